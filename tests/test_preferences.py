"""Preference tuning: for a small random Llama-style policy and a different random reference, both saved by
transformers with a Llama-style tokenizer (a BOS before every text, EOS </s>) and a ChatML template, jaxlm's token
ids, held-out losses and every logged metric equal those of TRL 1.16's own DPOTrainer (its tokenization and its
evaluate(), DPO and IPO, standard and conversational pairs); the step's gradient equals the gradient of the loss
written directly on full logits; and a run through the one loop (DPO with LoRA, the reference the base) writes
start_eval.json at log 2 and learns, on padding-free rows (preference.padding_free, the default) and padded ones;
the padding-free rows give the padded layout's held-out metrics, loss and gradient."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import save_random_llama, write_jsonl, write_llama_style_tokenizer
from flax import nnx

torch = pytest.importorskip("torch", reason="HF parity tests need the hf extra: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="HF parity tests need the hf extra: pip install -e '.[hf]'")

from jaxlm import config as config_lib  # noqa: E402
from jaxlm.config import DataConfig, PreferenceConfig  # noqa: E402
from jaxlm.data import load_tokenizer  # noqa: E402
from jaxlm.data.tuning import pair_packing  # noqa: E402
from jaxlm.data.tuning import preferences as pref_data  # noqa: E402
from jaxlm.interop import hf_weights  # noqa: E402
from jaxlm.recipes import preference_tuning  # noqa: E402
from jaxlm.training import preference_loss  # noqa: E402

WORDS = "apple river stone cloud maple tiger lemon piano silver garden".split()
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# jaxlm's held-out metric <- the one TRL's DPOTrainer.evaluate() logs (eval_num_tokens counts training tokens only)
TRL_METRICS = {"eval_preference_loss": "eval_loss", "eval_reward_accuracy": "eval_rewards/accuracies",
               "eval_reward_margin": "eval_rewards/margins", "eval_chosen_reward": "eval_rewards/chosen",
               "eval_rejected_reward": "eval_rewards/rejected", "eval_chosen_logp": "eval_logps/chosen",
               "eval_rejected_logp": "eval_logps/rejected", "eval_entropy": "eval_entropy",
               "eval_token_accuracy": "eval_mean_token_accuracy", "eval_chosen_mean_logit": "eval_logits/chosen",
               "eval_rejected_mean_logit": "eval_logits/rejected"}


def _pairs(count: int, seed: int) -> list[dict]:
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(count):
    words = [WORDS[i] for i in rng.choice(len(WORDS), size=int(rng.integers(2, 5)), replace=False)]
    rows.append({"prompt": "Repeat in capitals: " + " ".join(words), "chosen": " ".join(w.upper() for w in words),
                 "rejected": " ".join(reversed(words))})
  return rows


def _conversational(rows: list[dict]) -> list[dict]:
  message = lambda role, text: [{"role": role, "content": text}]
  return [{"prompt": message("user", r["prompt"]), "chosen": message("assistant", r["chosen"]),
           "rejected": message("assistant", r["rejected"])} for r in rows]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  folder = tmp_path_factory.mktemp("preferences")
  train, held_out = _pairs(40, 0), _pairs(8, 1)
  held_out[0]["prompt"] = "<s>" + held_out[0]["prompt"]  # a BOS in the text too: TRL's tokenizer call adds another
  texts = [r[k] for r in train for k in ("prompt", "chosen", "rejected")] + ["user\nassistant\n"]
  tokenizer = write_llama_style_tokenizer(str(folder / "tokenizer"), texts, CHATML)
  files = {}
  for name, rows in (("train", train), ("eval", held_out)):
    files[name] = write_jsonl(folder / f"{name}.jsonl", rows)
    files[f"{name}_chat"] = write_jsonl(folder / f"{name}_chat.jsonl", _conversational(rows))
  return dict(folder=folder, tokenizer=tokenizer, files=files,
              policy=save_random_llama(str(folder / "policy"), tokenizer, 1),
              reference=save_random_llama(str(folder / "reference"), tokenizer, 2))


@pytest.fixture(scope="module")
def trl_dpo(setup):
  """TRL 1.16's own DPOTrainer on the policy and the reference (transformers' models read from their folders),
  evaluating every held-out pair in one batch, as jaxlm's means are over all of them."""
  trl = pytest.importorskip("trl", reason="TRL parity tests need trl")
  if trl.__version__ != "1.16.0":
    pytest.skip(f"jaxlm follows TRL 1.16.0's DPOTrainer; trl {trl.__version__} is installed")
  import datasets  # noqa: PLC0415

  # bf16=False: TRL's default bf16 autocasts the reference's forward (not the policy's) even on a CPU.
  args = trl.DPOConfig(output_dir=str(setup["folder"] / "trl"), report_to=[], use_cpu=True, bf16=False,
                       max_length=None, per_device_eval_batch_size=64)
  policy, reference = (transformers.LlamaForCausalLM.from_pretrained(setup[k]) for k in ("policy", "reference"))
  rows = [json.loads(line) for line in open(setup["files"]["eval_chat"])]
  return trl.DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=datasets.Dataset.from_list(rows),
                        processing_class=transformers.AutoTokenizer.from_pretrained(setup["policy"]))


