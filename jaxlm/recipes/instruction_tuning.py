"""Instruction tuning a GPT-2 or Llama decoder on prompt/response pairs or conversations (the loss on the response
tokens, or the assistant turns, only).

The run goes through `loop.run_loop`, as pretraining and classifier fine-tuning do (resume, stop signals,
non-finite skipping, eval cadence, checkpoints, report.md); this module is its `loop.Task`:

  init_from   an HF GPT-2 / Llama folder (config.json + safetensors + tokenizer.json) or a jaxlm run workdir
              (experiments/train_lm.py's, or an earlier instruction-tuning run): the model's shape, weights and
              tokenizer come from it; `model.compute_dtype`, `model.param_dtype` and `kernels` from the config.
  data        jaxlm/data/tuning/instructions.py: pairs packed whole into rows (no attention across pairs), the loss
              mask on response targets; the batches have pretraining's layout, so the steps are pretraining's
              (`steps_lib.jit_steps` with the token-weighted next-token loss). When the tokenizer's folder has a
              chat template, every example is written with it (pairs as a user and an assistant turn,
              `data.messages_column` conversations whole) and the loss mask is its assistant turns; the workdir
              and hf_model/ keep the template files.
  eval        every `train.eval_every_steps` and at the end, on every held-out pair: `eval_loss` (mean over response
              tokens), `eval_perplexity`, `eval_token_accuracy`.
  report      report.md gets greedy responses for the first held-out prompts next to the reference responses
              (`log.sample_tokens` new tokens at most); eval.json the final evaluation as flat numbers;
              `<workdir>/hf_model/` the tuned model as an HF folder (transformers loads it).
  LoRA        `lora.rank > 0`: the base frozen (int8/NF4 with `lora.base`), only the adapters train, through the same
              train state as classification (jaxlm/adapters/lora.py); hf_model/ holds the merged weights,
              `<workdir>/adapter/` the adapters as a PEFT folder (jaxlm/interop/peft_folders.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import tokenizers
from flax import nnx
from jax.sharding import Mesh

from jaxlm import config as config_lib
from jaxlm.adapters import lora
from jaxlm.config import Config, ModelConfig
from jaxlm.data import load_tokenizer, make_train_iterator
from jaxlm.data.tuning import chat
from jaxlm.data.tuning import instructions as instr_data
from jaxlm.data.tuning import seq_lengths
from jaxlm.inference import generate
from jaxlm.interop import hf_config, hf_weights, peft_folders, streaming
from jaxlm.kernels import Kernels
from jaxlm.models.gpt import FLAVOURS, GPT
from jaxlm.recipes import data_defaults, distillation
from jaxlm.recipes import features as features_lib
from jaxlm.recipes import init_from as pretrained_lib
from jaxlm.training import atomic_files, loop, optim, reliability, telemetry
from jaxlm.training import steps as steps_lib
from jaxlm.training.state import TrainState

HF_MODEL = "hf_model"
ADAPTER = "adapter"  # LoRA runs: the final adapters as a PEFT folder
START_EVAL = "start_eval.json"  # the base model's evaluation, before the first step
GENERATED_EXAMPLES = 4  # held-out prompts answered in report.md


@dataclasses.dataclass
class Decoder:
  model_config: ModelConfig
  tokenizer: tokenizers.Tokenizer
  params: dict | None  # pure dict of the GPT's parameters; None once loaded into the train state
  chat_folder: str  # the tokenizer's folder: its chat template, if any, formats the examples (jaxlm.data.tuning.chat)


def load_decoder(config: Config, mesh: Mesh) -> Decoder:
  """The decoder and tokenizer of `init_from` (an HF folder or a jaxlm workdir), in the config's precision."""
  source, m = config.init_from, config.model
  if not source:
    raise ValueError("instruction tuning needs init_from: an HF GPT-2/Llama folder or a jaxlm run workdir")
  if not os.path.isdir(source):
    raise FileNotFoundError(f"init_from={source!r} is not a folder; give an HF checkpoint folder (config.json + "
                            f"model.safetensors) or a jaxlm run workdir")
  precision = dict(compute_dtype=m.compute_dtype, param_dtype=m.param_dtype)

  def check(model_config: ModelConfig) -> None:
    if model_config.flavour not in FLAVOURS:
      raise ValueError(f"init_from={source!r} holds a {model_config.flavour} model; instruction tuning needs a "
                       f"decoder ({', '.join(FLAVOURS)}), or set model.flavour=bert to fine-tune a classifier")

  if os.path.isdir(os.path.join(source, "checkpoints")):
    model_config, params = pretrained_lib.read_jaxlm_checkpoint(source, mesh, precision, check)
  elif config.lora.rank:  # LoRA: each parameter is read when the quantized base takes it (jaxlm/interop/streaming.py)
    model, params = streaming.hf_source(source, **precision)
    check(model.config)
    model_config = model.config
  else:
    model = hf_weights.from_pretrained(source, mesh=mesh, **precision)
    check(model.config)
    model_config, params = model.config, nnx.state(model, nnx.Param).to_pure_dict()
  tokenizer_path = config.data.tokenizer or source
  if os.path.isdir(tokenizer_path) and not os.path.isfile(os.path.join(tokenizer_path, "tokenizer.json")):
    raise ValueError(f"{tokenizer_path!r} has no tokenizer.json; put the model's tokenizer there or set "
                     f"data.tokenizer")
  tokenizer = load_tokenizer(tokenizer_path)
  tokenizer.no_padding()  # HF tokenizer.json files may pad or cut; the pairs are laid out here
  tokenizer.no_truncation()
  if tokenizer.get_vocab_size(with_added_tokens=True) > model_config.vocab_size:
    raise ValueError(f"the tokenizer of {tokenizer_path!r} has {tokenizer.get_vocab_size(with_added_tokens=True)} "
                     f"tokens but the model's vocabulary holds {model_config.vocab_size}; use the model's tokenizer")
  chat_folder = tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(tokenizer_path) or "."
  # Packed pairs must not attend to each other, whatever document masking the checkpoint was pretrained with.
  return Decoder(dataclasses.replace(model_config, document_mask=True, **precision), tokenizer, params, chat_folder)


