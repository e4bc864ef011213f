"""Prepared corpora: shards written by the prepare step, read back as windows, mixed and batched by step.

Small corpora written to tmp_path; the prepare runs in this process (workers=1) except where 1 and 2 workers are
compared.
"""

import json
import os

import numpy as np
import pytest
import tokenizers

from jaxlm.config import DataConfig
from jaxlm.data import (PretrainingBatches, TokenWindows, build_datasets, get_loader_state, make_pretraining_batches,
                        set_loader_state)
from jaxlm.data import tokenizer as tok_lib
from jaxlm.data.corpora import mixture, prepare

DOCS = [f"document {i}: " + "word " * (i % 7) + ("def f(x):\n    return x\n" if i % 3 else "prose, ünïcödé ✓.")
        for i in range(60)]


@pytest.fixture(scope="module")
def tokenizer():
  return tok_lib.train_bpe(DOCS, vocab_size=300)


def _prepare(tokenizer, out, documents=DOCS, **kw):
  kw.setdefault("workers", 1)
  kw.setdefault("progress", False)
  return prepare.prepare(documents, str(out), tokenizer.to_str(), tok_lib.eos_id(tokenizer),
                         tokenizer.get_vocab_size(with_added_tokens=True), **kw)


def _decoded(out, split):
  manifest = prepare.read_json(os.path.join(out, "manifest.json"))
  documents = []
  for shard in manifest["shards"]:
    if shard["split"] == split:
      tokens = np.load(os.path.join(out, shard["tokens_file"]), allow_pickle=False)
      ends = np.load(os.path.join(out, shard["ends_file"]), allow_pickle=False)
      starts = [0] + ends[:-1].tolist()
      documents += [tokens[a:b].tolist() for a, b in zip(starts, ends.tolist())]
  return documents


def test_shards_hold_exactly_the_tokenizers_output_and_eos(tokenizer, tmp_path):
  manifest = _prepare(tokenizer, tmp_path / "c", eval_fraction=0.1, shard_bytes=300)
  eos = tok_lib.eos_id(tokenizer)
  expected = [tokenizer.encode(d, add_special_tokens=False).ids + [eos] for d in DOCS]
  held = [i for i in range(len(DOCS)) if prepare.held_out(i, 0.1)]
  assert held == [0, 10, 20, 30, 40, 50]  # the first document, then every 10th
  assert _decoded(tmp_path / "c", "train") == [e for i, e in enumerate(expected) if i not in held]
  assert _decoded(tmp_path / "c", "eval") == [expected[i] for i in held]
  assert manifest["dtype"] == "uint16" and manifest["documents"] == len(DOCS)
  assert manifest["tokens"] == sum(map(len, expected)) and len(manifest["shards"]) > 4  # several shards
  assert manifest["splits"]["eval"]["documents"] == 6


def test_a_vocabulary_over_65536_gives_uint32(tmp_path):
  vocab = {f"w{i}": i for i in range(70_000)}
  vocab["<|endoftext|>"] = 70_000
  big = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
  big.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  manifest = _prepare(big, tmp_path / "big", documents=["w69999 w5", "w66000"])
  assert manifest["dtype"] == "uint32"
  assert _decoded(tmp_path / "big", "train") == [[69_999, 5, 70_000], [66_000, 70_000]]
  assert prepare.token_dtype(65_536) == np.uint16 and prepare.token_dtype(65_537) == np.uint32


def test_one_and_two_workers_write_the_same_shards(tokenizer, tmp_path):
  one = _prepare(tokenizer, tmp_path / "one", eval_fraction=0.1, shard_bytes=400)
  two = _prepare(tokenizer, tmp_path / "two", eval_fraction=0.1, shard_bytes=400, workers=2)
  assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in two["shards"]]
  assert one["splits"] == two["splits"]


def test_an_interrupted_prepare_resumes_skipping_finished_shards(tokenizer, tmp_path, monkeypatch):
  whole = _prepare(tokenizer, tmp_path / "whole", shard_bytes=300)

  def interrupted():
    yield from DOCS[:30]
    raise KeyboardInterrupt  # as a kill would, mid-stream

  with pytest.raises(KeyboardInterrupt):
    _prepare(tokenizer, tmp_path / "resumed", documents=interrupted(), shard_bytes=300)
  assert not os.path.exists(tmp_path / "resumed" / "manifest.json")
  finished = len(os.listdir(tmp_path / "resumed" / ".done"))
  assert finished > 2
  calls = []
  real = prepare.tokenize_shard
  monkeypatch.setattr(prepare, "tokenize_shard", lambda job, *a: calls.append(job["index"]) or real(job, *a))
  resumed = _prepare(tokenizer, tmp_path / "resumed", shard_bytes=300)
  assert min(calls) == finished and len(calls) == len(whole["shards"]) - finished
  assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in whole["shards"]]
  with pytest.raises(ValueError, match="prepared with other inputs or another tokenizer"):
    _prepare(tokenizer, tmp_path / "resumed", eval_fraction=0.5)


