"""Decoder instruction tuning: no loss on prompt tokens (exactly), packed pairs computed as if alone, the defaults
that fit the data (epochs -> steps, warmup fraction, seq_len from the lengths, the truncation warning), the bad-input
errors, and a tiny GPT-2 tuned end to end from an HF folder and read back from its jaxlm workdir."""

import contextlib
import dataclasses
import io
import json
import math
import os

import jax
import numpy as np
import pytest
from conftest import reverse_pairs, write_jsonl
from flax import nnx

from jaxlm import config as config_lib
from jaxlm.adapters import lora
from jaxlm.config import DataConfig, ModelConfig, TrainConfig
from jaxlm.data.tokenizer import train_bpe
from jaxlm.data.tuning import instructions as instr_data
from jaxlm.data.tuning import seq_lengths
from jaxlm.interop import hf_weights
from jaxlm.models.gpt import GPT
from jaxlm.parallel import sharding
from jaxlm.recipes import data_defaults, instruction_tuning
from jaxlm.training import loop, optim
from jaxlm.training import steps as steps_lib


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  folder = tmp_path_factory.mktemp("pairs")
  return (write_jsonl(folder / "train.jsonl", reverse_pairs(40, 1)),
          write_jsonl(folder / "eval.jsonl", reverse_pairs(8, 2)))


@pytest.fixture(scope="module")
def tokenizer():
  texts = [r["prompt"] + r["response"] for r in reverse_pairs(200, 0)]
  return train_bpe(texts, 300)


def _data_config(files, **overrides) -> DataConfig:
  return DataConfig(source="files", train_files=(files[0],), eval_files=(files[1],), **overrides)


def test_loss_is_exactly_zero_on_prompt_tokens_and_counts_every_response_token(files, tokenizer):
  data = instr_data.build_instruction_data(_data_config(files, seq_len=32), tokenizer, 0, 64)
  rows = data.train.rows
  assert data.train.num_tokens == sum(len(r) + 1 for r in _encoded_responses(files[0], tokenizer))  # + each EOS
  for row in range(len(data.train)):
    for segment in set(rows["segment_ids"][row]) - {0}:
      at = rows["segment_ids"][row] == segment
      inputs, targets, mask = rows["inputs"][row][at], rows["targets"][row][at], rows["loss_mask"][row][at]
      prompt_length = int(np.argmax(mask)) + 1  # the first weighted target follows the prompt's last token
      assert (mask[:prompt_length - 1] == 0).all() and (mask[prompt_length - 1:] == 1).all()
      prompt = tokenizer.decode(list(inputs[:prompt_length]))
      assert prompt.startswith("reverse: ") and prompt.endswith("\n")
      assert targets[-1] == data.eos_id and (rows["positions"][row][at] == np.arange(at.sum())).all()
  assert (rows["loss_mask"][rows["segment_ids"] == 0] == 0).all()

  # The training loss: scrambling every prompt target leaves it bit-identical; one response target changes it.
  graphdef, params = _tiny_gpt()
  loss_fn = jax.jit(steps_lib.make_loss_fn(graphdef))
  batch = data.train.batch(np.arange(4))
  scrambled = dict(batch, targets=np.where(batch["loss_mask"] == 0, (batch["targets"] + 7) % 300, batch["targets"]))
  (loss, (count, _)), (same, _) = loss_fn(params, batch), loss_fn(params, scrambled)
  assert float(loss) == float(same) and count == batch["loss_mask"].sum()
  first_response = np.argwhere(batch["loss_mask"] == 1)[0]
  changed = dict(batch, targets=batch["targets"].copy())
  changed["targets"][tuple(first_response)] = (changed["targets"][tuple(first_response)] + 7) % 300
  assert float(loss_fn(params, changed)[0]) != float(loss)


