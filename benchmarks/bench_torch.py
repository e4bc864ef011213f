"""The PyTorch references for benchmarks/bench.py, trained on the same shapes as jaxlm: HF transformers' GPT-2
(eager or torch.compile) and a minimal GPT-2 written in plain PyTorch the way nanoGPT writes it (`MinimalGPT`: fused
q/k/v Linear, SDPA with is_causal, tanh GELU, tied head), the leaner eager peer for small models.

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


def minimal_gpt(model_config, seq_len: int):
  """A GPT-2 of `model_config`'s shape in plain PyTorch, as nanoGPT's model.py writes one (no dropout): token and
  position embeddings, pre-LayerNorm blocks, a tied output head."""
  import torch
  from torch import nn
  from torch.nn import functional as F

  m = model_config

  class Block(nn.Module):
    def __init__(self):
      super().__init__()
      self.ln_1 = nn.LayerNorm(m.d_model, eps=m.layer_norm_eps)
      self.ln_2 = nn.LayerNorm(m.d_model, eps=m.layer_norm_eps)
      self.c_attn, self.c_proj = nn.Linear(m.d_model, 3 * m.d_model), nn.Linear(m.d_model, m.d_model)
      self.c_fc, self.mlp_proj = nn.Linear(m.d_model, m.mlp_width), nn.Linear(m.mlp_width, m.d_model)

    def forward(self, x):
      b, t, d = x.shape
      q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
      q, k, v = (y.view(b, t, m.num_heads, d // m.num_heads).transpose(1, 2) for y in (q, k, v))
      y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
      x = x + self.c_proj(y)
      return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

  class GPT(nn.Module):
    def __init__(self):
      super().__init__()
      self.wte, self.wpe = nn.Embedding(m.vocab_size, m.d_model), nn.Embedding(seq_len, m.d_model)
      self.blocks = nn.ModuleList(Block() for _ in range(m.num_layers))
      self.ln_f = nn.LayerNorm(m.d_model, eps=m.layer_norm_eps)

    def forward(self, ids):
      x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
      for block in self.blocks:
        x = block(x)
      return self.ln_f(x) @ self.wte.weight.T  # the tied head

  model = GPT()
  for name, p in model.named_parameters():  # GPT-2's init, as nanoGPT does it
    if p.dim() > 1:
      nn.init.normal_(p, std=0.02)
    elif name.endswith("bias"):
      nn.init.zeros_(p)
  return model


class TorchGPT2Step:
  """One GPT-2 train step on fixed tokens [B, T+1]; `mode` is `eager` or `compile`; `implementation` is `hf`
  (transformers' GPT2LMHeadModel) or `minimal` (`minimal_gpt`)."""

  def __init__(self, model_config, tokens: np.ndarray, mode: str, platform: str, implementation: str = "hf"):
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
    if implementation == "minimal":
      self.model = minimal_gpt(m, tokens.shape[1] - 1).to(self.device).train()
      self.attention = "sdpa"
    else:
      self.model = GPT2LMHeadModel(config).to(self.device).train()
      self.attention = self.model.config._attn_implementation  # HF's default: sdpa
    self.hf = implementation == "hf"
    self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
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
      logits = self.model(inputs).logits if self.hf else self.model(inputs)
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
