"""A labelled set of real English built offline: the first paragraphs of the Python standard library's docstrings
(modules, classes, functions), each labelled with the area of the library it documents (8 classes).

  python experiments/stdlib_docs.py --out=runs/stdlib_docs      # writes train.csv and eval.csv (text,label)

The areas group modules as the library reference does: concurrency (asyncio, multiprocessing, threading, ...), files
(pathlib, shutil, zipfile, csv, ...), imports (importlib, pkgutil, runpy, ...), internet (email, http, urllib, ...),
language (ast, typing, functools, collections, ...), markup (xml, html), testing (unittest, doctest, pdb, ...) and
text (re, string, codecs, ...). Every source file goes whole to one split (a quarter of each area's files, chosen by
a hash of the path, to eval), so the held-out rows are docstrings of code the training rows never saw. Paragraphs
of fewer than 8 words and repeated paragraphs are dropped. The rows come from the running interpreter's standard
library, so another Python version gives a somewhat different set; the row counts are printed.
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


def first_paragraphs(path: str) -> list[str]:
  """The first paragraph (whitespace collapsed) of every module, class and function docstring in `path`."""
  with open(path, encoding="utf-8") as f:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", SyntaxWarning)  # old modules' invalid escapes in plain strings
      tree = ast.parse(f.read())
  paragraphs = []
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      docstring = ast.get_docstring(node)
      if docstring:
        paragraph = " ".join(docstring.split("\n\n")[0].split())
        if len(paragraph.split()) >= MIN_WORDS:
          paragraphs.append(paragraph)
  return paragraphs


def stdlib_doc_rows(max_train_per_class: int = 250, seed: int = 0,
                    stdlib: str | None = None) -> dict[str, list[tuple[str, str]]]:
  """{"train": [(text, label)], "eval": [...]}, each shuffled (module docstring)."""
  stdlib = stdlib or sysconfig.get_paths()["stdlib"]
  rows: dict[str, list[tuple[str, str]]] = {"train": [], "eval": []}
  seen: set[str] = set()
  rng = random.Random(seed)
  for label in sorted(AREAS):
    files = [p for module in AREAS[label] for p in source_files(stdlib, module)]
    # A hash of the relative path, not the position in the list, decides the split: adding a module moves no file.
    rank = {p: hashlib.sha256(os.path.relpath(p, stdlib).encode()).hexdigest() for p in files}
    ordered = sorted(files, key=rank.get)
    held_out = set(ordered[::EVAL_SHARE])
    per_split: dict[str, list[str]] = {"train": [], "eval": []}
    for path in sorted(files, key=lambda p: p not in held_out):  # train files first: a repeat is dropped from eval
      for text in first_paragraphs(path):
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


def write_stdlib_docs_dataset(folder: str, max_train_per_class: int = 250, seed: int = 0) -> tuple[str, str]:
  """Writes <folder>/train.csv and <folder>/eval.csv (columns text,label) and returns their paths."""
  os.makedirs(folder, exist_ok=True)
  paths = []
  for split, split_rows in stdlib_doc_rows(max_train_per_class, seed).items():
    path = os.path.join(folder, f"{split}.csv")
    with open(path, "w", newline="", encoding="utf-8") as f:
      writer = csv.writer(f)
      writer.writerow(["text", "label"])
      writer.writerows(split_rows)
    paths.append(path)
  return paths[0], paths[1]


def main(argv):
  del argv
  train, eval_ = write_stdlib_docs_dataset(_OUT.value, _MAX_TRAIN_PER_CLASS.value, _SEED.value)
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
