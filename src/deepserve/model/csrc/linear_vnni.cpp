// int8 weights x int8 activations on AVX-512 VNNI (Zen 4, Ice Lake and later):
// linear_w8's path where the weights were packed for it (kernels.pack_linear_w8
// on a CPU with VNNI), as llama.cpp's Q8_0 x Q8_0 dot products are.
//
// The activations are quantized per row and group of G input features (the
// weights' groups): xq = round(x / sx), sx = max |x[group]| / 127, stored
// unsigned (xq + 128) because vpdpbusd multiplies unsigned by signed bytes; the
// 128 it adds is taken back per group with the weights' group sums.
//
// Packed layout (NP, K / 4, 64) int8: panel p, block b (k = 4b .. 4b + 3),
// bytes 4j .. 4j + 3 hold column 16p + j at those four k, so one 64-byte load
// and one vpdpbusd with four broadcast activation bytes add 64 products into
// the 16 columns' int32 sums. Scales (NP, K / G, 32) fp32: [0, 16) the
// columns' weight scales sw, [16, 32) c = 128 * sw * (sum of the group's q).
// Per group: acc += float(dot) * (sx * sw) - sx * c.
//
// Work split: panels over threads; in a panel, rows in blocks of up to 4
// (the block's weights stay in L1 while its rows pass).

#include <immintrin.h>
#include "simd.h"
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int ROWS = 4;

// Row m of x (fp32, K) -> xq (K unsigned bytes) and sx (K / G scales).
void quantize_row(const float* x, int64_t K, int64_t G, uint8_t* xq, float* sx) {
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += G, ++g) {
    float amax = 0.f;
    for (int64_t k = g0; k < g0 + G; ++k) amax = std::max(amax, std::fabs(x[k]));
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    const float inv = 1.f / s;
    sx[g] = s;
    for (int64_t k = g0; k < g0 + G; ++k) {
      const int q = static_cast<int>(std::nearbyint(x[k] * inv));
      xq[k] = static_cast<uint8_t>(std::min(127, std::max(-127, q)) + 128);
    }
  }
}

// Rows r0 .. r0 + R - 1 against one panel: out16[r] = the panel's 16 columns.
template <int R>
__attribute__((target("avx512f,avx512vnni"))) void panel_rows(
    const uint8_t* xq, const float* sx, int64_t K, int64_t G, const int8_t* w,
    const float* scales, float out16[ROWS][16]) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t NG = K / G;
  for (int64_t g = 0; g < NG; ++g) {
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    for (int64_t b = g * G / 4; b < (g + 1) * G / 4; ++b) {
      const __m512i wb = _mm512_loadu_si512(w + b * 64);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * K + b * 4, 4);
        dot[r] = _mm512_dpbusd_epi32(dot[r], _mm512_set1_epi32(four), wb);
      }
    }
    const __m512 sw = _mm512_loadu_ps(scales + g * 32), c = _mm512_loadu_ps(scales + g * 32 + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(sx[r * NG + g]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(s, sw), acc[r]);
      acc[r] = _mm512_fnmadd_ps(s, c, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out16[r], acc[r]);
}

using PanelFn = void (*)(const uint8_t*, const float*, int64_t, int64_t, const int8_t*,
                         const float*, float[ROWS][16]);
constexpr PanelFn PANELS[ROWS + 1] = {nullptr, panel_rows<1>, panel_rows<2>, panel_rows<3>,
                                      panel_rows<4>};

template <typename T>
void store(const float* acc, const float* bias, int64_t col0, int ncols, T* out) {
  for (int j = 0; j < ncols; ++j) {
    const float v = bias ? acc[j] + bias[col0 + j] : acc[j];
    if constexpr (std::is_same_v<T, float>)
      out[j] = v;
    else
      reinterpret_cast<uint16_t*>(out)[j] = ds::to_bf16(v);
  }
}

template <typename T>
void run(const uint8_t* xq, const float* sx, int64_t M, int64_t K, int64_t G, const int8_t* w,
         const float* scales, int64_t NP, int64_t N, const float* bias, T* out) {
  const int64_t NG = K / G;
  at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) {
    float acc[ROWS][16];
    for (int64_t p = p0; p < p1; ++p) {
      const int ncols = static_cast<int>(std::min<int64_t>(16, N - p * 16));
      for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
        const int R = static_cast<int>(std::min<int64_t>(ROWS, M - r0));
        PANELS[R](xq + r0 * K, sx + r0 * NG, K, G, w + p * K * 16, scales + p * NG * 32, acc);
        for (int r = 0; r < R; ++r) store<T>(acc[r], bias, p * 16, ncols, out + (r0 + r) * N + p * 16);
      }
    }
  });
}

}  // namespace

bool vnni_supported() {
  static const bool yes = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512vnni");
  return yes;
}

// xf: (M, K) fp32; packed (NP, K / 4, 64) int8; scales (NP, K / G, 32) fp32; out (M, N).
void linear_w8_vnni(const at::Tensor& xf, const at::Tensor& packed, const at::Tensor& scales,
                    const float* bias, at::Tensor& out) {
  const int64_t M = xf.size(0), K = xf.size(1), NP = packed.size(0), N = out.size(1);
  const int64_t NG = scales.size(1), G = K / NG;
  TORCH_CHECK(vnni_supported(), "int8 weights packed for AVX-512 VNNI on a CPU without it");
  TORCH_CHECK(G % 4 == 0, "VNNI groups must be a multiple of 4 input features");
  auto xq = at::empty({M, K}, xf.options().dtype(at::kByte));
  auto sx = at::empty({M, NG}, xf.options());
  const float* xp = xf.data_ptr<float>();
  uint8_t* qp = xq.data_ptr<uint8_t>();
  float* sp = sx.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) quantize_row(xp + m * K, K, G, qp + m * K, sp + m * NG);
  const int8_t* w = packed.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  if (out.scalar_type() == at::kBFloat16)
    run<at::BFloat16>(qp, sp, M, K, G, w, s, NP, N, bias, out.data_ptr<at::BFloat16>());
  else
    run<float>(qp, sp, M, K, G, w, s, NP, N, bias, out.data_ptr<float>());
}
