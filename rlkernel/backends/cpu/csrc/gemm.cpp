// rlkernel strict CPU GEMM: C[M,N] = A[M,K] · B[K,N], one float32 FMA chain per output.
//
// ---- Contract (decides bits) ------------------------------------------------------------
//   acc = +0.0f;  for k = 0 .. K-1 ascending: acc = fmaf(A[m,k], B[k,n], acc);  C[m,n] = acc
// A, B: float32 / bfloat16 / float16, each independently, widened to float32 exactly. The
// only refinement: a NaN result is stored as the canonical quiet NaN 0x7FC00000 (which NaN
// an FMA returns depends on operand order inside the instruction, i.e. on the compiler and
// the ISA, so payloads are made deterministic). Signed zeros, infinities, subnormals: exactly
// the chain's result.
//
// Why the bits cannot depend on ISA, thread count, M or row position:
//   * SIMD runs across output columns N only (a lane = one output column); the K loop is
//     sequential inside each lane. Every FMA is written explicitly (_mm512_fmadd_ps,
//     _mm256_fmadd_ps, std::fma) and the build uses -ffp-contract=off. FMA is correctly
//     rounded, so an AVX-512 lane, an AVX2 lane and a scalar std::fma (glibc's exact
//     software fma on a CPU without FMA) give the same float.
//   * K is blocked for the caches (KC) only with a carried accumulator: a block's kernel
//     reloads C and continues the chain; the K order never changes.
//   * Threads (at::parallel_for) split M-row blocks and N-column blocks, never K.
//   * Row panels of any height (1..MRP) and column tiles of any width run the same per-output
//     chain; padded rows/columns are computed on zeros and never stored.
//   * No dot-product instructions (vdpbf16ps, AMX), no split accumulators, no tree sums.
//
// ---- ISA: chosen at compile time ---------------------------------------------------------
//   __AVX512F__            -> "avx512": row panels of 8, tiles of R rows x V*16 columns (zmm)
//   __AVX2__ && __FMA__    -> "avx2":   row panels of 6, tiles of R rows x V*16 columns (2 ymm / 16)
//   otherwise              -> "scalar": std::fma loops (x86-64-v2: glibc fma, exact)
// The contract assumes the default MXCSR (no flush-to-zero / denormals-are-zero).
//
// ---- Design ----------------------------------------------------------------------------------
// * A is packed per call into row panels of MRP rows, float32, k-major: Ap[panel][k][MRP]
//   (8x8 register transposes for unit-k-stride rows; any dtype, any strides).
// * B is packed into 16-column panels, k-major: float32 [N/16][K][16], or for bf16 weights
//   (pack_b) k-pair interleaved bf16 [N/16][K/2][16][2]: one 64-byte load gives B[k] (<< 16)
//   and B[k+1] (& 0xFFFF0000) for 16 columns, one integer op per vector per k.
//   rlkernel::matmul packs B per call in column chunks of <= 16 MiB (16x16 register transposes
//   for b = W.t()); matmul_packed uses a pack_b result.
// * Micro-kernel ukr<R, V>: R rows (1..MRP) x V 16-column panels, R*V vector accumulators
//   that live in registers for a whole K block; per k: V B-vector loads, R broadcasts of A
//   from the packed panel, R*V FMAs (each accumulator = one output lane = one chain).
//   AVX-512 main tile 8 x 48 (24 zmm accumulators); wider tiles for few rows (1 x 128,
//   2 x 96, ...) keep >= 8 independent chains in flight. C tails: masked loads/stores.
// * Blocking: M-blocks of 64 rows x N-blocks of <= 768 columns are the parallel tasks (task
//   count a multiple of the thread count); inside, K blocks of 256 (A micro-panel in L1, B
//   block in L2, accumulators carried through C). One row panel (M <= 8): no K blocking, each
//   B panel streams once. Two row panels (M <= 16): AVX-512 kernels of up to 16 rows (9 x 48,
//   14 x 32, 16 x 16) cover both in one pass over B; AVX2 runs both panels per column tile.
//   Kernels of >= 4 rows software-prefetch B 32 k-steps ahead (they stream few panels at once).
//   None of this changes a chain: blocking only decides when a chain is parked in C.
// * Tuning macros (RK_GEMM_KC, _MC_PANELS, _NC, _PF, _FUSE2, _KC_TWO, _KC_FUSE, _ST_TWO) change
//   speed only, never bits.
//
// ---- Torch ops (TORCH_LIBRARY_FRAGMENT(rlkernel)) ------------------------------------------
//   rlkernel::matmul(Tensor a, Tensor b) -> Tensor
//       a [M,K], b [K,N], any strides (transposed views fine), dtypes float32/bfloat16/float16;
//       returns float32 [M,N] contiguous. B is packed per call (in column chunks).
//   rlkernel::pack_b(Tensor b) -> Tensor
//       b [K,N] (any strides; for a linear layer pass weight.t()). Returns the packed form:
//       float32 [ceil(N/16), K, 16] for fp32/fp16 b, bfloat16 [ceil(N/16), ceil(K/2), 32]
//       (k-pairs interleaved) for bf16 b. Pure data movement. To get a float32 packing of
//       bf16 weights (faster at large M, twice the bytes) pass b.float() (exact widening).
//   rlkernel::matmul_packed(Tensor a, Tensor packed, int n) -> Tensor
//       a [M,K] any strides/dtype, packed from pack_b of a [K,n] b; float32 [M,n].
//   rlkernel::matmul_out(Tensor a, Tensor b, Tensor(a!) out, bool accumulate=False) -> Tensor(a!)
//       writes into out (float32 [M,N], unit column stride, any row stride). accumulate=True
//       continues each output's chain from out's value instead of +0.0f, so splitting K into
//       ascending pieces, matmul_out(a[:, :k1], b[:k1], out); matmul_out(a[:, k1:], b[k1:], out,
//       True), gives the same bits as one call.
//   rlkernel::matmul_isa() -> str            "avx512" | "avx2" | "scalar"
//   rlkernel::bmm(Tensor a, Tensor b) -> Tensor   [B, M, K] @ [B, K, N]: rlkernel::matmul per item, in order
//   rlkernel::matmul_naive(Tensor a, Tensor b) -> Tensor   scalar triple loop (debug / tests)
// Raw-pointer entry points for other kernels: gemm.h (rk_gemm::gemm, gemm_packed, pack_b,
// rk_gemm_f32), with an `accumulate` flag that continues the chain from C.
#include "gemm.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>

