"""RL prompts (jaxlm/data/tuning/prompts.py): plain prompts from jsonl, csv, parquet and an HF dataset keep every
other column for the rewards; conversational prompts are the chat template's rendering with the generation prompt
(transformers' apply_chat_template ids); the held-out split is seeded; too-long prompts are dropped and counted; bad
input is a one-line error naming the file and the setting."""

import csv
import json
import os

import pytest
import tokenizers
from conftest import write_jsonl

from experiments import conversations as conversation_data
from jaxlm.config import DataConfig
from jaxlm.data.tokenizer import train_bpe
from jaxlm.data.tuning import prompts as prompt_data

WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta"]


def _rows(count: int, start: int = 0) -> list[dict]:
  """Arithmetic questions with their answer and a level: `answer` and `level` are what a reward reads."""
  return [{"prompt": f"What is {i} plus {i % 7}? {' '.join(WORDS[:1 + i % 5])}", "answer": str(i + i % 7),
           "level": i % 3} for i in range(start, start + count)]


@pytest.fixture(scope="module")
def tokenizer():
  return train_bpe([r["prompt"] for r in _rows(200)], 300)


def _config(train, eval_=(), **overrides) -> DataConfig:
  return DataConfig(source="files", train_files=tuple(train), eval_files=tuple(eval_), **overrides)


def _write_csv(path, rows: list[dict]) -> str:
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  return str(path)


def test_plain_jsonl_prompts_keep_their_text_their_ids_and_every_other_column(tokenizer, tmp_path):
  train, held_out = _rows(12), _rows(4, start=100)
  held_out[1]["source"] = "book"  # a column only one row has: every prompt of both splits lists it, None elsewhere
  data = prompt_data.build_prompt_data(
      _config([write_jsonl(tmp_path / "train.jsonl", train)], [write_jsonl(tmp_path / "eval.jsonl", held_out)]),
      tokenizer, seed=0, max_prompt_len=64)
  assert (len(data.train), len(data.eval)) == (12, 4) and not data.conversational
  assert data.train.prompts == [r["prompt"] for r in train]
  assert data.train.ids == [tokenizer.encode(r["prompt"], add_special_tokens=False).ids for r in train]
  assert data.train.columns == {"answer": [r["answer"] for r in train], "level": [r["level"] for r in train],
                                "source": [None] * 12}
  assert data.eval.columns["source"] == [None, "book", None, None]
  assert data.stop_ids == [tokenizer.token_to_id("<|endoftext|>")]
  lengths = [len(ids) for ids in data.train.ids + data.eval.ids]
  assert data.stats == {"train_prompts": 12, "eval_prompts": 4, "prompt_tokens_min": min(lengths),
                        "prompt_tokens_mean": pytest.approx(sum(lengths) / 16), "prompt_tokens_max": max(lengths),
                        "max_prompt_len": 64, "dropped_long_prompts": 0, "drop_rate": 0.0, "skipped_empty_prompts": 0}


def test_csv_parquet_and_hf_prompts_read_as_jsonl_does(tokenizer, tmp_path):
  import datasets
  import pyarrow as pa
  import pyarrow.parquet as pq

  rows = _rows(10)
  as_text = [{k: str(v) for k, v in r.items()} for r in rows]  # a CSV cell is text
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
  datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
  for config, expected in (
      (_config([_write_csv(tmp_path / "train.csv", rows)], eval_fraction=0.2), as_text),
      (_config([str(tmp_path / "train.parquet")], eval_fraction=0.2), rows),
      (DataConfig(source="hf", hf_name=str(tmp_path / "saved"), hf_split="train", eval_fraction=0.2), rows)):
    data = prompt_data.build_prompt_data(config, tokenizer, seed=3, max_prompt_len=64)
    got = [{"prompt": p, **{k: v[i] for k, v in data.train.columns.items()}} for i, p in enumerate(data.train.prompts)]
    assert len(data.train) == 8 and len(data.eval) == 2
    assert got == [r for r in expected if r["prompt"] in data.train.prompts], config


