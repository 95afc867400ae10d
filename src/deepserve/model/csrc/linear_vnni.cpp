// int8 (or int4) weights x int8 activations: linear_w8's path where the weights
// were packed for it (kernels.pack_linear_w8 / pack_linear_w4), as llama.cpp's
// Q8_0 x Q8_0 dot products are. Two ISA paths, picked at run time:
//   AVX-512 VNNI (Zen 4, Ice Lake and later): vpdpbusd, 64 products a
//     instruction into 16 int32 sums; it multiplies unsigned by signed bytes,
//     so the activations are stored + 128 and the 128 is taken back per group
//     with the weights' group sums;
//   AVX2: vpmaddubsw on |w| and x with w's sign (no pair exceeds 2 * 127 * 127,
//     so the int16 sums never saturate), vpmaddwd to int32, 8 columns a register.
//
// The activations are quantized per row and group of G input features (the
// weights' groups): xq = round(x / sx), sx = max |x[group]| / 127.
//
// Packed layout (NP, K / 4, 64) int8: panel p, block b (k = 4b .. 4b + 3),
// bytes 4j .. 4j + 3 hold column 16p + j at those four k, so one 64-byte load
// and one vpdpbusd with four broadcast activation bytes add 64 products into
// the 16 columns' int32 sums. Scales (NP, K / G, 32) fp32: [0, 16) the
// columns' weight scales sw, [16, 32) c = 128 * sw * (sum of the group's q)
// (int4: (NP, K / G, 48), [32, 48) the columns' minimums m).
// Per group: acc += float(dot) * (sx * sw) (- sx * c on VNNI) (+ sx * sum(xq) * m).
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
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

constexpr int ROWS = 4;

// Row m of x (fp32, K) -> xq (K bytes, + offset: 128 for VNNI, 0 for AVX2) and
// sx (K / G pairs: the group's scale, and the scale times the sum of its xq,
// which an int4 group's minimum multiplies).
void quantize_row(const float* x, int64_t K, int64_t G, int offset, uint8_t* xq, float* sx) {
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += G, ++g) {
    float amax = 0.f;
    for (int64_t k = g0; k < g0 + G; ++k) amax = std::max(amax, std::fabs(x[k]));
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    const float inv = 1.f / s;
    int sum = 0;
    for (int64_t k = g0; k < g0 + G; ++k) {
      const int q = std::min(127, std::max(-127, static_cast<int>(std::nearbyint(x[k] * inv))));
      xq[k] = static_cast<uint8_t>(q + offset);
      sum += q;
    }
    sx[2 * g] = s;
    sx[2 * g + 1] = s * static_cast<float>(sum);
  }
}

// The weight formats, one k4 block of a panel (16 columns x 4 k) at a time:
// int8, 64 bytes as laid out above; int4 (quantize = "int4"), 32 bytes, byte i
// holding value i (0..15) in its low nibble and value i + 32 in its high one,
// with a minimum per column and group besides its scale (w = q * s + m, as
// llama.cpp's Q4_1), so its scales carry 48 floats a group: s, c, m.
struct Int8Block {
  static constexpr int64_t BYTES = 64, SCALES = 32;
  static constexpr bool MINS = false;
  static inline void avx2(const uint8_t* p, __m256i& lo, __m256i& hi) {
    lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  }
  __attribute__((target("avx512f"))) static inline __m512i vnni(const uint8_t* p) {
    return _mm512_loadu_si512(p);
  }
};
struct Int4Block {
  static constexpr int64_t BYTES = 32, SCALES = 48;
  static constexpr bool MINS = true;
  static inline void avx2(const uint8_t* p, __m256i& lo, __m256i& hi) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    lo = _mm256_and_si256(v, nibble);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
  }
  __attribute__((target("avx512f"))) static inline __m512i vnni(const uint8_t* p) {
    __m256i lo, hi;
    avx2(p, lo, hi);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
};

