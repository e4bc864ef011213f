"""The kernel registry, the one list of kernels: for every op the models call (attention, the weight matmul,
cross-entropy, norms, the gated linear unit, the experts' grouped matmul), the implementations that compute it
(`IMPLEMENTATIONS`; the first of each is the reference every other one is tested equal to), where each runs, and
which one `auto` picks (`AUTO`);
and the execution choices that are not ops (`EXECUTION`: fused q/k/v, a scan or a loop over the layers, remat).

`resolve(KernelsConfig, ...)` turns the config (every key `auto` by default) into a `Kernels`: concrete names for
this platform, compute dtype and mesh, looked up in these tables. `auto` takes the first implementation of
`AUTO[op][platform]` that can run here; an explicit choice that cannot is a one-line error naming the key and the
values that would work. Models hold a `Kernels` and call its methods (`einsum`, `lookup`, `attend`, `layer_norm`,
`rms_norm`, `gated_linear_unit`, `expert_matmul`, `cross_entropy_sums`, `distillation_sums`); they never import a
backend module. A weight that is not a plain array reaches them through one protocol (jaxlm/kernels/weights.py).

Meshes: the CPU custom calls (`cpu_fused`, `blas`) and the tokamax Pallas calls carry no sharding rule, so XLA would
run each call whole on every device of a mesh; `auto` leaves them out on a mesh of more than one device, and choosing
them there is an error.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxlm.config import KernelsConfig
from jaxlm.kernels import attention as xla_attention
from jaxlm.kernels import cpu, distillation, fp8, gpu, mosaic_grouped, ring_attention, weights, xla
from jaxlm.kernels import cross_entropy as chunked_ce

ALL = ("cpu", "gpu", "tpu")
FLOATS = ("float32", "bfloat16", "float16")


def _compiler_missing() -> str | None:
  return None if cpu.compiler() else "no C++ compiler (install g++ or set CXX)"


def _cudnn_missing() -> str | None:
  # cuDNN's fused (flash) attention needs Ampere or newer: a V100 (7.0) or T4 (7.5) keeps the XLA reference.
  return gpu.nvidia_missing("cuDNN's fused attention, compute capability >= 8.0", 8.0, unknown="8.0")


class Target(NamedTuple):
  """What a model will run on: the platform, its compute dtype, a decoder or not, the devices of its mesh, the
  attention head size (0: unknown) and the mesh's tensor-parallel size."""
  platform: str
  dtype: str
  causal: bool
  devices: int
  head_dim: int = 0
  tensor: int = 1
  context: int = 1
  window: bool = False  # some attention layers see only a sliding window of keys (the mask holds it)
  softcaps: tuple[str, ...] = ()  # the ops whose scores or logits are soft-capped: attention, cross_entropy


@dataclasses.dataclass(frozen=True)
class Implementation:
  name: str
  platforms: tuple[str, ...]  # jax.default_backend() names it runs on
  dtypes: tuple[str, ...] = FLOATS  # compute dtypes it accepts
  causal_only: bool = False  # needs a causal mask (decoders): it skips the blocks above the diagonal
  one_device: bool = False  # a custom call (or Pallas call) that carries no sharding rule: XLA cannot partition it
  head_dims: Callable[[int], bool] | None = None  # the attention head sizes it takes
  sequence: str = ""  # attention: "whole" (one device holds every row's whole sequence) or "split" (mesh.context)
  window: bool = True  # attention: honours a sliding window (it reads the whole mask)
  softcap: bool = False  # attention, cross-entropy: soft-caps scores or logits (c tanh(x / c))
  missing: Callable[[], str | None] | None = None  # why it cannot run on this machine, or None

  def unfit(self, target: Target, op: str = "") -> str | None:
    """Why this implementation cannot serve `target` for `op`, or None."""
    if target.platform not in self.platforms:
      return f"runs on {'/'.join(self.platforms)}, not {target.platform}"
    if target.dtype not in self.dtypes:
      return f"computes in {'/'.join(self.dtypes)}, not model.compute_dtype={target.dtype}"
    if self.causal_only and not target.causal:
      return "needs a causal model (a decoder)"
    if self.one_device and target.devices > 1:
      return f"cannot be partitioned: XLA would run it whole on each of the {target.devices} devices"
    if self.sequence == "whole" and target.context > 1:
      return f"needs whole sequences, and mesh.context={target.context} splits them (ring takes split ones)"
    if self.sequence == "split" and target.context == 1:
      return "passes sequence chunks round mesh.context, which is 1 here"
    if op == "attention" and target.window and not self.window:
      return "has no sliding window (model.sliding_window)"
    if op in target.softcaps and not self.softcap:
      return "does not soft-cap (model.attention_softcap / model.logit_softcap)"
    if self.head_dims and target.head_dim and not self.head_dims(target.head_dim):
      return f"does not take heads of {target.head_dim} (model.attention_head_dim, or d_model / num_heads)"
    # What this machine lacks matters only when the target is this machine (the planner resolves for others).
    if self.missing and target.platform == jax.default_backend():
      return self.missing()
    return None