# ------------------------------------------------------------------------------------------------- tests


def _jaxlm_metrics(setup, data, loss: str, beta: float) -> dict:
  """jaxlm's held-out metrics: the reference pass over the pairs, then the eval function on the policy."""
  p = PreferenceConfig(loss=loss, beta=beta)
  eval_fn = jax.jit(preference_loss.make_eval_fn(nnx.split(_load(setup["policy"]))[0], p))
  for name in ("reference", "policy"):
    graphdef, params = nnx.split(_load(setup[name]))
    logps = np.asarray(jax.jit(preference_loss.make_log_probs_fn(graphdef))(params, data.eval.rows))
    if name == "reference":
      data.eval.rows["ref_logp"][...] = logps
  return preference_loss.eval_metrics(jax.device_get(eval_fn(params, data.eval.rows)))


def _load(folder: str):
  return hf_weights.from_pretrained(folder, compute_dtype="float32", param_dtype="float32")


@pytest.mark.parametrize("form", ["standard", "conversational"])
def test_tokens_losses_and_logged_metrics_equal_trl_dpo_trainers(setup, trl_dpo, form):
  import datasets  # noqa: PLC0415

  suffix = "_chat" if form == "conversational" else ""
  config = DataConfig(source="files", train_files=(setup["files"]["train" + suffix],),
                      eval_files=(setup["files"]["eval" + suffix],), seq_len=0)
  data = pref_data.build_preference_data(config, load_tokenizer(setup["policy"]), 0, 128, setup["policy"])
  rows = datasets.Dataset.from_list([json.loads(line) for line in open(setup["files"]["eval" + suffix])])
  tokenized = trl_dpo._prepare_dataset(rows, trl_dpo.processing_class, trl_dpo.args, "eval")  # DPOTrainer's own
  assert len(data.eval_pairs) == len(tokenized) == 8
  for pair, row in zip(data.eval_pairs, tokenized):
    assert (pair.prompt, pair.chosen, pair.rejected) == (row["prompt_ids"], row["chosen_ids"], row["rejected_ids"])
  end_of_turn, eos = (trl_dpo.processing_class.convert_tokens_to_ids(t) for t in ("<|im_end|>", "</s>"))
  for pair in data.eval_pairs:  # a conversational response ends with the template's end of turn and no EOS
    assert (eos in pair.chosen) == (form == "standard") and (end_of_turn in pair.chosen) == (form != "standard")
  for loss, beta in (("dpo", 0.1), ("ipo", 0.5)):
    trl_dpo.loss_types, trl_dpo.beta = ["sigmoid" if loss == "dpo" else "ipo"], beta
    expected = trl_dpo.evaluate(rows)
    found = _jaxlm_metrics(setup, data, loss, beta)
    assert 0 < expected["eval_rewards/accuracies"] < 1  # a test that can tell right from wrong rankings
    for ours, theirs in TRL_METRICS.items():
      assert found[ours] == pytest.approx(expected[theirs], rel=1e-5, abs=1e-7), (loss, ours)


