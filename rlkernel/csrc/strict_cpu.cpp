// rlkernel fused CPU kernels: the reference contracts, fewer passes, same bits.
//
// Every kernel here computes *exactly* what the torch composition of the reference backend
// (rlkernel/primitives.py, rlkernel/ops/*.py) computes, bit for bit: the same IEEE-754
// operations (each correctly rounded), in the same order, with the same roundings to the
// storage dtype. The build uses -ffp-contract=off, so the compiler never fuses a multiply
// and an add that the reference keeps apart; fmaf() is written out only where the
// reference's BLAS tile GEMM performs a fused multiply-add (see `dot_rows` below). The
// tile GEMMs of linear and linear-logprob are the reference's own at::bmm calls on the same
// operand shapes and strides. tests/test_fused_cpu.py checks every kernel against the torch
// composition with torch.equal; the loader (rlkernel/fused.py) re-checks on first use and
// turns the fused path off, with a warning, on a machine where a check fails.
//
// Signed zeros are not part of the contract (-0.0 == +0.0 under torch.equal).
#include <ATen/ATen.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace rk {

// ---- primitives (rlkernel/primitives.py) -------------------------------------------------
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

// ---- element-wise ops ------------------------------------------------------------------------
// fn over a float32 tensor. Pointers are copied into the lambda (not captured by reference): a
// store through a by-reference capture may alias the capture itself, which keeps GCC from
// vectorising.
template <float (*fn)(float)>
static at::Tensor map_f32(const at::Tensor& x_in, const char* name) {
  TORCH_CHECK_VALUE(x_in.scalar_type() == at::kFloat, name, " wants float32");
  auto x = x_in.contiguous();
  auto out = at::empty_like(x);
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, x.numel(), 1 << 14, [src, dst](int64_t b, int64_t e) {
    const float* __restrict s = src;
    float* __restrict d = dst;
    for (int64_t i = b; i < e; ++i) d[i] = fn(s[i]);
  });
  return out;
}

at::Tensor exp_f32(const at::Tensor& x) { return map_f32<sexp>(x, "rlkernel::exp"); }
at::Tensor log_f32(const at::Tensor& x) { return map_f32<slog>(x, "rlkernel::log"); }

// swiglu: (g / (exp(-g) + 1)) * u in fp32, one rounding to gate's dtype.
static void exp_span(const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = sexp(x[i]);
}

// In blocks through a float buffer: the exp loop alone is what GCC vectorises reliably.
template <typename T>
static void swiglu_span(const T* __restrict g, const float* __restrict u, T* __restrict o, int64_t n) {
  constexpr int64_t kBlock = 512;
  float xs[kBlock], e[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = std::min(kBlock, n - b);
    for (int64_t i = 0; i < m; ++i) xs[i] = -widen(g[b + i]);
    exp_span(xs, e, m);
    for (int64_t i = 0; i < m; ++i) {
      float d = e[i] + 1.0f;
      o[b + i] = narrow<T>((-xs[i] / d) * u[b + i]);
    }
  }
}

at::Tensor swiglu(const at::Tensor& gate_in, const at::Tensor& up_in) {
  TORCH_CHECK_VALUE(gate_in.sizes() == up_in.sizes(), "rlkernel::swiglu: gate and up differ in shape");
  auto gate = gate_in.contiguous();
  auto up = up_in.to(at::kFloat).contiguous();
  auto out = at::empty_like(gate);
  const float* u = up.data_ptr<float>();
  RK_DISPATCH(gate.scalar_type(), "rk_swiglu", [&] {
    const scalar_t* g = gate.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, gate.numel(), 1 << 14, [g, o, u](int64_t b, int64_t e) { swiglu_span<scalar_t>(g + b, u + b, o + b, e - b); });
  });
  return out;
}

