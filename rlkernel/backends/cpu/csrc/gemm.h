// rlkernel strict CPU GEMM: raw-pointer interface (implementation: gemm.cpp).
//
// Contract (decides bits): every output element is ONE float32 fused-multiply-add chain,
//     acc = +0.0f (or c[m,n] when accumulate);  for k = 0..K-1 ascending: acc = fmaf(A[m,k], B[k,n], acc)
// with A and B widened exactly to float32 (bf16 / fp16 / fp32 inputs). A NaN result is stored
// as the canonical quiet NaN 0x7FC00000 (NaN payloads are otherwise ISA-dependent); every
// other value, signed zeros included, is exactly the chain's result. The bits depend on
// neither the ISA path (AVX-512 / AVX2+FMA / scalar std::fma), the thread count, M, nor
// where a row sits in the batch: SIMD runs across N only, threads split M and N only, and
// K blocking carries the accumulator.
//
// Strides are in elements and may be anything (transposed views included). C has unit
// column stride and row stride ldc. `parallel` = use at::parallel_for (a caller already
// inside a parallel region can pass false; nested at::parallel_for runs inline anyway).
#pragma once
#include <cstdint>

namespace rk_gemm {

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// "avx512", "avx2" or "scalar": the path this translation unit was compiled with.
const char* isa();

// C = A·B (accumulate=false) or C = chain continued from C (accumulate=true).
void gemm(const void* a, DType a_dtype, int64_t lda_m, int64_t lda_k,
          const void* b, DType b_dtype, int64_t ldb_k, int64_t ldb_n,
          float* c, int64_t ldc, int64_t M, int64_t N, int64_t K,
          bool accumulate = false, bool parallel = true);

// Packed B (pure data movement: no bits change). Panels of 16 columns, zero padded:
//   float32 packing: float   [ceil(N/16)][K][16]             element (k,n) at ((n/16)*K + k)*16 + n%16
//   bf16 packing:    uint16  [ceil(N/16)][ceil(K/2)][16][2]  element (k,n) at (((n/16)*ceil(K/2) + k/2)*16 + n%16)*2 + k%2
// bf16 B packs as bf16 (half the bytes; widened in the kernel by a shift / mask), fp32 and
// fp16 B pack as float32. packed_b_elems() is the element count of that storage.
bool packed_is_bf16(DType b_dtype);
int64_t packed_b_elems(int64_t K, int64_t N, DType b_dtype);
void pack_b(const void* b, DType b_dtype, int64_t ldb_k, int64_t ldb_n, int64_t K, int64_t N,
            void* packed, bool parallel = true);
void gemm_packed(const void* a, DType a_dtype, int64_t lda_m, int64_t lda_k,
                 const void* packed, bool packed_bf16,
                 float* c, int64_t ldc, int64_t M, int64_t N, int64_t K,
                 bool accumulate = false, bool parallel = true);

// The plain scalar triple loop of the contract (std::fma), for tests.
void gemm_naive(const void* a, DType a_dtype, int64_t lda_m, int64_t lda_k,
                const void* b, DType b_dtype, int64_t ldb_k, int64_t ldb_n,
                float* c, int64_t ldc, int64_t M, int64_t N, int64_t K);

}  // namespace rk_gemm

// Convenience float32 entry point (e.g. for the linear-logprob kernel, per vocab tile).
inline void rk_gemm_f32(const float* a, int64_t lda_m, int64_t lda_k, const float* b, int64_t ldb_k, int64_t ldb_n,
                        float* c, int64_t ldc, int64_t M, int64_t N, int64_t K, bool accumulate = false,
                        bool parallel = true) {
  rk_gemm::gemm(a, rk_gemm::kF32, lda_m, lda_k, b, rk_gemm::kF32, ldb_k, ldb_n, c, ldc, M, N, K, accumulate, parallel);
}
