// Attention: varlen prefill, paged queries, KV write (contracts/attention.py).
#include "common.h"

namespace rk {
// The strict attention contract (contracts/attention.py), per query and chunk of kChunk keys
// anchored at absolute positions: s_j = (q . k_j) as one fp32 fma chain over d ascending from 0,
// then * scale, masked past the query's position; m' = max(m, max s); alpha = exp(m - m');
// p = exp(s - m'); l = l*alpha + tree(p); o_d = o_d*alpha + (p . v)_d with (p . v)_d one fp32
// fma chain over the chunk's keys ascending from 0; out = o / l. Vector lanes run across keys
// (scores) and across d (p . v): independent outputs, so the vector width cannot matter.

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


// One query row against one chunk: scores, online-softmax update of (m, l, o). Kept out of the
// parallel lambda with restrict pointers so GCC vectorises the j and d loops.
static void chunk_update(const float* __restrict qr, const float* __restrict kt, const float* __restrict vc, int64_t D,
                         int64_t visible, float scale, float* __restrict state_ml, float* __restrict orow, float* __restrict s,
                         float* __restrict p, float* __restrict tbuf, float* __restrict pv) {
  // scores: s[j] = fma chain over d (the GEMM contract), then * scale; masked keys -inf
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
  TORCH_CHECK_VALUE(q_in.dim() == 3, "rlkernel::attention: q must be [tokens, heads, head_dim], got ", q_in.sizes());
  TORCH_CHECK_VALUE(k.size(-1) == q_in.size(2), "rlkernel::attention: q's head_dim ", q_in.size(2), " but k's ", k.size(-1));
  auto q = q_in.to(at::kFloat).contiguous();
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k.size(-2);
  TORCH_CHECK_VALUE(Hkv > 0 && Hq % Hkv == 0, "rlkernel::attention: query heads are not a multiple of kv heads");
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ql = q_len.data_ptr<int64_t>();
  for (int64_t b = 0; b < q_start.size(0); ++b)  // the kernel reads and writes rows qs..qs+ql of q / out unchecked
    TORCH_CHECK_VALUE(qs[b] >= 0 && ql[b] >= 0 && qs[b] + ql[b] <= q.size(0), "rlkernel::attention: request ", b,
                      "'s query rows [", qs[b], ", ", qs[b] + ql[b], ") are outside q's ", q.size(0), " rows");
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
  TORCH_CHECK_VALUE(k.dim() == 3 && v.sizes() == k.sizes(), "rlkernel::attention_varlen: k and v must be [tokens, kv_heads, "
                    "head_dim] alike, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK_VALUE(cu_in.dim() == 1 && cu_in.size(0) >= 1, "rlkernel::attention_varlen: cu_seqlens must be 1-D [B + 1]");
  auto cu = cu_in.to(at::kLong).contiguous();
  const int64_t B = cu.size(0) - 1;
  const int64_t* c = cu.data_ptr<int64_t>();
  for (int64_t b = 0; b <= B; ++b)  // the keys of request b are rows c[b]..c[b+1] of k / v
    TORCH_CHECK_VALUE(c[b] >= 0 && (b == 0 || c[b] >= c[b - 1]) && c[b] <= k.size(0), "rlkernel::attention_varlen: "
                      "cu_seqlens must rise from >= 0 to <= k's ", k.size(0), " rows, got ", cu_in);
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
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
                    "rlkernel::attention_paged wants caches [blocks, block_size, Hkv, D] alike");
  auto lens = seq_lens_in.to(at::kLong).contiguous();
  const int64_t B = lens.size(0);
  auto qsl = qsl_in.to(at::kLong).contiguous();
  TORCH_CHECK_VALUE(qsl.dim() == 1 && qsl.size(0) == B + 1, "attention_paged: query_start_loc must be [", B + 1,
                    "] for ", B, " seq_lens, got ", qsl_in.sizes());
  TORCH_CHECK_VALUE(block_tables_in.dim() == 2 && block_tables_in.size(0) >= B, "attention_paged: block_tables must be "
                    "[>= ", B, ", blocks a request], got ", block_tables_in.sizes());
  auto table = block_tables_in.slice(0, 0, B).to(at::kLong).contiguous();
  auto starts = qsl.slice(0, 0, B).contiguous();
  auto qlens = (qsl.slice(0, 1, B + 1) - qsl.slice(0, 0, B)).contiguous();
  const int64_t* ql = qlens.data_ptr<int64_t>();
  const int64_t* sl = lens.data_ptr<int64_t>();
  const int64_t bs = k_cache.size(1);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(ql[b] <= sl[b], "attention_paged: request ", b, " has ", ql[b], " queries but only ", sl[b], " tokens");
    TORCH_CHECK_VALUE(sl[b] == 0 || (sl[b] - 1) / bs < table.size(1), "attention_paged: request ", b, " needs more blocks than its table has");
    const int64_t* row = table.data_ptr<int64_t>() + b * table.size(1);
    for (int64_t j = 0; sl[b] > 0 && j <= (sl[b] - 1) / bs; ++j)  // the blocks its keys are read from
      TORCH_CHECK_VALUE(row[j] >= 0 && row[j] < k_cache.size(0), "attention_paged: request ", b, "'s block ", j, " is ",
                        row[j], ", outside the cache's ", k_cache.size(0), " blocks");
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

}  // namespace rk

TORCH_LIBRARY_FRAGMENT(rlkernel, m) {
  m.def("attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale) -> Tensor", &rk::attention_varlen);
  m.def("attention_varlen_lse(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale) -> (Tensor, Tensor)", &rk::attention_varlen_lse);
  m.def("attention_paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale) -> Tensor",
        &rk::attention_paged);
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()", &rk::write_kv);
}
