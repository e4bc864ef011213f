"""Session 11: single-thread sgemm rate of scipy's OpenBLAS (what jaxlm.blas calls) vs BLIS (the library inside
PyPI's `blis` 1.3.4 wheel, explosion's build) on per-thread halves of the bench_cpu step's gemm shapes (row-major).
  pip download --no-deps blis==1.3.4 -d /tmp/blis && (cd /tmp/blis && unzip -q -o blis-*.whl)
  python experiments/results/cpu_2026-12-01/session11/blis_vs_openblas.py /tmp/blis
"""
import ctypes, glob, os, sys, time
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np
import scipy.linalg.cython_blas as cb
blis = ctypes.CDLL(glob.glob(os.path.join(sys.argv[1], "blis", "cy.*.so"))[0])
blis.bli_arch_string.restype = ctypes.c_char_p
blis.bli_arch_query_id.restype = ctypes.c_int
print("blis arch", blis.bli_arch_string(blis.bli_arch_query_id()))
cap = cb.__pyx_capi__["sgemm"]
ctypes.pythonapi.PyCapsule_GetPointer.restype = ctypes.c_void_p
ctypes.pythonapi.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
ctypes.pythonapi.PyCapsule_GetName.restype = ctypes.c_char_p
ctypes.pythonapi.PyCapsule_GetName.argtypes = [ctypes.py_object]
ptr = ctypes.pythonapi.PyCapsule_GetPointer(cap, ctypes.pythonapi.PyCapsule_GetName(cap))  # the capsule's own name
P = ctypes.POINTER
fp = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, P(ctypes.c_int), P(ctypes.c_int), P(ctypes.c_int),
                      P(ctypes.c_float), ctypes.c_void_p, P(ctypes.c_int), ctypes.c_void_p, P(ctypes.c_int),
                      P(ctypes.c_float), ctypes.c_void_p, P(ctypes.c_int))
osgemm = fp(ptr)
i = lambda v: ctypes.byref(ctypes.c_int(v))
one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
def openblas(a, b, c, ta, tb):
  # row-major C[M,N] = op(A) op(B) == col-major C^T = op(B)^T op(A)^T
  m, n = c.shape; k = a.shape[0] if ta else a.shape[1]
  osgemm(b"T" if tb else b"N", b"T" if ta else b"N", i(n), i(m), i(k), ctypes.byref(one), b.ctypes.data,
         i(b.shape[1]), a.ctypes.data, i(a.shape[1]), ctypes.byref(zero), c.ctypes.data, i(n))
L = ctypes.c_long
blis.bli_sgemm.argtypes = [ctypes.c_int, ctypes.c_int, L, L, L, P(ctypes.c_float), ctypes.c_void_p, L, L,
                           ctypes.c_void_p, L, L, P(ctypes.c_float), ctypes.c_void_p, L, L]
def blis_gemm(a, b, c, ta, tb):
  m, n = c.shape; k = a.shape[0] if ta else a.shape[1]
  blis.bli_sgemm(8 if ta else 0, 8 if tb else 0, m, n, k, ctypes.byref(one), a.ctypes.data, a.shape[1], 1,
                 b.ctypes.data, b.shape[1], 1, ctypes.byref(zero), c.ctypes.data, n, 1)
shapes = [  # (M, K, N, transA, transB) per thread: half the rows of the step's calls
  (1024, 384, 1152, 0, 0), (1024, 384, 1536, 0, 0), (1024, 1536, 384, 0, 0), (1024, 384, 384, 0, 0),
  (512, 384, 8192, 0, 1), (512, 8192, 384, 0, 0), (384, 2048, 768, 1, 0), (1536, 2048, 192, 1, 0),
  (1024, 1536, 384, 0, 1), (1024, 384, 1536, 0, 1), (512, 512, 512, 0, 0)]
rng = np.random.default_rng(0)
for m, k, n, ta, tb in shapes:
  a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
  b = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
  ref = (a.T if ta else a) @ (b.T if tb else b)
  res = {}
  for name, f in (("openblas", openblas), ("blis", blis_gemm)):
    c = np.zeros((m, n), np.float32); f(a, b, c, ta, tb)
    assert np.allclose(c, ref, rtol=1e-3, atol=1e-2), name
    best = 1e9
    for _ in range(7):
      t = time.perf_counter(); f(a, b, c, ta, tb); f(a, b, c, ta, tb); best = min(best, (time.perf_counter() - t) / 2)
    res[name] = 2 * m * n * k / best / 1e9
  print(f"{m}x{k}x{n} tA{ta} tB{tb}: openblas {res['openblas']:.1f}  blis {res['blis']:.1f} GFLOP/s  "
        f"ratio {res['blis'] / res['openblas']:.3f}")