// rms_norm (HF placement): h = x (+ residual) in x's dtype; rstd = 1/sqrt(tree(h*h)/H + eps);
// y = cast_x(h * rstd), then cast to the weight's dtype and multiplied there. Returns (y, h).
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps,
                                            const c10::optional<at::Tensor>& residual_in) {
  const int64_t H = x_in.size(-1);
  TORCH_CHECK_VALUE(weight_in.numel() == H, "rlkernel::rms_norm: weight does not match the hidden size");
  auto x = x_in.contiguous();
  at::Tensor h = x;
  if (residual_in.has_value()) {
    TORCH_CHECK_VALUE(residual_in->sizes() == x.sizes() && residual_in->scalar_type() == x.scalar_type(), "rlkernel::rms_norm: residual differs from x");
    h = at::empty_like(x);
  }
  auto weight = weight_in.contiguous();
  auto y = at::empty(x.sizes(), x.options().dtype(weight.scalar_type()));
  const int64_t rows = H ? x.numel() / H : 0;
  const float fH = static_cast<float>(H);
  const float feps = static_cast<float>(eps);
  const int64_t P = pow2_ceil(H);
  at::Tensor res = residual_in.has_value() ? residual_in->contiguous() : x;
  RK_DISPATCH(x.scalar_type(), "rk_rms_norm_x", [&] {
    using xt = scalar_t;
    const xt* xp = x.data_ptr<xt>();
    const xt* rp = res.data_ptr<xt>();
    xt* hp = h.data_ptr<xt>();
    const bool add = residual_in.has_value();
    RK_DISPATCH(weight.scalar_type(), "rk_rms_norm_w", [&] {
      using wt = scalar_t;
      const wt* wp = weight.data_ptr<wt>();
      wt* yp = y.data_ptr<wt>();
      at::parallel_for(0, rows, 16, [=](int64_t b, int64_t e) {
        std::vector<float> hfv(H), bufv(P);
        float* __restrict hf = hfv.data();
        float* __restrict buf = bufv.data();
        for (int64_t r = b; r < e; ++r) {
          const xt* __restrict xr = xp + r * H;
          const xt* __restrict rr = rp + r * H;
          xt* __restrict hr = hp + r * H;
          wt* __restrict yr = yp + r * H;
          for (int64_t i = 0; i < H; ++i) {
            xt hv = add ? narrow<xt>(widen(xr[i]) + widen(rr[i])) : xr[i];
            if (add) hr[i] = hv;
            hf[i] = widen(hv);
            buf[i] = hf[i] * hf[i];
          }
          float ms = tree_sum_inplace(buf, H) / fH;
          float rstd = 1.0f / std::sqrt(ms + feps);
          for (int64_t i = 0; i < H; ++i) {
            float yv = widen(narrow<wt>(widen(narrow<xt>(hf[i] * rstd))));
            yr[i] = narrow<wt>(yv * widen(wp[i]));
          }
        }
      });
    });
  });
  return {y, h};
}

// rope (rotate_half): out = [x1*c - x2*s, x2*c + x1*s] in fp32, one cast to x's dtype.
at::Tensor rope(const at::Tensor& x_in, const at::Tensor& positions_in, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK_VALUE(x_in.dim() == 3, "rlkernel::rope wants x [T, heads, d]");
  auto x = x_in.contiguous();
  auto pos = positions_in.to(at::kLong).contiguous();
  auto cs = cos_in.contiguous();
  auto sn = sin_in.contiguous();
  const int64_t T = x.size(0), Hh = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK_VALUE(cs.size(1) == half, "rlkernel::rope: table width does not match head_dim/2");
  auto out = at::empty_like(x);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* cp = cs.data_ptr<float>();
  const float* sp = sn.data_ptr<float>();
  const int64_t npos = cs.size(0);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK_VALUE(pp[t] >= 0 && pp[t] < npos, "rlkernel::rope: position outside the table");
  RK_DISPATCH(x.scalar_type(), "rk_rope", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 8, [=](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float* __restrict c = cp + pp[t] * half;
        const float* __restrict s = sp + pp[t] * half;
        for (int64_t hh = 0; hh < Hh; ++hh) {
          const scalar_t* __restrict xr = xp + (t * Hh + hh) * d;
          scalar_t* __restrict orow = op + (t * Hh + hh) * d;
          for (int64_t i = 0; i < half; ++i) {
            float x1 = widen(xr[i]), x2 = widen(xr[i + half]);
            float a = x1 * c[i];
            float bb = x2 * s[i];
            float cc = x2 * c[i];
            float dd = x1 * s[i];
            orow[i] = narrow<scalar_t>(a - bb);
            orow[i + half] = narrow<scalar_t>(cc + dd);
          }
        }
      }
    });
  });
  return out;
}

// ---- attention ----------------------------------------------------------------------------------
// The reference (ops/attention.py `_attend`) per query and chunk of ATTN_CHUNK keys anchored at
// absolute positions: s = (q . k) * scale as one fp32 tile GEMM row, masked past the query's
// position; m' = max(m, max s); alpha = exp(m - m'); p = exp(s - m'); l = l*alpha + tree(p);
// o = o*alpha + p . V as one fp32 tile GEMM row; out = o / l. The tile GEMMs here are the BLAS
// kernel's own order for K <= 192 (one fused multiply-add per term, k ascending, from 0):
// the loader checks that this machine's BLAS agrees before it enables the kernel.

