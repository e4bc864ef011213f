"""Instruction-tuning conversations under a checkpoint's chat template: records whose `data.messages_column` holds a
conversation (a list of {role, content} turns, several exchanges, an optional system turn).

  rows, skipped = read_conversations(config.data, "train")   # [(where, row, messages)]
  tokens, weights, prompt, text = encode(folder, messages)

The ids and weights are `chat.encode_conversation`'s, what TRL 1.16's SFTTrainer makes of a messages row with
assistant_only_loss: the conversation as the template writes it (no EOS added), weight 1 on the assistant turns
(the template's {% generation %} blocks; without them each reply and what closes it), 0 elsewhere. A prompt/response
pair is one user turn and one assistant turn (`pair_messages`), tokenized as a prompt/completion row instead
(instructions.py), and instructions.py packs both kinds of example the same way.
"""

from __future__ import annotations

import numpy as np

from jaxlm.config import DataConfig
from jaxlm.data.tuning import chat
from jaxlm.data.tuning import classification as cls_data


def read_conversations(config: DataConfig, split: str) -> tuple[list[tuple[str, int, list[dict]]], int]:
  """[(where, row, messages)] of `split`, each message reduced to its role and content, and the number of rows
  skipped for having no assistant turn with content. A turn that is not {role, content} strings is a ValueError."""
  key, column = "data.messages_column", config.messages_column
  rows, skipped = [], 0
  for where, table, _ in cls_data.read_rows(config, split, {column: key}):
    for i, row in enumerate(table):
      conversation = row[column]
      if not isinstance(conversation, list):
        raise ValueError(f"row {i + 1} of {where!r}: {key}={column!r} holds a {type(conversation).__name__}, not a "
                         f"list of {{role, content}} turns")
      messages = []
      for turn in conversation:
        role, content = (turn.get("role"), turn.get("content")) if isinstance(turn, dict) else (None, None)
        if not (isinstance(role, str) and isinstance(content, str)):
          raise ValueError(f"row {i + 1} of {where!r}: turn {len(messages)} of {key}={column!r} is not a "
                           f"{{role, content}} pair of strings: {turn!r}"[:300])
        messages.append({"role": role, "content": content})
      if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        skipped += 1
        continue
      rows.append((where, i + 1, messages))
  return rows, skipped


def pair_messages(prompt: str, response: str) -> list[dict]:
  """A prompt/response pair as a conversation: one user turn, one assistant turn."""
  return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def encode(folder: str, messages: list[dict]) -> tuple[np.ndarray, np.ndarray, list[int], tuple[str, str]]:
  """(token ids int32 [N], loss weights float32 [N], prompt ids, (prompt text, reference reply)) of `messages` under
  `folder`'s template (module docstring). The prompt, which the report asks the tuned model to continue, is the
  conversation before its last assistant turn with the template's generation prompt; the reference is that turn."""
  tokens, weights = chat.encode_conversation(folder, messages)
  last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
  template = chat.load(folder)
  before = messages[:last]
  prompt_text = chat.render(template, before, add_generation_prompt=True) if before else ""
  # chat.prompt_ids(folder, before), without rendering the prompt again
  prompt = template.tokenizer.encode(prompt_text, add_special_tokens=False).ids if before else []
  return tokens, weights, prompt, (prompt_text, messages[last]["content"])
