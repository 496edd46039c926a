// dequantize.cu — FP8 e4m3 codes times their block scales back to a float dtype (dequantize; semantics:
// cpu/ops.h). Rows a multiple of 16 codes wide, with column blocks of a multiple of 16 (blockwise 128x128,
// rowwise): each thread turns 16 codes of one block (one 16-byte load) into 16 values (16-byte stores), 32-bit
// index math once per 16; any other shape: one thread per element. Grid-stride both.
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

constexpr int kVec = 16;  // codes per thread and iteration: one 16-byte load

// chunks: numel / 16 (< 2^31); per_row: K / 16; per_block: bk / 16; bm: min(bm, M) (m / bm the same); M, SM,
// SK as above
template <typename T>
__global__ void __launch_bounds__(kThreads)
    dequantize_vec_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scale, uint32_t chunks,
                          uint32_t per_row, uint32_t per_block, uint32_t M, uint32_t bm, uint32_t SM, uint32_t SK,
                          T* __restrict__ out) {
  for (uint32_t c = blockIdx.x * kThreads + threadIdx.x; c < chunks; c += gridDim.x * kThreads) {
    const uint32_t row = c / per_row, kc = c - row * per_row;
    const uint32_t b = row / M, m = row - b * M;
    const float s = scale[(static_cast<size_t>(b) * SM + m / bm) * SK + kc / per_block];
    const uint4 codes = reinterpret_cast<const uint4*>(q)[c];
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&codes);
    alignas(16) T vals[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) vals[j] = from_float<T>(e4m3_value(bytes[j]) * s);
    uint4* dst = reinterpret_cast<uint4*>(out + static_cast<size_t>(c) * kVec);
#pragma unroll
    for (int j = 0; j < static_cast<int>(kVec * sizeof(T) / sizeof(uint4)); ++j)
      dst[j] = reinterpret_cast<const uint4*>(vals)[j];
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void dequantize(const TensorView& q, const TensorView& scale, int64_t block_rows, int64_t block_cols,
                const TensorView& out, void* stream) {
  const int64_t total = q.numel(), M = q.shape[q.ndim - 2], K = q.shape[q.ndim - 1];
  if (total == 0) return;
  const int64_t chunks = total / kVec;  // rows (total / K) are fewer: K is a multiple of 16 on this path
  const bool vec = K % kVec == 0 && block_cols % kVec == 0 && chunks < (int64_t{1} << 31) && aligned16(q.data) &&
                   aligned16(out.data);
  MOE8_DISPATCH_FLOAT(out.dtype, "dequantize: out", [&] {
    using T = scalar_t;
    if (vec) {
      const int64_t SM = (M + block_rows - 1) / block_rows, SK = (K + block_cols - 1) / block_cols;
      dequantize_vec_kernel<T><<<grid_stride_blocks(chunks), kThreads, 0, as_stream(stream)>>>(
          q.ptr<uint8_t>(), scale.ptr<float>(), static_cast<uint32_t>(chunks), static_cast<uint32_t>(K / kVec),
          static_cast<uint32_t>(block_cols / kVec), static_cast<uint32_t>(M),
          static_cast<uint32_t>(std::min<int64_t>(block_rows, M)), static_cast<uint32_t>(SM), static_cast<uint32_t>(SK),
          out.ptr<T>());
      check_launch("dequantize_vec_kernel");
      return;
    }
    dequantize_kernel<T><<<grid_stride_blocks(total), kThreads, 0, as_stream(stream)>>>(
        q.ptr<uint8_t>(), scale.ptr<float>(), total, M, K, block_rows, block_cols, out.ptr<T>());
    check_launch("dequantize_kernel");
  });
}

}  // namespace moe8::cuda
