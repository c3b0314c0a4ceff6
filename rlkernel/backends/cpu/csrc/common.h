// rlkernel CPU kernels: shared primitives (rlkernel/contracts/primitives.py, as C++).
//
// Every kernel of this library computes *exactly* what the torch composition of the strict
// contracts (rlkernel/backends/reference) computes, bit for bit: the same IEEE-754 operations
// (each correctly rounded), in the same order, with the same roundings to the storage dtype.
// The build uses -ffp-contract=off, so the compiler never fuses a multiply and an add that
// the contract keeps apart; fmaf() is written out exactly where the contract says fma (the
// GEMM K chains). Loops vectorise only across independent outputs, never across a reduction,
// so the vector width (SSE, AVX2, AVX-512) cannot change a value, and threads split outputs,
// never a reduction, so the thread count cannot either. tests/test_cpu_kernels.py checks every
// kernel against the composition with torch.equal; the golden suite checks both on every machine.
//
// The constants below are copies of rlkernel/contracts/; `rlkernel::constants` returns them
// and the loader refuses the library if they differ.
//
// Signed zeros are not part of the contract (-0.0 == +0.0 under torch.equal).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace rk {
constexpr float kLog2e = static_cast<float>(1.4426950408889634);
constexpr float kLn2Hi = static_cast<float>(0.693145751953125);
constexpr float kLn2Lo = static_cast<float>(1.428606765330187e-06);
constexpr float kExpMin = static_cast<float>(-87.33);
constexpr float kExpMax = static_cast<float>(88.72);
constexpr float kC[8] = {1.0f, 1.0f, static_cast<float>(1.0 / 2), static_cast<float>(1.0 / 6), static_cast<float>(1.0 / 24),
                         static_cast<float>(1.0 / 120), static_cast<float>(1.0 / 720), static_cast<float>(1.0 / 5040)};
constexpr float kInf = std::numeric_limits<float>::infinity();

static inline float pow2i(float n) {
  int32_t bits = (static_cast<int32_t>(n) + 127) * (1 << 23);
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// strict_exp: clamp, n = round(r*log2e), Cody-Waite reduction, degree-7 Horner, two 2^k factors.
static inline float sexp(float x) {
  float r = x < kExpMin ? kExpMin : (x > kExpMax ? kExpMax : x);
  float n = std::nearbyint(r * kLog2e);
  float t = n * kLn2Hi;
  r = r - t;
  r = r - n * kLn2Lo;
  float p = r * kC[7] + kC[6];
  for (int i = 5; i >= 0; --i) p = p * r + kC[i];
  float n1 = std::floor(n * 0.5f);
  p = p * pow2i(n1);
  p = p * pow2i(n - n1);
  if (x < kExpMin) p = 0.0f;
  if (x > kExpMax) p = kInf;
  return std::isnan(x) ? x : p;
}

constexpr float kSqrtHalf2 = static_cast<float>(2 * 0.70710678118654757);  // 2 * sqrt(0.5) as torch rounds it

// strict_log: exponent split, m in [sqrt(1/2), sqrt(2)), 2*atanh series.
static inline float slog(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  int32_t e = (bits >> 23) - 127;
  float m = x * pow2i(static_cast<float>(-e));
  bool big = m > kSqrtHalf2;
  if (big) {
    m = m * 0.5f;
    e = e + 1;
  }
  float ef = static_cast<float>(e);
  float f = m - 1.0f;
  float s = f / (f + 2.0f);
  float s2 = s * s;
  float q = static_cast<float>(2.0 / 11);
  const float ks[4] = {static_cast<float>(2.0 / 9), static_cast<float>(2.0 / 7), static_cast<float>(2.0 / 5), static_cast<float>(2.0 / 3)};
  for (float k : ks) q = q * s2 + k;
  q = q * s2 + 2.0f;
  float logm = q * s;
  float y = ef * kLn2Hi + (logm + ef * kLn2Lo);
  if (x == 0.0f) y = -kInf;
  if (x < 0.0f) y = std::numeric_limits<float>::quiet_NaN();
  if (std::isinf(x) && x > 0.0f) y = x;
  return y;
}

// tree_sum over n values: zero-pad to a power of two, add adjacent pairs until one is left.
// `buf` has room for the padded length; its contents are destroyed.
static inline float tree_sum_inplace(float* buf, int64_t n) {
  if (n == 0) return 0.0f;
  int64_t p = 1;
  while (p < n) p <<= 1;
  for (int64_t i = n; i < p; ++i) buf[i] = 0.0f;
  for (int64_t len = p; len > 1; len >>= 1)
    for (int64_t i = 0; i < len / 2; ++i) buf[i] = buf[2 * i] + buf[2 * i + 1];
  return buf[0];
}

static inline int64_t pow2_ceil(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

template <typename T>
static inline float widen(T v) { return static_cast<float>(v); }

// Round a float to storage type T and back (torch's casts round to nearest even).
template <typename T>
static inline T narrow(float v) { return static_cast<T>(v); }

#define RK_DISPATCH(TYPE, NAME, ...) AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

// exp over a span: the loop GCC vectorises reliably (lanes are independent elements).
static inline void exp_span(const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = sexp(x[i]);
}

constexpr int64_t kChunk = 32;      // contracts/attention.py ATTN_CHUNK
constexpr int64_t kVocabTile = 512;  // contracts/logprob.py VOCAB_TILE

}  // namespace rk
