"""Fused, chunked distillation loss: a student's loss against a frozen teacher's token distributions, and its gradient,
without [B, T, V] logits of either model in memory.

Per token n with weight w_n, the objective summed over tokens is
  sum_n w_n * ((1 - alpha) * D_n + alpha * CE_n)
where D_n is TRL's generalized Jensen-Shannon divergence of the two models' distributions at `temperature` (beta 0:
forward KL(T || S), beta 1: reverse KL(S || T), between: the mixture form; jaxlm/training/distill_loss.py is the
unchunked reference and spells it out) and CE_n the student's cross-entropy on the next token at temperature 1.

Why chunked: the reference holds both models' [B, T, V] f32 logits, and for a 262,144-token vocabulary the
teacher's alone are the memory of a whole run. As in cross_entropy.py (the pattern followed here), the tokens are
cut into chunks of `chunk` rows per device (the registry caps them by bytes: a chunk holds about six [P, C, V] f32
arrays); for each chunk the forward pass computes both models' logits [P, C, V]
from (hidden states, output table), the loss, and d(objective)/d(student logits) analytically, then the gradients
with respect to the student's hidden states [N, D] and output table [V, D], and keeps only those for the backward
pass, which scales them by the objective's cotangent (one scalar: the objective is a weighted sum). The teacher is
frozen: its hidden states and table get zero cotangents. Chunks run over tokens, so every chunk sees whole
vocabulary rows and the log-softmaxes are exact.

The gradient of token n's objective with respect to the student's logits l, with s = log softmax(l / t), p = exp(s),
teacher log-probs u (at the same temperature t) and q = exp(u), is
  w_n * ((1 - alpha) * dD_n + alpha * (softmax(l) - one-hot)),  dD_n = (1 / t) times
  beta = 0       p - q
  beta = 1       p * (s - u - KL(S || T))
  0 < beta < 1   (1 - beta) * p * (s - m - KL(S || M)),  m = log((1 - beta) p + beta q)
(the teacher-side term of the mixture cancels); a soft-capped student's is multiplied by the cap's derivative,
1 - (capped / cap)^2.
Dimension letters as in cross_entropy.py: N tokens, P devices splitting them, K chunks, C tokens per device in a
chunk, D model width, V vocabulary.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxlm.kernels.cross_entropy import _F32, _batch_shards, _blocks, _dlogits, _unblocks, token_stats
from jaxlm.kernels.xla import softcap
from jaxlm.parallel import sharding

SUMS = ("objective", "divergence", "cross_entropy", "correct")


class _Static(NamedTuple):
  """The kernel's non-array arguments (hashable: jit traces them as constants)."""
  chunk: int
  shards: int
  einsum: Callable
  beta: float
  temperature: float
  alpha: float
  student_softcap: float
  teacher_softcap: float


def _divergence(student_PCV, teacher_PCV, beta: float):
  """(the generalized JSD of each token [P, C], its gradient w.r.t. the student's logits / temperature [P, C, V])
  from the two models' log-probabilities at the temperature."""
  p_PCV = jnp.exp(student_PCV)
  if beta == 0:  # KL(T || S)
    q_PCV = jnp.exp(teacher_PCV)
    return jnp.sum(q_PCV * (teacher_PCV - student_PCV), axis=-1), p_PCV - q_PCV
  if beta == 1:  # KL(S || T)
    divergence_PC = jnp.sum(p_PCV * (student_PCV - teacher_PCV), axis=-1)
    return divergence_PC, p_PCV * (student_PCV - teacher_PCV - divergence_PC[..., None])
  mixture_PCV = jnp.logaddexp(student_PCV + jnp.log1p(-beta), teacher_PCV + jnp.log(beta))
  student_kl_PC = jnp.sum(p_PCV * (student_PCV - mixture_PCV), axis=-1)
  teacher_kl_PC = jnp.sum(jnp.exp(teacher_PCV) * (teacher_PCV - mixture_PCV), axis=-1)
  gradient_PCV = (1 - beta) * p_PCV * (student_PCV - mixture_PCV - student_kl_PC[..., None])
  return beta * teacher_kl_PC + (1 - beta) * student_kl_PC, gradient_PCV


