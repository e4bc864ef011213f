"""Distilling a classifier into its pruned copy: the loss against a hand computation (and no gradient where student
and teacher agree), unlabelled texts read and batched with the teacher's logits, optimize's Task feeding the masked
fine-tune from them, and stdlib_docs' unlabelled file holding no held-out text."""

import csv
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import load_script, write_labelled_words
from flax import nnx

from jaxlm import config as config_lib
from jaxlm.compress import distill, prune
from jaxlm.config import ModelConfig
from jaxlm.data.tokenizer import load_tokenizer
from jaxlm.interop import hf_weights
from jaxlm.models.bert import Bert, BertForSequenceClassification
from jaxlm.recipes import classifier_finetuning, trained_runs

stdlib_docs = load_script("experiments/stdlib_docs.py")
FORWARD = lambda m, b: m(b["input_ids"], b["attention_mask"], b["token_type_ids"])  # noqa: E731


def _classifier(vocab_size: int) -> BertForSequenceClassification:
  config = ModelConfig(flavour="bert", vocab_size=vocab_size, num_layers=1, d_model=32, num_heads=2, d_ff=64,
                       max_seq_len=32, compute_dtype="float32")
  return BertForSequenceClassification(config, 3, rngs=nnx.Rngs(0))


def _batch(rng, rows=6, length=10, vocab=12):
  lengths = rng.integers(3, length + 1, rows)
  mask = (np.arange(length)[None] < lengths[:, None]).astype(np.int32)
  return {"input_ids": rng.integers(2, vocab, (rows, length)).astype(np.int32) * mask, "attention_mask": mask,
          "token_type_ids": np.zeros((rows, length), np.int32), "weights": np.array([1, 1, 1, 1, 0.5, 0], np.float32)}


def test_distillation_loss_by_hand_and_no_gradient_where_the_student_is_the_teacher():
  model = _classifier(12)
  graphdef, state = nnx.split(model)
  params = state.to_pure_dict()
  batch = _batch(np.random.default_rng(0))
  own = np.asarray(FORWARD(model, batch))
  temperature = 2.0
  loss_fn = distill.make_distillation_loss_fn(graphdef, temperature)

  teacher = own + np.random.default_rng(1).normal(size=own.shape).astype(np.float32)
  total, (count, aux) = loss_fn(params, {**batch, distill.TEACHER_LOGITS: teacher})
  targets = np.exp(teacher / 2) / np.exp(teacher / 2).sum(-1, keepdims=True)
  log_student = own / 2 - np.log(np.exp(own / 2).sum(-1, keepdims=True))
  expected = (-(targets * log_student).sum(-1) * batch["weights"]).sum() * 4
  np.testing.assert_allclose(float(total), expected, rtol=1e-5)
  assert float(count) == pytest.approx(4.5)

  # The student equal to its teacher: zero gradient (the dense control stays where it is), full agreement.
  same = {**batch, distill.TEACHER_LOGITS: own}
  grads = jax.grad(lambda p: loss_fn(p, same)[0])(params)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) < 1e-5
  assert float(loss_fn(params, same)[1][1]["agree"]) == pytest.approx(4.5)
  with pytest.raises(ValueError, match="distillation temperature 0.0 must be > 0"):
    distill.make_distillation_loss_fn(graphdef, 0.0)


def _texts_csv(path, texts, column="text"):
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow([column])
    writer.writerows([t] for t in texts)
  return str(path)


def test_unlabelled_texts_are_read_batched_once_with_the_teachers_logits(tmp_path):
  vocab = write_labelled_words(tmp_path, 4, 4)
  tokenizer = load_tokenizer(str(tmp_path / "tokenizer.json"))
  data = config_lib.DataConfig(text_column="text")
  path = _texts_csv(tmp_path / "texts.csv", ["alpha beta", "", "gamma delta value one two", "def", "two alpha beta"])
  examples = distill.read_texts([path], data, tokenizer, seq_len=8)
  assert len(examples) == 4  # the empty row is skipped; no label column is needed
  np.testing.assert_array_equal(examples.lengths, [2, 5, 1, 3])

  model = _classifier(vocab)
  batches = distill.teacher_batches(model, FORWARD, examples, batch_size=3, seq_len=8, batching="max")
  assert [b["weights"].tolist() for b in batches] == [[1, 1, 1], [1, 0, 0]]  # each text once, filler weighted 0
  for b in batches:
    np.testing.assert_allclose(b[distill.TEACHER_LOGITS], np.asarray(FORWARD(model, b)), rtol=1e-6, atol=1e-6)

  with pytest.raises(FileNotFoundError, match="distillation file '.*nowhere.csv' does not exist"):
    distill.read_texts([str(tmp_path / "nowhere.csv")], data, tokenizer, 8)
  with pytest.raises(ValueError, match="column 'text' not found in .*other.csv.*the distillation files need"):
    distill.read_texts([_texts_csv(tmp_path / "other.csv", ["alpha"], column="body")], data, tokenizer, 8)
  with pytest.raises(ValueError, match="hold no non-empty text in column 'text'"):
    distill.read_texts([_texts_csv(tmp_path / "blank.csv", ["", " "])], data, tokenizer, 8)


