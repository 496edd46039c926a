// rmsnorm.cpp — CPU reference of RMSNorm, forward and backward (semantics: cpu/ops.h): fp32 elementwise math
// in the kernels' order of operations, sums in double.
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/parallel.h"
#include "cpu/common.h"
#include "cpu/ops.h"

namespace moe8::cpu {

void rms_norm_forward(const TensorView& x, const TensorView& weight, float eps, const TensorView& y,
                      const TensorView& rstd) {
  const int64_t R = x.size(0), H = x.size(1);
  float* rs = rstd.ptr<float>();
  MOE8_CPU_DISPATCH_FLOAT(x.dtype, "rms_norm_forward", [&] {
    const scalar_t* X = x.ptr<scalar_t>();
    const scalar_t* W = weight.ptr<scalar_t>();
    scalar_t* Y = y.ptr<scalar_t>();
    parallel_for(R, 16, [&](int64_t r) {
      const scalar_t* xr = X + r * H;
      scalar_t* yr = Y + r * H;
      double ss = 0.0;
      for (int64_t j = 0; j < H; ++j) ss += static_cast<double>(to_f(xr[j])) * to_f(xr[j]);
      const float s = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(H) + eps));
      rs[r] = s;
      for (int64_t j = 0; j < H; ++j) yr[j] = from_f<scalar_t>(to_f(xr[j]) * s * to_f(W[j]));
    });
  });
}

void rms_norm_backward(const TensorView& dy, const TensorView& x, const TensorView& weight, const TensorView& rstd,
                       const TensorView& dx, const TensorView& dweight) {
  const int64_t R = x.size(0), H = x.size(1);
  const float* rs = rstd.ptr<float>();
  MOE8_CPU_DISPATCH_FLOAT(x.dtype, "rms_norm_backward", [&] {
    const scalar_t* D = dy.ptr<scalar_t>();
    const scalar_t* X = x.ptr<scalar_t>();
    const scalar_t* W = weight.ptr<scalar_t>();
    scalar_t* DX = dx.ptr<scalar_t>();
    scalar_t* DW = dweight.ptr<scalar_t>();
    parallel_for(R, 16, [&](int64_t r) {
      const scalar_t* dr = D + r * H;
      const scalar_t* xr = X + r * H;
      scalar_t* o = DX + r * H;
      const float s = rs[r];
      double dot = 0.0;
      for (int64_t j = 0; j < H; ++j) dot += static_cast<double>(to_f(dr[j]) * to_f(W[j])) * (to_f(xr[j]) * s);
      const float mean = static_cast<float>(dot / static_cast<double>(H));
      for (int64_t j = 0; j < H; ++j) {
        const float g = to_f(dr[j]) * to_f(W[j]), xhat = to_f(xr[j]) * s;
        o[j] = from_f<scalar_t>(s * (g - xhat * mean));
      }
    });
    // dweight: each chunk of columns summed over the rows in order, so the result does not depend on threads
    constexpr int64_t kChunk = 64;
    parallel_for((H + kChunk - 1) / kChunk, 1, [&](int64_t c) {
      const int64_t j0 = c * kChunk, j1 = std::min(H, j0 + kChunk);
      std::vector<double> acc(j1 - j0, 0.0);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = j0; j < j1; ++j)
          acc[j - j0] += static_cast<double>(to_f(D[r * H + j])) * (to_f(X[r * H + j]) * rs[r]);
      for (int64_t j = j0; j < j1; ++j) DW[j] = from_f<scalar_t>(static_cast<float>(acc[j - j0]));
    });
  });
}

}  // namespace moe8::cpu