IMPLEMENTATIONS: dict[str, tuple[Implementation, ...]] = {
    "attention": (
        Implementation("xla", ALL, sequence="whole", softcap=True),
        Implementation("causal_blocks", ALL, causal_only=True, sequence="whole"),
        Implementation("cpu_fused", ("cpu",), ("float32",), causal_only=True, one_device=True,
                       missing=_compiler_missing, sequence="whole"),
        Implementation("recompute", ALL, sequence="whole"),
        Implementation("jax", ALL, sequence="whole"),
        # cuDNN's flash kernels take head sizes that are multiples of 8, up to 128.
        Implementation("cudnn", ("gpu",), ("bfloat16", "float16"), head_dims=lambda k: k % 8 == 0 and k <= 128,
                       missing=_cudnn_missing, sequence="whole"),
        Implementation("tokamax", ("gpu", "tpu"), one_device=True, missing=gpu.tokamax_unavailable,
                       sequence="whole"),
        Implementation("ring", ALL, causal_only=True, sequence="split", window=False),  # context parallelism
    ),
    "matmul": (
        Implementation("xla", ALL),
        Implementation("blas", ("cpu",), ("float32",), one_device=True, missing=_compiler_missing),
        # Quantizes (e4m3 forward, e5m2 gradients, per-tensor scales): close to, not equal to, the reference.
        Implementation("fp8", ("gpu",), ("bfloat16",), missing=fp8.unavailable),
    ),
    "cross_entropy": (
        Implementation("logits", ALL, softcap=True),
        Implementation("chunked", ALL),
        # tokamax has a fused kernel for TPUs only; on GPUs its cross-entropy is XLA's full-logits path.
        Implementation("tokamax", ("tpu",), one_device=True, missing=gpu.tokamax_unavailable),
    ),
    "norm": (Implementation("xla", ALL),
             Implementation("tokamax", ("gpu", "tpu"), one_device=True, missing=gpu.tokamax_unavailable)),
    "glu": (Implementation("xla", ALL),
            Implementation("tokamax", ("gpu", "tpu"), one_device=True, missing=gpu.tokamax_unavailable)),
    # Mixture-of-experts layers: rows sorted by expert, one matmul per expert on its own rows.
    "grouped_matmul": (
        Implementation("ragged_dot", ALL),
        # On a mesh the MoE layer calls these per device inside shard_map, so they need no sharding rule.
        Implementation("blas", ("cpu",), ("float32",), missing=_compiler_missing),
        Implementation("tokamax", ("gpu", "tpu"), missing=gpu.tokamax_unavailable),
        # jax's Mosaic GPU kernels (Hopper, 16-bit operands) with jaxlm's VJP; shapes they refuse run ragged_dot.
        Implementation("mosaic", ("gpu",), ("bfloat16", "float16"), missing=mosaic_grouped.unavailable),
    ),
}

# What `auto` tries, in order; the reference (always able to run) ends every list. `ring` leads the attention lists
# because it is the only one that takes split sequences (and is unfit without them); other implementations ahead of
# the reference are those measured faster on that platform (docs/performance.md has the measurements): nothing yet
# on TPUs, and the tokamax kernels are not faster on a GPU (or do not run there), so `auto` does not pick them.
# The `mosaic` grouped matmul is not measured yet (benchmarks/gpu_checks.sh: ab_moe, grouped_matmul), so not either;
# nor is the `fp8` matmul (ab_fp8), which also changes the numbers: it is only ever an explicit choice.
AUTO: dict[str, dict[str, tuple[str, ...]]] = {
    "attention": {"cpu": ("ring", "cpu_fused", "causal_blocks", "xla"), "gpu": ("ring", "cudnn", "xla"),
                  "tpu": ("ring", "xla")},
    "matmul": {"cpu": ("blas", "xla"), "gpu": ("xla",), "tpu": ("xla",)},
    "cross_entropy": {"cpu": ("chunked", "logits"), "gpu": ("chunked", "logits"), "tpu": ("logits",)},
    "norm": {"cpu": ("xla",), "gpu": ("xla",), "tpu": ("xla",)},
    "glu": {"cpu": ("xla",), "gpu": ("xla",), "tpu": ("xla",)},
    # XLA:CPU computes ragged_dot as a dense product per expert (all rows against every expert's weight).
    "grouped_matmul": {"cpu": ("blas", "ragged_dot"), "gpu": ("ragged_dot",), "tpu": ("ragged_dot",)},
}
# kernels.remat: what a block saves for the backward pass ("none" saves everything, no recomputation).
REMAT_POLICIES = {
    "full": None,  # save nothing inside a block: least memory, one extra forward
    # keep matmul outputs (XLA's dots and the named outputs of jaxlm's kernel calls), recompute elementwise ops
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots,
        jax.checkpoint_policies.save_only_these_names(cpu.CHECKPOINT_NAME, mosaic_grouped.CHECKPOINT_NAME)),
}


