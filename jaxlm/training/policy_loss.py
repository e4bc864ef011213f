"""Policy-gradient losses on sampled completions (GRPO and its successors), as TRL 1.16's GRPOTrainer computes them,
and their gradient without [B, T, V] logits.

  advantages = group_advantages(rewards, num_generations, scale_rewards)    # [N], host or device
  loss = policy_loss(logps, old_logps, ref_logps, advantages, mask, loss=..., ...)  # TRL's, one micro-batch
  loss_fn = make_policy_loss_fn(graphdef, config.rl, batch_size)           # a SumLossFn for steps.jit_steps

Per completion token t of completion i, with the policy's log-prob l, the sampling-time one l_old, the reference's
l_ref and the completion's advantage A_i (TRL `_compute_loss`):
  ratio    r = exp(l - l_old) per token, or (sequence: GSPO) exp(mean over the completion of l - l_old)
  token    -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta r (exp(l_ref - l) - (l_ref - l) - 1)
           (the k3 KL times r: TRL's use_bias_correction_kl, on by default, the unbiased reverse-KL gradient; r is
           differentiable, so it changes the KL's gradient on-policy too, where its value is 1)
  grpo     mean over completions of each completion's token mean
  bnpo     sum over tokens / completion tokens
  dapo     the same (TRL: over the tokens of the whole generation batch; here always the whole batch)
  dr_grpo  sum over tokens / (completions x rl.max_completion_length)
The train step normalises every loss by the whole rollout batch (its completions, its completion tokens), so
micro-batches and devices add up to the unsplit batch exactly; TRL's bnpo and grpo divide by each micro-batch's own
counts instead (docs/finetuning.md).

The gradient, as preference_loss does it: the loss is a function of the per-token log-probs of the completion
tokens, so the step computes them forward only (`Kernels.token_log_probs`, chunked), takes d loss / d l per token
with jax.grad on that small [N, C] function, and differentiates the fused cross-entropy with -d loss / d l as token
weights: the exact gradient, with the memory of an LM step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.config import RLConfig

ADVANTAGE_EPS = 1e-4  # TRL: advantages / (std + 1e-4)
# Step metrics (TRL's names): means over completion tokens (over completions with sequence importance sampling)
TOKEN_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def _nanstd(x: jax.Array, axis=None) -> jax.Array:
  """Standard deviation ignoring NaNs, with Bessel's correction (NaN below two values), as TRL's `nanstd`."""
  count = jnp.sum(~jnp.isnan(x), axis=axis, keepdims=True)
  mean = jnp.nanmean(x, axis=axis, keepdims=True)
  variance = jnp.nanmean((x - mean) ** 2, axis=axis, keepdims=True)
  variance = variance * jnp.where(count > 1, count / jnp.maximum(count - 1, 1), jnp.nan)
  return jnp.sqrt(variance)


def reward_stds(rewards_N: jax.Array, num_generations: int, scale_rewards: str) -> jax.Array:
  """The std each completion's advantage is divided by [N]: its group's (group, and none for the zero-std count), or
  the batch's (batch)."""
  rewards_N = jnp.asarray(rewards_N, jnp.float32)
  if scale_rewards == "batch":
    return jnp.broadcast_to(_nanstd(rewards_N).reshape(()), rewards_N.shape)
  return jnp.repeat(_nanstd(rewards_N.reshape(-1, num_generations), axis=1)[:, 0], num_generations)


def group_advantages(rewards_N: jax.Array, num_generations: int, scale_rewards: str) -> jax.Array:
  """Each completion's reward minus its group's mean reward, divided by std + 1e-4 unless scale_rewards is none
  (TRL `_generate_and_score_completions`, sum_then_normalize). Groups are consecutive: completion i is generation
  i % G of prompt i // G. A NaN reward (no function scored it) stays out of the means and gets advantage 0."""
  rewards_N = jnp.asarray(rewards_N, jnp.float32)
  means_N = jnp.repeat(jnp.nanmean(rewards_N.reshape(-1, num_generations), axis=1), num_generations)
  advantages_N = rewards_N - means_N
  if scale_rewards != "none":
    advantages_N = advantages_N / (reward_stds(rewards_N, num_generations, scale_rewards) + ADVANTAGE_EPS)
  return jnp.nan_to_num(advantages_N, nan=0.0)