namespace rk_gemm {
namespace {

// ---- ISA configuration --------------------------------------------------------------------
#if defined(__AVX512F__)
#define RK_GEMM_AVX512 1
constexpr const char* kIsa = "avx512";
constexpr int MRP = 8;  // rows per packed A panel
constexpr int VMAX = 8;
// column panels (16 columns each) per tile for a panel of R rows: R*V accumulators
constexpr int RMAX = 16;  // a kernel may span two row panels (M <= 16: one pass over B)
constexpr int vmax(int R) {
  return R == 1 ? 8 : R == 2 ? 6 : R == 3 ? 5 : R <= 6 ? 4 : R <= 9 ? 3 : R <= 14 ? 2 : 1;
}
#elif defined(__AVX2__) && defined(__FMA__)
#define RK_GEMM_AVX2 1
constexpr const char* kIsa = "avx2";
constexpr int MRP = 6;
constexpr int VMAX = 4;
constexpr int RMAX = MRP;
constexpr int vmax(int R) { return R == 1 ? 4 : R <= 3 ? 2 : 1; }
#else
constexpr const char* kIsa = "scalar";
constexpr int MRP = 4;
constexpr int VMAX = 2;
constexpr int RMAX = MRP;
constexpr int vmax(int R) { return R == 1 ? 2 : 1; }
#endif

// Software prefetch distance (k steps) for B in the AVX-512 kernels of >= 4 rows: they stream
// only V <= 4 B panels at once, too few concurrent streams for the hardware prefetchers when B
// comes from memory (decode with large weights); wide few-row tiles stream 5..8 panels.
#ifndef RK_GEMM_PF
#define RK_GEMM_PF 32
#endif
constexpr int kLoadC = 1;  // continue the chain from C (else start at +0.0f)
constexpr int kFinal = 2;  // last K block: canonicalise NaN before the store
constexpr uint32_t kQNaN = 0x7FC00000u;

inline float bits_f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float canon(float x) { return (f_bits(x) & 0x7FFFFFFFu) > 0x7F800000u ? bits_f(kQNaN) : x; }

template <class T>
inline float to_f(T x) {
  return static_cast<float>(x);
}
template <>
inline float to_f<c10::BFloat16>(c10::BFloat16 x) {
  return bits_f(static_cast<uint32_t>(x.x) << 16);
}

inline int64_t esize(DType t) { return t == kF32 ? 4 : 2; }
inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

#define RK_DISPATCH(DT, T, ...)          \
  switch (DT) {                          \
    case kF32: {                         \
      using T = float;                   \
      __VA_ARGS__;                       \
      break;                             \
    }                                    \
    case kBF16: {                        \
      using T = c10::BFloat16;           \
      __VA_ARGS__;                       \
      break;                             \
    }                                    \
    default: {                           \
      using T = c10::Half;               \
      __VA_ARGS__;                       \
      break;                             \
    }                                    \
  }

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <class T>
std::unique_ptr<T[], FreeDeleter> aligned_buf(int64_t n) {
  size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T);
  bytes = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes);
  TORCH_CHECK(p != nullptr, "rlkernel gemm: out of memory (", bytes, " bytes)");
  return std::unique_ptr<T[], FreeDeleter>(static_cast<T*>(p));
}

inline void run_parallel(bool parallel, int64_t n, const std::function<void(int64_t, int64_t)>& f) {
  if (n <= 0) return;
  if (parallel && n > 1)
    at::parallel_for(0, n, 1, f);
  else
    f(0, n);
}

// ---- micro-kernels --------------------------------------------------------------------------
// ukr<R, V, BF>: C[0:R, 0:ncols] (row stride ldc) op= A-panel · B-tile over kc steps.
//   ap: packed A at this K block, ap[k*MRP + r] = A[row r, k0 + k]
//   bp: packed B at (first panel of the tile, k0). fp32: bp[v*ps + k*16 + j];
//       bf16 (BF): uint32 pairs, ((uint32*)bp)[v*ps + (k/2)*16 + j] holds (B[k0+k even], B[k0+k+1])
//       in (low, high) halves; k0 is even.
//   ncols in ((V-1)*16, V*16]; columns beyond ncols are computed on padding, not stored.
//   aps: offset from a panel to the next one; rows r >= MRP (AVX-512, R up to 2*MRP) read the next panel.
using KFn = void (*)(int64_t kc, const float* ap, int64_t aps, const void* bp, int64_t ps, float* c, int64_t ldc, int ncols,
                     int flags);