def _encoded_responses(path, tokenizer):
  with open(path) as f:
    return [tokenizer.encode(json.loads(line)["response"], add_special_tokens=False).ids for line in f]


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_packed_pairs_give_the_logits_of_each_pair_alone(files, tokenizer, flavour):
  data = instr_data.build_instruction_data(_data_config(files, seq_len=40), tokenizer, 0, 64)
  rows = data.train.rows
  row = int(np.argmax([len(set(s) - {0}) for s in rows["segment_ids"]]))  # the row holding the most pairs
  segments = sorted(set(rows["segment_ids"][row]) - {0})
  assert len(segments) >= 3
  graphdef, params = _tiny_gpt(flavour)
  forward = jax.jit(lambda params, *batch: nnx.merge(graphdef, params)(*batch))
  # Row 0: the packed row. Rows 1..k: one pair each from position 0, right-padded with segment 0 (one compile).
  k, width = len(segments), rows["inputs"].shape[1]
  inputs, positions, segment_ids = (np.zeros((1 + k, width), np.int32) for _ in range(3))
  inputs[0], positions[0], segment_ids[0] = rows["inputs"][row], rows["positions"][row], rows["segment_ids"][row]
  for i, segment in enumerate(segments, start=1):
    pair = rows["inputs"][row][rows["segment_ids"][row] == segment]
    inputs[i, :len(pair)], positions[i, :len(pair)], segment_ids[i, :len(pair)] = pair, np.arange(len(pair)), 1
  logits = forward(params, inputs, positions, segment_ids)
  for i, segment in enumerate(segments, start=1):
    at = rows["segment_ids"][row] == segment
    np.testing.assert_allclose(logits[0][at], logits[i, :at.sum()], rtol=1e-5, atol=1e-5)


def _tiny_gpt(flavour="gpt2"):
  config = ModelConfig(vocab_size=300, num_layers=1, d_model=32, num_heads=2, max_seq_len=64,
                       flavour=flavour, compute_dtype="float32")
  make = lambda: GPT(config, rngs=nnx.Rngs(1))
  graphdef = nnx.split(nnx.eval_shape(make))[0]
  return graphdef, jax.jit(lambda: nnx.split(make())[1])()  # one compile; eager init compiles every small op


def test_epochs_give_the_steps_and_warmup_fraction_the_warmup():
  derived = data_defaults.resolve_steps(TrainConfig(steps=0, epochs=3, batch_size=16), 240)
  assert derived.steps == 45  # 3 * 240 / 16
  assert data_defaults.resolve_steps(TrainConfig(steps=0, epochs=2.5, batch_size=32), 100).steps == math.ceil(250 / 32)
  assert data_defaults.resolve_steps(TrainConfig(steps=0, epochs=0.01, batch_size=32), 100).steps == 1
  assert data_defaults.resolve_steps(TrainConfig(steps=7, epochs=3, batch_size=16),
                                     240).steps == 7  # explicit steps win
  assert optim.warmup_steps(dataclasses.replace(derived, warmup_steps=-1, warmup_fraction=0.2)) == 9
  assert optim.warmup_steps(dataclasses.replace(derived, warmup_steps=5, warmup_fraction=0.2)) == 5
  schedule = optim.learning_rate_schedule(dataclasses.replace(derived, warmup_steps=-1, warmup_fraction=0.2))
  assert float(schedule(9)) == pytest.approx(derived.learning_rate) and float(schedule(4)) < derived.learning_rate
  assert "45 (train.epochs=3: 3 epochs of 240 examples at batch 16), warmup 4" in data_defaults.describe_steps(
      dataclasses.replace(derived, warmup_steps=-1, warmup_fraction=0.1), 240, derived=True)
  with pytest.raises(ValueError, match=r"train.steps=0 must be >= 1, or 0 with train.epochs > 0"):
    config_lib.from_config_dict({"train": {"steps": 0}})
  with pytest.raises(ValueError, match=r"train.steps=0 derives the steps from fine-tuning examples; pretraining"):
    data_defaults.require_fixed(config_lib.Config(train=TrainConfig(steps=0, epochs=1)), "pretraining")


