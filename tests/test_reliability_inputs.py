"""Bad inputs: every row of the "Bad inputs" table in docs/reliability.md, each with the behaviour the table promises.

Flags, config values, data files and checkpoints that can not work fail before anything is compiled, with one line
that names the culprit and what to do; the few inputs that can work (a huge line, rows without text) are handled
and counted. Row ids below match the table's first column.
"""

import dataclasses
import glob
import json
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import commands_in_one_process
import numpy as np
import pytest
from conftest import load_script, script_with_flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlm import config as config_lib
from jaxlm.config import Config, DataConfig, MeshConfig, ModelConfig, TrainConfig
from jaxlm.data import build_datasets, make_train_iterator
from jaxlm.data import tokenizer as tok_lib
from jaxlm.data.corpora import sources
from jaxlm.data.packing import PackedSequences
from jaxlm.parallel import sharding
from jaxlm.recipes import pretraining
from jaxlm.training import optim
from jaxlm.training.checkpoint import Checkpointer, CheckpointMismatchError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ModelConfig(vocab_size=320, num_layers=2, d_model=64, num_heads=4, max_seq_len=32, compute_dtype="float32")


# --------------------------------------------------------------------------------------------- flags and config


BAD_FLAGS = [
    ("--config.train.stepz=5", r"error: unknown flag --config.train.stepz: train has no 'stepz'; "
                               r"did you mean \"steps\"\? it has: .*warmup_steps"),  # row 1
    ("--config.train.steps=ten", r"flag --config.train.steps=ten: invalid literal for int"),  # row 2
    ("--config.kernels.attention=flash", r"error: kernels.attention='flash' is not one of auto, xla, causal_blocks"),
]
# Every experiments/ script that runs under jaxlm.cli.run (new ones too): they take flags only.
CLI_SCRIPTS = sorted(os.path.basename(path)[:-len(".py")] for path in glob.glob(f"{REPO}/experiments/*.py")
                     if "cli.run(" in pathlib.Path(path).read_text())
AB_STEP_TYPO = ["benchmarks/ab_step.py", "--variants=base:,typo:kernels.remmat=dots"]


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
  """(folder, {case: Finished}) of every command below, run as `python <script> <flags>` in one process in turn
  (tests/commands_in_one_process.py): the property is each command's exit status and what it prints."""
  root = tmp_path_factory.mktemp("commands")
  cases = {f"flag {flag}": ["experiments/train_lm.py", "--config=experiments/configs/demo.py", flag,
                            f"--workdir={root / f'flag {flag}'}"] for flag, _ in BAD_FLAGS}
  # The required flags are given (--undefok: each script defines only some of them), so only the stray word is
  # wrong.
  cases.update({f"positional {script}": [f"experiments/{script}.py", "--undefok=config,workdir,out",
                                         "--config=experiments/configs/demo.py", f"--workdir={root / script}",
                                         f"--out={root / script}", "extra"] for script in CLI_SCRIPTS})
  cases["ab_step typo"] = AB_STEP_TYPO
  return root, commands_in_one_process.run_commands(cases)


@pytest.mark.parametrize("flag, message", BAD_FLAGS)
def test_bad_flags_stop_the_script_before_training(commands, flag, message):
  root, finished = commands
  result = finished[f"flag {flag}"]
  assert result.returncode != 0 and re.search(message, result.stderr), result.stderr[-2000:]
  assert not (root / f"flag {flag}").exists()


@pytest.mark.parametrize("script", CLI_SCRIPTS)
def test_positional_arguments_are_refused_by_every_cli_script(commands, script):
  """A stray word stops the script before main runs."""
  root, finished = commands
  result = finished[f"positional {script}"]
  assert result.returncode != 0 and "unexpected arguments: extra" in result.stderr, result.stderr[-2000:]
  assert not (root / script).exists()  # main never ran


def _dict(**sections):
  raw = json.loads(json.dumps(dataclasses.asdict(Config(model=MODEL, data=DataConfig(seq_len=16)))))
  for section, values in sections.items():
    raw.setdefault(section, {}).update(values)
  return raw


