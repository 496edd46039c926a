// permute.cpp — CPU reference of row movement: gather tokens into expert order, combine expert rows back
// into tokens (fp32 accumulation, slots in order), and the combine's gradient with respect to the weights.
#include <vector>

#include "core/parallel.h"
#include "cpu/common.h"
#include "cpu/ops.h"

namespace moe8::cpu {

void gather_rows(const TensorView& src, const TensorView& row_to_slot, int k, const TensorView& scale,
                 const TensorView& dst) {
  const int64_t R = dst.size(0), H = dst.size(1), slots = src.size(0) * k;
  const float* sc = scale.present ? scale.ptr<float>() : nullptr;
  MOE8_CPU_DISPATCH_FLOAT(src.dtype, "gather_rows", [&] {
    const scalar_t* S = src.ptr<scalar_t>();
    scalar_t* D = dst.ptr<scalar_t>();
    parallel_for(R, 256, [&](int64_t r) {
      int32_t slot = row_to_slot.ptr<int32_t>()[r];
      scalar_t* out = D + r * H;
      if (!in_range(slot, slots)) {
        for (int64_t h = 0; h < H; ++h) out[h] = from_f<scalar_t>(0.f);
        return;
      }
      const scalar_t* in = S + static_cast<int64_t>(slot / k) * H;
      float f = sc ? sc[slot] : 1.f;
      for (int64_t h = 0; h < H; ++h) out[h] = sc ? from_f<scalar_t>(f * to_f(in[h])) : in[h];
    });
  });
}

void combine_rows(const TensorView& rows, const TensorView& slot_to_row, const TensorView& weights,
                  const TensorView& out) {
  const int64_t T = out.size(0), H = out.size(1), K = slot_to_row.size(1), R = rows.size(0);
  const float* w = weights.present ? weights.ptr<float>() : nullptr;
  MOE8_CPU_DISPATCH_FLOAT(rows.dtype, "combine_rows", [&] {
    const scalar_t* X = rows.ptr<scalar_t>();
    scalar_t* Y = out.ptr<scalar_t>();
    parallel_for(T, 64, [&](int64_t t) {
      std::vector<float> acc(H, 0.f);
      for (int64_t k = 0; k < K; ++k) {
        int32_t row = slot_to_row.ptr<int32_t>()[t * K + k];
        if (!in_range(row, R)) continue;
        float f = w ? w[t * K + k] : 1.f;
        const scalar_t* x = X + static_cast<int64_t>(row) * H;
        for (int64_t h = 0; h < H; ++h) acc[h] += f * to_f(x[h]);
      }
      for (int64_t h = 0; h < H; ++h) Y[t * H + h] = from_f<scalar_t>(acc[h]);
    });
  });
}

void combine_weights_grad(const TensorView& dy, const TensorView& rows, const TensorView& slot_to_row,
                          const TensorView& d_weights) {
  const int64_t T = dy.size(0), H = dy.size(1), K = slot_to_row.size(1), R = rows.size(0);
  MOE8_CPU_DISPATCH_FLOAT(dy.dtype, "combine_weights_grad", [&] {
    const scalar_t* G = dy.ptr<scalar_t>();
    const scalar_t* X = rows.ptr<scalar_t>();
    parallel_for(T * K, 256, [&](int64_t s) {
      int32_t row = slot_to_row.ptr<int32_t>()[s];
      float acc = 0.f;
      if (in_range(row, R)) {
        const scalar_t* g = G + (s / K) * H;
        const scalar_t* x = X + static_cast<int64_t>(row) * H;
        for (int64_t h = 0; h < H; ++h) acc += to_f(g[h]) * to_f(x[h]);
      }
      d_weights.ptr<float>()[s] = acc;
    });
  });
}

}  // namespace moe8::cpu
