"""Foreign shards: llm.c .bin and datatrove .ds files indexed in place read back as the windows and documents they
hold, verify catches a changed file, and a run trains on an indexed llm.c folder."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tokenizers

from jaxlm.config import CheckpointConfig, Config, DataConfig, LogConfig, ModelConfig, TrainConfig
from jaxlm.data.corpora import foreign_shards, prepare
from jaxlm.data.corpora.shards import TokenWindows
from jaxlm.recipes import pretraining

EOT = 50256
SEQ = 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_llmc(path, tokens, version=1):
  header = np.zeros(256, "<i4")
  header[:3] = foreign_shards.LLMC_MAGIC, version, len(tokens)
  with open(path, "wb") as f:
    f.write(header.tobytes())
    f.write(np.asarray(tokens, "<u2" if version == 1 else "<u4").tobytes())
  return str(path)


def _llmc_stream(documents, seed):
  """llm.c's layout: every document preceded by EOT; the file ends mid-way through the last one."""
  rng = np.random.default_rng(seed)
  tokens = []
  for _ in range(documents):
    tokens += [EOT, *rng.integers(0, 100, size=rng.integers(0, 12))]  # 0: two EOTs in a row, an empty document
  return np.array(tokens)


def _write_datatrove(path, documents, token_size=2):
  tokens = np.concatenate(documents)
  tokens.astype(f"<u{token_size}").tofile(path)
  np.cumsum([len(d) for d in documents]).astype("<u8").tofile(f"{path}.index")
  with open(f"{path}.metadata", "w") as f:
    f.write(f"gpt2|{token_size}\n{tokens.size}\n{tokens.size} T")
  return str(path)


def _check_windows(out, split, stream, ends):
  """Every window is the stream's tokens at its place, and its segment ids step exactly where a document ends."""
  windows = TokenWindows(out, split, SEQ)
  assert len(windows) == (len(stream) - 1) // SEQ
  tokens, segments = windows.rows(np.arange(len(windows)))
  document = np.searchsorted(ends, np.arange(len(stream)), side="right")  # document number of each position
  for w in range(len(windows)):
    place = slice(w * SEQ, w * SEQ + SEQ + 1)
    np.testing.assert_array_equal(tokens[w], stream[place])
    np.testing.assert_array_equal(segments[w], document[place] - document[place][0] + 1)


@pytest.mark.parametrize("chunk", [foreign_shards._CHUNK, 5])  # 5: document ends found across chunk boundaries
def test_llmc_documents_end_after_each_separator(tmp_path, monkeypatch, chunk):
  monkeypatch.setattr(foreign_shards, "_CHUNK", chunk)
  tiny = _write_llmc(tmp_path / "tiny.bin", [EOT, 1, 2, EOT, 3, 4, EOT, 5])
  manifest = foreign_shards.index_prepared([tiny], [tiny], str(tmp_path / "tiny"))
  np.testing.assert_array_equal(np.load(tmp_path / "tiny" / "train-00000.ends.npy"), [1, 4, 7, 8])
  assert manifest["eos_id"] == EOT and manifest["vocab_size"] == EOT + 1 and manifest["dtype"] == "uint16"

  stream, ending_in_eot = _llmc_stream(40, seed=0), np.array([EOT, 7, 8, EOT, 9, EOT])
  train = [_write_llmc(tmp_path / "train_0.bin", stream), _write_llmc(tmp_path / "train_1.bin", ending_in_eot)]
  val = _write_llmc(tmp_path / "val.bin", _llmc_stream(10, seed=1))
  assert foreign_shards.detect(train[0]) == "llmc" and foreign_shards.detect(str(tmp_path / "tiny")) is None
  out = str(tmp_path / "out")
  manifest = foreign_shards.index_prepared(train, [val], out)
  ends = np.flatnonzero(stream == EOT) + 1
  ends = np.append(ends, len(stream)) if stream[-1] != EOT else ends
  np.testing.assert_array_equal(np.load(os.path.join(out, "train-00000.ends.npy")), ends)
  np.testing.assert_array_equal(np.load(os.path.join(out, "train-00001.ends.npy")), [1, 4, 6])
  assert [s["split"] for s in manifest["shards"]] == ["train", "train", "eval"]
  assert manifest["shards"][0]["tokens_file"] == train[0] and manifest["shards"][0]["offset"] == 1024
  assert manifest["splits"]["train"]["tokens"] == len(stream) + len(ending_in_eot)
  _check_windows(out, "train", stream, ends)  # the windows of the first file (the second is shorter than one)
  assert foreign_shards.index_prepared(train, [val], out) == manifest  # done: returned as it is


