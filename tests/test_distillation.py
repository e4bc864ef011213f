"""Distillation through the one loop: a small random Llama-style student tuned towards a different random teacher
(both saved by transformers with one tokenizer) on prompt/response pairs, off-policy and on-policy; the checkpoint
holds the student alone and a resumed run continues it bit for bit; a teacher with another vocabulary is a one-line
error naming both; pretraining distils from a jaxlm run; on-policy rows put the loss on the sampled responses."""

import json
import os

import jax
import numpy as np
import pytest
from conftest import save_random_llama, write_jsonl, write_llama_style_tokenizer

torch = pytest.importorskip("torch", reason="the HF teacher and student need the hf extra: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="the HF teacher and student need the hf extra")

from jaxlm import config as config_lib  # noqa: E402
from jaxlm.recipes import distillation, instruction_tuning, pretraining  # noqa: E402
from jaxlm.recipes import trained_runs  # noqa: E402

WORDS = "apple river stone cloud maple tiger lemon piano silver garden".split()


def _pairs(count: int, seed: int) -> list[dict]:
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(count):
    words = [WORDS[i] for i in rng.choice(len(WORDS), size=int(rng.integers(2, 5)), replace=False)]
    rows.append({"prompt": "Repeat in capitals: " + " ".join(words), "response": " ".join(w.upper() for w in words)})
  return rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  folder = tmp_path_factory.mktemp("distillation")
  train, held_out = _pairs(32, 0), _pairs(8, 1)
  texts = [r[k] for r in train for k in ("prompt", "response")]
  tokenizer = write_llama_style_tokenizer(str(folder / "tokenizer"), texts, None)
  other = write_llama_style_tokenizer(str(folder / "other_tokenizer"), texts[::-1] + ["zebra xylophone"], None)
  return dict(folder=folder, files={"train": write_jsonl(folder / "train.jsonl", train),
                                    "eval": write_jsonl(folder / "eval.jsonl", held_out)},
              student=save_random_llama(str(folder / "student"), tokenizer, 1),
              teacher=save_random_llama(str(folder / "teacher"), tokenizer, 2, layers=3),
              stranger=save_random_llama(str(folder / "stranger"), other, 3))


def _config(setup, **overrides):
  config = config_lib.default_config()
  config.init_from = setup["student"]
  config.distill.teacher = setup["teacher"]
  config.distill.teacher_dtype = "float32"
  config.model.flavour, config.model.compute_dtype = "llama", "float32"
  config.data.source = "files"
  config.data.train_files, config.data.eval_files = (setup["files"]["train"],), (setup["files"]["eval"],)
  config.data.seq_len = 0
  config.train.steps, config.train.batch_size = 6, 8
  config.train.learning_rate, config.train.warmup_steps = 1e-2, 0
  config.checkpoint.every_steps = 3
  config.log.every_steps, config.log.sample_tokens, config.log.progress_bar = 1, 0, False
  config.rl.max_completion_length = 8
  for key, value in overrides.items():
    section, name = key.split(".")
    setattr(config[section], name, value)
  return config_lib.from_config_dict(config)


def _student_params(workdir: str):
  _, _, params, _, _ = trained_runs.load_decoder_run(workdir)
  return jax.tree.leaves(jax.device_get(params))


def test_instruction_distillation_learns_the_teacher_and_resumes_bit_for_bit(setup):
  config = _config(setup)
  whole = str(setup["folder"] / "whole")
  result = instruction_tuning.instruction_tune(config, whole)
  start = json.load(open(os.path.join(whole, instruction_tuning.START_EVAL)))
  assert result["eval_distill_divergence"] < 0.8 * start["eval_distill_divergence"]
  lines = [json.loads(line) for line in open(os.path.join(whole, "metrics.jsonl")) if '"loss"' in line]
  # distill.alpha = 0: the objective is the divergence alone
  assert all(line["loss"] == pytest.approx(line["distill_divergence"], rel=1e-5) for line in lines)
  # The checkpoint is the student's train state: no teacher leaf in it, and a preempted run resumes exactly.
  resumed = str(setup["folder"] / "resumed")
  instruction_tuning.instruction_tune(config, resumed, stop_at_step=3)
  instruction_tuning.instruction_tune(config, resumed)
  for a, b in zip(_student_params(whole), _student_params(resumed)):
    np.testing.assert_array_equal(a, b)


def test_on_policy_steps_train_on_the_students_own_responses(setup):
  """Every step samples (on_policy = 1): the loss is on the student's own responses, graded by an int8 teacher."""
  # ... with the teacher's weights in int8 (weight-only)
  config = _config(setup, **{"distill.on_policy": 1.0, "distill.loss": "jsd", "distill.teacher_dtype": "int8",
                             "train.steps": 2})
  workdir = str(setup["folder"] / "on_policy")
  result = instruction_tuning.instruction_tune(config, workdir)
  assert np.isfinite(result["eval_distill_divergence"])
  lines = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if '"loss"' in line]
  for line in lines:
    assert line["tokens"] <= 8 * 8  # the loss is on 8 sampled responses of at most rl.max_completion_length = 8
    assert line["loss"] == pytest.approx(line["distill_divergence"], rel=1e-5)


