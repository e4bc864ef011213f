"""A prompt and its completions as token ids, the way TRL 1.16 tokenizes them (its DPOTrainer for preference pairs,
its SFTTrainer for prompt/completion rows):

  prompt, (chosen, rejected) = text_completions(tokenizer, eos_text, "Say hi:", [" hi", " no"])
  prompt, (reply,) = chat_completions(template, [{"role": "user", ...}], [[{"role": "assistant", ...}]])

Each prompt + completion is tokenized whole, and so is the prompt alone; the completion is what follows the longest
start the prompt's ids share with every prompt + completion. Tokens that merge across the boundary, or a template
that writes the prompt alone differently (a generation prompt the full conversation does not have), thus go to the
completion, and the prompt + completion ids are exactly those of the whole text.
  * text: tokenized with the tokenizer's own special tokens (a BOS where it adds one, as transformers does), each
    completion ending with the checkpoint's EOS (appended to the text unless it already ends with it);
  * messages: the prompt rendered with the template's generation prompt, prompt + completion rendered whole, both
    tokenized without special tokens (the template writes them); no EOS is added: the template's end of turn ends
    the completion (TRL 1.16 dropped the EOS its earlier releases appended after it).
"""

from __future__ import annotations

import json
import os

import tokenizers

from jaxlm.data.tokenizer import eos_id as tokenizer_eos_id
from jaxlm.data.tuning import chat


def common_prefix_length(a: list[int], b: list[int]) -> int:
  """How many leading ids `a` and `b` share."""
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def split_completions(prompt: list[int], wholes: list[list[int]]) -> tuple[list[int], list[list[int]]]:
  """(prompt ids, completion ids of each whole) cut where the prompt's ids and every prompt + completion diverge."""
  n = min(common_prefix_length(prompt, whole) for whole in wholes)
  return prompt[:n], [whole[n:] for whole in wholes]


def eos_id(tokenizer: tokenizers.Tokenizer, folder: str | None) -> int:
  """The checkpoint's EOS: tokenizer_config.json's `eos_token` (what transformers' tokenizer calls eos), else the
  tokenizer's end-of-document token."""
  config_path = os.path.join(folder or "", chat.TOKENIZER_CONFIG_FILE)
  if folder and os.path.isfile(config_path):
    with open(config_path) as f:
      token = json.load(f).get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
      return tokenizer.token_to_id(token)
  return tokenizer_eos_id(tokenizer)


def text_completions(tokenizer: tokenizers.Tokenizer, eos_text: str, prompt: str,
                     completions: list[str]) -> tuple[list[int], list[list[int]]]:
  """(prompt ids, ids of each completion) of text rows (module docstring)."""
  texts = [prompt] + [prompt + c + ("" if c.endswith(eos_text) else eos_text) for c in completions]
  ids = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=True)]
  return split_completions(ids[0], ids[1:])


def chat_completions(template: chat.ChatTemplate, prompt: list[dict],
                     completions: list[list[dict]]) -> tuple[list[int], list[list[int]]]:
  """(prompt ids, ids of each completion) of conversational rows under `template` (module docstring)."""
  texts = [chat.render(template, prompt, add_generation_prompt=True)]
  texts += [chat.render(template, prompt + c) for c in completions]
  ids = [e.ids for e in template.tokenizer.encode_batch(texts, add_special_tokens=False)]
  return split_completions(ids[0], ids[1:])
