// Causal self-attention on the CPU as two XLA FFI handlers (forward, backward), f32: kernels.attention=cpu_fused.
//
// Why our own kernel: the einsum versions run a dozen small matmuls, masks, softmax passes and transposes per
// layer as separate XLA ops that each stream [B, H, T, S] blocks through memory (benchmarks/bench_cpu_attention.py
// compares them with torch's fused SDPA kernel). Here
// one task per (batch, key/value head) works through query blocks whose scores stay in the core's cache: scores
// by sgemm, the softmax in place, then the output by sgemm, reading q, k, v and writing the output in their
// [B, T, heads, K] layout (no transposes). Query block i meets keys 0 .. end of block i only, so the masked upper
// triangle is mostly skipped; the mask hides the rest (document boundaries). The backward pass recomputes the
// probabilities from the saved log-sum-exp per query, as flash kernels do, instead of keeping [B, H, T, T].
//
// Contract (as causal_blocks'): the mask hides every key after its query; a query that sees no key at all gets
// zeros (output and gradients), where the einsum reference would average every value.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxlm::RowMajorGemm;

// exp(x) for x <= 0 (Cephes' single-precision polynomial, ~1 ulp; 0 below about -87.5): written out so the
// compiler vectorises the softmax loops (libm's expf is a call per element there). Branch-free on purpose: with
// -fno-trapping-math GCC then turns the loops into 8-wide AVX2 code instead of a scalar loop.
inline float ExpNonPositive(float x) {
  x = std::max(x, -88.0f);  // there n = -127, so the scale below is 0.0f: masked scores come out exactly 0
  const float t = x * 1.44269504088896341f;
  const int n = int(t - 0.5f);  // round half away from zero; t <= 0
  const float nf = float(n);
  const float r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Reductions in 8 lanes, which the compiler keeps in one vector register (a plain loop would have to add in
// order, one element at a time).
constexpr int kLanes = 8;
constexpr float kHidden = -1e30f;  // a hidden key's score: its exp is 0

inline float MaskedMax(float* row, const bool* shown, int n) {  // also writes kHidden over hidden scores
  float lanes[kLanes];
  std::fill(lanes, lanes + kLanes, kHidden);
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      row[j + l] = shown[j + l] ? row[j + l] : kHidden;
      lanes[l] = std::max(lanes[l], row[j + l]);
    }
  }
  for (; j < n; ++j) {
    row[j] = shown[j] ? row[j] : kHidden;
    lanes[0] = std::max(lanes[0], row[j]);
  }
  return *std::max_element(lanes, lanes + kLanes);
}

inline float ExpSum(float* row, int n, float subtract) {  // row = exp(row - subtract); returns the sum
  float lanes[kLanes] = {};
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      row[j + l] = ExpNonPositive(row[j + l] - subtract);
      lanes[l] += row[j + l];
    }
  }
  for (; j < n; ++j) {
    row[j] = ExpNonPositive(row[j] - subtract);
    lanes[0] += row[j];
  }
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

// The [B, T, N, K] layout of q, k, v and their gradients: row t of head n in batch b.
struct Heads {
  int64_t t, n, k;
  int64_t offset(int64_t b, int64_t head) const { return (b * t * n + head) * k; }
  int ld() const { return int(n * k); }
};

struct Shapes {
  int64_t b, t, h, g, k, block;
  Heads q() const { return {t, h, k}; }
  Heads kv() const { return {t, g, k}; }
};

ffi::Error Check(const char* name, ffi::Span<const int64_t> q, ffi::Span<const int64_t> k,
                 ffi::Span<const int64_t> v, ffi::Span<const int64_t> mask, int64_t block, Shapes* s) {
  if (q.size() != 4 || k.size() != 4 || v.size() != 4 || mask.size() != 3) {
    return ffi::Error::InvalidArgument(std::string(name) + ": q, k, v [B, T, heads, K] and the mask [B, T, T]");
  }
  *s = {q[0], q[1], q[2], k[2], q[3], block};
  const bool same = k[0] == s->b && k[1] == s->t && k[3] == s->k && v[0] == k[0] && v[1] == k[1] && v[2] == k[2] &&
                    v[3] == k[3] && mask[0] == s->b && mask[1] == s->t && mask[2] == s->t;
  if (!same || s->g < 1 || s->h % s->g || block < 1) {
    return ffi::Error::InvalidArgument(std::string(name) + ": shapes disagree (self-attention, heads a multiple of "
                                       "the key/value heads, block >= 1)");
  }
  if (s->t * s->h * s->k > std::numeric_limits<int>::max()) {
    return ffi::Error::InvalidArgument(std::string(name) + ": T * heads * K over 2^31 - 1 (sgemm takes 32-bit sizes)");
  }
  return ffi::Error::Success();
}

