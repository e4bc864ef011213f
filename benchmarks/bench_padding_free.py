"""DPO train steps with and without `preference.padding_free`, taking turns in ONE process, on the same pairs.

  JAX_PLATFORMS=cpu python benchmarks/bench_padding_free.py --workdir=runs/bench_padding_free \
      --results=benchmarks/results/padding_free_dpo.json
  (--pairs=runs/rule_pairs: a folder of train.jsonl / eval.jsonl; --init_from=runs/gemma3_270m: an HF decoder)

Both runs are experiments/configs/finetune_preferences.py's recipe (DPO, rpo_alpha 1, LoRA rank 16, train.batch_size
8) built by jaxlm/recipes/preference_tuning.py, one run with padding-free rows and one without: the same pairs,
decoder, reference pass and step function. Without --pairs, the pairs are experiments/preference_pairs.py's rule set
(240 training pairs, its default seed); without --init_from, the decoder is a random Llama-style one
(--d_model, --layers, ...) with a byte-level BPE tokenizer trained on the pairs, both saved by transformers.

A padded step takes train.batch_size pairs, each a [2, T] slot; a padding-free step takes train.batch_size /
row_pairs rows of row_pairs * 2 * T slots holding whole pairs (jaxlm/data/tuning/pair_packing.py): the same token
slots a step, more of them holding a token. Each run's first step is untimed (it compiles); then --rounds rounds of
--steps_per_round steps each, the runs taking turns (the first to go alternating), each round timed to its last
step's end. Reported per run: the median step time over the rounds, tokens/s over all token slots, over real tokens
(slots holding a token) and over response tokens, pairs/s and the padding share (slots holding no token).

The same loss: each run's first step is also taken, from the same initial state, on the other run's first batch
laid out its way (the padding-free batch's pairs as padded [2, T] slots, the padded batch's pairs packed into rows),
with that batch's reference log-probabilities; both losses must agree to 1e-6 (relative: the sums over a response
add in another order, so the last bits differ). Writes --results (JSON) and prints it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys
import time

from absl import app, flags

flags.DEFINE_string("workdir", "runs/bench_padding_free", "the runs' folders (and the pairs and decoder made here)")
flags.DEFINE_string("results", "", "the JSON to write (default <workdir>/padding_free_dpo.json)")
flags.DEFINE_string("pairs", "", "a folder with train.jsonl and eval.jsonl; '' = experiments/preference_pairs.py's")
flags.DEFINE_string("init_from", "", "an HF decoder folder; '' = a random Llama-style decoder (the sizes below)")
flags.DEFINE_integer("rounds", 10, "timed rounds per run")
flags.DEFINE_integer("steps_per_round", 5, "steps per round")
flags.DEFINE_integer("batch_size", 8, "train.batch_size (padded pairs' slots a step)")
flags.DEFINE_integer("row_pairs", 0, "preference.row_pairs (0: chosen from the data)")
flags.DEFINE_integer("lora_rank", 16, "lora.rank (0: full fine-tuning)")
flags.DEFINE_integer("d_model", 256, "random decoder: hidden size")
flags.DEFINE_integer("layers", 4, "random decoder: layers")
flags.DEFINE_integer("heads", 4, "random decoder: attention heads")
flags.DEFINE_integer("kv_heads", 2, "random decoder: key/value heads")
flags.DEFINE_integer("d_ff", 768, "random decoder: MLP width")
flags.DEFINE_integer("vocab", 1024, "random decoder: the BPE vocabulary it is trained to (at most)")
FLAGS = flags.FLAGS
VARIANTS = {"padded": False, "padding_free": True}
LOSS_TOLERANCE = 1e-6  # relative


def _rule_pairs(folder: str) -> str:
  from experiments import preference_pairs  # noqa: PLC0415

  os.makedirs(folder, exist_ok=True)
  for name, rows in (("train", preference_pairs.pairs(240, 0, False)), ("eval", preference_pairs.pairs(48, 1, True))):
    with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
      f.writelines(json.dumps(row) + "\n" for row in rows)
  return folder


def _random_decoder(folder: str, pairs_folder: str) -> str:
  """A random Llama-style decoder and a byte-level BPE tokenizer (BOS <s> before every text, EOS </s>) trained on
  the pairs, saved by transformers."""
  import tokenizers  # noqa: PLC0415
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers  # noqa: PLC0415

  rows = [json.loads(line) for name in ("train", "eval") for line in open(os.path.join(pairs_folder, f"{name}.jsonl"))]
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator([r[k] for r in rows for k in ("prompt", "chosen", "rejected")], trainers.BpeTrainer(
      vocab_size=FLAGS.vocab, special_tokens=["<s>", "</s>", "<pad>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      hidden_size=FLAGS.d_model, intermediate_size=FLAGS.d_ff, num_hidden_layers=FLAGS.layers,
      num_attention_heads=FLAGS.heads, num_key_value_heads=FLAGS.kv_heads, vocab_size=tokenizer.get_vocab_size(),
      max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=2)
  transformers.LlamaForCausalLM(config).save_pretrained(folder)
  transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                       pad_token="<pad>").save_pretrained(folder)
  return folder


@dataclasses.dataclass
class Run:
  name: str
  config: object
  mesh: object
  task: object
  state: object


def _build(config, name: str, workdir: str) -> Run:
  from jaxlm.recipes import instruction_tuning, preference_tuning  # noqa: PLC0415
  from jaxlm.training import loop  # noqa: PLC0415

  config = dataclasses.replace(config, preference=dataclasses.replace(config.preference, padding_free=VARIANTS[name]))
  config, mesh, kernels = loop.prepare_run(instruction_tuning.with_source_model(config), workdir, causal=True)
  config, task = preference_tuning.preference_task(config, workdir, mesh, kernels)
  state = task.start(task.state, 0)  # init_from's weights, the reference pass and the start evaluation
  return Run(name, config, mesh, task, state)


def _step(run: Run, state, local: dict):
  from jaxlm.training import steps as steps_lib  # noqa: PLC0415

  return run.task.train_step(state, steps_lib.to_global_batch(local, run.mesh))


def _copy(tree):
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  return jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, tree)


def as_padded(batch: dict, seq_len: int, multiple: int) -> dict:
  """A padding-free batch's pairs as padded [N, 2, T] slots (N rounded up to `multiple` with pairs weighing 0)."""
  import numpy as np  # noqa: PLC0415

  pairs = [(r, j) for r, j in zip(*np.nonzero(batch["pair_weight"]))]
  n = len(pairs) + (-len(pairs)) % multiple
  out = {k: np.zeros((n, 2, seq_len), batch[k].dtype) for k in ("inputs", "targets", "positions", "segment_ids",
                                                               "loss_mask")}
  out["ref_logp"], out["pair_weight"] = np.zeros((n, 2), np.float32), np.zeros(n, np.float32)
  for i, (r, j) in enumerate(pairs):
    for side in (0, 1):
      at = batch["segment_ids"][r] == 2 * j + 1 + side
      for key in ("inputs", "targets", "positions", "loss_mask"):
        out[key][i, side, :at.sum()] = batch[key][r, at]
      out["segment_ids"][i, side, :at.sum()] = 1
    out["ref_logp"][i], out["pair_weight"][i] = batch["ref_logp"][r, j], 1.0
  return out