def test_the_tokenizers_bos_goes_in_front_once(tmp_path):
  tokenizer = train_bpe([r["prompt"] for r in _rows(100)], 300)
  tokenizer.add_special_tokens(["<s>"])
  bos = tokenizer.token_to_id("<s>")
  tokenizer.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
  rows = [{"prompt": "What is 1 plus 1?"}, {"prompt": "<s>What is 2 plus 2?"}, {"prompt": "What is 3 plus 3?"}]
  data = prompt_data.build_prompt_data(_config([write_jsonl(tmp_path / "train.jsonl", rows)], eval_fraction=0.4),
                                       tokenizer, seed=0, max_prompt_len=64)
  every = data.train.ids + data.eval.ids
  assert all(ids[0] == bos and bos not in ids[1:] for ids in every)
  assert sorted(every) == sorted([bos, *tokenizer.encode(r["prompt"].removeprefix("<s>"),
                                                         add_special_tokens=False).ids] for r in rows)


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
  """write_chat_tokenizer's Qwen2-style tokenizer and ChatML template (eos_token <|im_end|>)."""
  chats = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["answer"]}]}
           for r in _rows(100)]
  return conversation_data.write_chat_tokenizer(str(tmp_path_factory.mktemp("chat") / "tokenizer"), chats, 320, 128)


def _conversational(rows: list[dict]) -> list[dict]:
  return [{**r, "prompt": [{"role": "system", "content": "Answer with a number."},
                           {"role": "user", "content": r["prompt"]}]} for r in rows]


def test_conversational_prompts_are_the_chat_templates_rendering_with_the_generation_prompt(chat_folder, tmp_path):
  transformers = pytest.importorskip("transformers", reason="the reference ids need the hf extra")
  tokenizer = tokenizers.Tokenizer.from_file(os.path.join(chat_folder, "tokenizer.json"))
  rows = _conversational(_rows(6))
  data = prompt_data.build_prompt_data(_config([write_jsonl(tmp_path / "train.jsonl", rows)], eval_fraction=0.3),
                                       tokenizer, seed=0, max_prompt_len=128, chat_folder=chat_folder)
  hf = transformers.AutoTokenizer.from_pretrained(chat_folder)
  assert data.conversational and len(data.train) == 4 and len(data.eval) == 2
  for prompts in (data.train, data.eval):
    for messages, ids, answer in zip(prompts.prompts, prompts.ids, prompts.columns["answer"]):
      assert messages == next(r["prompt"] for r in rows if r["answer"] == answer)  # the messages, as TRL passes them
      text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
      assert ids == hf(text, add_special_tokens=False)["input_ids"]  # as TRL's GRPOTrainer tokenizes its prompts
      assert tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
  assert data.stop_ids == [tokenizer.token_to_id("<|im_end|>")]  # the EOS and the end of an assistant turn

  plain = prompt_data.build_prompt_data(_config([write_jsonl(tmp_path / "plain.jsonl", _rows(6))]), tokenizer, 0,
                                        128, chat_folder=chat_folder)
  assert not plain.conversational and plain.train.ids[0] == tokenizer.encode(plain.train.prompts[0]).ids  # as text
  with pytest.raises(ValueError, match=r"^the prompts in data.prompt_column='prompt' are conversations, which need "
                                       r"the checkpoint's chat template, and the tokenizer's folder has none"):
    prompt_data.build_prompt_data(_config([str(tmp_path / "train.jsonl")]), tokenizer, 0, 128)


def test_without_eval_files_a_seeded_fraction_is_held_out(tokenizer, tmp_path):
  rows = _rows(20)
  config = _config([write_jsonl(tmp_path / "train.jsonl", rows)], eval_fraction=0.25)
  data = prompt_data.build_prompt_data(config, tokenizer, seed=1, max_prompt_len=64)
  assert (len(data.train), len(data.eval)) == (15, 5)
  assert sorted(data.train.prompts + data.eval.prompts) == sorted(r["prompt"] for r in rows)
  by_prompt = {r["prompt"]: r["answer"] for r in rows}
  for split in (data.train, data.eval):  # each column stays with its prompt, in the file's order
    assert split.columns["answer"] == [by_prompt[p] for p in split.prompts]
    assert split.prompts == [r["prompt"] for r in rows if r["prompt"] in split.prompts]
  again = prompt_data.build_prompt_data(config, tokenizer, seed=1, max_prompt_len=64)
  other = prompt_data.build_prompt_data(config, tokenizer, seed=2, max_prompt_len=64)
  assert again.eval.prompts == data.eval.prompts and other.eval.prompts != data.eval.prompts