#if defined(RK_GEMM_AVX512)
template <int R, int V, bool BF>
void ukr(int64_t kc, const float* __restrict ap, int64_t aps, const void* __restrict bpv, int64_t ps, float* __restrict c,
         int64_t ldc, int ncols, int flags) {
  static_assert(R <= 2 * MRP, "R");
  constexpr bool kPrefetch = RK_GEMM_PF > 0 && R >= 4;
#define RK_A(r, k) (((r) < MRP ? ap + (r) : ap + aps + ((r) - MRP))[(k) * MRP])
  __m512 acc[R][V];
  __mmask16 mk[V];
#pragma GCC unroll 16
  for (int v = 0; v < V; ++v) {
    int rem = ncols - 16 * v;
    mk[v] = rem >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rem) - 1u);
  }
  if (flags & kLoadC) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_maskz_loadu_ps(mk[v], c + r * ldc + 16 * v);
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  if constexpr (!BF) {
    const float* bp = static_cast<const float*>(bpv);
    for (int64_t k = 0; k < kc; ++k) {
      if constexpr (kPrefetch) {
#pragma GCC unroll 16
        for (int v = 0; v < V; ++v) _mm_prefetch(reinterpret_cast<const char*>(bp + v * ps + (k + RK_GEMM_PF) * 16), _MM_HINT_T0);
      }
      __m512 b[V];
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v) b[v] = _mm512_loadu_ps(bp + v * ps + k * 16);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(RK_A(r, k));
#pragma GCC unroll 16
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(a, b[v], acc[r][v]);
      }
    }
  } else {
    const uint32_t* bp = static_cast<const uint32_t*>(bpv);
    const __m512i hmask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    int64_t k = 0;
    for (; k + 1 < kc; k += 2) {
      const uint32_t* q = bp + (k >> 1) * 16;
      if constexpr (kPrefetch) {
#pragma GCC unroll 16
        for (int v = 0; v < V; ++v) _mm_prefetch(reinterpret_cast<const char*>(q + v * ps + RK_GEMM_PF * 16), _MM_HINT_T0);
      }
      {
        __m512 b[V];
#pragma GCC unroll 16
        for (int v = 0; v < V; ++v) b[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(q + v * ps), 16));
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m512 a = _mm512_set1_ps(RK_A(r, k));
#pragma GCC unroll 16
          for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(a, b[v], acc[r][v]);
        }
      }
      {
        __m512 b[V];
#pragma GCC unroll 16
        for (int v = 0; v < V; ++v) b[v] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(q + v * ps), hmask));
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m512 a = _mm512_set1_ps(RK_A(r, k + 1));
#pragma GCC unroll 16
          for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(a, b[v], acc[r][v]);
        }
      }
    }
    if (k < kc) {  // odd tail: the low halves only
      const uint32_t* q = bp + (k >> 1) * 16;
      __m512 b[V];
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v) b[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(q + v * ps), 16));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(RK_A(r, k));
#pragma GCC unroll 16
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(a, b[v], acc[r][v]);
      }
    }
  }
  if (flags & kFinal) {
    const __m512 qn = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(kQNaN)));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int v = 0; v < V; ++v)
        acc[r][v] = _mm512_mask_mov_ps(acc[r][v], _mm512_cmp_ps_mask(acc[r][v], acc[r][v], _CMP_UNORD_Q), qn);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) {
      if (mk[v] == 0xFFFF)
        _mm512_storeu_ps(c + r * ldc + 16 * v, acc[r][v]);
      else
        _mm512_mask_storeu_ps(c + r * ldc + 16 * v, mk[v], acc[r][v]);
    }
}
#undef RK_A
#elif defined(RK_GEMM_AVX2)
template <int R, int V, bool BF>
void ukr(int64_t kc, const float* __restrict ap, int64_t aps, const void* __restrict bpv, int64_t ps, float* __restrict c,
         int64_t ldc, int ncols, int flags) {
  constexpr int W = 2 * V;  // ymm per row
  __m256 acc[R][W];
  const bool full = ncols == V * 16;
  alignas(32) float tmp[R][V * 16];
  if (flags & kLoadC) {
    if (full) {
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
        for (int w = 0; w < W; ++w) acc[r][w] = _mm256_loadu_ps(c + r * ldc + 8 * w);
    } else {
      for (int r = 0; r < R; ++r) {
        for (int j = 0; j < V * 16; ++j) tmp[r][j] = j < ncols ? c[r * ldc + j] : 0.0f;
#pragma GCC unroll 16
        for (int w = 0; w < W; ++w) acc[r][w] = _mm256_load_ps(&tmp[r][8 * w]);
      }
    }
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int w = 0; w < W; ++w) acc[r][w] = _mm256_setzero_ps();
  }
  if constexpr (!BF) {
    const float* bp = static_cast<const float*>(bpv);
    for (int64_t k = 0; k < kc; ++k) {
      __m256 b[W];
#pragma GCC unroll 16
      for (int w = 0; w < W; ++w) b[w] = _mm256_loadu_ps(bp + (w >> 1) * ps + k * 16 + 8 * (w & 1));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(ap + k * MRP + r);
#pragma GCC unroll 16
        for (int w = 0; w < W; ++w) acc[r][w] = _mm256_fmadd_ps(a, b[w], acc[r][w]);
      }
    }
  } else {
    const uint32_t* bp = static_cast<const uint32_t*>(bpv);
    const __m256i hmask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    int64_t k = 0;
    for (; k + 1 < kc; k += 2) {
      const uint32_t* q = bp + (k >> 1) * 16;
      {
        __m256 b[W];
#pragma GCC unroll 16
        for (int w = 0; w < W; ++w)
          b[w] = _mm256_castsi256_ps(
              _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (w >> 1) * ps + 8 * (w & 1))), 16));
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m256 a = _mm256_broadcast_ss(ap + k * MRP + r);
#pragma GCC unroll 16
          for (int w = 0; w < W; ++w) acc[r][w] = _mm256_fmadd_ps(a, b[w], acc[r][w]);
        }
      }
      {
        __m256 b[W];
#pragma GCC unroll 16
        for (int w = 0; w < W; ++w)
          b[w] = _mm256_castsi256_ps(
              _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (w >> 1) * ps + 8 * (w & 1))), hmask));
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m256 a = _mm256_broadcast_ss(ap + (k + 1) * MRP + r);
#pragma GCC unroll 16
          for (int w = 0; w < W; ++w) acc[r][w] = _mm256_fmadd_ps(a, b[w], acc[r][w]);
        }
      }
    }
    if (k < kc) {
      const uint32_t* q = bp + (k >> 1) * 16;
      __m256 b[W];
#pragma GCC unroll 16
      for (int w = 0; w < W; ++w)
        b[w] = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (w >> 1) * ps + 8 * (w & 1))), 16));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(ap + k * MRP + r);
