// quant_rowwise.cu — FP8 e4m3 rowwise and tensorwise quantisation (quantize_rowwise, quantize_tensorwise;
// semantics: cpu/ops.h), bit-exact with the CPU reference (quant.cuh says why): a block per row; a grid-wide
// amax (atomicMax on the float bits), then a cast.
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
    quantize_rowwise_kernel(const T* __restrict__ x, int64_t K, uint8_t* __restrict__ q, float* __restrict__ scale) {
  const int64_t r = blockIdx.x;
  const T* row = x + r * K;
  float m = 0.f;
  for (int64_t i = threadIdx.x; i < K; i += kThreads) m = fmaxf(m, fabsf(to_float(row[i])));
  const float s = scale_of(block_max(m));
  if (threadIdx.x == 0) scale[r] = s;
  const float inv = inv_scale(s);
  for (int64_t i = threadIdx.x; i < K; i += kThreads) q[r * K + i] = to_e4m3(__fmul_rn(to_float(row[i]), inv));
}

// amax_bits must be zeroed first; non-negative floats order like their bit patterns.
template <typename T>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T* __restrict__ x, int64_t n, unsigned* amax_bits) {
  float m = 0.f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    m = fmaxf(m, fabsf(to_float(x[i])));
  m = block_max(m);
  if (threadIdx.x == 0) atomicMax(amax_bits, __float_as_uint(m));
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_tensorwise_kernel(const T* __restrict__ x, int64_t n, const float* amax, uint8_t* __restrict__ q) {
  const float inv = inv_scale(scale_of(*amax));
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    q[i] = to_e4m3(__fmul_rn(to_float(x[i]), inv));
}

__global__ void amax_to_scale_kernel(float* scale) { scale[0] = scale_of(scale[0]); }

}  // namespace

void quantize_rowwise(const TensorView& x, const TensorView& q, const TensorView& scale, void* stream) {
  const int64_t K = x.shape[x.ndim - 1], rows = scale.numel();
  if (rows == 0) return;
  MOE8_DISPATCH_FLOAT(x.dtype, "quantize_rowwise: x", [&] {
    using T = scalar_t;
    quantize_rowwise_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, as_stream(stream)>>>(
        x.ptr<T>(), K, q.ptr<uint8_t>(), scale.ptr<float>());
    check_launch("quantize_rowwise_kernel");
  });
}

void quantize_tensorwise(const TensorView& x, const TensorView& q, const TensorView& scale, void* stream) {
  const int64_t n = x.numel();
  cudaStream_t s = as_stream(stream);
  // scale[0] holds the amax until the last kernel turns it into the scale.
  cuda_check(cudaMemsetAsync(scale.data, 0, sizeof(float), s), "quantize_tensorwise: cudaMemsetAsync");
  MOE8_DISPATCH_FLOAT(x.dtype, "quantize_tensorwise: x", [&] {
    using T = scalar_t;
    if (n > 0) {
      amax_kernel<T><<<grid_stride_blocks(n), kThreads, 0, s>>>(x.ptr<T>(), n, static_cast<unsigned*>(scale.data));
      check_launch("amax_kernel");
      quantize_tensorwise_kernel<T>
          <<<grid_stride_blocks(n), kThreads, 0, s>>>(x.ptr<T>(), n, scale.ptr<float>(), q.ptr<uint8_t>());
      check_launch("quantize_tensorwise_kernel");
    }
    amax_to_scale_kernel<<<1, 1, 0, s>>>(scale.ptr<float>());
    check_launch("amax_to_scale_kernel");
  });
}

}  // namespace moe8::cuda
