"""LoRA / QLoRA load and merged export one parameter at a time (jaxlm/interop/streaming.py), against the whole-tree path
(lora.load_base of the float model; lora.merge + save) for int8, NF4 and float bases: the loaded state bit for bit,
the merged weights to float32 rounding; the empty base of `lora.LoRASplit(..., empty_base=True)` differs from
the random one only in the frozen weights."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxlm.adapters import lora
from jaxlm.config import LoRAConfig, MeshConfig, ModelConfig, TrainConfig
from jaxlm.interop import hf_config, hf_weights, streaming
from jaxlm.kernels import Kernels
from jaxlm.models.bert import Bert, BertForSequenceClassification
from jaxlm.models.gpt import GPT
from jaxlm.parallel import sharding
from jaxlm.recipes import init_from, instruction_tuning
from jaxlm.training import optim
from jaxlm.training.state import Features, init_train_state

GPT2 = ModelConfig(vocab_size=64, num_layers=2, d_model=64, num_heads=4, max_seq_len=16, compute_dtype="float32")
LLAMA = dataclasses.replace(GPT2, flavour="llama", d_model=128, num_kv_heads=2, d_ff=256, tie_embeddings=False)
BERT = dataclasses.replace(GPT2, flavour="bert", num_layers=1, d_ff=128)


def _same(x, y) -> bool:
  return jax.tree.structure(x) == jax.tree.structure(y) and all(
      a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
      for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)))


# One family per base (NF4 needs inputs of 128): each case loads and exports both ways on a 2 x 2 mesh.
@pytest.mark.parametrize("model_config, base", [(GPT2, "int8"), (LLAMA, "nf4"), (BERT, "float")])
def test_streamed_load_and_merged_export_equal_the_whole_tree_path(model_config, base, tmp_path):
  if model_config.flavour == "bert":  # fine-tuning's case: a bare encoder checkpoint, the new head kept random
    save = Bert(model_config, rngs=nnx.Rngs(7))
    make = lambda rngs: BertForSequenceClassification(model_config, 3, kernels=Kernels(), rngs=rngs)
  else:
    save = GPT(model_config, rngs=nnx.Rngs(7))
    make = lambda rngs: GPT(model_config, kernels=Kernels(), rngs=rngs)
  hf_weights.save_pretrained(save, str(tmp_path / "base"))
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
  mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=2, tensor=2) if base == "nf4" else MeshConfig(), jax.devices()[
      :4 if base == "nf4" else 1])
  optimizer, lora_config = optim.make_optimizer(TrainConfig(steps=2)), LoRAConfig(rank=4, base=base, targets="all")
  plan = lora.make_plan(abstract, lora_config)
  _, state, shardings = init_train_state(make, 0, mesh, optimizer, Features(lora.LoRASplit(plan, empty_base=True)))
  assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(state["frozen"]) if x.ndim > 1)
  if base == "int8":  # the empty base changes nothing else
    _, random_state, _ = init_train_state(make, 0, mesh, optimizer, Features(lora.LoRASplit(plan)))
    assert _same(random_state["params"], state["params"]) and _same(random_state["opt_state"], state["opt_state"])

  # The whole-tree path: the float model loaded, merged into the dequantized state, quantized again.
  folder = str(tmp_path / "base")
  whole = nnx.state(hf_weights.from_pretrained(folder), nnx.Param).to_pure_dict()
  _, source = streaming.hf_source(folder)
  if model_config.flavour == "bert":
    whole, source = {"bert": whole}, {"bert": source}
    old, old_kept = lora.load_base(state, shardings, lora_config, make, mesh, lambda p, s: (
        init_from.merge_pretrained(p, whole, s, folder)))
    new, kept = streaming.load_base(state, shardings, lora_config, make, mesh, source, folder, strict=False)
    assert kept == old_kept == ["classifier/b", "classifier/w"]
  else:
    old, _ = lora.load_base(state, shardings, lora_config, make, mesh, lambda p, s: (
        instruction_tuning.place_params(whole, p, s, folder), None))
    with pytest.raises(ValueError, match="has no parameter blocks/"):  # strict (instruction tuning): all or nothing
      streaming.load_base(state, shardings, lora_config, make, mesh, {}, folder)
    new, _ = streaming.load_base(state, shardings, lora_config, make, mesh, source, folder)
  assert _same(old, new)

  # Trained-looking adapters (B no longer zero), then the merged export against lora.merge of the whole tree.
  trainable = jax.jit(lambda t: jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(3), x.shape), t))(
      new["params"])
  params = lora.combine(trainable, new["frozen"])
  streaming.save_merged(graphdef, params, str(tmp_path / "merged"))
  merged_model = nnx.merge(graphdef, lora.merge(params))
  written = nnx.state(hf_weights.from_pretrained(str(tmp_path / "merged")), nnx.Param).to_pure_dict()
  expected = nnx.state(merged_model, nnx.Param).to_pure_dict()
  assert jax.tree.structure(written) == jax.tree.structure(expected)
  for path, value in lora._flat(expected).items():  # per layer: the adapters' product may round by one ulp
    np.testing.assert_allclose(lora._flat(written)[path], value, rtol=2e-7, atol=1e-8, err_msg=path)
    assert lora._flat(written)[path].dtype == value.dtype
  with open(tmp_path / "merged" / "config.json") as f:
    assert json.load(f) == json.loads(json.dumps(hf_config.hf_config(merged_model)))
