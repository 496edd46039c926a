// swiglu_quant.cu — an expert activation fused with the FP8 e4m3 1x128 quantisation of its output
// (swiglu_quant): the 1x128 row kernel (quant.cuh) with the activation computed on the way (activation.cuh,
// the formula activation.cu uses) and 16-byte loads of gate and up.
#include <cstdint>

#include "core/fp8.h"
#include "cuda/activation.cuh"
#include "cuda/common.cuh"
#include "cuda/ops.h"
#include "cuda/quant.cuh"

namespace moe8::cuda {
using namespace quant;  // the shared helpers (quant.cuh)
namespace {

// 16 lanes per (row, 128-column block of the output); h [rows, 2I] (gated) or [rows, I]. vec: I % 8 == 0
// and h, q aligned, so a lane's 8 gate and 8 up values (8 interleaved pairs) are vector loads.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    swiglu_quant_kernel(const T* __restrict__ h, ActParams p, bool gated, int64_t rows, int64_t I, bool vec,
                        uint8_t* __restrict__ q, float* __restrict__ scale) {
  const int64_t r = warp_row();
  if (r >= rows) return;
  const int64_t IB = quant_blocks(I);
  const T* row = h + r * (gated ? 2 * I : I);
  for (int64_t b0 = 0; b0 < IB; b0 += 2) {
    const int64_t b = b0 + half(), i0 = lane_col(b);
    const bool live = b < IB;
    float g[kLaneVals] = {}, u[kLaneVals] = {};
    if (live) {
      if (!gated) {
        load_n(row, i0, I, vec, g);
      } else if (!p.interleaved) {
        load_n(row, i0, I, vec, g);
        load_n(row + I, i0, I, vec, u);
      } else {  // pairs (g, u) at 2i, 2i + 1: the lane's 16 values, in two loads
        float gu[2][kLaneVals];
        load_n(row, 2 * i0, 2 * I, vec, gu[0]);
        load_n(row, 2 * i0 + kLaneVals, 2 * I, vec, gu[1]);
#pragma unroll
        for (int j = 0; j < kLaneVals; ++j) {
          g[j] = gu[j / 4][2 * (j % 4)];
          u[j] = gu[j / 4][2 * (j % 4) + 1];
        }
      }
    }
    float v[kLaneVals];
#pragma unroll
    for (int j = 0; j < kLaneVals; ++j)  // rounded to T, as activation_forward stores it; 0 past I
      v[j] = live && i0 + j < I ? to_float(from_float<T>(act_forward(p, g[j], u[j]))) : 0.f;
    quantize_block(v, live, r, b, I, vec, q, scale);
  }
}

}  // namespace

void swiglu_quant(const TensorView& h, const ActParams& p, const TensorView& q, const TensorView& scale, void* stream) {
  const int64_t rows = q.shape[0], I = q.shape[1];
  if (rows == 0 || I == 0) return;
  MOE8_DISPATCH_FLOAT(h.dtype, "swiglu_quant: h", [&] {
    using T = scalar_t;
    const bool vec = I % kLaneVals == 0 && aligned(h.data, sizeof(T) * kLaneVals) && aligned(q.data, kLaneVals);
    swiglu_quant_kernel<T><<<blocks_for_rows(rows), kThreads, 0, as_stream(stream)>>>(
        h.ptr<T>(), p, is_gated(p.kind), rows, I, vec, q.ptr<uint8_t>(), scale.ptr<float>());
    check_launch("swiglu_quant_kernel");
  });
}

}  // namespace moe8::cuda
