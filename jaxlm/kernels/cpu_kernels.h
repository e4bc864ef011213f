// What jaxlm's CPU kernels (blas_gemm.cc, cpu_attention.cc; one library built by jaxlm/kernels/cpu.py) share: the BLAS
// sgemm that scipy ships (OpenBLAS, one thread) and a parallel loop over XLA's intra-op thread pool.
#ifndef JAXLM_CPU_KERNELS_H_
#define JAXLM_CPU_KERNELS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxlm {

// Fortran sgemm, column-major, every argument by pointer (scipy.linalg.cython_blas exports it with 32-bit ints).
typedef void SgemmFn(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                     const int*, const float*, const int*, const float*, float*, const int*);
extern SgemmFn* sgemm;  // set by jaxlm_set_sgemm (blas_gemm.cc) before any kernel runs

// Row-major C[m, n] = alpha * op(A)[m, k] @ op(B)[k, n] + beta * C, op transposing where asked. A row-major
// [R, C] array is a column-major [C, R] one, so this is the column-major C^T = op(B)^T op(A)^T: B goes first.
inline void RowMajorGemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc) {
  const char ta = trans_a ? 'T' : 'N', tb = trans_b ? 'T' : 'N';
  sgemm(&tb, &ta, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
}

// Runs task(0) ... task(count - 1) on the calling thread and up to `workers - 1` tasks scheduled on XLA's pool,
// each taking the next index until none are left; returns when all have run. The caller waits only for tasks
// already taken, so a busy pool cannot deadlock it: it takes every task nobody else has. A pool task that starts
// after the caller has taken everything returns without touching `task`'s data.
template <typename Task>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t count, int64_t workers, Task task) {
  struct State {
    explicit State(Task t, int64_t n) : task(std::move(t)), count(n) {}
    Task task;
    const int64_t count;
    std::atomic<int64_t> next{0}, done{0};
    void TakeAll() {
      for (int64_t i; (i = next.fetch_add(1)) < count;) {
        task(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  if (count <= 0) return;
  auto state = std::make_shared<State>(std::move(task), count);
  for (int64_t t = 1; t < std::min(workers, count); ++t) pool.Schedule([state] { state->TakeAll(); });
  state->TakeAll();
  while (state->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

}  // namespace jaxlm

#endif  // JAXLM_CPU_KERNELS_H_
