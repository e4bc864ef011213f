"""--init_from=<HF checkpoint folder> on experiments/generate.py, lm_eval.py and optimize.py, on a tiny random Llama
saved by transformers: greedy samples are transformers' greedy generate (plain and under the folder's chat template),
lm-eval's rolling loglikelihood is transformers' log-probabilities, optimize.py's fp32 perplexity on --eval_text is
transformers' on the same windows; both, neither flag and an encoder folder are one-line errors."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import perturbed, script_with_flags, xla_flags_without_device_count

torch = pytest.importorskip("torch", reason="needs the hf extra: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from absl import flags  # noqa: E402

from jaxlm import data as data_lib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = ["def f(x):\n  return x + 1\n", "class Box:\n  pass\n", "the cat sat on the mat.\n"] * 20
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|endoftext|>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
TEXTS = ["the cat sat on the mat. def f(x): return x", "class Box: pass"]
EVAL_TEXT = "".join(CORPUS[:9])
SEQ_LEN, BATCH = 16, 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  root = tmp_path_factory.mktemp("init_from")
  llama, chat_model, bert = root / "llama", root / "chat", root / "bert"
  tokenizer = data_lib.train_bpe(CORPUS, 300, str(llama / "tokenizer.json"))  # "<|endoftext|>" is id 0
  config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=300, max_position_embeddings=64,
                                    tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
  torch.manual_seed(0)
  model = perturbed(transformers.LlamaForCausalLM(config))  # noise on every weight: distinct logits, a real test
  model.save_pretrained(str(llama))
  shutil.copytree(llama, chat_model)
  (chat_model / "chat_template.jinja").write_text(TEMPLATE)
  transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                 intermediate_size=48, vocab_size=300)).save_pretrained(str(bert))
  shutil.copy(llama / "tokenizer.json", bert / "tokenizer.json")
  return dict(root=root, llama=str(llama), chat=str(chat_model), bert=str(bert), model=model, tokenizer=tokenizer)


def _run(script, argv):
  """The script's main under `argv` (its absl flags removed again afterwards)."""
  with script_with_flags(f"experiments/{script}.py") as module:
    flags.FLAGS([script, *argv])
    module.main([])


def _greedy(model, prompt, new_tokens):
  with torch.no_grad():
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
  return out[0, len(prompt):].tolist()


def test_generate_greedy_equals_transformers_plain_and_under_the_folders_chat_template(folders):
  from jaxlm.data.tuning import chat

  tokenizer, model = folders["tokenizer"], folders["model"]
  output = folders["root"] / "generate.json"
  _run("generate", [f"--init_from={folders['llama']}", "--prompt=def f", "--prompt=the cat", "--max_new_tokens=8",
                    "--temperature=0", f"--output={output}"])
  result = json.loads(output.read_text())
  assert result["checkpoint_step"] is None and result["model"] == folders["llama"]
  for i, prompt in enumerate(["def f", "the cat"]):
    ids = tokenizer.encode(prompt).ids
    expected = _greedy(model, ids, 8)
    assert result[f"sample_{i}_tokens"] == expected and len(expected) == 8
    assert result[f"sample_{i}_text"] == tokenizer.decode(ids + expected)

  _run("generate", [f"--init_from={folders['chat']}", "--chat", "--prompt=def", "--max_new_tokens=6",
                    "--temperature=0", f"--output={output}"])
  ids = chat.prompt_ids(folders["chat"], [{"role": "user", "content": "def"}]).tolist()
  result = json.loads(output.read_text())
  assert result["sample_0_text"].startswith("<user>def<assistant>")  # the template's special tokens decoded away
  assert result["sample_0_tokens"] == _greedy(model, ids, 6)


def test_lm_eval_scores_an_hf_folder_as_transformers_does(folders):
  root, tokenizer, model = folders["root"], folders["tokenizer"], folders["model"]
  tasks = root / "tasks"
  tasks.mkdir()
  (root / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
  (tasks / "text.yaml").write_text(
      f"task: local_text\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'text.jsonl'}\n"
      "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
      "metric_list:\n  - metric: word_perplexity\n")
  output = root / "lm_eval.json"
  _run("lm_eval", [f"--init_from={folders['llama']}", f"--include_path={tasks}", "--tasks=local_text",
                   "--bootstrap_iters=0", f"--output={output}"])
  flat = json.loads(output.read_text())
  assert flat["model"] == folders["llama"] and flat["checkpoint_step"] is None
  # Each text scored after the end-of-document token (lm-eval's prefix), in one window: transformers' log-probs.
  logp = 0.0
  for text in TEXTS:
    ids = [0] + tokenizer.encode(text).ids
    with torch.no_grad():
      logits = model(torch.tensor([ids])).logits[0].double()
    logp += float(torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), ids[1:]].sum())
  words = sum(len(re.split(r"\s+", t)) for t in TEXTS)
  assert flat["local_text/word_perplexity"] == pytest.approx(np.exp(-logp / words), rel=1e-4)


