"""Running experiment scripts: `cli.run(main)` instead of `absl.app.run(main)`.

ml_collections parses `--config.section.key=value` overrides inside absl's flag parsing, and a key the config does
not have surfaces there as a bare `AttributeError: "'foo'"` with a traceback. `run` checks every override against
the config file first and stops with one line that names the key and what the section does have. It also starts the
process with transparent huge pages for glibc's malloc (`use_huge_page_malloc`), part of the CPU's fast path.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os
import sys
from typing import Callable, Sequence

from absl import app

_PREFIX = "--config."
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"


def use_huge_page_malloc() -> None:
  """Re-executes this process with GLIBC_TUNABLES asking malloc for transparent huge pages (glibc >= 2.35 reads it;
  older ones ignore it). XLA:CPU allocates each step's large temporaries afresh, and with 4 KiB pages every step
  paid page faults and TLB misses for them. glibc reads the variable only at start-up, hence the exec (same PID, so
  launchers and signals are unaffected). JAXLM_NO_HUGE_PAGES=1 opts out."""
  tunables = os.environ.get("GLIBC_TUNABLES", "")
  if (not sys.platform.startswith("linux") or HUGE_PAGE_TUNABLE in tunables
      or os.environ.get("JAXLM_NO_HUGE_PAGES")):
    return
  os.environ["GLIBC_TUNABLES"] = ":".join(filter(None, [tunables, HUGE_PAGE_TUNABLE]))
  os.execv(sys.executable, sys.orig_argv)


def _config_file(argv: Sequence[str]):
  """The ConfigDict that `--config=<file>` in argv builds, or None when there is no such file."""
  config_path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  if not config_path or not os.path.isfile(config_path.split(":", 1)[0]):
    return None  # no file to check against: absl/ml_collections report their own errors
  spec = importlib.util.spec_from_file_location("_jaxlm_cli_config", config_path.split(":", 1)[0])
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def unknown_override(argv: Sequence[str], config=None) -> str | None:
  """The one-line error for the first `--config.*` override that the `--config=<file>` does not define, or None."""
  overrides = [a[len(_PREFIX):].split("=", 1)[0] for a in argv if a.startswith(_PREFIX)]
  config = config if config is not None else (_config_file(argv) if overrides else None)
  if config is None:
    return None
  for key in overrides:
    node = config
    for depth, name in enumerate(key.split(".")):
      if not hasattr(node, "keys") or name not in node.keys():
        where = ".".join(key.split(".")[:depth]) or "the config"
        known = sorted(node.keys()) if hasattr(node, "keys") else []
        close = difflib.get_close_matches(name, known, n=1)
        hint = f'did you mean "{close[0]}"? ' if close else ""
        return (f"unknown flag --config.{key}: {where} has no '{name}'; {hint}"
                f"it has: {', '.join(known) or 'no sub-keys'}")
      node = node[name]
  return None


def quote_comma_lists(argv: Sequence[str], config) -> list[str]:
  """`--config.key=a:b,c.py:d` for a tuple key, quoted as one string: ml_collections reads a tuple override as a
  Python literal and refuses a comma list that is not one (':' is a syntax error there); jaxlm.config splits the
  string at its commas, as it does for `--config.key=a,b`."""
  quoted = []
  for arg in argv:
    key, _, value = arg[len(_PREFIX):].partition("=")
    if arg.startswith(_PREFIX) and "," in value and isinstance(_default(config, key), tuple):
      try:
        ast.literal_eval(value)
      except (ValueError, SyntaxError):
        arg = f"{_PREFIX}{key}={value!r}"
    quoted.append(arg)
  return quoted


def _default(config, key: str):
  node = config
  for name in key.split("."):
    if not hasattr(node, "keys") or name not in node.keys():
      return None
    node = node[name]
  return node


def run(main: Callable[[list[str]], None], argv: Sequence[str] | None = None) -> None:
  """absl's app.run, plus: unknown `--config.*` keys are refused before parsing, so are positional arguments (the
  scripts take flags only), and the input errors jaxlm raises (ValueError, missing files) end the script with
  their one-line message (a run stopped by non-finite steps too) instead of a traceback (JAXLM_TRACEBACK=1 keeps the
  traceback, for debugging)."""
  if argv is None:  # the process's own command line: safe to run again
    use_huge_page_malloc()
  argv = list(sys.argv if argv is None else argv)
  config = _config_file(argv) if any(a.startswith(_PREFIX) for a in argv) else None
  if error := unknown_override(argv, config):
    sys.exit(f"error: {error}")
  if config is not None:
    argv = quote_comma_lists(argv, config)  # absl parses these values; ml_collections reads only the keys' names

  def main_with_one_line_errors(args):
    if len(args) > 1:
      raise app.UsageError(f"unexpected arguments: {' '.join(args[1:])}")
    try:
      return main(args)
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
      if os.environ.get("JAXLM_TRACEBACK"):
        raise
      sys.exit(f"error: {e} ({type(e).__name__}; JAXLM_TRACEBACK=1 shows where)")

  app.run(main_with_one_line_errors, argv=argv)