def test_seq_len_from_the_data_and_the_truncation_warning(files, tokenizer):
  lengths = np.arange(1, 201)  # p99 = 198.01
  assert seq_lengths.choose_seq_len(lengths, 512) == 200  # 199 rounded up to a multiple of 8
  assert seq_lengths.choose_seq_len(lengths, 128) == 128  # capped by the position table
  assert seq_lengths.choose_seq_len(np.full(50, 3), 512, at_least=12) == 16
  assert seq_lengths.truncation_warning(2, 100, 32, 512, chosen=False) is None  # 2% cut: no warning
  line = seq_lengths.truncation_warning(45, 100, 32, 512, chosen=False)
  assert line == ("warning: 45.0% of the examples (45 of 100) are longer than data.seq_len=32 tokens and are cut; "
                  "raise data.seq_len (the model has 512 positions) or set it to 0 to choose it from the data")
  assert "no more positions (128)" in seq_lengths.truncation_warning(10, 100, 128, 128, chosen=True)

  data = instr_data.build_instruction_data(_data_config(files, seq_len=0), tokenizer, 0, 64)
  prompts = [tokenizer.encode(json.loads(line)["prompt"]).ids for line in open(files[0])]
  full = [len(p) + len(r) for p, r in zip(prompts, _encoded_responses(files[0], tokenizer))]
  assert data.seq_len == seq_lengths.choose_seq_len(np.array(full), 64, at_least=max(map(len, prompts)) + 1)
  assert data.stats["truncated_pairs"] == 0 and data.stats["seq_len"] == data.seq_len

  tight = max(map(len, prompts)) + 1  # room for one response token after the longest prompt
  cut = instr_data.build_instruction_data(_data_config(files, seq_len=tight), tokenizer, 0, 64)
  assert cut.stats["truncated_pairs"] > 0 and cut.train.rows["inputs"].shape[1] == tight
  # A cut pair keeps its prompt and fills the row with the start of its response, without an EOS.
  assert not cut.train.rows["loss_mask"][cut.train.rows["targets"] == cut.eos_id].all()


def test_bad_input_is_one_line_and_deletes_nothing(files, tokenizer, tmp_path, tiny_gpt2_folder):
  with pytest.raises(ValueError, match=r"data.prompt_column='question' is not a column of '.*train.jsonl'; its "
                                       r"columns are \['prompt', 'response'\]"):
    instr_data.build_instruction_data(_data_config(files, prompt_column="question"), tokenizer, 0, 64)
  with pytest.raises(ValueError, match=r"data.response_column='answer' is not a column"):
    instr_data.build_instruction_data(_data_config(files, response_column="answer"), tokenizer, 0, 64)
  with pytest.raises(ValueError, match=r"the prompt of row \d+ of '.*train.jsonl' is \d+ tokens, which leaves no "
                                       r"room for its response in data.seq_len=4; raise data.seq_len"):
    instr_data.build_instruction_data(_data_config(files, seq_len=4), tokenizer, 0, 64)
  empty = write_jsonl(tmp_path / "gaps.jsonl", [*reverse_pairs(3, 5), {"prompt": "x", "response": " "}])
  data = instr_data.build_instruction_data(DataConfig(source="files", train_files=(empty,), seq_len=32), tokenizer,
                                           0, 64)
  assert data.stats["skipped_empty_pairs"] == 1 and data.stats["train_pairs"] + data.stats["eval_pairs"] == 3

  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "notes.txt").write_text("keep me")
  with pytest.raises(ValueError, match=r"data.prompt_column='question' is not a column"):
    instruction_tuning.instruction_tune(_config(tiny_gpt2_folder, files, **{"data.prompt_column": "question"}),
                                        str(workdir))
  with pytest.raises(ValueError, match=r"data.seq_len=128 exceeds the model's 64 positions"):
    instruction_tuning.instruction_tune(_config(tiny_gpt2_folder, files, **{"data.seq_len": 128}), str(workdir))
  assert (workdir / "notes.txt").read_text() == "keep me"


@pytest.fixture(scope="module")
def tiny_gpt2_folder(tmp_path_factory, tokenizer):
  """A random 1-layer GPT-2 as an HF folder with the test tokenizer."""
  folder = tmp_path_factory.mktemp("tiny_gpt2")
  hf_weights.save_pretrained(nnx.merge(*_tiny_gpt()), str(folder))
  tokenizer.save(str(folder / "tokenizer.json"))
  return str(folder)


@contextlib.contextmanager
def _captured_stdout():
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    yield out


