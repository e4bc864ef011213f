"""jaxlm.planner.estimates_rl through jaxlm.planner.plan: an RL config (rl.loss) is planned as its update step plus
the reference copy (full tuning with rl.beta > 0 only), the rollout's KV cache and the rollout, update and log-prob
times. Traces shapes only; nothing is compiled."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxlm import config as config_lib
from jaxlm.models.gpt import GPT
from jaxlm.planner import estimates_rl, layouts, plan
from jaxlm.planner import hardware as hardware_lib
from jaxlm.planner.hardware import GIB

L, D, H, V = 2, 64, 4, 256
TINY = config_lib.Config(
    model=config_lib.ModelConfig(vocab_size=V, num_layers=L, d_model=D, num_heads=H, max_seq_len=128,
                                 compute_dtype="float32"),
    data=config_lib.DataConfig(seq_len=32), train=config_lib.TrainConfig(batch_size=8, steps=100),
    checkpoint=config_lib.CheckpointConfig(every_steps=50),
    rl=config_lib.RLConfig(loss="grpo", num_generations=4, max_completion_length=16,
                           rewards=("jaxlm.recipes.rewards:exact_answer",)))


@pytest.fixture(scope="module")
def h100():
  return hardware_lib.load_hardware(["h100_80gb"])[0]


def _rl(config, **changes):
  return dataclasses.replace(config, rl=dataclasses.replace(config.rl, **changes))


def _row(config, hardware, devices=1):
  """The one-device row (or the first row of `devices`) of the plan."""
  rows = plan.plan(config, [hardware], (devices,), pipelines=False, remat_fallback=False)
  return rows[0]


def _param_bytes(model):
  abstract = nnx.eval_shape(lambda: GPT(model, rngs=nnx.Rngs(0)))
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def test_a_full_tuning_reference_adds_exactly_the_params_bytes(h100):
  without, with_reference = (_row(_rl(TINY, beta=beta), h100) for beta in (0.0, 0.04))
  reference = _param_bytes(TINY.model)
  assert with_reference["reference_bytes"] == reference and without["reference_bytes"] == 0
  assert with_reference["memory_parts_gib"]["reference"] * GIB == pytest.approx(reference, rel=1e-12)
  assert with_reference["grad_accum"] == without["grad_accum"]
  added = (with_reference["predicted_memory_gib"] - without["predicted_memory_gib"]) * GIB
  assert added == pytest.approx(reference, rel=1e-9)
  # The update step itself is the LM step of prompt + completion tokens: only the log-prob passes differ.
  assert with_reference["update_sec"] == without["update_sec"]
  assert without["reference_logprobs_sec"] == 0 < with_reference["reference_logprobs_sec"]
  # Split over two FSDP devices, the reference is split as the params are.
  fsdp = estimates_rl.reference_bytes(estimates_rl.as_sequence_run(_rl(TINY, beta=0.04)), (1, 2, 1))
  assert reference / 2 <= fsdp < reference


def test_a_lora_reference_is_the_base_with_the_adapters_off_and_costs_no_memory(h100):
  lora = dataclasses.replace(TINY, lora=config_lib.LoRAConfig(rank=8))
  without, with_reference = (_row(_rl(lora, beta=beta), h100) for beta in (0.0, 0.04))
  assert with_reference["reference_bytes"] == 0 and with_reference["memory_parts_gib"]["reference"] == 0
  assert with_reference["predicted_memory_gib"] == without["predicted_memory_gib"]
  assert "frozen_base" in with_reference["memory_parts_gib"]  # planned as a LoRA step
  assert with_reference["reference_logprobs_sec"] > 0  # the forward still runs


def test_kv_cache_bytes_formula_on_a_tiny_config(h100):
  config = estimates_rl.as_sequence_run(TINY)
  b, s, k = 8, 48, D // H
  keys_values = 2 * L * b * s * H * k * 4  # [L, B, S, G, K] f32, keys and values
  assert estimates_rl.kv_cache_bytes(config, (1, 1, 1), b, s) == keys_values + b * s * 4 + 4
  # Rows split over data x fsdp, KV heads over tensor; the slots' segment ids follow the rows.
  assert estimates_rl.kv_cache_bytes(config, (2, 1, 2), b, s) == keys_values / 4 + b * s * 4 / 2 + 4
  bf16_gqa = dataclasses.replace(config, model=dataclasses.replace(config.model, compute_dtype="bfloat16",
                                                                   num_kv_heads=2))
  assert estimates_rl.kv_cache_bytes(bf16_gqa, (1, 1, 1), b, s) == 2 * L * b * s * 2 * k * 2 + b * s * 4 + 4
  # The row's cache: train.batch_size rows of prompt (data.seq_len) + completion slots.
  row = _row(TINY, h100)
  assert row["rl_prompt_length"] == 32 and row["rl_sequence_length"] == 48
  assert row["kv_cache_bytes"] == keys_values + b * s * 4 + 4


def test_time_parts_are_positive_and_the_rollout_grows_with_the_completion_length(h100):
  row = _row(TINY, h100)
  for key in ("prefill_sec", "decode_sec", "rollout_sec", "update_sec", "update_step_sec", "step_time_sec"):
    assert row[key] > 0, key
  assert row["old_logprobs_sec"] == 0 and row["reference_logprobs_sec"] == 0  # num_iterations 1, beta 0
  assert row["rollout_sec"] == pytest.approx(row["prefill_sec"] + row["decode_sec"])
  assert row["step_time_sec"] == pytest.approx(row["rollout_sec"] + row["update_sec"])
  assert 0 < row["rollout_share"] < 1 and 0 < row["mfu"] < 1
  longer = _row(_rl(TINY, max_completion_length=48), h100)
  assert longer["rollout_sec"] > row["rollout_sec"] and longer["decode_sec"] > 2 * row["decode_sec"]
  assert longer["rl_sequence_length"] == 80
  # Two updates per rollout: the sampling-time log-probs take a forward; a step is half a cycle.
  twice = _row(_rl(TINY, num_iterations=2), h100)
  assert twice["old_logprobs_sec"] == pytest.approx(row["update_step_sec"] / 3)
  assert twice["update_sec"] == pytest.approx(2 * row["update_sec"])
  assert twice["step_time_sec"] == pytest.approx((twice["rollout_sec"] + twice["update_sec"]
                                                  + twice["old_logprobs_sec"]) / 2)
  assert twice["steps"] == row["steps"] == TINY.train.steps  # train.steps counts optimizer steps
  # experiments/plan.py retimes rows with compiled collective bytes through predict_row_time: the same parts.
  config = estimates_rl.as_sequence_run(TINY)
  retimed = plan.predict_row_time(config, (1, 1, 1), row["grad_accum"], h100, row["collective_bytes"])
  assert retimed["step_time_sec"] == pytest.approx(row["step_time_sec"])


def test_prompt_length_and_what_an_rl_plan_leaves_out():
  assert estimates_rl.prompt_length(TINY) == 32
  unset = dataclasses.replace(TINY, data=dataclasses.replace(TINY.data, seq_len=0))
  assert estimates_rl.prompt_length(unset) == 128 - 16  # the default, capped by the positions left
  wide = dataclasses.replace(unset, model=dataclasses.replace(unset.model, max_seq_len=1024))
  assert estimates_rl.prompt_length(wide) == estimates_rl.DEFAULT_PROMPT_LENGTH
  assert estimates_rl.prompt_length(_rl(wide, max_prompt_length=100)) == 100
  assert estimates_rl.as_sequence_run(wide).data.seq_len == estimates_rl.DEFAULT_PROMPT_LENGTH + 16
  with pytest.raises(ValueError, match="rl.max_completion_length=128 leaves no room for a prompt in the model's 128 "
                                       "positions; lower it"):
    estimates_rl.prompt_length(_rl(TINY, max_completion_length=128))
  pipeline = layouts.Layout(1, 1, 1, 2, "gpipe")
  assert plan.mesh_problem(estimates_rl.as_sequence_run(TINY), pipeline) == (
      "rl.loss=grpo samples its rollouts on the training mesh, which has no mesh.pipeline > 1")
