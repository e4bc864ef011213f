"""Prompt/response pairs built offline for instruction tuning a decoder: a Python function's signature (the prompt)
and the first line of its docstring (the response), from the standard library's sources.

  python experiments/docstring_pairs.py --out=runs/docstring_pairs     # writes train.jsonl and eval.jsonl

A prompt is `def name(arguments):` and the opening quotes of a docstring on the next line; the response is the
docstring's first line and the closing quotes, as the function's author wrote them. Every source file goes whole to
one split (one file in ten, chosen by a hash of its path, to eval), so held-out prompts are functions of files the
training pairs never came from. Pairs with a first line shorter than 20 or longer than 100 characters, or a
signature longer than 80, are left out. The files are those of the demo corpus
(jaxlm.data.corpora.sources.demo_files), so `make demo`'s model knows the language and style of the pairs; another Python version gives a somewhat different set.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import warnings

from absl import app, flags

from jaxlm.data.corpora.sources import demo_files

EVAL_SHARE = 10  # one file in EVAL_SHARE goes to eval
MAX_SIGNATURE_CHARS = 80
RESPONSE_CHARS = (20, 100)  # shortest and longest docstring first line kept


def function_pairs(path: str) -> list[tuple[str, str]]:
  """(prompt, response) for every function in `path` whose docstring starts on its opening line."""
  with open(path, encoding="utf-8") as f:
    source = f.read()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", SyntaxWarning)  # old modules' invalid escapes in plain strings
    tree = ast.parse(source)
  pairs = []
  for node in ast.walk(tree):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    docstring = ast.get_docstring(node, clean=False)
    if not docstring or not docstring.strip() or docstring[0].isspace():
      continue
    first_line = docstring.split("\n")[0].strip()
    signature = (f"{'async ' if isinstance(node, ast.AsyncFunctionDef) else ''}"
                 f"def {node.name}({ast.unparse(node.args)}):")
    if len(signature) > MAX_SIGNATURE_CHARS or not RESPONSE_CHARS[0] <= len(first_line) <= RESPONSE_CHARS[1]:
      continue
    pairs.append((f'{signature}\n    """', f'{first_line}"""'))
  return pairs


def docstring_pair_rows(max_train: int = 3000, max_eval: int = 200, seed: int = 0) -> dict[str, list[dict]]:
  """{"train": [{"prompt", "response"}], "eval": [...]}: seeded samples of at most max_train / max_eval pairs."""
  rows: dict[str, list[dict]] = {"train": [], "eval": []}
  seen = set()
  for path in demo_files():
    split = "eval" if int(hashlib.sha256(os.path.basename(path).encode()).hexdigest(), 16) % EVAL_SHARE == 0 \
        else "train"
    try:
      pairs = function_pairs(path)
    except (SyntaxError, UnicodeDecodeError, ValueError):
      continue  # a few standard-library files are templates or in other encodings
    for prompt, response in pairs:
      if prompt not in seen:  # one pair per signature: overloads and repeats across files would leak into eval
        seen.add(prompt)
        rows[split].append({"prompt": prompt, "response": response})
  rng = random.Random(seed)
  for split, cap in (("train", max_train), ("eval", max_eval)):
    rng.shuffle(rows[split])
    rows[split] = rows[split][:cap]
  return rows


def write_docstring_pairs(folder: str, max_train: int = 3000, max_eval: int = 200, seed: int = 0) -> tuple[str, str]:
  """Writes <folder>/train.jsonl and <folder>/eval.jsonl (keys prompt, response) and returns their paths."""
  os.makedirs(folder, exist_ok=True)
  paths = []
  for split, split_rows in docstring_pair_rows(max_train, max_eval, seed).items():
    path = os.path.join(folder, f"{split}.jsonl")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      f.writelines(json.dumps(row) + "\n" for row in split_rows)
    os.replace(path + ".tmp", path)
    paths.append(path)
  return paths[0], paths[1]


def main(argv):
  del argv
  for path in write_docstring_pairs(_OUT.value, _MAX_TRAIN.value, _MAX_EVAL.value, _SEED.value):
    with open(path, encoding="utf-8") as f:
      print(f"{path}: {sum(1 for _ in f)} pairs")


if __name__ == "__main__":  # flags only when run: importers (tests, benchmarks) keep their own --out
  _OUT = flags.DEFINE_string("out", "runs/docstring_pairs", "folder for train.jsonl and eval.jsonl")
  _MAX_TRAIN = flags.DEFINE_integer("max_train", 3000, "training pairs at most (a seeded sample)")
  _MAX_EVAL = flags.DEFINE_integer("max_eval", 200, "held-out pairs at most (a seeded sample)")
  _SEED = flags.DEFINE_integer("seed", 0, "seed of the samples")
  app.run(main)
