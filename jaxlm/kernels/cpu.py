"""The CPU backend: f32 matmuls through the CPU's BLAS (scipy's OpenBLAS sgemm; kernels.matmul=blas) and causal
self-attention built on it (cpu_attention.cc; kernels.attention=cpu_fused), as XLA FFI custom calls.

Why our own kernels: XLA:CPU's GEMMs ran slower than torch's on the training step's weight-gradient shapes
(benchmarks/bench_cpu_gemm.py), and OpenBLAS's sgemm takes transposed operands as flags, so dW = x^T @ dy needs no
transpose copy. A custom call runs on XLA's own thread with the buffers in place (a `jax.pure_callback` into numpy
copies and holds the GIL).

The handlers (blas_gemm.cc, cpu_attention.cc, against jaxlib's FFI headers) are compiled with the system C++
compiler on first use into ~/.cache/jaxlm (XDG_CACHE_HOME), keyed by a hash of their sources, the jaxlib version and
the CPU, and handed the sgemm function pointer scipy.linalg.cython_blas exports (as jaxlib's own LAPACK kernels
are). OpenBLAS runs on one thread and each call splits its rows (or columns, or batch entries) over XLA's intra-op
thread pool, so the two pools do not fight over the cores. CPU, f32, one device: XLA cannot partition or
differentiate a custom call, so `matmul` and `fused_attention` carry their own VJPs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import pathlib
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import jaxlib
from jax.ad_checkpoint import checkpoint_name

# One library from these sources (cpu_kernels.h is what they share); blas_gemm.cc holds the sgemm pointer.
_SOURCES = tuple(pathlib.Path(__file__).with_name(name) for name in ("blas_gemm.cc", "cpu_attention.cc"))
_HEADER = pathlib.Path(__file__).with_name("cpu_kernels.h")
TARGET = "jaxlm_gemm"
ATTENTION_TARGETS = ("jaxlm_attention_fwd", "jaxlm_attention_bwd")  # cpu_attention.cc
GROUPED_TARGETS = ("jaxlm_grouped_gemm", "jaxlm_grouped_gemm_dw")  # blas_gemm.cc
CHECKPOINT_NAME = "blas_matmul"  # the outputs' name: remat=dots saves them like XLA's dot outputs


def _cache_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "jaxlm"


def compiler() -> str | None:
  """The C++ compiler that builds the kernel ($CXX, else g++ or c++ on PATH), or None."""
  return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _cpu_flags() -> bytes:
  """What this CPU can run (/proc/cpuinfo's flags), for the cache key: the library is built for the CPU it runs on,
  and a cache directory shared between machines must not hand one CPU's build to another."""
  try:
    with open("/proc/cpuinfo", "rb") as info:
      return next((line for line in info if line.startswith((b"flags", b"Features"))), b"")
  except OSError:
    return b""


def _build() -> pathlib.Path:
  """The compiled handler library, built once per source, jaxlib version and CPU (written atomically)."""
  source = b"".join(path.read_bytes() for path in (*_SOURCES, _HEADER))
  key = hashlib.sha256(source + jaxlib.__version__.encode() + _cpu_flags()).hexdigest()[:16]
  library = _cache_dir() / f"jaxlm_cpu_kernels-{key}.so"
  if library.exists():
    return library
  cxx = compiler()
  if cxx is None:
    raise RuntimeError("kernels.matmul=blas and kernels.attention=cpu_fused compile small C++ kernels: install g++ "
                       "(or set CXX), or use kernels.matmul=xla and another kernels.attention")
  library.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
    built = pathlib.Path(tmp) / library.name
    # -march=native: the softmax loops (cpu_attention.cc) in the CPU's widest vectors; -fno-trapping-math lets GCC
    # vectorise their branch-free selects at all (nothing here reads floating-point exception flags). A compiler
    # that does not know -march=native gets the portable build.
    for arch in (["-march=native"], []):
      command = [cxx, "-O3", *arch, "-fno-trapping-math", "-std=c++17", "-shared", "-fPIC", "-w",
                 f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES), "-o", str(built)]
      result = subprocess.run(command, capture_output=True, text=True)
      if not result.returncode:
        break
    else:
      raise RuntimeError(f"jaxlm's CPU kernels: building {', '.join(p.name for p in _SOURCES)} failed "
                         f"({' '.join(command)}): {result.stderr.strip()[-2000:]}")
    os.replace(built, library)  # atomic: a concurrent process sees either no library or a whole one
  return library


