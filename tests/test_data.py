"""Tests for jaxlm.data: sources, tokenizer, packing invariants, the resumable sharded loader, build_datasets.

Everything runs on small files written to tmp_path; nothing touches the network.
"""

import dataclasses
import json
import os

import grain.python as gp
import numpy as np
import pytest

from jaxlm.config import DataConfig
from jaxlm.data import (Datasets, PackedSequences, build_datasets, eval_batches, get_loader_state,
                        make_train_iterator, set_loader_state)
from jaxlm.data import packing, tokenizer as tok_lib
from jaxlm.data.corpora import sources

DOCS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "x",
    "import os\nprint(os.getcwd())\n" * 3,
    "Packing puts many short documents in one row.",
    "ünïcödé text ✓ works too",
] * 4


@pytest.fixture(scope="module")
def tokenizer():
  return tok_lib.train_bpe(DOCS, vocab_size=300)


def fake_packed(num_rows: int, seq_len: int = 4) -> PackedSequences:
  # Row i holds the token i everywhere, so a batch tells which rows it came from.
  tokens = np.repeat(np.arange(num_rows, dtype=np.int32)[:, None], seq_len + 1, axis=1)
  return PackedSequences(tokens, np.ones_like(tokens))


def row_ids(batch):
  return batch["inputs"][:, 0].tolist()


# --- packing -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seq_len", [1, 7, 16, 1000])
def test_packing_invariants(tokenizer, seq_len):
  eos = tok_lib.eos_id(tokenizer)
  packed = packing.pack(tokenizer, DOCS, seq_len, eos)
  b = packed.batch(np.arange(len(packed)))
  n, t = b["inputs"].shape
  assert t == seq_len and n == len(packed)
  assert {k: v.dtype for k, v in b.items()} == {"inputs": np.int32, "targets": np.int32, "segment_ids": np.int32,
                                                 "positions": np.int32, "loss_mask": np.float32}
  # Targets are the inputs shifted by one, inside a row and across the one-token row overlap.
  np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
  np.testing.assert_array_equal(b["inputs"][1:, 0], b["targets"][:-1, -1])

  # The loss mask is zero exactly at document boundaries and padding.
  target_segments = packed.segments[:, 1:]
  expected_mask = (b["segment_ids"] == target_segments) & (b["segment_ids"] != 0)
  np.testing.assert_array_equal(b["loss_mask"], expected_mask.astype(np.float32))
  assert packed.num_tokens == int(b["loss_mask"].sum())

  # Positions restart at 0 at every segment start and count up inside a segment.
  seg, pos = b["segment_ids"], b["positions"]
  assert (pos[:, 0] == 0).all()
  starts = seg[:, 1:] != seg[:, :-1]
  assert (pos[:, 1:][starts] == 0).all()
  assert (pos[:, 1:][~starts] == pos[:, :-1][~starts] + 1).all()

  # Every stream token after the first is a target exactly once, in order; padding only at the end.
  stream = np.concatenate([tokenizer.encode(d, add_special_tokens=False).ids + [eos] for d in DOCS])
  real = target_segments != 0
  np.testing.assert_array_equal(b["targets"][real], stream[1:])
  assert real.reshape(-1)[: len(stream) - 1].all() and not real.reshape(-1)[len(stream) - 1:].any()
  # Documents are numbered from 1 in order and each ends with EOS.
  doc_segments = np.concatenate([np.full(len(tokenizer.encode(d).ids) + 1, i + 1) for i, d in enumerate(DOCS)])
  np.testing.assert_array_equal(target_segments[real], doc_segments[1:])
  # The EOS of a document is a loss target; the next document's first token is not.
  assert b["loss_mask"][b["targets"] == eos].sum() == len(DOCS)


