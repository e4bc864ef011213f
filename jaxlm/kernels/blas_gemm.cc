// XLA FFI handlers: row-major C = op(A) @ op(B) in f32 through the Fortran BLAS sgemm that scipy ships
// (OpenBLAS), and the grouped matmuls of mixture-of-experts layers (below). Built and loaded by
// jaxlm/kernels/cpu.py, which also hands over the BLAS function pointers.
//
// Threads: OpenBLAS's own thread pool fights XLA's for the same cores (and two gemms that XLA runs at once share
// it). So OpenBLAS runs on one thread (jaxlm/kernels/cpu.py sets it) and each call
// splits C into as many row or column blocks as XLA's intra-op pool has threads (jaxlm::ParallelFor).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

jaxlm::SgemmFn* jaxlm::sgemm = nullptr;

extern "C" void jaxlm_set_sgemm(void* fn) { jaxlm::sgemm = reinterpret_cast<jaxlm::SgemmFn*>(fn); }

namespace {

using jaxlm::RowMajorGemm;
using jaxlm::sgemm;

// Blocks smaller than this many multiply-adds are not worth a task.
constexpr int64_t kMinBlockWork = int64_t{1} << 21;

enum class Split { kBatch, kRows, kCols };

struct Gemm {
  bool trans_a, trans_b;
  int64_t batch;
  int m, n, k, lda, ldb, ldc;
  const float* a;
  const float* b;
  float* c;
  Split split;  // blocks of batch entries, of C's rows (op(A)'s rows) or of its columns (op(B)'s columns)
  int blocks;

  // C[i] = op(A[i]) @ op(B[i]) for rows (or columns) [begin, begin + count) of C.
  void Run(int64_t i, int begin, int count, bool rows) const {
    const float* a_i = a + i * m * k;
    const float* b_i = b + i * k * n;
    float* c_i = c + i * m * n;
    if (rows) {
      const float* a_block = a_i + (trans_a ? begin : int64_t(begin) * lda);
      RowMajorGemm(trans_a, trans_b, count, n, k, 1.0f, a_block, lda, b_i, ldb, 0.0f, c_i + int64_t(begin) * ldc,
                   ldc);
    } else {
      const float* b_block = b_i + (trans_b ? int64_t(begin) * ldb : begin);
      RowMajorGemm(trans_a, trans_b, m, count, k, 1.0f, a_i, lda, b_block, ldb, 0.0f, c_i + begin, ldc);
    }
  }