def test_classifier_task_distils_the_pruned_model_on_the_unlabelled_files(tmp_path):
  """A classifier_finetuning.py run read back as optimize.py does: the masked fine-tune's batches come from the
  unlabelled file with the float model's logits, its loss is the distillation's, and a pruned model moves towards the
  teacher."""
  vocab = write_labelled_words(tmp_path, 40, 12)
  source = tmp_path / "init"
  model_config = ModelConfig(flavour="bert", vocab_size=vocab, num_layers=1, d_model=32, num_heads=2, d_ff=64,
                             max_seq_len=32, compute_dtype="float32")
  hf_weights.save_pretrained(Bert(model_config, rngs=nnx.Rngs(0)), str(source))
  os.replace(tmp_path / "tokenizer.json", source / "tokenizer.json")
  config = config_lib.default_config()
  config.init_from = str(source)
  config.model.flavour, config.model.compute_dtype = "bert", "float32"
  config.data.source, config.data.seq_len, config.data.batching = "files", 16, "max"
  config.data.train_files, config.data.eval_files = (str(tmp_path / "train.csv"),), (str(tmp_path / "eval.csv"),)
  for key, value in {"steps": 4, "batch_size": 8, "learning_rate": 1e-3, "warmup_steps": 1, "eval_every_steps": 0,
                     "best_metric": "accuracy"}.items():
    setattr(config.train, key, value)
  config.checkpoint.every_steps, config.log.progress_bar = 0, False
  config = config_lib.from_config_dict(config)
  workdir = str(tmp_path / "run")
  classifier_finetuning.finetune(config, workdir)
  texts = _texts_csv(tmp_path / "unlabelled.csv", [" ".join(np.random.default_rng(i).choice(
      ["alpha", "beta", "gamma", "value", "one"], size=6)) for i in range(20)])

  task = trained_runs.classifier_task(workdir, config, calibration_batches=1, finetune_steps=5, finetune_orders=2,
                              distill_files=(texts,), distill_temperature=2.0)
  assert len(task.finetune_orders) == 2 and all(len(order) == 5 for order in task.finetune_orders)
  assert all(distill.TEACHER_LOGITS in b and b["input_ids"].shape == (8, 16) for b in task.finetune_orders[0])
  masks = prune.magnitude_masks(task.model, 0.5, per_layer=True)
  pruned = prune.apply_masks(task.model, masks)
  graphdef, state = nnx.split(pruned)
  loss_fn = task.loss_fn(graphdef)
  before = state.to_pure_dict()
  before["classifier"]["b"] = before["classifier"]["b"] + jnp.array([1.0, -1.0])  # a student the teacher can correct
  def mean_loss(params):
    sums = [loss_fn(params, b) for b in task.finetune_orders[0]]
    return np.mean([float(total / count) for total, (count, _) in sums])
  tuned = prune.finetune_soup(graphdef, before, masks, loss_fn, task.finetune_orders, optimizer=optax.sgd(0.3))
  assert mean_loss(tuned) < mean_loss(before) - 0.1
  assert prune.sparsity(tuned, masks) == pytest.approx(0.5, abs=0.01)  # the zeros stay zeros
  labelled = trained_runs.classifier_task(workdir, config, calibration_batches=1, finetune_steps=5)
  assert "labels" in labelled.finetune_orders[0][0] and distill.TEACHER_LOGITS not in labelled.finetune_orders[0][0]


def test_stdlib_docs_unlabelled_text_holds_no_held_out_file_and_no_eval_text(tmp_path):
  stdlib = tmp_path / "lib"
  (stdlib / "email").mkdir(parents=True)
  for i in range(8):  # one area package of eight files: two are held out
    (stdlib / "email" / f"part{i}.py").write_text(
        f'"""Parse and format mail message headers in part {i} of the package.\n\nA second paragraph of part {i} '
        f'explains more about headers here."""\n')
  (stdlib / "tkinter.py").write_text('def f():\n  """Draw a window with buttons on the screen for the user."""\n')
  (stdlib / "broken.py").write_text("def (:\n")  # not Python: skipped
  _, held_out = stdlib_docs.area_split(str(stdlib), "internet")
  assert len(held_out) == 2
  eval_text = "Parse and format mail message headers in part 0 of the package."
  texts = stdlib_docs.unlabelled_texts({eval_text}, stdlib=str(stdlib))
  assert "Draw a window with buttons on the screen for the user." in texts  # a module of no area
  assert eval_text not in texts
  for path in held_out:
    part = os.path.basename(path)[len("part"):-len(".py")]
    assert not any(f"part {part} " in t for t in texts), part
  eval_file_held_out = str(stdlib / "email" / "part0.py") in held_out
  assert len(texts) == 2 * 6 + 1 - (0 if eval_file_held_out else 1)  # kept files' two paragraphs, tkinter's one
