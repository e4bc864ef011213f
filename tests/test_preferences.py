"""Preference tuning: for a small random Llama-style policy and a different random reference, both saved by
transformers, jaxlm's held-out preference metrics equal those computed from transformers' log-probabilities with
TRL's formulas (DPO and IPO, standard and conversational pairs, tokenized as TRL tokenizes them); the step's
gradient equals the gradient of the loss written directly on full logits; and a run through the one loop (DPO with
LoRA, the reference the base) writes start_eval.json at log 2 and learns."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import write_jsonl
from flax import nnx

torch = pytest.importorskip("torch", reason="HF parity tests need the hf extra: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="HF parity tests need the hf extra: pip install -e '.[hf]'")

from experiments import conversations as conversation_data  # noqa: E402
from jaxlm import config as config_lib  # noqa: E402
from jaxlm.config import DataConfig, PreferenceConfig  # noqa: E402
from jaxlm.data import load_tokenizer  # noqa: E402
from jaxlm.data.tuning import chat  # noqa: E402
from jaxlm.data.tuning import preferences as pref_data  # noqa: E402
from jaxlm.interop import hf_weights  # noqa: E402
from jaxlm.recipes import preference_tuning  # noqa: E402
from jaxlm.training import preference_loss  # noqa: E402

WORDS = "apple river stone cloud maple tiger lemon piano silver garden".split()


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



def _save_llama(folder: str, tokenizer_folder: str, seed: int) -> str:
  torch.manual_seed(seed)
  config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=320, max_position_embeddings=128,
                                    initializer_range=0.2, tie_word_embeddings=False, rms_norm_eps=1e-6)
  transformers.LlamaForCausalLM(config).save_pretrained(folder)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(tokenizer_folder, name), folder)
  return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  folder = tmp_path_factory.mktemp("preferences")
  train, held_out = _pairs(40, 0), _pairs(6, 1)
  chats = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r[k]}]}
           for r in train for k in ("chosen", "rejected")]
  tokenizer = conversation_data.write_chat_tokenizer(str(folder / "tokenizer"), chats, 320, 128)
  files = {}
  for name, rows in (("train", train), ("eval", held_out)):
    files[name] = write_jsonl(folder / f"{name}.jsonl", rows)
    files[f"{name}_chat"] = write_jsonl(folder / f"{name}_chat.jsonl", _conversational(rows))
  return dict(folder=folder, tokenizer=tokenizer, files=files, policy=_save_llama(str(folder / "policy"), tokenizer, 1),
              reference=_save_llama(str(folder / "reference"), tokenizer, 2))


# ------------------------------------------------------------------------- the reference: transformers + TRL


def _trl_tokens(hf_tokenizer, row: dict) -> tuple[list[int], list[int], list[int]]:
  """TRL's DPOTrainer tokens: maybe_apply_chat_template, then tokenize_row (prompt, response + EOS, no specials)."""
  prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
  if isinstance(chosen, list):
    prompt_text = hf_tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    with_chosen = hf_tokenizer.apply_chat_template(prompt + chosen, tokenize=False)
    with_rejected = hf_tokenizer.apply_chat_template(prompt + rejected, tokenize=False)
    n = 0
    while n < min(len(prompt_text), len(with_chosen)) and prompt_text[n] == with_chosen[n]:
      n += 1
    prompt, chosen, rejected = prompt_text[:n], with_chosen[n:], with_rejected[n:]
  ids = lambda text: hf_tokenizer(text, add_special_tokens=False)["input_ids"]
  eos, bos = hf_tokenizer.eos_token_id, hf_tokenizer.bos_token_id
  prompt_ids = ids(prompt)
  if bos is not None and prompt_ids[:1] != [bos]:  # TRL's add_bos_token_if_needed (before 0.12)
    prompt_ids = [bos] + prompt_ids
  return prompt_ids, ids(chosen) + [eos], ids(rejected) + [eos]


def _hf_logps(model, prompt: list[int], response: list[int]) -> tuple[float, int]:
  """Summed log-probability of `response` after `prompt` under a transformers model, and its length."""
  ids = torch.tensor([prompt + response])
  with torch.no_grad():
    logits = model(ids).logits[0, :-1].double()
  logps = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
  return float(logps[len(prompt) - 1:].sum()), len(response)


