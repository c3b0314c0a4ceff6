// RMSNorm (contracts/norm.py).
#include "common.h"

namespace rk {
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
}  // namespace rk

TORCH_LIBRARY_FRAGMENT(rlkernel, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)", &rk::rms_norm);
}