def test_windows_carry_document_boundaries(tokenizer, tmp_path):
  _prepare(tokenizer, tmp_path / "c", shard_bytes=10**9)
  stream = np.concatenate([np.array(d) for d in _decoded(tmp_path / "c", "train")])
  ends = np.cumsum([len(d) for d in _decoded(tmp_path / "c", "train")])
  windows = TokenWindows(str(tmp_path / "c"), "train", seq_len=16)
  assert len(windows) == (len(stream) - 1) // 16
  tokens, segments = windows.rows([0, 5, len(windows) - 1])
  for row, w in enumerate([0, 5, len(windows) - 1]):
    np.testing.assert_array_equal(tokens[row], stream[w * 16:w * 16 + 17])
    document = np.searchsorted(ends, np.arange(w * 16, w * 16 + 17), side="right")
    np.testing.assert_array_equal(segments[row], document - document[0] + 1)
  batch = windows.batch([5])
  # No target crosses a document boundary; a document's EOS is a target, the next document's first token is not.
  eos = tok_lib.eos_id(tokenizer)
  crossing = batch["segment_ids"][0, :-1] != batch["segment_ids"][0, 1:]
  assert (batch["loss_mask"][0, :-1][crossing] == 0).all()
  assert (batch["loss_mask"][0][batch["targets"][0] == eos] == 1).all()
  assert (batch["loss_mask"][0][batch["inputs"][0] == eos] == 0).all() and (batch["inputs"][0] == eos).any()


def _corpus(tokenizer, out, documents, **kw):
  _prepare(tokenizer, out, documents=documents, shard_bytes=200, **kw)
  return TokenWindows(str(out), "train", seq_len=8)


def _ids(batches: PretrainingBatches, step: int):
  return [tuple(w) for w in batches.windows(step)]


def test_each_window_once_per_epoch_and_resume_across_shards_and_epochs(tokenizer, tmp_path):
  corpus = _corpus(tokenizer, tmp_path / "c", DOCS)
  assert len(corpus) > 40 and len(corpus._shards) > 3  # several shards
  batches = PretrainingBatches([corpus], [1.0], 4, seed=1)
  epoch_steps = len(corpus) // 4
  seen = [w for s in range(3 * epoch_steps + 3) for _, w in batches.windows(s)]
  for epoch in range(3):  # every window once per epoch (batches flow across the wrap), a new order every epoch
    assert sorted(seen[epoch * len(corpus):(epoch + 1) * len(corpus)]) == list(range(len(corpus)))
  assert seen[:len(corpus)] != seen[len(corpus):2 * len(corpus)]

  # Kill and resume at a step inside an epoch and at one past the wrap: the same batches, bit for bit.
  for stop in (3, epoch_steps + 1):
    run = make_pretraining_batches_for([corpus], 4)
    for _ in range(stop):
      next(run)
    state = json.loads(json.dumps(get_loader_state(run)))
    expected = [next(run) for _ in range(epoch_steps)]  # crosses shard boundaries and an epoch wrap
    resumed = make_pretraining_batches_for([corpus], 4)
    set_loader_state(resumed, state)
    for want in expected:
      got = next(resumed)
      for key in want:
        np.testing.assert_array_equal(got[key], want[key])


def make_pretraining_batches_for(corpora, batch, weights=None, **kw):
  return PretrainingBatches(corpora, weights or [1.0] * len(corpora), batch, seed=1, **kw)