// Scores of query rows [start, start + rows) against keys [0, keys) into p (row-major [rows, keys]), then each
// row's probabilities in place: softmax over the keys the mask shows (forward: lse_out gets max + log(sum)), or
// exp(score - lse) with the forward's log-sum-exp (backward: lse_in). Hidden keys get 0.
void Probabilities(const Shapes& s, const float* q, const float* k, const bool* mask_b, int64_t start, int rows,
                   int keys, float* p, const float* lse_in, float* lse_out) {
  RowMajorGemm(false, true, rows, keys, int(s.k), 1.0f, q + start * s.q().ld(), s.q().ld(), k, s.kv().ld(), 0.0f, p,
               keys);
  for (int r = 0; r < rows; ++r) {
    float* row = p + int64_t(r) * keys;
    const bool* shown = mask_b + (start + r) * s.t;
    const float max = MaskedMax(row, shown, keys);
    if (max <= kHidden) {  // no key shown
      std::fill(row, row + keys, 0.0f);
      if (lse_out != nullptr) lse_out[start + r] = -std::numeric_limits<float>::infinity();
      continue;
    }
    if (lse_in != nullptr) {  // backward: the forward's probabilities, exp(score - log-sum-exp)
      ExpSum(row, keys, lse_in[start + r]);
      continue;
    }
    const float sum = ExpSum(row, keys, max), inverse = 1.0f / sum;
    for (int j = 0; j < keys; ++j) row[j] *= inverse;
    lse_out[start + r] = max + std::log(sum);
  }
}

// Scratch rows per thread, reused across calls: [block, T] floats each.
std::vector<float>& Scratch(int which, size_t size) {
  thread_local std::vector<float> buffers[2];
  if (buffers[which].size() < size) buffers[which].resize(size);
  return buffers[which];
}

ffi::Error AttentionForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                            ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> out,
                            ffi::ResultBuffer<ffi::F32> lse, int64_t block) {
  Shapes s;
  if (auto e = Check("jaxlm_attention_fwd", q.dimensions(), k.dimensions(), v.dimensions(), mask.dimensions(), block,
                     &s);
      e.failure()) {
    return e;
  }
  const float *qd = q.typed_data(), *kd = k.typed_data(), *vd = v.typed_data();
  const bool* md = mask.typed_data();
  float *od = out->typed_data(), *ld = lse->typed_data();
  const int64_t r_per_g = s.h / s.g;
  const Heads q_layout = s.q(), kv_layout = s.kv();
  const int ldq = q_layout.ld(), ldkv = kv_layout.ld(), head_dim = int(s.k);
  jaxlm::ParallelFor(pool, s.b * s.h, std::max<int64_t>(pool.num_threads(), 1), [&](int64_t task) {
    const int64_t b = task / s.h, h = task % s.h, g = h / r_per_g;
    const float *qh = qd + q_layout.offset(b, h), *kg = kd + kv_layout.offset(b, g), *vg = vd + kv_layout.offset(b, g);
    float* oh = od + q_layout.offset(b, h);
    float* lse_bh = ld + (b * s.h + h) * s.t;
    float* p = Scratch(0, size_t(std::min(s.block, s.t) * s.t)).data();
    for (int64_t start = 0; start < s.t; start += s.block) {
      const int rows = int(std::min(s.block, s.t - start)), keys = int(start + rows);
      Probabilities(s, qh, kg, md + b * s.t * s.t, start, rows, keys, p, nullptr, lse_bh);
      RowMajorGemm(false, false, rows, head_dim, keys, 1.0f, p, keys, vg, ldkv, 0.0f, oh + start * ldq, ldq);
    }
  });
  return ffi::Error::Success();
}