def _capsule_pointer(capsule) -> int:
  api = ctypes.pythonapi
  api.PyCapsule_GetName.restype = ctypes.c_char_p
  api.PyCapsule_GetName.argtypes = [ctypes.py_object]
  api.PyCapsule_GetPointer.restype = ctypes.c_void_p
  api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
  return api.PyCapsule_GetPointer(capsule, api.PyCapsule_GetName(capsule))


def _openblas_function(name: str) -> int | None:
  """The address of `name` in the OpenBLAS library scipy loaded (found in /proc/self/maps), or None."""
  try:
    with open("/proc/self/maps") as maps:
      paths = {line.split()[-1] for line in maps if "openblas" in line and "scipy" in line}
  except OSError:
    return None
  for path in sorted(paths):
    try:
      return ctypes.cast(getattr(ctypes.CDLL(path), name), ctypes.c_void_p).value
    except (OSError, AttributeError):
      continue
  return None


@functools.cache
def register() -> None:
  """Builds (once) and registers the custom call with XLA:CPU; safe to call again."""
  from scipy.linalg import cython_blas  # scipy comes with jax; importing it loads its OpenBLAS

  # One OpenBLAS thread: the kernel splits each matmul over XLA's own thread pool instead (blas_gemm.cc says why).
  # Process-wide: scipy's other BLAS/LAPACK calls (and jaxlib's LAPACK kernels, which use them) run on one thread
  # too once these kernels have run. (openblas_set_num_threads_local, per calling thread, did not take effect.)
  set_threads = _openblas_function("scipy_openblas_set_num_threads")
  if set_threads is not None:
    ctypes.CFUNCTYPE(None, ctypes.c_int)(set_threads)(1)
  library = ctypes.cdll.LoadLibrary(str(_build()))
  library.jaxlm_set_sgemm.argtypes = [ctypes.c_void_p]
  library.jaxlm_set_sgemm(_capsule_pointer(cython_blas.__pyx_capi__["sgemm"]))
  for target in (TARGET, *ATTENTION_TARGETS, *GROUPED_TARGETS):
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu")


def _check_cpu_f32(option: str, alternative: str, *arrays: jax.Array) -> None:
  """The custom calls take float32 buffers and exist for XLA:CPU only."""
  if any(a.dtype != jnp.float32 for a in arrays):
    raise ValueError(f"{option} computes in float32, got {', '.join(str(a.dtype) for a in arrays)}: set "
                     f"model.compute_dtype=float32 or {option.split('=')[0]}=auto")
  if jax.default_backend() != "cpu":
    raise ValueError(f"{option} runs on the CPU only (this backend: {jax.default_backend()}); use {alternative}")


