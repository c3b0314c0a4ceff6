// Linear and linear-logprob (contracts/gemm.py, contracts/logprob.py): the strict GEMM, then
// the contract's merges in one pass.
#include "common.h"
#include "gemm_at.h"

namespace rk {

// Partials merged by a balanced tree (zero-padded to a power of two), bias, one cast.
static at::Tensor finish_linear(std::vector<at::Tensor> parts, const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& bias) {
  while (parts.size() & (parts.size() - 1)) parts.push_back(at::zeros_like(parts[0]));
  while (parts.size() > 1) {
    std::vector<at::Tensor> next;
    for (size_t i = 0; i < parts.size(); i += 2) next.push_back(parts[i] + parts[i + 1]);
    parts.swap(next);
  }
  at::Tensor out = parts[0];
  if (bias.has_value()) out = out + bias->to(at::kFloat);
  auto lead = x.sizes().vec();
  lead.back() = n;
  return out.to(x.scalar_type()).reshape(lead);
}

// linear: x [.., K], weight [N, K], optional bias, k_segments canonical K-segments (each its own
// chain, partials merged by the tree).
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, int64_t k_segments) {
  const int64_t k = x.size(-1), n = weight.size(0);
  TORCH_CHECK_VALUE(weight.size(1) == k, "linear: x has K=", k, " but weight has K=", weight.size(1));
  TORCH_CHECK_VALUE(k_segments >= 1 && k % k_segments == 0, "linear: K=", k, " is not divisible into ", k_segments, " canonical segments");
  auto x2 = x.reshape({-1, k});
  const int64_t seg = k / k_segments;
  std::vector<at::Tensor> parts;
  for (int64_t i = 0; i < k_segments; ++i) parts.push_back(gemm(x2.slice(1, i * seg, (i + 1) * seg), weight.slice(1, i * seg, (i + 1) * seg).t()));
  return finish_linear(std::move(parts), x, n, bias);
}

// linear with the weight pre-packed (rlkernel::pack_b of each K-segment's weight.t()): the same
// chains on the same values, so the same bits, without re-packing the weight every call.
at::Tensor linear_packed(const at::Tensor& x, at::TensorList packed, int64_t n, const c10::optional<at::Tensor>& bias) {
  const int64_t k = x.size(-1), S = static_cast<int64_t>(packed.size());
  TORCH_CHECK_VALUE(S >= 1 && k % S == 0, "linear_packed: K=", k, " is not divisible into ", S, " packed segments");
  auto x2 = x.reshape({-1, k});
  const int64_t seg = k / S;
  std::vector<at::Tensor> parts;
  for (int64_t i = 0; i < S; ++i) parts.push_back(gemm_packed(x2.slice(1, i * seg, (i + 1) * seg), packed[i], n));
  return finish_linear(std::move(parts), x, n, bias);
}

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