def _chunk(xs, student_table_VD, teacher_table_VD, static: _Static, with_gradient: bool):
  """One chunk: (its weighted sums (objective, divergence, cross-entropy, correct)[, d(objective)/d(student's
  pre-cap logits) [P, C, V] in f32])."""
  student_x_PCD, teacher_x_PCD, targets_PC, weights_PC = xs
  einsum, t = static.einsum, static.temperature
  logits_PCV = softcap(einsum("pcd,vd->pcv", student_x_PCD, student_table_VD, **_F32), static.student_softcap)
  teacher_PCV = softcap(einsum("pcd,vd->pcv", teacher_x_PCD, teacher_table_VD, **_F32), static.teacher_softcap)
  ce_PC, correct_PC, shift_PC, exp_PCV, sum_PC = token_stats(logits_PCV, targets_PC)  # at temperature 1
  student_PCV = jax.nn.log_softmax(logits_PCV / t, axis=-1)
  divergence_PC, ddivergence_PCV = _divergence(student_PCV, jax.nn.log_softmax(teacher_PCV / t, axis=-1),
                                               static.beta)
  alpha = static.alpha
  sums = tuple(jnp.sum(a * weights_PC) for a in ((1 - alpha) * divergence_PC + alpha * ce_PC, divergence_PC,
                                                  ce_PC, correct_PC))
  if not with_gradient:
    return sums
  dlogits_PCV = ddivergence_PCV * ((1 - alpha) / t * weights_PC)[..., None]
  if alpha:
    dlogits_PCV = dlogits_PCV + _dlogits(logits_PCV, shift_PC, exp_PCV, sum_PC, targets_PC, alpha * weights_PC)
  if static.student_softcap:
    dlogits_PCV = dlogits_PCV * (1 - jnp.square(logits_PCV / static.student_softcap))
  return sums, dlogits_PCV


def distillation_sums(student_x_ND: jax.Array, student_table_VD: jax.Array, teacher_x_ND: jax.Array,
                      teacher_table_VD, targets_N: jax.Array, weights_N: jax.Array, *, beta: float,
                      temperature: float, alpha: float, chunk: int, einsum=jnp.einsum, student_softcap: float = 0.0,
                      teacher_softcap: float = 0.0) -> dict[str, jax.Array]:
  """{"objective": sum_n w_n * ((1 - alpha) * D_n + alpha * CE_n), "divergence": sum_n w_n D_n, "cross_entropy":
  sum_n w_n CE_n, "correct": sum_n w_n [argmax of the student == target]}, `chunk` tokens per device at a time (module
  docstring).

  Hidden states and tables in the compute dtype (the teacher's dtype and width may differ); logits f32, soft-capped
  where a cap is nonzero. Gradients flow to the student's x and table through "objective" only: the others are
  metrics without gradient, and the teacher gets zero cotangents. A teacher table may be a stand-in weight (jaxlm.kernels.weights) if `einsum`
  contracts it; the student's must be an array. Divide by the global token weight afterwards, as the cross-entropy."""
  if not (0 <= beta <= 1 and temperature > 0 and 0 <= alpha <= 1):
    raise ValueError(f"distillation needs 0 <= beta <= 1, temperature > 0 and 0 <= alpha <= 1 (got beta={beta}, "
                     f"temperature={temperature}, alpha={alpha})")
  shards = _batch_shards(student_x_ND.shape[0])
  chunk = min(chunk, student_x_ND.shape[0] // shards)  # fewer tokens than a chunk: one chunk of them, no padding
  static = _Static(chunk, shards, einsum, float(beta), float(temperature), float(alpha), float(student_softcap),
                   float(teacher_softcap))
  objective, *metrics = _fused(student_x_ND, student_table_VD, teacher_x_ND, teacher_table_VD, targets_N, weights_N,
                               static, (student_x_ND.dtype, student_table_VD.dtype))
  return dict(zip(SUMS, (objective, *jax.lax.stop_gradient(metrics))))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _fused(student_x_ND, student_table_VD, teacher_x_ND, teacher_table_VD, targets_N, weights_N, static, dtypes):
  del dtypes  # the dtypes of the gradients the backward pass returns

  def body(totals, xs):
    sums = _chunk(xs, student_table_VD, teacher_table_VD, static, with_gradient=False)
    return tuple(a + b for a, b in zip(totals, sums)), None

  xs = tuple(_blocks(a, static.shards, static.chunk) for a in (student_x_ND, teacher_x_ND, targets_N, weights_N))
  totals, _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32),) * 4, xs)
  return totals


