"""Byte-level BPE tokenizers: train, save, load, and pick the one a run uses.

A run's tokenizer is chosen once (`get_tokenizer`) and saved as `<workdir>/tokenizer.json`, so a resumed run, the
evaluation scripts and text generation all read back exactly the same vocabulary.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxlm.config import DataConfig

EOS_TOKEN = "<|endoftext|>"  # GPT-2's document separator; id 0 in tokenizers trained here
# End-of-document tokens of common pretrained tokenizers, tried in order when EOS_TOKEN is absent.
_OTHER_EOS_TOKENS = ("<|end_of_text|>", "</s>", "<eos>", "[SEP]")
_MIN_VOCAB = 256 + 1  # every byte plus EOS, so byte-level BPE can encode any text
TOKENIZER_FILE = "tokenizer.json"


def train_bpe(texts: Iterable[str], vocab_size: int, path: str | None = None) -> tokenizers.Tokenizer:
  """Trains a byte-level BPE with `EOS_TOKEN` at id 0; saves it to `path` (a tokenizer.json) unless None.

  Deterministic: the same texts and vocab_size give the same merges (checked in tests).
  """
  if vocab_size < _MIN_VOCAB:
    raise ValueError(f"vocab_size={vocab_size} is too small for byte-level BPE; set model.vocab_size >= {_MIN_VOCAB}")
  tokenizer = tokenizers.Tokenizer(models.BPE())
  # No prefix space: code and prose keep their leading characters as written.
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=[EOS_TOKEN],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, even ones the corpus lacks
      show_progress=False,
  )
  tokenizer.train_from_iterator(texts, trainer=trainer)
  if path is not None:
    save_tokenizer(tokenizer, path)
  return tokenizer


def save_tokenizer(tokenizer: tokenizers.Tokenizer, path: str) -> None:
  """Writes tokenizer.json atomically, so processes sharing a workdir never read a half-written file."""
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tokenizer-", suffix=".json")
  os.close(fd)
  try:
    tokenizer.save(tmp)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def load_tokenizer(path: str) -> tokenizers.Tokenizer:
  """Loads a tokenizer.json (a file, or a folder holding one, e.g. an HF model folder)."""
  if os.path.isdir(path):
    path = os.path.join(path, TOKENIZER_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"tokenizer file {path!r} does not exist; fix data.tokenizer or leave it empty")
  return tokenizers.Tokenizer.from_file(path)


def tokenizer_from_json(text: str) -> tokenizers.Tokenizer:
  return tokenizers.Tokenizer.from_str(text)


def eos_id(tokenizer: tokenizers.Tokenizer) -> int:
  """Id of the end-of-document token appended after every document."""
  for token in (EOS_TOKEN, *_OTHER_EOS_TOKENS):
    token_id = tokenizer.token_to_id(token)
    if token_id is not None:
      return token_id
  raise ValueError(f"tokenizer has no end-of-document token (tried {EOS_TOKEN!r}, {', '.join(_OTHER_EOS_TOKENS)}); "
                   f"add {EOS_TOKEN!r} as a special token")


def get_tokenizer(config: DataConfig, texts: Iterable[str], vocab_size: int,
                  workdir: str | None) -> tokenizers.Tokenizer:
  """The run's tokenizer: `data.tokenizer` if set, else `<workdir>/tokenizer.json` if present, else a new BPE.

  A newly trained tokenizer is saved to `<workdir>/tokenizer.json` (not saved when workdir is None).
  """
  if config.tokenizer:
    tokenizer = load_tokenizer(config.tokenizer)
    where = config.tokenizer
  elif workdir is not None and os.path.isfile(os.path.join(workdir, TOKENIZER_FILE)):
    where = os.path.join(workdir, TOKENIZER_FILE)
    tokenizer = load_tokenizer(where)
  else:
    path = None if workdir is None else os.path.join(workdir, TOKENIZER_FILE)
    return train_bpe(texts, vocab_size, path)
  size = tokenizer.get_vocab_size(with_added_tokens=True)
  if size > vocab_size:
    raise ValueError(f"tokenizer {where!r} has {size} tokens but model.vocab_size={vocab_size}; "
                     f"set model.vocab_size >= {size}")
  return tokenizer