def test_prompts_longer_than_max_prompt_len_are_dropped_counted_and_warned_about(tokenizer, tmp_path, capsys):
  rows = _rows(20)
  lengths = {r["prompt"]: len(tokenizer.encode(r["prompt"]).ids) for r in rows}
  limit = sorted(lengths.values())[15]  # 4 or so prompts longer than the limit
  long = sum(n > limit for n in lengths.values())
  assert 0 < long < 20
  train = write_jsonl(tmp_path / "train.jsonl", rows)
  data = prompt_data.build_prompt_data(_config([train], eval_fraction=0.25), tokenizer, 0, max_prompt_len=limit)
  kept = data.train.prompts + data.eval.prompts
  assert sorted(kept) == sorted(p for p, n in lengths.items() if n <= limit)
  assert all(len(ids) <= limit for ids in data.train.ids + data.eval.ids)
  assert data.train.columns["answer"] == [next(r["answer"] for r in rows if r["prompt"] == p)
                                          for p in data.train.prompts]
  assert data.stats["dropped_long_prompts"] == long and data.stats["drop_rate"] == long / 20
  assert data.stats["prompt_tokens_max"] <= limit
  assert (f"warning: {long / 20:.1%} of the prompts ({long} of 20) are longer than max_prompt_len={limit} tokens and "
          "are dropped; raise rl.max_prompt_length") in capsys.readouterr().out
  with pytest.raises(ValueError, match=r"^every training prompt is longer than max_prompt_len=2 tokens \(the "
                                       r"shortest is \d+\); raise rl.max_prompt_length"):
    prompt_data.build_prompt_data(_config([train]), tokenizer, 0, max_prompt_len=2)


def test_bad_input_is_one_line_naming_the_file_and_the_setting(tokenizer, tmp_path):
  train = write_jsonl(tmp_path / "train.jsonl", _rows(6))
  cases = [
      (_config([train], prompt_column="question"),
       r"^data.prompt_column='question' is not a column of '.*train.jsonl'; its columns are \['prompt', 'answer', "
       r"'level'\]$"),
      (_config([_write_csv(tmp_path / "train.csv", _rows(4))], prompt_column="question"),
       r"^data.prompt_column='question' is not a column of '.*train.csv'; its columns are \['prompt', 'answer', "
       r"'level'\]$"),
      (_config([str(tmp_path / "empty.jsonl")]), r"^data file '.*empty.jsonl' is empty; remove it from "
                                                 r"data.train_files / data.eval_files$"),
      (_config([str(tmp_path / "blank.jsonl")]), r"^'.*blank.jsonl' holds no rows; give a file of prompts in "
                                                 r"data.prompt_column='prompt', or remove it"),
      (_config([str(tmp_path / "header.csv")]), r"^'.*header.csv' holds no rows"),
      (_config([write_jsonl(tmp_path / "gaps.jsonl", [{"prompt": " ", "answer": "1"}, {"prompt": None}])]),
       r"^the training data holds no non-empty prompt in data.prompt_column='prompt' \(2 rows skipped\); check the "
       r"files and data.prompt_column$"),
      (_config([write_jsonl(tmp_path / "mixed.jsonl", [*_rows(2), *_conversational(_rows(1))])]),
       r"^row 3 of '.*mixed.jsonl': data.prompt_column holds messages where row 1 of '.*mixed.jsonl' holds a "
       r"string; give every prompt as a string or every one as messages$"),
      (_config([write_jsonl(tmp_path / "number.jsonl", [*_rows(2), {"prompt": 7}])]),
       r"^row 3 of '.*number.jsonl': data.prompt_column holds neither a string nor a list of \{role, content\} "
       r"messages: 7$"),
      (_config([str(tmp_path / "one.jsonl")]), r"^holding out eval prompts needs >= 2 training prompts; add data or "
                                               r"give data.eval_files$"),
  ]
  (tmp_path / "empty.jsonl").write_text("")
  (tmp_path / "blank.jsonl").write_text("\n\n")
  (tmp_path / "header.csv").write_text("prompt,answer\n")
  (tmp_path / "one.jsonl").write_text(json.dumps(_rows(1)[0]) + "\n")
  for config, message in cases:
    with pytest.raises(ValueError, match=message) as raised:
      prompt_data.build_prompt_data(config, tokenizer, 0, 64)
    assert "\n" not in str(raised.value), str(raised.value)
  # A skipped empty prompt is counted, never silent.
  gaps = write_jsonl(tmp_path / "some_gaps.jsonl", [*_rows(5), {"prompt": "", "answer": "0"}])
  assert prompt_data.build_prompt_data(_config([gaps]), tokenizer, 0, 64).stats["skipped_empty_prompts"] == 1