def with_source_model(config: Config) -> Config:
  """`config` with the model init_from holds, read from its config.json alone (no weights) in the config's precision,
  and validated: the kernels and the mesh checks then see the checkpoint's model (its window, soft-capping, layer
  pattern) rather than the experiment file's placeholder. A folder that is neither kind is load_decoder's error."""
  source, m = config.init_from, config.model
  precision = dict(compute_dtype=m.compute_dtype, param_dtype=m.param_dtype)
  if not source or not os.path.isdir(source):
    return config
  if os.path.isdir(os.path.join(source, "checkpoints")) and os.path.isfile(os.path.join(source, "config.json")):
    model = config_lib.from_run_file(os.path.join(source, "config.json")).model
  elif os.path.isfile(os.path.join(source, "config.json")):
    model = hf_config.model_config_from_file(source, **precision)
  else:
    return config
  if model.flavour not in FLAVOURS:
    return config  # load_decoder names the problem
  config = dataclasses.replace(config, model=dataclasses.replace(model, document_mask=True, **precision))
  _check_seq_len(config.data.seq_len, config.model)
  config_lib.validate(config)
  return config


def _check_seq_len(seq_len: int, model: ModelConfig) -> None:
  if seq_len > model.max_seq_len:
    raise ValueError(f"data.seq_len={seq_len} exceeds the model's {model.max_seq_len} positions; lower "
                     f"data.seq_len or set it to 0 to choose it from the data")


def instruction_tune(config: Config, workdir: str, stop_at_step: int | None = None) -> dict:
  """Instruction-tunes (or resumes) a decoder into `workdir`; returns the final evaluation (also in eval.json)."""
  with reliability.StopSignals() as stop:
    started = time.time()
    config, mesh, kernels = loop.prepare_run(with_source_model(config), workdir, causal=True)
    config, task = instruction_task(config, workdir, mesh, kernels)
    return loop.run_loop(config, workdir, mesh, task, stop, stop_at_step, started)