#pragma GCC unroll 16
        for (int w = 0; w < W; ++w) acc[r][w] = _mm256_fmadd_ps(a, b[w], acc[r][w]);
      }
    }
  }
  if (flags & kFinal) {
    const __m256 qn = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(kQNaN)));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int w = 0; w < W; ++w) acc[r][w] = _mm256_blendv_ps(acc[r][w], qn, _mm256_cmp_ps(acc[r][w], acc[r][w], _CMP_UNORD_Q));
  }
  if (full) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int w = 0; w < W; ++w) _mm256_storeu_ps(c + r * ldc + 8 * w, acc[r][w]);
  } else {
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
      for (int w = 0; w < W; ++w) _mm256_store_ps(&tmp[r][8 * w], acc[r][w]);
      for (int j = 0; j < ncols; ++j) c[r * ldc + j] = tmp[r][j];
    }
  }
}
#else
template <int R, int V, bool BF>
void ukr(int64_t kc, const float* __restrict ap, int64_t aps, const void* __restrict bpv, int64_t ps, float* __restrict c,
         int64_t ldc, int ncols, int flags) {
  constexpr int NC = V * 16;
  float acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NC; ++j) acc[r][j] = (flags & kLoadC) && j < ncols ? c[r * ldc + j] : 0.0f;
  for (int64_t k = 0; k < kc; ++k) {
    float b[NC];
    if constexpr (BF) {
      const uint32_t* bp = static_cast<const uint32_t*>(bpv);
      for (int v = 0; v < V; ++v)
        for (int j = 0; j < 16; ++j) {
          uint32_t w = bp[v * ps + (k >> 1) * 16 + j];
          b[v * 16 + j] = bits_f((k & 1) ? (w & 0xFFFF0000u) : (w << 16));
        }
    } else {
      const float* bp = static_cast<const float*>(bpv);
      for (int v = 0; v < V; ++v)
        for (int j = 0; j < 16; ++j) b[v * 16 + j] = bp[v * ps + k * 16 + j];
    }
    for (int r = 0; r < R; ++r) {
      const float a = ap[k * MRP + r];
      for (int j = 0; j < NC; ++j) acc[r][j] = std::fma(a, b[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < ncols; ++j) c[r * ldc + j] = (flags & kFinal) ? canon(acc[r][j]) : acc[r][j];
}
#endif

// kernel table [R][V], R = 1..RMAX, V = 1..vmax(R)
template <bool BF, int R, int V>
constexpr KFn pick() {
  if constexpr (R >= 1 && V >= 1 && V <= vmax(R))
    return &ukr<R, V, BF>;
  else
    return nullptr;
}
template <bool BF, int R, int... Vs>
constexpr std::array<KFn, VMAX + 1> table_row(std::integer_sequence<int, Vs...>) {
  return {pick<BF, R, Vs>()...};
}
template <bool BF, int... Rs>
constexpr std::array<std::array<KFn, VMAX + 1>, RMAX + 1> make_table(std::integer_sequence<int, Rs...>) {
  return {table_row<BF, Rs>(std::make_integer_sequence<int, VMAX + 1>{})...};
}
constexpr auto kTabF32 = make_table<false>(std::make_integer_sequence<int, RMAX + 1>{});
constexpr auto kTabBF16 = make_table<true>(std::make_integer_sequence<int, RMAX + 1>{});

// ---- packing --------------------------------------------------------------------------------
#if defined(RK_GEMM_AVX512) || defined(RK_GEMM_AVX2)
#define RK_GEMM_SIMD_PACK 1
// 8 consecutive elements widened to float32 exactly.
template <class T>
inline __m256 load8(const T* p);
template <>
inline __m256 load8<float>(const float* p) {
  return _mm256_loadu_ps(p);
}
template <>
inline __m256 load8<c10::BFloat16>(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
template <>
inline __m256 load8<c10::Half>(const c10::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float t[8];
  for (int i = 0; i < 8; ++i) t[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(t);
#endif
}

// r[i][j] -> r[j][i]
inline void tr8x8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}
#endif

// A panel ip (rows ip*MRP .. +MRP) -> dst[k*MRP + r], rows beyond M zero.
template <class T>
void pack_a_panel(const T* a, int64_t sm, int64_t sk, int64_t M, int64_t K, int64_t ip, float* dst) {
  const int64_t m0 = ip * MRP;
  const int rows = static_cast<int>(std::min<int64_t>(MRP, M - m0));
  if (rows < MRP) std::memset(dst, 0, sizeof(float) * MRP * K);
  if (sk <= sm || sk == 1) {  // rows are (more) contiguous in k: read row by row
    int64_t k0 = 0;
#if defined(RK_GEMM_SIMD_PACK)
    if (sk == 1 && rows > 1) {  // 8 x 8 register transposes
#if defined(RK_GEMM_AVX2)
      const __m256i m6 = _mm256_setr_epi32(-1, -1, -1, -1, -1, -1, 0, 0);
#endif
      for (; k0 + 8 <= K; k0 += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) r[i] = i < rows ? load8(a + (m0 + i) * sm + k0) : _mm256_setzero_ps();
        tr8x8(r);
        for (int i = 0; i < 8; ++i) {
#if defined(RK_GEMM_AVX512)
          _mm256_storeu_ps(dst + (k0 + i) * MRP, r[i]);
#else
          _mm256_maskstore_ps(dst + (k0 + i) * MRP, m6, r[i]);
#endif
        }
      }
    }
#endif
    for (int r = 0; r < rows; ++r) {
      const T* src = a + (m0 + r) * sm;
      if (sk == 1)
        for (int64_t k = k0; k < K; ++k) dst[k * MRP + r] = to_f(src[k]);
      else
        for (int64_t k = k0; k < K; ++k) dst[k * MRP + r] = to_f(src[k * sk]);
    }
  } else {  // transposed A (e.g. g.t()): for each k the panel's rows are (more) contiguous
    for (int64_t k = 0; k < K; ++k) {
      const T* src = a + m0 * sm + k * sk;
      if (sm == 1)
        for (int r = 0; r < rows; ++r) dst[k * MRP + r] = to_f(src[r]);
      else
        for (int r = 0; r < rows; ++r) dst[k * MRP + r] = to_f(src[r * sm]);
    }
  }
}

#if defined(RK_GEMM_SIMD_PACK)
// B columns contiguous along k (b = W.t(), sk == 1), a full 16-column panel: 8 x 8 transposes.
template <class T>
void pack_b_panel_t8(const T* b, int64_t sn, int64_t K, int64_t p, float* dst) {
  const T* w = b + p * 16 * sn;
  int64_t k0 = 0;
  for (; k0 + 8 <= K; k0 += 8)
    for (int h = 0; h < 2; ++h) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = load8(w + (8 * h + i) * sn + k0);
      tr8x8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + (k0 + i) * 16 + 8 * h, r[i]);
    }
  for (; k0 < K; ++k0)
    for (int j = 0; j < 16; ++j) dst[k0 * 16 + j] = to_f(w[j * sn + k0]);
}
#endif

