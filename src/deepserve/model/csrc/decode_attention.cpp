// Decode attention that reads the paged KV pool in place (AVX2 + FMA).
//
// One query token per sequence. The pool of one layer is head-major,
// k_cache, v_cache: (Hkv, NB, bs, D) (see model/attention.py); token t of
// sequence b is row t % bs of block block_tables[b, t / bs]. A task is one
// (sequence, KV head): its G = H / Hkv query heads share every K/V row it
// reads, so each row is read once per task, straight from its block, with no
// gather copy. Two passes over the context: scores (G x L, kept in a
// per-task buffer), softmax, then the weighted sum of V rows.
//
// Rows are widened to fp32 16 values at a time. For bf16 the widening
// yields the even elements then the odd ones (see linear.cpp), so q and the
// accumulators live in that same permuted order and are put back in order
// only when the output row is written; for fp32 the order is the natural one.

#include <immintrin.h>
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers (ATen.h: a quarter more compile time)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include "simd.h"
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline void widen16(const at::BFloat16* p, __m256& a, __m256& b) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  b = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

inline void widen16(const float* p, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(p);
  b = _mm256_loadu_ps(p + 8);
}

// Put a permuted 16-value chunk back in order.
inline void narrow16(const float* acc, float scale, at::BFloat16* out) {
  for (int i = 0; i < 8; ++i) {
    out[2 * i] = static_cast<at::BFloat16>(acc[i] * scale);
    out[2 * i + 1] = static_cast<at::BFloat16>(acc[8 + i] * scale);
  }
}

inline void narrow16(const float* acc, float scale, float* out) {
  for (int i = 0; i < 16; ++i) out[i] = acc[i] * scale;
}

using ds::exp_neg;
using ds::hsum;

// p[0..n) = exp(p - max); returns their sum.
inline float softmax_numerators(float* p, int64_t n) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, p[i]);
  __m256 vm = _mm256_set1_ps(m), vs = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(p + i), vm));
    _mm256_storeu_ps(p + i, e);
    vs = _mm256_add_ps(vs, e);
  }
  float s = hsum(vs);
  for (; i < n; ++i) {
    p[i] = std::exp(p[i] - m);
    s += p[i];
  }
  return s;
}

template <typename T, int D>
void one_task(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t len,
              int64_t bs, int G, float scale, std::vector<float>& scores, T* out) {
  constexpr int C = D / 16;  // 16-value chunks per row
  __m256 qa[8][C], qb[8][C];  // G <= 8 query rows, fp32, permuted
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) widen16(q + g * D + c * 16, qa[g][c], qb[g][c]);
  scores.resize(static_cast<size_t>(G) * len);
  float* s = scores.data();
  for (int64_t t = 0; t < len; ++t) {
    const T* k = kc + (table[t / bs] * bs + t % bs) * D;
    __m256 ka[C], kb[C];
    for (int c = 0; c < C; ++c) widen16(k + c * 16, ka[c], kb[c]);
    for (int g = 0; g < G; ++g) {
      __m256 acc = _mm256_mul_ps(qa[g][0], ka[0]);
      acc = _mm256_fmadd_ps(qb[g][0], kb[0], acc);
      for (int c = 1; c < C; ++c) {
        acc = _mm256_fmadd_ps(qa[g][c], ka[c], acc);
        acc = _mm256_fmadd_ps(qb[g][c], kb[c], acc);
      }
      s[g * len + t] = hsum(acc) * scale;
    }
  }
  float inv[8];
  for (int g = 0; g < G; ++g) inv[g] = 1.0f / softmax_numerators(s + g * len, len);
  alignas(32) float acc[8][D];
  std::memset(acc, 0, sizeof(acc));
  for (int64_t t = 0; t < len; ++t) {
    const T* v = vc + (table[t / bs] * bs + t % bs) * D;
    __m256 va[C], vb[C];
    for (int c = 0; c < C; ++c) widen16(v + c * 16, va[c], vb[c]);
    for (int g = 0; g < G; ++g) {
      __m256 p = _mm256_set1_ps(s[g * len + t]);
      for (int c = 0; c < C; ++c) {
        float* a = acc[g] + c * 16;
        _mm256_store_ps(a, _mm256_fmadd_ps(p, va[c], _mm256_load_ps(a)));
        _mm256_store_ps(a + 8, _mm256_fmadd_ps(p, vb[c], _mm256_load_ps(a + 8)));
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) narrow16(acc[g] + c * 16, inv[g], out + g * D + c * 16);
}

template <typename T, int D>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& tables, const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), Hkv = k_cache.size(0);
  const int64_t NB = k_cache.size(1), bs = k_cache.size(2), W = tables.size(1);
  const int G = static_cast<int>(H / Hkv);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t head0 = h * G;  // first query head of this KV head
      one_task<T, D>(qp + (b * H + head0) * D, kp + h * NB * bs * D, vp + h * NB * bs * D,
                     tp + b * W, lp[b], bs, G, static_cast<float>(scale), scores,
                     op + (b * H + head0) * D);
    }
  });
}

}  // namespace

// q: (B, H, D); caches: (Hkv, NB, bs, D); tables: (B, W) int64; lens: (B,) int64 -> (B, H, D).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& tables,
                                     const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q (B, H, D), caches (Hkv, NB, bs, D)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and caches must share a dtype");
  const int64_t H = q.size(1), Hkv = k_cache.size(0), D = q.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0 && H / Hkv <= 8, "heads: H % Hkv, G <= 8");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong &&
              tables.size(0) == q.size(0) && lens.size(0) == q.size(0), "tables (B, W), lens (B,)");
  auto qc = q.contiguous();
  auto tc = tables.contiguous();
  auto lc = lens.contiguous();
  auto out = at::empty_like(qc);
#define DS_CASE(T, DIM) if (D == DIM) { run<T, DIM>(qc, k_cache, v_cache, tc, lc, scale, out); return out; }
  if (q.scalar_type() == at::kBFloat16) {
    DS_CASE(at::BFloat16, 32) DS_CASE(at::BFloat16, 64) DS_CASE(at::BFloat16, 128)
  } else if (q.scalar_type() == at::kFloat) {
    DS_CASE(float, 32) DS_CASE(float, 64) DS_CASE(float, 128)
  }
#undef DS_CASE
  TORCH_CHECK(false, "paged_decode_attention: D in {32, 64, 128}, bf16 or fp32");
}