def _forward(student_x_ND, student_table_VD, teacher_x_ND, teacher_table_VD, targets_N, weights_N, static, dtypes):
  n, compute_dtype = student_x_ND.shape[0], student_x_ND.dtype
  einsum = static.einsum

  def body(carry, xs):
    totals, dtable_PVD = carry
    sums, dlogits_PCV = _chunk(xs, student_table_VD, teacher_table_VD, static, with_gradient=True)
    # The gradient in f32, then matmuls in the compute dtype with f32 accumulation.
    dlogits_PCV = dlogits_PCV.astype(compute_dtype)
    student_x_PCD = xs[0]
    dx_PCD = einsum("pcv,vd->pcd", dlogits_PCV, student_table_VD, **_F32)
    # Each device accumulates its own partial table gradient; they are summed once, after the scan.
    dtable_PVD = dtable_PVD + einsum("pcv,pcd->pvd", dlogits_PCV, student_x_PCD, **_F32)
    return (tuple(a + b for a, b in zip(totals, sums)), dtable_PVD), dx_PCD

  dtable_PVD = sharding.constrain(jnp.zeros((static.shards,) + student_table_VD.shape, jnp.float32),
                                  ("act_batch", None, None))
  xs = tuple(_blocks(a, static.shards, static.chunk) for a in (student_x_ND, teacher_x_ND, targets_N, weights_N))
  (totals, dtable_PVD), dx_KPCD = jax.lax.scan(body, ((jnp.zeros((), jnp.float32),) * 4, dtable_PVD), xs)
  # float16: the saved gradients stay f32 (cross_entropy._forward says why: the loss scale comes after them).
  saved = jnp.float32 if compute_dtype == jnp.float16 else None
  residuals = (_unblocks(dx_KPCD, n).astype(saved or compute_dtype),
               dtable_PVD.sum(axis=0).astype(saved or student_table_VD.dtype))
  return totals, residuals


def _backward(static, dtypes, residuals, cotangents):
  del static
  dx_ND, dtable_VD = residuals
  g = cotangents[0]  # the metrics have no gradient
  dx = (g * dx_ND.astype(jnp.float32)).astype(dtypes[0])
  dtable = (g * dtable_VD.astype(jnp.float32)).astype(dtypes[1])
  # The teacher is frozen; integer targets and the weights (data, a mask) are not differentiated.
  return dx, dtable, None, None, None, None


_fused.defvjp(_forward, _backward)


def token_divergence(student_logits: jax.Array, teacher_logits: jax.Array, *, beta: float,
                     temperature: float) -> jax.Array:
  """The generalized JSD of each token, summed over the vocabulary (the last axis): [...] in f32."""
  student = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
  teacher = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
  # torch's F.kl_div(input, target, log_target=True) is exp(target) * (target - input): KL(target || input).
  kl = lambda target, input_: jnp.sum(jnp.exp(target) * (target - input_), axis=-1)
  if beta == 0:
    return kl(teacher, student)
  if beta == 1:
    return kl(student, teacher)
  mixture = jnp.logaddexp(student + jnp.log1p(-beta), teacher + jnp.log(beta))
  return beta * kl(teacher, mixture) + (1 - beta) * kl(student, mixture)


def reference_sums(student_x_ND, student_table_VD, teacher_x_ND, teacher_table_VD, targets_N, weights_N, *,
                   beta: float, temperature: float, alpha: float, einsum=jnp.einsum, student_softcap: float = 0.0,
                   teacher_softcap: float = 0.0) -> dict[str, jax.Array]:
  """`distillation_sums` from [N, V] f32 logits of both models, differentiated by JAX: the reference the kernel is
  tested equal to, and the path for a student table that is a stand-in weight (LoRA on the output head)."""
  logits_NV = softcap(einsum("nd,vd->nv", student_x_ND, student_table_VD, **_F32), student_softcap)
  teacher_NV = softcap(einsum("nd,vd->nv", teacher_x_ND, teacher_table_VD, **_F32), teacher_softcap)
  divergence_N = token_divergence(logits_NV, jax.lax.stop_gradient(teacher_NV), beta=beta, temperature=temperature)
  ce_N = optax.softmax_cross_entropy_with_integer_labels(logits_NV, targets_N)
  correct_N = (jnp.argmax(logits_NV, axis=-1) == targets_N).astype(jnp.float32)
  objective = jnp.sum(((1 - alpha) * divergence_N + alpha * ce_N) * weights_N)
  metrics = [jnp.sum(a * weights_N) for a in (divergence_N, ce_N, correct_N)]
  return dict(zip(SUMS, (objective, *jax.lax.stop_gradient(metrics))))
