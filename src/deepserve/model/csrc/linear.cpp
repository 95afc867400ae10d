// bf16-weight linear for CPUs with AVX2 + FMA and no bf16 arithmetic.
//
// torch's bf16 matmul falls back to a scalar-ish path on such CPUs (Zen 3:
// ~17 GFLOP/s against ~110 for its fp32 sgemm), so we keep the weights in
// bf16 (half the bytes a decode step streams) and do the arithmetic in fp32:
// a bf16 value is the top half of an fp32, so widening is one shift or mask.
//
// Packed weight layout (pack_linear_weight in model/kernels.py):
//   (NP, K, 16) bf16, NP = ceil(N / 16) panels of 16 output columns; in the
//   16 values of one (panel, k), 32-bit lane j holds column j in its low half
//   and column j + 8 in its high half, so a 256-bit load gives columns 0..7
//   by `<< 16` and columns 8..15 by `& 0xffff0000`, both already fp32.
//
// int8 weights (weight-only, linear_w8): the same panels with int8 values,
// column j of a panel at byte j of its 16 (a 128-bit load, sign-extended to
// two 8-lane int32 halves, converted to fp32), times the fp32 scale of its
// column and group of G consecutive k (symmetric: w = q * s; scales packed
// (NP, K / G, 16) like the panels, two 8-lane vectors loaded once a group),
// so a decode step streams 1 + 4 / G bytes per weight instead of two.
//
// Work split: row chunks of ROWS_PER_CHUNK x all panels, flattened into one
// parallel range (chunk-major: a thread walks every panel of a chunk while
// that chunk of x sits in its cache); each task runs the panel over the
// chunk's rows in micro-tiles of MR rows x 16 columns, the accumulators in
// registers, the whole K in one pass.

#include <immintrin.h>
#include "simd.h"
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS  // per-operator headers (ATen.h: a quarter more compile time)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

namespace {

constexpr int64_t ROWS_PER_CHUNK = 96;  // 16 micro-tiles of 6 rows

inline void widen16(const uint16_t* p, __m256& lo, __m256& hi) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// The weight types: 16 columns of one (panel, k) -> two 8-column fp32 halves.
struct Bf16W {
  using type = uint16_t;
  static constexpr bool scaled = false;
  static inline void widen(const uint16_t* p, __m256& lo, __m256& hi) { widen16(p, lo, hi); }
};
struct Int8W {
  using type = int8_t;
  static constexpr bool scaled = true;
  static inline void widen(const int8_t* p, __m256& lo, __m256& hi) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
  }
};

// acc rows r < MR (16 floats each) for rows of a: x rows (fp32, stride lda),
// panel (K, 16). Named accumulators, not an array: GCC keeps an array of
// __m256 in registers but also stores it back every iteration.
#define DS_ROW(r)                                                   \
  if constexpr (MR > r) {                                           \
    const __m256 x = _mm256_broadcast_ss(a + r * lda + k);          \
    l##r = _mm256_fmadd_ps(x, wl, l##r);                            \
    h##r = _mm256_fmadd_ps(x, wh, h##r);                            \
  }