@pytest.mark.parametrize("overrides, message", [
    ({"train": {"stepz": 5}}, r"unknown config key train.stepz; known keys: .*steps"),  # row 3
    ({"trian": {"steps": 5}}, r"unknown config section 'trian'"),  # row 4
    ({"train": {"steps": 0}}, r"train.steps=0 must be >= 1"),  # row 5
    ({"train": {"batch_size": 10, "grad_accum": 4}}, r"train.batch_size=10 is not divisible by train.grad_accum=4"),
    # row 6 ^
    ({"data": {"seq_len": 64}}, r"data.seq_len=64 exceeds model.max_seq_len=32; raise model.max_seq_len"),  # row 7
    ({"model": {"num_heads": 5}}, r"model.d_model=64 is not divisible by model.num_heads=5"),  # row 8
    ({"data": {"source": "web"}}, r"data.source='web' is not one of demo, files, hf"),  # row 9
    ({"data": {"source": "files"}}, r"data.source=files needs data.train_files"),  # row 10
    ({"train": {"max_consecutive_nonfinite": 0}}, r"train.max_consecutive_nonfinite=0 must be >= 1"),  # row 11
], ids=["unknown-key", "unknown-section", "steps-0", "grad-accum", "seq-len", "heads", "source", "no-files",
        "nonfinite-0"])
def test_bad_config_values_are_one_line_errors(overrides, message):
  with pytest.raises(ValueError, match=message) as error:
    config_lib.from_config_dict(_dict(**overrides))
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("mesh, message", [
    (MeshConfig(data=3, fsdp=1, tensor=1), r"data\*fsdp\*tensor = 3\*1\*1 = 3 but there are 4 devices"),  # row 12
    (MeshConfig(data=-1, fsdp=-1, tensor=1), r"at most one of mesh.data/fsdp/tensor may be -1"),  # row 13
])
def test_a_mesh_that_does_not_fit_the_devices(mesh, message):
  with pytest.raises(ValueError, match=message):
    sharding.make_mesh(mesh)


def test_a_batch_that_does_not_split_over_the_mesh(tmp_path):  # row 14
  config = Config(model=MODEL, mesh=MeshConfig(data=4, fsdp=1, tensor=1), train=TrainConfig(batch_size=6))
  with pytest.raises(ValueError,
                     match=r"train.batch_size=6 must be divisible by mesh.data\*mesh.fsdp\*mesh.expert\*train.grad_"):
    pretraining.train(config, str(tmp_path / "run"))


def test_a_workdir_that_is_a_file(tmp_path):  # row 15
  (tmp_path / "run").write_text("not a folder")
  with pytest.raises(ValueError, match=r"--workdir=.*run' is a file, not a folder"):
    pretraining.train(Config(model=MODEL), str(tmp_path / "run"))


# --------------------------------------------------------------------------------------------- data files


def _read(path, **data_kw):
  return sources.read_documents(DataConfig(source="files", train_files=(str(path),), **data_kw), "train")


def _write(path, content: bytes) -> None:
  path.write_bytes(content)


@pytest.mark.parametrize("name, content, error, message", [
    ("missing.txt", None, FileNotFoundError, r"data file '.*missing.txt' does not exist"),  # row 16
    ("empty.jsonl", b"", ValueError, r"data file '.*empty.jsonl' is empty"),  # row 17
    ("image.txt", bytes(range(256)) * 4, ValueError,
     r"'.*image.txt' looks binary \(a NUL byte at offset 0\)"),  # row 18
    ("latin1.txt", "café\n".encode("latin-1"), ValueError,
     r"'.*latin1.txt' is not UTF-8 \(byte 0xe9 at offset 3\); re-encode"),  # row 19
    ("latin1.jsonl", b'{"text": "caf\xe9"}\n', ValueError, r"'.*latin1.jsonl' is not UTF-8"),  # row 20
    ("rows.jsonl", b'{"body": "a"}\n{"body": "b"}\n', ValueError,
     r"column 'text' not found in '.*rows.jsonl'; columns are \['body'\]; set data.text_column"),  # row 21
    ("broken.jsonl", b'{"text": "a"}\n{"text": oops}\n', ValueError,
     r"'.*broken.jsonl' could not be read as jsonl \(line 2: JSON parse error"),  # row 22
    ("table.csv", b"text\nhello\n", ValueError, r"unsupported suffix '.csv'; use .txt, .jsonl"),  # row 23
], ids=["missing", "empty", "binary", "non-utf8-txt", "non-utf8-jsonl", "no-text-column", "bad-json", "csv"])
def test_bad_data_files_are_one_line_errors(tmp_path, name, content, error, message):
  path = tmp_path / name
  if content is not None:
    _write(path, content)
  with pytest.raises(error, match=message) as raised:
    _read(path)
  assert "\n" not in str(raised.value)


