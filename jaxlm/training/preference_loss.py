"""Preference losses on pairs of responses, as TRL computes them, and their gradient without [B, T, V] logits.

  loss_fn = make_preference_loss_fn(graphdef, config.preference)   # a SumLossFn for steps.jit_steps
  logps = make_log_probs_fn(graphdef)(params, batch)               # [B, 2] summed response log-probs

Per pair, with the policy's summed response log-probabilities (chosen c, rejected r) and the reference's (c0, r0):
  dpo    loss = -log sigmoid(beta * z) (1 - eps) - log sigmoid(-beta * z) eps,  z = (c - r) - (c0 - r0)
         rewards beta (c - c0), beta (r - r0)                       (TRL DPOTrainer, loss_type="sigmoid")
  ipo    loss = (z' - 1 / (2 beta))^2, z' = (c - c0) / chosen tokens - (r - r0) / rejected tokens;
         rewards as dpo's                                            (TRL DPOTrainer, loss_type="ipo")
  simpo  loss = -log sigmoid(beta (c - r) - gamma) (1 - eps) - log sigmoid(-(...)) eps on log-probs averaged over
         each response's tokens, rewards beta c, beta r; no reference (TRL CPOTrainer, loss_type="simpo", cpo_alpha=0)
The logged log-probs and rewards are TRL 1.16's: sums for dpo and ipo (the averaging is inside ipo's loss only),
averages for simpo (its CPOTrainer logs the averaged log-probs its loss uses). With
`preference.rpo_alpha`, each pair's loss adds alpha * (-c / chosen tokens), the chosen response's mean token NLL
(TRL's rpo_alpha averages it over all chosen tokens of the batch instead; per pair, it accumulates exactly).

The gradient: the loss is a function of per-response sums of token log-probs, so d loss / d params =
sum over responses of (d loss / d logp_response) * d logp_response / d params. The step computes the sums forward
only (`Kernels.token_log_probs`, chunked), takes the per-response coefficients, and differentiates the
weighted cross-entropy sum with those coefficients as token weights through the fused kernel
(`Kernels.cross_entropy_sums`): the exact gradient, with the memory of an LM step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.config import PreferenceConfig

# summed over pairs, reported as means
PAIR_METRICS = ("reward_margin", "chosen_reward", "rejected_reward", "chosen_logp", "rejected_logp")


def pair_losses(logp_B2: jax.Array, ref_logp_B2: jax.Array, lengths_B2: jax.Array,
                p: PreferenceConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(loss [B], rewards [B, 2], the log-probs to log [B, 2]) from summed response log-probs (module docstring)."""
  tokens_B2 = jnp.maximum(lengths_B2, 1.0)
  chosen_nll_B = -logp_B2[:, 0] / tokens_B2[:, 0]
  if p.loss == "simpo":
    logp_B2 = logp_B2 / tokens_B2
    logits_B = p.beta * (logp_B2[:, 0] - logp_B2[:, 1]) - p.simpo_gamma
    rewards_B2 = p.beta * logp_B2
  else:
    ratios_B2 = logp_B2 - ref_logp_B2
    if p.loss == "ipo":  # each log-ratio averaged over its response's tokens, in the loss only
      ratios_B2 = ratios_B2 / tokens_B2
    z_B = ratios_B2[:, 0] - ratios_B2[:, 1]
    logits_B = p.beta * z_B
    rewards_B2 = p.beta * (logp_B2 - ref_logp_B2)
  if p.loss == "ipo":
    loss_B = (z_B - 1.0 / (2.0 * p.beta)) ** 2
  else:
    eps = p.label_smoothing
    loss_B = -jax.nn.log_sigmoid(logits_B) * (1.0 - eps) - jax.nn.log_sigmoid(-logits_B) * eps
  if p.rpo_alpha:
    loss_B = loss_B + p.rpo_alpha * chosen_nll_B
  return loss_B, rewards_B2, logp_B2


