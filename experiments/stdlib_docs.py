"""A labelled set of real English built offline: the first paragraphs of the Python standard library's docstrings
(modules, classes, functions), each labelled with the area of the library it documents (8 classes).

  python experiments/stdlib_docs.py --out=runs/stdlib_docs      # writes train.csv, eval.csv (text,label),
                                                                # unlabelled.csv

The areas group modules as the library reference does: concurrency (asyncio, multiprocessing, threading, ...), files
(pathlib, shutil, zipfile, csv, ...), imports (importlib, pkgutil, runpy, ...), internet (email, http, urllib, ...),
language (ast, typing, functools, collections, ...), markup (xml, html), testing (unittest, doctest, pdb, ...) and
text (re, string, codecs, ...). Every source file goes whole to one split (a quarter of each area's files, chosen by
a hash of the path, to eval), so the held-out rows are docstrings of code the training rows never saw. Paragraphs
of fewer than 8 words and repeated paragraphs are dropped. The rows come from the running interpreter's standard
library, so another Python version gives a somewhat different set; the row counts are printed.

unlabelled.csv (column text) holds every docstring paragraph of the library's other files, those of no held-out
file and none that eval.csv holds: text of the task's domain without labels, for distilling a fine-tuned model into
a pruned one (experiments/optimize.py --prune_distill_files).
"""

from __future__ import annotations

import ast
import csv
import hashlib
import os
import random
import sysconfig
import warnings

from absl import app, flags

AREAS = {
    "concurrency": ("asyncio", "multiprocessing", "concurrent", "threading", "queue", "subprocess", "sched",
                    "selectors", "_threading_local", "signal", "asyncore", "asynchat"),
    "files": ("pathlib", "shutil", "tempfile", "glob", "fnmatch", "zipfile", "tarfile", "gzip", "bz2", "lzma", "csv",
              "configparser", "filecmp", "fileinput", "os", "ntpath", "posixpath", "genericpath", "shelve", "dbm",
              "netrc", "plistlib", "zipapp", "mailcap", "chunk", "wave", "aifc", "sunau"),
    "imports": ("importlib", "pkgutil", "modulefinder", "runpy", "zipimport", "site", "sysconfig", "imp", "venv"),
    "internet": ("email", "http", "urllib", "xmlrpc", "wsgiref", "smtplib", "imaplib", "poplib", "ftplib", "mailbox",
                 "mimetypes", "socketserver", "nntplib", "ipaddress", "webbrowser", "uu", "quopri", "base64",
                 "telnetlib", "smtpd", "cgi"),
    "language": ("ast", "dis", "inspect", "typing", "types", "abc", "functools", "operator", "dataclasses", "enum",
                 "copy", "pickle", "copyreg", "collections", "contextlib", "weakref", "reprlib", "pprint", "numbers",
                 "decimal", "fractions", "statistics", "random", "heapq", "bisect", "_collections_abc", "_pydecimal",
                 "symtable", "code", "codeop", "compileall", "py_compile", "opcode"),
    "markup": ("xml", "html"),
    "testing": ("unittest", "doctest", "pdb", "bdb", "trace", "timeit", "cProfile", "profile", "pstats",
                "tracemalloc"),
    "text": ("string", "re", "textwrap", "difflib", "stringprep", "gettext", "locale", "codecs", "encodings", "shlex",
             "tokenize", "token", "keyword"),
}
MIN_WORDS = 8  # shorter first paragraphs ("Return the name.") say too little about their area
EVAL_SHARE = 4  # one file in EVAL_SHARE goes to eval
_SKIP_DIRS = {"test", "tests", "idle_test", "__pycache__"}



def source_files(stdlib: str, module: str) -> list[str]:
  """The .py files of a standard-library module or package (tests excluded), sorted; empty if absent."""
  path = os.path.join(stdlib, module)
  if os.path.isfile(path + ".py"):
    return [path + ".py"]
  found = []
  for root, dirs, names in os.walk(path):
    dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
    found.extend(os.path.join(root, n) for n in sorted(names) if n.endswith(".py"))
  return found


def docstring_paragraphs(path: str, first_only: bool = True) -> list[str]:
  """The first paragraph (or every one), whitespace collapsed and of at least MIN_WORDS words, of every module, class
  and function docstring in `path`."""
  with open(path, encoding="utf-8") as f:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", SyntaxWarning)  # old modules' invalid escapes in plain strings
      tree = ast.parse(f.read())
  paragraphs = []
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      docstring = ast.get_docstring(node)
      for paragraph in (docstring or "").split("\n\n")[:1 if first_only else None]:
        paragraph = " ".join(paragraph.split())
        if len(paragraph.split()) >= MIN_WORDS:
          paragraphs.append(paragraph)
  return paragraphs


