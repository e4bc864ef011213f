"""Where fine-tuning starts from (`init_from`): an HF checkpoint folder, a jaxlm run workdir, or nothing.

  pretrained = load_pretrained(config, mesh)   # model config, tokenizer, pure-dict params (encoder, maybe a head)
  params, kept_random = merge_pretrained(state["params"], pretrained.params, shardings, config.init_from)

HF folders are read with `jaxlm.hf.from_pretrained` (safetensors only), each tensor straight onto its sharding. A
jaxlm workdir's latest orbax checkpoint is opened read-only and only its parameters are kept; its `labels.json` and
`tokenizer.json` come along. The model's shape comes from the checkpoint, its precision from the config (how it
runs, `kernels`, is not part of the model).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import tokenizers
from flax import nnx, traverse_util
from jax.sharding import Mesh

from jaxlm.interop import hf_weights
from jaxlm.interop import streaming
from jaxlm.parallel import sharding
from jaxlm.config import Config, ModelConfig
from jaxlm.data.tuning import classification as cls_data
from jaxlm.models.bert import Bert, BertForMaskedLM, BertForSequenceClassification

LABELS_FILE, TOKENIZER_FILE = "labels.json", "tokenizer.json"


@dataclasses.dataclass
class Pretrained:
  model_config: ModelConfig
  tokenizer: tokenizers.Tokenizer
  params: dict | None  # pure dict: {"bert": ...} and, when the checkpoint has one, {"classifier": ...}
                      # (LoRA runs: streaming.LazyLeaf leaves, read by streaming.load_base)
  class_names: list[str] | None  # the classes of a checkpoint that already is a classifier


def load_pretrained(config: Config, mesh: Mesh) -> Pretrained:
  source, m = config.init_from, config.model
  precision = dict(compute_dtype=m.compute_dtype, param_dtype=m.param_dtype)  # the rest is the checkpoint's
  if not source:
    if m.flavour != "bert":
      raise ValueError(f"model.flavour={m.flavour!r}: fine-tuning from scratch needs model.flavour=bert (or set "
                       f"init_from to a BERT checkpoint)")
    if not config.data.tokenizer:
      raise ValueError("fine-tuning without init_from needs data.tokenizer (a tokenizer.json or an HF folder)")
    m = dataclasses.replace(m, classifier_pooling=classifier_pooling(m.classifier_pooling, "", None))
    return Pretrained(m, cls_data.load_checkpoint_tokenizer(config.data.tokenizer), None, None)
  if not os.path.isdir(source):
    raise FileNotFoundError(f"init_from={source!r} is not a folder; give an HF checkpoint folder (config.json + "
                            f"model.safetensors) or a jaxlm run workdir")
  if os.path.isdir(os.path.join(source, "checkpoints")):
    return _load_jaxlm_workdir(source, mesh, precision, m.classifier_pooling)
  if config.lora.rank:  # LoRA: each parameter is read when the quantized base takes it (jaxlm/interop/streaming.py)
    model, lazy = streaming.hf_source(source, m.compute_dtype, m.param_dtype)
  else:
    model = hf_weights.from_pretrained(source, mesh=mesh, compute_dtype=m.compute_dtype, param_dtype=m.param_dtype)
  if not isinstance(model, (Bert, BertForMaskedLM, BertForSequenceClassification)):
    raise ValueError(f"init_from={source!r} holds a {model.config.flavour} decoder; fine-tuning classifies with a "
                     f"BERT-style encoder (model_type bert, roberta, xlm-roberta, distilbert, modernbert)")
  params = lazy if config.lora.rank else nnx.state(model, nnx.Param).to_pure_dict()
  class_names = None
  if isinstance(model, BertForSequenceClassification):
    class_names = _hf_class_names(source, model.num_labels)
  elif isinstance(model, BertForMaskedLM):  # ModernBERT's classifier reuses the masked-LM head's transform
    kept = ("bert", "transform", "transform_norm") if model.config.classifier_head == "transform" else ("bert",)
    params = {k: params[k] for k in kept}
  else:
    params = {"bert": params}
  tokenizer = cls_data.load_checkpoint_tokenizer(config.data.tokenizer or source)
  pooling = classifier_pooling(m.classifier_pooling, source, model.config.classifier_pooling
                               if isinstance(model, BertForSequenceClassification) else None)
  return Pretrained(dataclasses.replace(model.config, **precision, classifier_pooling=pooling), tokenizer, params,
                    class_names)


def classifier_pooling(requested: str, folder: str, checkpoint_pooling: str | None) -> str:
  """`model.classifier_pooling`, with `auto` resolved to what the checkpoint was trained for: its own classifier's
  pooling; else mean for a sentence-transformers folder whose 1_Pooling/ pools by mean; else cls (HF's)."""
  if requested != "auto":
    return requested
  if checkpoint_pooling is not None:
    return checkpoint_pooling
  pooling_config = os.path.join(folder, "1_Pooling", "config.json")
  if folder and os.path.isfile(pooling_config):  # no folder (from scratch): never a path relative to the cwd
    with open(pooling_config) as f:
      if json.load(f).get("pooling_mode_mean_tokens"):
        return "mean"
  return "cls"


def _hf_class_names(folder: str, num_labels: int) -> list[str]:
  with open(os.path.join(folder, "config.json")) as f:
    id2label = json.load(f).get("id2label") or {}
  return [str(id2label.get(str(i), f"LABEL_{i}")) for i in range(num_labels)]


def _load_jaxlm_workdir(workdir: str, mesh: Mesh, precision: dict, requested_pooling: str) -> Pretrained:
  def check(model_config: ModelConfig) -> None:
    if model_config.flavour != "bert":
      raise ValueError(f"init_from={workdir!r} holds a {model_config.flavour} model; fine-tuning needs a BERT encoder")

  model_config, params = read_jaxlm_checkpoint(workdir, mesh, precision, check)
  if "bert" not in params:  # a bare encoder
    params = {"bert": params}
  model_config = dataclasses.replace(model_config, classifier_pooling=classifier_pooling(
      requested_pooling, workdir, model_config.classifier_pooling if "classifier" in params else None))
  class_names = None
  labels_path = os.path.join(workdir, LABELS_FILE)
  if os.path.isfile(labels_path):
    with open(labels_path) as f:
      class_names = json.load(f)
  tokenizer = cls_data.load_checkpoint_tokenizer(os.path.join(workdir, TOKENIZER_FILE))
  return Pretrained(model_config, tokenizer, params, class_names)


def read_jaxlm_checkpoint(workdir: str, mesh: Mesh, precision: dict,
                          check=lambda model_config: None) -> tuple[ModelConfig, dict]:
  """(model config with `precision` applied, replicated parameters in the param dtype) of a jaxlm run's latest
  checkpoint; `check(model_config)` may refuse the model before any parameter is read."""
  import orbax.checkpoint as ocp  # noqa: PLC0415

  directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
  # PyTreeCheckpointHandler reads what StandardCheckpointHandler wrote (the same format) and, unlike it, can restore
  # a chosen subtree: only the parameters are read, never the optimizer moments (2x the parameters for AdamW).
  manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True), item_handlers={
      "state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
      "model": ocp.JsonCheckpointHandler()})
  try:
    step = manager.latest_step()
    if step is None:
      raise ValueError(f"init_from={workdir!r} has no complete checkpoint under checkpoints/; train it first")
    saved_model = manager.restore(step, args=ocp.args.Composite(model=ocp.args.JsonRestore()))["model"]
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    model_config = dataclasses.replace(ModelConfig(**{k: v for k, v in saved_model.items() if k in known}), **precision)
    check(model_config)
    # Replicated: the fine-tuning state is laid out on the mesh later (the train-state builder + merge_pretrained).
    params_metadata = manager.item_metadata(step)["state"]["params"]
    replicated = sharding.replicated(mesh)
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=replicated), params_metadata)
    restore_args = jax.tree.map(lambda m: ocp.ArrayRestoreArgs(sharding=replicated), params_metadata)
    # transforms={} restores exactly the keys of `item` (the parameters) and skips the rest of the saved state.
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item={"params": abstract}, restore_args={"params": restore_args}, transforms={})))["state"]
  finally:  # also when a check above raises
    manager.close()
  dtype = jnp.dtype(model_config.param_dtype)
  return model_config, jax.tree.map(lambda x: x.astype(dtype), state["params"])


def merge_pretrained(state_params: dict, pretrained: dict, shardings: dict, where: str) -> tuple[dict, list[str]]:
  """Pretrained arrays replace the random ones where the path and shape agree; returns (params, paths kept random)."""
  flat_state = _flatten(state_params)
  flat_pretrained = _flatten(pretrained)
  flat_shardings = _flatten(shardings)
  kept_random = []
  for path, value in flat_state.items():
    source = flat_pretrained.get(path)
    if source is None or source.shape != value.shape:
      kept_random.append(path)
      continue
    flat_state[path] = jax.device_put(source.astype(value.dtype), flat_shardings[path])
  if not any(p.startswith("bert/") and p not in kept_random for p in flat_state):
    raise ValueError(f"init_from={where!r}: no encoder parameter fits this model; is it a BERT checkpoint?")
  return _unflatten(flat_state), kept_random


_flatten = lambda tree: traverse_util.flatten_dict(tree, sep="/")  # {"a/b/c": leaf}
_unflatten = lambda flat: traverse_util.unflatten_dict(flat, sep="/")