// B columns n0 + 16p .. +16 -> float panel dst[k*16 + j] (K x 16), columns beyond N zero.
template <class T>
void pack_b_f32_panel(const T* b, int64_t sk, int64_t sn, int64_t K, int64_t N, int64_t p, float* dst) {
  const int64_t n0 = p * 16;
  const int cols = static_cast<int>(std::min<int64_t>(16, N - n0));
  if (sn == 1 && cols == 16) {
    for (int64_t k = 0; k < K; ++k) {
      const T* src = b + k * sk + n0;
      float* d = dst + k * 16;
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) d[j] = to_f(src[j]);
    }
    return;
  }
  if (cols < 16) std::memset(dst, 0, sizeof(float) * 16 * K);
  if (sk < sn) {  // columns contiguous (b = W.t()): 16 x 16 blocks, read along k
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
      const int kk = static_cast<int>(std::min<int64_t>(16, K - k0));
      for (int j = 0; j < cols; ++j) {
        const T* src = b + (n0 + j) * sn + k0 * sk;
        float* d = dst + k0 * 16 + j;
        if (sk == 1)
          for (int t = 0; t < kk; ++t) d[t * 16] = to_f(src[t]);
        else
          for (int t = 0; t < kk; ++t) d[t * 16] = to_f(src[t * sk]);
      }
    }
  } else {
    for (int64_t k = 0; k < K; ++k)
      for (int j = 0; j < cols; ++j) dst[k * 16 + j] = to_f(b[k * sk + (n0 + j) * sn]);
  }
}

#if defined(RK_GEMM_AVX512)
// b = W.t() in float32 (sk == 1, sn = ldw): 16x16 register transposes.
void pack_b_f32_panel_t512(const float* b, int64_t sn, int64_t K, int64_t p, float* dst) {
  const float* w = b + p * 16 * sn;
  int64_t k0 = 0;
  for (; k0 + 16 <= K; k0 += 16) {
    __m512 r[16], t[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(w + j * sn + k0);
    // 16x16 transpose: unpack 32-bit, 64-bit, then 128-bit lane shuffles
    for (int j = 0; j < 16; j += 2) {
      t[j] = _mm512_unpacklo_ps(r[j], r[j + 1]);
      t[j + 1] = _mm512_unpackhi_ps(r[j], r[j + 1]);
    }
    for (int j = 0; j < 16; j += 4) {
      r[j] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[j]), _mm512_castps_pd(t[j + 2])));
      r[j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[j]), _mm512_castps_pd(t[j + 2])));
      r[j + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[j + 1]), _mm512_castps_pd(t[j + 3])));
      r[j + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[j + 1]), _mm512_castps_pd(t[j + 3])));
    }
    // r[4q + s] holds, in each 128-bit lane L, columns 4q..4q+3 of row k0 + 4L + s
    for (int q = 0; q < 4; q += 2)
      for (int s = 0; s < 4; ++s) {
        t[4 * q + s] = _mm512_shuffle_f32x4(r[4 * q + s], r[4 * q + 4 + s], 0x88);
        t[4 * q + 4 + s] = _mm512_shuffle_f32x4(r[4 * q + s], r[4 * q + 4 + s], 0xDD);
      }
    // t[0+s]: lanes (q0 L0, q0 L2, q1 L0, q1 L2), t[4+s]: (q0 L1, q0 L3, q1 L1, q1 L3); similarly t[8+s], t[12+s]
    for (int s = 0; s < 4; ++s) {
      const __m512 a0 = _mm512_shuffle_f32x4(t[s], t[8 + s], 0x88);       // L0: q0 q1 q2 q3
      const __m512 a2 = _mm512_shuffle_f32x4(t[s], t[8 + s], 0xDD);       // L2
      const __m512 a1 = _mm512_shuffle_f32x4(t[4 + s], t[12 + s], 0x88);  // L1
      const __m512 a3 = _mm512_shuffle_f32x4(t[4 + s], t[12 + s], 0xDD);  // L3
      _mm512_storeu_ps(dst + (k0 + 0 + s) * 16, a0);
      _mm512_storeu_ps(dst + (k0 + 4 + s) * 16, a1);
      _mm512_storeu_ps(dst + (k0 + 8 + s) * 16, a2);
      _mm512_storeu_ps(dst + (k0 + 12 + s) * 16, a3);
    }
  }
  for (; k0 < K; ++k0)
    for (int j = 0; j < 16; ++j) dst[k0 * 16 + j] = w[j * sn + k0];
}
#endif

void pack_b_f32_any(const void* b, DType bt, int64_t sk, int64_t sn, int64_t K, int64_t N, int64_t p, float* dst) {
#if defined(RK_GEMM_AVX512)
  if (bt == kF32 && sk == 1 && sn >= 1 && (p + 1) * 16 <= N) {
    pack_b_f32_panel_t512(static_cast<const float*>(b), sn, K, p, dst);
    return;
  }
#endif
#if defined(RK_GEMM_SIMD_PACK)
  if (sk == 1 && sn >= 1 && (p + 1) * 16 <= N) {
    RK_DISPATCH(bt, T, pack_b_panel_t8<T>(static_cast<const T*>(b), sn, K, p, dst));
    return;
  }
#endif
  RK_DISPATCH(bt, T, pack_b_f32_panel<T>(static_cast<const T*>(b), sk, sn, K, N, p, dst));
}

// bf16 B -> k-pair interleaved bf16 panel: dst[(k/2)*32 + j*2 + k%2], padding zero.
void pack_b_bf16_panel(const c10::BFloat16* b, int64_t sk, int64_t sn, int64_t K, int64_t N, int64_t p, uint16_t* dst) {
  const int64_t n0 = p * 16;
  const int cols = static_cast<int>(std::min<int64_t>(16, N - n0));
  const int64_t kp = cdiv(K, 2);
  if (cols < 16 || (K & 1)) std::memset(dst, 0, sizeof(uint16_t) * 32 * kp);
  if (sk < sn) {
    for (int j = 0; j < cols; ++j) {
      const c10::BFloat16* src = b + (n0 + j) * sn;
      for (int64_t k = 0; k < K; ++k) dst[(k >> 1) * 32 + j * 2 + (k & 1)] = src[k * sk].x;
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      const c10::BFloat16* src = b + k * sk + n0 * sn;
      for (int j = 0; j < cols; ++j) dst[(k >> 1) * 32 + j * 2 + (k & 1)] = src[j * sn].x;
    }
  }
}

