"""Chat templates: a checkpoint's own `chat_template`, rendered as transformers renders it (jinja2 in a sandbox), and
conversations turned into token ids with a loss mask on the assistant turns.

  ids, loss_mask = encode_conversation("path/to/checkpoint", [
      {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello."}])

`folder` is what transformers' `save_pretrained` writes for a tokenizer: tokenizer.json, and the template in
chat_template.jinja or in tokenizer_config.json's `chat_template` (with the special tokens the template refers to,
`bos_token`, `eos_token`, ...). The ids are transformers' `apply_chat_template(messages, tokenize=True)`: the rendered
text tokenized without adding special tokens (the template writes them). The mask covers the tokens of the text a
template marks with `{% generation %}...{% endgeneration %}` where it has such markers (what transformers'
`return_assistant_tokens_mask` selects, and TRL's SFTTrainer with `assistant_only_loss`); a template without them
(most) gets each assistant turn from the end of its header through what the template writes after the turn's
end-of-turn token (a newline for ChatML): the text that rendering the conversation up to that turn adds to rendering
the one before it with `add_generation_prompt=True`, as TRL 1.16 takes a completion to be everything after the
generation prompt.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import shutil

import jinja2
import jinja2.ext
import numpy as np
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Private-use characters put around what a template's {% generation %} block writes, taken out after rendering.
GENERATION_START, GENERATION_END = "\ue000", "\ue001"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A folder's template, compiled, with the special tokens it may refer to and the folder's tokenizer."""
  source: str  # the file the template came from (for errors)
  text: str  # the template's jinja source (lm-eval logs it with the results)
  template: jinja2.Template
  special_tokens: dict
  tokenizer: tokenizers.Tokenizer
  marks_generation: bool  # the template has {% generation %} markers around the assistant's text


