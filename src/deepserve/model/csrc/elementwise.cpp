// Fused elementwise ops of a decoder layer for bf16 activations (AVX2 + FMA).
//
// Each replaces a chain of torch ops (one dispatch, one pass over memory
// each) with one op, and rounds to bf16 exactly where that chain did, so the
// results are the torch path's bit for bit wherever both compute the same
// fp32 values (the sum of squares of RMSNorm is added in another order, and
// SiLU's exp is a polynomial (simd.h): those two may differ in the last fp32 bit):
//
//   add_rms_norm   residual = bf16(residual + x) (in place; skipped without x);
//                  out = bf16(w * bf16(residual * rsqrt(mean(residual^2) + eps)))
//   rotary         q, k of a fused qkv row, in place, half-split layout:
//                  out = bf16(bf16(x * bf16(cos)) + bf16(rot(x) * bf16(sin)))
//   silu_and_mul   (T, 2I) -> (T, I): bf16(bf16(silu(gate)) * up)
//
// Rows are independent: every op is one parallel_for over rows, 8 lanes at a
// time (AVX2) with a scalar tail.

#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers (ATen.h: a quarter more compile time)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#include "simd.h"

namespace {

inline float f32(at::BFloat16 v) {
  uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline at::BFloat16 bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  at::BFloat16 out;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    out.x = static_cast<uint16_t>((u >> 16) | 0x40);
    return out;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  out.x = static_cast<uint16_t>(u >> 16);
  return out;
}

inline float round_bf16(float f) { return f32(bf16(f)); }

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

// x * sigmoid(x) with exp of a non-positive argument only: e = exp(-|x|),
// sigmoid = 1 / (1 + e) for x >= 0 and e / (1 + e) below.
inline __m256 silu8(__m256 x) {
  const __m256 neg_abs = _mm256_or_ps(x, _mm256_set1_ps(-0.0f));
  const __m256 e = ds::exp_neg(neg_abs);
  const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.f), e);
  const __m256 pos = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
  const __m256 num = _mm256_blendv_ps(_mm256_mul_ps(x, e), x, pos);
  return _mm256_div_ps(num, den);
}

void check_bf16_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bf16");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be (T, E) with unit stride");
}

}  // namespace

// x: (T, E) or empty; residual: (T, E), updated in place; weight: (E,) bf16 -> out (T, E).
at::Tensor add_rms_norm(const c10::optional<at::Tensor>& x, const at::Tensor& residual,
                        const at::Tensor& weight, double eps) {
  check_bf16_rows(residual, "residual");
  const bool add = x.has_value() && x->defined();
  if (add) {
    check_bf16_rows(*x, "x");
    TORCH_CHECK(x->sizes() == residual.sizes(), "x and residual differ in shape");
  }
  const int64_t T = residual.size(0), E = residual.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
              weight.numel() == E, "weight must be (E,) bf16");
  auto out = at::empty({T, E}, residual.options());
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  const float fe = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      at::BFloat16* r = residual.data_ptr<at::BFloat16>() + t * residual.stride(0);
      const int64_t E8 = E - E % 8;
      if (add) {
        const at::BFloat16* xp = x->data_ptr<at::BFloat16>() + t * x->stride(0);
        for (int64_t i = 0; i < E8; i += 8)
          ds::store_bf16x8(r + i, _mm256_add_ps(ds::load_bf16x8(r + i), ds::load_bf16x8(xp + i)));
        for (int64_t i = E8; i < E; ++i) r[i] = bf16(f32(r[i]) + f32(xp[i]));
      }
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < E8; i += 8) {
        const __m256 v = ds::load_bf16x8(r + i);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      float ss = ds::hsum(acc);
      for (int64_t i = E8; i < E; ++i) ss += f32(r[i]) * f32(r[i]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(E) + fe);
      const __m256 vinv = _mm256_set1_ps(inv);
      at::BFloat16* o = out.data_ptr<at::BFloat16>() + t * E;
      for (int64_t i = 0; i < E8; i += 8) {
        const __m256 h = ds::round_bf16x8(_mm256_mul_ps(ds::load_bf16x8(r + i), vinv));
        ds::store_bf16x8(o + i, _mm256_mul_ps(ds::load_bf16x8(wp + i), h));
      }
      for (int64_t i = E8; i < E; ++i) o[i] = bf16(f32(wp[i]) * round_bf16(f32(r[i]) * inv));
    }
  });
  return out;
}

