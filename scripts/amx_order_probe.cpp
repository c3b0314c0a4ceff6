// Can Intel AMX's bf16 dot product (TDPBF16PS) implement rlkernel's strict GEMM contract on CPUs that have it?
// The contract: every output is one float32 FMA chain over K ascending, so its bits do not depend on the ISA. This probe
// runs one 16x16x32 tile product on random bf16 data (normal and wide-exponent values, zero and non-zero accumulators)
// and compares AMX's outputs bit for bit with candidate orders: the contract's sequential chain, pairs summed exactly
// then rounded into the accumulator, one rounding of the whole sum, fp32 pair sums, and round-toward-zero variants.
// Build and run on an AMX CPU (Linux >= 5.16):
//   g++ -O2 -mamx-tile -mamx-bf16 -mfma -ffp-contract=off scripts/amx_order_probe.cpp -o /tmp/amx_probe && /tmp/amx_probe 1
// Result on this machine (2026-12-01, Intel Xeon with AMX, benchmarks/cpu_gemm_bf16_isa.json): AMX matches none of them
// (27-72% of outputs differ from each), so an AMX kernel cannot compute the contract's bits.
#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <random>
#include <unistd.h>
#include <sys/syscall.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
struct TileCfg { uint8_t palette, start; uint8_t r0[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static uint16_t bf(float f) { uint32_t u; memcpy(&u, &f, 4); return u >> 16; }  // truncation: values chosen exactly representable
static float fl(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) { printf("no AMX permission\n"); return 1; }
  TileCfg cfg{}; cfg.palette = 1;
  const int M = 16, N = 16, K = 32;  // one tile: A 16x32 bf16 (64 B rows), B 16 (k pairs) x 16 (n) x 2 (VNNI), C 16x16 fp32
  for (int t = 0; t < 3; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
  std::mt19937 rng(argc > 1 ? atoi(argv[1]) : 0);
  long d3 = 0, d4 = 0, d5 = 0, d6 = 0; long trials = 0, differ_seq = 0, differ_pair = 0, differ_both = 0;
  for (int it = 0; it < 20000; ++it) {
    alignas(64) uint16_t A[M][K], B[K / 2][N][2]; alignas(64) float C[M][N];
    int mode = it % 4;
    std::normal_distribution<float> nd(0.f, 1.f);
    std::uniform_int_distribution<int> ex(-30, 30);
    for (int m = 0; m < M; ++m) for (int k = 0; k < K; ++k) {
      float v = nd(rng); if (mode >= 2) v = ldexpf(v, ex(rng)); A[m][k] = bf(v); }
    for (int k = 0; k < K; ++k) for (int n = 0; n < N; ++n) {
      float v = nd(rng); if (mode >= 2) v = ldexpf(v, ex(rng)); B[k / 2][n][k % 2] = bf(v); }
    float init[M][N];
    for (int m = 0; m < M; ++m) for (int n = 0; n < N; ++n) { float v = (mode % 2) ? ldexpf(nd(rng), ex(rng) / 3) : 0.f; init[m][n] = v; C[m][n] = v; }
    _tile_loadd(0, C, 64); _tile_loadd(1, A, 64); _tile_loadd(2, B, 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, C, 64);
    for (int m = 0; m < M; ++m) for (int n = 0; n < N; ++n) {
      float seq = init[m][n], pair = init[m][n];
      for (int k = 0; k < K; ++k) seq = fmaf(fl(A[m][k]), fl(B[k / 2][n][k % 2]), seq);
      for (int k = 0; k < K; k += 2) {  // the two products of a pair summed first (exactly, in double), then one rounding into acc
        double p = (double)fl(A[m][k]) * fl(B[k / 2][n][0]) + (double)fl(A[m][k + 1]) * fl(B[k / 2][n][1]);
        pair = (float)((double)pair + p);
      }
      // H3: one rounding of acc + all 32 products (long double sum)
      long double tot = init[m][n]; for (int k = 0; k < K; ++k) tot += (long double)fl(A[m][k]) * fl(B[k / 2][n][k % 2]);
      float h3 = (float)tot;
      // H4: fp32 pair sum, then fp32 add to acc
      float h4 = init[m][n]; for (int k = 0; k < K; k += 2) { float pp = fl(A[m][k]) * fl(B[k/2][n][0]) + fl(A[m][k+1]) * fl(B[k/2][n][1]); h4 = h4 + pp; }
      // H5: sequential chain with round-toward-zero? emulate via double then truncate
      double h5d = init[m][n]; for (int k = 0; k < K; ++k) { h5d = h5d + (double)fl(A[m][k]) * fl(B[k/2][n][k%2]); float t = (float)h5d; if (fabs((double)t) > fabs(h5d)) t = nextafterf(t, 0.f); h5d = t; }
      float h5 = (float)h5d;
      // H6: pairs summed exactly, accumulate in the order of pairs but with round toward zero
      double h6d = init[m][n]; for (int k = 0; k < K; k += 2) { h6d = h6d + (double)fl(A[m][k]) * fl(B[k/2][n][0]) + (double)fl(A[m][k+1]) * fl(B[k/2][n][1]); float t = (float)h6d; if (fabs((double)t) > fabs(h6d)) t = nextafterf(t, 0.f); h6d = t; }
      float h6 = (float)h6d;
      uint32_t c, s, p, a3, a4, a5, a6; memcpy(&c, &C[m][n], 4); memcpy(&s, &seq, 4); memcpy(&p, &pair, 4);
      memcpy(&a3, &h3, 4); memcpy(&a4, &h4, 4); memcpy(&a5, &h5, 4); memcpy(&a6, &h6, 4);
      ++trials; differ_seq += c != s; differ_pair += c != p; differ_both += (c != s) && (c != p);
      d3 += c != a3; d4 += c != a4; d5 += c != a5; d6 += c != a6;
    }
  }
  printf("outputs %ld: AMX != sequential fma chain: %ld; AMX != pair-then-add: %ld; neither: %ld\n", trials, differ_seq, differ_pair, differ_both);
  printf("H3 one rounding: %ld; H4 fp32 pair then add: %ld; H5 seq RZ: %ld; H6 pair-exact RZ: %ld\n", d3, d4, d5, d6);
  _tile_release();
}