// Per vocab tile of kVocabTile rows: z = gemm(h, W[lo:hi]^T) / T, m = max z, l = tree(exp(z - m));
// tiles merged by the balanced tree. kind 0: full table [T, V]; kind 1: logprob of targets [T];
// kind 2: lse [T]; kind 3: both [2, T] (what the backward needs).
// `packed` (optional): rlkernel::pack_b(weight[:vocab].t()); tile ti is then its panels
// [ti * kVocabTile / 16, ...), contiguous, and no tile is re-packed per call.
static at::Tensor logprob_impl(const at::Tensor& hidden, const at::Tensor& weight, const c10::optional<at::Tensor>& targets_in,
                               double temperature, int64_t vocab, int kind, const c10::optional<at::Tensor>& packed) {
  const int64_t T = hidden.size(0);
  const int64_t ntiles = (vocab + kVocabTile - 1) / kVocabTile;
  const int64_t P = pow2_ceil(ntiles);
  std::vector<float> ms(T * P, -kInf), ls(T * P, 0.0f);
  at::Tensor full;
  if (kind == 0) full = at::empty({T, vocab}, hidden.options().dtype(at::kFloat));
  at::Tensor targets;
  std::vector<float> zt(T, 0.0f);
  if (kind == 1 || kind == 3) targets = targets_in->to(at::kLong).contiguous();
  for (int64_t ti = 0; ti < ntiles; ++ti) {
    const int64_t lo = ti * kVocabTile, hi = std::min(lo + kVocabTile, vocab), w = hi - lo;
    auto z = kind == 0 ? full.slice(1, lo, hi) : at::empty({T, w}, hidden.options().dtype(at::kFloat));
    auto logits = packed.has_value() ? gemm_packed(hidden, packed->narrow(0, lo / 16, (w + 15) / 16), w) : gemm(hidden, weight.slice(0, lo, hi).t());
    z.copy_(at::div(logits, temperature));
    const int64_t zs = z.stride(0);
    const float* zp = z.data_ptr<float>();
    float* msp = ms.data();
    float* lsp = ls.data();
    at::parallel_for(0, T, 4, [=](int64_t b, int64_t e) {
      std::vector<float> bufv(pow2_ceil(w)), dv(w);
      float* __restrict buf = bufv.data();
      float* __restrict dz = dv.data();
      for (int64_t r = b; r < e; ++r) {
        const float* __restrict zr = zp + r * zs;
        float m = -kInf;
        for (int64_t j = 0; j < w; ++j) m = zr[j] > m ? zr[j] : m;
        for (int64_t j = 0; j < w; ++j) dz[j] = zr[j] - m;
        exp_span(dz, buf, w);
        msp[r * P + ti] = m;
        lsp[r * P + ti] = tree_sum_inplace(buf, w);
      }
    });
    if (kind == 1 || kind == 3) {
      const int64_t* tp = targets.data_ptr<int64_t>();
      for (int64_t r = 0; r < T; ++r)
        if (tp[r] >= lo && tp[r] < hi) zt[r] = zp[r * zs + (tp[r] - lo)];
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
  const bool lp = kind != 2, lse = kind != 1;
  auto out = kind == 3 ? at::empty({2, T}, hidden.options().dtype(at::kFloat)) : at::empty({T}, hidden.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < T; ++r) {
    if (lp) op[r] = (zt[r] - mfin[r]) - logl[r];
    if (lse) op[(lp ? T : 0) + r] = mfin[r] + logl[r];
  }
  return out;
}

using OptT = c10::optional<at::Tensor>;

at::Tensor logprobs_full(const at::Tensor& hidden, const at::Tensor& weight, const OptT& packed, double temperature, int64_t vocab) {
  return logprob_impl(hidden, weight, c10::nullopt, temperature, vocab, 0, packed);
}

at::Tensor logprob_targets(const at::Tensor& hidden, const at::Tensor& weight, const OptT& packed, const at::Tensor& targets, double temperature,
                           int64_t vocab) {
  return logprob_impl(hidden, weight, targets, temperature, vocab, 1, packed);
}

at::Tensor logprob_targets_lse(const at::Tensor& hidden, const at::Tensor& weight, const OptT& packed, const at::Tensor& targets,
                               double temperature, int64_t vocab) {
  return logprob_impl(hidden, weight, targets, temperature, vocab, 3, packed);
}

at::Tensor logsumexp(const at::Tensor& hidden, const at::Tensor& weight, const OptT& packed, double temperature, int64_t vocab) {
  return logprob_impl(hidden, weight, c10::nullopt, temperature, vocab, 2, packed);
}

// The contract constants this library was compiled with (the loader compares them with
// rlkernel/contracts): [attn_chunk, vocab_tile, log2e, ln2_hi, ln2_lo, exp_min, exp_max, c0..c7].
at::Tensor constants() {
  std::vector<double> v = {static_cast<double>(kChunk), static_cast<double>(kVocabTile), kLog2e, kLn2Hi, kLn2Lo, kExpMin, kExpMax};
  for (float c : kC) v.push_back(c);
  return at::tensor(v, at::dtype(at::kDouble));
}

}  // namespace rk

TORCH_LIBRARY_FRAGMENT(rlkernel, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, int k_segments) -> Tensor", &rk::linear);
  m.def("linear_packed(Tensor x, Tensor[] packed, int n, Tensor? bias) -> Tensor", &rk::linear_packed);
  m.def("logprobs_full(Tensor hidden, Tensor weight, Tensor? packed, float temperature, int vocab) -> Tensor", &rk::logprobs_full);
  m.def("logprob_targets(Tensor hidden, Tensor weight, Tensor? packed, Tensor targets, float temperature, int vocab) -> Tensor",
        &rk::logprob_targets);
  m.def("logprob_targets_lse(Tensor hidden, Tensor weight, Tensor? packed, Tensor targets, float temperature, int vocab) -> Tensor",
        &rk::logprob_targets_lse);
  m.def("logsumexp(Tensor hidden, Tensor weight, Tensor? packed, float temperature, int vocab) -> Tensor", &rk::logsumexp);
  m.def("constants() -> Tensor", &rk::constants);
}