def test_packed_getitem_save_load(tokenizer, tmp_path):
  packed = packing.pack(tokenizer, DOCS, 8, tok_lib.eos_id(tokenizer))
  row = packed[3]
  for key, value in packed.batch([3]).items():
    np.testing.assert_array_equal(row[key], value[0])
  with pytest.raises(IndexError):
    packed[len(packed)]
  packed.save(str(tmp_path / "saved"))
  loaded = PackedSequences.load(str(tmp_path / "saved"))
  np.testing.assert_array_equal(loaded.tokens, packed.tokens)
  assert loaded.num_tokens == packed.num_tokens


# --- tokenizer -----------------------------------------------------------------------------------------------------

def test_tokenizer_round_trip_and_determinism(tokenizer, tmp_path):
  path = str(tmp_path / "tok.json")
  trained = tok_lib.train_bpe(DOCS, vocab_size=300, path=path)
  assert trained.to_str() == tokenizer.to_str()  # same input, same tokenizer
  loaded = tok_lib.load_tokenizer(path)
  assert tok_lib.eos_id(loaded) == 0
  text = "def add(a, b): ünïcödé ✓\n"
  assert loaded.encode(text).ids == trained.encode(text).ids
  assert loaded.decode(loaded.encode(text).ids) == text  # byte-level: lossless
  with pytest.raises(FileNotFoundError, match="missing.json"):
    tok_lib.load_tokenizer(str(tmp_path / "missing.json"))
  with pytest.raises(ValueError, match="model.vocab_size"):
    tok_lib.train_bpe(DOCS, vocab_size=100)


def test_get_tokenizer_trains_saves_reloads(tmp_path):
  config = DataConfig()
  workdir = str(tmp_path / "run")
  first = tok_lib.get_tokenizer(config, DOCS, 300, workdir)
  assert os.path.isfile(os.path.join(workdir, "tokenizer.json"))
  # A resumed run loads the saved file, even given other texts.
  again = tok_lib.get_tokenizer(config, ["something else entirely"], 300, workdir)
  assert again.to_str() == first.to_str()
  assert tok_lib.get_tokenizer(config, DOCS, 300, None).to_str() == first.to_str()  # trains without saving
  with pytest.raises(ValueError, match="set model.vocab_size >= 300"):
    tok_lib.get_tokenizer(config, DOCS, 290, workdir)
  explicit = dataclasses.replace(config, tokenizer=os.path.join(workdir, "tokenizer.json"))
  assert tok_lib.get_tokenizer(explicit, [], 300, None).to_str() == first.to_str()


# --- sources -------------------------------------------------------------------------------------------------------