def instruction_task(config: Config, workdir: str, mesh: Mesh, kernels: Kernels) -> tuple[Config, loop.Task]:
  """The run's config (its model from init_from, steps and seq_len fitted to the data) and its `loop.Task`."""
  t, d = config.train, config.data
  decoder = load_decoder(config, mesh)
  model_config = decoder.model_config
  _check_seq_len(d.seq_len, model_config)
  data = instr_data.build_instruction_data(d, decoder.tokenizer, t.seed, model_config.max_seq_len,
                                           decoder.chat_folder)
  derived_steps, chosen_seq_len = t.steps == 0, d.seq_len == 0
  t = data_defaults.resolve_learning_rate(t, config.lora.rank)
  t, d = data_defaults.resolve_steps(t, len(data.train)), dataclasses.replace(d, seq_len=data.seq_len)
  config = dataclasses.replace(config, model=model_config, train=t, data=d)
  stats = data.stats
  announce_data(config, workdir, decoder, stats, len(data.train), derived_steps, chosen_seq_len, "packed rows")

  optimizer = optim.make_optimizer(t)
  make_model = lambda rngs: GPT(model_config, kernels=kernels, rngs=rngs)
  graphdef, state, state_shardings, features = features_lib.train_state_from_config(config, mesh, optimizer, make_model)
  inputs, teacher_flops = None, 0.0
  if config.distill.teacher:  # the loss becomes the distillation objective; the teacher is a frozen step input
    teacher = distillation.load_teacher(config, d.seq_len, decoder.tokenizer, f"init_from={config.init_from!r}",
                                        "give a teacher of init_from's tokenizer and vocabulary")
    inputs = distillation.frozen_inputs(config, graphdef, teacher)
    teacher_flops = distillation.teacher_flops_per_token(teacher, d.seq_len)
  prepare = loop.Task.prepare  # the data's rows as they are
  if config.distill.teacher and config.distill.on_policy:
    prepare = distillation.OnPolicyRows(config, graphdef, features, state_shardings, mesh, data.train_prompts,
                                        data.stop_ids, decoder.tokenizer.token_to_id("<pad>") or data.eos_id,
                                        d.seq_len)
  train_step, eval_step = steps_lib.jit_steps(graphdef, optimizer, config, mesh, state_shardings, features,
                                              inputs=inputs)
  eval_batches = instr_data.eval_batches(data.eval, t.batch_size, jax.process_index(), jax.process_count())
  local_batch_size = t.batch_size // jax.process_count()
  latest: dict[str, float] = {}

  def start(state: TrainState, start_step: int) -> TrainState:
    if start_step == 0:
      if "frozen" in state:  # LoRA: the checkpoint becomes the frozen base, one leaf at a time
                             # (jaxlm/interop/streaming.py)
        state, _ = streaming.load_base(state, state_shardings, config.lora, make_model, mesh, decoder.params,
                                     config.init_from, t.seed)
      else:
        state["params"] = place_params(decoder.params, state["params"], state_shardings["params"], config.init_from)
      # The base model's held-out loss, kept in the workdir so that a resumed run still reports it.
      before = steps_lib.evaluate(eval_step, features.model_params(state), eval_batches, mesh)
      atomic_files.write_json_on_process_0(os.path.join(workdir, START_EVAL), before)
      if jax.process_index() == 0:
        print(f"init_from {config.init_from}: loaded; eval_loss before tuning {before['eval_loss']:.4f}", flush=True)
    decoder.params = None  # a resumed run never needs them
    return state

  def count(local: dict) -> dict[str, float]:
    """Every token slot of the global batch (the packed rows the step computes), its response tokens (those with a
    loss) and its FLOPs (a LoRA step's without the frozen weights' gradients: telemetry.flops_per_token)."""
    processes = jax.process_count()
    slots = float(local["inputs"].size) * processes
    return {"tokens": slots, "response_tokens": float(local["loss_mask"].sum()) * processes,
            "flops": slots * (telemetry.flops_per_token(model_config, local["inputs"].shape[1], lora=config.lora)
                              + teacher_flops)}

  def evaluate_step(step: int, params) -> dict[str, float]:
    latest.clear()
    latest.update(steps_lib.evaluate(eval_step, params, eval_batches, mesh))
    return dict(latest)

  def finish(end: loop.RunEnd) -> loop.Report:
    params = features.model_params(end.state)  # with LoRA: the adapted weights (lora.LoRAWeight values)
    examples = generated_examples(graphdef, params, decoder.tokenizer, data, config.log.sample_tokens,
                                  model_config, t.seed)
    saved = save_tuned_decoder(graphdef, params, decoder, workdir, config)
    result: dict[str, Any] = {f"start_{k}": v for k, v in read_json(os.path.join(workdir, START_EVAL)).items()}
    result.update({**latest, "step": t.steps, "seq_len": d.seq_len, "train_pairs": stats["train_pairs"],
                   "eval_pairs": stats["eval_pairs"], "train_rows": stats["train_rows"],
                   "final_train_loss": end.last.get("loss"), "init_from": config.init_from,
                   "wall_time_sec": end.facts["wall_time_sec"], "devices": jax.device_count()})
    result.update({k: v for k, v in end.rates.items() if k.endswith("_per_sec") or k == "mfu"})
    result.update(lora.state_bytes(end.state))  # per device: trainable params, optimizer state, frozen base
    result.update(saved)
    atomic_files.write_json_on_process_0(os.path.join(workdir, "eval.json"), result)
    summary = {**result, **{k: end.facts[k] for k in ("mesh", "device_kind", "peak_flops_per_device")}}
    return loop.Report(summary, result=result, data_stats=stats,
                        sections=[("Held-out prompts (greedy)", examples_markdown(examples))])

  return config, loop.Task(
      title="Instruction-tuning run", state=state, state_shardings=state_shardings, train_step=train_step,
      batches=make_train_iterator(data.train, local_batch_size, t.seed, d.shuffle), count=count,
      evaluate=evaluate_step, finish=finish, start=start, prepare=prepare, features=features)