def test_optimize_measures_an_hf_folder_on_the_given_text(folders):
  root, tokenizer, model = folders["root"], folders["tokenizer"], folders["model"]
  (root / "held_out.txt").write_text(EVAL_TEXT)
  out = root / "optimized"
  _run("optimize", [f"--init_from={folders['llama']}", f"--eval_text={root / 'held_out.txt'}", f"--output_dir={out}",
                    "--variants=int8_weight-only", "--repeats=1", "--calibration_batches=1", f"--seq_len={SEQ_LEN}",
                    f"--batch_size={BATCH}"])
  flat = json.loads((out / "optimize.json").read_text())
  # The .txt file is one document (its lines joined by newlines, EOS after it), cut into windows of SEQ_LEN + 1 tokens
  # overlapping by one (the last one shorter), each scored once: the second batch's filler rows count nothing.
  stream = tokenizer.encode(EVAL_TEXT.rstrip("\n"), add_special_tokens=False).ids + [0]
  windows = [stream[i:i + SEQ_LEN + 1] for i in range(0, len(stream) - 1, SEQ_LEN)]
  assert BATCH < len(windows) < 2 * BATCH
  loss = 0.0
  for window in windows:
    with torch.no_grad():
      logits = model(torch.tensor([window[:-1]])).logits[0].double()
    loss += float(torch.nn.functional.cross_entropy(logits, torch.tensor(window[1:]), reduction="sum"))
  assert flat["fp32/eval_tokens"] == len(stream) - 1
  assert flat["fp32/perplexity"] == pytest.approx(np.exp(loss / (len(stream) - 1)), rel=1e-4)
  assert flat["int8_weight-only/perplexity"] == pytest.approx(flat["fp32/perplexity"], rel=0.02)
  assert flat["int8_weight-only/checkpoint_ratio_vs_fp32"] > 2
  assert "<!-- optimize:begin -->" in (out / "report.md").read_text()
  assert sorted(os.listdir(folders["llama"])) == ["config.json", "generation_config.json", "model.safetensors",
                                                   "tokenizer.json"]  # the model's folder is only read


@pytest.mark.parametrize("script,extra", [("generate", []), ("lm_eval", ["--tasks=local_text"]),
                                          ("optimize", ["--eval_text=held_out.txt", "--output_dir=out"])])
def test_both_neither_and_an_encoder_folder_are_one_line_errors(folders, script, extra):
  for argv, message in (([f"--init_from={folders['llama']}", f"--workdir={folders['llama']}"], "both given; give one"),
                        ([], "no model given: set --workdir=<jaxlm training run> or --init_from="),
                        ([f"--init_from={folders['bert']}"], "holds an HF 'bert' model, an encoder; this command "
                                                             "needs a decoder")):
    with pytest.raises(ValueError, match=re.escape(message)) as error:
      _run(script, argv + extra)
    assert "\n" not in str(error.value)


def test_an_hf_folder_given_as_workdir_is_pointed_to_init_from(folders):
  for script, extra in (("generate", []), ("lm_eval", ["--tasks=local_text"]), ("optimize", [])):
    with pytest.raises(ValueError, match=re.escape(f"{folders['llama']} is an HF checkpoint folder, not a jaxlm "
                                                   f"training run: give it as --init_from={folders['llama']}")):
      _run(script, [f"--workdir={folders['llama']}", *extra])


def test_the_command_line_prints_the_encoder_error_on_one_line(folders):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags_without_device_count())
  result = subprocess.run([sys.executable, os.path.join(ROOT, "experiments/generate.py"),
                           f"--init_from={folders['bert']}"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1].startswith(f"error: {folders['bert']} holds an HF 'bert' model, an "
                                                           "encoder; this command needs a decoder")