struct KeySource {
  // paged: key j of request b lives in block block_table[b][j / bs] at offset j % bs.
  // flat:  key j of request b is row key_start[b] + j.
  const char* k;
  const char* v;
  int64_t s_block, s_off, s_head;  // element strides (k and v share them)
  int64_t bs;                      // block size (paged), or 0 for flat
  const int64_t* table;            // [B, max_blocks] (paged)
  int64_t table_stride;
  const int64_t* key_start;  // [B] (flat)

  inline int64_t offset(int64_t b, int64_t j, int64_t h) const {
    if (bs) return table[b * table_stride + j / bs] * s_block + (j % bs) * s_off + h * s_head;
    return (key_start[b] + j) * s_off + h * s_head;
  }
};

constexpr int64_t kChunk = 32;

// One query row against one chunk: scores, online-softmax update of (m, l, o). Kept out of the
// parallel lambda with restrict pointers so GCC vectorises the j and d loops.
static void chunk_update(const float* __restrict qr, const float* __restrict kt, const float* __restrict vc, int64_t D,
                         int64_t visible, float scale, float* __restrict state_ml, float* __restrict orow, float* __restrict s,
                         float* __restrict p, float* __restrict tbuf, float* __restrict pv) {
  // scores: s[j] = fma chain over d (the BLAS tile order), then * scale; masked keys -inf
  for (int64_t j = 0; j < kChunk; ++j) s[j] = 0.0f;
  for (int64_t d = 0; d < D; ++d) {
    const float qd = qr[d];
    const float* __restrict kr = kt + d * kChunk;
    for (int64_t j = 0; j < kChunk; ++j) s[j] = std::fma(qd, kr[j], s[j]);
  }
  float cmax = -kInf;
  for (int64_t j = 0; j < kChunk; ++j) {
    s[j] = j < visible ? s[j] * scale : -kInf;
    cmax = s[j] > cmax ? s[j] : cmax;
  }
  const float m_old = state_ml[0];
  const float m_new = m_old > cmax ? m_old : cmax;
  const float alpha = sexp(m_old - m_new);
  for (int64_t j = 0; j < kChunk; ++j) tbuf[j] = s[j] - m_new;
  exp_span(tbuf, p, kChunk);
  for (int64_t j = 0; j < kChunk; ++j) tbuf[j] = p[j];
  state_ml[1] = state_ml[1] * alpha + tree_sum_inplace(tbuf, kChunk);
  for (int64_t d = 0; d < D; ++d) pv[d] = 0.0f;
  for (int64_t j = 0; j < kChunk; ++j) {
    const float pj = p[j];
    const float* __restrict vr = vc + j * D;
    for (int64_t d = 0; d < D; ++d) pv[d] = std::fma(pj, vr[d], pv[d]);
  }
  for (int64_t d = 0; d < D; ++d) orow[d] = orow[d] * alpha + pv[d];
  state_ml[0] = m_new;
}

// dst[c][r] = src[r][c] for an 8 x 8 block (pure data movement: no value changes).
static inline void transpose8(const float* __restrict src, int64_t lds, float* __restrict dst, int64_t ldd) {
#if defined(__AVX2__)
  __m256 r[8], t[8], s[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3 (h = 0) and 4-7 (h = 1)
    s[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(s[i], s[4 + i], 0x20));
    _mm256_storeu_ps(dst + (4 + i) * ldd, _mm256_permute2f128_ps(s[i], s[4 + i], 0x31));
  }
#else
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) dst[j * ldd + i] = src[i * lds + j];
#endif
}

// Gather one chunk of keys as fp32: kt [D][32] (transposed) and vc [32][D]; zeros past the keys.
// Rows are widened into kbuf [32][D] first, then transposed in 8 x 8 blocks.
template <typename kv_t>
static void gather_chunk(const kv_t* __restrict K, const kv_t* __restrict V, const KeySource& src, int64_t b, int64_t hk, int64_t lo,
                         int64_t key_len, int64_t D, float* __restrict kt, float* __restrict vc, float* __restrict kbuf) {
  for (int64_t j = 0; j < kChunk; ++j) {
    const int64_t key = lo + j;
    float* __restrict vr = vc + j * D;
    float* __restrict kr = kbuf + j * D;
    if (key < key_len) {
      const int64_t off = src.offset(b, key, hk);
      const kv_t* __restrict ks = K + off;
      const kv_t* __restrict vs = V + off;
      for (int64_t d = 0; d < D; ++d) kr[d] = widen(ks[d]);
      for (int64_t d = 0; d < D; ++d) vr[d] = widen(vs[d]);
    } else {
      for (int64_t d = 0; d < D; ++d) kr[d] = 0.0f;
      for (int64_t d = 0; d < D; ++d) vr[d] = 0.0f;
    }
  }
  if (D % 8 == 0) {
    for (int64_t j = 0; j < kChunk; j += 8)
      for (int64_t d = 0; d < D; d += 8) transpose8(kbuf + j * D + d, D, kt + d * kChunk + j, kChunk);
  } else {
    for (int64_t j = 0; j < kChunk; ++j)
      for (int64_t d = 0; d < D; ++d) kt[d * kChunk + j] = kbuf[j * D + d];
  }
}

