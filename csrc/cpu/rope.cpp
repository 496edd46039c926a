// rope.cpp — CPU reference of the rotary position embedding (Llama/Qwen "rotate_half" form), forward and
// backward, on strided x / out.
#include <cstdint>

#include "core/parallel.h"
#include "cpu/common.h"
#include "cpu/ops.h"

namespace moe8::cpu {

void rope(const TensorView& x, const TensorView& cos, const TensorView& sin, const TensorView& out, bool backward) {
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3), half = D / 2;
  const int64_t cos_b = cos.size(0) == 1 ? 0 : S * D;  // batch stride of cos / sin: 0 broadcasts
  MOE8_CPU_DISPATCH_FLOAT(x.dtype, "rope", [&] {
    const scalar_t* X = x.ptr<scalar_t>();
    const scalar_t* C = cos.ptr<scalar_t>();
    const scalar_t* Sn = sin.ptr<scalar_t>();
    scalar_t* Y = out.ptr<scalar_t>();
    parallel_for(B * H * S, 256, [&](int64_t r) {
      const int64_t b = r / (H * S), h = (r / S) % H, s = r % S;
      const scalar_t* xr = X + b * x.strides[0] + h * x.strides[1] + s * x.strides[2];
      scalar_t* yr = Y + b * out.strides[0] + h * out.strides[1] + s * out.strides[2];
      const scalar_t* c = C + b * cos_b + s * D;
      const scalar_t* sn = Sn + b * cos_b + s * D;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = to_f(xr[i]), x2 = to_f(xr[i + half]);
        const float c1 = to_f(c[i]), c2 = to_f(c[i + half]), s1 = to_f(sn[i]), s2 = to_f(sn[i + half]);
        float y1, y2;
        if (!backward) {  // y = x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]
          y1 = x1 * c1 - x2 * s1;
          y2 = x2 * c2 + x1 * s2;
        } else {  // dx = g cos + rotate_half^T(g sin), rotate_half^T(u) = [u2, -u1]
          y1 = x1 * c1 + x2 * s2;
          y2 = x2 * c2 - x1 * s1;
        }
        yr[i] = from_f<scalar_t>(y1);
        yr[i + half] = from_f<scalar_t>(y2);
      }
    });
  });
}

}  // namespace moe8::cpu