def _trl_metrics(policy, reference, hf_tokenizer, rows, loss: str, beta: float) -> dict:
  """TRL's dpo_loss (loss_type sigmoid or ipo) and its logged metrics, means over the pairs."""
  logps, ref_logps = [], []
  for row in rows:
    prompt, chosen, rejected = _trl_tokens(hf_tokenizer, row)
    (c, nc), (r, nr) = _hf_logps(policy, prompt, chosen), _hf_logps(policy, prompt, rejected)
    (c0, _), (r0, _) = _hf_logps(reference, prompt, chosen), _hf_logps(reference, prompt, rejected)
    if loss == "ipo":  # TRL averages the log-probs over the response tokens for IPO
      c, r, c0, r0 = c / nc, r / nr, c0 / nc, r0 / nr
    logps.append((c, r))
    ref_logps.append((c0, r0))
  logps, ref_logps = torch.tensor(logps), torch.tensor(ref_logps)
  logits = (logps[:, 0] - logps[:, 1]) - (ref_logps[:, 0] - ref_logps[:, 1])
  losses = (logits - 1 / (2 * beta)) ** 2 if loss == "ipo" else -torch.nn.functional.logsigmoid(beta * logits)
  chosen_rewards, rejected_rewards = beta * (logps[:, 0] - ref_logps[:, 0]), beta * (logps[:, 1] - ref_logps[:, 1])
  return {"eval_preference_loss": float(losses.mean()),
          "eval_reward_accuracy": float((chosen_rewards > rejected_rewards).double().mean()),
          "eval_reward_margin": float((chosen_rewards - rejected_rewards).mean()),
          "eval_chosen_logp": float(logps[:, 0].mean()), "eval_rejected_logp": float(logps[:, 1].mean())}


def _hf_tokenizer(folder: str):
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  tokenizer.chat_template = chat.load(folder).text
  return tokenizer


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
def test_held_out_metrics_equal_trl_formulas_on_transformers_log_probs(setup, form):
  suffix = "_chat" if form == "conversational" else ""
  config = DataConfig(source="files", train_files=(setup["files"]["train" + suffix],),
                      eval_files=(setup["files"]["eval" + suffix],), seq_len=0)
  data = pref_data.build_preference_data(config, load_tokenizer(setup["policy"]), 0, 128, setup["policy"])
  rows = [json.loads(line) for line in open(setup["files"]["eval" + suffix])]
  hf_tokenizer = _hf_tokenizer(setup["policy"])
  for pair, row in zip(data.eval_pairs, rows):  # the tokens are TRL's
    assert (pair.prompt, pair.chosen, pair.rejected) == _trl_tokens(hf_tokenizer, row)
  policy, reference = (transformers.LlamaForCausalLM.from_pretrained(setup[k]).eval() for k in ("policy", "reference"))
  for loss, beta in (("dpo", 0.1), ("ipo", 0.5)):
    expected = _trl_metrics(policy, reference, hf_tokenizer, rows, loss, beta)
    found = _jaxlm_metrics(setup, data, loss, beta)
    assert expected["eval_reward_accuracy"] not in (0.0, 1.0)  # a test that can tell right from wrong rankings
    for key, value in expected.items():
      assert found[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (loss, key)


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
  assert "After tuning" in open(os.path.join(workdir, "report.md")).read()


def test_a_prompt_starts_with_the_tokenizers_bos_once(setup, tmp_path):
  """A tokenizer that puts a BOS before every text (Llama's, Gemma's): each prompt starts with exactly one, whether
  the text has it or not; responses never get one."""
  import tokenizers  # noqa: PLC0415

  tokenizer = load_tokenizer(setup["policy"])
  bos = tokenizer.token_to_id("<|endoftext|>")
  tokenizer.post_processor = tokenizers.processors.TemplateProcessing(single="<|endoftext|> $A",
                                                                       special_tokens=[("<|endoftext|>", bos)])
  rows = [{"prompt": "Repeat in capitals: apple", "chosen": "APPLE", "rejected": "apple"},
          {"prompt": "<|endoftext|>Repeat in capitals: pear", "chosen": "PEAR", "rejected": "pear"}]
  files = write_jsonl(tmp_path / "pairs.jsonl", rows)
  data = pref_data.build_preference_data(DataConfig(source="files", train_files=(files,), eval_files=(files,)),
                                         tokenizer, 0, 128, None)
  for pair in data.eval_pairs:
    assert pair.prompt[0] == bos and bos not in pair.prompt[1:] and bos not in pair.chosen[:1]


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