def gemm(a: jax.Array, b: jax.Array, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
  """op(a) @ op(b) over the last two axes of f32 arrays, 2-D or 3-D with one shared leading batch axis; op
  transposes where asked (an sgemm flag, no copy). One custom call, not differentiable (`matmul` is)."""
  if a.ndim not in (2, 3) or b.ndim != a.ndim or a.shape[:-2] != b.shape[:-2]:
    raise ValueError(f"kernels.matmul=blas multiplies 2-D (or batched 3-D) arrays, got {list(a.shape)} and "
                     f"{list(b.shape)}")
  _check_cpu_f32("kernels.matmul=blas", "kernels.matmul=xla", a, b)
  register()
  m, k = a.shape[-1:-3:-1] if trans_a else a.shape[-2:]
  k_b, n = b.shape[-1:-3:-1] if trans_b else b.shape[-2:]
  if k != k_b:
    raise ValueError(f"gemm: contracted sizes differ ({k} vs {k_b}) for {list(a.shape)} and {list(b.shape)}")
  out = jax.ShapeDtypeStruct((*a.shape[:-2], m, n), jnp.float32)
  # vmap (rare: the models call this unbatched) loops over the mapped axis, one call per entry.
  return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(a, b, trans_a=trans_a, trans_b=trans_b)


def matmul(a: jax.Array, b: jax.Array, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
  """Differentiable `gemm`; its output is named CHECKPOINT_NAME for remat policies (outside the custom VJP: a
  policy sees only the outputs of a custom_vjp call, not the names inside it)."""
  return checkpoint_name(_matmul(a, b, trans_a, trans_b), CHECKPOINT_NAME)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(a, b, trans_a, trans_b):
  return gemm(a, b, trans_a, trans_b)


def _matmul_fwd(a, b, trans_a, trans_b):
  return gemm(a, b, trans_a, trans_b), (a, b)


def _matmul_bwd(trans_a, trans_b, residuals, g):
  # With C = op(a) @ op(b): d op(a) = g @ op(b)^T and d op(b) = op(a)^T @ g, each one gemm with flags, so no
  # operand is ever transposed in memory.
  a, b = residuals
  da = gemm(b, g, trans_b, True) if trans_a else gemm(g, b, False, not trans_b)
  db = gemm(g, a, True, trans_a) if trans_b else gemm(a, g, not trans_a, False)
  return da, db


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def einsum(subscripts: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """A two-operand einsum of jaxlm's layers as one differentiable (batched) matmul, e.g. "btd,dhk->bthk",
  "btd,vd->btv", "...i,io->...o", "bgrqs,bgrqk->bgsk". It must need no transpose in memory: the batch axes (in
  both operands and the output) lead everywhere in the same order; in each operand the contracted axes come
  either all before or all after its free axes, in the same order in both; the output is batch, x's free axes,
  w's free axes. Anything else is a ValueError that says to use kernels.matmul=xla."""
  inputs, out = subscripts.replace(" ", "").split("->")
  xs, ws = inputs.split(",")
  if xs.startswith("..."):  # name the ellipsis axes so they can be compared like the others
    named = "".join([c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in subscripts][:x.ndim - len(xs) + 3])
    xs, out = named + xs[3:], out.replace("...", named)
  refuse = ValueError(f"kernels.matmul=blas: einsum {subscripts!r} is not a plain (batched) matmul of "
                      f"{list(x.shape)} and {list(w.shape)}; use kernels.matmul=xla")
  if any(len(set(s)) != len(s) or not s.isalpha() for s in (xs, ws, out)):  # repeated axes (diagonals), "i...j"
    raise refuse
  shape_of = dict(zip(xs, x.shape))
  if any(shape_of.setdefault(c, size) != size for c, size in zip(ws, w.shape)):
    raise refuse
  batch = "".join(c for c in xs if c in ws and c in out)
  contracted = "".join(c for c in xs if c in ws and c not in out)
  x_free = "".join(c for c in xs if c not in ws)
  w_free = "".join(c for c in ws if c not in xs)
  xr, wr = xs[len(batch):], ws[len(batch):]
  if (len(xs) != x.ndim or len(ws) != w.ndim or not contracted or not xs.startswith(batch)
      or not ws.startswith(batch) or out != batch + x_free + w_free
      or xr not in (x_free + contracted, contracted + x_free) or wr not in (contracted + w_free, w_free + contracted)):
    raise refuse
  trans_a = xr != x_free + contracted  # x laid out [batch, contracted, free]
  trans_b = wr != contracted + w_free  # w laid out [batch, free, contracted]
  nb, m, k, n = (math.prod(shape_of[c] for c in part) for part in (batch, x_free, contracted, w_free))
  lead = (nb,) if batch else ()
  a = x.reshape(*lead, *((k, m) if trans_a else (m, k)))
  b = w.reshape(*lead, *((n, k) if trans_b else (k, n)))
  return matmul(a, b, trans_a, trans_b).reshape(tuple(shape_of[c] for c in out))


def attention_forward(q_BTHK: jax.Array, k_BTGK: jax.Array, v_BTGK: jax.Array, mask_BTT: jax.Array,
                      block: int) -> tuple[jax.Array, jax.Array]:
  """(softmax(q k^T + mask) v [B, T, H, K], log-sum-exp per query [B, H, T] f32) for causal self-attention, q
  already scaled; cpu_attention.cc. Not differentiable (`fused_attention` is)."""
  _check_cpu_f32("kernels.attention=cpu_fused", "kernels.attention=causal_blocks", q_BTHK, k_BTGK, v_BTGK)
  register()
  b, t, h, _ = q_BTHK.shape
  outs = (jax.ShapeDtypeStruct(q_BTHK.shape, jnp.float32), jax.ShapeDtypeStruct((b, h, t), jnp.float32))
  return jax.ffi.ffi_call(ATTENTION_TARGETS[0], outs, vmap_method="sequential")(
      q_BTHK, k_BTGK, v_BTGK, mask_BTT.astype(bool), block=block)


def attention_backward(q_BTHK, k_BTGK, v_BTGK, mask_BTT, out_BTHK, lse_BHT, dout_BTHK,
                       block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(dq, dk, dv) of `attention_forward` given its output, log-sum-exp and the output's cotangent."""
  _check_cpu_f32("kernels.attention=cpu_fused", "kernels.attention=causal_blocks", q_BTHK, k_BTGK, v_BTGK, out_BTHK,
                 lse_BHT, dout_BTHK)
  register()
  outs = tuple(jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (q_BTHK, k_BTGK, v_BTGK))
  return jax.ffi.ffi_call(ATTENTION_TARGETS[1], outs, vmap_method="sequential")(
      q_BTHK, k_BTGK, v_BTGK, mask_BTT.astype(bool), out_BTHK, lse_BHT, dout_BTHK, block=block)


def fused_attention(q_BTHK: jax.Array, k_BTGK: jax.Array, v_BTGK: jax.Array, mask_BTT: jax.Array,
                    block: int) -> jax.Array:
  """`dot_product_attention` for causal self-attention as one C++ custom call per layer and direction on the CPU
  (cpu_attention.cc): query blocks of `block` rows skip the keys after them, the scores
  stay in cache, and the backward pass rebuilds the probabilities from the saved log-sum-exp. f32, the CPU, the
  same mask contract as `causal_block_attention`."""
  if k_BTGK.shape[1] != q_BTHK.shape[1]:
    raise ValueError(f"cpu_fused attention needs as many keys as queries, got {k_BTGK.shape[1]} and {q_BTHK.shape[1]}")
  q_BTHK = q_BTHK * (1 / math.sqrt(q_BTHK.shape[-1]))  # scaling q: a pass over B*T*H*K values, not every score
  return _fused_cpu(q_BTHK, k_BTGK, v_BTGK, mask_BTT, block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused_cpu(q_BTHK, k_BTGK, v_BTGK, mask_BTT, block):
  return attention_forward(q_BTHK, k_BTGK, v_BTGK, mask_BTT, block)[0]


def _fused_cpu_fwd(q_BTHK, k_BTGK, v_BTGK, mask_BTT, block):
  out_BTHK, lse_BHT = attention_forward(q_BTHK, k_BTGK, v_BTGK, mask_BTT, block)
  # Named so remat=dots keeps them (the policy sees this rule's operations): otherwise the backward pass runs the
  # forward kernel again to rebuild them.
  out_BTHK, lse_BHT = checkpoint_name(out_BTHK, CHECKPOINT_NAME), checkpoint_name(lse_BHT, CHECKPOINT_NAME)
  return out_BTHK, (q_BTHK, k_BTGK, v_BTGK, mask_BTT, out_BTHK, lse_BHT)


def _fused_cpu_bwd(block, residuals, dout_BTHK):
  q_BTHK, k_BTGK, v_BTGK, mask_BTT, out_BTHK, lse_BHT = residuals
  dq, dk, dv = attention_backward(q_BTHK, k_BTGK, v_BTGK, mask_BTT, out_BTHK, lse_BHT, dout_BTHK, block)
  return dq, dk, dv, None


_fused_cpu.defvjp(_fused_cpu_fwd, _fused_cpu_bwd)


def _vma(x) -> frozenset:
  """The mesh axes over which `x` varies inside shard_map (empty outside it); jax 0.10 names them
  `manual_axis_type.varying`, earlier releases `vma`."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  return frozenset(manual.varying if manual is not None else getattr(aval, "vma", None) or ())


def _varying_like(out: jax.Array, *inputs: jax.Array) -> jax.Array:
  """A custom call's output typed as varying over every axis its inputs vary over (shard_map types what it computes
  per device; a custom call's result carries no such type of its own)."""
  axes = tuple(sorted(frozenset().union(*map(_vma, inputs)) - _vma(out)))
  return jax.lax.pcast(out, axes, to="varying") if axes else out


def _summed_to(cotangent: jax.Array, primal: jax.Array) -> jax.Array:
  """A cotangent summed over the devices along which its primal is the same (shard_map's transpose of a broadcast)."""
  axes = tuple(sorted(_vma(cotangent) - _vma(primal)))
  return jax.lax.psum(cotangent, axes) if axes else cotangent


def grouped_gemm(x_MK: jax.Array, w_GKN: jax.Array, group_sizes_G: jax.Array, trans_w: bool = False) -> jax.Array:
  """Rows of x sorted by group, group g the next group_sizes[g] rows: y = x_g @ op(w[g]) per group ([M, N]; rows
  past the groups are zero). One custom call (blas_gemm.cc), not differentiable (`grouped_matmul` is)."""
  _check_cpu_f32("kernels.grouped_matmul=blas", "kernels.grouped_matmul=ragged_dot", x_MK, w_GKN)
  register()
  n = w_GKN.shape[1] if trans_w else w_GKN.shape[2]
  out = jax.ShapeDtypeStruct((x_MK.shape[0], n), jnp.float32)
  return _varying_like(jax.ffi.ffi_call(GROUPED_TARGETS[0], out, vmap_method="sequential")(
      x_MK, w_GKN, group_sizes_G.astype(jnp.int32), trans_w=trans_w), x_MK, w_GKN, group_sizes_G)


def grouped_gemm_weight_grad(x_MK: jax.Array, dy_MN: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
  """dw[g] = x_g^T @ dy_g per group: [G, K, N] (zeros for a group without rows)."""
  _check_cpu_f32("kernels.grouped_matmul=blas", "kernels.grouped_matmul=ragged_dot", x_MK, dy_MN)
  register()
  out = jax.ShapeDtypeStruct((group_sizes_G.shape[0], x_MK.shape[1], dy_MN.shape[1]), jnp.float32)
  return _varying_like(jax.ffi.ffi_call(GROUPED_TARGETS[1], out, vmap_method="sequential")(
      x_MK, dy_MN, group_sizes_G.astype(jnp.int32)), x_MK, dy_MN, group_sizes_G)


def grouped_matmul(x_MK: jax.Array, w_GKN: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
  """Differentiable `grouped_gemm`: what `jax.lax.ragged_dot(x, w, group_sizes)` computes, one sgemm per group. Its
  output is named CHECKPOINT_NAME, so remat=dots keeps it as it keeps XLA's matmul outputs."""
  return checkpoint_name(_grouped_matmul(x_MK, w_GKN, group_sizes_G), CHECKPOINT_NAME)


@jax.custom_vjp
def _grouped_matmul(x_MK: jax.Array, w_GKN: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
  return grouped_gemm(x_MK, w_GKN, group_sizes_G)


def _grouped_fwd(x_MK, w_GKN, group_sizes_G):
  return grouped_gemm(x_MK, w_GKN, group_sizes_G), (x_MK, w_GKN, group_sizes_G)


def _grouped_bwd(residuals, dy_MN):
  x_MK, w_GKN, group_sizes_G = residuals
  # dx = dy_g @ w[g]^T (a flag, no transpose in memory), dw[g] = x_g^T @ dy_g; the sizes are integers (no cotangent).
  dx = grouped_gemm(dy_MN, w_GKN, group_sizes_G, trans_w=True)
  dw = grouped_gemm_weight_grad(x_MK, dy_MN, group_sizes_G)
  return _summed_to(dx, x_MK), _summed_to(dw, w_GKN), None


_grouped_matmul.defvjp(_grouped_fwd, _grouped_bwd)
