"""Evaluate a decoder on lm-eval (EleutherAI's lm-evaluation-harness) tasks: the latest checkpoint of a jaxlm run,
or an HF checkpoint folder (as lm-eval's own CLI takes a model path).

  python experiments/lm_eval.py --workdir=runs/demo --make_demo_tasks=runs/demo/lm_eval_tasks
  python experiments/lm_eval.py --workdir=runs/demo --include_path=runs/demo/lm_eval_tasks \
      --tasks=stdlib_next_line,stdlib_line_completion,stdlib_perplexity --weights=weight_only --kv_cache=int8
  python experiments/lm_eval.py --init_from=path/to/hf_folder --include_path=my_tasks --tasks=my_task \
      --output=runs/lm_eval_hf.json

Reads the model like experiments/generate.py (--workdir: config.json, tokenizer.json, the newest checkpoint;
--init_from: an HF decoder folder with config.json + model.safetensors + tokenizer.json, in float32, or a jaxlm run
workdir, through jaxlm.recipes.trained_runs.load_decoder; give one of the two), wraps the decoder
as an lm-eval model (jaxlm.interop.lm_eval_model.JaxlmLM: loglikelihood, rolling loglikelihood, generate_until through
the KV cache, batched, on this host's devices) and runs `--tasks` (lm-eval task, group or tag names; `--include_path`
folders of task YAMLs come first). Writes <workdir>/lm_eval.json (flat `<task>/<metric>` numbers with the settings;
with --init_from, which only reads its folder, the file --output names, if any) and prints lm-eval's table.
`--weights` evaluates the int8 model (jaxlm.compress.quantization) instead of the float one; pruned or int8
checkpoints saved by experiments/optimize.py are scored from optimize.py itself (`--lm_eval_tasks`).
A model whose folder holds a chat template (an instruction-tuning run of a checkpoint with one, an HF chat model)
ends generations at the template's end-of-turn tokens; `--apply_chat_template` also writes each request as a
conversation under it (lm-eval's option of that name: few-shot examples as earlier turns, `--system_instruction` as
a system turn).

Without a network, use tasks defined from local files (dataset_path: json with dataset_kwargs.data_files); a task
whose data is on the Hugging Face hub stops with a one-line error naming it. `--make_demo_tasks=DIR` writes three
such tasks from the run's held-out documents of the Python stdlib corpus (the demo's data):
  stdlib_next_line        multiple choice: which of 4 lines follows the 3 lines before it (acc, acc_norm)
  stdlib_line_completion  generate_until "\\n": the rest of a line from its first half (exact_match)
  stdlib_perplexity       loglikelihood_rolling over held-out documents (word/byte perplexity, bits per byte)
Runtime: 1.5-3 minutes for the demo model and the three demo tasks on a shared 2-core CPU (docs/optimization.md).
"""

from __future__ import annotations

import json
import os
import sys

import jax
from absl import flags, logging

from jaxlm import cli
from jaxlm.inference import generate
from jaxlm.recipes import trained_runs
from jaxlm.training import atomic_files

_WORKDIR = flags.DEFINE_string("workdir", None, "training run folder (config.json, tokenizer.json, checkpoints/)")
_INIT_FROM = flags.DEFINE_string("init_from", None, f"instead of --workdir: {trained_runs.FOLDER_HELP}; only read")
_TASKS = flags.DEFINE_list("tasks", [], "lm-eval task, group or tag names")
_INCLUDE = flags.DEFINE_multi_string("include_path", [], "folder of task YAMLs (repeatable)")
_LIMIT = flags.DEFINE_integer("limit", 0, "documents per task (0 = all)")
_FEWSHOT = flags.DEFINE_integer("num_fewshot", -1, "few-shot examples per prompt (-1 = the task's default)")
_BATCH = flags.DEFINE_integer("batch_size", 8, "requests per forward / generation batch")
_KV_CACHE = flags.DEFINE_enum("kv_cache", "float", list(generate.KV_CACHES), "generate_until's KV cache")
_WEIGHTS = flags.DEFINE_enum("weights", "float", list(trained_runs.WEIGHTS),
                             "float (as trained) or int8 weights (jaxlm.compress.quantization's weight_only or "
                             "w8a8_dynamic)")