def announce_data(config: Config, workdir: str, decoder: Decoder, stats: dict, num_train: int, derived_steps: bool,
                  chosen_seq_len: bool, unit: str) -> None:
  """The run's first lines (the truncation warning, the steps, the data table) and the tokenizer (with the chat
  template the examples were written with, if any) in the workdir, where init_from=<this workdir> reads them."""
  t, d = config.train, config.data
  data_defaults.print_on_process_0(seq_lengths.truncation_warning(
      stats["truncated_pairs"], stats["train_pairs"] + stats["eval_pairs"], d.seq_len, config.model.max_seq_len,
      chosen_seq_len))
  data_defaults.print_on_process_0(data_defaults.describe_steps(t, num_train, derived_steps, unit=unit))
  if jax.process_index() == 0:
    print("data: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()),
          flush=True)
    atomic_files.write_text(os.path.join(workdir, "tokenizer.json"), decoder.tokenizer.to_str(pretty=True))
    chat.copy_template(decoder.chat_folder, workdir)


def save_tuned_decoder(graphdef, params, decoder: Decoder, workdir: str, config: Config) -> dict:
  """<workdir>/hf_model/ (an HF folder with the tokenizer and chat template; LoRA: the merged weights) and, with
  LoRA, <workdir>/adapter/ (a PEFT folder); returns the LoRA settings for eval.json. Every process joins the
  gathers; process 0 writes."""
  hf_weights.save_pretrained(nnx.merge(graphdef, params), os.path.join(workdir, HF_MODEL))  # one weight at a time
  if jax.process_index() == 0:
    decoder.tokenizer.save(os.path.join(workdir, HF_MODEL, "tokenizer.json"))
    chat.copy_template(decoder.chat_folder, os.path.join(workdir, HF_MODEL))
  if not config.lora.rank:
    return {}
  # The adapters as a PEFT folder (peft.PeftModel.from_pretrained loads it onto the base).
  peft_folders.save_adapters(nnx.merge(graphdef, params), os.path.join(workdir, ADAPTER),
                             base_model_name_or_path=config.init_from)
  return dict(lora_rank=config.lora.rank, lora_alpha=config.lora.alpha, lora_targets=config.lora.targets,
              lora_base=config.lora.base)


def read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def place_params(source: dict, target: dict, shardings: dict, where: str, path: tuple = ()) -> dict:
  """The checkpoint's parameters on the train state's shardings; every parameter must be there, in its shape."""
  placed = {}
  for key, value in target.items():
    found = source.get(key) if isinstance(source, dict) else None
    name = "/".join(map(str, (*path, key)))
    if isinstance(value, dict):
      if not isinstance(found, dict):
        raise ValueError(f"init_from={where!r} has no parameters {name}/...; is it a decoder checkpoint?")
      placed[key] = place_params(found, value, shardings[key], where, (*path, key))
    elif found is None or found.shape != value.shape:
      raise ValueError(f"init_from={where!r} has {'no' if found is None else f'a {found.shape}'} parameter {name} "
                       f"for the model's {value.shape}; is it a decoder checkpoint?")
    else:
      placed[key] = jax.device_put(found.astype(value.dtype), shardings[key])
  return placed


def generated_examples(graphdef, params, tokenizer, data: instr_data.InstructionData, max_new_tokens: int,
                       model_config: ModelConfig, seed: int) -> list[tuple[str, str, str]]:
  """(prompt, reference, greedy response) for the first held-out examples, each ended by EOS or, under a chat
  template, an end-of-turn token; every process joins the jitted sampler."""
  examples = data.eval_examples[:GENERATED_EXAMPLES]
  prompts = [e.prompt or [data.eos_id] for e in examples]
  room = model_config.max_seq_len - max(map(len, prompts), default=0)  # gpt2's learned positions end there
  new_tokens = min(max_new_tokens, room)
  if not examples or new_tokens < 1:
    return []
  outputs = generate.generate(graphdef, params, prompts, new_tokens, stop_tokens=data.stop_ids, seed=seed)
  return [(e.text[0], e.text[1], tokenizer.decode([x for x in out if x not in data.stop_ids]))
          for e, out in zip(examples, outputs)]


def examples_markdown(examples: list[tuple[str, str, str]]) -> str:
  if not examples:
    return "No held-out prompt was answered (log.sample_tokens=0 or no room left in the position table)."
  fence = lambda text: "```\n" + text.replace("```", "`\u200b``") + "\n```"
  return "\n\n".join(f"**Prompt {i + 1}**\n\n{fence(p)}\n\nReference:\n\n{fence(r)}\n\nGenerated:\n\n{fence(g)}"
                     for i, (p, r, g) in enumerate(examples))
