"""Conversations built offline for instruction tuning under a chat template, and a small random Qwen2-style
checkpoint with a ChatML template to tune on them.

  python experiments/conversations.py --out=runs/conversations --checkpoint=runs/tiny_qwen_chat

writes <out>/train.jsonl and <out>/eval.jsonl (one record per line: {"messages": [{role, content}, ...]}) and, with
--checkpoint, an HF folder: config.json and model.safetensors of a randomly initialised Qwen2-style decoder (llama
flavour with biases on q, k, v: model.qkv_bias), tokenizer.json (a byte-level BPE trained on the training
conversations, with <|endoftext|>, <|im_start|> and <|im_end|>) and tokenizer_config.json holding Qwen2's ChatML
template. transformers loads the folder (AutoModelForCausalLM, AutoTokenizer.apply_chat_template).

A conversation is an optional system turn and one to three exchanges. A user turn asks one of a few word and number
tasks whose answer follows from the turn itself (reverse, sort or count a list of words, add two numbers) or from
the conversation before it ("Say that again." repeats the previous answer; "And the first word?" names the first
word of the previous list), so a reply is learnable from the context alone. Held-out conversations are drawn with
another seed; the same seed gives the same files.
"""

from __future__ import annotations

import json
import os
import random

from absl import app, flags

WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle", "forest", "window", "rocket",
         "garden", "silver", "planet", "bridge", "violet")
SYSTEM_TURNS = ("You answer in as few words as possible.", "You are a careful assistant.")
# Qwen2's template: ChatML, with a default system turn when the conversation has none.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenizer split (digits one at a time, as transformers' Qwen2Tokenizer writes it).
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def _task(rng: random.Random) -> tuple[str, str, list[str]]:
  """(question, answer, the words it is about) of one self-contained task."""
  words = rng.sample(WORDS, rng.randint(2, 5))
  kind = rng.randrange(4)
  listed = " ".join(words)
  if kind == 0:
    return f"Reverse the words: {listed}", " ".join(reversed(words)), words
  if kind == 1:
    return f"Sort the words: {listed}", " ".join(sorted(words)), words
  if kind == 2:
    return f"How many words are in: {listed}", str(len(words)), words
  a, b = rng.randint(0, 20), rng.randint(0, 20)
  return f"What is {a} plus {b}?", str(a + b), []


def conversation(rng: random.Random, max_exchanges: int = 3) -> list[dict]:
  """One conversation (module docstring) as a list of {role, content}."""
  messages = [{"role": "system", "content": rng.choice(SYSTEM_TURNS)}] if rng.random() < 0.5 else []
  answer, words = None, []
  for _ in range(rng.randint(1, max_exchanges)):
    follow_up = rng.random() if answer is not None else 1.0
    if follow_up < 0.25:
      question = "Say that again."
    elif follow_up < 0.5 and words:
      question, answer = "And the first word?", words[0]
    else:
      question, answer, words = _task(rng)
    messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
  return messages


def conversation_rows(count: int, seed: int, max_exchanges: int = 3) -> list[dict]:
  """`count` records {"messages": [...]}, seeded."""
  rng = random.Random(seed)
  return [{"messages": conversation(rng, max_exchanges)} for _ in range(count)]


def write_jsonl(path: str, rows: list[dict]) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
  os.replace(path + ".tmp", path)
  return path


