"""Instruction tuning against TRL 1.16's own SFTTrainer, for a small Llama-style model (briefly tuned, so that its
token accuracy is not 0) saved by transformers with a Llama-style tokenizer (a BOS before every text, EOS </s>):
for standard prompt/completion pairs, the same pairs under a ChatML template, and multi-turn conversations under a
ChatML template with {% generation %} markers (SFTTrainer's assistant_only_loss), every held-out example's token
ids and loss mask equal the labels of SFTTrainer's prepared dataset, and the held-out loss and token accuracy that
jaxlm's eval step computes on its packed rows equal SFTTrainer.evaluate()'s."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from conftest import write_jsonl, write_llama_style_tokenizer
from flax import nnx

torch = pytest.importorskip("torch", reason="HF parity tests need the hf extra: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="HF parity tests need the hf extra: pip install -e '.[hf]'")
trl = pytest.importorskip("trl", reason="TRL parity tests need trl")
datasets = pytest.importorskip("datasets", reason="TRL parity tests need datasets")

from experiments import conversations as conversation_data  # noqa: E402
from jaxlm import config as config_lib  # noqa: E402
from jaxlm.config import DataConfig  # noqa: E402
from jaxlm.data import load_tokenizer  # noqa: E402
from jaxlm.data.tuning import instructions as instr_data  # noqa: E402
from jaxlm.interop import hf_weights  # noqa: E402
from jaxlm.models.gpt import GPT  # noqa: E402
from jaxlm.parallel import sharding  # noqa: E402
from jaxlm.training import steps as steps_lib  # noqa: E402

if trl.__version__ != "1.16.0":
  pytest.skip(f"jaxlm follows TRL 1.16.0's SFTTrainer; trl {trl.__version__} is installed", allow_module_level=True)

# A block tag eats the newline after it (trim_blocks), hence {{ '\n' }} after one.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_MARKED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
                 "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\n' }}"
                 "{% else %}{{ m['content'] }}<|im_end|>{{ '\n' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SEQ_LEN = 120  # no held-out example is cut, as none is by TRL's max_length


def _pairs(conversations: list[dict]) -> list[dict]:
  """The last exchange of each conversation as a prompt/completion pair. Every other prompt ends with a space that
  the completion's first word takes when the whole is tokenized; the first prompt starts with the BOS's text (the
  tokenizer adds another), the second completion ends with the EOS's (none is added)."""
  rows = []
  for i, row in enumerate(conversations):
    user, reply = row["messages"][-2]["content"], row["messages"][-1]["content"]
    rows.append({"prompt": user + ("\nAnswer: " if i % 2 else "\nAnswer:"),
                 "completion": reply if i % 2 else " " + reply})
  rows[0]["prompt"] = "<s>" + rows[0]["prompt"]
  rows[1]["completion"] += "</s>"
  return rows


def _sft_config(folder: str, **overrides):
  return trl.SFTConfig(output_dir=folder, report_to=[], use_cpu=True, bf16=False, per_device_eval_batch_size=64,
                       disable_tqdm=True, **overrides)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """Tokenizer folders (no template, ChatML, ChatML with generation markers), the data files of each form (train,
  eval) and the model: a random Llama tuned for a few steps on the training conversations."""
  folder = tmp_path_factory.mktemp("sft_trl")
  train = conversation_data.conversation_rows(32, seed=0, max_exchanges=2)
  held_out = conversation_data.conversation_rows(8, seed=1, max_exchanges=2)
  texts = [m["role"] + "\n" + m["content"] for row in train for m in row["messages"]] + ["Answer:"]
  tokenizers = {name: write_llama_style_tokenizer(str(folder / name), texts, template)
                for name, template in (("plain", None), ("chatml", CHATML), ("marked", CHATML_MARKED))}
  files = {}
  for split, rows in (("train", train), ("eval", held_out)):
    files["messages", split] = write_jsonl(folder / f"{split}_messages.jsonl", rows)
    files["pairs", split] = write_jsonl(folder / f"{split}_pairs.jsonl", _pairs(rows))

  torch.manual_seed(0)
  config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=320, max_position_embeddings=128,
                                    tie_word_embeddings=False, rms_norm_eps=1e-6)
  model = transformers.LlamaForCausalLM(config)
  _tune(model, _tokenizer(tokenizers["marked"]), train)
  model.save_pretrained(str(folder / "model"))
  return dict(folder=folder, tokenizers=tokenizers, files=files, model=str(folder / "model"))