template <typename kv_t>
static void attend_kernel(const float* q, float* out, float* lse, int64_t Hq, int64_t Hkv, int64_t D, const KeySource& src,
                          const int64_t* q_start, const int64_t* q_len, const int64_t* first_pos, const int64_t* key_len,
                          int64_t B, float scale) {
  const int64_t groups = Hq / Hkv;
  const kv_t* K = reinterpret_cast<const kv_t*>(src.k);
  const kv_t* V = reinterpret_cast<const kv_t*>(src.v);
  at::parallel_for(0, B * Hkv, 1, [=, &src](int64_t wb, int64_t we) {
    std::vector<float> kt(D * kChunk), vc(kChunk * D), kbuf(kChunk * D), s(kChunk), p(kChunk), tbuf(kChunk), pv(D), ml, o;
    for (int64_t w = wb; w < we; ++w) {
      const int64_t b = w / Hkv, hk = w % Hkv;
      const int64_t n = q_len[b];
      if (n == 0) continue;
      const int64_t rows = n * groups;
      ml.resize(2 * rows);
      for (int64_t r = 0; r < rows; ++r) {
        ml[2 * r] = -kInf;  // m
        ml[2 * r + 1] = 0.0f;  // l
      }
      o.assign(rows * D, 0.0f);
      const int64_t last = first_pos[b] + n - 1;  // highest query position of this request
      const int64_t nchunks = last / kChunk + 1;
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t lo = c * kChunk;
        gather_chunk<kv_t>(K, V, src, b, hk, lo, key_len[b], D, kt.data(), vc.data(), kbuf.data());
        for (int64_t i = 0; i < n; ++i) {
          const int64_t pos = first_pos[b] + i;
          if (pos < lo) continue;  // a chunk past the query's position is an exact identity
          for (int64_t g = 0; g < groups; ++g) {
            const int64_t hq = hk * groups + g, row = i * groups + g;
            chunk_update(q + ((q_start[b] + i) * Hq + hq) * D, kt.data(), vc.data(), D, pos - lo + 1, scale, ml.data() + 2 * row,
                         o.data() + row * D, s.data(), p.data(), tbuf.data(), pv.data());
          }
        }
      }
      for (int64_t i = 0; i < n; ++i)
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t row = i * groups + g, hq = hk * groups + g;
          float* dst = out + ((q_start[b] + i) * Hq + hq) * D;
          const float* orow = o.data() + row * D;
          const float lr = ml[2 * row + 1];
          for (int64_t d = 0; d < D; ++d) dst[d] = orow[d] / lr;
          if (lse) lse[(q_start[b] + i) * Hq + hq] = ml[2 * row] + slog(lr);  // for the backward
        }
    }
  });
}

static at::Tensor run_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, KeySource src,
                                const at::Tensor& q_start, const at::Tensor& q_len, const at::Tensor& first_pos,
                                const at::Tensor& key_len, double scale, at::Tensor* lse_out = nullptr) {
  TORCH_CHECK_VALUE(k.scalar_type() == v.scalar_type(), "rlkernel::attention: k and v dtypes differ");
  TORCH_CHECK_VALUE(k.stride(-1) == 1 && v.stride(-1) == 1, "rlkernel::attention: k/v last dim must be contiguous");
  TORCH_CHECK_VALUE(k.strides() == v.strides(), "rlkernel::attention: k and v strides differ");
  auto q = q_in.to(at::kFloat).contiguous();
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k.size(-2);
  TORCH_CHECK_VALUE(Hq % Hkv == 0, "rlkernel::attention: query heads are not a multiple of kv heads");
  auto out = at::zeros(q.sizes(), q.options());
  float* lse = nullptr;
  if (lse_out) {
    *lse_out = at::zeros({q.size(0), Hq}, q.options());
    lse = lse_out->data_ptr<float>();
  }
  RK_DISPATCH(k.scalar_type(), "rk_attention", [&] {
    src.k = reinterpret_cast<const char*>(k.data_ptr<scalar_t>());
    src.v = reinterpret_cast<const char*>(v.data_ptr<scalar_t>());
    attend_kernel<scalar_t>(q.data_ptr<float>(), out.data_ptr<float>(), lse, Hq, Hkv, D, src, q_start.data_ptr<int64_t>(),
                            q_len.data_ptr<int64_t>(), first_pos.data_ptr<int64_t>(), key_len.data_ptr<int64_t>(),
                            q_start.size(0), static_cast<float>(scale));
  });
  return out;
}

