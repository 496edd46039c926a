// dequantize.cu — FP8 e4m3 codes times their block scales back to a float dtype (dequantize; semantics:
// cpu/ops.h): one thread per element, grid-stride.
#include <cstdint>

#include "core/fp8.h"
#include "cuda/common.cuh"
#include "cuda/ops.h"
#include "cuda/quant.cuh"

namespace moe8::cuda {
using namespace quant;  // the shared helpers (quant.cuh)
namespace {

template <typename T>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scale, int64_t total, int64_t M,
                      int64_t K, int64_t bm, int64_t bk, T* __restrict__ out) {
  const int64_t SM = (M + bm - 1) / bm, SK = (K + bk - 1) / bk;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t k = i % K, m = (i / K) % M, b = i / (M * K);
    out[i] = from_float<T>(e4m3_value(q[i]) * scale[(b * SM + m / bm) * SK + k / bk]);
  }
}

}  // namespace

void dequantize(const TensorView& q, const TensorView& scale, int64_t block_rows, int64_t block_cols,
                const TensorView& out, void* stream) {
  const int64_t total = q.numel(), M = q.shape[q.ndim - 2], K = q.shape[q.ndim - 1];
  if (total == 0) return;
  MOE8_DISPATCH_FLOAT(out.dtype, "dequantize: out", [&] {
    using T = scalar_t;
    dequantize_kernel<T><<<grid_stride_blocks(total), kThreads, 0, as_stream(stream)>>>(
        q.ptr<uint8_t>(), scale.ptr<float>(), total, M, K, block_rows, block_cols, out.ptr<T>());
    check_launch("dequantize_kernel");
  });
}

}  // namespace moe8::cuda
