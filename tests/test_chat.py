"""Chat templates: jaxlm.data.tuning.chat.encode_conversation gives exactly transformers' apply_chat_template ids for
Llama-3-, ChatML (Qwen)-, Gemma- and Mistral-style templates, and its mask selects exactly the assistant contents with
their end-of-turn tokens (and the newline a template writes after one); a template with {% generation %} markers gets
transformers' own assistant mask. Each template is written here in its family's format; the tokenizer is a small byte-level
BPE trained on the spot with the family's special tokens."""

import json

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxlm.data.tuning import chat

transformers = pytest.importorskip("transformers", reason="the comparison needs the hf extra: pip install -e '.[hf]'")

LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n"
          "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
         "{% set rest = messages[1:] %}{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
         "{% for m in rest %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}{% endif %}"
         "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}<start_of_turn>{{ role }}\n"
         "{{ (first if loop.first else '') + m['content'] | trim }}<end_of_turn>\n{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
           "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")

# family -> (template, special tokens of tokenizer_config.json, every special token, the end of an assistant turn)
FAMILIES = {
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
               ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
    "chatml": (CHATML, {"eos_token": "<|im_end|>"}, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], "<|im_end|>"),
    "gemma": (GEMMA, {"bos_token": "<bos>", "eos_token": "<eos>"},
              ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
    "mistral": (MISTRAL, {"bos_token": "<s>", "eos_token": "</s>"}, ["<s>", "</s>", "[INST]", "[/INST]"], "</s>"),
}
# What each template writes after an assistant turn's end-of-turn token: the mask covers it too (TRL 1.16's completion).
AFTER_TURN = {"chatml": "\n", "gemma": "\n"}
# ChatML with transformers' {% generation %} markers around what the assistant writes (TRL's training templates).
MARKED_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
                 "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}{{ m['content'] }}"
                 "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [
    {"role": "system", "content": "Answer in one short sentence."},
    {"role": "user", "content": "What does a tokenizer do?"},
    {"role": "assistant", "content": "It splits text into the pieces a model reads."},
    {"role": "user", "content": "And a chat template?"},
    {"role": "assistant", "content": "It writes the turns in the format the model was tuned on."},
]


def _folder(tmp_path, family: str) -> str:
  template, special, tokens, _ = FAMILIES[family]
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  corpus = [m["content"] for m in CONVERSATION] * 20 + ["user assistant system model"] * 20
  tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=tokens,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                            show_progress=False))
  folder = tmp_path / family
  folder.mkdir()
  tokenizer.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **special}))
  return str(folder)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ids_equal_transformers_and_the_mask_selects_the_assistant_turns(tmp_path, family):
  folder = _folder(tmp_path, family)
  messages = CONVERSATION if family != "mistral" else CONVERSATION[1:]  # this Mistral style has no system turn
  ids, mask = chat.encode_conversation(folder, messages)
  reference = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=True)
  np.testing.assert_array_equal(ids, reference["input_ids"])
  decode = tokenizers.Tokenizer.from_file(f"{folder}/tokenizer.json").decode
  end_of_turn = FAMILIES[family][3]
  selected = decode(ids[mask == 1].tolist(), skip_special_tokens=False)
  assert selected == "".join(m["content"] + end_of_turn + AFTER_TURN.get(family, "")
                             for m in messages if m["role"] == "assistant")


def test_generation_markers_give_transformers_assistant_mask(tmp_path):
  """A template with {% generation %} blocks: the mask is what they write (here without the newline after the end of
  turn), token for token transformers' return_assistant_tokens_mask."""
  folder = _folder(tmp_path, "chatml")
  (tmp_path / "chatml" / "chat_template.jinja").write_text(MARKED_CHATML)
  chat.load.cache_clear()
  ids, mask = chat.encode_conversation(folder, CONVERSATION)
  reference = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
      CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
  np.testing.assert_array_equal(ids, reference["input_ids"])
  np.testing.assert_array_equal(mask, reference["assistant_masks"])
  assert chat.render(chat.load(folder), CONVERSATION).count("\ue000") == 0 and mask.sum() > 0
  assert chat.end_of_turn_ids(folder) == [tokenizers.Tokenizer.from_file(f"{folder}/tokenizer.json").token_to_id(
      "<|im_end|>")]


def test_a_template_that_fails_names_its_file_and_the_message(tmp_path):
  folder = _folder(tmp_path, "gemma")
  two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
  with pytest.raises(ValueError, match=r"tokenizer_config.json: the chat template failed at message 1 \('user'\): "
                                       "Conversation roles must alternate"):
    chat.encode_conversation(folder, two_users)


def test_a_folder_without_a_template_is_a_clear_error(tmp_path):
  folder = _folder(tmp_path, "chatml")
  (tmp_path / "chatml" / "tokenizer_config.json").write_text("{}")
  chat.load.cache_clear()
  assert chat.load(folder) is None
  with pytest.raises(ValueError, match="no chat template"):
    chat.encode_conversation(folder, CONVERSATION)


def test_the_sandbox_refuses_reaching_python_internals(tmp_path):
  folder = _folder(tmp_path, "chatml")
  (tmp_path / "chatml" / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
  chat.load.cache_clear()
  with pytest.raises(Exception, match="unsafe|access"):
    chat.encode_conversation(folder, CONVERSATION)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generation_prompts_equal_transformers_and_replies_end_at_the_end_of_turn_token(tmp_path, family):
  folder = _folder(tmp_path, family)
  question = [{"role": "user", "content": "What does a tokenizer do?"}]
  reference = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
      question, tokenize=True, add_generation_prompt=True)
  np.testing.assert_array_equal(chat.prompt_ids(folder, question), reference["input_ids"])
  vocab = tokenizers.Tokenizer.from_file(f"{folder}/tokenizer.json")
  assert chat.end_of_turn_ids(folder) == [vocab.token_to_id(FAMILIES[family][3])]
