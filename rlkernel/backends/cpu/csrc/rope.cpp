// RoPE rotation (contracts/rope.py).
#include "common.h"

namespace rk {

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

}  // namespace rk

TORCH_LIBRARY_FRAGMENT(rlkernel, m) {
  m.def("rope(Tensor x, Tensor positions, Tensor cos, Tensor sin) -> Tensor", &rk::rope);
}