#define DS_STORE(r)                                                 \
  if constexpr (MR > r) {                                           \
    _mm256_storeu_ps(out16 + r * 16, l##r);                         \
    _mm256_storeu_ps(out16 + r * 16 + 8, h##r);                     \
  }
// One panel of a packed weight: its K x 16 values and, for a scaled type, its
// (K / G) x 16 group scales.
template <typename W>
struct Panel {
  const typename W::type* w;
  const float* s;  // nullptr for bf16
  int64_t G;       // k per scale group (K for bf16: one group)
  // The weights of (this panel, k) as fp32, scaled by (sl, sh) where the type has scales.
  inline void widen(int64_t k, __m256 sl, __m256 sh, __m256& wl, __m256& wh) const {
    W::widen(w + k * 16, wl, wh);
    if constexpr (W::scaled) {
      wl = _mm256_mul_ps(wl, sl);
      wh = _mm256_mul_ps(wh, sh);
    }
  }
  inline void scales(int64_t g0, __m256& sl, __m256& sh) const {
    if constexpr (W::scaled) {
      sl = _mm256_loadu_ps(s + (g0 / G) * 16);
      sh = _mm256_loadu_ps(s + (g0 / G) * 16 + 8);
    } else {
      sl = sh = _mm256_setzero_ps();
    }
  }
  inline Panel at(int64_t p, int64_t K) const {  // panel p of a packed weight starting here
    return {w + p * K * 16, s ? s + p * (K / G) * 16 : nullptr, G};
  }
};

template <int MR, typename W>
inline void tile(const float* a, int64_t lda, Panel<W> panel, int64_t K, float* out16) {
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0;
  __m256 l3 = l0, h3 = l0, l4 = l0, h4 = l0, l5 = l0, h5 = l0;
  for (int64_t g0 = 0; g0 < K; g0 += panel.G) {
    __m256 sl, sh;
    panel.scales(g0, sl, sh);
    for (int64_t k = g0, g1 = std::min(K, g0 + panel.G); k < g1; ++k) {
      __m256 wl, wh;
      panel.widen(k, sl, sh, wl, wh);
      DS_ROW(0) DS_ROW(1) DS_ROW(2) DS_ROW(3) DS_ROW(4) DS_ROW(5)
    }
  }
  DS_STORE(0) DS_STORE(1) DS_STORE(2) DS_STORE(3) DS_STORE(4) DS_STORE(5)
}
#undef DS_ROW
#undef DS_STORE

// One row against 4 panels at once: 8 independent FMA chains for M = 1.
template <typename W>
inline void row_tile4(const float* a, Panel<W> panels, int64_t K, float* out) {
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0;
  const Panel<W> p0 = panels, p1 = panels.at(1, K), p2 = panels.at(2, K), p3 = panels.at(3, K);
  for (int64_t g0 = 0; g0 < K; g0 += panels.G) {
    __m256 s0l, s0h, s1l, s1h, s2l, s2h, s3l, s3h;
    p0.scales(g0, s0l, s0h);
    p1.scales(g0, s1l, s1h);
    p2.scales(g0, s2l, s2h);
    p3.scales(g0, s3l, s3h);
    for (int64_t k = g0, g1 = std::min(K, g0 + panels.G); k < g1; ++k) {
      const __m256 x = _mm256_broadcast_ss(a + k);
      __m256 wl, wh;
      p0.widen(k, s0l, s0h, wl, wh);
      l0 = _mm256_fmadd_ps(x, wl, l0);
      h0 = _mm256_fmadd_ps(x, wh, h0);
      p1.widen(k, s1l, s1h, wl, wh);
      l1 = _mm256_fmadd_ps(x, wl, l1);
      h1 = _mm256_fmadd_ps(x, wh, h1);
      p2.widen(k, s2l, s2h, wl, wh);
      l2 = _mm256_fmadd_ps(x, wl, l2);
      h2 = _mm256_fmadd_ps(x, wh, h2);
      p3.widen(k, s3l, s3h, wl, wh);
      l3 = _mm256_fmadd_ps(x, wl, l3);
      h3 = _mm256_fmadd_ps(x, wh, h3);
    }
  }
  _mm256_storeu_ps(out, l0);
  _mm256_storeu_ps(out + 8, h0);
  _mm256_storeu_ps(out + 16, l1);
  _mm256_storeu_ps(out + 24, h1);
  _mm256_storeu_ps(out + 32, l2);
  _mm256_storeu_ps(out + 40, h2);
  _mm256_storeu_ps(out + 48, l3);
  _mm256_storeu_ps(out + 56, h3);
}

// A finished sum's columns plus the bias (per output column, or none).
struct Epilogue {
  const float* bias;
  inline float operator()(const float* acc, int64_t col) const {
    return bias ? acc[0] + bias[col] : acc[0];
  }
};

template <typename T>
inline void store_row(const float* acc16, Epilogue ep, int64_t col0, int ncols, T* out);

template <>
inline void store_row<float>(const float* acc, Epilogue ep, int64_t col0, int ncols, float* out) {
  for (int j = 0; j < ncols; ++j) out[j] = ep(acc + j, col0 + j);
}

template <>
inline void store_row<at::BFloat16>(const float* acc, Epilogue ep, int64_t col0, int ncols,
                                    at::BFloat16* out) {
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  for (int j = 0; j < ncols; ++j) o[j] = ds::to_bf16(ep(acc + j, col0 + j));
}

template <int MR, typename W>
void run_tile(const float* a, int64_t K, Panel<W> panel, float* acc) {
  tile<MR, W>(a, K, panel, K, acc);
}

template <typename W>
struct Tiles {
  using Fn = void (*)(const float*, int64_t, Panel<W>, float*);
  static constexpr Fn at[7] = {nullptr, run_tile<1, W>, run_tile<2, W>, run_tile<3, W>,
                               run_tile<4, W>, run_tile<5, W>, run_tile<6, W>};
};

template <typename T, typename W>
void panel_rows(const float* x, int64_t row0, int64_t rows, int64_t K, Panel<W> panel,
                int64_t col0, int64_t N, Epilogue ep, T* out) {
  float acc[6 * 16];
  const int ncols = static_cast<int>(std::min<int64_t>(16, N - col0));
  // Rows spread evenly over ceil(rows / 6) tiles (8 rows: 4 + 4, not 6 + 2:
  // a 2-row tile has too few FMA chains to hide their latency).
  const int64_t num_tiles = (rows + 5) / 6;
  for (int64_t i = 0, r = row0; i < num_tiles; ++i) {
    const int mr = static_cast<int>((rows - (r - row0)) / (num_tiles - i) +
                                    ((rows - (r - row0)) % (num_tiles - i) != 0));
    Tiles<W>::at[mr](x + r * K, K, panel, acc);
    for (int j = 0; j < mr; ++j) store_row<T>(acc + j * 16, ep, col0, ncols, out + (r + j) * N + col0);
    r += mr;
  }
}

template <typename T, typename W>
void single_row(const float* x, int64_t K, Panel<W> w, int64_t NP, int64_t N, Epilogue ep,
                T* out) {
  constexpr int NPAN = 4;
  at::parallel_for(0, (NP + NPAN - 1) / NPAN, 1, [&](int64_t g0, int64_t g1) {
    float acc[NPAN * 16];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = g * NPAN;
      const int np = static_cast<int>(std::min<int64_t>(NPAN, NP - p0));
      if (np == NPAN) {
        row_tile4<W>(x, w.at(p0, K), K, acc);
      } else {
        for (int p = 0; p < np; ++p) tile<1, W>(x, K, w.at(p0 + p, K), K, acc + p * 16);
      }
      for (int p = 0; p < np; ++p) {
        const int64_t col0 = (p0 + p) * 16;
        const int ncols = static_cast<int>(std::min<int64_t>(16, N - col0));
        store_row<T>(acc + p * 16, ep, col0, ncols, out + col0);
      }
    }
  });
}

template <typename T, typename W>
void run(const float* xp, int64_t M, int64_t K, Panel<W> wp, int64_t NP, int64_t N, Epilogue ep,
         T* op) {
  if (M == 1) {
    single_row<T, W>(xp, K, wp, NP, N, ep, op);
    return;
  }
  const int64_t chunks = (M + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
  at::parallel_for(0, chunks * NP, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c = t / NP, p = t % NP;
      const int64_t row0 = c * ROWS_PER_CHUNK;
      const int64_t rows = std::min<int64_t>(ROWS_PER_CHUNK, M - row0);
      panel_rows<T, W>(xp, row0, rows, K, wp.at(p, K), p * 16, N, ep, op);
    }
  });
}

