"""A/B of classifier fine-tuning step variants in ONE process, rounds interleaved (benchmarks/ab_step.py does the
same for decoders): e.g. LoRA's step against full fine-tuning's on the same batch.

  python benchmarks/ab_classifier_step.py --seq=128 --variants="full:,lora:lora.rank=8"

Each variant is `name:key=value;key=value` over experiments/configs/finetune_bert.py (all-MiniLM-L6-v2 from its
PyPI package, so no download); the first is the baseline. Every variant's real train step (the classification
loss through steps_lib.jit_steps, with its features: LoRA's split, ...) is compiled for one random batch of
--batch x --seq tokens with --labels classes, then each runs --steps_per_round steps per round, in turn, after one
untimed step, for --rounds rounds. Prints the median milliseconds per step and the ratio to the baseline, and
writes <workdir>/ab.json when --workdir is given.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging

from jaxlm import cli
from jaxlm import config as config_lib
from jaxlm.kernels import registry
from jaxlm.models.bert import BertForSequenceClassification
from jaxlm.parallel import sharding
from jaxlm.recipes import classifier_finetuning, init_from
from jaxlm.recipes import features as features_lib
from jaxlm.training import atomic_files, optim
from jaxlm.training import steps as steps_lib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
from configs import finetune_bert  # noqa: E402

_VARIANTS = flags.DEFINE_string("variants", "full:,lora:lora.rank=8", "name:key=value;key=value, comma-separated")
_SEQ = flags.DEFINE_integer("seq", 128, "tokens per example")
_BATCH = flags.DEFINE_integer("batch", 16, "examples per step")
_LABELS = flags.DEFINE_integer("labels", 8, "classes")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "rounds; every variant runs once per round")
_STEPS = flags.DEFINE_integer("steps_per_round", 3, "timed steps per variant per round")
_WORKDIR = flags.DEFINE_string("workdir", None, "where ab.json goes (optional)")


def _config(overrides: str) -> config_lib.Config:
  cd = finetune_bert.get_config()
  cd.train.steps, cd.train.learning_rate, cd.data.seq_len, cd.train.batch_size = 100, 5e-5, _SEQ.value, _BATCH.value
  for entry in filter(None, overrides.split(";")):
    key, value = entry.split("=", 1)
    *parents, last = key.split(".")
    node = cd
    for name in parents:
      node = node[name]
    node[last] = type(node[last])(value)
  return config_lib.from_config_dict(cd)


def _compiled_step(config: config_lib.Config):
  """(compiled train step, its initial state, a random batch) of `config` on the first device."""
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
  pretrained = init_from.load_pretrained(config, mesh)
  config = dataclasses.replace(config, model=pretrained.model_config)
  kernels = registry.resolve(config.kernels, compute_dtype=config.model.compute_dtype, causal=False, mesh=mesh)
  make_model = lambda rngs: BertForSequenceClassification(config.model, _LABELS.value, kernels=kernels, rngs=rngs)  # noqa: E731
  optimizer = optim.make_optimizer(config.train)
  graphdef, state, shardings, features = features_lib.train_state_from_config(config, mesh, optimizer, make_model,
                                                                              language_model_loss=False)
  step, _ = steps_lib.jit_steps(graphdef, optimizer, config, mesh, shardings, features,
                                loss_fn=classifier_finetuning.make_classification_loss_fn(graphdef),
                                eval_fn=classifier_finetuning.make_eval_step(graphdef))
  rng = np.random.default_rng(0)
  b, t = _BATCH.value, _SEQ.value
  batch = {"input_ids": jnp.asarray(rng.integers(1000, 20000, (b, t)), jnp.int32),
           "attention_mask": jnp.ones((b, t), jnp.int32), "token_type_ids": jnp.zeros((b, t), jnp.int32),
           "labels": jnp.asarray(rng.integers(0, _LABELS.value, (b,)), jnp.int32),
           "weights": jnp.ones((b,), jnp.float32)}
  return step.lower(state, batch).compile(), state, batch, kernels


def main(argv):
  del argv  # flags only: cli.run refuses positional arguments
  logging.set_verbosity(logging.WARNING)
  contenders = {}
  for spec in _VARIANTS.value.split(","):
    name, overrides = spec.split(":", 1)
    step, state, batch, kernels = _compiled_step(_config(overrides))
    print(f"{name}: kernels {kernels.describe()}")
    contenders[name] = [step, state, batch, []]
  for _ in range(_ROUNDS.value):
    for entry in contenders.values():
      step, state, batch, times = entry
      state, metrics = step(state, batch)  # untimed: the first step after another variant ran is colder
      jax.block_until_ready(metrics)
      for _ in range(_STEPS.value):
        started = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - started)
      entry[1] = state
  baseline = None
  out = {"seq": _SEQ.value, "batch": _BATCH.value, "device_kind": jax.devices()[0].device_kind, "variants": {}}
  for name, (_, _, _, times) in contenders.items():
    median = statistics.median(times)
    baseline = baseline or median
    out["variants"][name] = {"median_step_sec": median, "ratio_to_baseline": median / baseline, "step_sec": times}
    print(f"{name:16s} {1e3 * median:9.1f} ms per step  {median / baseline:.3f}x the baseline")
  if _WORKDIR.value:
    os.makedirs(_WORKDIR.value, exist_ok=True)
    atomic_files.write_json(os.path.join(_WORKDIR.value, "ab.json"), out)


if __name__ == "__main__":
  cli.run(main)