def test_rows_without_text_are_skipped_and_counted(tmp_path):  # row 24
  path = tmp_path / "mixed.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in [{"text": "one"}, {"body": "x"}, {"text": 7}, {"text": ""},
                                                      {"text": "two"}]))
  documents, stats = _read(path)
  assert documents == ["one", "two"] and stats["skipped_documents"] == 3


def test_a_huge_single_line_is_capped_and_packed(tmp_path, monkeypatch, capsys):  # row 25
  monkeypatch.setenv("JAXLM_DATA_CACHE", str(tmp_path / "cache"))
  path = tmp_path / "one_line.txt"
  path.write_text("alpha beta gamma delta " * 200_000)  # 4.6 MB, no newline
  config = DataConfig(source="files", train_files=(str(path),), seq_len=16, max_bytes=40_000, eval_files=(str(path),),
                      workers=1)
  datasets = build_datasets(config, 320, str(tmp_path / "run"), seed=0)
  assert datasets.stats["bytes"] == 80_000 and datasets.stats["documents"] == 2  # train + eval copy, each capped
  assert datasets.stats["train_windows"] > 100
  # The cap is never silent: the console says what was read of how much.
  assert "data.max_bytes=40,000 cut data.train_files: read 1 documents, 40,000 bytes of text of 4,600,000 bytes" \
      in capsys.readouterr().out


def test_too_little_data_for_one_batch():  # row 26
  packed = PackedSequences(np.zeros((5, 17), np.int32), np.ones((5, 17), np.int32))
  with pytest.raises(ValueError, match=r"holds 5 packed sequences.* but one .*batch needs 8.*lower train.batch_size"):
    make_train_iterator(packed, 8, seed=0, shuffle=True)


def test_a_tokenizer_path_that_does_not_exist(tmp_path):  # row 27
  with pytest.raises(FileNotFoundError, match=r"tokenizer file '.*nope.json' does not exist; fix data.tokenizer"):
    tok_lib.get_tokenizer(DataConfig(tokenizer=str(tmp_path / "nope.json")), [], 320, None)


def test_a_tokenizer_larger_than_the_model_vocabulary(tmp_path):  # row 28
  path = str(tmp_path / "tokenizer.json")
  tok_lib.train_bpe(["hello world, hello tokens"] * 50, vocab_size=300, path=path)
  with pytest.raises(ValueError, match=r"has \d+ tokens but model.vocab_size=260; set model.vocab_size >= \d+"):
    tok_lib.get_tokenizer(DataConfig(tokenizer=path), [], 260, None)


def test_a_pickled_array_in_the_data_cache_is_never_unpickled(tmp_path):  # row 29
  np.save(tmp_path / "tokens.npy", np.array([{"evil": 1}], dtype=object), allow_pickle=True)
  np.save(tmp_path / "segments.npy", np.ones((2, 17), np.int32))
  with pytest.raises(ValueError, match="Object arrays cannot be loaded when allow_pickle=False"):
    PackedSequences.load(str(tmp_path))


# --------------------------------------------------------------------------------------------- checkpoints


def _save_small(tmp_path, model=MODEL, opt_state=None):
  params = {"w": jnp.ones((4, 8))}
  state = {"params": params, "opt_state": opt_state if opt_state is not None else (jnp.zeros((4, 8)),)}
  checkpointer = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=2)
  checkpointer.save(3, state, {"next_index": 3}, model)
  checkpointer.close()
  return state