  void RunBlock(int block) const {
    const int64_t size = split == Split::kBatch ? batch : split == Split::kRows ? m : n;
    const int64_t begin = size * block / blocks, end = size * (block + 1) / blocks;
    if (split == Split::kBatch) {
      for (int64_t i = begin; i < end; ++i) Run(i, 0, m, true);
    } else if (end > begin) {
      Run(0, int(begin), int(end - begin), split == Split::kRows);
    }
  }
};

// Row-major C[..., M, N] = op(A[..., :, :]) @ op(B[..., :, :]): 2-D operands, or 3-D with one leading batch axis.
ffi::Error GemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                    ffi::ResultBuffer<ffi::F32> c, bool trans_a, bool trans_b) {
  if (sgemm == nullptr) return ffi::Error::Internal("jaxlm_gemm: no sgemm (load it with jaxlm.kernels.cpu)");
  auto ad = a.dimensions(), bd = b.dimensions();
  const size_t rank = ad.size();
  if (rank < 2 || rank > 3 || bd.size() != rank || (rank == 3 && ad[0] != bd[0])) {
    return ffi::Error::InvalidArgument("jaxlm_gemm: 2-D operands, or 3-D with the same batch size");
  }
  for (int64_t d : {ad[rank - 2], ad[rank - 1], bd[rank - 2], bd[rank - 1]}) {
    if (d > std::numeric_limits<int>::max()) {
      return ffi::Error::InvalidArgument("jaxlm_gemm: a matrix side over 2^31 - 1 (sgemm takes 32-bit sizes)");
    }
  }
  Gemm g;
  g.trans_a = trans_a;
  g.trans_b = trans_b;
  g.batch = rank == 3 ? ad[0] : 1;
  const int64_t a_rows = ad[rank - 2], a_cols = ad[rank - 1], b_rows = bd[rank - 2], b_cols = bd[rank - 1];
  g.m = trans_a ? a_cols : a_rows;
  g.k = trans_a ? a_rows : a_cols;
  g.n = trans_b ? b_rows : b_cols;
  g.lda = std::max<int64_t>(a_cols, 1);
  g.ldb = std::max<int64_t>(b_cols, 1);
  g.ldc = std::max(g.n, 1);
  g.a = a.typed_data();
  g.b = b.typed_data();
  g.c = c->typed_data();
  if (g.batch == 0 || g.m == 0 || g.n == 0) return ffi::Error::Success();
  if (g.k == 0) {
    std::fill(g.c, g.c + g.batch * g.m * g.n, 0.0f);
    return ffi::Error::Success();
  }
  g.split = g.batch > 1 ? Split::kBatch : g.m >= g.n ? Split::kRows : Split::kCols;
  const int64_t parts = g.split == Split::kBatch ? g.batch : g.split == Split::kRows ? g.m : g.n;
  const int64_t by_size = std::max<int64_t>(1, g.batch * g.m * g.n * g.k / kMinBlockWork);
  g.blocks = int(std::min<int64_t>({std::max<int64_t>(pool.num_threads(), 1), by_size, parts}));
  jaxlm::ParallelFor(pool, g.blocks, g.blocks, [&g](int64_t block) { g.RunBlock(int(block)); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxlm_gemm, GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("trans_a")
                                  .Attr<bool>("trans_b"));

// Grouped (ragged) matmuls for mixture-of-experts layers, rows sorted by group: group g owns the next
// group_sizes[g] rows of x. Written here because XLA:CPU computes jax.lax.ragged_dot as a dense product per group
// (every row against every group's weight); these run one sgemm per group on its own rows only.
namespace {

// Row offsets of each group (prefix sums of the sizes, clipped to the rows there are).
std::vector<int64_t> GroupStarts(const int32_t* sizes, int64_t groups, int64_t rows) {
  std::vector<int64_t> starts(groups + 1, 0);
  for (int64_t g = 0; g < groups; ++g) starts[g + 1] = std::min(rows, starts[g] + std::max<int32_t>(sizes[g], 0));
  return starts;
}

// y[rows of g, N] = x[rows of g, K] @ op(w[g]); w is [G, K, N] (or [G, N, K] with trans_w). Rows past the groups
// are zero. Tasks are row blocks of one group each, so a large group is split over the threads.
ffi::Error GroupedGemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> y, bool trans_w) {
  if (sgemm == nullptr) return ffi::Error::Internal("jaxlm_grouped_gemm: no sgemm (load it with jaxlm.kernels.cpu)");
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || group_sizes.dimensions().size() != 1 ||
      group_sizes.dimensions()[0] != wd[0]) {
    return ffi::Error::InvalidArgument("jaxlm_grouped_gemm: x [M, K], w [G, K, N], group_sizes [G]");
  }
  const int64_t rows = xd[0], k = xd[1], groups = wd[0];
  const int64_t n = trans_w ? wd[1] : wd[2];
  if ((trans_w ? wd[2] : wd[1]) != k) return ffi::Error::InvalidArgument("jaxlm_grouped_gemm: contracted sizes differ");
  const std::vector<int64_t> starts = GroupStarts(group_sizes.typed_data(), groups, rows);
  float* out = y->typed_data();
  std::fill(out + starts[groups] * n, out + rows * n, 0.0f);
  if (k == 0) {
    std::fill(out, out + starts[groups] * n, 0.0f);
    return ffi::Error::Success();
  }
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  // Rows per task: enough work to pay for a task, and about two tasks per thread over all groups.
  const int64_t by_work = std::max<int64_t>(1, kMinBlockWork / std::max<int64_t>(n * k, 1));
  const int64_t chunk = std::max(by_work, (starts[groups] + 2 * threads - 1) / (2 * threads));
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (group, first row)
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = starts[g]; r < starts[g + 1]; r += chunk) tasks.emplace_back(g, r);
  }
  const float* xs = x.typed_data();
  const float* ws = w.typed_data();
  jaxlm::ParallelFor(pool, tasks.size(), threads, [&](int64_t t) {
    const auto [g, first] = tasks[t];
    const int count = int(std::min(chunk, starts[g + 1] - first));
    RowMajorGemm(false, trans_w, count, int(n), int(k), 1.0f, xs + first * k, int(k), ws + g * k * n,
                 int(trans_w ? k : n), 0.0f, out + first * n, int(n));
  });
  return ffi::Error::Success();
}

// dw[g] = x[rows of g]^T @ dy[rows of g]: [G, K, N]; a group without rows gets zeros. Tasks are (group, column
// block) pairs.
ffi::Error GroupedGemmWeightGradImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> dy,
                                     ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> dw) {
  if (sgemm == nullptr) return ffi::Error::Internal("jaxlm_grouped_gemm_dw: no sgemm (load it with jaxlm.kernels.cpu)");
  auto xd = x.dimensions(), yd = dy.dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0] || group_sizes.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("jaxlm_grouped_gemm_dw: x [M, K], dy [M, N], group_sizes [G]");
  }
  const int64_t rows = xd[0], k = xd[1], n = yd[1], groups = group_sizes.dimensions()[0];
  const std::vector<int64_t> starts = GroupStarts(group_sizes.typed_data(), groups, rows);
  float* out = dw->typed_data();
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t col_blocks = std::max<int64_t>(1, std::min<int64_t>(threads, n / 64));
  const float* xs = x.typed_data();
  const float* ys = dy.typed_data();
  jaxlm::ParallelFor(pool, groups * col_blocks, threads, [&](int64_t t) {
    const int64_t g = t / col_blocks, block = t % col_blocks;
    const int64_t begin = n * block / col_blocks, end = n * (block + 1) / col_blocks;
    float* out_g = out + g * k * n;
    const int64_t count = starts[g + 1] - starts[g];
    if (count == 0) {
      for (int64_t i = 0; i < k; ++i) std::fill(out_g + i * n + begin, out_g + i * n + end, 0.0f);
      return;
    }
    RowMajorGemm(true, false, int(k), int(end - begin), int(count), 1.0f, xs + starts[g] * k, int(k),
                 ys + starts[g] * n + begin, int(n), 0.0f, out_g + begin, int(n));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxlm_grouped_gemm, GroupedGemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("trans_w"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxlm_grouped_gemm_dw, GroupedGemmWeightGradImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
