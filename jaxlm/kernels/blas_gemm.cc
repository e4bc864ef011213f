// One XLA FFI handler: row-major C = op(A) @ op(B) in f32 through the Fortran BLAS sgemm that scipy ships
// (OpenBLAS). Built and loaded by jaxlm/kernels/cpu.py, which also hands over the BLAS function pointers.
//
// Threads: OpenBLAS's own thread pool fights XLA's for the same cores (and two gemms that XLA runs at once share
// it). So OpenBLAS runs on one thread (jaxlm/kernels/cpu.py sets it) and each call
// splits C into as many row or column blocks as XLA's intra-op pool has threads (jaxlm::ParallelFor).
#include <algorithm>
#include <cstdint>
#include <limits>

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