def as_rows(batch: dict, rows: int) -> dict:
  """A padded batch's B pairs packed into `rows` rows (B / rows pairs each, chosen then rejected, no padding
  between them), as pair_packing lays them out."""
  import numpy as np  # noqa: PLC0415

  b, _, t = batch["inputs"].shape
  per_row = b // rows
  length = per_row * 2 * t
  out = {k: np.zeros((rows, length), batch[k].dtype) for k in ("inputs", "targets", "positions", "segment_ids",
                                                              "loss_mask")}
  out["ref_logp"] = batch["ref_logp"].reshape(rows, per_row, 2).copy()
  out["pair_weight"] = batch["pair_weight"].reshape(rows, per_row).copy()
  for i in range(b):
    r, j = divmod(i, per_row)
    start = int((out["segment_ids"][r] > 0).sum())
    for side in (0, 1):
      k = int((batch["segment_ids"][i, side] > 0).sum())
      for key in ("inputs", "targets", "positions", "loss_mask"):
        out[key][r, start:start + k] = batch[key][i, side, :k]
      out["segment_ids"][r, start:start + k] = 2 * j + 1 + side
      start += k
  return out


def _counts(local: dict) -> dict:
  return {"slots": int(local["inputs"].size), "real": int((local["segment_ids"] > 0).sum()),
          "response": int(local["loss_mask"].sum()), "pairs": int(local["pair_weight"].sum())}