def test_files_source_txt_jsonl_json_parquet(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  txt = tmp_path / "a.txt"
  txt.write_text("first line\n\nsecond line\n")
  jsonl = tmp_path / "b.jsonl"
  jsonl.write_text("\n".join(json.dumps(r) for r in [{"text": "json one"}, {"text": ""}, {"text": "json two"}]))
  as_json = tmp_path / "c.json"
  as_json.write_text(json.dumps([{"text": "array one", "id": 1}]))
  parquet = tmp_path / "d.parquet"
  pq.write_table(pa.table({"text": ["parquet one", "parquet two"], "id": [1, 2]}), parquet)

  config = DataConfig(source="files", train_files=(str(txt), str(jsonl), str(as_json), str(parquet)), max_bytes=0)
  documents, stats = sources.read_documents(config, "train")
  assert documents == ["first line", "second line", "json one", "json two", "array one", "parquet one",
                       "parquet two"]
  assert stats == {"documents": 7, "bytes": sum(len(d.encode()) for d in documents), "skipped_documents": 2}

  capped, capped_stats = sources.read_documents(dataclasses.replace(config, max_documents=3), "train")
  assert capped == documents[:3] and capped_stats["documents"] == 3
  capped, capped_stats = sources.read_documents(dataclasses.replace(config, max_bytes=15), "train")
  assert capped == ["first line", "secon"] and capped_stats["bytes"] == 15

  eval_config = dataclasses.replace(config, eval_files=(str(parquet),))
  assert sources.read_documents(eval_config, "eval")[0] == ["parquet one", "parquet two"]
  with pytest.raises(ValueError, match="eval_files"):
    sources.read_documents(config, "eval")


def test_files_source_errors(tmp_path):
  jsonl = tmp_path / "rows.jsonl"
  jsonl.write_text(json.dumps({"body": "hello"}) + "\n")
  missing = DataConfig(source="files", train_files=(str(tmp_path / "nope.jsonl"),))
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    sources.read_documents(missing, "train")
  wrong_column = DataConfig(source="files", train_files=(str(jsonl),))
  with pytest.raises(ValueError, match=r"column 'text' not found.*\['body'\]"):
    sources.read_documents(wrong_column, "train")
  assert sources.read_documents(dataclasses.replace(wrong_column, text_column="body"), "train")[0] == ["hello"]
  (tmp_path / "x.csv").write_text("a\n")
  with pytest.raises(ValueError, match="unsupported suffix"):
    sources.read_documents(DataConfig(source="files", train_files=(str(tmp_path / "x.csv"),)), "train")
  with pytest.raises(ValueError, match="not one of demo, files, hf"):
    sources.read_documents(DataConfig(source="web"), "train")


def test_hf_source_reads_a_saved_local_dataset(tmp_path):
  import datasets

  datasets.Dataset.from_dict({"content": ["alpha", "beta", None]}).save_to_disk(str(tmp_path / "ds"))
  config = DataConfig(source="hf", hf_name=str(tmp_path / "ds"), text_column="content")
  documents, stats = sources.read_documents(config, "train")
  assert documents == ["alpha", "beta"] and stats["skipped_documents"] == 1


def test_demo_source_needs_no_network():
  documents, stats = sources.read_documents(DataConfig(source="demo", max_bytes=200_000), "train")
  assert stats["documents"] == len(documents) > 3 and stats["bytes"] == 200_000
  assert all(isinstance(d, str) and d for d in documents)
  assert documents == sources.read_documents(DataConfig(source="demo", max_bytes=200_000), "train")[0]
  assert not any(os.sep + "test" + os.sep in p for p in sources.demo_files())


# --- loader --------------------------------------------------------------------------------------------------------

def test_train_iterator_shapes_and_epochs():
  packed = fake_packed(12, seq_len=4)
  it = make_train_iterator(packed, 3, seed=0, shuffle=True)
  batches = [next(it) for _ in range(8)]  # two epochs of 12 rows
  for b in batches:
    assert {k: (v.shape, v.dtype) for k, v in b.items()} == {
        "inputs": ((3, 4), np.int32), "targets": ((3, 4), np.int32), "segment_ids": ((3, 4), np.int32),
        "positions": ((3, 4), np.int32), "loss_mask": ((3, 4), np.float32)}
  epoch1 = sum((row_ids(b) for b in batches[:4]), [])
  epoch2 = sum((row_ids(b) for b in batches[4:]), [])
  assert sorted(epoch1) == sorted(epoch2) == list(range(12))
  assert epoch1 != epoch2  # reshuffled each epoch
  ordered = make_train_iterator(packed, 4, seed=0, shuffle=False)
  assert [row_ids(next(ordered)) for _ in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [0, 1, 2, 3]]


def test_train_iterator_resume_contract():
  packed = fake_packed(50)
  it = make_train_iterator(packed, 4, seed=7, shuffle=True)
  for _ in range(3):
    next(it)
  state = get_loader_state(it)
  json.dumps(state)  # must be JSON-serialisable for the checkpoint
  expected = [next(it) for _ in range(2)]
  resumed = make_train_iterator(packed, 4, seed=7, shuffle=True)
  set_loader_state(resumed, json.loads(json.dumps(state)))
  for want in expected:
    got = next(resumed)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])
  with pytest.raises(ValueError, match="different data pipeline"):
    set_loader_state(resumed, {"something": 1})