// x (M, K) bf16 or fp32 as fp32, its output (M, N) in x's dtype, the bias as fp32.
struct Operands {
  at::Tensor xf, bf, out;
  Operands(const at::Tensor& x, const c10::optional<at::Tensor>& bias, int64_t N) {
    TORCH_CHECK(x.dim() == 2, "x must be (M, K)");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
                "x must be bf16 or fp32");
    xf = x.to(at::kFloat).contiguous();
    if (bias.has_value() && bias->defined()) bf = bias->to(at::kFloat).contiguous();
    out = at::empty({x.size(0), N}, x.options());
  }
  const float* bias() const { return bf.defined() ? bf.data_ptr<float>() : nullptr; }
};

template <typename W>
void dispatch(const Operands& o, Panel<W> wp, int64_t NP, int64_t N, Epilogue ep) {
  const float* xp = o.xf.data_ptr<float>();
  const int64_t M = o.xf.size(0), K = o.xf.size(1);
  if (o.out.scalar_type() == at::kBFloat16)
    run<at::BFloat16, W>(xp, M, K, wp, NP, N, ep, o.out.data_ptr<at::BFloat16>());
  else
    run<float, W>(xp, M, K, wp, NP, N, ep, o.out.data_ptr<float>());
}

void check_packed(const at::Tensor& packed, at::ScalarType type, int64_t K, int64_t N) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.scalar_type() == type,
              "packed must be (NP, K, 16) ", type);
  const int64_t NP = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && NP * 16 >= N && NP * 16 < N + 16, "shape mismatch");
  TORCH_CHECK(packed.is_contiguous(), "packed must be contiguous");
}

}  // namespace