_TENSOR = flags.DEFINE_integer("mesh_tensor", 1, "devices that split heads (the other devices split the batch)")
_BOOTSTRAP = flags.DEFINE_integer("bootstrap_iters", 1000, "lm-eval's bootstrap resamples for the standard errors "
                                  "of non-mean metrics (perplexities); 0 = none")
_OUTPUT = flags.DEFINE_string("output", "", "JSON file for the metrics (default: <workdir>/lm_eval.json with "
                              "--workdir, none with --init_from)")
_APPLY_CHAT = flags.DEFINE_bool("apply_chat_template", False, "write each request as a conversation under the chat "
                                "template in the model's folder (chat_template.jinja or tokenizer_config.json's)")
_SYSTEM = flags.DEFINE_string("system_instruction", "", "with --apply_chat_template: a system turn before each request")
_MAKE_DEMO = flags.DEFINE_string("make_demo_tasks", "", "write the stdlib demo tasks (YAMLs + data) to this folder "
                                 "and exit")

DEMO_CHOICES = 4
DEMO_CONTEXT_LINES = 3


def _usable_lines(document: str) -> list[str]:
  return [line for line in document.splitlines() if 16 <= len(line.strip()) <= 80]


def write_demo_tasks(workdir: str, folder: str, max_examples: int = 200) -> list[str]:
  """Writes the three stdlib demo tasks (see the module docstring) from the run's held-out documents; returns their
  names. The held-out documents are the ones train_lm.py held out (the last data.eval_fraction of the corpus)."""
  import numpy as np  # noqa: PLC0415

  from jaxlm import config as config_lib  # noqa: PLC0415
  from jaxlm.data.corpora.sources import read_documents  # noqa: PLC0415

  config = config_lib.from_run_file(os.path.join(workdir, "config.json"))
  if config.data.source != "demo":
    raise ValueError(f"--make_demo_tasks reads the demo corpus, but {workdir} trained on data.source="
                     f"{config.data.source!r}; define tasks from your own files instead")
  documents, _ = read_documents(config.data, "train")
  held_out = documents[-min(len(documents) - 1, max(1, round(config.data.eval_fraction * len(documents)))):]
  rng = np.random.default_rng(0)
  pool = [line for doc in held_out for line in _usable_lines(doc)]
  choice_rows, completion_rows = [], []
  for doc in held_out:
    lines = doc.splitlines()
    for i in range(DEMO_CONTEXT_LINES, len(lines)):
      line = lines[i]
      if not 16 <= len(line.strip()) <= 80 or any(not l.strip() for l in lines[i - DEMO_CONTEXT_LINES:i]):
        continue
      # The newline starts each choice: the byte-level BPE merges a newline with the next line's indentation, so a
      # context ending in one would not be a token boundary.
      context = "\n".join(lines[i - DEMO_CONTEXT_LINES:i])
      distractors = [d for d in rng.choice(pool, DEMO_CHOICES + 2, replace=False) if d != line][:DEMO_CHOICES - 1]
      answer = int(rng.integers(DEMO_CHOICES))
      choice_rows.append({"context": context, "answer": answer,
                          "choices": ["\n" + c for c in distractors[:answer] + [line] + distractors[answer:]]})
      # Cut before a space near the middle: BPE tokens carry their leading space, so a prompt ending in a space or
      # inside a word would ask for a tokenization the model never saw.
      cut = line.rfind(" ", len(line) - len(line.lstrip()) + 1, len(line) // 2 + 1)
      completion_rows.append({"prompt": context + "\n" + line[:cut], "target": line[cut:]} if cut > 0 else None)
  order = [i for i in rng.permutation(len(choice_rows)) if completion_rows[i] is not None][:max_examples]
  chunks = [doc[i:i + 2000] for doc in held_out for i in range(0, len(doc), 2000)]  # a document per 2000 chars
  texts = [{"text": chunk} for chunk in chunks if chunk.strip()][:max_examples // 4]
  os.makedirs(folder, exist_ok=True)
  data = {"stdlib_next_line": [choice_rows[i] for i in order],
          "stdlib_line_completion": [completion_rows[i] for i in order], "stdlib_perplexity": texts}
  bodies = {
      "stdlib_next_line": ("output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
                           "doc_to_target: '{{answer}}'\ntarget_delimiter: ''\nmetric_list:\n"
                           "  - metric: acc\n  - metric: acc_norm\n"),
      "stdlib_line_completion": ("output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
                                 "target_delimiter: ''\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 48\n"
                                 "metric_list:\n  - metric: exact_match\n"),
      "stdlib_perplexity": ("output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                            "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
                            "  - metric: bits_per_byte\n"),
  }
  for name, rows in data.items():
    data_file = os.path.abspath(os.path.join(folder, f"{name}.jsonl"))
    atomic_files.write_text(data_file, "".join(json.dumps(row) + "\n" for row in rows))
    atomic_files.write_text(os.path.join(folder, f"{name}.yaml"), (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(data_file)}\n"
        f"test_split: test\n{bodies[name]}metadata:\n  version: 1.0\n"))
  print(f"wrote {', '.join(f'{n} ({len(r)} examples)' for n, r in data.items())} to {folder}")
  return list(data)


def main(argv):
  del argv  # flags only: cli.run refuses positional arguments
  logging.set_verbosity(logging.WARNING)
  if not _MAKE_DEMO.value:  # everything but writing the demo tasks runs lm-eval, the `eval` extra
    try:
      from jaxlm.interop import lm_eval_model  # noqa: PLC0415
    except ImportError as error:
      sys.exit(f"error: {error}")  # its message says to pip install -e '.[eval]'
  folder = trained_runs.chosen_folder(_WORKDIR.value, _INIT_FROM.value)
  if _MAKE_DEMO.value:
    if not trained_runs.is_jaxlm_run(folder):
      raise ValueError(f"--make_demo_tasks writes tasks from a demo run's held-out data; {folder} is no jaxlm run")
    write_demo_tasks(folder, _MAKE_DEMO.value)
    return
  if not _TASKS.value:
    raise ValueError("--tasks is empty; name lm-eval tasks (e.g. --tasks=stdlib_next_line with --include_path)")
  if _INIT_FROM.value:
    trained_runs.check_decoder_folder(folder)  # an encoder or a folder of neither kind fails before lm-eval loads
  else:
    trained_runs.check_not_hf_folder(folder)

  from jaxlm.data.tuning import chat  # noqa: PLC0415

  chat_folder = folder if chat.load(folder) is not None else None
  if _APPLY_CHAT.value and chat_folder is None:
    raise ValueError(f"--apply_chat_template needs a chat template in {folder} (chat_template.jinja or "
                     "tokenizer_config.json's chat_template); instruction-tuning runs copy their checkpoint's")
  manager = lm_eval_model.task_manager(_TASKS.value, _INCLUDE.value)  # bad task names fail before the model loads
  lm_eval_model.check_offline(manager, _TASKS.value)
  if _WORKDIR.value:
    _, graphdef, params, tokenizer, step = trained_runs.load_decoder_run(folder, _TENSOR.value)
  else:
    _, graphdef, params, tokenizer, step = trained_runs.load_decoder(folder, _TENSOR.value)
  graphdef, params = trained_runs.with_weights(graphdef, params, _WEIGHTS.value)
  lm = lm_eval_model.JaxlmLM(graphdef, params, tokenizer, batch_size=_BATCH.value, kv_cache=_KV_CACHE.value,
                             chat_folder=chat_folder)
  results = lm_eval_model.evaluate(lm, _TASKS.value, include_path=_INCLUDE.value, limit=_LIMIT.value or None,
                             num_fewshot=None if _FEWSHOT.value < 0 else _FEWSHOT.value,
                             bootstrap_iters=_BOOTSTRAP.value, manager=manager,
                             apply_chat_template=_APPLY_CHAT.value, system_instruction=_SYSTEM.value or None)
  from lm_eval.utils import make_table  # noqa: PLC0415

  print(make_table(results))
  flat = {"checkpoint_step": step, "model": folder, "tasks": ",".join(_TASKS.value), "weights": _WEIGHTS.value,
          "kv_cache": _KV_CACHE.value, "limit": _LIMIT.value, "num_fewshot": _FEWSHOT.value,
          "apply_chat_template": _APPLY_CHAT.value,
          "command": "python experiments/lm_eval.py " + " ".join(sys.argv[1:]),
          "device_kind": jax.devices()[0].device_kind, "devices": jax.device_count()}
  flat.update(lm_eval_model.flat_metrics(results))
  output = _OUTPUT.value or (os.path.join(_WORKDIR.value, "lm_eval.json") if _WORKDIR.value else "")
  if output:
    atomic_files.write_json_on_process_0(output, flat)


if __name__ == "__main__":
  cli.run(main)
