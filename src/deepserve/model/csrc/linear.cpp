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
// Work split: row chunks of ROWS_PER_CHUNK x all panels, flattened into one
// parallel range (chunk-major: a thread walks every panel of a chunk while
// that chunk of x sits in its cache); each task runs the panel over the
// chunk's rows in micro-tiles of MR rows x 16 columns, the accumulators in
// registers, the whole K in one pass.

#include <immintrin.h>
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

inline uint16_t to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

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
template <int MR>
inline void tile(const float* a, int64_t lda, const uint16_t* panel, int64_t K, float* out16) {
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0;
  __m256 l3 = l0, h3 = l0, l4 = l0, h4 = l0, l5 = l0, h5 = l0;
  for (int64_t k = 0; k < K; ++k) {
    __m256 wl, wh;
    widen16(panel + k * 16, wl, wh);
    DS_ROW(0) DS_ROW(1) DS_ROW(2) DS_ROW(3) DS_ROW(4) DS_ROW(5)
  }
  DS_STORE(0) DS_STORE(1) DS_STORE(2) DS_STORE(3) DS_STORE(4) DS_STORE(5)
}
#undef DS_ROW
#undef DS_STORE

// One row against 4 panels at once: 8 independent FMA chains for M = 1.
inline void row_tile4(const float* a, const uint16_t* panels, int64_t K, float* out) {
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0;
  const uint16_t *p0 = panels, *p1 = p0 + K * 16, *p2 = p1 + K * 16, *p3 = p2 + K * 16;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 x = _mm256_broadcast_ss(a + k);
    __m256 wl, wh;
    widen16(p0 + k * 16, wl, wh);
    l0 = _mm256_fmadd_ps(x, wl, l0);
    h0 = _mm256_fmadd_ps(x, wh, h0);
    widen16(p1 + k * 16, wl, wh);
    l1 = _mm256_fmadd_ps(x, wl, l1);
    h1 = _mm256_fmadd_ps(x, wh, h1);
    widen16(p2 + k * 16, wl, wh);
    l2 = _mm256_fmadd_ps(x, wl, l2);
    h2 = _mm256_fmadd_ps(x, wh, h2);
    widen16(p3 + k * 16, wl, wh);
    l3 = _mm256_fmadd_ps(x, wl, l3);
    h3 = _mm256_fmadd_ps(x, wh, h3);
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

template <typename T>
inline void store_row(const float* acc16, const float* bias16, int ncols, T* out);

template <>
inline void store_row<float>(const float* acc, const float* bias, int ncols, float* out) {
  for (int j = 0; j < ncols; ++j) out[j] = acc[j] + (bias ? bias[j] : 0.f);
}

template <>
inline void store_row<at::BFloat16>(const float* acc, const float* bias, int ncols,
                                    at::BFloat16* out) {
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  for (int j = 0; j < ncols; ++j) o[j] = to_bf16(acc[j] + (bias ? bias[j] : 0.f));
}

template <int MR>
void run_tile(const float* a, int64_t K, const uint16_t* panel, float* acc) {
  tile<MR>(a, K, panel, K, acc);
}

using TileFn = void (*)(const float*, int64_t, const uint16_t*, float*);
constexpr TileFn TILES[7] = {nullptr, run_tile<1>, run_tile<2>, run_tile<3>,
                             run_tile<4>, run_tile<5>, run_tile<6>};

template <typename T>
void panel_rows(const float* x, int64_t row0, int64_t rows, int64_t K, const uint16_t* panel,
                int64_t col0, int64_t N, const float* bias, T* out) {
  float acc[6 * 16];
  const int ncols = static_cast<int>(std::min<int64_t>(16, N - col0));
  // Rows spread evenly over ceil(rows / 6) tiles (8 rows: 4 + 4, not 6 + 2:
  // a 2-row tile has too few FMA chains to hide their latency).
  const int64_t num_tiles = (rows + 5) / 6;
  for (int64_t i = 0, r = row0; i < num_tiles; ++i) {
    const int mr = static_cast<int>((rows - (r - row0)) / (num_tiles - i) +
                                    ((rows - (r - row0)) % (num_tiles - i) != 0));
    TILES[mr](x + r * K, K, panel, acc);
    for (int j = 0; j < mr; ++j)
      store_row<T>(acc + j * 16, bias ? bias + col0 : nullptr, ncols, out + (r + j) * N + col0);
    r += mr;
  }
}

template <typename T>
void single_row(const float* x, int64_t K, const uint16_t* w, int64_t NP, int64_t N,
                const float* bias, T* out) {
  constexpr int NPAN = 4;
  at::parallel_for(0, (NP + NPAN - 1) / NPAN, 1, [&](int64_t g0, int64_t g1) {
    float acc[NPAN * 16];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = g * NPAN;
      const int np = static_cast<int>(std::min<int64_t>(NPAN, NP - p0));
      if (np == NPAN) {
        row_tile4(x, w + p0 * K * 16, K, acc);
      } else {
        for (int p = 0; p < np; ++p) tile<1>(x, K, w + (p0 + p) * K * 16, K, acc + p * 16);
      }
      for (int p = 0; p < np; ++p) {
        const int64_t col0 = (p0 + p) * 16;
        const int ncols = static_cast<int>(std::min<int64_t>(16, N - col0));
        store_row<T>(acc + p * 16, bias ? bias + col0 : nullptr, ncols, out + col0);
      }
    }
  });
}

template <typename T>
void run(const float* xp, int64_t M, int64_t K, const uint16_t* wp, int64_t NP, int64_t N,
         const float* bp, T* op) {
  if (M == 1) {
    single_row<T>(xp, K, wp, NP, N, bp, op);
    return;
  }
  const int64_t chunks = (M + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
  at::parallel_for(0, chunks * NP, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c = t / NP, p = t % NP;
      const int64_t row0 = c * ROWS_PER_CHUNK;
      const int64_t rows = std::min<int64_t>(ROWS_PER_CHUNK, M - row0);
      panel_rows<T>(xp, row0, rows, K, wp + p * K * 16, p * 16, N, bp, op);
    }
  });
}

}  // namespace

// x: (M, K) bf16 or fp32; packed: (NP, K, 16) bf16; bias: (N,) or empty -> (M, N), x's dtype.
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed,
                          const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2, "x must be (M, K)");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.scalar_type() == at::kBFloat16,
              "packed must be (NP, K, 16) bf16");
  const int64_t M = x.size(0), K = x.size(1), NP = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && NP * 16 >= N && NP * 16 < N + 16, "shape mismatch");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x must be bf16 or fp32");
  auto xf = x.to(at::kFloat).contiguous();  // (M, K) fp32
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) bf = bias->to(at::kFloat).contiguous();
  auto out = at::empty({M, N}, x.options());
  const float* xp = xf.data_ptr<float>();
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  if (x.scalar_type() == at::kBFloat16)
    run(xp, M, K, wp, NP, N, bp, out.data_ptr<at::BFloat16>());
  else
    run(xp, M, K, wp, NP, N, bp, out.data_ptr<float>());
  return out;
}
