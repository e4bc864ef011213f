"""Generate text from the latest checkpoint of a jaxlm training run, with the KV-cache decoder.

  python experiments/generate.py --workdir=runs/demo --prompt="def " --prompt="class Foo" --max_new_tokens=96

Reads <workdir>/config.json (the run's config), <workdir>/tokenizer.json and the newest readable checkpoint under
<workdir>/checkpoints; prints each prompt with its continuation and writes them to <workdir>/generate.json (flat:
`checkpoint_step`, `sample_<i>_prompt`, `sample_<i>_text`, and the sampling settings). --temperature=0 is greedy;
--top_k / --top_p filter the distribution; a sample ends at the tokenizer's end-of-document token.
Runtime: about 15 s for the demo model on a 2-core CPU (mostly start-up and compilation).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
from absl import flags, logging

from jaxlm import config as config_lib
from jaxlm import data as data_lib
from jaxlm import cli, generate, optim, sharding
from jaxlm.checkpoint import Checkpointer, abstract_with_shardings
from jaxlm import steps as steps_lib

_WORKDIR = flags.DEFINE_string("workdir", None, "training run folder (config.json, tokenizer.json, checkpoints/)")
_PROMPT = flags.DEFINE_multi_string("prompt", ["def "], "prompt text; repeat the flag for a batch of prompts")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 96, "tokens generated after each prompt (at most)")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "sampling temperature; 0 = greedy")
_TOP_K = flags.DEFINE_integer("top_k", 40, "sample among the k most likely tokens (0 = all)")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "sample within the smallest set of tokens with this probability mass")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_TENSOR = flags.DEFINE_integer("mesh_tensor", 1, "devices that split heads (the other devices split the batch)")
_OUTPUT = flags.DEFINE_string("output", "", "JSON file for the samples (default <workdir>/generate.json)")
flags.mark_flags_as_required(["workdir"])


def load_run(workdir: str, mesh_tensor: int = 1):
  """(config, graphdef, params, tokenizer, step) of a run's newest checkpoint, params sharded on this host's
  devices (heads over `mesh_tensor` devices, replicated over the rest)."""
  config_path = os.path.join(workdir, "config.json")
  if not os.path.exists(config_path):
    raise ValueError(f"{config_path} not found: --workdir must be a jaxlm training run folder")
  config = config_lib.from_run_file(config_path)
  config = dataclasses.replace(config, mesh=config_lib.MeshConfig(data=-1, fsdp=1, tensor=mesh_tensor))
  mesh = sharding.make_mesh(config.mesh)
  optimizer = optim.make_optimizer(config.train)
  built = {}

  def init():  # traced only (eval_shape): shapes and shardings of the train state, nothing allocated
    graphdef, state, state_shardings = steps_lib.init_train_state(config, mesh, optimizer)
    built.update(graphdef=graphdef, shardings=state_shardings)
    return state

  abstract_state = jax.eval_shape(init)
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), every_steps=0, keep=config.checkpoint.keep)
  try:
    restored = checkpointer.restore_latest(abstract_with_shardings(abstract_state, built["shardings"]), config.model)
  finally:
    checkpointer.close()
  if restored is None:
    raise ValueError(f"no checkpoint in {workdir}/checkpoints; train first (experiments/train_lm.py)")
  step, state, _ = restored
  tokenizer = data_lib.load_tokenizer(os.path.join(workdir, "tokenizer.json"))
  return config, built["graphdef"], state["params"], tokenizer, step


def main(argv):
  del argv  # flags only: cli.run refuses positional arguments
  logging.set_verbosity(logging.WARNING)
  config, graphdef, params, tokenizer, step = load_run(_WORKDIR.value, _TENSOR.value)
  eos = data_lib.eos_id(tokenizer)
  prompts = [tokenizer.encode(p).ids or [eos] for p in _PROMPT.value]
  limit = config.model.max_seq_len if config.model.flavour == "gpt2" else None
  new_tokens = _MAX_NEW_TOKENS.value
  if limit is not None:  # the learned position table bounds prompt + continuation
    prompts = [p[-(limit - 1):] for p in prompts]
    new_tokens = min(new_tokens, limit - max(len(p) for p in prompts))
  outputs = generate.generate(graphdef, params, prompts, new_tokens, temperature=_TEMPERATURE.value,
                              top_k=_TOP_K.value, top_p=_TOP_P.value, stop_tokens=(eos,), seed=_SEED.value,
                              pad_id=eos)
  result = {"checkpoint_step": step, "temperature": _TEMPERATURE.value, "top_k": _TOP_K.value,
            "top_p": _TOP_P.value, "seed": _SEED.value}
  for i, (prompt, ids, out) in enumerate(zip(_PROMPT.value, prompts, outputs)):
    text = tokenizer.decode(ids + out)
    result[f"sample_{i}_prompt"], result[f"sample_{i}_text"] = prompt, text
    print(f"--- sample {i} (checkpoint step {step}) ---\n{text}")
  if jax.process_index() == 0:
    with open(_OUTPUT.value or os.path.join(_WORKDIR.value, "generate.json"), "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  cli.run(main)
