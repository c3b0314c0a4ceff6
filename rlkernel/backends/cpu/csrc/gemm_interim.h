// Interim GEMM under the strict contract (contracts/gemm.py): per output one fp32 fma chain over
// K ascending from +0.0; lanes across N, threads across rows. Replaced by gemm.cpp's kernel.
#pragma once
#include "common.h"

namespace rk {

// a [M, K] (any float dtype, any strides), b [K, N] (any float dtype, any strides) -> fp32 [M, N].
inline at::Tensor gemm(const at::Tensor& a_in, const at::Tensor& b_in) {
  auto a = a_in.to(at::kFloat).contiguous();
  auto b = b_in.to(at::kFloat).contiguous();
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  auto out = at::empty({M, N}, a.options());
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 1, [=](int64_t mb, int64_t me) {
    for (int64_t m = mb; m < me; ++m) {
      float* __restrict acc = op + m * N;
      for (int64_t n = 0; n < N; ++n) acc[n] = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const float x = ap[m * K + k];
        const float* __restrict br = bp + k * N;
        for (int64_t n = 0; n < N; ++n) acc[n] = std::fma(x, br[n], acc[n]);
      }
    }
  });
  return out;
}

}  // namespace rk