// Packed causal prefill: q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens [B+1]. Returns fp32 out
// (and, with lse, the fp32 log-sum-exp [T, Hq] of each query's scaled scores, for the backward).
static at::Tensor varlen_impl(const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& cu_in, double scale,
                              at::Tensor* lse) {
  auto k = k_in.contiguous(), v = v_in.contiguous();
  auto cu = cu_in.to(at::kLong).contiguous();
  const int64_t B = cu.size(0) - 1;
  auto starts = cu.slice(0, 0, B).contiguous();
  auto lens = (cu.slice(0, 1, B + 1) - cu.slice(0, 0, B)).contiguous();
  auto zeros = at::zeros({B}, cu.options());
  KeySource src{nullptr, nullptr, 0, k.stride(0), k.stride(1), 0, nullptr, 0, starts.data_ptr<int64_t>()};
  return run_attention(q, k, v, src, starts, lens, zeros, lens, scale, lse);
}

at::Tensor attention_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu, double scale) {
  return varlen_impl(q, k, v, cu, scale, nullptr);
}

std::tuple<at::Tensor, at::Tensor> attention_varlen_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu,
                                                        double scale) {
  at::Tensor lse;
  auto out = varlen_impl(q, k, v, cu, scale, &lse);
  return {out, lse};
}

// Queries against a paged cache: caches [num_blocks, block_size, Hkv, D] (any strides with a
// contiguous last dim); request b owns q rows query_start_loc[b]..[b+1], the last tokens of its
// seq_lens[b]. Returns fp32.
at::Tensor attention_paged(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables_in,
                           const at::Tensor& seq_lens_in, const at::Tensor& qsl_in, double scale) {
  TORCH_CHECK_VALUE(k_cache.dim() == 4, "rlkernel::attention_paged wants caches [blocks, block_size, Hkv, D]");
  auto lens = seq_lens_in.to(at::kLong).contiguous();
  const int64_t B = lens.size(0);
  auto qsl = qsl_in.to(at::kLong).contiguous();
  auto table = block_tables_in.slice(0, 0, B).to(at::kLong).contiguous();
  auto starts = qsl.slice(0, 0, B).contiguous();
  auto qlens = (qsl.slice(0, 1, B + 1) - qsl.slice(0, 0, B)).contiguous();
  const int64_t* ql = qlens.data_ptr<int64_t>();
  const int64_t* sl = lens.data_ptr<int64_t>();
  const int64_t bs = k_cache.size(1);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(ql[b] <= sl[b], "attention_paged: request ", b, " has ", ql[b], " queries but only ", sl[b], " tokens");
    TORCH_CHECK_VALUE(sl[b] == 0 || (sl[b] - 1) / bs < table.size(1), "attention_paged: request ", b, " needs more blocks than its table has");
  }
  auto first = (lens - qlens).contiguous();
  KeySource src{nullptr, nullptr, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), bs, table.data_ptr<int64_t>(), table.size(1), nullptr};
  return run_attention(q, k_cache, v_cache, src, starts, qlens, first, lens, scale);
}

// Exact copies of k/v [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at flat slots;
// slots < 0 (vLLM's padding) are skipped.
void write_kv(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots_in) {
  auto slots = slots_in.to(at::kLong).contiguous();
  auto k = k_in.to(k_cache.scalar_type()).contiguous(), v = v_in.to(v_cache.scalar_type()).contiguous();
  TORCH_CHECK_VALUE(k_cache.stride(-1) == 1 && v_cache.stride(-1) == 1 && k_cache.strides() == v_cache.strides(), "rlkernel::write_kv: cache layout");
  const int64_t T = slots.size(0), Hkv = k.size(1), D = k.size(2), bs = k_cache.size(1);
  TORCH_CHECK_VALUE(k.size(0) >= T, "rlkernel::write_kv: fewer keys than slots");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t nslots = k_cache.size(0) * bs;
  RK_DISPATCH(k_cache.scalar_type(), "rk_write_kv", [&] {
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = sp[t];
      if (slot < 0) continue;
      TORCH_CHECK_VALUE(slot < nslots, "rlkernel::write_kv: slot ", slot, " outside the cache");
      const int64_t base = (slot / bs) * k_cache.stride(0) + (slot % bs) * k_cache.stride(1);
      for (int64_t h = 0; h < Hkv; ++h) {
        std::memcpy(kc + base + h * k_cache.stride(2), kp + (t * Hkv + h) * D, D * sizeof(scalar_t));
        std::memcpy(vc + base + h * v_cache.stride(2), vp + (t * Hkv + h) * D, D * sizeof(scalar_t));
      }
    }
  });
}