def test_the_step_gradient_is_the_gradient_of_the_loss_on_full_logits(setup):
  config = DataConfig(source="files", train_files=(setup["files"]["train"],), eval_files=(setup["files"]["eval"],),
                      seq_len=0)
  data = pref_data.build_preference_data(config, load_tokenizer(setup["policy"]), 0, 128, setup["policy"])
  batch = {k: jnp.asarray(v) for k, v in data.eval.batch(np.arange(4)).items()}
  batch["ref_logp"] = jnp.asarray(np.random.default_rng(0).normal(-40, 3, (4, 2)), jnp.float32)
  graphdef, params = nnx.split(_load(setup["policy"]))
  for loss in ("dpo", "ipo", "simpo"):
    p = PreferenceConfig(loss=loss, beta=0.5, label_smoothing=0.1 if loss == "dpo" else 0.0,
                         rpo_alpha=0.5 if loss == "ipo" else 0.0)

    def direct(params):
      b, _, t = batch["inputs"].shape
      logits = nnx.merge(graphdef, params)(batch["inputs"].reshape(2 * b, t), batch["positions"].reshape(2 * b, t),
                                           batch["segment_ids"].reshape(2 * b, t))
      logp = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"].reshape(2 * b, t, 1), -1)[..., 0]
      summed = (logp * batch["loss_mask"].reshape(2 * b, t)).sum(-1).reshape(b, 2)
      losses, _, _ = preference_loss.pair_losses(summed, batch["ref_logp"], batch["loss_mask"].sum(-1), p)
      return losses.sum()

    (value, _), grads = jax.value_and_grad(preference_loss.make_preference_loss_fn(graphdef, p), has_aux=True)(
        params, batch)
    expected_value, expected = jax.value_and_grad(direct)(params)
    assert float(value) == pytest.approx(float(expected_value), rel=1e-5)
    flat, flat_expected = jax.tree.leaves(grads), jax.tree.leaves(expected)
    scale = max(float(jnp.abs(g).max()) for g in flat_expected)
    assert scale > 0
    for g, e in zip(flat, flat_expected):
      np.testing.assert_allclose(g, e, atol=1e-5 * scale, err_msg=loss)


def test_padding_free_rows_give_the_padded_layouts_metrics_loss_and_gradient(setup):
  """The same pairs, padded ([N, 2, T]) and packed into rows of 2 pairs' slots: the held-out metrics, and the
  training loss and gradient over every pair, equal to float rounding (the sums only add in another order)."""
  config = DataConfig(source="files", train_files=(setup["files"]["train_chat"],),
                      eval_files=(setup["files"]["eval_chat"],), seq_len=0)
  tokenizer = load_tokenizer(setup["policy"])
  padded = pref_data.build_preference_data(config, tokenizer, 0, 128, setup["policy"])
  free = pref_data.build_preference_data(config, tokenizer, 0, 128, setup["policy"],
                                         pair_packing.packing_layout(2, (2,)))
  assert free.train.rows["inputs"].shape[1] == 4 * padded.seq_len and len(free.train) < len(padded.train) / 2
  assert free.stats["padding_fraction"] < padded.stats["padding_fraction"] / 2
  expected, found = (_jaxlm_metrics(setup, data, "dpo", 0.1) for data in (padded, free))
  assert 0 < expected["eval_reward_accuracy"] < 1
  for key, value in expected.items():
    assert found[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
  graphdef, reference = nnx.split(_load(setup["reference"]))
  for data in (padded, free):
    data.train.rows["ref_logp"][...] = jax.jit(preference_loss.make_log_probs_fn(graphdef))(reference, data.train.rows)
  graphdef, params = nnx.split(_load(setup["policy"]))
  p = PreferenceConfig(loss="dpo", beta=0.5, label_smoothing=0.1, rpo_alpha=0.5)
  loss_and_grad = jax.jit(jax.value_and_grad(preference_loss.make_preference_loss_fn(graphdef, p), has_aux=True))
  (loss, (pairs, aux)), grads = loss_and_grad(params, padded.train.rows)
  (free_loss, (free_pairs, free_aux)), free_grads = loss_and_grad(params, free.train.rows)
  assert float(pairs) == float(free_pairs) == 40 and float(aux["correct"]) == float(free_aux["correct"])
  assert float(free_loss / free_pairs) == pytest.approx(float(loss / pairs), rel=1e-6, abs=1e-6)
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads))
  for g, free_g in zip(jax.tree.leaves(grads), jax.tree.leaves(free_grads)):
    np.testing.assert_allclose(free_g, g, atol=2e-6 * scale)


