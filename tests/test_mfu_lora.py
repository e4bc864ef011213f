"""MFU and tokens/s of LoRA runs (jaxlm/training/telemetry.py): a LoRA step's FLOPs leave out the frozen weights'
weight gradients and add the adapters' own (checked against the matmuls of the LoRA gradient's jaxpr, and against
the hand formula), and a short LoRA instruction-tuning run logs tokens/s over every packed slot, the response
tokens apart, and an MFU in (0, 1] that is its counted FLOPs over the measured peak."""

import json
import os

import jax
import jax.numpy as jnp
import pytest
from conftest import reverse_pairs, write_jsonl
from flax import nnx

from jaxlm import config as config_lib
from jaxlm.adapters import lora
from jaxlm.config import LoRAConfig, ModelConfig
from jaxlm.data.tokenizer import train_bpe
from jaxlm.interop import hf_weights
from jaxlm.kernels import Kernels
from jaxlm.models import bert, gpt
from jaxlm.recipes import instruction_tuning
from jaxlm.training import telemetry
from test_flops import BASE, B, T, classifier_loss, lm_loss, matmul_flops


def _lora_gradient_matmul_flops(make, loss, lora_config: LoRAConfig) -> float:
  """The matmul FLOPs of the gradient of the adapters (and a classifier head) alone, the base frozen."""
  graphdef, params = nnx.split(make())
  plan = lora.make_plan(params, lora_config)
  trainable = lora.init_adapters(plan, params.to_pure_dict(), jax.random.key(0))
  frozen = lora.freeze(plan, params.to_pure_dict())
  ids = jnp.zeros((B, T), jnp.int32)

  def loss_fn(trainable):
    return loss(nnx.merge(graphdef, lora.combine(trainable, frozen))(ids))

  return matmul_flops(jax.make_jaxpr(jax.grad(loss_fn))(trainable).jaxpr)


@pytest.mark.parametrize("name, overrides, targets", [
    ("gpt2_all", {}, "all"),
    ("gpt2_names_and_paths", {}, "w_q,blocks/mlp/w_out"),
    ("llama_gqa_attention_and_down", {"flavour": "llama", "num_kv_heads": 2, "tie_embeddings": False, "d_ff": 40},
     "attention,w_down"),
])
def test_decoder_lora_flops_match_the_lora_gradient_jaxpr(name, overrides, targets):
  config = ModelConfig(**{**BASE, **overrides})
  lora_config = LoRAConfig(rank=3, targets=targets)
  counted = _lora_gradient_matmul_flops(lambda: gpt.GPT(config, kernels=Kernels(), rngs=nnx.Rngs(0)), lm_loss,
                                        lora_config)
  assert telemetry.flops_per_token(config, T, lora=lora_config) * B * T == pytest.approx(counted, rel=1e-9), name


@pytest.mark.parametrize("head", ["pooler", "dense_tanh"])
def test_bert_classifier_lora_flops_match_the_lora_gradient_jaxpr(head):
  """The head (classifier, and pre_classifier for dense_tanh) trains whole: 6 FLOPs per parameter, on one token."""
  config = ModelConfig(**{**BASE, "flavour": "bert", "classifier_head": head})
  lora_config = LoRAConfig(rank=3, targets="w_q,w_v,mlp")
  counted = _lora_gradient_matmul_flops(
      lambda: bert.BertForSequenceClassification(config, 3, kernels=Kernels(), rngs=nnx.Rngs(0)), classifier_loss,
      lora_config)
  assert telemetry.flops_per_token(config, T, num_labels=3, lora=lora_config) * B * T == pytest.approx(counted,
                                                                                                      rel=1e-9)