// ---- linear and linear-logprob: the reference's tile GEMMs, its merges in one pass --------------
constexpr int64_t kTileRows = 16;

// primitives._tile_matmul for a 2-D a [M, K] and b [K, N]: the same at:: calls, so the same bits.
static at::Tensor tile_matmul(const at::Tensor& a, const at::Tensor& b) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  const int64_t rem = (-m) % kTileRows;
  const int64_t pad = rem < 0 ? rem + kTileRows : rem;
  at::Tensor ap = pad ? at::constant_pad_nd(a, {0, 0, 0, pad}) : a;
  const int64_t t = ap.size(0) / kTileRows;
  auto at_ = ap.reshape({-1, kTileRows, k});
  auto bt = b.unsqueeze(-3).expand({t, k, n}).reshape({-1, k, n});
  auto out = at::bmm(at_, bt).reshape({t * kTileRows, n});
  return out.slice(0, 0, m);
}

// The same product as one plain GEMM: rows zero-padded to at least one tile. The BLAS's
// fp32 GEMM reduces K in an order that depends on K alone, not on M, N or the thread count
// (measured over M 16..1500, K 32..4096, N 16..4096, 1 and 2 threads), so each row's bits equal
// tile_matmul's; the loader checks this per weight shape before it uses the plain GEMM.
static at::Tensor plain_matmul(const at::Tensor& a, const at::Tensor& b) {
  const int64_t m = a.size(0);
  if (m >= kTileRows) return at::mm(a, b);
  return at::mm(at::constant_pad_nd(a, {0, 0, 0, kTileRows - m}), b).slice(0, 0, m);
}

static at::Tensor matmul(const at::Tensor& a, const at::Tensor& b, bool plain) { return plain ? plain_matmul(a, b) : tile_matmul(a, b); }

constexpr int64_t kMinCols = 16;

static at::Tensor widen_weight(const at::Tensor& weight) {
  auto w = weight.to(at::kFloat);
  const int64_t n = w.size(0);
  return n < kMinCols ? at::constant_pad_nd(w, {0, 0, 0, kMinCols - n}) : w;
}

// linear reference: x [.., K], weight [N, K], optional bias, k_segments canonical K-segments.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, int64_t k_segments, bool plain) {
  const int64_t k = x.size(-1), n = weight.size(0);
  TORCH_CHECK_VALUE(weight.size(1) == k, "linear: x has K=", k, " but weight has K=", weight.size(1));
  auto x2 = x.reshape({-1, k}).to(at::kFloat);
  auto w = widen_weight(weight);
  at::Tensor out;
  if (k_segments == 1) {
    out = matmul(x2, w.t(), plain);
  } else {
    TORCH_CHECK_VALUE(k_segments >= 1 && k % k_segments == 0, "linear: K=", k, " is not divisible into ", k_segments, " canonical segments");
    const int64_t seg = k / k_segments, m = x2.size(0), nw = w.size(0);
    std::vector<at::Tensor> parts;
    if (plain) {
      // all segments as one batched GEMM: problem i is segment i's [M, K/S] x [K/S, N] (the
      // same problem as its own GEMM, so the same bits; checked with the plain GEMM)
      at::Tensor xp = m >= kTileRows ? x2 : at::constant_pad_nd(x2, {0, 0, 0, kTileRows - m});
      auto a = xp.reshape({xp.size(0), k_segments, seg}).transpose(0, 1);
      auto b = w.reshape({nw, k_segments, seg}).permute({1, 2, 0});
      auto prod = at::bmm(a, b);
      for (int64_t i = 0; i < k_segments; ++i) parts.push_back(prod[i].slice(0, 0, m));
    } else {
      for (int64_t i = 0; i < k_segments; ++i)
        parts.push_back(tile_matmul(x2.slice(1, i * seg, (i + 1) * seg), w.slice(1, i * seg, (i + 1) * seg).t()));
    }
    // tree_sum over the stacked partials: zero-pad to a power of two, add adjacent pairs
    while (parts.size() & (parts.size() - 1)) parts.push_back(at::zeros_like(parts[0]));
    while (parts.size() > 1) {
      std::vector<at::Tensor> next;
      for (size_t i = 0; i < parts.size(); i += 2) next.push_back(parts[i] + parts[i + 1]);
      parts.swap(next);
    }
    out = parts[0];
  }
  out = out.slice(1, 0, n);  // drop the zero columns of a narrow weight before the bias
  if (bias.has_value()) out = out + bias->to(at::kFloat);
  auto lead = x.sizes().vec();
  lead.back() = n;
  return out.to(x.scalar_type()).reshape(lead);
}

