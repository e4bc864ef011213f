"""The distillation losses of a language model on its teacher's token distributions, as TRL 1.16 computes them.

  beta = loss_beta(loss, beta)                    # "forward_kl" -> 0, "reverse_kl" -> 1, "jsd" -> beta in (0, 1)
  loss = generalized_jsd(student_logits, teacher_logits, mask, beta=beta, temperature=temperature)

TRL's `GKDTrainer.generalized_jsd_loss` (trl/experimental/gkd/gkd_trainer.py; Eq. 1 of Agarwal et al., On-Policy
Distillation of Language Models) on logits divided by the temperature, with student distribution S and teacher T,
summed over the vocabulary for each token:
  beta = 0       KL(T || S)                          forward KL: the student covers every mode of the teacher
  beta = 1       KL(S || T)                          reverse KL: the student seeks the teacher's modes
  0 < beta < 1   beta KL(T || M) + (1 - beta) KL(S || M),  M = beta T + (1 - beta) S
then averaged over the tokens the mask keeps ("batchmean" with labels -100 on the others; 0 for an empty mask). Beta 0
and 1 are special cases, not limits: as beta -> 0 the mixture tends to S and the divergence to 0. No temperature**2
factor, as TRL.

This is the unchunked reference: [B, T, V] f32 logits of both models, the memory of a whole run for a 262,144-token
vocabulary. Training computes the same sums without them, `chunk` tokens at a time (jaxlm/kernels/distillation.py,
tested equal to this).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlm.config import DISTILL_LOSSES
from jaxlm.kernels.distillation import token_divergence  # the per-token divergence both paths share


def loss_beta(loss: str, beta: float) -> float:
  """TRL's beta for a named loss: forward_kl 0, reverse_kl 1, jsd `beta` (which must lie strictly between)."""
  if loss == "forward_kl":
    return 0.0
  if loss == "reverse_kl":
    return 1.0
  if loss == "jsd":
    if not 0.0 < beta < 1.0:
      raise ValueError(f"the jsd loss takes a beta strictly between 0 and 1 (got {beta}); beta 0 is forward_kl and "
                       "1 is reverse_kl")
    return float(beta)
  raise ValueError(f"unknown distillation loss {loss!r}: use one of {', '.join(DISTILL_LOSSES)}")


def generalized_jsd(student_logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array, *, beta: float,
                    temperature: float) -> jax.Array:
  """TRL's generalized_jsd_loss with reduction "batchmean": the mean over the tokens where `mask` is 1. Logits
  [B, T, V] (or [N, V]), mask [B, T] (or [N])."""
  divergence = token_divergence(student_logits, teacher_logits, beta=beta, temperature=temperature)
  mask = mask.astype(jnp.float32)
  return jnp.sum(divergence * mask) / jnp.maximum(jnp.sum(mask), 1.0)