def _tune(model, tokenizer, rows: list[dict], steps: int = 15) -> None:
  """A few full-batch Adam steps on every token of the conversations (far quicker than a Trainer's loop)."""
  batch = tokenizer.apply_chat_template([r["messages"] for r in rows], tokenize=True, return_dict=True, padding=True,
                                        return_tensors="pt")
  labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
  optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
  threads = torch.get_num_threads()
  torch.set_num_threads(1)  # a model this small only loses time to threads contending for the shared cores
  try:
    for _ in range(steps):
      optimizer.zero_grad()
      model(**batch, labels=labels).loss.backward()
      optimizer.step()
  finally:
    torch.set_num_threads(threads)


def _tokenizer(folder: str):
  return transformers.AutoTokenizer.from_pretrained(folder)


def _rows(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f]


def _trl_rows(rows: list[dict], conversational: bool) -> list[dict]:
  """The held-out rows as SFTTrainer reads them; conversational pairs: one user turn and one assistant turn."""
  if conversational and "prompt" in rows[0]:
    return [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "completion": [{"role": "assistant", "content": r["completion"]}]} for r in rows]
  return rows


# form -> (tokenizer folder, jaxlm's data.messages_column, SFTTrainer's assistant_only_loss)
FORMS = {"text_pairs": ("plain", "", False), "chat_pairs": ("chatml", "", False),
         "marked_pairs": ("marked", "", False), "conversations": ("marked", "messages", True)}


@pytest.mark.parametrize("form", list(FORMS))
def test_token_ids_masks_loss_and_token_accuracy_equal_trl_sft_trainers(setup, form):
  tokenizer_name, messages_column, assistant_only = FORMS[form]
  tokenizer_folder, kind = setup["tokenizers"][tokenizer_name], "messages" if messages_column else "pairs"
  config = DataConfig(source="files", train_files=(setup["files"][kind, "train"],),
                      eval_files=(setup["files"][kind, "eval"],), response_column="completion",
                      messages_column=messages_column, seq_len=SEQ_LEN)
  data = instr_data.build_instruction_data(config, load_tokenizer(tokenizer_folder), 0, 128, tokenizer_folder)
  assert data.stats["truncated_pairs"] == 0

  rows = datasets.Dataset.from_list(_trl_rows(_rows(setup["files"][kind, "eval"]), tokenizer_name != "plain"))
  trainer = trl.SFTTrainer(model=transformers.LlamaForCausalLM.from_pretrained(setup["model"]),
                           processing_class=_tokenizer(tokenizer_folder), train_dataset=rows,
                           args=_sft_config(str(setup["folder"] / form), assistant_only_loss=assistant_only))
  prepared = trainer._prepare_dataset(rows, trainer.processing_class, trainer.args, False, None, "eval")
  assert len(data.eval_examples) == len(prepared) == 8
  eos, end_of_turn = (trainer.processing_class.convert_tokens_to_ids(t) for t in ("</s>", "<|im_end|>"))
  for example, row in zip(data.eval_examples, prepared):
    assert example.tokens.tolist() == row["input_ids"]
    assert (example.weights == 1).tolist() == [label != -100 for label in row["labels"]]
    # A text completion ends with the EOS; a templated reply with the template's end of turn (then the newline
    # after it in a completion, not in a generation block), no EOS.
    ends = example.tokens[example.weights == 1][-2:].tolist()
    assert ends[-1] == eos if form == "text_pairs" else (end_of_turn in ends and eos not in ends)
  if form == "text_pairs":  # the completion takes the space that ends an odd row's prompt
    assert len(data.eval_examples[1].prompt) < len(load_tokenizer(tokenizer_folder).encode(rows[1]["prompt"]).ids)

  expected = trainer.evaluate(rows)  # one batch of every held-out example: its token mean
  assert len(data.eval) < len(data.eval_examples)  # several examples share a row
  found = _jaxlm_eval(setup["model"], data)
  assert 0 < expected["eval_mean_token_accuracy"] < 1  # a test that can tell right from wrong predictions
  assert found["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-5)
  assert found["eval_token_accuracy"] == pytest.approx(expected["eval_mean_token_accuracy"], rel=1e-5)


def _jaxlm_eval(model_folder: str, data: instr_data.InstructionData) -> dict:
  """jaxlm's held-out metrics as instruction tuning computes them: its eval step over the packed held-out rows, the
  model with its document mask (packed examples do not attend to each other)."""
  model = hf_weights.from_pretrained(model_folder, compute_dtype="float32", param_dtype="float32")
  config = dataclasses.replace(model.config, document_mask=True)
  graphdef = nnx.split(nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0))))[0]
  params = nnx.state(model)
  mesh = sharding.make_mesh(config_lib.MeshConfig())
  batches = instr_data.eval_batches(data.eval, 8, jax.process_index(), jax.process_count())
  return steps_lib.evaluate(jax.jit(steps_lib.make_eval_step(graphdef)), params, batches, mesh)