// Per vocab tile of VOCAB_TILE rows: z = tile_matmul(h32, W[lo:hi].float().t()) / T,
// m = max z, l = tree(exp(z - m)); tiles merged by a balanced tree (identity-padded).
constexpr int64_t kVocabTile = 512;

struct ML {
  float m, l;
};

static inline ML merge_ml(ML a, ML b) {
  float m = a.m > b.m ? a.m : b.m;
  float safe = (std::isinf(m) && m < 0) ? 0.0f : m;
  float x = a.l * sexp(a.m - safe);
  float y = b.l * sexp(b.m - safe);
  return {m, x + y};
}

// The tiles' (m, l) merged by one balanced tree (v has a power-of-two length, identity-padded
// with (-inf, 0)); returns (m, log l). v is destroyed.
static inline std::pair<float, float> tree_merge_ml(ML* v, int64_t P) {
  for (int64_t len = P; len > 1; len >>= 1)
    for (int64_t i = 0; i < len / 2; ++i) v[i] = merge_ml(v[2 * i], v[2 * i + 1]);
  return {v[0].m, slog(v[0].l)};
}

// The full table with every vocab tile's logits from one plain GEMM over the whole vocab (a
// column's bits do not depend on the other columns; the loader checks this shape), then per row:
// per-tile (m, l), the tile tree, and the final formula, as logprob_impl does tile by tile.
static at::Tensor logprobs_full_one_gemm(const at::Tensor& h32, const at::Tensor& weight, double temperature, int64_t vocab, int64_t ntiles,
                                         int64_t P) {
  const int64_t T = h32.size(0);
  auto full = at::div(plain_matmul(h32, weight.slice(0, 0, vocab).to(at::kFloat).t()), temperature).contiguous();
  float* fp = full.data_ptr<float>();
  at::parallel_for(0, T, 1, [=](int64_t b, int64_t e) {
    std::vector<float> bufv(kVocabTile), dv(kVocabTile);
    std::vector<ML> v(P);
    float* __restrict buf = bufv.data();
    float* __restrict dz = dv.data();
    for (int64_t r = b; r < e; ++r) {
      float* __restrict row = fp + r * vocab;
      for (int64_t ti = 0; ti < P; ++ti) {
        if (ti >= ntiles) {
          v[ti] = {-kInf, 0.0f};
          continue;
        }
        const int64_t lo = ti * kVocabTile, w = std::min(lo + kVocabTile, vocab) - lo;
        const float* __restrict zr = row + lo;
        float m = -kInf;
        for (int64_t j = 0; j < w; ++j) m = zr[j] > m ? zr[j] : m;
        for (int64_t j = 0; j < w; ++j) dz[j] = zr[j] - m;
        exp_span(dz, buf, w);
        v[ti] = {m, tree_sum_inplace(buf, w)};
      }
      const auto [mr, lr] = tree_merge_ml(v.data(), P);
      for (int64_t j = 0; j < vocab; ++j) row[j] = (row[j] - mr) - lr;
    }
  });
  return full;
}