@pytest.mark.parametrize("token_size", [2, 4])
def test_datatrove_documents_follow_the_index(tmp_path, monkeypatch, token_size):
  monkeypatch.setattr(foreign_shards, "_CHUNK", 7)
  rng = np.random.default_rng(0)
  eos = 70000 if token_size == 4 else 3
  documents = [np.append(rng.integers(10, 60, size=rng.integers(1, 15)), eos) for _ in range(30)]
  train = _write_datatrove(tmp_path / "000_fineweb.ds", documents, token_size)
  val = _write_datatrove(tmp_path / "001_fineweb.ds", documents[:5], token_size)
  assert foreign_shards.detect(train) == "datatrove" and foreign_shards.detect(f"{train}.index") is None
  out = str(tmp_path / "out")
  manifest = foreign_shards.index_prepared([train], [val], out)
  assert manifest["eos_id"] == eos  # the token every document ends with
  assert manifest["dtype"] == f"uint{8 * token_size}" and manifest["vocab_size"] == max(eos, 59) + 1
  assert manifest["splits"]["train"]["documents"] == 30 and manifest["splits"]["eval"]["documents"] == 5
  _check_windows(out, "train", np.concatenate(documents), np.cumsum([len(d) for d in documents]))
  if token_size == 2:  # with the tokenizer (a folder holding its tokenizer.json): copied, and it gives the vocabulary
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    manifest = foreign_shards.index_prepared([train], [val], str(tmp_path / "named"), tokenizer=str(tmp_path))
    assert manifest["vocab_size"] == 64 and os.path.isfile(tmp_path / "named" / "tokenizer.json")
    assert manifest["tokenizer_sha256"] == hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
    with pytest.raises(ValueError, match="token id 59 but the tokenizer"):
      tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(8)}, unk_token="w0"))
      tokenizer.save(str(tmp_path / "small.json"))
      foreign_shards.index_prepared([train], [val], str(tmp_path / "small"), tokenizer=str(tmp_path / "small.json"))


def test_inputs_that_cannot_be_indexed_are_one_line_errors(tmp_path):
  bin_file = _write_llmc(tmp_path / "a.bin", [EOT, 1, 2])
  ds_file = _write_datatrove(tmp_path / "b.ds", [np.array([1, 2, 0])])
  with pytest.raises(ValueError, match="give --eval_input"):
    foreign_shards.index_prepared([bin_file], [], str(tmp_path / "out"))
  with pytest.raises(ValueError, match="mix formats"):
    foreign_shards.index_prepared([bin_file], [ds_file], str(tmp_path / "out"))
  with pytest.raises(ValueError, match="mix token sizes"):
    foreign_shards.index_prepared([bin_file], [_write_llmc(tmp_path / "c.bin", [128000, 5], version=2)],
                                  str(tmp_path / "out"))
  with open(bin_file, "ab") as f:
    f.write(b"\0\0")
  with pytest.raises(ValueError, match="header says 3 uint16 tokens"):
    foreign_shards.index_prepared([bin_file], [bin_file], str(tmp_path / "out"))


def test_verify_finds_a_changed_shard_in_indexed_and_prepared_folders(tmp_path):
  train = _write_llmc(tmp_path / "train.bin", _llmc_stream(20, seed=0))
  val = _write_llmc(tmp_path / "val.bin", _llmc_stream(5, seed=1))
  out = str(tmp_path / "indexed")
  foreign_shards.index_prepared([train], [val], out)
  assert foreign_shards.verify(out) == []
  with open(train, "r+b") as f:  # one token changed in place: same size, other bytes
    f.seek(1024 + 2 * 7)
    f.write(b"\x63\x00" if f.read(2) != b"\x63\x00" else b"\x62\x00")
  problems = foreign_shards.verify(out)
  assert len(problems) == 1 and "train-00000" in problems[0] and "sha256" in problems[0]
  with open(val, "ab") as f:
    f.write(b"\1\0")
  problems = foreign_shards.verify(out)
  assert len(problems) == 2 and "eval-00000" in problems[1] and "the manifest says" in problems[1]

  words = ["alpha", "beta", "gamma", "<|endoftext|>"]
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="alpha"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  prepared = str(tmp_path / "prepared")
  prepare.prepare((" ".join(words[i % 3:]) for i in range(20)), prepared, tokenizer.to_str(), 3, len(words),
                  eval_fraction=0.25, workers=1, shard_bytes=40, progress=False)
  assert foreign_shards.verify(prepared) == []
  np.save(os.path.join(prepared, "train-00001.tokens.npy"), np.zeros(3, np.uint16))
  problems = foreign_shards.verify(prepared)
  assert len(problems) == 1 and "train-00001" in problems[0]


def test_a_run_trains_on_an_indexed_llmc_folder(tmp_path):
  """pretraining reads an indexed folder; prepare_data.py's command line (run meanwhile) indexes the same one."""
  train = _write_llmc(tmp_path / "fineweb_train_000001.bin", _llmc_stream(200, seed=0))
  val = _write_llmc(tmp_path / "fineweb_val_000000.bin", _llmc_stream(40, seed=1))
  command = subprocess.Popen([sys.executable, "experiments/prepare_data.py", f"--input={tmp_path}/fineweb_train_*.bin",
                              f"--eval_input={val}", f"--out={tmp_path / 'by_cli'}"], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  out = str(tmp_path / "corpus")
  manifest = foreign_shards.index_prepared([train], [val], out)
  config = Config(
      model=ModelConfig(vocab_size=manifest["vocab_size"], num_layers=1, d_model=32, num_heads=2, max_seq_len=16,
                        compute_dtype="float32"),
      data=DataConfig(source="prepared", prepared=out, seq_len=16),
      train=TrainConfig(steps=2, batch_size=4, warmup_steps=1, eval_batches=1),
      checkpoint=CheckpointConfig(every_steps=0), log=LogConfig(every_steps=1, sample_tokens=0, progress_bar=False))
  workdir = tmp_path / "run"
  pretraining.train(config, str(workdir))
  losses = [json.loads(line)["loss"] for line in open(workdir / "metrics.jsonl") if '"loss"' in line]
  assert len(losses) == 2 and all(np.isfinite(losses))

  stdout, stderr = command.communicate(timeout=120)
  assert command.returncode == 0, stderr[-2000:]
  assert "in 2 shards" in stdout and prepare.read_json(str(tmp_path / "by_cli" / "manifest.json")) == manifest