// qkv: (T, (H + 2 Hkv) D) bf16, q then k then v per row; rotated in place.
// cos, sin: (P, D) fp32 tables (half-split: column i and i + D/2 hold one angle);
// positions: (T,) int64.
void rotary(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
            const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  check_bf16_rows(qkv, "qkv");
  const int64_t T = qkv.size(0), D = head_dim, half = D / 2, heads = num_heads + num_kv_heads;
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "qkv width");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == T &&
              positions.is_contiguous(), "positions must be (T,) int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
              cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == D &&
              sin.sizes() == cos.sizes(), "cos / sin must be (P, D) fp32");
  const int64_t P = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position ", pos[t], " outside the rotary table");
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cos.data_ptr<float>() + pos[t] * D;
      const float* s = sin.data_ptr<float>() + pos[t] * D;
      at::BFloat16* row = qkv.data_ptr<at::BFloat16>() + t * qkv.stride(0);
      for (int64_t h = 0; h < heads; ++h) {
        at::BFloat16* x = row + h * D;
        const int64_t half8 = half - half % 8;
        for (int64_t i = 0; i < half8; i += 8) {
          const __m256 x1 = ds::load_bf16x8(x + i), x2 = ds::load_bf16x8(x + i + half);
          const __m256 c1 = ds::round_bf16x8(_mm256_loadu_ps(c + i));
          const __m256 c2 = ds::round_bf16x8(_mm256_loadu_ps(c + i + half));
          const __m256 s1 = ds::round_bf16x8(_mm256_loadu_ps(s + i));
          const __m256 s2 = ds::round_bf16x8(_mm256_loadu_ps(s + i + half));
          const __m256 neg_x2 = _mm256_xor_ps(x2, _mm256_set1_ps(-0.0f));
          ds::store_bf16x8(x + i, _mm256_add_ps(ds::round_bf16x8(_mm256_mul_ps(x1, c1)),
                                                ds::round_bf16x8(_mm256_mul_ps(neg_x2, s1))));
          ds::store_bf16x8(x + i + half,
                           _mm256_add_ps(ds::round_bf16x8(_mm256_mul_ps(x2, c2)),
                                         ds::round_bf16x8(_mm256_mul_ps(x1, s2))));
        }
        for (int64_t i = half8; i < half; ++i) {
          const float x1 = f32(x[i]), x2 = f32(x[i + half]);
          const float c1 = round_bf16(c[i]), c2 = round_bf16(c[i + half]);
          const float s1 = round_bf16(s[i]), s2 = round_bf16(s[i + half]);
          x[i] = bf16(round_bf16(x1 * c1) + round_bf16(-x2 * s1));
          x[i + half] = bf16(round_bf16(x2 * c2) + round_bf16(x1 * s2));
        }
      }
    }
  });
}

// gate_up: (T, 2I) bf16 -> (T, I) bf16.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_bf16_rows(gate_up, "gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I, "gate_up width must be even");
  auto out = at::empty({T, I}, gate_up.options());
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const at::BFloat16* g = gate_up.data_ptr<at::BFloat16>() + t * gate_up.stride(0);
      const at::BFloat16* u = g + I;
      at::BFloat16* o = out.data_ptr<at::BFloat16>() + t * I;
      const int64_t I8 = I - I % 8;
      for (int64_t i = 0; i < I8; i += 8) {
        const __m256 a = ds::round_bf16x8(silu8(ds::load_bf16x8(g + i)));
        ds::store_bf16x8(o + i, _mm256_mul_ps(a, ds::load_bf16x8(u + i)));
      }
      for (int64_t i = I8; i < I; ++i) o[i] = bf16(round_bf16(silu(f32(g[i]))) * f32(u[i]));
    }
  });
  return out;
}