def write_chat_tokenizer(folder: str, rows: list[dict], vocab_size: int, max_positions: int) -> str:
  """tokenizer.json (a byte-level BPE with Qwen2's pre-tokenizer, trained on `rows`' conversations) and
  tokenizer_config.json (Qwen2's ChatML template and special tokens) in `folder`; returns the folder."""
  import tokenizers  # noqa: PLC0415 (the conversations alone need none of these)
  from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers  # noqa: PLC0415

  os.makedirs(folder, exist_ok=True)
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.normalizer = normalizers.NFC()  # Qwen2's normalizer and pre-tokenizer: transformers' Qwen2Tokenizer
  tokenizer.pre_tokenizer = pre_tokenizers.Sequence([  # sets them on a qwen2 folder whatever tokenizer.json holds
      pre_tokenizers.Split(tokenizers.Regex(QWEN2_SPLIT), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tokenizer.decoder = decoders.ByteLevel()
  texts = [m["role"] + "\n" + m["content"] for row in rows for m in row["messages"]]
  tokenizer.train_from_iterator(texts + ["system\nYou are a helpful assistant."], trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  tokenizer.save(os.path.join(folder, "tokenizer.json"))
  with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump({"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
               "bos_token": None, "model_max_length": max_positions, "chat_template": CHATML_TEMPLATE}, f, indent=2)
  return folder


def write_chat_checkpoint(folder: str, rows: list[dict], model_config, seed: int = 0) -> str:
  """A random decoder of `model_config` as an HF folder with `write_chat_tokenizer`'s tokenizer (of the model's
  vocab_size) and ChatML template (module docstring); returns the folder."""
  import jax  # noqa: PLC0415 (the conversations alone need no JAX)
  from flax import nnx  # noqa: PLC0415

  from jaxlm.interop import hf_weights  # noqa: PLC0415
  from jaxlm.models.gpt import GPT  # noqa: PLC0415

  write_chat_tokenizer(folder, rows, model_config.vocab_size, model_config.max_seq_len)
  make = lambda: GPT(model_config, rngs=nnx.Rngs(seed))
  graphdef = nnx.split(nnx.eval_shape(make))[0]
  params = jax.jit(lambda: nnx.split(make())[1])()  # one compile; eager init compiles every small op
  hf_weights.save_pretrained(nnx.merge(graphdef, params), folder)
  return folder


def tiny_qwen_config(vocab_size: int = 512):
  """The --checkpoint model: 4 Qwen2-style blocks, 128 wide, grouped-query attention. Its weights are drawn with
  init_std 0.1: at the default 0.02 the (tied, frozen under LoRA) embeddings keep every logit close to 0, a range no
  pretrained model has, and LoRA adapters alone can hardly move the loss."""
  from jaxlm.config import ModelConfig  # noqa: PLC0415

  return ModelConfig(flavour="llama", qkv_bias=True, vocab_size=vocab_size, num_layers=4, d_model=128, num_heads=4,
                     num_kv_heads=2, d_ff=384, max_seq_len=256, rope_theta=10000.0, layer_norm_eps=1e-6,
                     init_std=0.1, compute_dtype="float32")


def main(argv):
  del argv
  train = conversation_rows(_TRAIN.value, _SEED.value)
  held_out = conversation_rows(_EVAL.value, _SEED.value + 1)
  for name, rows in (("train", train), ("eval", held_out)):
    path = write_jsonl(os.path.join(_OUT.value, f"{name}.jsonl"), rows)
    print(f"{path}: {len(rows)} conversations")
  if _CHECKPOINT.value:
    print(f"{write_chat_checkpoint(_CHECKPOINT.value, train, tiny_qwen_config(), _SEED.value)}: a random "
          "Qwen2-style decoder with a ChatML template")


if __name__ == "__main__":  # flags only when run: importers (tests) keep their own
  _OUT = flags.DEFINE_string("out", "runs/conversations", "folder for train.jsonl and eval.jsonl")
  _CHECKPOINT = flags.DEFINE_string("checkpoint", "", "folder for the random Qwen2-style checkpoint with a ChatML "
                                    "template ('' = none)")
  _TRAIN = flags.DEFINE_integer("train", 2000, "training conversations")
  _EVAL = flags.DEFINE_integer("eval", 200, "held-out conversations")
  _SEED = flags.DEFINE_integer("seed", 0, "seed of the conversations and of the model's initialisation")
  app.run(main)