def pair_sums(loss_B: jax.Array, rewards_B2: jax.Array, logp_B2: jax.Array, weight_B: jax.Array) -> dict:
  """The batch's weighted sums: loss, pairs, correct (chosen reward above rejected) and PAIR_METRICS."""
  margin_B = rewards_B2[:, 0] - rewards_B2[:, 1]
  return {"loss_sum": jnp.sum(loss_B * weight_B), "pairs": jnp.sum(weight_B),
          "correct": jnp.sum((margin_B > 0).astype(jnp.float32) * weight_B),
          "reward_margin": jnp.sum(margin_B * weight_B), "chosen_reward": jnp.sum(rewards_B2[:, 0] * weight_B),
          "rejected_reward": jnp.sum(rewards_B2[:, 1] * weight_B), "chosen_logp": jnp.sum(logp_B2[:, 0] * weight_B),
          "rejected_logp": jnp.sum(logp_B2[:, 1] * weight_B)}


def _hidden_states(model, batch: dict):
  """The final hidden states [N, D] of every token slot of the batch (both responses of every pair in one forward),
  targets and mask [N]. Padded batches are [B, 2, T], padding-free ones [B, L] (jaxlm/data/tuning/pair_packing.py)."""
  rows = lambda key: batch[key].reshape(-1, batch[key].shape[-1])
  x_BTD = model.features(rows("inputs"), rows("positions"), rows("segment_ids"))
  return x_BTD.reshape(-1, x_BTD.shape[-1]), rows("targets").reshape(-1), rows("loss_mask").reshape(-1)


def _padding_free(batch: dict) -> bool:
  return batch["inputs"].ndim == 2


def _per_response(values_N: jax.Array, batch: dict) -> jax.Array:
  """[pairs, 2] sums of per-token values over each response: padded, a sequence's slots; padding-free, its segment's
  (the j-th pair of a row: segments 2j + 1 and 2j + 2), as [B * P, 2]."""
  if not _padding_free(batch):
    return values_N.reshape(batch["inputs"].shape).sum(-1)
  b, length = batch["inputs"].shape
  responses = 2 * batch["pair_weight"].shape[1]
  # A masked sum per segment (not a scatter-add): exact in f32 and deterministic on every backend.
  in_segment_BLS = batch["segment_ids"][..., None] == jnp.arange(1, responses + 1).reshape(1, 1, -1)
  sums_BS = jnp.where(in_segment_BLS, values_N.reshape(b, length, 1), 0.0).sum(1)
  return sums_BS.reshape(-1, 2)


def _per_token(per_response: jax.Array, batch: dict) -> jax.Array:
  """[N]: the value of each token slot's response (`per_response` [pairs, 2]); padding slots get some response's
  value, which the caller's mask zeroes."""
  if not _padding_free(batch):
    return jnp.broadcast_to(per_response[..., None], batch["inputs"].shape).reshape(-1)
  b = batch["inputs"].shape[0]
  index_BL = jnp.maximum(batch["segment_ids"] - 1, 0)
  return jnp.take_along_axis(per_response.reshape(b, -1), index_BL, axis=1).reshape(-1)


def _pair_inputs(batch: dict) -> tuple[jax.Array, jax.Array]:
  """The reference's summed log-probs [pairs, 2] and the pairs' weights [pairs], in either layout."""
  return batch["ref_logp"].reshape(-1, 2), batch["pair_weight"].reshape(-1)


def _summed_log_probs(model, x_ND, targets_N, mask_N, batch: dict) -> jax.Array:
  table = jax.lax.stop_gradient(model.output_table())
  logp_N = model.kernels.token_log_probs(jax.lax.stop_gradient(x_ND), table, targets_N, model.config.logit_softcap)
  return _per_response(logp_N * mask_N, batch)


def make_log_probs_fn(graphdef: nnx.GraphDef):
  """(params, batch) -> summed log-probabilities of the chosen and rejected responses (the reference pass), in the
  shape of batch["ref_logp"]: [B, 2] padded, [B, P, 2] padding-free."""

  def log_probs(params, batch):
    model = nnx.merge(graphdef, params)
    x_ND, targets_N, mask_N = _hidden_states(model, batch)
    return _summed_log_probs(model, x_ND, targets_N, mask_N, batch).reshape(batch["ref_logp"].shape)

  return log_probs


