"""The PyTorch references for benchmarks/bench.py, trained on the same shapes as jaxlm: HF transformers' GPT-2
(eager or torch.compile) and nanoGPT's GPT with its train.py defaults (`nanogpt`), the peer of the small CPU recipe
as its authors run it (eager: their CPU command passes --compile=False).

One train step is what jaxlm's step does: forward, token cross-entropy, backward, global-norm clipping at 1.0 and an
AdamW update. `torch.compile` compiles the forward + loss + backward (AOTAutograd); the optimizer step runs eagerly,
as in most torch training code. Imported by the benchmark scripts only, so the jaxlm package never imports torch.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np


def available(platform: str = "cpu") -> str | None:
  """None when torch and transformers import (with CUDA when JAX runs on a GPU), else the reason they do not."""
  try:
    import torch
    import transformers  # noqa: F401
  except ImportError as error:  # the `hf` extra is not installed (e.g. a GPU image without torch)
    return f"torch/transformers not importable: {error}"
  if platform == "gpu" and not torch.cuda.is_available():  # the CPU wheel: a GPU-sized model on the CPU takes hours
    return f"torch {torch.__version__} has no CUDA"
  return None


def device_and_dtype(platform: str):
  import torch
  if platform == "gpu" and torch.cuda.is_available():
    return "cuda", torch.bfloat16
  return "cpu", torch.float32


def nanogpt(model_config, seq_len: int, bias: bool = False):
  """nanoGPT's GPT (karpathy/nanoGPT, model.py) of `model_config`'s shape, computing what its model.py computes with
  the defaults of its train.py (`bias=False`, dropout 0): LayerNorms by F.layer_norm with an optional bias, one fused
  q/k/v Linear, F.scaled_dot_product_attention(is_causal=True), exact GELU (nn.GELU), dropout modules at p=0, a
  bias-free lm_head tied to the token table, logits for every position and F.cross_entropy(ignore_index=-1); init
  N(0, 0.02) with the residual projections at 0.02 / sqrt(2 L). Written here because nanoGPT is not a package."""
  import torch
  from torch import nn
  from torch.nn import functional as F

  m = model_config

  class LayerNorm(nn.Module):
    def __init__(self):
      super().__init__()
      self.weight = nn.Parameter(torch.ones(m.d_model))
      self.bias = nn.Parameter(torch.zeros(m.d_model)) if bias else None

    def forward(self, x):
      return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)

  class Attention(nn.Module):
    def __init__(self):
      super().__init__()
      self.c_attn = nn.Linear(m.d_model, 3 * m.d_model, bias=bias)
      self.c_proj = nn.Linear(m.d_model, m.d_model, bias=bias)
      self.resid_dropout = nn.Dropout(0.0)

    def forward(self, x):
      b, t, d = x.size()
      q, k, v = self.c_attn(x).split(d, dim=2)
      q, k, v = (y.view(b, t, m.num_heads, d // m.num_heads).transpose(1, 2) for y in (q, k, v))
      y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
      return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d)))

  class MLP(nn.Module):
    def __init__(self):
      super().__init__()
      self.c_fc = nn.Linear(m.d_model, 4 * m.d_model, bias=bias)
      self.gelu = nn.GELU()
      self.c_proj = nn.Linear(4 * m.d_model, m.d_model, bias=bias)
      self.dropout = nn.Dropout(0.0)

    def forward(self, x):
      return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))

  class Block(nn.Module):
    def __init__(self):
      super().__init__()
      self.ln_1, self.attn, self.ln_2, self.mlp = LayerNorm(), Attention(), LayerNorm(), MLP()

    def forward(self, x):
      x = x + self.attn(self.ln_1(x))
      return x + self.mlp(self.ln_2(x))

  class GPT(nn.Module):
    def __init__(self):
      super().__init__()
      self.transformer = nn.ModuleDict(dict(
          wte=nn.Embedding(m.vocab_size, m.d_model), wpe=nn.Embedding(seq_len, m.d_model), drop=nn.Dropout(0.0),
          h=nn.ModuleList(Block() for _ in range(m.num_layers)), ln_f=LayerNorm()))
      self.lm_head = nn.Linear(m.d_model, m.vocab_size, bias=False)
      self.transformer.wte.weight = self.lm_head.weight
      for module in self.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
          nn.init.normal_(module.weight, std=0.02)
          if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
      for name, p in self.named_parameters():
        if name.endswith("c_proj.weight"):
          nn.init.normal_(p, std=0.02 / math.sqrt(2 * m.num_layers))

    def forward(self, idx, targets):
      pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
      x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
      for block in self.transformer.h:
        x = block(x)
      logits = self.lm_head(self.transformer.ln_f(x))
      return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

  return GPT()


def nanogpt_optimizer(model, learning_rate: float, b2: float, weight_decay: float = 0.1):
  """nanoGPT's configure_optimizers: AdamW with weight decay on the 2-D parameters only (fused on CUDA)."""
  import torch
  params = [p for p in model.parameters() if p.requires_grad]
  groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
  fused = next(model.parameters()).is_cuda
  return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, b2), fused=fused)


