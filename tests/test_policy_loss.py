"""The RL step's loss (jaxlm/training/policy_loss.py): its value and gradient, computed with forward-only log-probs and
token weights of the fused cross-entropy, equal the policy loss written on full [N, T, V] logits; micro-batches
(gradient accumulation) give the unsplit batch's loss and gradient; the whole-batch normalisation of one batch equals
`policy_loss` (TRL's arithmetic for one micro-batch). Parity of `policy_loss` and `group_advantages` with TRL's own
code is tests/test_policy_loss_trl.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlm.config import ModelConfig, RLConfig
from jaxlm.kernels import Kernels
from jaxlm.models.gpt import GPT
from jaxlm.training import optim, policy_loss

N, P, C = 6, 5, 7  # completions, prompt slots, completion slots


def _model():
  config = ModelConfig(vocab_size=64, num_layers=2, d_model=32, num_heads=4, max_seq_len=32, flavour="llama",
                       compute_dtype="float32", tie_embeddings=False)
  return nnx.split(GPT(config, kernels=Kernels(cross_entropy="chunked", cross_entropy_chunk=8), rngs=nnx.Rngs(0)))


def _batch(seed=0, old=True, ref=True):
  rng = np.random.default_rng(seed)
  pads = rng.integers(0, 3, N)
  full = rng.integers(1, 64, (N, P + C))
  slots = np.arange(P + C - 1)[None]
  lengths = rng.integers(1, C + 1, N)  # completions of different lengths
  mask = (np.arange(C)[None] < lengths[:, None]).astype(np.float32)
  batch = {"inputs": full[:, :-1].astype(np.int32), "positions": np.maximum(slots - pads[:, None], 0).astype(np.int32),
           "segment_ids": (slots >= pads[:, None]).astype(np.int32), "targets": full[:, P:].astype(np.int32),
           "loss_mask": mask, "advantages": rng.normal(size=N).astype(np.float32),
           "completion_tokens": np.full(N, mask.sum(), np.float32)}
  if old:
    batch["old_logp"] = (-4.2 + 0.3 * rng.normal(size=(N, C))).astype(np.float32)
  if ref:
    batch["ref_logp"] = (-4.2 + 0.3 * rng.normal(size=(N, C))).astype(np.float32)
  return {k: jnp.asarray(v) for k, v in batch.items()}


def _full_logits_loss(graphdef, params, batch, rl: RLConfig):
  """The loss from full logits: log_softmax, the completion tokens' log-probs, `policy_loss`."""
  logits = nnx.merge(graphdef, params)(batch["inputs"], batch["positions"], batch["segment_ids"])[:, -C:]
  logps = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), batch["targets"][..., None], -1)[..., 0]
  return policy_loss.policy_loss(logps, batch.get("old_logp"), batch.get("ref_logp") if rl.beta else None,
                                 batch["advantages"], batch["loss_mask"], loss=rl.loss,
                                 importance_sampling=rl.importance_sampling, epsilon=rl.epsilon,
                                 epsilon_high=rl.epsilon_high or rl.epsilon, beta=rl.beta,
                                 max_completion_length=rl.max_completion_length)


CASES = [("dapo", "token", 0.04, True), ("grpo", "sequence", 0.0, True), ("dr_grpo", "token", 0.0, False),
         ("bnpo", "sequence", 0.04, False)]


@pytest.mark.parametrize("loss,sampling,beta,old", CASES, ids=[f"{c[0]}-{c[1]}-beta{c[2]}-old{c[3]}" for c in CASES])
def test_step_loss_and_gradient_equal_the_loss_on_full_logits(loss, sampling, beta, old):
  graphdef, params = _model()
  rl = RLConfig(loss=loss, importance_sampling=sampling, beta=beta, epsilon_high=0.28, max_completion_length=C)
  batch = _batch(old=old, ref=bool(beta))
  loss_fn = policy_loss.make_policy_loss_fn(graphdef, rl, N)
  step = lambda p: (lambda s, aux: s / aux[0])(*loss_fn(p, batch))
  value, grads = jax.value_and_grad(step)(params)
  reference, reference_grads = jax.value_and_grad(lambda p: _full_logits_loss(graphdef, p, batch, rl))(params)
  np.testing.assert_allclose(value, reference, rtol=1e-5)
  for ours, theirs in zip(jax.tree.leaves(grads), jax.tree.leaves(reference_grads)):
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss", ["grpo", "dapo"])  # normalised by completions, by completion tokens
def test_accumulated_micro_batches_equal_the_unsplit_batch(loss):
  graphdef, params = _model()
  rl = RLConfig(loss=loss, beta=0.04, max_completion_length=C)
  batch = _batch(seed=3)
  loss_fn = policy_loss.make_policy_loss_fn(graphdef, rl, N)
  whole = optim.accumulate_gradients(loss_fn, params, batch, 1)
  split = optim.accumulate_gradients(loss_fn, params, batch, 3)
  np.testing.assert_allclose(split[0], whole[0], rtol=1e-6)
  for key in ("kl", "entropy", "clip_ratio/region_mean"):
    np.testing.assert_allclose(split[3][key], whole[3][key], rtol=1e-5, atol=1e-7)
  for a, b in zip(jax.tree.leaves(split[2]), jax.tree.leaves(whole[2])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss", ["grpo", "dapo", "bnpo", "dr_grpo"])
def test_whole_batch_normalisation_of_one_batch_is_policy_loss(loss):
  rng = np.random.default_rng(1)
  batch = {k: v for k, v in _batch(seed=1).items()}
  logps = jnp.asarray(-4.0 + 0.3 * rng.normal(size=(N, C)), jnp.float32)
  rl = RLConfig(loss=loss, beta=0.04, max_completion_length=C)
  total, metrics = policy_loss.batch_loss_sums(logps, batch, rl, N)
  expected = policy_loss.policy_loss(logps, batch["old_logp"], batch["ref_logp"], batch["advantages"],
                                     batch["loss_mask"], loss=loss, beta=0.04, max_completion_length=C)
  np.testing.assert_allclose(total / N, expected, rtol=1e-6)
  # TRL's k3 estimator times the importance ratio (its use_bias_correction_kl, on by default)
  kl = (jnp.exp(batch["ref_logp"] - logps) - (batch["ref_logp"] - logps) - 1) * jnp.exp(logps - batch["old_logp"])
  np.testing.assert_allclose(metrics["kl"] / N, (kl * batch["loss_mask"]).sum() / batch["loss_mask"].sum(),
                             rtol=1e-6)


def test_group_advantages_of_equal_rewards_are_zero_and_nan_rewards_stay_out():
  rewards = np.array([1.0, 1.0, 1.0, 0.0, 1.0, np.nan], np.float32)
  advantages = np.asarray(policy_loss.group_advantages(rewards, 3, "group"))
  np.testing.assert_allclose(advantages[:3], 0.0)
  # The second group's mean and std come from its two scored rewards; the unscored one gets 0.
  std = np.std([0.0, 1.0], ddof=1)
  np.testing.assert_allclose(advantages[3:], [-0.5 / (std + 1e-4), 0.5 / (std + 1e-4), 0.0], rtol=1e-6)