// kind 0: full table [T, V]; kind 1: logprob of targets [T]; kind 2: lse [T]; kind 3: both [2, T].
static at::Tensor logprob_impl(const at::Tensor& hidden, const at::Tensor& weight, const c10::optional<at::Tensor>& targets_in,
                               double temperature, int64_t vocab, int kind, bool plain) {
  auto h32 = hidden.to(at::kFloat);
  const int64_t T = h32.size(0);
  const int64_t ntiles = (vocab + kVocabTile - 1) / kVocabTile;
  const int64_t P = pow2_ceil(ntiles);
  if (kind == 0 && plain) return logprobs_full_one_gemm(h32, weight, temperature, vocab, ntiles, P);
  std::vector<float> ms(T * P, -kInf), ls(T * P, 0.0f);
  at::Tensor full;
  if (kind == 0) full = at::empty({T, vocab}, h32.options());
  at::Tensor targets;
  std::vector<float> zt(T, 0.0f);
  if (kind == 1 || kind == 3) targets = targets_in->to(at::kLong).contiguous();
  for (int64_t ti = 0; ti < ntiles; ++ti) {
    const int64_t lo = ti * kVocabTile, hi = std::min(lo + kVocabTile, vocab), w = hi - lo;
    auto z = at::div(matmul(h32, weight.slice(0, lo, hi).to(at::kFloat).t(), plain), temperature).contiguous();
    const float* zp = z.data_ptr<float>();
    float* msp = ms.data();
    float* lsp = ls.data();
    at::parallel_for(0, T, 4, [=](int64_t b, int64_t e) {
      std::vector<float> bufv(pow2_ceil(w)), dv(w);
      float* __restrict buf = bufv.data();
      float* __restrict dz = dv.data();
      for (int64_t r = b; r < e; ++r) {
        const float* __restrict zr = zp + r * w;
        float m = -kInf;
        for (int64_t j = 0; j < w; ++j) m = zr[j] > m ? zr[j] : m;
        for (int64_t j = 0; j < w; ++j) dz[j] = zr[j] - m;
        exp_span(dz, buf, w);
        msp[r * P + ti] = m;
        lsp[r * P + ti] = tree_sum_inplace(buf, w);
      }
    });
    if (kind == 0) full.slice(1, lo, hi).copy_(z);
    if (kind == 1 || kind == 3) {
      const int64_t* tp = targets.data_ptr<int64_t>();
      for (int64_t r = 0; r < T; ++r)
        if (tp[r] >= lo && tp[r] < hi) zt[r] = zp[r * w + (tp[r] - lo)];
    }
  }
  std::vector<float> mfin(T), logl(T);
  std::vector<ML> v(P);
  for (int64_t r = 0; r < T; ++r) {
    for (int64_t i = 0; i < P; ++i) v[i] = {ms[r * P + i], ls[r * P + i]};
    std::tie(mfin[r], logl[r]) = tree_merge_ml(v.data(), P);
  }
  if (kind == 0) {
    float* fp = full.data_ptr<float>();
    const float* mf = mfin.data();
    const float* ll = logl.data();
    at::parallel_for(0, T, 1, [=](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        float* __restrict row = fp + r * vocab;
        const float mr = mf[r], lr = ll[r];
        for (int64_t j = 0; j < vocab; ++j) row[j] = (row[j] - mr) - lr;
      }
    });
    return full;
  }
  // kind 1: [T] logprobs of targets; kind 2: [T] lse; kind 3: [2, T] both (what the backward needs)
  const bool lp = kind != 2, lse = kind != 1;
  auto out = kind == 3 ? at::empty({2, T}, h32.options()) : at::empty({T}, h32.options());
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < T; ++r) {
    if (lp) op[r] = (zt[r] - mfin[r]) - logl[r];
    if (lse) op[(lp ? T : 0) + r] = mfin[r] + logl[r];
  }
  return out;
}

at::Tensor logprobs_full(const at::Tensor& hidden, const at::Tensor& weight, double temperature, int64_t vocab, bool plain) {
  return logprob_impl(hidden, weight, c10::nullopt, temperature, vocab, 0, plain);
}

at::Tensor logprob_targets(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, double temperature, int64_t vocab,
                           bool plain) {
  return logprob_impl(hidden, weight, targets, temperature, vocab, 1, plain);
}

at::Tensor logprob_targets_lse(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, double temperature,
                               int64_t vocab, bool plain) {
  return logprob_impl(hidden, weight, targets, temperature, vocab, 3, plain);
}

at::Tensor logsumexp(const at::Tensor& hidden, const at::Tensor& weight, double temperature, int64_t vocab, bool plain) {
  return logprob_impl(hidden, weight, c10::nullopt, temperature, vocab, 2, plain);
}

}  // namespace rk

TORCH_LIBRARY(rlkernel, m) {
  m.def("exp(Tensor x) -> Tensor", &rk::exp_f32);
  m.def("log(Tensor x) -> Tensor", &rk::log_f32);
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor", &rk::swiglu);
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)", &rk::rms_norm);
  m.def("rope(Tensor x, Tensor positions, Tensor cos, Tensor sin) -> Tensor", &rk::rope);
  m.def("attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale) -> Tensor", &rk::attention_varlen);
  m.def("attention_varlen_lse(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale) -> (Tensor, Tensor)", &rk::attention_varlen_lse);
  m.def("attention_paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale) -> Tensor",
        &rk::attention_paged);
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()", &rk::write_kv);
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, int k_segments, bool plain_gemm) -> Tensor", &rk::linear);
  m.def("logprobs_full(Tensor hidden, Tensor weight, float temperature, int vocab, bool plain_gemm) -> Tensor", &rk::logprobs_full);
  m.def("logprob_targets(Tensor hidden, Tensor weight, Tensor targets, float temperature, int vocab, bool plain_gemm) -> Tensor",
        &rk::logprob_targets);
  m.def("logprob_targets_lse(Tensor hidden, Tensor weight, Tensor targets, float temperature, int vocab, bool plain_gemm) -> Tensor",
        &rk::logprob_targets_lse);
  m.def("logsumexp(Tensor hidden, Tensor weight, float temperature, int vocab, bool plain_gemm) -> Tensor", &rk::logsumexp);
}