def test_lora_flops_are_the_full_ones_less_the_frozen_weight_gradients_plus_the_adapters():
  # Llama, 2 layers, D = 32, 4 query heads and 2 kv heads of 8, F = 40, V = 96, untied; rank 4 on q, v and down.
  config = ModelConfig(**{**BASE, "flavour": "llama", "num_kv_heads": 2, "tie_embeddings": False, "d_ff": 40})
  lora_config = LoRAConfig(rank=4, targets="w_q,w_v,w_down")
  layer = 32 * 32 + 32 * 16 + 32 * 16 + 32 * 32 + 3 * 32 * 40  # q, k, v, o, gate/up/down: 6912
  matmul_params = 2 * layer + 96 * 32  # + the LM head (the input embedding is a lookup): 16896
  adapters = 2 * ((32 + 32) + (32 + 16) + (40 + 32))  # (d_in + d_out) of q, v, down in each layer: 368
  full = telemetry.flops_per_token(config, T)
  lora_flops = telemetry.flops_per_token(config, T, lora=lora_config)
  assert full - lora_flops == 2 * matmul_params - 6 * 4 * adapters == 24960
  attention = 12 * 2 * 32 * T
  assert lora_flops == 4 * matmul_params + 6 * 4 * adapters + attention
  assert telemetry.flops_per_token(config, T, lora=LoRAConfig(rank=0)) == full  # rank 0: no LoRA
  assert [m[0] for m in telemetry.lora_matrices(config, "w_q,w_v,w_down")] == ["attn/w_q", "attn/w_v", "mlp/w_down"]


# ----------------------------------------------------------------------------------------------- a short LoRA run



def test_lora_instruction_run_counts_every_slot_and_keeps_mfu_within_one(tmp_path):
  tokenizer = train_bpe([r["prompt"] + r["response"] for r in reverse_pairs(200, 0)], 300)
  model_config = ModelConfig(vocab_size=320, num_layers=1, d_model=32, num_heads=2, max_seq_len=64,
                             compute_dtype="float32")
  base = tmp_path / "base"
  hf_weights.save_pretrained(gpt.GPT(model_config, kernels=Kernels(), rngs=nnx.Rngs(0)), str(base))
  tokenizer.save(str(base / "tokenizer.json"))
  config = config_lib.default_config()
  config.init_from = str(base)
  config.model.compute_dtype = "float32"
  config.data.source = "files"
  config.data.train_files = (write_jsonl(tmp_path / "train.jsonl", reverse_pairs(40, 1)),)
  config.data.eval_files = (write_jsonl(tmp_path / "eval.jsonl", reverse_pairs(8, 2)),)
  config.data.seq_len = 0
  config.train.steps, config.train.batch_size, config.train.learning_rate, config.train.warmup_steps = 4, 4, 1e-2, 0
  config.checkpoint.every_steps = 0
  config.log.every_steps, config.log.sample_tokens, config.log.progress_bar = 1, 2, False
  config.train.eval_every_steps = 2
  config.lora.rank, config.lora.targets = 4, "attention,w_in"
  config = config_lib.from_config_dict(config)
  workdir = str(tmp_path / "run")
  result = instruction_tuning.instruction_tune(config, workdir)

  seq_len = result["seq_len"]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    timed = [r for r in map(json.loads, f) if r.get("mfu") is not None]
  assert timed, "no timed step logged"
  peak = telemetry.peak_flops_per_device(dtype="float32")[0] * jax.device_count()  # the loop's denominator
  flops_per_token = telemetry.flops_per_token(model_config, seq_len, lora=config.lora)  # the model of init_from
  assert flops_per_token < telemetry.flops_per_token(model_config, seq_len)
  for record in timed:
    assert 0 < record["mfu"] <= 1, record
    # tokens/s: every packed slot of the batch; the response tokens (the loss's) apart and fewer.
    assert record["tokens_per_sec"] * record["step_time_sec"] == pytest.approx(4 * seq_len, rel=1e-6)
    assert 0 < record["response_tokens_per_sec"] < record["tokens_per_sec"]
    assert record["mfu"] * peak * record["step_time_sec"] == pytest.approx(4 * seq_len * flops_per_token, rel=1e-6)
  assert 0 < result["mfu"] <= 1 and result["response_tokens_per_sec"] < result["tokens_per_sec"]
