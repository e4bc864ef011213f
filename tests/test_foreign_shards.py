"""Foreign shards: llm.c .bin (both of llm.c's formats) and datatrove .ds files (written by datatrove itself)
indexed in place read back as the tokens and documents they hold, verify catches a changed file, and runs train on
indexed llm.c folders of both formats."""

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

EOT, BOS = 50256, 128000  # GPT-2's <|endoftext|>, Llama 3's <|begin_of_text|>
SEQ = 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# llm.c's shard headers as its HEADERS_INFO lists them: format -> (magic, version, token dtype, separator that
# precedes every document).
LLMC = {"gpt-2": (20240520, 1, "<u2", EOT), "llama-3": (20240801, 7, "<u4", BOS)}


def _write_llmc(path, tokens, fmt="gpt-2"):
  """A shard as llm.c writes one: 256 int32 (magic, version, token count, zeros), then the tokens."""
  magic, version, dtype, _ = LLMC[fmt]
  header = np.zeros(256, "<i4")
  header[:3] = magic, version, len(tokens)
  with open(path, "wb") as f:
    f.write(header.tobytes())
    f.write(np.asarray(tokens, dtype).tobytes())
  return str(path)


def _read_like_llmc(path, fmt):
  """What llm.c's own Python loader does with a shard: check the header's magic and version, then read header[2]
  tokens of the format's dtype from byte 1024 (and insist that is all the file holds)."""
  magic, version, dtype, _ = LLMC[fmt]
  with open(path, "rb") as f:
    header = np.frombuffer(f.read(1024), np.int32)
    assert header[0] == magic and header[1] == version
    tokens = np.frombuffer(f.read(), dtype)
  assert len(tokens) == header[2]
  return tokens


def _document_ends(tokens, fmt):
  """Where the documents of an llm.c stream end, from the format alone: GPT-2's end-of-text separator closes the
  document before it, Llama 3's begin-of-text opens the one after it; the file's end closes the last one."""
  separator = LLMC[fmt][3]
  at = np.flatnonzero(tokens == separator)
  ends = at + 1 if fmt == "gpt-2" else at[at > 0]
  return np.union1d(ends, [len(tokens)]).astype(np.int64)


def _llmc_stream(documents, seed, separator=EOT):
  """llm.c's layout: every document preceded by the separator; the file ends mid-way through the last one."""
  rng = np.random.default_rng(seed)
  tokens = []
  for _ in range(documents):
    tokens += [separator, *rng.integers(0, 100, size=rng.integers(0, 12))]  # 0: an empty document
  return np.array(tokens)


def _write_datatrove(path, documents, token_size=2):
  """Token documents written by datatrove's own writer (TokenizedFile, as DocumentTokenizer uses it)."""
  tokenized_file = pytest.importorskip("datatrove.pipeline.tokens.tokenizer").TokenizedFile
  writer = tokenized_file(os.path.dirname(path), os.path.basename(path), tokenizer_name_or_path="gpt2",
                          save_final_metadata=True, token_size=token_size)
  for document in documents:
    writer.write([int(t) for t in document], None)
  writer.close()
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


