"""GRPO parity with TRL 1.16's own code, not a copy of its formulas: for a real tiny `GRPOTrainer` (a random
transformers Llama saved to a folder, a word-level tokenizer, nothing from the hub), TRL's `_compute_loss` runs on
per-token log-probs that we hand it in place of the model's, and its loss, its gradient with respect to those log-probs
and its logged metrics (kl, clip ratios) equal jaxlm's `policy_loss` and `batch_loss_sums` on the same numbers, for
every loss (grpo, dr_grpo, dapo, bnpo), both importance-sampling levels, with and without the KL term (times the
ratio: TRL's default use_bias_correction_kl), symmetric and asymmetric clipping, and sampling-time log-probs given or
detached. TRL's `_generate_and_score_completions` generates completions, scores them with a reward function of fixed
rewards (groups of equal rewards, unscorable completions) and its advantages and frac_reward_zero_std equal jaxlm's
`group_advantages` and `reward_stds` for each scale_rewards."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="TRL parity tests need the hf extra: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="TRL parity tests need the hf extra: pip install -e '.[hf]'")
trl = pytest.importorskip("trl", reason="TRL parity tests need trl")

from jaxlm.config import RLConfig  # noqa: E402
from jaxlm.training import policy_loss as pl  # noqa: E402

if trl.__version__ != "1.16.0":
  pytest.skip(f"jaxlm follows TRL 1.16.0's GRPOTrainer; trl {trl.__version__} is installed", allow_module_level=True)

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

WORDS = ["[PAD]", "[UNK]", "</s>", "a", "b", "c", "d", "e"]
N, C = 8, 6  # completions and completion slots of the loss tests
EPSILON = 0.2


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
  """A random 1-layer Llama and a word-level tokenizer, saved: TRL loads its reference model (beta > 0) by path."""
  import tokenizers  # noqa: PLC0415
  folder = str(tmp_path_factory.mktemp("tiny_llama"))
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", eos_token="</s>",
                                       unk_token="[UNK]").save_pretrained(folder)
  config = transformers.LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                    pad_token_id=0, bos_token_id=2, eos_token_id=2)
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(config).save_pretrained(folder)
  return folder


def _trainer(folder: str, tmp_path, reward_func=None, **config) -> GRPOTrainer:
  """A real GRPOTrainer on the tiny model, in train mode, as inside its training loop with no accumulation."""
  import datasets  # noqa: PLC0415
  args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, **config)
  trainer = GRPOTrainer(model=folder, reward_funcs=reward_func or (lambda completions, **_: [0.0] * len(completions)),
                        args=args, train_dataset=datasets.Dataset.from_dict({"prompt": ["a b"] * 4}),
                        processing_class=transformers.AutoTokenizer.from_pretrained(folder))
  trainer.model.train()
  trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop, read by _compute_loss
  return trainer


def _loss_inputs(seed: int) -> dict[str, np.ndarray]:
  """Per-token log-probs [N, C] with ratios inside and outside the clip range, right-padded completion masks of
  different lengths (a full one, a one-token one, an empty one: a masked truncated completion) and advantages of
  both signs and zero."""
  rng = np.random.default_rng(seed)
  logps = -rng.uniform(0.05, 3.0, (N, C)).astype(np.float32)
  lengths = np.array([C, 1, 3, 0, 5, 2, C, 4])
  mask = (np.arange(C)[None, :] < lengths[:, None]).astype(np.int64)
  # whole-completion shifts too, so that sequence-level ratios (GSPO) leave the clip range at both ends
  shift = np.array([-0.4, 0.4, 0.0, 0.0, 0.3, -0.3, 0.0, 0.0])[:, None]
  return {"logps": logps, "old": (logps + shift + rng.normal(0, 0.3, (N, C))).astype(np.float32),
          "ref": (logps + rng.normal(0, 0.5, (N, C))).astype(np.float32),
          "entropies": rng.uniform(0, 2, (N, C)).astype(np.float32),
          "advantages": np.array([1.3, -0.7, 0.0, 0.9, -1.5, 0.4, -0.2, 1.1], np.float32), "mask": mask}


def _trl_loss(trainer: GRPOTrainer, x: dict, with_old: bool) -> tuple[float, np.ndarray, dict[str, float]]:
  """TRL's `_compute_loss` on our log-probs (float64): its loss, d loss / d logps and the metrics it logged."""
  logps = torch.tensor(x["logps"], dtype=torch.float64, requires_grad=True)
  entropies = torch.tensor(x["entropies"], dtype=torch.float64)
  # The model's forward pass, replaced: TRL's loss arithmetic runs on these log-probs
  trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, entropies, None)
  mask = torch.tensor(x["mask"])
  inputs = {"prompt_ids": torch.full((N, 2), 3), "prompt_mask": torch.ones((N, 2), dtype=torch.long),
            "completion_ids": torch.full((N, C), 4), "completion_mask": mask,
            "advantages": torch.tensor(x["advantages"], dtype=torch.float64),
            "num_items_in_batch": mask.sum()}  # as _generate_and_score_completions: the batch's completion tokens
  if with_old:
    inputs["old_per_token_logps"] = torch.tensor(x["old"], dtype=torch.float64)
  if trainer.beta:
    inputs["ref_per_token_logps"] = torch.tensor(x["ref"], dtype=torch.float64)
  trainer._metrics = collections.defaultdict(lambda: collections.defaultdict(list))
  loss = trainer._compute_loss(trainer.model, inputs)
  loss.backward()
  metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
  return loss.item(), logps.grad.numpy(), metrics