def token_terms(logps, old_logps, ref_logps, advantages_N, mask, *, importance_sampling: str, epsilon: float,
                epsilon_high: float, beta: float) -> dict[str, jax.Array]:
  """The per-token loss before normalisation and what the metrics read, arrays [N, C] (or [N, 1] for sequence
  ratios): `loss`, `ratio` (TRL's coef_1), `kl` (None when beta = 0), `low_clipped`, `high_clipped`."""
  mask = mask.astype(jnp.float32)
  log_ratio = logps - old_logps
  if importance_sampling == "sequence":
    log_ratio = ((log_ratio * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0))[:, None]
  elif importance_sampling != "token":
    raise ValueError(f"importance_sampling={importance_sampling!r} is not one of token, sequence")
  ratio = jnp.exp(log_ratio)
  a = advantages_N[:, None]
  clipped = jnp.clip(ratio, 1 - epsilon, 1 + epsilon_high)
  loss = -jnp.minimum(ratio * a, clipped * a)
  kl = None
  if beta:
    # times the ratio: TRL's use_bias_correction_kl (its default); the kl metric is of this product too, as TRL's
    kl = (jnp.exp(ref_logps - logps) - (ref_logps - logps) - 1) * ratio
    loss = loss + beta * kl
  return {"loss": loss, "ratio": ratio, "kl": kl, "low_clipped": (ratio < 1 - epsilon) & (a < 0),
          "high_clipped": (ratio > 1 + epsilon_high) & (a > 0)}


def policy_loss(logps, old_logps, ref_logps, advantages, mask, *, loss: str, importance_sampling: str = "token",
                epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
                max_completion_length: int | None = None) -> jax.Array:
  """The loss of one micro-batch without accumulation, as TRL computes it: per-token arrays [N, C] (`old_logps` None:
  the current ones, detached, as TRL with num_iterations 1; `ref_logps` None when beta = 0), advantages [N]."""
  epsilon_high = epsilon if epsilon_high is None else epsilon_high
  old_logps = jax.lax.stop_gradient(logps) if old_logps is None else old_logps
  mask = mask.astype(jnp.float32)
  per_token = token_terms(logps, old_logps, ref_logps, advantages, mask, importance_sampling=importance_sampling,
                          epsilon=epsilon, epsilon_high=epsilon_high, beta=beta)["loss"]
  masked = per_token * mask
  if loss == "grpo":
    return jnp.mean(masked.sum(-1) / jnp.maximum(mask.sum(-1), 1.0))
  if loss in ("bnpo", "dapo"):
    return masked.sum() / jnp.maximum(mask.sum(), 1.0)
  if loss == "dr_grpo":
    if not max_completion_length:
      raise ValueError("loss=dr_grpo divides by max_completion_length; give it")
    return masked.sum() / (masked.shape[0] * max_completion_length)
  raise ValueError(f"loss={loss!r} is not one of grpo, dr_grpo, dapo, bnpo")