def make_preference_loss_fn(graphdef: nnx.GraphDef, p: PreferenceConfig):
  """(params, batch) -> (loss sum over pairs, (pairs, sums)): a SumLossFn whose gradient is the preference loss's.
  `sums` holds `correct` (pairs ranked right) and PAIR_METRICS, each summed over the batch's pairs."""

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    x_ND, targets_N, mask_N = _hidden_states(model, batch)
    logp_B2 = _summed_log_probs(model, x_ND, targets_N, mask_N, batch)
    lengths_B2 = _per_response(mask_N, batch)
    ref_logp_B2, weight_B = _pair_inputs(batch)

    def objective(logp):
      loss_B, rewards_B2, used_B2 = pair_losses(logp, ref_logp_B2, lengths_B2, p)
      sums = pair_sums(loss_B, rewards_B2, used_B2, weight_B)
      return sums["loss_sum"], sums

    (loss_sum, sums), dloss_B2 = jax.value_and_grad(objective, has_aux=True)(logp_B2)
    # logp of a response = -(its tokens' cross-entropy sum): token weight -d loss / d logp_response.
    weights_N = jax.lax.stop_gradient(-_per_token(dloss_B2, batch) * mask_N)
    surrogate, _ = model.kernels.cross_entropy_sums(x_ND, model.output_table(), targets_N, weights_N,
                                                    model.config.logit_softcap)
    loss_sum = loss_sum + (surrogate - jax.lax.stop_gradient(surrogate))  # the value of the loss, its gradient
    aux = {k: sums[k] for k in ("correct", *PAIR_METRICS)}
    return loss_sum, (sums["pairs"], aux)

  return loss_fn


def make_eval_fn(graphdef: nnx.GraphDef, p: PreferenceConfig):
  """(params, batch) -> the batch's pair sums (`pair_sums`) and response-token sums (`eval_metrics`), for the
  held-out evaluation."""

  def eval_fn(params, batch):
    model = nnx.merge(graphdef, params)
    x_ND, targets_N, mask_N = _hidden_states(model, batch)
    stats = model.kernels.token_statistics(x_ND, model.output_table(), targets_N, model.config.logit_softcap)
    ref_logp_B2, weight_B = _pair_inputs(batch)
    loss_B, rewards_B2, used_B2 = pair_losses(_per_response(stats["log_probs"] * mask_N, batch), ref_logp_B2,
                                              _per_response(mask_N, batch), p)
    sums = pair_sums(loss_B, rewards_B2, used_B2, weight_B)
    # TRL's token diagnostics, means over response tokens: entropy over both responses, the rest over each one.
    weight_N = _per_token(jnp.broadcast_to(weight_B[:, None], ref_logp_B2.shape), batch) * mask_N
    chosen_N = _per_token(jnp.broadcast_to(jnp.array([1.0, 0.0]), ref_logp_B2.shape), batch) * weight_N
    rejected_N = weight_N - chosen_N
    sums.update({"response_tokens": weight_N.sum(), "entropy": (stats["entropy"] * weight_N).sum(),
                 "chosen_tokens": chosen_N.sum(), "rejected_tokens": rejected_N.sum(),
                 "chosen_mean_logit": (stats["mean_logit"] * chosen_N).sum(),
                 "rejected_mean_logit": (stats["mean_logit"] * rejected_N).sum(),
                 "chosen_top1": (stats["top1"] * chosen_N).sum()})
    return sums

  return eval_fn


def eval_metrics(totals: dict) -> dict[str, float]:
  """The held-out means, under the names metrics.jsonl and eval.json keep: per pair, and per response token
  (`eval_entropy` over both responses; `eval_token_accuracy`, the chosen tokens that are the policy's first choice,
  and `eval_chosen_mean_logit` over the chosen ones; `eval_rejected_mean_logit` over the rejected ones)."""
  pairs = max(float(totals["pairs"]), 1.0)
  per_token = lambda key, tokens: float(totals[key]) / max(float(totals[tokens]), 1.0)
  return {"eval_preference_loss": float(totals["loss_sum"]) / pairs,
          "eval_reward_accuracy": float(totals["correct"]) / pairs,
          **{f"eval_{k}": float(totals[k]) / pairs for k in PAIR_METRICS},
          "eval_entropy": per_token("entropy", "response_tokens"),
          "eval_token_accuracy": per_token("chosen_top1", "chosen_tokens"),
          "eval_chosen_mean_logit": per_token("chosen_mean_logit", "chosen_tokens"),
          "eval_rejected_mean_logit": per_token("rejected_mean_logit", "rejected_tokens")}
