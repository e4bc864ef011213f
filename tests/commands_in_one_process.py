"""Many `python <script> <flags>` commands run in one Python process, one after another: one interpreter start-up and
one import of jax for all of them instead of one each.

Each command runs its script as __main__ with the script's folder first on sys.path (as `python <script>` does), file
descriptors 1 and 2 captured apart (C-level output counts too) and its exit status taken from SystemExit as the
interpreter would; after it, the absl flags the script defined are deleted and every flag's value is reset, so the
next script parses its command line as a fresh process would. For tests whose property is what a command prints and
its exit status; where the process itself is the point (a signal, several processes) a test keeps its own.

  run_commands({"name": ["experiments/train_lm.py", "--config=...", ...]}) -> {"name": Finished(returncode, ...)}
"""

import dataclasses
import json
import os
import runpy
import subprocess
import sys
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Finished:
  returncode: int
  stdout: str
  stderr: str


def run_commands(commands: dict, env: dict | None = None, timeout: float = 300) -> dict:
  """{name: argv (script path relative to the repository root, then its flags)} -> {name: Finished}, all run in one
  subprocess started in the repository root. JAXLM_NO_HUGE_PAGES=1: the scripts' re-exec would replace the runner."""
  with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, "commands.json")
    with open(path, "w") as f:
      json.dump(commands, f)
    done = subprocess.run([sys.executable, os.path.abspath(__file__), path], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "JAXLM_NO_HUGE_PAGES": "1", **(env or {})})
    assert done.returncode == 0 and os.path.exists(path + ".out"), done.stderr[-3000:]
    with open(path + ".out") as f:
      return {name: Finished(**result) for name, result in json.load(f).items()}


def _exit_status(code) -> int:
  """The status the interpreter exits with for SystemExit(code), printing a message code as it does."""
  if code is None or isinstance(code, int):
    return int(code or 0)
  print(code, file=sys.stderr)
  return 1


def _run_one(argv: list) -> dict:
  from absl import flags  # noqa: PLC0415  (in the runner only)
  script = os.path.abspath(argv[0])
  runner_argv, runner_path = sys.argv, sys.path[0]
  sys.argv, sys.path[0] = list(argv), os.path.dirname(script)
  captured = {}
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    try:
      runpy.run_path(argv[0], run_name="__main__")  # __file__ as the command gives it
      status = 0
    except SystemExit as e:
      status = _exit_status(e.code)
    except BaseException:  # noqa: BLE001  (as the interpreter: the traceback on stderr, status 1)
      traceback.print_exc()
      status = 1
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      for fd, copy in zip((1, 2), saved):
        os.dup2(copy, fd)
        os.close(copy)
    for name, file in (("stdout", out), ("stderr", err)):
      file.seek(0)
      captured[name] = file.read().decode("utf-8", "replace")
  # The script's own flags go (absl files them under the script's path; the next script may define the same names),
  # with the `--config.a.b` override flags ml_collections added for its config flags; its imports' flags stay, as
  # those modules stay imported. Every value back to its default, as in a fresh process.
  by_module = flags.FLAGS.flags_by_module_dict()
  own = {flag.name for module in (script, argv[0], "__main__") for flag in by_module.get(module, [])}
  for name in [name for name in flags.FLAGS if name in own or name.split(".")[0] in own]:
    delattr(flags.FLAGS, name)
  flags.FLAGS.unparse_flags()
  sys.argv, sys.path[0] = runner_argv, runner_path
  return {"returncode": status, **captured}


if __name__ == "__main__":
  commands_file = sys.argv[1]
  with open(commands_file) as f:
    commands = json.load(f)
  results = {name: _run_one(argv) for name, argv in commands.items()}
  with open(commands_file + ".out", "w") as f:
    json.dump(results, f)