def _config(init_from, files, **overrides):
  config = config_lib.default_config()
  config.init_from = init_from
  config.model.compute_dtype = "float32"
  config.data.source = "files"
  config.data.train_files, config.data.eval_files = (files[0],), (files[1],)
  config.data.seq_len = 0
  config.train.steps, config.train.epochs = 0, 1.0
  config.train.batch_size = 8
  config.train.learning_rate = 1e-2
  config.train.warmup_steps = -1
  config.checkpoint.every_steps = 0
  config.log.every_steps = 1
  config.log.sample_tokens = 6
  config.log.progress_bar = False
  for key, value in overrides.items():
    section, name = key.split(".")
    setattr(config[section], name, value)
  return config_lib.from_config_dict(config)


@pytest.fixture(scope="module")
def tuned(files, tiny_gpt2_folder, tmp_path_factory):
  """One instruction-tuning run of the tiny GPT-2 (steps from train.epochs, seq_len from the data): (workdir, result,
  what it printed)."""
  workdir = str(tmp_path_factory.mktemp("tuned") / "run")
  with _captured_stdout() as out:
    result = instruction_tuning.instruction_tune(_config(tiny_gpt2_folder, files), workdir)
  return workdir, result, out.getvalue()


def test_tiny_gpt2_tunes_from_an_hf_folder_and_reads_back_from_its_workdir(files, tokenizer, tuned):
  workdir, result, out = tuned
  saved = json.loads(open(os.path.join(workdir, "eval.json")).read())
  rows = saved["train_rows"]
  assert saved["step"] == result["step"] == math.ceil(rows / 8) and f"epochs of {rows} packed rows" in out
  assert saved["eval_pairs"] == 8 and saved["eval_loss"] < saved["start_eval_loss"]
  report = open(os.path.join(workdir, "report.md")).read()
  assert "Held-out prompts (greedy)" in report and "reverse: " in report
  assert isinstance(hf_weights.from_pretrained(os.path.join(workdir, instruction_tuning.HF_MODEL)), GPT)
  config_json = json.loads(open(os.path.join(workdir, "config.json")).read())
  assert config_json["train"]["steps"] == saved["step"] and config_json["data"]["seq_len"] == saved["seq_len"]

  # init_from the run's workdir reads back the tuned weights that hf_model/ holds, bit for bit.
  mesh = sharding.make_mesh(config_lib.MeshConfig())
  decoder = instruction_tuning.load_decoder(_config(workdir, files), mesh)
  exported = nnx.state(hf_weights.from_pretrained(os.path.join(workdir, instruction_tuning.HF_MODEL)),
                       nnx.Param).to_pure_dict()
  assert decoder.model_config.num_layers == 1 and decoder.tokenizer.to_str() == tokenizer.to_str()
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), decoder.params, exported)


def test_lora_instruction_tuning_starts_from_the_frozen_base(files, tmp_path, tiny_gpt2_folder, tuned):
  """lora.rank > 0 takes classification's LoRA train state: the HF base frozen, only the adapters in the optimizer,
  and (B = 0) the held-out loss before the first step equals the full-tuning run's, the base model's."""
  config = _config(tiny_gpt2_folder, files, **{"lora.rank": 4, "train.steps": 1})
  config, mesh, kernels = loop.prepare_run(config, str(tmp_path / "lora"), causal=True)
  config, task = instruction_tuning.instruction_task(config, str(tmp_path / "lora"), mesh, kernels)
  state = task.start(task.state, 0)
  assert "frozen" in state and set(lora.state_bytes(state)) >= {"frozen_base_bytes", "optimizer_state_bytes"}
  assert all(name in ("lora_a", "lora_b") for name in _leaf_names(state["params"]))
  lora_start = json.loads((tmp_path / "lora" / instruction_tuning.START_EVAL).read_text())
  full_start = json.loads(open(os.path.join(tuned[0], instruction_tuning.START_EVAL)).read())  # the same base,
                                                                                               # no adapters
  assert lora_start["eval_loss"] == pytest.approx(full_start["eval_loss"], rel=1e-5)


def _leaf_names(tree, name=""):
  if isinstance(tree, dict):
    return [n for k, v in tree.items() for n in _leaf_names(v, str(k))]
  return [name]
