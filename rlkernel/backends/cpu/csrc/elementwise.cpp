// Element-wise kernels: strict exp and log (float32), SwiGLU (contracts/swiglu.py).
#include "common.h"

namespace rk {
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

}  // namespace rk

TORCH_LIBRARY_FRAGMENT(rlkernel, m) {
  m.def("exp(Tensor x) -> Tensor", &rk::exp_f32);
  m.def("log(Tensor x) -> Tensor", &rk::log_f32);
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor", &rk::swiglu);
}