// ---- blocked driver ---------------------------------------------------------------------------
struct PackedB {
  const void* p;  // panel 0, k 0
  bool bf;        // k-pair bf16 panels (uint32 units) or float panels
  int64_t ps;     // panel stride, in uint32 (bf) or float units
  const void* at(int64_t panel, int64_t k) const {
    return bf ? static_cast<const void*>(static_cast<const uint32_t*>(p) + panel * ps + (k >> 1) * 16)
              : static_cast<const void*>(static_cast<const float*>(p) + panel * ps + k * 16);
  }
};

#ifndef RK_GEMM_KC
#define RK_GEMM_KC 256
#endif
#ifndef RK_GEMM_MC_PANELS
#define RK_GEMM_MC_PANELS 8
#endif
#ifndef RK_GEMM_NC
#define RK_GEMM_NC 768
#endif
constexpr int64_t kKC = RK_GEMM_KC;         // K block (even: bf16 pairs never straddle blocks)
constexpr int64_t kMCPanels = RK_GEMM_MC_PANELS;     // row panels per M block at large M
constexpr int64_t kNCMax = RK_GEMM_NC;      // columns per N block at large M (KC x NC floats ~ L2/2)
constexpr int64_t kNCMaxSmall = 2048;
#ifndef RK_GEMM_KC_TWO
#define RK_GEMM_KC_TWO 2048
#endif
#ifndef RK_GEMM_FUSE2
#define RK_GEMM_FUSE2 1
#endif
#ifndef RK_GEMM_KC_FUSE
#define RK_GEMM_KC_FUSE (1 << 30)
#endif
#ifndef RK_GEMM_ST_TWO
#define RK_GEMM_ST_TWO 0
#endif
constexpr int64_t kKCTwo = RK_GEMM_KC_TWO;     // K block at two row panels (even)

// Ap: packed A, panels [ceil(M/MRP)][K][MRP]. Computes C[:, 0:N] (B columns 0..N-1).
void run_blocks(const float* Ap, int64_t M, int64_t K, const PackedB& B, int64_t N, float* C, int64_t ldc, bool accumulate,
                bool parallel) {
  if (M <= 0 || N <= 0) return;
  if (K == 0) {
    if (!accumulate)
      for (int64_t m = 0; m < M; ++m) std::fill(C + m * ldc, C + m * ldc + N, 0.0f);
    return;
  }
  const auto& tab = B.bf ? kTabBF16 : kTabF32;
  const int64_t npan = cdiv(M, MRP);
  // below about 260k multiply-adds (a decode GEMV of a small layer) waking the thread pool
  // costs more than it saves; scheduling only: every output is the same chain either way
  if (M * N * K < (int64_t{1} << 18)) parallel = false;
  const int64_t nth = parallel ? std::max<int>(1, at::get_num_threads()) : 1;
  int64_t mbp, nc;  // row panels per M block, columns per N block
  if (npan <= 2) {
    mbp = npan;
    int64_t nnb = nth * cdiv(N, nth * kNCMaxSmall);
    nc = cdiv(cdiv(N, nnb), 16) * 16;
  } else {
    mbp = std::min<int64_t>(kMCPanels, npan);
    int64_t nmb = cdiv(npan, mbp);
    int64_t nnb = cdiv(N, kNCMax);
    // at::parallel_for hands each thread one contiguous range of tasks: make the task count a
    // multiple of the thread count (or large), splitting N further when M blocks are few
    while (nmb * nnb % nth != 0 && nmb * nnb < 8 * nth && cdiv(N, nnb + 1) >= 48) ++nnb;
    nc = cdiv(cdiv(N, nnb), 16) * 16;
  }
  const int64_t nmb = cdiv(npan, mbp), nnb = cdiv(N, nc);
  // Few rows (decode): one row panel: no K blocking, so each B panel streams once,
  // contiguously; two row panels: both run on one column tile before the next (the second
  // re-reads it from L2), K blocks of kKCTwo bound that tile.
  // Many rows: K blocks of kKC (A micro-panel in L1, B block in L2), row panels outer.
  // Two row panels and kernels of up to 2*MRP rows (AVX-512): one pass over B with both.
  const bool fuse2 = RK_GEMM_FUSE2 && npan == 2 && RMAX >= 2 * MRP;
  const int64_t KC = npan == 1 ? K : fuse2 ? std::min<int64_t>(K, RK_GEMM_KC_FUSE) : npan == 2 ? std::min<int64_t>(K, kKCTwo) : kKC;
  const int64_t ST = (npan == 2 && !fuse2) ? (RK_GEMM_ST_TWO ? RK_GEMM_ST_TWO : 16 * vmax(MRP)) : nc;
  const int64_t step = fuse2 ? 2 : 1;
  run_parallel(parallel, nmb * nnb, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t jb = t / nmb, ib = t % nmb;
      const int64_t n0 = jb * nc, n1 = std::min(N, n0 + nc);
      const int64_t p0 = ib * mbp, p1 = std::min(npan, p0 + mbp);
      for (int64_t pc = 0; pc < K; pc += KC) {
        const int64_t kc = std::min(KC, K - pc);
        const int flags = ((accumulate || pc > 0) ? kLoadC : 0) | (pc + kc == K ? kFinal : 0);
        for (int64_t jq = n0; jq < n1; jq += ST) {
          const int64_t jq1 = std::min(n1, jq + ST);
          for (int64_t ip = p0; ip < p1; ip += step) {
            const int R = static_cast<int>(std::min<int64_t>(step * MRP, M - ip * MRP));
            const int64_t W = 16 * vmax(R);
            const float* ap = Ap + ip * MRP * K + pc * MRP;
            float* crow = C + ip * MRP * ldc;
            for (int64_t jn = jq; jn < jq1; jn += W) {
              const int ncols = static_cast<int>(std::min(W, jq1 - jn));
              tab[R][cdiv(ncols, 16)](kc, ap, MRP * K, B.at(jn / 16, pc), B.ps, crow + jn, ldc, ncols, flags);
            }
          }
        }
      }
    }
  });
}

