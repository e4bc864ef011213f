"""HF checkpoint folders (config.json + safetensors) <-> jaxlm models, for GPT-2, the BERT-style encoders (BERT,
RoBERTa, XLM-RoBERTa, DistilBERT, ModernBERT: their tables are in hf_encoders.py) and the Llama-shaped decoders
(Llama, Mixtral, Qwen3, Qwen3-MoE, OLMoE).

  model = hf.from_pretrained("path/to/folder")             # GPT (gpt2 or llama flavour) or a BERT model
  model = hf.from_pretrained(folder, mesh=mesh)            # each tensor straight onto its NamedSharding
  hf.save_pretrained(model, "out/")                        # transformers' from_pretrained loads it

Only safetensors are read (with `safetensors.numpy`): nothing is unpickled, torch is not needed, and no remote code
is ever run. Each architecture is one table of rules below: HF tensor names and shapes <-> jaxlm parameter paths, and
a pure reshape/transpose between them, so a jaxlm -> HF -> jaxlm round trip is bit-identical. Loading with a mesh
builds the abstract model, computes shardings with `jaxlm.parallel.sharding.param_shardings`, and places every parameter
with `jax.make_array_from_callback`: each device receives only its shard, and the host holds one parameter (stacked over
layers) at a time. Saving writes one HF tensor at a time (LoRA weights merged, layer by layer), so neither the host
nor a device ever holds the whole float model. config.json's side is jaxlm/interop/hf_config.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import struct
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import Mesh
from safetensors import safe_open

from jaxlm.interop import hf_config as hf_config_lib
from jaxlm.interop import hf_decoders
from jaxlm.interop import hf_encoders
from jaxlm.adapters import lora
from jaxlm.parallel import sharding
from jaxlm.config import ModelConfig
from jaxlm.models.gpt import GPT
from jaxlm.models.precision import DTYPES

_flat = lambda tree: traverse_util.flatten_dict(tree, sep="/")  # {"a/b/c": leaf}
_nested = lambda flat: traverse_util.unflatten_dict(flat, sep="/")

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Buffers some checkpoints carry that are not parameters (masks, rotary tables, position ids, tied copies).
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq", "embeddings.position_ids",
                    "cls.predictions.decoder.weight", "cls.predictions.decoder.bias")


# ----------------------------------------------------------------------------------------------- the tables


@dataclasses.dataclass(frozen=True)
class Rule:
  """HF tensors (name, shape) <-> jaxlm parameters. `{i}` in a name is the layer; those rules fill the stacked
  `blocks/...` parameters one layer at a time. `kind`: copy (reshape only, incl. GPT-2's Conv1D [in, out]),
  linear (nn.Linear [out, in]: transpose, then reshape), fused (GPT-2's c_attn: split/join q, k, v on the last axis),
  fused_linear (an nn.Linear holding several: Phi-3's qkv_proj and gate_up_proj, split/joined on the out axis)."""
  kind: str
  hf: str  # HF tensor name
  shape: tuple[int, ...]  # its shape, as config.json implies
  jax: tuple[str, ...]  # jaxlm parameter paths ("a/b/c")
  first_layer_fill: float | None = None  # a number: layer 0 has no HF tensor and holds this value (ModernBERT's
                                         # first attention norm, an Identity in HF)

  @property
  def per_layer(self) -> bool:
    return "{i}" in self.hf

  @property
  def per_expert(self) -> bool:
    """`{e}` in the name: one HF tensor per expert of each layer fills the [L, E, ...] parameter."""
    return "{e}" in self.hf


def _r(kind: str, hf_name: str, hf_shape: tuple[int, ...], *jax_paths: str) -> Rule:
  return Rule(kind, hf_name, hf_shape, jax_paths)


def _to_jax(rule: Rule, hf: np.ndarray, shapes: list[tuple]) -> list[np.ndarray]:
  if rule.kind == "copy":
    return [hf.reshape(shapes[0])]
  if rule.kind == "linear":
    return [hf.T.reshape(shapes[0])]
  joined = hf.T if rule.kind == "fused_linear" else hf
  # Each part's width on the joined last axis: its size over the size of the other (leading) axes.
  widths = [math.prod(s) // math.prod(joined.shape[:-1]) for s in shapes]
  parts = np.split(joined, np.cumsum(widths)[:-1], axis=-1)
  return [part.reshape(s) for part, s in zip(parts, shapes)]


def _to_hf(rule: Rule, arrays: list[np.ndarray]) -> np.ndarray:
  if rule.kind == "copy":
    return arrays[0].reshape(rule.shape)
  if rule.kind == "linear":
    return arrays[0].reshape(rule.shape[::-1]).T
  if rule.kind == "fused_linear":
    return np.concatenate([a.reshape(rule.shape[1:] + (-1,)) for a in arrays], axis=-1).T
  return np.concatenate([a.reshape(rule.shape[:-1] + (-1,)) for a in arrays], axis=-1)


def _gpt2_rules(c: ModelConfig) -> list[Rule]:
  d, f, v = c.d_model, c.mlp_width, c.vocab_size
  rules = [_r("copy", "wte.weight", (v, d), "token_embed/embedding"),
           _r("copy", "wpe.weight", (c.max_seq_len, d), "position_embed/embedding"),
           _r("copy", "ln_f.weight", (d,), "final_norm/scale"), _r("copy", "ln_f.bias", (d,), "final_norm/bias")]
  layer = [("ln_1.weight", (d,), "attn_norm/scale"), ("ln_1.bias", (d,), "attn_norm/bias"),
           ("attn.c_proj.weight", (d, d), "attn/w_o"), ("attn.c_proj.bias", (d,), "attn/b_o"),
           ("ln_2.weight", (d,), "mlp_norm/scale"), ("ln_2.bias", (d,), "mlp_norm/bias"),
           ("mlp.c_fc.weight", (d, f), "mlp/w_in"), ("mlp.c_fc.bias", (f,), "mlp/b_in"),
           ("mlp.c_proj.weight", (f, d), "mlp/w_out"), ("mlp.c_proj.bias", (d,), "mlp/b_out")]
  rules += [_r("copy", f"h.{{i}}.{name}", shape, f"blocks/{path}") for name, shape, path in layer]
  rules += [_r("fused", "h.{i}.attn.c_attn.weight", (d, 3 * d), *(f"blocks/attn/w_{x}" for x in "qkv")),
            _r("fused", "h.{i}.attn.c_attn.bias", (3 * d,), *(f"blocks/attn/b_{x}" for x in "qkv"))]
  return rules


def _llama_rules(c: ModelConfig) -> list[Rule]:
  d, f, v = c.d_model, c.mlp_width, c.vocab_size
  qd, kvd = c.num_heads * c.head_dim, (c.num_kv_heads or c.num_heads) * c.head_dim
  rules = [_r("copy", "embed_tokens.weight", (v, d), "token_embed/embedding"),
           _r("copy", "norm.weight", (d,), "final_norm/scale")]
  norms = {"pre": [("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")],
           "sandwich": [("input_layernorm", "attn_norm"), ("post_attention_layernorm", "attn_post_norm"),
                        ("pre_feedforward_layernorm", "mlp_norm"), ("post_feedforward_layernorm", "mlp_post_norm")],
           "post": [("post_attention_layernorm", "attn_post_norm"),
                    ("post_feedforward_layernorm", "mlp_post_norm")]}[c.block_norms]
  layer = [("copy", f"{hf_name}.weight", (d,), f"{path}/scale") for hf_name, path in norms]
  layer += [("linear", "self_attn.q_proj.weight", (qd, d), "attn/w_q"),
            ("linear", "self_attn.k_proj.weight", (kvd, d), "attn/w_k"),
            ("linear", "self_attn.v_proj.weight", (kvd, d), "attn/w_v"),
            ("linear", "self_attn.o_proj.weight", (d, qd), "attn/w_o"),
            ("linear", "mlp.gate_proj.weight", (f, d), "mlp/w_gate"),
            ("linear", "mlp.up_proj.weight", (f, d), "mlp/w_up"),
            ("linear", "mlp.down_proj.weight", (d, f), "mlp/w_down")]
  if c.num_experts:  # a router and one MLP per expert (transformers saves them one tensor each)
    f = c.expert_width
    if hf_decoders.hf_family(c) == "mixtral":
      router, gate, up, down = ("block_sparse_moe.gate", *(f"block_sparse_moe.experts.{{e}}.{w}" for w in
                                                           ("w1", "w3", "w2")))
    else:  # Qwen3-MoE, OLMoE
      router, gate, up, down = ("mlp.gate", *(f"mlp.experts.{{e}}.{w}_proj" for w in ("gate", "up", "down")))
    layer[-3:] = [("linear", f"{router}.weight", (c.num_experts, d), "mlp/w_router"),
                  ("linear", f"{gate}.weight", (f, d), "mlp/w_gate"),
                  ("linear", f"{up}.weight", (f, d), "mlp/w_up"),
                  ("linear", f"{down}.weight", (d, f), "mlp/w_down")]
  if c.qkv_bias:  # Qwen2
    layer += [("copy", "self_attn.q_proj.bias", (qd,), "attn/b_q"),
              ("copy", "self_attn.k_proj.bias", (kvd,), "attn/b_k"),
              ("copy", "self_attn.v_proj.bias", (kvd,), "attn/b_v")]
  if c.qk_norm:  # Qwen3: one scale per head dimension; OLMoE: one per element of all heads
    q_size, k_size = (c.head_dim, c.head_dim) if c.qk_norm == "head" else (qd, kvd)
    layer += [("copy", "self_attn.q_norm.weight", (q_size,), "attn/q_norm"),
              ("copy", "self_attn.k_norm.weight", (k_size,), "attn/k_norm")]
  rules += [_r(kind, f"layers.{{i}}.{name}", shape, f"blocks/{path}") for kind, name, shape, path in layer]
  if hf_decoders.hf_family(c) == "phi3":  # q, k, v and gate, up each one nn.Linear
    fused = {"attn/w_q": ("self_attn.qkv_proj.weight", (qd + 2 * kvd, d), ("attn/w_q", "attn/w_k", "attn/w_v")),
             "mlp/w_gate": ("mlp.gate_up_proj.weight", (2 * f, d), ("mlp/w_gate", "mlp/w_up"))}
    parts = {p for _, _, paths in fused.values() for p in paths}
    rules = [r for r in rules if r.jax[0].removeprefix("blocks/") not in parts]
    rules += [Rule("fused_linear", f"layers.{{i}}.{name}", shape, tuple(f"blocks/{p}" for p in paths))
              for name, shape, paths in fused.values()]
  return rules


def _head_rules(model: GPT) -> list[Rule]:
  """Rules outside the base model's prefix (HF names without `transformer.` / `model.`)."""
  c = model.config
  return [] if c.tie_embeddings else [_r("copy", "lm_head.weight", (c.vocab_size, c.d_model), "lm_head/embedding")]


def _rules(model: nnx.Module) -> tuple[list[tuple[str, str, Rule]], str]:
  """(HF prefix, jaxlm prefix, rule) for every parameter of `model`, and the HF base-model prefix."""
  c = model.config
  if isinstance(model, GPT) and c.flavour == "gpt2":
    base, prefix, jax_prefix = _gpt2_rules(c), "transformer.", ""
  elif isinstance(model, GPT):
    base, prefix, jax_prefix = _llama_rules(c), "model.", ""
  else:  # the encoders' tables
    return hf_encoders.rules(model)
  return [(prefix, jax_prefix, r) for r in base] + [("", "", r) for r in _head_rules(model)], prefix


# ----------------------------------------------------------------------------------------------- load and save


class _Weights:
  """The folder's safetensors files, opened lazily (memory-mapped); refuses pickle-only checkpoints."""

  def __init__(self, folder: str):
    self.folder = folder
    index = os.path.join(folder, INDEX)
    if os.path.exists(index):
      with open(index) as f:
        self.file_of = {k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()}
    elif os.path.exists(os.path.join(folder, WEIGHTS)):
      with safe_open(os.path.join(folder, WEIGHTS), framework="numpy") as f:
        self.file_of = {k: os.path.join(folder, WEIGHTS) for k in f.keys()}
    else:
      pickles = sorted(n for n in os.listdir(folder) if n.endswith(PICKLE_SUFFIXES))
      if pickles:
        raise ValueError(f"{os.path.join(folder, pickles[0])} is a pickle checkpoint and there is no {WEIGHTS}; "
                         "jaxlm never unpickles weights: convert it where you trust it (transformers "
                         "save_pretrained(..., safe_serialization=True))")
      raise ValueError(f"{folder}: no {WEIGHTS} or {INDEX}; an HF checkpoint folder needs its weights as safetensors")
    self.handles: dict[str, Any] = {}
    self.used: set[str] = set()

  def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in self.file_of and name == "cls.predictions.bias":
      name = "cls.predictions.decoder.bias"  # some BERT checkpoints keep only the decoder's copy of the bias
    if name not in self.file_of:
      raise ValueError(f"{self.folder}: weights lack tensor {name!r} that config.json implies")
    path = self.file_of[name]
    if path not in self.handles:
      self.handles[path] = safe_open(path, framework="numpy")
    array = self.handles[path].get_tensor(name)
    if tuple(array.shape) != tuple(shape):
      raise ValueError(f"{path}: tensor {name!r} has shape {tuple(array.shape)} but config.json implies {shape}")
    if not np.issubdtype(array.dtype, np.floating) and array.dtype.name != "bfloat16":
      raise ValueError(f"{path}: tensor {name!r} has dtype {array.dtype}, expected floating point weights")
    self.used.add(name)
    return array


def from_pretrained(folder: str, *, mesh: Mesh | None = None, compute_dtype: str = "float32",
                    param_dtype: str = "float32") -> nnx.Module:
  """The jaxlm model (GPT, Bert, BertForMaskedLM or BertForSequenceClassification) of an HF checkpoint folder
  (config.json + safetensors) of GPT-2, Llama or BERT: with `mesh`, each parameter made directly in its sharding
  (`jaxlm.parallel.sharding.RULES`), else on the default device; one parameter on the host at a time."""
  abstract, readers, weights = lazy_pretrained(folder, compute_dtype, param_dtype)
  graphdef, abstract_state = nnx.split(abstract)
  shardings = _flat(sharding.param_shardings(abstract_state, mesh)) if mesh is not None else {}
  values = {path: _place(read(), shardings.get(path)) for path, read in readers.items()}
  unused = sorted(n for n in set(weights.file_of) - weights.used if not n.endswith(IGNORED_SUFFIXES))
  if unused:
    logging.getLogger(__name__).warning("%s: %d tensors not used, e.g. %s", folder, len(unused), unused[0])
  abstract_state.replace_by_pure_dict(_nested(values))
  return nnx.merge(graphdef, abstract_state)


def lazy_pretrained(folder: str, compute_dtype: str = "float32", param_dtype: str = "float32"
                    ) -> tuple[nnx.Module, dict[str, Callable[[], np.ndarray]], _Weights]:
  """(abstract model, {parameter path: read(layer=None) -> its host array in `param_dtype`}, the weights) of an HF
  folder: each read holds one parameter (stacked over layers, or its `layer`) and one HF tensor, then unmaps."""
  where = os.path.join(folder, "config.json")
  if not os.path.exists(where):
    raise ValueError(f"{where} not found: from_pretrained needs an HF checkpoint folder (config.json + safetensors)")
  with open(where) as f:
    hf_config = json.load(f)
  weights = _Weights(folder)
  make = hf_config_lib.model_from_hf_config(hf_config, where, set(weights.file_of), compute_dtype, param_dtype)
  abstract = nnx.eval_shape(lambda: make(nnx.Rngs(0)))
  shapes = {k: v.shape for k, v in _flat(nnx.split(abstract)[1].to_pure_dict()).items()}
  rules, base_prefix = _rules(abstract)
  # Checkpoints of a bare base model (GPT2Model, LlamaModel, BertModel) have no `transformer.` / `model.` prefix.
  first = rules[0][2].hf
  if base_prefix and base_prefix + first not in weights.file_of and first in weights.file_of:
    rules = [("" if p == base_prefix else p, jp, r) for p, jp, r in rules]

  def read(hf_prefix: str, rule: Rule, paths: list[str], j: int, layer: int | None = None) -> np.ndarray:
    """The parameter, or one layer of a stacked one; the files are unmapped after (the pages leave the process)."""
    try:
      if not rule.per_layer:  # the tensor itself when it needs no cast: no second copy
        hf = weights.read(hf_prefix + rule.hf, rule.shape)
        return _to_jax(rule, hf, [shapes[p] for p in paths])[j].astype(DTYPES[param_dtype], copy=False)
      out = np.empty(shapes[paths[j]][0 if layer is None else 1:], DTYPES[param_dtype])
      lead = 2 if rule.per_expert else 1  # the stacked axes each HF tensor fills one entry of: layer (and expert)
      for i in [layer] if layer is not None else range(abstract.config.num_layers):
        for e in range(abstract.config.num_experts) if rule.per_expert else [None]:
          at = (() if layer is not None else (i,)) + (() if e is None else (e,))
          if i == 0 and rule.first_layer_fill is not None:
            out[at or ...] = rule.first_layer_fill
            continue
          hf = weights.read(hf_prefix + rule.hf.format(i=i, e=e), rule.shape)
          out[at or ...] = _to_jax(rule, hf, [shapes[p][lead:] for p in paths])[j]  # as astype
      return out
    finally:
      weights.handles.clear()

  readers = {path: functools.partial(read, hf_prefix, rule, [jax_prefix + p for p in rule.jax], j)
             for hf_prefix, jax_prefix, rule in rules for j, path in enumerate(jax_prefix + p for p in rule.jax)}
  assert set(readers) == set(shapes), f"jaxlm.interop.hf_weights's tables miss {sorted(set(shapes) - set(readers))[:1]}"
  return abstract, readers, weights


def _place(host: np.ndarray, target: jax.sharding.Sharding | None) -> jax.Array:
  if target is None:
    return jax.device_put(host)
  # Each addressable device copies only its slice of the host array.
  return jax.make_array_from_callback(host.shape, target, lambda index: host[index])


def _to_host(x: jax.Array) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:  # multi-process: gather the shards of other hosts
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


@jax.jit
def _merged_layer(value: lora.LoRAWeight, i: jax.Array) -> jax.Array:
  """Layer i of W + scale * A B: lora.merge's values up to float32 rounding (its batched A B may round otherwise)."""
  return lora.merge({"w": jax.tree.map(lambda x: x[i], value)})["w"]


def _hf_tensors(model: nnx.Module) -> tuple[list[tuple[str, tuple, np.dtype]], Callable[[], Iterator[np.ndarray]]]:
  """([(HF name, shape, dtype)], a generator of those tensors in that order, each computed when asked for)."""
  flat = _flat(nnx.state(model, nnx.Param).to_pure_dict())
  rules, _ = _rules(model)
  used = {jax_prefix + p for _, jax_prefix, rule in rules for p in rule.jax}
  if set(flat) - used:
    raise ValueError(f"parameter {sorted(set(flat) - used)[0]} has no HF counterpart; cannot save this model")
  layers = lambda rule: range(rule.first_layer_fill is not None, model.config.num_layers) if rule.per_layer else [None]
  merged_dtype = lambda v: jnp.float32 if isinstance(v, lora.LoRAWeight) else v.dtype  # lora.merge's
  experts = lambda rule: range(model.config.num_experts) if rule.per_expert else [None]
  entries = [(hf_prefix + rule.hf.format(i=i, e=e), rule.shape,
              np.dtype(jnp.result_type(*(merged_dtype(flat[jax_prefix + p]) for p in rule.jax))))
             for hf_prefix, jax_prefix, rule in rules for i in layers(rule) for e in experts(rule)]

  def layer(value, host: np.ndarray | None, i: int | None) -> np.ndarray:
    if host is not None:  # a plain parameter: read to the host once per rule
      return host if i is None else host[i]
    return _to_host(lora.merge({"w": value})["w"] if i is None else _merged_layer(value, jnp.int32(i)))

  def tensors() -> Iterator[np.ndarray]:
    for _, jax_prefix, rule in rules:
      values = [flat[jax_prefix + p] for p in rule.jax]
      hosts = [None if isinstance(v, lora.LoRAWeight) else _to_host(v) for v in values]
      for i in layers(rule):
        for e in experts(rule):  # expert weights are never LoRA-adapted: plain host arrays
          out = _to_hf(rule, [layer(v, h, i) if e is None else h[i][e] for v, h in zip(values, hosts)])
          if out.shape != rule.shape:
            raise ValueError(f"parameter {rule.jax[0]} gives HF tensor {rule.hf} of shape {out.shape}, not "
                             f"{rule.shape}")
          yield out
  return entries, tensors


def _write_safetensors(path: str, entries: list[tuple[str, tuple, np.dtype]], tensors: Iterator[np.ndarray],
                      metadata: dict | None = None) -> None:
  """A safetensors file written tensor by tensor: the header (names, shapes, dtypes, offsets) first, then each
  tensor's bytes as `tensors` yields it, so only one tensor is ever in memory (safetensors' own `save_file` takes
  them all at once)."""
  header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
  offset = 0
  for name, shape, dtype in entries:
    size = math.prod(shape) * np.dtype(dtype).itemsize
    header[name] = {"dtype": SAFETENSORS_DTYPES[np.dtype(dtype).name], "shape": list(shape),
                    "data_offsets": [offset, offset + size]}
    offset += size
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors' own writer pads
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)) + blob)
    for (name, shape, dtype), array in zip(entries, tensors, strict=True):
      if tuple(array.shape) != tuple(shape) or array.dtype != np.dtype(dtype):
        raise AssertionError(f"tensor {name}: {array.dtype}{list(array.shape)}, the header says {dtype}{list(shape)}")
      f.write(np.ascontiguousarray(array).tobytes())  # little-endian hosts, as safetensors


def save_pretrained(model: nnx.Module, folder: str) -> None:
  """config.json and model.safetensors that transformers' `from_pretrained` loads (process 0 writes; every process
  joins the gathers), one tensor at a time; LoRA weights are written merged (W + alpha/r A B, in f32)."""
  hf_config = hf_config_lib.hf_config(model)
  entries, tensors = _hf_tensors(model)
  if jax.process_index() != 0:
    for _ in tensors():
      pass
    return
  os.makedirs(folder, exist_ok=True)
  _write_safetensors(os.path.join(folder, WEIGHTS), entries, tensors(), metadata={"format": "pt"})
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