def main(argv):
  del argv
  import jax  # noqa: PLC0415

  from experiments.configs import finetune_preferences  # noqa: PLC0415
  from jaxlm import config as config_lib  # noqa: PLC0415

  workdir = FLAGS.workdir
  pairs = FLAGS.pairs or _rule_pairs(os.path.join(workdir, "rule_pairs"))
  init_from = FLAGS.init_from or _random_decoder(os.path.join(workdir, "random_decoder"), pairs)
  config = finetune_preferences.get_config()
  config.init_from = init_from
  config.data.train_files = (os.path.join(pairs, "train.jsonl"),)
  config.data.eval_files = (os.path.join(pairs, "eval.jsonl"),)
  config.lora.rank = FLAGS.lora_rank
  config.preference.row_pairs = FLAGS.row_pairs
  config.train.batch_size = FLAGS.batch_size
  config.train.steps = 1 + FLAGS.rounds * FLAGS.steps_per_round
  config.train.eval_every_steps, config.checkpoint.every_steps = 0, 0
  config.log.sample_tokens, config.log.progress_bar = 0, False
  config = config_lib.from_config_dict(config)

  runs = {name: _build(config, name, os.path.join(workdir, name)) for name in VARIANTS}
  padded, free = runs["padded"], runs["padding_free"]
  seq_len = padded.config.data.seq_len
  first = {name: next(run.task.batches) for name, run in runs.items()}
  shards = padded.mesh.shape["data"] * padded.mesh.shape["fsdp"]
  # The same loss: each run's step from the same initial state on the other's first batch, laid out its way.
  crossed = {"padded": as_padded(first["padding_free"], seq_len, shards),
             "padding_free": as_rows(first["padded"], shards)}
  losses = {}
  for name, run in runs.items():
    _, own = _step(run, _copy(run.state), first[name])
    _, other = _step(run, _copy(run.state), crossed[name])
    losses[name] = {"own_first_batch": float(own["loss"]), "other_runs_first_batch": float(other["loss"])}
  same_loss = {
      "padding_free_batch": {"padding_free": losses["padding_free"]["own_first_batch"],
                             "padded": losses["padded"]["other_runs_first_batch"],
                             "pairs": int(first["padding_free"]["pair_weight"].sum())},
      "padded_batch": {"padded": losses["padded"]["own_first_batch"],
                       "padding_free": losses["padding_free"]["other_runs_first_batch"],
                       "pairs": int(first["padded"]["pair_weight"].sum())}}
  for entry in same_loss.values():
    entry["abs_diff"] = abs(entry["padded"] - entry["padding_free"])
    entry["rel_diff"] = entry["abs_diff"] / max(abs(entry["padded"]), 1e-30)
  worst = max(entry["rel_diff"] for entry in same_loss.values())

  for name, run in runs.items():  # the untimed first steps (they compile)
    run.state, metrics = _step(run, run.state, first[name])
    jax.block_until_ready(metrics)
  times = {name: [] for name in runs}
  totals = {name: dict.fromkeys(("slots", "real", "response", "pairs", "steps"), 0) for name in runs}
  for r in range(FLAGS.rounds):
    for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
      run, started = runs[name], time.perf_counter()
      for _ in range(FLAGS.steps_per_round):
        local = next(run.task.batches)
        for key, value in _counts(local).items():
          totals[name][key] += value
        totals[name]["steps"] += 1
        run.state, metrics = _step(run, run.state, local)
      jax.block_until_ready(metrics)
      times[name].append((time.perf_counter() - started) / FLAGS.steps_per_round)

  per_run = {}
  for name, run in runs.items():
    step, n = statistics.median(times[name]), totals[name]["steps"]
    per_run[name] = {
        "step_time_s": step, "step_time_s_per_round": times[name], "batch_shape": list(first[name]["inputs"].shape),
        "tokens_per_sec": totals[name]["slots"] / n / step, "real_tokens_per_sec": totals[name]["real"] / n / step,
        "response_tokens_per_sec": totals[name]["response"] / n / step,
        "pairs_per_sec": totals[name]["pairs"] / n / step,
        "pairs_per_step": totals[name]["pairs"] / n, "padding_share": 1 - totals[name]["real"] / totals[name]["slots"]}
  ratio = lambda key: per_run["padding_free"][key] / per_run["padded"][key]
  results = {
      "command": " ".join(["python", *sys.argv]), "machine": f"{platform.processor() or platform.machine()}, "
      f"{os.cpu_count()} CPUs, {jax.devices()[0].platform} x{jax.device_count()}",
      "pairs": pairs, "init_from": init_from, "decoder": "random" if not FLAGS.init_from else "given",
      "seq_len": seq_len, "row_pairs": free.config.preference.row_pairs or first["padding_free"]["inputs"].shape[1]
      // (2 * seq_len), "batch_size": FLAGS.batch_size, "lora_rank": FLAGS.lora_rank, "rounds": FLAGS.rounds,
      "steps_per_round": FLAGS.steps_per_round, **per_run,
      "padding_free_over_padded": {key: ratio(key) for key in ("real_tokens_per_sec", "pairs_per_sec",
                                                               "tokens_per_sec", "response_tokens_per_sec")},
      "step_time_padding_free_over_padded": ratio("step_time_s"),
      "first_step_loss": same_loss, "first_step_loss_max_rel_diff": worst,
      "same_loss_to_1e-6": worst <= LOSS_TOLERANCE}
  if not FLAGS.init_from:
    results["random_decoder"] = {k: getattr(FLAGS, k) for k in ("d_model", "layers", "heads", "kv_heads", "d_ff")}
    results["random_decoder"]["vocab_size"] = padded.config.model.vocab_size
  path = FLAGS.results or os.path.join(workdir, "padding_free_dpo.json")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(results, f, indent=2)
  print(json.dumps({k: v for k, v in results.items() if k not in ("padded", "padding_free")}, indent=2))
  if worst > LOSS_TOLERANCE:
    raise SystemExit(f"the first step's losses differ by {worst:.3g} (relative) > {LOSS_TOLERANCE}")


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  app.run(main)
