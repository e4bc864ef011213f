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
from jaxlm.interop import hf_encoders, hf_rules
from jaxlm.adapters import lora
from jaxlm.parallel import sharding
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


def _rules(model: nnx.Module) -> tuple[list[tuple[str, str, hf_rules.Rule]], str]:
  """(HF prefix, jaxlm prefix, rule) for every parameter of `model`, and the HF base-model prefix."""
  c = model.config
  if isinstance(model, GPT) and c.flavour == "gpt2":
    base, prefix, jax_prefix = hf_rules.gpt2_rules(c), "transformer.", ""
  elif isinstance(model, GPT):
    base, prefix, jax_prefix = hf_rules.llama_rules(c), "model.", ""
  else:  # the encoders' tables
    return hf_encoders.rules(model)
  return [(prefix, jax_prefix, r) for r in base] + [("", "", r) for r in hf_rules.decoder_head_rules(model)], prefix


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

  def read(hf_prefix: str, rule: hf_rules.Rule, paths: list[str], j: int, layer: int | None = None) -> np.ndarray:
    """The parameter, or one layer of a stacked one; the files are unmapped after (the pages leave the process)."""
    try:
      if not rule.per_layer:  # the tensor itself when it needs no cast: no second copy
        hf = weights.read(hf_prefix + rule.hf, rule.shape)
        return hf_rules.to_jax(rule, hf, [shapes[p] for p in paths])[j].astype(DTYPES[param_dtype], copy=False)
      out = np.empty(shapes[paths[j]][0 if layer is None else 1:], DTYPES[param_dtype])
      lead = 2 if rule.per_expert else 1  # the stacked axes each HF tensor fills one entry of: layer (and expert)
      for i in [layer] if layer is not None else range(abstract.config.num_layers):
        for e in range(abstract.config.num_experts) if rule.per_expert else [None]:
          at = (() if layer is not None else (i,)) + (() if e is None else (e,))
          if i == 0 and rule.first_layer_fill is not None:
            out[at or ...] = rule.first_layer_fill
            continue
          hf = weights.read(hf_prefix + rule.hf.format(i=i, e=e), rule.shape)
          out[at or ...] = hf_rules.to_jax(rule, hf, [shapes[p][lead:] for p in paths])[j]  # as astype
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
          out = hf_rules.to_hf(rule, [layer(v, h, i) if e is None else h[i][e] for v, h in zip(values, hosts)])
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