@pytest.mark.parametrize("fmt, tiny, tiny_ends", [
    ("gpt-2", [EOT, 1, 2, EOT, 3, 4, EOT, 5], [1, 4, 7, 8]),  # [EOT] [1 2 EOT] [3 4 EOT] [5]
    ("llama-3", [BOS, 1, 2, BOS, 3, 4, BOS, 5], [3, 6, 8]),  # [BOS 1 2] [BOS 3 4] [BOS 5]
])
@pytest.mark.parametrize("chunk", [foreign_shards._CHUNK, 5])  # 5: document ends found across chunk boundaries
def test_llmc_shards_hold_what_llmcs_reader_reads(tmp_path, monkeypatch, chunk, fmt, tiny, tiny_ends):
  """Both of llm.c's formats: the tokens, their count and the document ends are the ones llm.c's reader and its
  format give."""
  monkeypatch.setattr(foreign_shards, "_CHUNK", chunk)
  separator, dtype = LLMC[fmt][3], np.dtype(LLMC[fmt][2])
  tiny = _write_llmc(tmp_path / "tiny.bin", tiny, fmt)
  manifest = foreign_shards.index_prepared([tiny], [tiny], str(tmp_path / "tiny"))
  np.testing.assert_array_equal(np.load(tmp_path / "tiny" / "train-00000.ends.npy"), tiny_ends)
  assert manifest["eos_id"] == separator and manifest["vocab_size"] == separator + 1
  assert manifest["dtype"] == dtype.name

  # A shard that starts mid-document (llm.c cuts its shards at a token count), one ending in a separator.
  stream = _llmc_stream(40, seed=0, separator=separator)[3:]
  ending_in_separator = np.array([separator, 7, 8, separator, 9, separator])
  train = [_write_llmc(tmp_path / "train_0.bin", stream, fmt),
           _write_llmc(tmp_path / "train_1.bin", ending_in_separator, fmt)]
  val = _write_llmc(tmp_path / "val.bin", _llmc_stream(10, seed=1, separator=separator), fmt)
  assert foreign_shards.detect(train[0]) == "llmc" and foreign_shards.detect(str(tmp_path / "tiny")) is None
  out = str(tmp_path / "out")
  manifest = foreign_shards.index_prepared(train, [val], out)
  for shard, path in zip(manifest["shards"], [*train, val]):
    tokens = _read_like_llmc(path, fmt)
    assert shard["tokens"] == len(tokens) and shard["offset"] == 1024 and shard["tokens_file"] == path
    assert shard["sha256"] == hashlib.sha256(tokens.tobytes()).hexdigest()
    ends = np.load(os.path.join(out, shard["ends_file"]))
    np.testing.assert_array_equal(ends, _document_ends(tokens, fmt))
    assert shard["documents"] == len(ends)
  assert [s["split"] for s in manifest["shards"]] == ["train", "train", "eval"]
  assert manifest["splits"]["train"]["tokens"] == len(stream) + len(ending_in_separator)
  # the windows of the first file (the second is shorter than one)
  _check_windows(out, "train", _read_like_llmc(train[0], fmt), _document_ends(stream, fmt))
  assert foreign_shards.index_prepared(train, [val], out) == manifest  # done: returned as it is


@pytest.mark.parametrize("header", [(123, 9), (20240520, 2), (20240801, 1)])  # (20240520, 2): never written by llm.c
def test_a_bin_with_another_header_is_named_not_taken_for_text(tmp_path, header):
  path = tmp_path / "shard.bin"
  _write_llmc(path, [EOT, 1, 2])
  with open(path, "r+b") as f:
    f.write(np.array(header, "<i4").tobytes())
  message = rf"magic {header[0]}, version {header[1]}: not an llm.c shard header this jaxlm reads"
  with pytest.raises(ValueError, match=message) as error:
    foreign_shards.detect(str(path))
  assert "\n" not in str(error.value) and "llama-3 (magic 20240801, version 7)" in str(error.value)
  (tmp_path / "short.bin").write_bytes(b"abc")
  with pytest.raises(ValueError, match="3 bytes, too few for an llm.c shard header"):
    foreign_shards.detect(str(tmp_path / "short.bin"))
  (tmp_path / "notes.txt").write_text("plain text")
  assert foreign_shards.detect(str(tmp_path / "notes.txt")) is None  # text stays text


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


@pytest.mark.parametrize("eos_token", ["<|endoftext|>", None])
@pytest.mark.parametrize("words", [64, 70_000])  # 70,000 ids: datatrove writes uint32 tokens
def test_datatrove_document_tokenizer_files_read_as_it_wrote_them(tmp_path, eos_token, words):
  """DocumentTokenizer itself writes the files, with and without eos_token (it appends an EOS only when given one):
  the indexed documents are its tokens, and the end-of-document id is the EOS either way with the tokenizer."""
  tokenizer_step = pytest.importorskip("datatrove.pipeline.tokens.tokenizer").DocumentTokenizer
  from datatrove.data import Document  # noqa: PLC0415
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(words)}, unk_token="w0"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tokenizer.add_special_tokens(["<|endoftext|>"])
  eos = tokenizer.token_to_id("<|endoftext|>")
  os.makedirs(tmp_path / "tokenizer")
  tokenizer.save(str(tmp_path / "tokenizer" / "tokenizer.json"))
  rng = np.random.default_rng(0)
  texts = [" ".join(f"w{i}" for i in rng.integers(0, words, size=rng.integers(1, 12))) for _ in range(30)]

  def tokenized(name, texts):
    step = tokenizer_step(str(tmp_path / "datatrove"), str(tmp_path / "tokenizer" / "tokenizer.json"),
                          save_filename=name, eos_token=eos_token, shuffle_documents=False)
    step.run(iter(Document(text=text, id=str(i)) for i, text in enumerate(texts)))
    return str(tmp_path / "datatrove" / f"{name}_00000_unshuffled.ds")

  train, val = tokenized("train", texts), tokenized("val", texts[:5])
  documents = [tokenizer.encode(text).ids + ([eos] if eos_token else []) for text in texts]
  manifest = foreign_shards.index_prepared([train], [val], str(tmp_path / "out"), tokenizer=str(tmp_path / "tokenizer"))
  assert manifest["eos_id"] == eos and manifest["dtype"] == ("uint32" if words > 65536 else "uint16")
  assert manifest["splits"]["train"]["documents"] == 30 and manifest["vocab_size"] == words + 1
  _check_windows(str(tmp_path / "out"), "train", np.concatenate(documents), np.cumsum([len(d) for d in documents]))
  if eos_token:  # without the tokenizer the one token every document ends with is the EOS
    assert foreign_shards.index_prepared([train], [val], str(tmp_path / "bare"))["eos_id"] == eos
  else:  # nothing says which id ends a document
    with pytest.raises(ValueError, match="datatrove appends one only when DocumentTokenizer was given eos_token"):
      foreign_shards.index_prepared([train], [val], str(tmp_path / "bare"))