// x: (M, K) bf16 or fp32; packed: (NP, K, 16) bf16; bias: (N,) or empty -> (M, N), x's dtype.
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias, int64_t N) {
  Operands o(x, bias, N);
  check_packed(packed, at::kBFloat16, x.size(1), N);
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  dispatch<Bf16W>(o, Panel<Bf16W>{wp, nullptr, x.size(1)}, packed.size(0), N,
                  Epilogue{o.bias()});
  return o.out;
}

void linear_w8a8(const at::Tensor& xf, const at::Tensor& packed, const at::Tensor& scales,
                 const float* bias, at::Tensor& out);

// x as above; packed: (NP, K, 16) int8; scales: (NP, K / G, 16) fp32, laid out as the
// panels: w[16p + j, k] = packed[p, k, j] * scales[p, k / G, j]. Or packed for
// int8 activations: (NP, K / 4, 64) with scales (NP, K / G, 32), or int4:
// (NP, K / 4, 32) uint8 with scales (NP, K / G, 48) (csrc/linear_vnni.cpp).
at::Tensor linear_w8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias, int64_t N) {
  Operands o(x, bias, N);
  const int64_t K = x.size(1), NP = packed.size(0);
  const bool int4 = packed.dim() == 3 && packed.size(2) == 32 && packed.scalar_type() == at::kByte;
  if (int4 || (packed.dim() == 3 && packed.size(2) == 64)) {
    TORCH_CHECK((int4 || packed.scalar_type() == at::kChar) && packed.is_contiguous() &&
                packed.size(1) * 4 == K && NP * 16 >= N && NP * 16 < N + 16,
                "packed must be (NP, K / 4, 64) int8 or (NP, K / 4, 32) uint8 for ", N,
                " columns");
    TORCH_CHECK(scales.dim() == 3 && scales.size(0) == NP && scales.size(1) > 0 &&
                K % scales.size(1) == 0 && scales.scalar_type() == at::kFloat &&
                scales.is_contiguous(),
                "scales must be (NP, K / G, 32 or 48) fp32 with G dividing K");
    linear_w8a8(o.xf, packed, scales, o.bias(), o.out);
    return o.out;
  }
  check_packed(packed, at::kChar, K, N);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == NP && scales.size(2) == 16 &&
              scales.size(1) > 0 && K % scales.size(1) == 0 &&
              scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "scales must be (NP, K / G, 16) fp32 with G dividing K");
  dispatch<Int8W>(o, Panel<Int8W>{packed.data_ptr<int8_t>(), scales.data_ptr<float>(),
                                  K / scales.size(1)}, NP, N, Epilogue{o.bias()});
  return o.out;
}
