"""Prepare's memory bounds: the reader runs ahead of the tokenizer workers by a few pieces, never a whole shard, and
the shard files, written piece by piece, are byte for byte what np.save writes."""

import io
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jaxlm.data import tokenizer as tok_lib
from jaxlm.data.corpora import prepare

DOCS = [f"document {i}: " + "word " * (i % 7) + ("def f(x):\n    return x\n" if i % 3 else "prose, ünïcödé ✓.")
        for i in range(240)]


def test_the_reader_runs_ahead_by_a_few_pieces_not_a_shard(tmp_path, monkeypatch):
  tokenizer = tok_lib.train_bpe(DOCS, vocab_size=300)
  monkeypatch.setattr(prepare, "_PIECE_BYTES", 200)  # pieces of a few documents; the parent cuts them
  pieces = list(prepare._pieces([("main", DOCS)], 10**6))
  assert len(pieces) > 20 and sum(len(p["documents"]) for p in pieces) == len(DOCS)  # one shard, many pieces
  read, appended, ahead = [0], [0], []

  def documents():
    for text in DOCS:
      read[0] += 1
      yield text

  real_append = prepare.ShardWriter.append

  def append(writer, result):  # runs in this process, as each piece's tokens come back from a worker
    real_append(writer, result)
    appended[0] += sum(len(lengths) for _, lengths, _ in result.values())
    ahead.append(read[0] - appended[0])

  monkeypatch.setattr(prepare.ShardWriter, "append", append)
  out = str(tmp_path / "c")
  manifest = prepare.prepare(documents(), out, tokenizer.to_str(), tok_lib.eos_id(tokenizer),
                             tokenizer.get_vocab_size(with_added_tokens=True), workers=2, eval_fraction=0.1,
                             progress=False)
  assert len(manifest["shards"]) == 2 and len(ahead) == len(pieces)  # one shard (train and eval), every piece
  per_piece = max(len(p["documents"]) for p in pieces)
  # In flight: 2 per worker, one more just submitted, the next piece that groupby reads to see the shard go on, and
  # the 2 pieces read to choose between workers and this process.
  assert max(ahead) <= (2 * 2 + 4) * per_piece < len(DOCS) / 2
  for shard in manifest["shards"]:
    for name in (shard["tokens_file"], shard["ends_file"]):
      written = open(os.path.join(out, name), "rb").read()
      saved = io.BytesIO()
      np.save(saved, np.load(os.path.join(out, name), allow_pickle=False), allow_pickle=False)
      assert written == saved.getvalue()


READ_PARQUET = """
import sys
import pyarrow as pa
from jaxlm.data import files
rows = sum(1 for _ in files.iter_rows([sys.argv[1]], {"text": "text"}))
print(rows, pa.default_memory_pool().max_memory())
"""


def test_a_parquet_row_group_of_long_documents_is_read_a_few_rows_at_a_time(tmp_path):
  """One 24 MB row group (1,000 documents of 24 KB, as FineWeb's): the reader's Arrow buffers peak at a small part of
  it, not at the decoded row group (measured in a fresh process, whose Arrow pool has held nothing else)."""
  rng = np.random.default_rng(0)
  texts = ["".join(map(chr, rng.integers(97, 123, 24_000))) for _ in range(1000)]  # incompressible enough
  path = str(tmp_path / "long.parquet")
  # Data pages of 64 rows (1.5 MB): a writer cuts pages near its page size limit only between write batches.
  pq.write_table(pa.table({"text": texts, "id": list(range(1000))}), path, row_group_size=1000, write_batch_size=64)
  assert pq.ParquetFile(path).metadata.num_row_groups == 1
  done = subprocess.run([sys.executable, "-c", READ_PARQUET, path], capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  rows, peak = map(int, done.stdout.split())
  assert rows == 1000 and peak < 12e6, peak  # the row group's text is 24 MB; whole 1,024-row batches peaked at 52 MB