@pytest.mark.parametrize("overrides, words", [
    ({"distill.on_policy": 0.5, "distill.alpha": 0.1}, "distill.alpha=0"),
    ({"distill.loss": "jsd", "distill.beta": 1.0}, "distill.loss=forward_kl or reverse_kl"),
    ({"mesh.pipeline": 2, "model.num_layers": 2}, "mesh.pipeline=1"),
    ({"distill.teacher": "", "distill.on_policy": 0.5}, "needs a distill.teacher"),
])
def test_conflicting_distillation_keys_are_one_line_errors(overrides, words):
  config = config_lib.default_config()
  config.distill.teacher = "teacher_folder"
  config.train.grad_accum = 2
  for key, value in overrides.items():
    section, name = key.split(".")
    setattr(config[section], name, value)
  with pytest.raises(ValueError, match=words.replace(".", r"\.")) as error:
    config_lib.from_config_dict(config)
  assert "\n" not in str(error.value)


def test_response_rows_put_the_loss_on_the_sampled_tokens_up_to_the_stop():
  tokens = np.array([[0, 0, 5, 6], [7, 8, 9, 10]], np.int32)  # left-padded prompts
  pads = np.array([2, 0], np.int32)
  completions = np.array([[11, 2, 0], [12, 13, 14]], np.int32)  # 2 = stop; the second is cut at C = 3
  rows = distillation.response_rows(tokens, pads, completions, {2}, seq_len=8)
  assert rows["inputs"].shape == (2, 8)
  np.testing.assert_array_equal(rows["inputs"][0, :6], [0, 0, 5, 6, 11, 2])
  np.testing.assert_array_equal(rows["targets"][0, :6], [0, 5, 6, 11, 2, 0])
  np.testing.assert_array_equal(rows["loss_mask"][0], [0, 0, 0, 1, 1, 0, 0, 0])  # predicts 11 and the stop
  np.testing.assert_array_equal(rows["loss_mask"][1], [0, 0, 0, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(rows["positions"][0, :6], [0, 0, 0, 1, 2, 3])
  np.testing.assert_array_equal(rows["segment_ids"][0], [0, 0, 1, 1, 1, 1, 0, 0])


def test_a_teacher_with_another_vocabulary_is_a_one_line_error_naming_both(setup):
  config = _config(setup, **{"distill.teacher": setup["stranger"]})
  with pytest.raises(ValueError) as error:
    instruction_tuning.instruction_tune(config, str(setup["folder"] / "stranger_run"))
  message = str(error.value)
  assert "\n" not in message and setup["stranger"] in message and setup["student"] in message
  assert "320 tokens" in message and "init_from's tokenizer" in message


def test_pretraining_distils_from_an_hf_teacher(setup, tmp_path):
  """train_lm's recipe: a student from scratch on packed text tokenized by the teacher's tokenizer."""
  texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": r["prompt"] + " " + r["response"]} for r in _pairs(64, 2)])
  config = config_lib.default_config()
  config.model.update(vocab_size=320, num_layers=1, d_model=32, num_heads=2, max_seq_len=32)
  config.data.update(source="files", train_files=(texts,), seq_len=32, cache_dir=str(tmp_path / "cache"),
                     tokenizer=os.path.join(setup["teacher"], "tokenizer.json"))
  config.train.update(steps=4, warmup_steps=0, batch_size=8, eval_batches=1)
  config.log.update(every_steps=2, sample_tokens=0, progress_bar=False)
  config.checkpoint.every_steps = 0
  config.distill.update(teacher=setup["teacher"], loss="reverse_kl", teacher_dtype="float32")
  summary = pretraining.train(config_lib.from_config_dict(config), str(tmp_path / "student"))
  assert np.isfinite(summary["eval_distill_divergence"]) and summary["eval_distill_divergence"] > 0
  assert summary["loss"] == pytest.approx(summary["distill_divergence"], rel=1e-5)
