"""Instruction tuning on conversations under a checkpoint's chat template: the loss mask the training batches carry is
exactly jaxlm.data.tuning.chat.encode_conversation's (multi-turn, with a system turn; pairs wrapped as one user and one
assistant turn), a small random Qwen2-style model with a ChatML template lowers its held-out assistant-token loss
through the one training loop (full fine-tuning and LoRA), and conversations without a template are a one-line
error."""

import os
import shutil

import numpy as np
import pytest

from conftest import write_jsonl
from experiments import conversations as conversation_data
from jaxlm import config as config_lib
from jaxlm.config import DataConfig, ModelConfig
from jaxlm.data import load_tokenizer
from jaxlm.data.tuning import chat, conversations
from jaxlm.data.tuning import instructions as instr_data
from jaxlm.recipes import instruction_tuning

# init_std 0.1: with the default 0.02 the frozen random embeddings keep every logit near 0, which LoRA cannot change.
MODEL = ModelConfig(flavour="llama", qkv_bias=True, vocab_size=300, num_layers=2, d_model=32, num_heads=4,
                    num_kv_heads=2, d_ff=64, max_seq_len=96, init_std=0.1, compute_dtype="float32")
WITH_SYSTEM = [
    {"role": "system", "content": "You answer in as few words as possible."},
    {"role": "user", "content": "Reverse the words: apple river stone"},
    {"role": "assistant", "content": "stone river apple"},
    {"role": "user", "content": "And the first word?"},
    {"role": "assistant", "content": "apple"},
]



@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """A random Qwen2-style checkpoint with a ChatML template and the conversations files (train, eval)."""
  folder = tmp_path_factory.mktemp("conversations")
  train = conversation_data.conversation_rows(48, seed=0, max_exchanges=2)
  held_out = conversation_data.conversation_rows(8, seed=1, max_exchanges=2)
  checkpoint = conversation_data.write_chat_checkpoint(str(folder / "qwen_chat"), train, MODEL)
  return dict(folder=folder, checkpoint=checkpoint, train=write_jsonl(folder / "train.jsonl", train),
              eval=write_jsonl(folder / "eval.jsonl", held_out))


def _segments(packed):
  """{(row, segment): (inputs, targets, loss_mask)} of every packed example."""
  rows = packed.rows
  found = {}
  for row in range(len(packed)):
    for segment in sorted(set(rows["segment_ids"][row]) - {0}):
      at = rows["segment_ids"][row] == segment
      found[row, segment] = (rows["inputs"][row][at], rows["targets"][row][at], rows["loss_mask"][row][at])
  return list(found.values())


def test_the_training_mask_is_encode_conversations_mask(setup, tmp_path):
  checkpoint = setup["checkpoint"]
  tokenizer = load_tokenizer(checkpoint)
  pair = {"prompt": "What is 3 plus 4?", "response": "7"}
  train = write_jsonl(tmp_path / "train.jsonl", [{"messages": WITH_SYSTEM, **pair}])
  for messages_column, messages in (("messages", WITH_SYSTEM),
                                    ("", conversations.pair_messages(pair["prompt"], pair["response"]))):
    config = DataConfig(source="files", train_files=(train,), eval_files=(train,), messages_column=messages_column,
                        seq_len=0)
    data = instr_data.build_instruction_data(config, tokenizer, 0, MODEL.max_seq_len, checkpoint)
    ids, mask = chat.encode_conversation(checkpoint, messages)
    ((inputs, targets, loss_mask),) = _segments(data.train)
    np.testing.assert_array_equal(inputs, ids[:-1])
    np.testing.assert_array_equal(targets, ids[1:])
    np.testing.assert_array_equal(loss_mask, mask[1:])  # target j is token j + 1: it weighs what that token does
    assert data.stop_ids == tuple(sorted({tokenizer.token_to_id("<|im_end|>"), data.eos_id}))
  assert mask.sum() > 0 and "<|im_start|>user" in tokenizer.decode(ids.tolist(), skip_special_tokens=False)

  # A data.seq_len that ends inside the first reply: the conversation's first seq_len + 1 tokens, their mask as
  # before; one that ends before the first reply is a one-line error.
  ids, mask = chat.encode_conversation(checkpoint, WITH_SYSTEM)
  seq_len = int(np.argmax(mask)) + 2
  config = DataConfig(source="files", train_files=(train,), eval_files=(train,), messages_column="messages",
                      seq_len=seq_len)
  data = instr_data.build_instruction_data(config, tokenizer, 0, MODEL.max_seq_len, checkpoint)
  ((inputs, targets, loss_mask),) = _segments(data.train)
  assert data.stats["truncated_pairs"] == 2  # the train and the eval copy
  np.testing.assert_array_equal(targets, ids[1:seq_len + 1])
  np.testing.assert_array_equal(loss_mask, mask[1:seq_len + 1])
  with pytest.raises(ValueError, match=r"the turns before the first assistant reply of row 1 of '.*train.jsonl' is "
                                       rf"{seq_len - 2} tokens, which leaves no room for a reply in data.seq_len="):
    instr_data.build_instruction_data(DataConfig(**{**vars(config), "seq_len": seq_len - 2}), tokenizer, 0,
                                      MODEL.max_seq_len, checkpoint)


def test_messages_column_without_a_chat_template_is_a_one_line_error(setup, tmp_path):
  plain = tmp_path / "plain"
  plain.mkdir()
  shutil.copy(os.path.join(setup["checkpoint"], "tokenizer.json"), plain / "tokenizer.json")
  config = DataConfig(source="files", train_files=(setup["train"],), messages_column="messages")
  with pytest.raises(ValueError, match=r"^data.messages_column='messages' needs a chat template, and '.*plain' has "
                                       r"none \(chat_template.jinja or tokenizer_config.json's chat_template\)") as e:
    instr_data.build_instruction_data(config, load_tokenizer(str(plain)), 0, 96, str(plain))
  assert "\n" not in str(e.value)


def _config(setup, workdir_name, **overrides):
  config = config_lib.default_config()
  config.init_from = setup["checkpoint"]
  config.model.flavour, config.model.compute_dtype = "llama", "float32"
  config.data.source = "files"
  config.data.train_files, config.data.eval_files = (setup["train"],), (setup["eval"],)
  config.data.messages_column = "messages"
  config.data.seq_len = 0
  config.train.steps, config.train.batch_size = 12, 8
  config.train.learning_rate, config.train.warmup_steps = 1e-2, 2
  config.checkpoint.every_steps = 0
  config.log.every_steps, config.log.sample_tokens, config.log.progress_bar = 4, 4, False
  for key, value in overrides.items():
    section, name = key.split(".")
    setattr(config[section], name, value)
  return config_lib.from_config_dict(config), str(setup["folder"] / workdir_name)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_tuning_on_conversations_lowers_the_held_out_assistant_loss(setup, method):
  overrides = {"lora.rank": 8} if method == "lora" else {}
  config, workdir = _config(setup, method, **overrides)
  result = instruction_tuning.instruction_tune(config, workdir)
  assert result["eval_loss"] < result["start_eval_loss"] - 0.5
  assert result["eval_pairs"] == 8 and ("trainable_params" in result)
  # The workdir and hf_model/ keep the template: generate.py --chat and lm_eval.py --apply_chat_template read it.
  for folder in (workdir, os.path.join(workdir, instruction_tuning.HF_MODEL)):
    assert chat.load(folder).text == chat.load(setup["checkpoint"]).text
  assert "<|im_start|>assistant" in open(os.path.join(workdir, "report.md")).read()