def area_split(stdlib: str, label: str) -> tuple[list[str], set[str]]:
  """An area's source files and the quarter of them held out for eval."""
  files = [p for module in AREAS[label] for p in source_files(stdlib, module)]
  # A hash of the relative path, not the position in the list, decides the split: adding a module moves no file.
  rank = {p: hashlib.sha256(os.path.relpath(p, stdlib).encode()).hexdigest() for p in files}
  return files, set(sorted(files, key=rank.get)[::EVAL_SHARE])


def stdlib_doc_rows(max_train_per_class: int = 250, seed: int = 0,
                    stdlib: str | None = None) -> dict[str, list[tuple[str, str]]]:
  """{"train": [(text, label)], "eval": [...]}, each shuffled (module docstring)."""
  stdlib = stdlib or sysconfig.get_paths()["stdlib"]
  rows: dict[str, list[tuple[str, str]]] = {"train": [], "eval": []}
  seen: set[str] = set()
  rng = random.Random(seed)
  for label in sorted(AREAS):
    files, held_out = area_split(stdlib, label)
    per_split: dict[str, list[str]] = {"train": [], "eval": []}
    for path in sorted(files, key=lambda p: p not in held_out):  # train files first: a repeat is dropped from eval
      for text in docstring_paragraphs(path):
        if text not in seen:
          seen.add(text)
          per_split["eval" if path in held_out else "train"].append(text)
    train = per_split["train"]
    if max_train_per_class and len(train) > max_train_per_class:
      train = rng.sample(train, max_train_per_class)
    rows["train"].extend((text, label) for text in train)
    rows["eval"].extend((text, label) for text in per_split["eval"])
  for split in rows.values():
    rng.shuffle(split)
  return rows


def unlabelled_texts(eval_texts: set[str], seed: int = 0, stdlib: str | None = None) -> list[str]:
  """Every docstring paragraph of the library outside the held-out files, none of `eval_texts`, shuffled."""
  stdlib = stdlib or sysconfig.get_paths()["stdlib"]
  held_out = set().union(*(area_split(stdlib, label)[1] for label in AREAS))
  texts, seen = [], set(eval_texts)
  for root, dirs, names in os.walk(stdlib):
    dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS | {"site-packages"})
    for path in (os.path.join(root, n) for n in sorted(names) if n.endswith(".py")):
      if path in held_out:
        continue
      try:
        paragraphs = docstring_paragraphs(path, first_only=False)
      except (SyntaxError, UnicodeDecodeError):  # a few data files in the library are not Python 3 or not UTF-8
        continue
      for text in paragraphs:
        if text not in seen:
          seen.add(text)
          texts.append(text)
  random.Random(seed).shuffle(texts)
  return texts


def write_stdlib_docs_dataset(folder: str, max_train_per_class: int = 250, seed: int = 0) -> tuple[str, str, str]:
  """Writes <folder>/train.csv and <folder>/eval.csv (columns text,label) and <folder>/unlabelled.csv (text);
  returns their paths."""
  os.makedirs(folder, exist_ok=True)
  rows = stdlib_doc_rows(max_train_per_class, seed)
  rows["unlabelled"] = [(text,) for text in unlabelled_texts({text for text, _ in rows["eval"]}, seed)]
  paths = []
  for split, split_rows in rows.items():
    path = os.path.join(folder, f"{split}.csv")
    with open(path, "w", newline="", encoding="utf-8") as f:
      writer = csv.writer(f)
      writer.writerow(["text", "label"] if split != "unlabelled" else ["text"])
      writer.writerows(split_rows)
    paths.append(path)
  return paths[0], paths[1], paths[2]


def main(argv):
  del argv
  train, eval_, unlabelled = write_stdlib_docs_dataset(_OUT.value, _MAX_TRAIN_PER_CLASS.value, _SEED.value)
  with open(unlabelled, encoding="utf-8") as f:
    print(f"{unlabelled}: {sum(1 for _ in csv.DictReader(f))} rows without labels")
  for path in (train, eval_):
    with open(path, encoding="utf-8") as f:
      counts: dict[str, int] = {}
      for row in csv.DictReader(f):
        counts[row["label"]] = counts.get(row["label"], 0) + 1
    print(f"{path}: {sum(counts.values())} rows, {', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}")


if __name__ == "__main__":  # flags only when run: importers (benchmarks, tests) keep their own --out
  _OUT = flags.DEFINE_string("out", "runs/stdlib_docs", "folder for train.csv and eval.csv")
  _MAX_TRAIN_PER_CLASS = flags.DEFINE_integer("max_train_per_class", 250, "cap on training rows per class (seeded "
                                              "sample; 0 = all)")
  _SEED = flags.DEFINE_integer("seed", 0, "seed of the row sample and order")
  app.run(main)