class Choice(NamedTuple):
  """An execution choice that is not an op: the values it takes and what `auto` picks for a target, given the
  choices already made (the explicit ones, then the table's earlier entries)."""
  values: tuple[str, ...]
  auto: Callable[[Target, dict[str, str]], str]


EXECUTION: dict[str, Choice] = {
    # Measured on CPUs and GPUs only. Under tensor parallelism, concatenating q/k/v weights that the tensor axis
    # splits by heads would make GSPMD regather them.
    "fuse_qkv": Choice(("fused", "separate"),
                       lambda t, _: "fused" if t.tensor == 1 and t.platform in ("cpu", "gpu") else "separate"),
    # On one CPU device, recomputing the elementwise ops beats writing and reading their saved outputs. Not on a
    # mesh: the recomputed forward would gather FSDP-sharded weights a second time. A Python loop cannot recompute.
    "remat": Choice(("none", *REMAT_POLICIES),
                    lambda t, chosen: "dots" if t.platform == "cpu" and t.devices == 1
                    and chosen.get("layers") != "loop" else "none"),
    # A Python loop over the layers ran faster on an H200; the scan keeps CPU compile times flat in depth. Only the
    # scan recomputes: XLA schedules an unrolled loop's recomputed blocks beside the forward pass, so every layer's
    # activations stay alive (docs/performance.md).
    "layers": Choice(("scan", "loop"),
                     lambda t, chosen: "loop" if t.platform == "gpu" and chosen["remat"] == "none" else "scan"),
}
CROSS_ENTROPY_CHUNK = {"cpu": 1024, "gpu": 4096, "tpu": 4096}  # tokens per chunk when kernels.cross_entropy_chunk=0
DISTILL_CHUNK_BYTES = 256 * 2**20  # the distillation kernel's per-chunk f32 arrays: 42 tokens of Gemma's 262,144 rows