def _config(setup, **overrides):
  config = config_lib.default_config()
  config.init_from = setup["policy"]
  config.model.flavour, config.model.compute_dtype = "llama", "float32"
  config.data.source = "files"
  config.data.train_files, config.data.eval_files = (setup["files"]["train"],), (setup["files"]["eval"],)
  config.data.seq_len = 0
  config.preference.loss = "dpo"
  config.train.steps, config.train.batch_size = 10, 8
  config.train.learning_rate, config.train.warmup_steps = 3e-2, 0
  config.checkpoint.every_steps = 5
  config.log.every_steps, config.log.sample_tokens, config.log.progress_bar = 5, 4, False
  for key, value in overrides.items():
    section, name = key.split(".")
    setattr(config[section], name, value)
  return config_lib.from_config_dict(config)


def test_lora_dpo_through_the_loop_starts_at_log_2_learns_and_resumes(setup):
  workdir = str(setup["folder"] / "lora_dpo")
  config = _config(setup, **{"lora.rank": 8, "preference.beta": 0.5})
  stopped = preference_tuning.preference_tune(config, workdir, stop_at_step=5)  # as a preemption would
  assert "eval_preference_loss" not in stopped
  result = preference_tuning.preference_tune(config, workdir)  # resumes: the reference log-probs from the workdir
  start = json.load(open(os.path.join(workdir, "start_eval.json")))
  # The reference is the policy before its first step: every pair starts at log 2, no margin.
  assert start["eval_preference_loss"] == pytest.approx(np.log(2), rel=1e-5)
  assert start["eval_reward_margin"] == pytest.approx(0.0, abs=1e-6)
  assert result["eval_preference_loss"] < start["eval_preference_loss"] - 0.1
  assert result["eval_reward_accuracy"] > 0.5 and result["eval_reward_margin"] > 0
  assert os.path.isdir(os.path.join(workdir, "adapter")) and os.path.isdir(os.path.join(workdir, "hf_model"))
  lines = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert {"reward_accuracy", "reward_margin", "chosen_logp", "rejected_logp"} <= set(lines[-1])
  report = open(os.path.join(workdir, "report.md")).read()
  assert "After tuning" in report
  # The default layout: whole pairs packed into rows (row_pairs chosen from the data), [rows, pairs, 2] references.
  assert "rows_per_step" in report  # the data table's
  assert np.load(os.path.join(workdir, preference_tuning.REFERENCE_LOGPS))["train"].ndim == 3


