// The strict GEMM (gemm.h) on at::Tensors, for the op kernels: per output one fp32 fma chain
// over K ascending from +0.0 (contracts/gemm.py), any strides, fp32/bf16/fp16 operands.
#pragma once
#include "common.h"
#include "gemm.h"

namespace rk {

inline rk_gemm::DType gemm_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return rk_gemm::kF32;
    case at::kBFloat16: return rk_gemm::kBF16;
    case at::kHalf: return rk_gemm::kF16;
    default: TORCH_CHECK_VALUE(false, "rlkernel gemm: unsupported dtype ", t.scalar_type());
  }
  return rk_gemm::kF32;
}

// a [M, K], b [K, N] -> float32 [M, N]
inline at::Tensor gemm(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "rlkernel gemm: a ", a.sizes(), " b ", b.sizes());
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  auto out = at::empty({M, N}, a.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  rk_gemm::gemm(a.data_ptr(), gemm_dtype(a), a.stride(0), a.stride(1), b.data_ptr(), gemm_dtype(b), b.stride(0), b.stride(1),
                out.data_ptr<float>(), N, M, N, K, false, true);
  return out;
}

// a [M, K] times a B packed by rlkernel::pack_b ([K, n]) -> float32 [M, n]
inline at::Tensor gemm_packed(const at::Tensor& a, const at::Tensor& packed, int64_t n) {
  const int64_t M = a.size(0), K = a.size(1);
  const bool bf = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE(packed.is_contiguous() && packed.dim() == 3 && packed.size(0) == (n + 15) / 16 &&
                        packed.size(1) == (bf ? (K + 1) / 2 : K),
                    "rlkernel gemm_packed: packed ", packed.sizes(), " does not hold a [", K, ", ", n, "] B");
  auto out = at::empty({M, n}, a.options().dtype(at::kFloat));
  if (M == 0 || n == 0) return out;
  rk_gemm::gemm_packed(a.data_ptr(), gemm_dtype(a), a.stride(0), a.stride(1), packed.data_ptr(), bf, out.data_ptr<float>(), n, M, n, K,
                       false, true);
  return out;
}

}  // namespace rk