std::unique_ptr<float[], FreeDeleter> pack_a(const void* a, DType at, int64_t sm, int64_t sk, int64_t M, int64_t K,
                                             bool parallel) {
  const int64_t npan = cdiv(M, MRP);
  auto Ap = aligned_buf<float>(npan * MRP * std::max<int64_t>(K, 1));
  float* ap = Ap.get();
  run_parallel(parallel && M * K >= (1 << 16), npan, [&](int64_t i0, int64_t i1) {
    for (int64_t ip = i0; ip < i1; ++ip)
      RK_DISPATCH(at, T, pack_a_panel<T>(static_cast<const T*>(a), sm, sk, M, K, ip, ap + ip * MRP * K));
  });
  return Ap;
}

constexpr int64_t kChunkBytes = 16 << 20;  // per-call B packing buffer (column chunks)

}  // namespace

const char* isa() { return kIsa; }

bool packed_is_bf16(DType b_dtype) { return b_dtype == kBF16; }

int64_t packed_b_elems(int64_t K, int64_t N, DType b_dtype) {
  return b_dtype == kBF16 ? cdiv(N, 16) * cdiv(K, 2) * 32 : cdiv(N, 16) * K * 16;
}

void pack_b(const void* b, DType bt, int64_t sk, int64_t sn, int64_t K, int64_t N, void* packed, bool parallel) {
  const int64_t np = cdiv(N, 16);
  if (bt == kBF16) {
    const int64_t pe = cdiv(K, 2) * 32;
    run_parallel(parallel && N * K >= (1 << 16), np, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        pack_b_bf16_panel(static_cast<const c10::BFloat16*>(b), sk, sn, K, N, p, static_cast<uint16_t*>(packed) + p * pe);
    });
  } else {
    run_parallel(parallel && N * K >= (1 << 16), np, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) pack_b_f32_any(b, bt, sk, sn, K, N, p, static_cast<float*>(packed) + p * K * 16);
    });
  }
}

void gemm_packed(const void* a, DType at, int64_t sm, int64_t sk, const void* packed, bool bf, float* c, int64_t ldc,
                 int64_t M, int64_t N, int64_t K, bool accumulate, bool parallel) {
  if (M <= 0 || N <= 0) return;
  auto Ap = pack_a(a, at, sm, sk, M, K, parallel);
  PackedB B{packed, bf, bf ? cdiv(K, 2) * 16 : K * 16};
  run_blocks(Ap.get(), M, K, B, N, c, ldc, accumulate, parallel);
}

void gemm(const void* a, DType at, int64_t sm, int64_t sk, const void* b, DType bt, int64_t bsk, int64_t bsn, float* c,
          int64_t ldc, int64_t M, int64_t N, int64_t K, bool accumulate, bool parallel) {
  if (M <= 0 || N <= 0) return;
  if (K == 0) {
    PackedB B{nullptr, false, 0};
    run_blocks(nullptr, M, K, B, N, c, ldc, accumulate, parallel);
    return;
  }
  auto Ap = pack_a(a, at, sm, sk, M, K, parallel);
  const int64_t chunk = std::max<int64_t>(16 * VMAX, kChunkBytes / (K * 4) / (16 * VMAX) * (16 * VMAX));
  const int64_t cw = std::min(chunk, cdiv(N, 16) * 16);
  auto Bp = aligned_buf<float>(cw * K);
  const char* bbase = static_cast<const char*>(b);
  for (int64_t n0 = 0; n0 < N; n0 += cw) {
    const int64_t ncw = std::min(cw, N - n0);
    const void* bsub = bbase + n0 * bsn * esize(bt);
    float* bp = Bp.get();
    run_parallel(parallel && ncw * K >= (1 << 15), cdiv(ncw, 16), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) pack_b_f32_any(bsub, bt, bsk, bsn, K, ncw, p, bp + p * K * 16);
    });
    PackedB B{bp, false, K * 16};
    run_blocks(Ap.get(), M, K, B, ncw, c + n0, ldc, accumulate, parallel);
  }
}

void gemm_naive(const void* a, DType at, int64_t sm, int64_t sk, const void* b, DType bt, int64_t bsk, int64_t bsn, float* c,
                int64_t ldc, int64_t M, int64_t N, int64_t K) {
  RK_DISPATCH(at, TA, {
    const TA* A = static_cast<const TA*>(a);
    RK_DISPATCH(bt, TB, {
      const TB* Bm = static_cast<const TB*>(b);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          float acc = 0.0f;
          for (int64_t k = 0; k < K; ++k) acc = std::fma(to_f(A[m * sm + k * sk]), to_f(Bm[k * bsk + n * bsn]), acc);
          c[m * ldc + n] = canon(acc);
        }
    });
  });
}

}  // namespace rk_gemm