def test_one_two_and_four_processes_see_the_same_global_batches(tokenizer, tmp_path):
  corpus = _corpus(tokenizer, tmp_path / "c", DOCS)
  single = make_pretraining_batches_for([corpus], 8)
  for processes in (2, 4):
    parts = [make_pretraining_batches_for([corpus], 8 // processes, process_index=p, process_count=processes)
             for p in range(processes)]
    for _ in range(12):
      want = next(single)
      got = [next(p) for p in parts]
      for key in want:
        np.testing.assert_array_equal(np.concatenate([g[key] for g in got]), want[key])
    single = make_pretraining_batches_for([corpus], 8)


def test_mixture_proportions_and_a_weight_change_on_resume(tokenizer, tmp_path, capsys):
  a = _corpus(tokenizer, tmp_path / "a", DOCS)
  b = _corpus(tokenizer, tmp_path / "b", DOCS[::-1])
  batches = make_pretraining_batches_for([a, b], 10, weights=[3.0, 1.0])
  picks = [k for s in range(40) for k, _ in batches.windows(s)]
  assert abs(picks.count(0) / len(picks) - 0.75) < 0.01
  assert all(abs(sum(k == 0 for k in picks[:n]) - 0.75 * n) <= 1 for n in range(1, len(picks)))  # at every step
  # Positions within a corpus are a pure function of the sample: counts() and pick() agree.
  weights = mixture.exact_weights([0.5, 0.3, 0.2])
  taken = [0, 0, 0]
  for sample in range(500):
    corpus, position = mixture.pick(sample, weights)
    assert position == taken[corpus]
    taken[corpus] += 1
  assert taken == mixture.counts(500, weights)

  state = get_loader_state(batches)  # after no steps: resume at step 20 with new weights
  state["next_index"] = 20
  later = make_pretraining_batches_for([a, b], 10, weights=[1.0, 1.0])
  set_loader_state(later, state)
  assert "data.mixture weights changed on resume at step 20" in capsys.readouterr().out
  old = [_ids(batches, s) for s in range(20)]
  consumed = [sum(k == c for step in old for k, _ in step) for c in (0, 1)]
  new = [k for s in range(20, 40) for k, _ in later.windows(s)]
  assert abs(new.count(0) / len(new) - 0.5) < 0.02
  # Each corpus continues its own stream where it stopped: the first new window of corpus 0 is its next one.
  order0 = [w for step in old for k, w in step if k == 0]
  assert len(order0) == consumed[0]
  assert later._orders[0][consumed[0]] == next(w for k, w in later.windows(20) if k == 0)
  saved = get_loader_state(later)
  assert [begin for begin, _ in saved["mixture"]] == [0, 200]


def test_training_from_a_prepared_folder_and_a_mixture(tokenizer, tmp_path):
  _prepare(tokenizer, tmp_path / "a", eval_fraction=0.2)
  _prepare(tokenizer, tmp_path / "b", documents=DOCS[::-1], eval_fraction=0.2)
  config = DataConfig(source="prepared", prepared=str(tmp_path / "a"), seq_len=8)
  data = build_datasets(config, 300, str(tmp_path / "run"), seed=0)
  assert data.tokenizer.to_str() == tokenizer.to_str()
  assert os.path.isfile(tmp_path / "run" / "tokenizer.json")
  mixed = build_datasets(DataConfig(source="prepared", mixture=f"{tmp_path / 'a'}=0.7,{tmp_path / 'b'}=0.3",
                                    seq_len=8), 300, None, seed=0)
  assert mixed.weights == [0.7, 0.3] and len(mixed.train) == 2 and "mixture" in mixed.stats
  assert len(mixed.eval) > len(data.eval)  # both corpora's held-out windows
  batch = next(make_pretraining_batches(mixed, 4, 0))
  assert batch["inputs"].shape == (4, 8)
  with pytest.raises(ValueError, match="model.vocab_size=100; set model.vocab_size >= 300"):
    build_datasets(config, 100, None, seed=0)
  with pytest.raises(ValueError, match="is not folder=weight"):
    build_datasets(DataConfig(source="prepared", mixture=f"{tmp_path / 'a'}", seq_len=8), 300, None, 0)
  with pytest.raises(FileNotFoundError, match="is not a prepared corpus"):
    build_datasets(DataConfig(source="prepared", prepared=str(tmp_path), seq_len=8), 300, None, 0)


def test_prepare_data_command_on_compressed_jsonl_and_parquet(tokenizer, tmp_path):
  import gzip
  import subprocess
  import sys

  import pyarrow as pa
  import pyarrow.parquet as pq

  with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as f:
    f.write("\n".join(json.dumps({"text": d}) for d in DOCS[:30]))
  pq.write_table(pa.table({"text": DOCS[30:]}), tmp_path / "b.parquet")
  tokenizer.save(str(tmp_path / "tokenizer.json"))
  out = tmp_path / "prepared"
  command = [sys.executable, "experiments/prepare_data.py", f"--input={tmp_path}/*.jsonl.gz",
             f"--input={tmp_path / 'b.parquet'}", f"--tokenizer={tmp_path / 'tokenizer.json'}", f"--out={out}",
             "--workers=2", "--eval_fraction=0.1"]
  env = dict(os.environ, JAXLM_NO_HUGE_PAGES="1")
  result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  assert result.returncode == 0, result.stderr
  assert "60 documents" in result.stdout and "--config.data.prepared=" in result.stdout
  eos = tok_lib.eos_id(tokenizer)
  expected = [tokenizer.encode(d, add_special_tokens=False).ids + [eos] for d in DOCS]
  assert _decoded(out, "train") + _decoded(out, "eval") == \
      [e for i, e in enumerate(expected) if not prepare.held_out(i, 0.1)] + \
      [e for i, e in enumerate(expected) if prepare.held_out(i, 0.1)]
  verified = subprocess.run(command[:2] + [f"--out={out}", "--verify"], capture_output=True, text=True, env=env,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert verified.returncode == 0 and "every shard matches" in verified.stdout