def test_padded_dpo_through_the_loop(setup):
  """preference.padding_free=False: each pair one [2, T] slot, train.batch_size of them a step; the reference pass,
  the start evaluation (every pair at log 2) and the steps run on them (the default, padding-free rows, runs in the
  LoRA test above)."""
  workdir = str(setup["folder"] / "padded")
  config = _config(setup, **{"preference.padding_free": False, "train.steps": 2, "log.every_steps": 1,
                             "log.sample_tokens": 0})
  result = preference_tuning.preference_tune(config, workdir)
  assert result["start_eval_preference_loss"] == pytest.approx(np.log(2), rel=1e-5)
  assert result["eval_preference_loss"] < result["start_eval_preference_loss"]
  assert np.load(os.path.join(workdir, preference_tuning.REFERENCE_LOGPS))["train"].shape == (40, 2)  # [pairs, 2]
  lines = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if '"loss"' in line]
  assert len(lines) == 2 and all(np.isfinite(x["loss"]) for x in lines)
  assert "rows_per_step" not in open(os.path.join(workdir, "report.md")).read()


def test_ipo_with_a_jaxlm_run_as_the_reference(setup):
  """preference.reference names a folder (here the LoRA DPO run above, a jaxlm workdir): the start evaluation
  compares the policy with it, not with itself."""
  reference = str(setup["folder"] / "lora_dpo")
  if not os.path.isdir(os.path.join(reference, "checkpoints")):
    pytest.skip("needs test_lora_dpo_through_the_loop_starts_at_log_2_learns_and_resumes's run")
  workdir = str(setup["folder"] / "ipo_reference")
  config = _config(setup, **{"preference.loss": "ipo", "preference.reference": reference, "train.steps": 2})
  result = preference_tuning.preference_tune(config, workdir)
  # The reference learned to prefer the chosen responses: against it the untuned policy ranks them lower.
  assert result["start_eval_reward_margin"] < 0 and result["start_eval_preference_loss"] > 0
  assert np.isfinite(result["eval_preference_loss"]) and result["reference"] == reference


def test_rpo_alpha_adds_the_chosen_responses_mean_token_nll():
  logp, ref = jnp.array([[-12.0, -20.0], [-30.0, -9.0]]), jnp.array([[-11.0, -19.0], [-28.0, -10.0]])
  lengths = jnp.array([[4.0, 5.0], [6.0, 3.0]])
  for loss in ("dpo", "ipo", "simpo"):
    plain, _, _ = preference_loss.pair_losses(logp, ref, lengths, PreferenceConfig(loss=loss))
    with_rpo, _, _ = preference_loss.pair_losses(logp, ref, lengths, PreferenceConfig(loss=loss, rpo_alpha=0.5))
    np.testing.assert_allclose(with_rpo - plain, 0.5 * np.array([12 / 4, 30 / 6]), rtol=1e-6)