def test_inputs_that_cannot_be_indexed_are_one_line_errors(tmp_path):
  bin_file = _write_llmc(tmp_path / "a.bin", [EOT, 1, 2])
  ds_file = _write_datatrove(tmp_path / "b.ds", [np.array([1, 2, 0])])
  with pytest.raises(ValueError, match="give --eval_input"):
    foreign_shards.index_prepared([bin_file], [], str(tmp_path / "out"))
  with pytest.raises(ValueError, match="mix formats"):
    foreign_shards.index_prepared([bin_file], [ds_file], str(tmp_path / "out"))
  with pytest.raises(ValueError, match="mix token sizes"):
    foreign_shards.index_prepared([bin_file], [_write_llmc(tmp_path / "c.bin", [BOS, 5], "llama-3")],
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


def test_a_run_trains_on_indexed_llmc_folders_of_both_formats(tmp_path):
  """pretraining reads indexed folders of both of llm.c's formats, as a mixture of the two (every batch half each,
  jaxlm/data/corpora/mixture.py: one compile for both); prepare_data.py's command line (run meanwhile) indexes the
  gpt-2 one alike."""
  train = _write_llmc(tmp_path / "fineweb_train_000001.bin", _llmc_stream(200, seed=0))
  val = _write_llmc(tmp_path / "fineweb_val_000000.bin", _llmc_stream(40, seed=1))
  command = subprocess.Popen([sys.executable, "experiments/prepare_data.py", f"--input={tmp_path}/fineweb_train_*.bin",
                              f"--eval_input={val}", f"--out={tmp_path / 'by_cli'}"], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  llama = [_write_llmc(tmp_path / f"llama_{split}.bin", _llmc_stream(n, seed=seed, separator=BOS), "llama-3")
           for split, n, seed in (("train", 200, 2), ("val", 40, 3))]
  manifests = {fmt: foreign_shards.index_prepared([train_file], [val_file], str(tmp_path / fmt))
               for fmt, (train_file, val_file) in (("gpt-2", (train, val)), ("llama-3", llama))}
  assert manifests["llama-3"]["dtype"] == "uint32" and manifests["llama-3"]["eos_id"] == BOS
  config = Config(
      model=ModelConfig(vocab_size=BOS + 1, num_layers=1, d_model=32, num_heads=2, max_seq_len=16,
                        compute_dtype="float32"),
      data=DataConfig(source="prepared", mixture=f"{tmp_path / 'gpt-2'}=1,{tmp_path / 'llama-3'}=1", seq_len=16),
      train=TrainConfig(steps=2, batch_size=4, warmup_steps=1, eval_batches=1),
      checkpoint=CheckpointConfig(every_steps=0), log=LogConfig(every_steps=1, sample_tokens=0, progress_bar=False))
  workdir = tmp_path / "run"
  pretraining.train(config, str(workdir))
  losses = [json.loads(line)["loss"] for line in open(workdir / "metrics.jsonl") if '"loss"' in line]
  assert len(losses) == 2 and all(np.isfinite(losses))

  stdout, stderr = command.communicate(timeout=120)
  assert command.returncode == 0, stderr[-2000:]
  assert "in 2 shards" in stdout and prepare.read_json(str(tmp_path / "by_cli" / "manifest.json")) == manifests["gpt-2"]