class TorchGPT2Step:
  """One GPT-2 train step on fixed tokens [B, T+1]; `mode` is `eager` or `compile`; `implementation` is `hf`
  (transformers' GPT2LMHeadModel) or `nanogpt` (`nanogpt`, with nanoGPT's optimizer groups)."""

  def __init__(self, model_config, tokens: np.ndarray, mode: str, platform: str, implementation: str = "hf",
               learning_rate: float = 1e-4, b2: float = 0.95):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(os.cpu_count() or 1)  # both cores, as XLA's CPU thread pool uses
    torch.manual_seed(0)
    self.torch = torch
    self.device, self.autocast_dtype = device_and_dtype(platform)
    m = model_config
    config = GPT2Config(vocab_size=m.vocab_size, n_positions=tokens.shape[1] - 1, n_embd=m.d_model,
                        n_layer=m.num_layers, n_head=m.num_heads, n_inner=m.mlp_width,
                        layer_norm_epsilon=m.layer_norm_eps,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no dropout: jaxlm has none
                        bos_token_id=m.vocab_size - 1, eos_token_id=m.vocab_size - 1)  # inside the vocabulary
    if implementation == "nanogpt":
      self.model = nanogpt(m, tokens.shape[1] - 1).to(self.device).train()
      self.attention = "sdpa"
      self.optimizer = nanogpt_optimizer(self.model, learning_rate, b2)
    else:
      self.model = GPT2LMHeadModel(config).to(self.device).train()
      self.attention = self.model.config._attn_implementation  # HF's default: sdpa
      self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=learning_rate, betas=(0.9, b2), weight_decay=0.1)
    self.hf = implementation == "hf"
    ids = torch.from_numpy(tokens.astype(np.int64)).to(self.device)
    self.inputs, self.targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    self.vocab_size = m.vocab_size
    self.forward_backward = torch.compile(self._forward_backward) if mode == "compile" else self._forward_backward
    self.compile_seconds = None
    if mode == "compile":  # the first two calls compile (forward+backward graphs, then a recompile-free re-run)
      started = time.perf_counter()
      self.run(2)
      self.compile_seconds = time.perf_counter() - started

  def _forward_backward(self, inputs, targets):
    with self.torch.autocast(self.device, dtype=self.autocast_dtype, enabled=self.device == "cuda"):
      if not self.hf:  # nanoGPT computes its loss inside the model, as its train.py calls it
        loss = self.model(inputs, targets)[1]
        loss.backward()
        return loss
      logits = self.model(inputs).logits
    loss = self.torch.nn.functional.cross_entropy(logits.float().view(-1, self.vocab_size), targets.view(-1))
    loss.backward()
    return loss

  def step(self):
    self.optimizer.zero_grad(set_to_none=True)
    loss = self.forward_backward(self.inputs, self.targets)
    self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
    self.optimizer.step()
    return loss.detach()

  def run(self, steps: int) -> float:
    """Seconds per step over `steps` consecutive steps (the loss of the last is read, so the device has finished)."""
    started = time.perf_counter()
    for _ in range(steps):
      loss = self.step()
    loss_value = float(loss)
    if not math.isfinite(loss_value):
      raise FloatingPointError(f"torch GPT-2 loss is {loss_value}")
    return (time.perf_counter() - started) / steps

  def memory(self) -> dict:
    if self.device == "cuda":
      return {"peak_bytes": int(self.torch.cuda.max_memory_allocated())}
    return {}  # the CPU allocator keeps no statistics


def matmul_flops(n: int, platform: str, repeats: int = 5) -> float:
  """FLOP/s of the best of `repeats` n^3 matmuls in torch (MKL on the CPU), as telemetry.measure_matmul_flops."""
  import torch
  device, dtype = device_and_dtype(platform)
  torch.set_num_threads(os.cpu_count() or 1)
  a = torch.randn(n, n, device=device, dtype=dtype)
  b = torch.randn(n, n, device=device, dtype=dtype)
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  for _ in range(2):
    a @ b
  sync()
  best = math.inf
  for _ in range(repeats):
    started = time.perf_counter()
    a @ b
    sync()
    best = min(best, time.perf_counter() - started)
  return 2.0 * n**3 / best