@dataclasses.dataclass(frozen=True)
class Kernels:
  """The resolved kernels: a concrete implementation per op (no `auto` left) and the execution choices. Frozen and
  hashable, so models keep it as static structure and jit traces it as a constant."""
  attention: str = "xla"
  attention_block: int = 32
  matmul: str = "xla"
  cross_entropy: str = "logits"
  cross_entropy_chunk: int = 1024
  norm: str = "xla"
  glu: str = "xla"
  grouped_matmul: str = "ragged_dot"
  fuse_qkv: str = "separate"
  layers: str = "scan"
  scan_unroll: int = 1
  remat: str = "none"

  def describe(self) -> str:
    """One line for the start-up print: `attention=cpu_fused matmul=blas ...`."""
    return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())

  def as_config(self) -> KernelsConfig:
    return KernelsConfig(**dataclasses.asdict(self))

  # ------------------------------------------------------------------------------------------- ops

  def einsum(self, subscripts: str, x: jax.Array, w, **kwargs) -> jax.Array:
    """An activation x weight contraction. A weight that is not a plain array (jaxlm.kernels.weights) contracts
    itself, with this method for the plain arrays it holds."""
    if weights.is_stand_in(w):
      # fp8 is for float weights in training: a stand-in's (quantized, frozen or adapted) arrays keep the reference.
      return w.contract(subscripts, x, xla.einsum if self.matmul == "fp8" else self.einsum, **kwargs)
    if self.matmul == "blas":
      return cpu.einsum(subscripts, x, w)
    # Contractions asking for f32 results (the output head's logits, the cross-entropy's gradients) stay in bf16, as
    # torchtitan keeps the output layer out of float8.
    if self.matmul == "fp8" and not kwargs:
      return fp8.einsum(subscripts, x, w)
    return xla.einsum(subscripts, x, w, **kwargs)

  def lookup(self, table_ND, ids) -> jax.Array:
    """Rows `ids` of a table [N, ...] (embeddings)."""
    return table_ND.lookup(ids) if weights.is_stand_in(table_ND) else jnp.take(table_ND, ids, axis=0)

  def attend(self, q_BTHK, k_BSGK, v_BSGK, mask_BTS, *, causal: bool, document_mask: bool = True,
             softcap: float = 0.0):
    """Softmax attention; `mask_BTS` holds causality, document boundaries and any sliding window (the same function
    on every path). `softcap` > 0: scores soft-capped, which only the reference does (`resolve` picks it then)."""
    name = self.attention
    if softcap and name != "xla":
      raise ValueError(f"kernels.attention={name} does not soft-cap scores (model.attention_softcap): use "
                       "kernels.attention=auto or xla")
    if softcap:
      return xla_attention.dot_product_attention(q_BTHK, k_BSGK, v_BSGK, mask_BTS, softcap)
    if name == "ring":
      return ring_attention.ring_attention(q_BTHK, k_BSGK, v_BSGK, mask_BTS.time_BT, mask_BTS.segment_ids_BT)
    if name == "xla":
      return xla_attention.dot_product_attention(q_BTHK, k_BSGK, v_BSGK, mask_BTS)
    if name in ("causal_blocks", "cpu_fused") and not causal:
      raise ValueError(f"kernels.attention={name} skips the blocks a causal mask hides; this model's attention is "
                       "not causal: use kernels.attention=auto or xla")
    if name == "causal_blocks":  # products of activations: never in fp8
      return xla_attention.causal_block_attention(q_BTHK, k_BSGK, v_BSGK, mask_BTS, self.attention_block,
                                                  xla.einsum if self.matmul == "fp8" else self.einsum)
    if name == "cpu_fused":
      return cpu.fused_attention(q_BTHK, k_BSGK, v_BSGK, mask_BTS, self.attention_block)
    if name == "recompute":
      return xla_attention.recompute_attention(q_BTHK, k_BSGK, v_BSGK, mask_BTS)
    # Library kernels: with plain causal attention (no document mask) they get no mask tensor at all.
    mask = None if (causal and not document_mask) else mask_BTS
    if name == "jax":
      return xla_attention.library_attention(q_BTHK, k_BSGK, v_BSGK, mask, causal)
    if name == "cudnn":
      return gpu.cudnn_attention(q_BTHK, k_BSGK, v_BSGK, mask, causal)
    return gpu.tokamax_attention(q_BTHK, k_BSGK, v_BSGK, mask, causal)

  def attend_reference(self, q_BTHK, k_BSGK, v_BSGK, mask_BTS, softcap: float = 0.0) -> jax.Array:
    """The reference attention, for shapes the faster kernels do not take (decoding against a longer KV cache)."""
    return xla_attention.dot_product_attention(q_BTHK, k_BSGK, v_BSGK, mask_BTS, softcap)

  def softcap(self, x, cap: float) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's output logits); cap 0 leaves x as it is."""
    return xla.softcap(x, cap)

  def layer_norm(self, x, scale, bias, eps: float) -> jax.Array:
    """LayerNorm over the last axis, in f32."""
    if self.norm == "tokamax":
      return gpu.tokamax_layer_norm(x, scale, bias, eps)
    return xla.layer_norm(x, scale, bias, eps)

  def rms_norm(self, x, scale, eps: float) -> jax.Array:
    """RMSNorm over the last axis, in f32."""
    if self.norm == "tokamax":
      return gpu.tokamax_rms_norm(x, scale, eps)
    return xla.rms_norm(x, scale, eps)

  def gated_linear_unit(self, x_BTD, w_gate_DF, w_up_DF, activation: str = "silu") -> jax.Array:
    """act(x @ w_gate) * (x @ w_up): the gated half of Llama's MLP (silu) or Gemma's (gelu_tanh)."""
    if (self.glu == "tokamax" and activation == "silu" and isinstance(w_gate_DF, jax.Array)
        and isinstance(w_up_DF, jax.Array)):
      return gpu.tokamax_glu(x_BTD, w_gate_DF, w_up_DF)
    return xla.glu(x_BTD, w_gate_DF, w_up_DF, self.einsum, activation)

  def expert_matmul(self, x_MK, w_GKN, group_sizes_G) -> jax.Array:
    """Rows of x sorted by expert (expert g owns the next group_sizes[g] rows): x_g @ w[g] for each, [M, N]; rows past
    the experts' are zero. What `jax.lax.ragged_dot` computes."""
    if self.grouped_matmul == "blas":
      return cpu.grouped_matmul(x_MK, w_GKN, group_sizes_G)
    if self.grouped_matmul == "tokamax":
      return gpu.tokamax_ragged_dot(x_MK, w_GKN, group_sizes_G)
    if self.grouped_matmul == "mosaic":
      return mosaic_grouped.grouped_matmul(x_MK, w_GKN, group_sizes_G)
    return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G)

  def cross_entropy_sums(self, x_ND, table_VD, targets_N, weights_N,
                         logit_softcap: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """(sum_n w_n * CE(x_n @ table^T, target_n), sum_n w_n * [argmax == target]) with f32 logits, soft-capped if
    `logit_softcap` (full logits then: `resolve` picks `logits` for such a model)."""
    if weights.is_stand_in(table_VD) or logit_softcap:  # e.g. an int8 table: contracted by itself, full logits
      return xla.cross_entropy_sums(x_ND, table_VD, targets_N, weights_N, self.einsum, logit_softcap)
    if self.cross_entropy == "chunked":
      return chunked_ce.fused_cross_entropy(x_ND, table_VD, targets_N, weights_N, self.cross_entropy_chunk,
                                            self.einsum)
    if self.cross_entropy == "tokamax":
      return gpu.tokamax_cross_entropy(x_ND, table_VD, targets_N, weights_N, chunk=self.cross_entropy_chunk)
    return xla.cross_entropy_sums(x_ND, table_VD, targets_N, weights_N, self.einsum)

  def distillation_sums(self, student_x_ND, student_table_VD, teacher_x_ND, teacher_table_VD, targets_N, weights_N, *,
                        beta: float, temperature: float, alpha: float, student_softcap: float = 0.0,
                        teacher_softcap: float = 0.0) -> dict[str, jax.Array]:
    """{"objective": sum_n w_n * ((1 - alpha) * generalized JSD_n + alpha * CE_n), and the sums of the divergence,
    cross-entropy and correct tokens without gradient} of a student against a frozen teacher, `cross_entropy_chunk`
    tokens at a time (jaxlm/kernels/distillation.py); full logits for a student table that is a stand-in weight."""
    arrays = (student_x_ND, student_table_VD, teacher_x_ND, teacher_table_VD, targets_N, weights_N)
    options = {"beta": beta, "temperature": temperature, "alpha": alpha, "einsum": self.einsum,
               "student_softcap": student_softcap, "teacher_softcap": teacher_softcap}
    if weights.is_stand_in(student_table_VD):  # e.g. LoRA on the output head: its adapters take JAX's gradient
      return distillation.reference_sums(*arrays, **options)
    # A chunk keeps about six [C, V] f32 arrays alive (both models' logits, probabilities, the gradient), three times
    # the cross-entropy's: its tokens are capped so that they stay within DISTILL_CHUNK_BYTES.
    chunk = min(self.cross_entropy_chunk, max(8, DISTILL_CHUNK_BYTES // (24 * student_table_VD.shape[0])))
    return distillation.distillation_sums(*arrays, chunk=chunk, **options)

  def token_log_probs(self, x_ND, table_VD, targets_N, logit_softcap: float = 0.0, with_entropy: bool = False):
    """log p(target_n) per token, [N] in f32, `cross_entropy_chunk` tokens at a time (forward only); with
    `with_entropy`, (log-probs, each token's predictive entropy [N]) from the same pass."""
    return chunked_ce.token_log_probs(x_ND, table_VD, targets_N, self.cross_entropy_chunk, self.einsum,
                                      lambda logits: self.softcap(logits, logit_softcap), with_entropy)

  def token_statistics(self, x_ND, table_VD, targets_N, logit_softcap: float = 0.0) -> dict:
    """Per token [N] in f32: `log_probs`, `entropy`, `mean_logit` and `top1` of the targets, `cross_entropy_chunk`
    tokens at a time (forward only: evaluation's diagnostics)."""
    return chunked_ce.token_statistics(x_ND, table_VD, targets_N, self.cross_entropy_chunk, self.einsum,
                                       lambda logits: self.softcap(logits, logit_softcap))


def validate_kernels(config: KernelsConfig) -> None:
  """Names the registry knows at all; whether one fits this platform, dtype and mesh is `resolve`'s check."""
  for key in (*IMPLEMENTATIONS, *EXECUTION):
    known = [i.name for i in IMPLEMENTATIONS[key]] if key in IMPLEMENTATIONS else list(EXECUTION[key].values)
    if getattr(config, key) not in ("auto", *known):
      raise ValueError(f"kernels.{key}={getattr(config, key)!r} is not one of auto, {', '.join(known)}")
  if config.layers == "loop" and config.remat not in ("auto", "none"):
    raise ValueError(f"kernels.layers=loop cannot recompute (kernels.remat={config.remat}): XLA keeps every layer's "
                     "activations of an unrolled loop; use kernels.layers=scan (or auto) with remat")


def _pick(op: str, requested: str, target: Target) -> str:
  implementations = {impl.name: impl for impl in IMPLEMENTATIONS[op]}
  if requested != "auto":
    reason = implementations[requested].unfit(target, op)
    if reason:
      fits = [n for n, impl in implementations.items() if not impl.unfit(target, op)]
      raise ValueError(f"kernels.{op}={requested} {reason}; here use one of: auto, {', '.join(fits)}")
    return requested
  for name in AUTO[op][target.platform]:
    if not implementations[name].unfit(target, op):
      return name
  raise AssertionError(f"no {op} implementation fits {target}")  # the reference (or ring) always fits


def resolve(config: KernelsConfig | None = None, *, compute_dtype: str = "float32", causal: bool = True,
            head_dim: int = 0, mesh: jax.sharding.Mesh | None = None, platform: str | None = None,
            devices: int | None = None, tensor: int | None = None, window: bool = False,
            softcaps: tuple[str, ...] = ()) -> Kernels:
  """The Kernels for a model computing in `compute_dtype` on `mesh` (default: every device of the default backend,
  which is what `auto` must assume for a model built outside a training run). `causal`: a decoder's attention;
  `head_dim`: its head size (0: not checked). `platform`, `devices` and `tensor` (the mesh's tensor-parallel size)
  override what the mesh says, for planning a run on other hardware. `window` and `softcaps`: what the model's
  attention and logits need (`ModelConfig.kernel_needs`)."""
  config = config or KernelsConfig()
  validate_kernels(config)
  if platform is None:
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
  if devices is None:
    devices = mesh.devices.size if mesh is not None else jax.device_count()
  if tensor is None:
    tensor = dict(mesh.shape).get("tensor", 1) if mesh is not None else 1
  context = dict(mesh.shape).get("context", 1) if mesh is not None else 1
  target = Target(platform, jnp.dtype(compute_dtype).name, causal, devices, head_dim, tensor, context, window,
                  softcaps)
  ops = {op: _pick(op, getattr(config, op), target) for op in IMPLEMENTATIONS}
  execution = {key: getattr(config, key) for key in EXECUTION if getattr(config, key) != "auto"}
  for key, choice in EXECUTION.items():
    execution.setdefault(key, choice.auto(target, execution))
  return Kernels(**ops, **execution, attention_block=config.attention_block, scan_unroll=config.scan_unroll,
                 cross_entropy_chunk=config.cross_entropy_chunk or CROSS_ENTROPY_CHUNK[platform])


# For tracing on one platform what another will run (the planner): a stand-in computing the same function that keeps
# the same residuals for the backward pass (q, k, v, the output and per-row softmax statistics for flash kernels).
_STAND_INS = {"attention": "recompute", "matmul": "xla", "cross_entropy": "chunked", "norm": "xla", "glu": "xla",
              "grouped_matmul": "ragged_dot"}


def runnable_on(kernels: Kernels, platform: str, target: str | None = None) -> Kernels:
  """`kernels` with every implementation that cannot run on `platform` (or on this machine) replaced by its
  stand-in, so the step traces and compiles here with the memory and traffic of the original on `target` (None:
  `platform` itself)."""
  changes = {}
  for op, stand_in in _STAND_INS.items():
    impl = {i.name: i for i in IMPLEMENTATIONS[op]}[getattr(kernels, op)]
    if platform not in impl.platforms or (impl.missing and impl.missing()):
      changes[op] = stand_in
  if kernels.layers == "loop" and target not in (None, platform):
    # The same residuals per layer, but another backend's buffer assignment of an unrolled loop keeps far more live
    # than the target's: the scan's compiled memory is the closer stand-in.
    changes["layers"] = "scan"
  return dataclasses.replace(kernels, **changes)