// Rows r0 .. r0 + R - 1 against one panel: out16[r] = the panel's 16 columns.
template <int R, typename B>
__attribute__((target("avx512f,avx512vnni"))) void panel_rows(
    const uint8_t* xq, const float* sx, int64_t K, int64_t G, const uint8_t* w,
    const float* scales, float out16[ROWS][16]) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t NG = K / G;
  for (int64_t g = 0; g < NG; ++g) {
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    for (int64_t b = g * G / 4; b < (g + 1) * G / 4; ++b) {
      const __m512i wb = B::vnni(w + b * B::BYTES);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * K + b * 4, 4);
        dot[r] = _mm512_dpbusd_epi32(dot[r], _mm512_set1_epi32(four), wb);
      }
    }
    const float* gs = scales + g * B::SCALES;
    const __m512 sw = _mm512_loadu_ps(gs), c = _mm512_loadu_ps(gs + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(sx[(r * NG + g) * 2]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(s, sw), acc[r]);
      acc[r] = _mm512_fnmadd_ps(s, c, acc[r]);
      if constexpr (B::MINS)
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sx[(r * NG + g) * 2 + 1]),
                                 _mm512_loadu_ps(gs + 32), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out16[r], acc[r]);
}

// The same on AVX2 (xq signed): 8 columns a register, lo = columns 0..7, hi = 8..15.
template <int R, typename B>
void panel_rows_avx2(const uint8_t* xq, const float* sx, int64_t K, int64_t G, const uint8_t* w,
                     const float* scales, float out16[ROWS][16]) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t NG = K / G;
  for (int64_t g = 0; g < NG; ++g) {
    __m256i dlo[R], dhi[R];
    for (int r = 0; r < R; ++r) dlo[r] = dhi[r] = _mm256_setzero_si256();
    for (int64_t b = g * G / 4; b < (g + 1) * G / 4; ++b) {
      __m256i wl, wh;
      B::avx2(w + b * B::BYTES, wl, wh);
      const __m256i al = _mm256_sign_epi8(wl, wl), ah = _mm256_sign_epi8(wh, wh);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * K + b * 4, 4);
        const __m256i x = _mm256_set1_epi32(four);
        dlo[r] = _mm256_add_epi32(dlo[r], _mm256_madd_epi16(
            _mm256_maddubs_epi16(al, _mm256_sign_epi8(x, wl)), ones));
        dhi[r] = _mm256_add_epi32(dhi[r], _mm256_madd_epi16(
            _mm256_maddubs_epi16(ah, _mm256_sign_epi8(x, wh)), ones));
      }
    }
    const float* gs = scales + g * B::SCALES;
    const __m256 swl = _mm256_loadu_ps(gs), swh = _mm256_loadu_ps(gs + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_set1_ps(sx[(r * NG + g) * 2]);
      lo[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dlo[r]), _mm256_mul_ps(s, swl), lo[r]);
      hi[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dhi[r]), _mm256_mul_ps(s, swh), hi[r]);
      if constexpr (B::MINS) {
        const __m256 xs = _mm256_set1_ps(sx[(r * NG + g) * 2 + 1]);
        lo[r] = _mm256_fmadd_ps(xs, _mm256_loadu_ps(gs + 32), lo[r]);
        hi[r] = _mm256_fmadd_ps(xs, _mm256_loadu_ps(gs + 40), hi[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out16[r], lo[r]);
    _mm256_storeu_ps(out16[r] + 8, hi[r]);
  }
}

using PanelFn = void (*)(const uint8_t*, const float*, int64_t, int64_t, const uint8_t*,
                         const float*, float[ROWS][16]);
