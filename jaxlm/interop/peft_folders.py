"""LoRA adapters in and out as PEFT folders, and merging them into the base weights.

  peft_io.save_adapters(model, "out/adapter")           # a LoRA model (LoRAWeight values) -> a PEFT LoRA folder
  peft_io.save_adapters(model, "out/adapter", use_rslora=True)  # the same scale, written as rsLoRA's alpha / sqrt(r)
  adapters = peft_io.read_adapters("out/adapter", model)  # -> trainable tree, scale, targets (bit-identical)
  model = peft_io.from_pretrained(base_folder, adapter_folder)  # an HF base + a PEFT folder -> a jaxlm LoRA model
  merged = peft_io.merged_model(model); hf_weights.save_pretrained(merged, "out/merged")  # an ordinary HF checkpoint

The folder is what `peft.PeftModel.from_pretrained(hf_base_model, folder)` loads: adapter_config.json (peft_type
LORA, r, lora_alpha, use_rslora, the target modules by their full HF names, modules_to_save for a classifier head) and
adapter_model.safetensors (`base_model.model.<module>.lora_A.weight` [r, in], `lora_B.weight` [out, r]). HF module
names come from the tables of jaxlm/interop/hf_rules.py and hf_encoders.py. GPT-2 keeps q, k and v in one Conv1D
(c_attn): its three adapters are written as one of rank 3r (A stacked, B block-diagonal, alpha 3 alpha, or sqrt(3)
alpha for rsLoRA: the same update exactly) and split back on import; ModernBERT's Wqkv and Wi alike. Parts that
share one A (a fused module's adapter as peft trains it) are written back as that adapter. jaxlm keeps one scale per
model (lora.LoRAWeight.scale): lora_alpha / r, or lora_alpha / sqrt(r) for rsLoRA (use_rslora, peft's rank-stabilised
scaling), which reads and writes alike. Only safetensors are read; anything else (DoRA, biases, other peft types) is a
one-line error.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxlm.interop import hf_rules, hf_weights
from jaxlm.adapters import lora
from jaxlm.models.bert import Bert, BertForSequenceClassification
from jaxlm.models.gpt import GPT

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# PEFT's config has no field for a classifier's pooling: a mean-pooling head (model.classifier_pooling=mean) says so
# in this file beside it, which peft ignores (its BertForSequenceClassification pools [CLS]).
HEAD_FILE = "jaxlm_head.json"
PREFIX = "base_model.model."
# adapter_config.json keys whose non-default values change the function: jaxlm reads plain LoRA (and rsLoRA) only.
UNSUPPORTED = {"use_dora": False, "lora_bias": False, "bias": "none", "layers_to_transform": None,
               "layers_pattern": None, "layer_replication": None, "use_qalora": False, "target_parameters": None,
               "trainable_token_indices": None, "alora_invocation_tokens": None, "use_bdlora": None}


def _task_type(model: nnx.Module) -> str | None:
  if isinstance(model, GPT):
    return "CAUSAL_LM"
  if isinstance(model, BertForSequenceClassification):
    return "SEQ_CLS"
  return "FEATURE_EXTRACTION"


def _weight_modules(model: nnx.Module) -> dict[str, tuple[str, ...]]:
  """HF module name ("bert.encoder.layer.0.attention.self.query") -> (rule kind, jaxlm paths, layer) of every
  weight matmul jaxlm can adapt."""
  rules, _ = hf_weights._rules(model)
  modules = {}
  for hf_prefix, jax_prefix, rule in rules:
    paths = tuple(jax_prefix + p for p in rule.jax)
    if not rule.hf.endswith(".weight") or paths[0].rsplit("/", 1)[-1] not in lora.MATMUL_WEIGHTS:
      continue
    for i in range(model.config.num_layers) if rule.per_layer else [None]:
      modules[hf_prefix + rule.hf.format(i=i)[:-len(".weight")]] = (rule.kind, paths, i)
  return modules


def _head_modules(model: nnx.Module) -> dict[str, tuple[hf_rules.Rule, str]]:
  """HF tensor name -> (rule, jaxlm path) of the classification head trained whole (lora.HEAD_PREFIXES): peft's
  modules_to_save."""
  rules, _ = hf_weights._rules(model)
  return {hf_prefix + rule.hf: (rule, jax_prefix + rule.jax[0]) for hf_prefix, jax_prefix, rule in rules
          if (jax_prefix + rule.jax[0]).startswith(lora.HEAD_PREFIXES)}


def _split_io(value: np.ndarray, n_in: int) -> np.ndarray:
  return value.reshape(int(np.prod(value.shape[:n_in])), -1)


def _flat_params(model: nnx.Module) -> dict[str, Any]:
  return lora._flat(nnx.state(model, nnx.Param).to_pure_dict())


def _host(x) -> np.ndarray:
  return hf_weights._to_host(x)


# ----------------------------------------------------------------------------------------------- out


def save_adapters(model: nnx.Module, folder: str, base_model_name_or_path: str = "", use_rslora: bool = False
                  ) -> None:
  """Writes the adapters of `model` (a jaxlm model whose target weights are lora.LoRAWeights; a classifier's head is
  written as modules_to_save) as a PEFT LoRA folder. The scale is written as lora_alpha = scale * r, or with
  `use_rslora` (e.g. `read_config(folder)["use_rslora"]` of the folder it was read from) as rsLoRA's
  lora_alpha = scale * sqrt(r): peft computes the same scale from either. Process 0 writes."""
  params = _flat_params(model)
  adapted = {p: v for p, v in params.items() if isinstance(v, lora.LoRAWeight)}
  if not adapted:
    raise ValueError("this model has no LoRA adapters to export (train with lora.rank > 0)")
  scales = {float(s) for v in adapted.values() for s in np.ravel(_host(v.scale))}
  if len(scales) != 1:
    raise ValueError(f"the adapters have different scales {sorted(scales)}; PEFT's lora_alpha / r is one value here")
  scale = scales.pop()
  rank = next(iter(adapted.values())).a.shape[-1]
  tensors, rank_pattern, alpha_pattern, targets = {}, {}, {}, []
  host = {p: (_host(v.a), _host(v.b)) for p, v in adapted.items()}
  for module, (kind, paths, layer) in _weight_modules(model).items():
    present = [p in host for p in paths]
    if not any(present):
      continue
    if not all(present):  # GPT-2's c_attn
      raise ValueError(f"GPT-2's {module} holds {', '.join(paths)} in one matrix: target all of them or none "
                       f"(lora.targets)")
    pieces = []
    for path in paths:
      a, b = host[path]
      a, b = (a[layer], b[layer]) if layer is not None else (a, b)
      pieces.append((_split_io(a, a.ndim - 1).T, _split_io(b, 1).T))  # lora_A [r, in], lora_B [out, r]
    if len(pieces) == 1:
      lora_a, lora_b = pieces[0]
    elif all(np.array_equal(a, pieces[0][0]) for a, _ in pieces):  # one A shared by the parts (as peft trains it)
      lora_a, lora_b = pieces[0][0], np.concatenate([b for _, b in pieces], axis=0)
    else:
      lora_a = np.concatenate([a for a, _ in pieces], axis=0)
      lora_b = np.zeros((sum(b.shape[0] for _, b in pieces), lora_a.shape[0]), pieces[0][1].dtype)
      row = col = 0
      for a, b in pieces:
        lora_b[row:row + b.shape[0], col:col + a.shape[0]] = b
        row, col = row + b.shape[0], col + a.shape[0]
      short = module.rsplit(".", 1)[-1]
      rank_pattern[short] = lora_a.shape[0]
      alpha_pattern[short] = _number(scale * _scale_divisor(lora_a.shape[0], use_rslora))
    tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(lora_a)
    tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(lora_b)
    targets.append(module)
  modules_to_save = None
  if isinstance(model, BertForSequenceClassification):
    modules_to_save = ["classifier"]  # peft also matches the modules whose names end with it (pre_classifier)
    for name, (rule, path) in _head_modules(model).items():
      tensors[PREFIX + name] = np.ascontiguousarray(hf_rules.to_hf(rule, [_host(params[path])]))
  config = {
      "peft_type": "LORA", "task_type": _task_type(model), "r": int(rank),
      "lora_alpha": _number(scale * _scale_divisor(rank, use_rslora)),
      "target_modules": targets, "modules_to_save": modules_to_save, "rank_pattern": rank_pattern,
      "alpha_pattern": alpha_pattern, "fan_in_fan_out": isinstance(model, GPT) and model.config.flavour == "gpt2",
      "lora_dropout": 0.0, "bias": "none", "use_dora": False, "use_rslora": bool(use_rslora), "init_lora_weights": True,
      "inference_mode": True, "base_model_name_or_path": base_model_name_or_path or None,
  }
  if jax.process_index() == 0:
    os.makedirs(folder, exist_ok=True)
    save_file({k: np.asarray(v, np.float32) for k, v in tensors.items()}, os.path.join(folder, WEIGHTS),
              metadata={"format": "pt"})
    with open(os.path.join(folder, CONFIG), "w") as f:
      json.dump(config, f, indent=2)
    if isinstance(model, BertForSequenceClassification) and model.config.classifier_pooling == "mean":
      with open(os.path.join(folder, HEAD_FILE), "w") as f:
        json.dump({"classifier_pooling": "mean"}, f)


def _scale_divisor(rank: int, use_rslora: bool) -> float:
  """What peft divides lora_alpha by: r, or sqrt(r) with use_rslora (peft's LoraLayer.update_layer)."""
  return math.sqrt(rank) if use_rslora else rank


def _number(x: float) -> float | int:
  # An integer alpha comes back from the f32 scale within f32 precision (16 / sqrt(8) * sqrt(8) = 15.9999997).
  return int(round(x)) if abs(x - round(x)) < 1e-6 * max(1.0, abs(x)) else x


# ----------------------------------------------------------------------------------------------- in


def read_config(folder: str) -> dict:
  """adapter_config.json of a PEFT LoRA folder, checked for what jaxlm supports (one-line errors)."""
  path = os.path.join(folder, CONFIG)
  if not os.path.isfile(path):
    raise ValueError(f"{path} not found: a PEFT adapter folder needs adapter_config.json and {WEIGHTS}")
  with open(path) as f:
    config = json.load(f)
  if config.get("peft_type") != "LORA":
    raise ValueError(f"{path}: peft_type={config.get('peft_type')!r} is not supported; jaxlm reads LORA adapters")
  for key, plain in UNSUPPORTED.items():
    if config.get(key, plain) != plain and config.get(key) not in (None, False, [], {}):
      raise ValueError(f"{path}: {key}={config[key]!r} is not supported; jaxlm reads plain LoRA ({key}={plain!r})")
  if not os.path.isfile(os.path.join(folder, WEIGHTS)):
    pickles = [n for n in os.listdir(folder) if n.endswith(hf_weights.PICKLE_SUFFIXES)]
    hint = f" ({pickles[0]} is a pickle; jaxlm never unpickles weights)" if pickles else ""
    raise ValueError(f"{folder}: no {WEIGHTS}{hint}; save the adapter with safe_serialization=True")
  return config


def _pattern_value(patterns: dict, module: str, default: float) -> float:
  for key, value in (patterns or {}).items():
    if re.match(rf"(.*\.)?({key})$", module):
      return value
  return default


def read_adapters(folder: str, model: nnx.Module) -> tuple[dict, float]:
  """(trainable tree: {"lora_a", "lora_b"} at each adapted jaxlm weight (+ "classifier" for modules_to_save), scale)
  of a PEFT LoRA folder for `model` (a jaxlm model of the same base). One-line errors for adapters of another base
  model, shape or kind."""
  config = read_config(folder)
  path = os.path.join(folder, WEIGHTS)
  tensors = load_file(path)
  modules, head_modules = _weight_modules(model), _head_modules(model)
  shapes = {p: tuple(v.shape) for p, v in _flat_params(model).items()}
  found: dict[str, dict] = {}  # module -> {"A": ..., "B": ...}
  head = {}
  for name, value in tensors.items():
    key = name[len(PREFIX):] if name.startswith(PREFIX) else name
    match = re.fullmatch(r"(.+)\.lora_([AB])(?:\.default)?\.weight", key)
    if match:
      if match.group(1) not in modules:
        raise ValueError(f"{path}: tensor {name} adapts module {match.group(1)}, which this {type(model).__name__} "
                         f"({model.config.flavour}, {model.config.num_layers} layers) lacks: adapters of another "
                         f"base model?")
      found.setdefault(match.group(1), {})[match.group(2)] = value
    elif key in head_modules:
      rule, head_path = head_modules[key]
      head[head_path] = hf_rules.to_jax(rule, value, [shapes[head_path]])[0]
    else:
      raise ValueError(f"{path}: tensor {name} is not a LoRA A/B matrix or the classifier head; jaxlm reads plain "
                       f"LoRA adapters")
  scales, per_path = [], {}
  for module, pair in found.items():
    if set(pair) != {"A", "B"}:
      raise ValueError(f"{path}: module {module} has lora_{'A' if 'A' in pair else 'B'} only")
    kind, paths, layer = modules[module]
    a, b = pair["A"], pair["B"]
    r = _pattern_value(config.get("rank_pattern"), module, config["r"])
    alpha = _pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
    if a.shape[0] != r or b.shape[1] != r:
      raise ValueError(f"{path}: module {module} has rank {a.shape[0]} but adapter_config.json says r={r}")
    scales.append(float(alpha) / _scale_divisor(r, bool(config.get("use_rslora"))))
    per_layer = [shapes[p][1:] if layer is not None else shapes[p] for p in paths]
    n_in = lora.num_inputs(paths[0])
    in_size = int(np.prod(per_layer[0][:n_in]))
    out_sizes = [int(np.prod(s[n_in:])) for s in per_layer]
    if a.shape[1] != in_size or b.shape[0] != sum(out_sizes):
      raise ValueError(f"{path}: module {module} maps {a.shape[1]} -> {b.shape[0]} features but this model's weight "
                       f"is {in_size} -> {sum(out_sizes)}: adapters of another base model or shape?")
    parts = _split_fused(a, b, out_sizes)
    for p, shape, (part_a, part_b) in zip(paths, per_layer, parts):
      per_path.setdefault(p, {})[layer] = (part_a.T.reshape(shape[:n_in] + (-1,)),
                                           part_b.T.reshape((-1,) + shape[n_in:]))
  if not per_path:
    raise ValueError(f"{path}: no LoRA tensors")
  if max(scales) - min(scales) > 1e-6 * max(scales):  # equal up to rounding (rsLoRA's sqrt of a fused module's rank)
    divisor = "sqrt(r)" if config.get("use_rslora") else "r"
    raise ValueError(f"{os.path.join(folder, CONFIG)}: the scale lora_alpha / {divisor} differs between modules "
                     f"({sorted(scales)}); jaxlm uses one scale")
  trainable = {}
  for p, layers in per_path.items():
    if None in layers:
      a, b = layers[None]
    else:
      missing = sorted(set(range(model.config.num_layers)) - set(layers))
      if missing:
        raise ValueError(f"{path}: {p} has adapters for some layers only (none for layer {missing[0]}); jaxlm adapts "
                         f"every layer of a target")
      ranks = {layers[i][0].shape[-1] for i in layers}
      if len(ranks) > 1:
        raise ValueError(f"{path}: {p} has different ranks per layer {sorted(ranks)}")
      a = np.stack([layers[i][0] for i in sorted(layers)])
      b = np.stack([layers[i][1] for i in sorted(layers)])
    trainable[p] = {"lora_a": a, "lora_b": b}
  trainable.update(head)
  return lora._nested(trainable), scales[0]


def _split_fused(a: np.ndarray, b: np.ndarray, out_sizes: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
  """One module's (lora_A [R, in], lora_B [out, R]) as one pair per jaxlm weight. A block-diagonal B of rank
  R = n r (what save_adapters writes for c_attn) splits into rank-r pairs; any other B keeps the shared A."""
  n = len(out_sizes)
  if n == 1:
    return [(a, b)]
  rows = np.cumsum([0] + out_sizes)
  r = a.shape[0] // n
  block = a.shape[0] % n == 0 and all(
      not np.any(np.delete(b[rows[i]:rows[i + 1]], np.s_[i * r:(i + 1) * r], axis=1)) for i in range(n))
  if block:
    return [(a[i * r:(i + 1) * r], b[rows[i]:rows[i + 1], i * r:(i + 1) * r]) for i in range(n)]
  return [(a, b[rows[i]:rows[i + 1]]) for i in range(n)]


# ----------------------------------------------------------------------------------------------- models


def with_adapters(model: nnx.Module, trainable: dict, scale: float) -> nnx.Module:
  """`model` (plain weights) with the adapters attached: its target weights become lora.LoRAWeights (and a
  classifier head in `trainable` replaces the model's)."""
  graphdef, state = nnx.split(model)
  params = lora._flat(state.to_pure_dict())
  for path, value in lora._flat(trainable).items():
    if path.startswith(lora.HEAD_PREFIXES):
      params[path] = jax.numpy.asarray(value, params[path].dtype)
  for path, (a, b) in _adapter_items(trainable).items():
    base = params[path]
    lead = base.shape[:1] if a.ndim - 1 - lora.num_inputs(path) == 1 else ()
    params[path] = lora.LoRAWeight(base, jax.numpy.asarray(a, base.dtype), jax.numpy.asarray(b, base.dtype),
                                   jax.numpy.full(lead, scale, jax.numpy.float32))
  state.replace_by_pure_dict(lora._nested(params))
  return nnx.merge(graphdef, state)


def _adapter_items(trainable: dict) -> dict[str, tuple[Any, Any]]:
  flat = lora._flat(trainable)
  return {p[:-len("/lora_a")]: (v, flat[p[:-len("/lora_a")] + "/lora_b"]) for p, v in flat.items()
          if p.endswith("/lora_a")}


def from_pretrained(base_folder: str, adapter_folder: str, **kwargs) -> nnx.Module:
  """A jaxlm LoRA model: the HF checkpoint in `base_folder` (jaxlm.hf.from_pretrained) with the PEFT adapters of
  `adapter_folder`. A SEQ_CLS adapter on a bare BERT encoder gives a BertForSequenceClassification."""
  base = hf_weights.from_pretrained(base_folder, **kwargs)
  config = read_config(adapter_folder)
  pooling = head_pooling(adapter_folder)
  if config.get("modules_to_save") and (isinstance(base, Bert) or (
      isinstance(base, BertForSequenceClassification) and base.config.classifier_pooling != pooling)):
    # The head comes from the adapter (modules_to_save); until then zeros of its shape.
    head = load_file(os.path.join(adapter_folder, WEIGHTS))
    labels = next(v.shape[0] for k, v in head.items() if k.endswith((".classifier.weight", ".out_proj.weight")))
    known = lora._flat(nnx.state(base, nnx.Param).to_pure_dict())
    known = {f"bert/{k}": v for k, v in known.items()} if isinstance(base, Bert) else known
    head_config = dataclasses.replace(base.config, classifier_pooling=pooling)
    classifier = nnx.eval_shape(lambda: BertForSequenceClassification(head_config, labels, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(classifier)
    flat = {p: jax.numpy.zeros(v.shape, v.dtype) if p.startswith(lora.HEAD_PREFIXES) else known.get(p)
            for p, v in lora._flat(state.to_pure_dict()).items()}
    missing = sorted(p for p, v in flat.items() if v is None)
    if missing:  # e.g. ModernBERT's transform, which peft does not save with the classifier
      raise ValueError(f"{adapter_folder}: its classifier needs {missing[0]}, which neither {base_folder} nor the "
                       "adapter holds; load it onto the checkpoint it was trained on")
    state.replace_by_pure_dict(lora._nested(flat))
    base = nnx.merge(graphdef, state)
  trainable, scale = read_adapters(adapter_folder, base)
  return with_adapters(base, trainable, scale)


def head_pooling(adapter_folder: str) -> str:
  """The pooling of the classifier head an adapter folder was trained with: cls unless its HEAD_FILE says mean."""
  path = os.path.join(adapter_folder, HEAD_FILE)
  if not os.path.isfile(path):
    return "cls"
  with open(path) as f:
    pooling = json.load(f).get("classifier_pooling", "cls")
  if pooling not in ("cls", "mean"):
    raise ValueError(f"{path}: classifier_pooling={pooling!r} is not cls or mean")
  return pooling


def merged_model(model: nnx.Module) -> nnx.Module:
  """The same model with every adapter folded into its base weight (W + scale A B, float): a plain jaxlm model that
  jaxlm.hf.save_pretrained writes as an ordinary HF checkpoint."""
  graphdef, state = nnx.split(model)
  merged = lora.merge(state.to_pure_dict())
  state.replace_by_pure_dict(merged)
  return nnx.merge(graphdef, state)