def test_a_pair_longer_than_the_row_keeps_its_prompts_end_and_its_responses_start():
  pairs = [pref_data.Pair(list(range(100, 112)), [1, 2, 3, 4, 5, 9], [6, 7, 9], ("p", "c", "r")),  # 12 + 6 > 11
           pref_data.Pair([100, 101], [1, 9], [2, 9], ("p", "c", "r"))]
  rows, cut = pref_data.lay_out(pairs, seq_len=10, pad_id=0)
  assert cut == 1
  first = rows.rows
  # 11 tokens a row: the prompt keeps its last 5 (11 - 6), then each response whole.
  np.testing.assert_array_equal(first["inputs"][0, 0], [107, 108, 109, 110, 111, 1, 2, 3, 4, 5])
  np.testing.assert_array_equal(first["targets"][0, 0], [108, 109, 110, 111, 1, 2, 3, 4, 5, 9])
  np.testing.assert_array_equal(first["loss_mask"][0, 0], [0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
  np.testing.assert_array_equal(first["loss_mask"][0, 1], [0, 0, 0, 0, 1, 1, 1, 0, 0, 0])
  # A response longer than half the row: the prompt keeps half the row (5 of 11), the response its first 6 tokens.
  long = [pref_data.Pair(list(range(100, 112)), list(range(1, 20)), [6, 9], ("p", "c", "r"))]
  rows, cut = pref_data.lay_out(long, seq_len=10, pad_id=0)
  np.testing.assert_array_equal(rows.rows["inputs"][0, 0], [107, 108, 109, 110, 111, 1, 2, 3, 4, 5])
  assert cut == 1 and rows.rows["loss_mask"][0, 0].sum() == 6


def test_without_a_prompt_column_the_prompt_is_what_chosen_and_rejected_share(setup, tmp_path):
  """TRL's implicit prompt: the shared start of the two message lists (or texts, a space going to the responses)."""
  explicit = [json.loads(line) for line in open(setup["files"]["eval_chat"])]
  implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in explicit]
  texts = [json.loads(line) for line in open(setup["files"]["eval"])]
  implicit_texts = [{"chosen": r["prompt"] + " " + r["chosen"], "rejected": r["prompt"] + " " + r["rejected"]}
                    for r in texts]
  tokenizer = load_tokenizer(setup["policy"])
  built = {}
  for name, rows in (("explicit", explicit), ("implicit", implicit), ("implicit_texts", implicit_texts)):
    path = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    config = DataConfig(source="files", train_files=(path,), eval_files=(path,))
    built[name] = pref_data.build_preference_data(config, tokenizer, 0, 128, setup["policy"]).eval_pairs
  for a, b in zip(built["explicit"], built["implicit"]):
    assert (a.prompt, a.chosen, a.rejected) == (b.prompt, b.chosen, b.rejected)
  for pair, row in zip(built["implicit_texts"], texts):
    prompt, chosen, rejected = pair.text
    assert (prompt, chosen, rejected) == (row["prompt"], " " + row["chosen"], " " + row["rejected"])


def test_accumulated_micro_batches_give_the_unsplit_batchs_loss_and_gradient(setup):
  from jaxlm.training import optim  # noqa: PLC0415

  config = DataConfig(source="files", train_files=(setup["files"]["train"],), eval_files=(setup["files"]["eval"],))
  data = pref_data.build_preference_data(config, load_tokenizer(setup["policy"]), 0, 128, setup["policy"])
  batch = {k: jnp.asarray(v) for k, v in data.train.batch(np.arange(8)).items()}
  batch["ref_logp"] = jnp.asarray(np.random.default_rng(1).normal(-40, 3, (8, 2)), jnp.float32)
  graphdef, params = nnx.split(_load(setup["policy"]))
  loss_fn = preference_loss.make_preference_loss_fn(graphdef, PreferenceConfig(loss="dpo", beta=0.3, rpo_alpha=0.2))
  (loss, count, grads, aux), (loss4, count4, grads4, aux4) = (
      jax.jit(lambda p, b, k=k: optim.accumulate_gradients(loss_fn, p, b, k))(params, batch) for k in (1, 4))
  assert float(count) == float(count4) == 8
  assert float(loss4) == pytest.approx(float(loss), rel=1e-5)
  assert float(aux4["correct"]) == float(aux["correct"])
  for g, g4 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads4)):
    np.testing.assert_allclose(g4, g, rtol=1e-4, atol=1e-6)


def test_simpo_runs_without_a_reference(setup):
  workdir = str(setup["folder"] / "simpo")
  config = _config(setup, **{"preference.loss": "simpo", "preference.beta": 2.0, "train.steps": 2})
  result = preference_tuning.preference_tune(config, workdir)
  assert not os.path.exists(os.path.join(workdir, preference_tuning.REFERENCE_LOGPS))
  # Reference-free: the rewards are beta times the policy's own averaged log-probabilities from the start.
  assert result["start_eval_reward_margin"] == pytest.approx(
      2.0 * (result["start_eval_chosen_logp"] - result["start_eval_rejected_logp"]), rel=1e-5)
  assert np.isfinite(result["eval_preference_loss"]) and result["reference"] == ""