def batch_loss_sums(logps, batch: dict, rl: RLConfig, batch_size: int) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(loss sum, metric sums) of a micro-batch, each scaled so that summing over the micro-batches of a rollout batch
  and dividing by its `batch_size` completions gives the whole batch's loss and metric means exactly.
  batch: loss_mask [n, C], advantages [n], old_logp / ref_logp [n, C] when present, completion_tokens [n] (the
  rollout batch's completion-token total, on every row)."""
  mask = batch["loss_mask"].astype(jnp.float32)
  old = batch["old_logp"] if "old_logp" in batch else jax.lax.stop_gradient(logps)
  epsilon_high = rl.epsilon_high or rl.epsilon
  terms = token_terms(logps, old, batch.get("ref_logp"), batch["advantages"], mask,
                      importance_sampling=rl.importance_sampling, epsilon=rl.epsilon, epsilon_high=epsilon_high,
                      beta=rl.beta)
  tokens = jnp.maximum(batch["completion_tokens"][0].astype(jnp.float32), 1.0)
  row_sums = (terms["loss"] * mask).sum(-1)
  if rl.loss == "grpo":
    loss_sum = jnp.sum(row_sums / jnp.maximum(mask.sum(-1), 1.0))
  elif rl.loss == "dr_grpo":
    loss_sum = jnp.sum(row_sums) / rl.max_completion_length
  else:  # bnpo, dapo: over the rollout batch's completion tokens
    loss_sum = jnp.sum(row_sums) * batch_size / tokens

  def token_mean_sum(x):  # a sum whose total over the batch, / batch_size, is the token mean (TRL's)
    x = x.astype(jnp.float32)
    if x.shape[-1] == 1:  # sequence ratios: one value per completion, a mean over completions
      return jnp.sum(x)
    return jnp.sum(x * mask) * batch_size / tokens

  metrics = {"clip_ratio/low_mean": token_mean_sum(terms["low_clipped"]),
             "clip_ratio/high_mean": token_mean_sum(terms["high_clipped"]),
             "clip_ratio/region_mean": token_mean_sum(terms["low_clipped"] | terms["high_clipped"])}
  if terms["kl"] is not None:
    metrics["kl"] = token_mean_sum(terms["kl"])
  return loss_sum, metrics


def completion_states(model, batch: dict) -> tuple[jax.Array, jax.Array, int]:
  """The final hidden states that predict the completion tokens [n*C, D], their targets [n*C] and C. Rows are
  [left-padded prompt, completion] and the completion fills the last C slots, so the last C positions of
  `inputs` (one shorter than the row) predict it: TRL's logits_to_keep."""
  n, c = batch["targets"].shape
  x_BTD = model.features(batch["inputs"], batch["positions"], batch["segment_ids"])[:, -c:]
  return x_BTD.reshape(n * c, -1), batch["targets"].reshape(-1), c


def completion_log_probs(model, batch: dict, with_entropy: bool = False):
  """Per-token log-probs [n, C] of the completion tokens under `model`, forward only (and entropies with
  `with_entropy`): the sampling-time and reference passes, and the loss's values."""
  x_ND, targets_N, c = completion_states(model, batch)
  out = model.kernels.token_log_probs(jax.lax.stop_gradient(x_ND), jax.lax.stop_gradient(model.output_table()),
                                      targets_N, model.config.logit_softcap, with_entropy=with_entropy)
  return jax.tree.map(lambda a: a.reshape(-1, c), out)


def make_log_probs_fn(graphdef: nnx.GraphDef):
  """(params, batch) -> [n, C] per-token log-probs of the completion tokens (old and reference log-probs)."""
  return lambda params, batch: completion_log_probs(nnx.merge(graphdef, params), batch)


def make_policy_loss_fn(graphdef: nnx.GraphDef, rl: RLConfig, batch_size: int):
  """(params, batch) -> (loss sum, (completions, metric sums)): a SumLossFn whose gradient is the policy loss's
  (`batch_loss_sums`). `batch_size`: the rollout batch's completions (train.batch_size)."""

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    x_ND, targets_N, c = completion_states(model, batch)
    table = model.output_table()
    logp_N, entropy_N = model.kernels.token_log_probs(jax.lax.stop_gradient(x_ND), jax.lax.stop_gradient(table),
                                                      targets_N, model.config.logit_softcap, with_entropy=True)
    logps = logp_N.reshape(-1, c)
    (loss_sum, metrics), dloss = jax.value_and_grad(lambda l: batch_loss_sums(l, batch, rl, batch_size),
                                                    has_aux=True)(logps)
    # log p of a token = -(its cross-entropy): token weight -d loss / d log p.
    weights_N = jax.lax.stop_gradient(-dloss.reshape(-1))
    surrogate, _ = model.kernels.cross_entropy_sums(x_ND, table, targets_N, weights_N, model.config.logit_softcap)
    loss_sum = loss_sum + (surrogate - jax.lax.stop_gradient(surrogate))  # the value of the loss, its gradient
    mask = batch["loss_mask"].astype(jnp.float32)
    tokens = jnp.maximum(batch["completion_tokens"][0].astype(jnp.float32), 1.0)
    metrics["entropy"] = jnp.sum(entropy_N.reshape(-1, c) * mask) * batch_size / tokens
    # `correct` becomes the step's token_accuracy (correct / completions): here the share of completions with a
    # positive advantage
    metrics["correct"] = jnp.sum((batch["advantages"] > 0).astype(jnp.float32))
    rows = jnp.asarray(batch["advantages"].shape[0], jnp.float32)
    return loss_sum, (rows, metrics)

  return loss_fn


def loss_metric_names(rl: RLConfig) -> tuple[str, ...]:
  """The step metrics `make_policy_loss_fn` adds (TRL's names)."""
  return tuple(k for k in TOKEN_METRICS if k != "kl" or rl.beta)