ffi::Error AttentionBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                             ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::F32> out,
                             ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout, ffi::ResultBuffer<ffi::F32> dq,
                             ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv, int64_t block) {
  Shapes s;
  if (auto e = Check("jaxlm_attention_bwd", q.dimensions(), k.dimensions(), v.dimensions(), mask.dimensions(), block,
                     &s);
      e.failure()) {
    return e;
  }
  const float *qd = q.typed_data(), *kd = k.typed_data(), *vd = v.typed_data(), *od = out.typed_data();
  const float *ld = lse.typed_data(), *dod = dout.typed_data();
  const bool* md = mask.typed_data();
  float *dqd = dq->typed_data(), *dkd = dk->typed_data(), *dvd = dv->typed_data();
  const int64_t r_per_g = s.h / s.g;
  const Heads q_layout = s.q(), kv_layout = s.kv();
  const int ldq = q_layout.ld(), ldkv = kv_layout.ld(), head_dim = int(s.k);
  // One task per (batch, key/value head): the query heads that share it add into its dk and dv in turn.
  jaxlm::ParallelFor(pool, s.b * s.g, std::max<int64_t>(pool.num_threads(), 1), [&](int64_t task) {
    const int64_t b = task / s.g, g = task % s.g;
    const float *kg = kd + kv_layout.offset(b, g), *vg = vd + kv_layout.offset(b, g);
    float *dkg = dkd + kv_layout.offset(b, g), *dvg = dvd + kv_layout.offset(b, g);
    for (int64_t t = 0; t < s.t; ++t) {
      std::fill(dkg + t * ldkv, dkg + t * ldkv + s.k, 0.0f);
      std::fill(dvg + t * ldkv, dvg + t * ldkv + s.k, 0.0f);
    }
    const size_t scratch = size_t(std::min(s.block, s.t) * s.t);
    float *p = Scratch(0, scratch).data(), *dp = Scratch(1, scratch + size_t(s.t)).data();
    float* row_dot = dp + scratch;  // per query: sum over K of dout * out (the softmax backward's row term)
    for (int64_t h = g * r_per_g; h < (g + 1) * r_per_g; ++h) {
      const float *qh = qd + q_layout.offset(b, h), *oh = od + q_layout.offset(b, h);
      const float* doh = dod + q_layout.offset(b, h);
      float* dqh = dqd + q_layout.offset(b, h);
      const float* lse_bh = ld + (b * s.h + h) * s.t;
      for (int64_t t = 0; t < s.t; ++t) {
        float dot = 0.0f;
        for (int64_t c = 0; c < s.k; ++c) dot += doh[t * ldq + c] * oh[t * ldq + c];
        row_dot[t] = dot;
      }
      for (int64_t start = 0; start < s.t; start += s.block) {
        const int rows = int(std::min(s.block, s.t - start)), keys = int(start + rows);
        const float* do_block = doh + start * ldq;
        Probabilities(s, qh, kg, md + b * s.t * s.t, start, rows, keys, p, lse_bh, nullptr);
        RowMajorGemm(true, false, keys, head_dim, rows, 1.0f, p, keys, do_block, ldq, 1.0f, dvg, ldkv);  // dv += p^T do
        RowMajorGemm(false, true, rows, keys, head_dim, 1.0f, do_block, ldq, vg, ldkv, 0.0f, dp, keys);  // dp = do v^T
        for (int r = 0; r < rows; ++r) {  // dscores = p * (dp - row_dot), in dp
          float* dp_row = dp + int64_t(r) * keys;
          const float* p_row = p + int64_t(r) * keys;
          const float term = row_dot[start + r];
          for (int j = 0; j < keys; ++j) dp_row[j] = p_row[j] * (dp_row[j] - term);
        }
        RowMajorGemm(false, false, rows, head_dim, keys, 1.0f, dp, keys, kg, ldkv, 0.0f, dqh + start * ldq, ldq);
        RowMajorGemm(true, false, keys, head_dim, rows, 1.0f, dp, keys, qh + start * ldq, ldq, 1.0f, dkg, ldkv);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxlm_attention_fwd, AttentionForward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxlm_attention_bwd, AttentionBackward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block"));