def test_train_iterator_seeds_and_errors():
  packed = fake_packed(64)
  orders = {seed: [row_ids(next(it)) for it in [make_train_iterator(packed, 8, seed, True)] for _ in range(4)]
            for seed in (0, 1)}
  assert orders[0] != orders[1]
  assert orders[0] == [row_ids(next(it)) for it in [make_train_iterator(packed, 8, 0, True)] for _ in range(4)]
  with pytest.raises(ValueError, match="holds 5 packed sequences.*lower train.batch_size"):
    make_train_iterator(fake_packed(5), 8, 0, True)
  with pytest.raises(ValueError, match="holds 5 packed sequences but one global batch needs 6"):
    make_train_iterator(fake_packed(5), 3, 0, True, shard_options=gp.ShardOptions(1, 2, drop_remainder=True))


def test_process_slices_rebuild_the_single_process_batches():
  """Two processes' slices, side by side, are exactly the batches one process would read: losses do not depend on
  the process count."""
  packed = fake_packed(21)
  single = make_train_iterator(packed, 10, seed=3, shuffle=True)
  parts = [make_train_iterator(packed, 5, seed=3, shuffle=True,
                               shard_options=gp.ShardOptions(shard, 2, drop_remainder=True)) for shard in range(2)]
  for _ in range(5):  # crosses an epoch boundary (21 rows)
    halves = [row_ids(next(it)) for it in parts]
    assert halves[0] + halves[1] == row_ids(next(single))
    assert set(halves[0]).isdisjoint(halves[1])


def test_eval_batches_deterministic_sharded_and_wrapping():
  packed = fake_packed(10)
  batches = eval_batches(packed, 4, 2)
  assert [row_ids(b) for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert [row_ids(b) for b in eval_batches(packed, 4, 3)][2] == [8, 9, 0, 1]  # wraps around
  shards = [sum((row_ids(b) for b in eval_batches(packed, 5, 1, gp.ShardOptions(i, 2))), []) for i in range(2)]
  assert shards == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]


# --- build_datasets ------------------------------------------------------------------------------------------------

def test_build_datasets_files_with_holdout_and_resume(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXLM_DATA_CACHE", str(tmp_path / "cache"))
  train_file = tmp_path / "train.jsonl"
  train_file.write_text("\n".join(json.dumps({"text": d}) for d in DOCS + [""]))
  config = DataConfig(source="files", train_files=(str(train_file),), seq_len=4, eval_fraction=0.25, workers=1)
  workdir = str(tmp_path / "run")
  data = build_datasets(config, vocab_size=300, workdir=workdir, seed=0)
  assert isinstance(data, Datasets) and data.eos_id == 0
  s = data.stats
  assert (s["documents"], s["skipped_documents"], s["train_documents"], s["eval_documents"]) == (24, 1, 18, 6)
  assert s["train_windows"] == len(data.train[0]) > 0 and s["eval_windows"] == len(data.eval) > 0
  assert os.path.isfile(os.path.join(workdir, "tokenizer.json"))
  # Every 4th document is held out, from the first on: documents 0, 4, 8, ...; the eval stream starts with DOCS[0].
  first = data.tokenizer.encode(DOCS[0]).ids
  np.testing.assert_array_equal(data.eval.rows([0])[0][0, :len(first[:5])], first[:5])

  # Another workdir on the same data reads the same shards from the shared cache, without tokenizing again.
  monkeypatch.setattr("jaxlm.data.corpora.prepare.tokenize_shard", lambda *a: pytest.fail("tokenized again"))
  again = build_datasets(config, vocab_size=300, workdir=str(tmp_path / "other"), seed=0)
  assert again.folders == data.folders and again.stats == s


def test_build_datasets_errors(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXLM_DATA_CACHE", str(tmp_path / "cache"))
  empty = tmp_path / "empty.jsonl"
  empty.write_text(json.dumps({"text": ""}) + "\n")
  with pytest.raises(ValueError, match="no documents to train on"):
    build_datasets(DataConfig(source="files", train_files=(str(empty),), workers=1), 300, None, 0)