// ---- torch ops ----------------------------------------------------------------------------------
namespace {

rk_gemm::DType dtype_of(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return rk_gemm::kF32;
    case at::kBFloat16:
      return rk_gemm::kBF16;
    case at::kHalf:
      return rk_gemm::kF16;
    default:
      TORCH_CHECK(false, "rlkernel gemm: ", what, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return rk_gemm::kF32;  // unreachable
}

void check_2d(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "rlkernel gemm: ", what, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2, "rlkernel gemm: ", what, " must be 2-D, got ", t.dim(), "-D");
}

at::Tensor op_matmul(const at::Tensor& a, const at::Tensor& b) {
  check_2d(a, "a");
  check_2d(b, "b");
  TORCH_CHECK(a.size(1) == b.size(0), "rlkernel::matmul: a is ", a.sizes(), ", b is ", b.sizes());
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  at::Tensor out = at::empty({M, N}, a.options().dtype(at::kFloat));
  rk_gemm::gemm(a.data_ptr(), dtype_of(a, "a"), a.stride(0), a.stride(1), b.data_ptr(), dtype_of(b, "b"), b.stride(0),
                b.stride(1), out.data_ptr<float>(), N, M, N, K, false, true);
  return out;
}

at::Tensor op_matmul_naive(const at::Tensor& a, const at::Tensor& b) {
  check_2d(a, "a");
  check_2d(b, "b");
  TORCH_CHECK(a.size(1) == b.size(0), "rlkernel::matmul_naive: a is ", a.sizes(), ", b is ", b.sizes());
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  at::Tensor out = at::empty({M, N}, a.options().dtype(at::kFloat));
  rk_gemm::gemm_naive(a.data_ptr(), dtype_of(a, "a"), a.stride(0), a.stride(1), b.data_ptr(), dtype_of(b, "b"), b.stride(0),
                      b.stride(1), out.data_ptr<float>(), N, M, N, K);
  return out;
}

at::Tensor op_pack_b(const at::Tensor& b) {
  check_2d(b, "b");
  const int64_t K = b.size(0), N = b.size(1);
  const rk_gemm::DType bt = dtype_of(b, "b");
  const int64_t np = (N + 15) / 16;
  at::Tensor out = bt == rk_gemm::kBF16 ? at::empty({np, (K + 1) / 2, 32}, b.options().dtype(at::kBFloat16))
                                        : at::empty({np, K, 16}, b.options().dtype(at::kFloat));
  rk_gemm::pack_b(b.data_ptr(), bt, b.stride(0), b.stride(1), K, N, out.data_ptr(), true);
  return out;
}

at::Tensor op_matmul_packed(const at::Tensor& a, const at::Tensor& packed, int64_t n) {
  check_2d(a, "a");
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 3 && packed.is_contiguous(),
              "rlkernel::matmul_packed: packed must be a contiguous 3-D CPU tensor from rlkernel::pack_b");
  const int64_t M = a.size(0), K = a.size(1);
  const bool bf = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf || packed.scalar_type() == at::kFloat, "rlkernel::matmul_packed: packed must be float32 or bfloat16");
  TORCH_CHECK(n >= 0 && packed.size(0) == (n + 15) / 16 && packed.size(1) == (bf ? (K + 1) / 2 : K) &&
                  packed.size(2) == (bf ? 32 : 16),
              "rlkernel::matmul_packed: packed ", packed.sizes(), " does not hold a [", K, ", ", n, "] B");
  at::Tensor out = at::empty({M, n}, a.options().dtype(at::kFloat));
  rk_gemm::gemm_packed(a.data_ptr(), dtype_of(a, "a"), a.stride(0), a.stride(1), packed.data_ptr(), bf, out.data_ptr<float>(),
                       n, M, n, K, false, true);
  return out;
}

at::Tensor& op_matmul_out(const at::Tensor& a, const at::Tensor& b, at::Tensor& out, bool accumulate) {
  check_2d(a, "a");
  check_2d(b, "b");
  check_2d(out, "out");
  TORCH_CHECK(a.size(1) == b.size(0), "rlkernel::matmul_out: a is ", a.sizes(), ", b is ", b.sizes());
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.size(0) == M && out.size(1) == N && (out.stride(1) == 1 || N <= 1) &&
                  (out.stride(0) >= N || M <= 1),
              "rlkernel::matmul_out: out must be float32 [", M, ", ", N, "] with unit column stride, got ", out.sizes(),
              " strides ", out.strides());
  rk_gemm::gemm(a.data_ptr(), dtype_of(a, "a"), a.stride(0), a.stride(1), b.data_ptr(), dtype_of(b, "b"), b.stride(0),
                b.stride(1), out.data_ptr<float>(), out.stride(0), M, N, K, accumulate, true);
  return out;
}

// a [B, M, K] @ b [B, K, N] -> float32 [B, M, N]: one op_matmul per batch item, in order (the same call, strides and
// bits as B separate rlkernel::matmul calls; only the per-item dispatch from Python is saved)
at::Tensor op_bmm(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), "rlkernel::bmm: a and b must be CPU tensors");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == b.size(1), "rlkernel::bmm: a is ",
              a.sizes(), ", b is ", b.sizes());
  const int64_t B = a.size(0), M = a.size(1), K = a.size(2), N = b.size(2);
  at::Tensor out = at::empty({B, M, N}, a.options().dtype(at::kFloat));
  const rk_gemm::DType at_ = dtype_of(a, "a"), bt = dtype_of(b, "b");
  const int64_t ea = a.element_size(), eb = b.element_size();
  for (int64_t i = 0; i < B; ++i) {
    const char* ap = static_cast<const char*>(a.data_ptr()) + i * a.stride(0) * ea;
    const char* bp = static_cast<const char*>(b.data_ptr()) + i * b.stride(0) * eb;
    rk_gemm::gemm(ap, at_, a.stride(1), a.stride(2), bp, bt, b.stride(1), b.stride(2), out.data_ptr<float>() + i * M * N, N, M, N, K,
                  false, true);
  }
  return out;
}

std::string op_matmul_isa() { return rk_gemm::isa(); }

}  // namespace

// The op namespace is `rlkernel`; a standalone build of this file (tests/test_cpu_gemm.py,
// scripts/bench_gemm.py) passes -DRK_GEMM_OPS_NAMESPACE=rlkernel_gemm_standalone so it can share
// a process with the project library (which links this file) without duplicate registrations.
#ifndef RK_GEMM_OPS_NAMESPACE
#define RK_GEMM_OPS_NAMESPACE rlkernel
#endif
TORCH_LIBRARY_FRAGMENT(RK_GEMM_OPS_NAMESPACE, m) {
  m.def("matmul(Tensor a, Tensor b) -> Tensor", &op_matmul);
  m.def("matmul_naive(Tensor a, Tensor b) -> Tensor", &op_matmul_naive);
  m.def("pack_b(Tensor b) -> Tensor", &op_pack_b);
  m.def("matmul_packed(Tensor a, Tensor packed, int n) -> Tensor", &op_matmul_packed);
  m.def("matmul_out(Tensor a, Tensor b, Tensor(a!) out, bool accumulate=False) -> Tensor(a!)", &op_matmul_out);
  m.def("matmul_isa() -> str", &op_matmul_isa);
  m.def("bmm(Tensor a, Tensor b) -> Tensor", &op_bmm);
}
