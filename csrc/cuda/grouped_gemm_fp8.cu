// grouped_gemm_fp8.cu — the portable blockwise FP8 grouped GEMM (grouped_gemm_fp8; semantics: cpu/ops.h):
// any GPU, any shape, slow. The Hopper kernel is grouped_gemm_fp8_sm90.cu.
#include <cstdint>

#include "core/fp8.h"
#include "cuda/common.cuh"
#include "cuda/ops.h"
#include "cuda/quant.cuh"
#include "cuda/rowwise.cuh"

namespace moe8::cuda {
using namespace quant;  // the shared helpers (quant.cuh)
namespace {

// One thread per output (grid: rows x 128-column chunks): slow, but any GPU and any shape. Row r's group is
// found by binary search, which never leaves [0, E) even for offsets the API did not check.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    grouped_gemm_fp8_kernel(const uint8_t* __restrict__ a, const float* __restrict__ sa, const uint8_t* __restrict__ b,
                            const float* __restrict__ sb, const int32_t* __restrict__ offsets, int groups, int64_t R,
                            int64_t N, int64_t K, T* __restrict__ c) {
  const int64_t r = blockIdx.x, n = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (n >= N) return;
  const int64_t e = group_of_row(offsets, groups, r), KB = quant_blocks(K), NB = quant_blocks(N);
  if (e < 0) {  // no group's row (past offsets[E]; or before offsets[0], which only unchecked offsets leave)
    c[r * N + n] = from_float<T>(0.f);
    return;
  }
  const uint8_t* x = a + r * K;
  const uint8_t* w = b + (e * N + n) * K;
  float acc = 0.f;
  for (int64_t kb = 0; kb < KB; ++kb) {
    float part = 0.f;
    for (int64_t k = kb * kQuantBlock; k < min(K, (kb + 1) * kQuantBlock); ++k)
      part += e4m3_value(x[k]) * e4m3_value(w[k]);
    acc += part * (sa[r * KB + kb] * sb[(e * NB + n / kQuantBlock) * KB + kb]);
  }
  c[r * N + n] = from_float<T>(acc);
}

}  // namespace

void grouped_gemm_fp8(const TensorView& a, const TensorView& a_scale, const TensorView& b, const TensorView& b_scale,
                      const TensorView& offsets, const TensorView& c, void* stream) {
  const int64_t R = a.shape[0], K = a.shape[1], N = b.shape[1];
  const int groups = static_cast<int>(b.shape[0]);
  if (R == 0 || N == 0) return;
  MOE8_DISPATCH_FLOAT(c.dtype, "grouped_gemm_fp8: c", [&] {
    using T = scalar_t;
    const dim3 grid(static_cast<unsigned>(R), static_cast<unsigned>(ceil_div(N, 128)));
    grouped_gemm_fp8_kernel<T><<<grid, 128, 0, as_stream(stream)>>>(
        a.ptr<uint8_t>(), a_scale.ptr<float>(), b.ptr<uint8_t>(), b_scale.ptr<float>(), offsets.ptr<int32_t>(), groups,
        R, N, K, c.ptr<T>());
    check_launch("grouped_gemm_fp8_kernel");
  });
}

}  // namespace moe8::cuda