def _target(state):
  one = NamedSharding(sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]), P())
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), state)


@pytest.mark.parametrize("changed, message", [
    ({"d_model": 128}, r"/3 holds a model with d_model=64 but the config asks for model.d_model=128"),  # row 30
    ({"vocab_size": 512}, r"holds a model with vocab_size=320 but the config asks for model.vocab_size=512"),  # row 31
], ids=["another-model", "another-vocabulary"])
def test_a_checkpoint_of_another_model_or_vocabulary(tmp_path, changed, message):
  state = _save_small(tmp_path)
  with pytest.raises(CheckpointMismatchError, match=message):
    Checkpointer(str(tmp_path / "ckpt"), 1, 2).restore_latest(_target(state), dataclasses.replace(MODEL, **changed))


def test_a_checkpoint_of_another_optimizer_names_the_first_path(tmp_path):  # row 32
  params = {"w": jnp.ones((4, 8))}
  with_clip = optim.make_optimizer(TrainConfig(grad_clip=1.0))
  without_clip = optim.make_optimizer(TrainConfig(grad_clip=0.0))
  _save_small(tmp_path, opt_state=with_clip.init(params))
  target = _target({"params": params, "opt_state": without_clip.init(params)})
  with pytest.raises(CheckpointMismatchError, match=r"/3 has no array at opt_state/0/0/count, which this run needs"):
    Checkpointer(str(tmp_path / "ckpt"), 1, 2).restore_latest(target, MODEL)

# Rows 33-38 (another dtype, a truncated checkpoint, none readable, a save killed midway, non-finite steps and
# states) are tested in tests/test_reliability.py, next to the other checkpoint guarantees.


# --------------------------------------------------------------------------------------------- safety


_FORBIDDEN = [
    (re.compile(r"^\s*(import|from)\s+(pickle|cPickle|_pickle|dill|cloudpickle|joblib)\b", re.M), "a pickle module"),
    (re.compile(r"\b(pickle|torch)\.loads?\("), "pickle.load / torch.load"),
    (re.compile(r"allow_pickle\s*=\s*True"), "allow_pickle=True"),
    (re.compile(r"trust_remote_code\s*=\s*True"), "trust_remote_code=True"),
    (re.compile(r"\bnp\.load\((?![^)]*allow_pickle=False)"), "np.load without allow_pickle=False"),
]


def test_weights_never_come_through_pickle_and_remote_code_is_never_trusted():  # row 39
  offenders = []
  for top in ("jaxlm", "experiments", "benchmarks", "launch"):
    for folder, _, files in os.walk(os.path.join(REPO, top)):
      for name in files:
        if name.endswith(".py"):
          text = open(os.path.join(folder, name), encoding="utf-8").read()
          offenders += [f"{os.path.relpath(os.path.join(folder, name), REPO)}: {what}"
                        for pattern, what in _FORBIDDEN if pattern.search(text)]
  assert not offenders, offenders



def test_ab_step_refuses_a_variant_key_the_config_lacks(commands):
  """benchmarks/ab_step.py: a mistyped variant key is a one-line error before anything compiles."""
  result = commands[1]["ab_step typo"]
  assert result.returncode != 0
  assert "variant assignment 'kernels.remmat=dots' is not <section>.<key>=<value> of the config" in result.stderr


def test_ab_step_variants_take_xla_options_apart_from_config_keys():
  """benchmarks/ab_step.py: `xla.<option>=v` becomes a compiler option of that variant alone (typed), config keys
  keep the type of the key they replace."""
  with script_with_flags("benchmarks/ab_step.py") as ab_step:
    config, options = ab_step.variant_config(
        load_script("experiments/configs/demo.py").get_config(),
        "train.batch_size=4;xla.xla_gpu_enable_triton_gemm=False;xla.xla_gpu_autotune_level=0;kernels.fuse_qkv=fused")
  assert (config.train.batch_size, config.kernels.fuse_qkv) == (4, "fused")
  assert sorted(options.items()) == [("xla_gpu_autotune_level", 0), ("xla_gpu_enable_triton_gemm", False)]