class _GenerationMarkers(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` (transformers' tag for the text a model learns to write): the block's
  output between GENERATION_START and GENERATION_END, which `_render` takes out and records as spans."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

  def _mark(self, caller) -> str:
    return GENERATION_START + caller() + GENERATION_END


def _environment() -> ImmutableSandboxedEnvironment:
  """jinja2's sandbox with what transformers gives templates: trimmed blocks, loop controls, `raise_exception`,
  a `tojson` that does not escape HTML, and `strftime_now`. The sandbox is why a checkpoint's template is safe to
  run: it is code from whoever published the checkpoint."""
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols", _GenerationMarkers])

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
      x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
  env.globals.update(raise_exception=raise_exception,
                     strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
  return env


def _token_text(value) -> str | None:
  """A special token as tokenizer_config.json stores it: a string, or an AddedToken's dict with `content`."""
  return value.get("content") if isinstance(value, dict) else value


@functools.lru_cache(maxsize=16)
def load(folder: str) -> ChatTemplate | None:
  """The folder's chat template, or None when it has none (a checkpoint without one keeps jaxlm's own format)."""
  config_path = os.path.join(folder, TOKENIZER_CONFIG_FILE)
  config = {}
  if os.path.exists(config_path):
    with open(config_path) as f:
      config = json.load(f)
  template_path = os.path.join(folder, CHAT_TEMPLATE_FILE)
  if os.path.exists(template_path):
    with open(template_path) as f:
      source, text = template_path, f.read()
  elif config.get("chat_template"):
    source, text = config_path, config["chat_template"]
    if isinstance(text, list):  # named templates: the default one
      named = {t.get("name"): t.get("template") for t in text}
      if "default" not in named:
        raise ValueError(f"{config_path}: chat_template lists {sorted(named)} and no 'default' template")
      text = named["default"]
  else:
    return None
  tokenizer_path = os.path.join(folder, "tokenizer.json")
  if not os.path.exists(tokenizer_path):
    raise ValueError(f"{folder}: a chat template needs the folder's tokenizer.json, which is missing")
  try:
    template = _environment().from_string(text)
  except jinja2.TemplateSyntaxError as e:
    raise ValueError(f"{source}: the chat template does not compile (line {e.lineno}: {e.message})") from None
  special = {key: _token_text(config[key]) for key in SPECIAL_TOKEN_KEYS if config.get(key) is not None}
  marks = any(isinstance(node.call.node, jinja2.nodes.ExtensionAttribute)
              for node in _environment().parse(text).find_all(jinja2.nodes.CallBlock))
  return ChatTemplate(source, text, template, special, tokenizers.Tokenizer.from_file(tokenizer_path), marks)


def copy_template(folder: str, destination: str) -> None:
  """Copies the folder's template files (chat_template.jinja, tokenizer_config.json) that exist into `destination`,
  so a tuned model's folder answers chats with the template it was tuned on."""
  os.makedirs(destination, exist_ok=True)
  for name in (CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE):
    source, target = os.path.join(folder, name), os.path.join(destination, name)
    if os.path.isfile(source) and os.path.abspath(source) != os.path.abspath(target):
      shutil.copyfile(source, target + ".tmp")
      os.replace(target + ".tmp", target)  # readers never see half a file


def render(chat: ChatTemplate, messages: list[dict], add_generation_prompt: bool = False) -> str:
  """The conversation as the template writes it. A template that fails names its file and the first message at
  which it fails."""
  return render_marked(chat, messages, add_generation_prompt)[0]


def render_marked(chat: ChatTemplate, messages: list[dict],
                  add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
  """(the conversation as `render` writes it, the [start, end) character ranges its {% generation %} blocks wrote)."""
  _check_messages(messages)
  try:
    marked = _render(chat, messages, add_generation_prompt)
  except jinja2.TemplateError as e:
    failing = next((i for i in range(len(messages)) if not _renders(chat, messages[:i + 1])), len(messages) - 1)
    raise ValueError(f"{chat.source}: the chat template failed at message {failing} "
                     f"({messages[failing].get('role')!r}): {e}") from None
  pieces, spans, length, start = [], [], 0, None
  for piece in marked.replace(GENERATION_END, GENERATION_START).split(GENERATION_START):
    if pieces:  # a marker stood before this piece: a block opens or closes
      if start is None:
        start = length
      else:
        spans.append((start, length))
        start = None
    pieces.append(piece)
    length += len(piece)
  return "".join(pieces), spans


def _render(chat: ChatTemplate, messages: list[dict], add_generation_prompt: bool) -> str:
  return chat.template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                              documents=None, **chat.special_tokens)


def _renders(chat: ChatTemplate, messages: list[dict]) -> bool:
  try:
    _render(chat, messages, False)
    return True
  except jinja2.TemplateError:
    return False


def _check_messages(messages: list[dict]) -> None:
  if not messages:
    raise ValueError("a conversation needs at least one message")
  for i, message in enumerate(messages):
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
      raise ValueError(f"message {i} is not a {{role, content}} dict: {message!r}")
    if any(c in str(message["content"]) for c in (GENERATION_START, GENERATION_END)):
      raise ValueError(f"message {i} holds the private-use character U+E000 or U+E001, which jaxlm uses to mark "
                       "the assistant's text while rendering; remove it from the data")


def assistant_spans(chat: ChatTemplate, messages: list[dict], text: str) -> list[tuple[int, int]]:
  """[start, end) character ranges of `text` (the whole conversation rendered) that the assistant turns add."""
  spans = []
  for i, message in enumerate(messages):
    if message["role"] != "assistant":
      continue
    before = render(chat, messages[:i], add_generation_prompt=True) if i else ""
    through = render(chat, messages[:i + 1])
    if not (text.startswith(through) and through.startswith(before)):
      raise ValueError(f"{chat.source}: the chat template writes the conversation before message {i} differently "
                       "once later messages follow it, so the assistant's tokens cannot be located; train on "
                       "prompt/response pairs instead")
    spans.append((len(before), len(through)))
  return spans


def encode_conversation(folder: str, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
  """(token ids int32 [N], loss mask float32 [N]: 1 on each assistant turn's tokens and its end-of-turn token) of
  `messages` under `folder`'s chat template (module docstring)."""
  chat = require(folder)
  text, spans = render_marked(chat, messages)
  if not chat.marks_generation:
    spans = assistant_spans(chat, messages, text)
  encoding = chat.tokenizer.encode(text, add_special_tokens=False)
  ids = np.asarray(encoding.ids, np.int32)
  mask = np.zeros(len(ids), np.float32)
  offsets = np.asarray(encoding.offsets).reshape(len(ids), 2)  # [N, (start, end)] characters of each token
  for start, end in spans:
    mask[(offsets[:, 0] < end) & (offsets[:, 1] > start)] = 1.0
  return ids, mask


def require(folder: str) -> ChatTemplate:
  """The folder's chat template, or a one-line error saying it has none."""
  chat = load(folder)
  if chat is None:
    raise ValueError(f"{folder}: no chat template (chat_template.jinja, or chat_template in "
                     f"{TOKENIZER_CONFIG_FILE}); conversations need one")
  return chat


def prompt_ids(folder: str, messages: list[dict]) -> np.ndarray:
  """Token ids int32 [N] of `messages` followed by the template's generation prompt (the assistant's header): what
  a model tuned on this template continues with its reply."""
  chat = require(folder)
  return np.asarray(chat.tokenizer.encode(render(chat, messages, add_generation_prompt=True),
                                          add_special_tokens=False).ids, np.int32)


def end_of_turn_ids(folder: str) -> list[int]:
  """The special tokens that close an assistant turn under the template (`<|eot_id|>`, `<|im_end|>`,
  `<end_of_turn>`, `</s>`, ...): generation stops at any of them. Found by rendering a one-turn exchange and taking
  the special tokens the assistant's turn ends with."""
  chat = require(folder)
  messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
  ids, mask = encode_conversation(folder, messages)
  special = {token.content for token in chat.tokenizer.get_added_tokens_decoder().values() if token.special}
  turn = [int(i) for i in ids[mask == 1]]
  ends = [i for i in turn if chat.tokenizer.id_to_token(i) in special]
  if not ends:
    raise ValueError(f"{chat.source}: an assistant turn ends in no special token under this template, so "
                     "generation would not know where a reply ends")
  return sorted(set(ends))