def _close(ours, reference, tol: float = 1e-5) -> bool:
  ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
  return bool(np.abs(ours - reference).max() <= tol * max(np.abs(reference).max(), 1e-3))


# Every loss x importance-sampling level x beta; epsilon_high alternates (None = epsilon, or DAPO's clip-higher 0.28)
# so that each loss, each level and each beta meets both, in half the cases of the full product.
LOSS_CASES = [pytest.param(loss, level, beta, [None, 0.28][(i + j + k) % 2],
                           id=f"{loss}-{level}-beta{beta}-eps_high{[EPSILON, 0.28][(i + j + k) % 2]}")
              for i, loss in enumerate(("grpo", "dr_grpo", "dapo", "bnpo"))
              for j, level in enumerate(("token", "sequence")) for k, beta in enumerate((0.0, 0.04))]


@pytest.mark.parametrize("loss, level, beta, epsilon_high", LOSS_CASES)
def test_policy_loss_equals_trl(model_folder, tmp_path, loss, level, beta, epsilon_high):
  """jaxlm's policy_loss and batch_loss_sums / N equal TRL's `_compute_loss` (one micro-batch, no accumulation): the
  loss, its gradient with respect to the log-probs, and the kl and clip-ratio metrics, with the sampling-time
  log-probs given (ratios away from 1, some clipped) and absent (TRL's detached current log-probs)."""
  trainer = _trainer(model_folder, tmp_path, loss_type=loss, importance_sampling_level=level, beta=beta,
                     epsilon=EPSILON, epsilon_high=epsilon_high, max_completion_length=C, per_device_train_batch_size=4,
                     num_generations=2)
  assert trainer.args.use_bias_correction_kl and trainer.args.delta is None  # TRL's defaults: KL times the ratio
  rl = RLConfig(loss=loss, importance_sampling=level, beta=beta, epsilon=EPSILON, epsilon_high=epsilon_high or 0.0,
                max_completion_length=C)
  for seed, with_old in ((0, True), (1, False)):
    x = _loss_inputs(seed)
    expected_loss, expected_grad, expected_metrics = _trl_loss(trainer, x, with_old)
    if with_old and seed == 0:  # the data reach both clip ends
      assert expected_metrics["clip_ratio/low_mean"] > 0 and expected_metrics["clip_ratio/high_mean"] > 0
    old = jnp.asarray(x["old"]) if with_old else None
    ref = jnp.asarray(x["ref"]) if beta else None
    loss_of = lambda logps: pl.policy_loss(logps, old, ref, jnp.asarray(x["advantages"]), jnp.asarray(x["mask"]),
                                           loss=loss, importance_sampling=level, epsilon=EPSILON,
                                           epsilon_high=epsilon_high, beta=beta, max_completion_length=C)
    value, grad = jax.value_and_grad(loss_of)(jnp.asarray(x["logps"]))
    assert _close(value, expected_loss), (seed, float(value), expected_loss)
    assert _close(grad, expected_grad), (seed, np.abs(np.asarray(grad) - expected_grad).max())

    # The train step's form: sums over the micro-batch that, divided by the rollout batch's N, are TRL's means
    batch = {"loss_mask": jnp.asarray(x["mask"]), "advantages": jnp.asarray(x["advantages"]),
             "completion_tokens": jnp.full((N,), x["mask"].sum())}
    if with_old:
      batch["old_logp"] = old
    if beta:
      batch["ref_logp"] = ref
    (loss_sum, sums), sum_grad = jax.value_and_grad(lambda logps: pl.batch_loss_sums(logps, batch, rl, N),
                                                    has_aux=True)(jnp.asarray(x["logps"]))
    assert _close(loss_sum / N, expected_loss), (seed, float(loss_sum / N), expected_loss)
    assert _close(sum_grad / N, expected_grad), (seed, np.abs(np.asarray(sum_grad) / N - expected_grad).max())
    names = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"] + (["kl"] if beta else [])
    assert sorted(sums) == sorted(names) and set(names) <= set(expected_metrics)
    for name in names:
      assert _close(sums[name] / N, expected_metrics[name]), (seed, name, float(sums[name] / N),
                                                              expected_metrics[name])