template <typename B>
struct Panels {
  static constexpr PanelFn vnni[ROWS + 1] = {nullptr, panel_rows<1, B>, panel_rows<2, B>,
                                             panel_rows<3, B>, panel_rows<4, B>};
  static constexpr PanelFn avx2[ROWS + 1] = {nullptr, panel_rows_avx2<1, B>,
                                             panel_rows_avx2<2, B>, panel_rows_avx2<3, B>,
                                             panel_rows_avx2<4, B>};
};

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
void run(const PanelFn* panels, int64_t block_bytes, int64_t scale_floats, const uint8_t* xq,
         const float* sx, int64_t M, int64_t K, int64_t G, const uint8_t* w,
         const float* scales, int64_t NP, int64_t N, const float* bias, T* out) {
  const int64_t NG = K / G;
  at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) {
    float acc[ROWS][16];
    for (int64_t p = p0; p < p1; ++p) {
      const int ncols = static_cast<int>(std::min<int64_t>(16, N - p * 16));
      for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
        const int R = static_cast<int>(std::min<int64_t>(ROWS, M - r0));
        panels[R](xq + r0 * K, sx + r0 * NG * 2, K, G, w + p * (K / 4) * block_bytes,
                  scales + p * NG * scale_floats, acc);
        for (int r = 0; r < R; ++r) store<T>(acc[r], bias, p * 16, ncols, out + (r0 + r) * N + p * 16);
      }
    }
  });
}

}  // namespace

// The running CPU has AVX-512 VNNI and $DEEPSERVE_KERNEL_ISA is not "avx2" (which
// keeps the AVX2 path: its tests and benchmarks on such a CPU). Read once a process.
bool vnni_supported() {
  static const bool yes = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512vnni") &&
                          !(std::getenv("DEEPSERVE_KERNEL_ISA") &&
                            std::string(std::getenv("DEEPSERVE_KERNEL_ISA")) == "avx2");
  return yes;
}

// xf: (M, K) fp32; packed (NP, K / 4, 64) int8 or (NP, K / 4, 32) uint8 (int4);
// scales (NP, K / G, 32) fp32; out (M, N).
void linear_w8a8(const at::Tensor& xf, const at::Tensor& packed, const at::Tensor& scales,
                 const float* bias, at::Tensor& out) {
  const int64_t M = xf.size(0), K = xf.size(1), NP = packed.size(0), N = out.size(1);
  const int64_t NG = scales.size(1), G = K / NG;
  TORCH_CHECK(G % 4 == 0, "int8-activation groups must be a multiple of 4 input features");
  const bool vnni = vnni_supported();
  auto xq = at::empty({M, K}, xf.options().dtype(at::kByte));
  auto sx = at::empty({M, NG, 2}, xf.options());
  const float* xp = xf.data_ptr<float>();
  uint8_t* qp = xq.data_ptr<uint8_t>();
  float* sp = sx.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {  // a prefill's rows: in parallel
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(xp + m * K, K, G, vnni ? 128 : 0, qp + m * K, sp + m * NG * 2);
  });
  const bool int4 = packed.size(2) == Int4Block::BYTES;
  const auto* w = static_cast<const uint8_t*>(packed.data_ptr());
  const float* s = scales.data_ptr<float>();
  const PanelFn* panels = int4 ? (vnni ? Panels<Int4Block>::vnni : Panels<Int4Block>::avx2)
                               : (vnni ? Panels<Int8Block>::vnni : Panels<Int8Block>::avx2);
  const int64_t bytes = int4 ? Int4Block::BYTES : Int8Block::BYTES;
  const int64_t floats = int4 ? Int4Block::SCALES : Int8Block::SCALES;
  TORCH_CHECK(scales.size(2) == floats, "scales must carry ", floats, " floats a group");
  if (out.scalar_type() == at::kBFloat16)
    run<at::BFloat16>(panels, bytes, floats, qp, sp, M, K, G, w, s, NP, N, bias,
                      out.data_ptr<at::BFloat16>());
  else
    run<float>(panels, bytes, floats, qp, sp, M, K, G, w, s, NP, N, bias,
               out.data_ptr<float>());
}