# Fixed rewards of 6 prompts x 4 generations: pseudo-random groups, a group of equal rewards (std 0), a group with an
# unscorable completion (None: out of the group's mean and std, advantage 0), one with a single scorable completion
# (std NaN) and one with none.
G = 4
rng = np.random.default_rng(7)
REWARDS = [*np.round(rng.normal(0, 1, G), 3), 0.5, 0.5, 0.5, 0.5, 1.0, None, 0.0, 2.5,
           None, 3.0, None, None, None, None, None, None, *np.round(rng.uniform(0, 1, G), 3)]


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_equal_trl(model_folder, tmp_path, scale_rewards):
  """jaxlm's group_advantages of the rewards that TRL's `_generate_and_score_completions` scored equal the advantages
  it returns (a real generation batch of the tiny model, groups consecutive as TRL's sampler repeats prompts), and
  the share of completions whose std reward_stds puts at 0 equals TRL's logged frac_reward_zero_std."""
  scored = []

  def reward(completions, **_):
    assert len(completions) == len(REWARDS)
    scored.append([np.nan if r is None else float(r) for r in REWARDS])
    return [None if r is None else float(r) for r in REWARDS]

  trainer = _trainer(model_folder, tmp_path, reward_func=reward, per_device_train_batch_size=len(REWARDS),
                     num_generations=G, scale_rewards=scale_rewards, max_completion_length=4)
  prompts = ["a b", "c d", "e a", "b c", "d d", "a e"]
  torch.manual_seed(0)
  out = trainer._generate_and_score_completions([{"prompt": p} for p in prompts for _ in range(G)])
  assert len(scored) == 1
  rewards = np.array(scored[0], np.float32)
  expected = out["advantages"].numpy()
  ours = np.asarray(pl.group_advantages(rewards, G, scale_rewards))
  np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)
  assert np.all(ours[np.isnan(rewards)] == 0)  # unscorable completions
  zero_std = np.isclose(np.asarray(pl.reward_stds(rewards, G, scale_rewards)), 0.0)
  assert trainer._metrics["train"]["frac_reward_zero_std"][-1] == pytest.approx(zero_std.mean(), abs=1e-7)
  if scale_rewards != "batch":
    assert zero_std.mean() == pytest.approx(1 / 6)  # the group of equal rewards
