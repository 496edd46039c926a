// quant_rows.cu — FP8 e4m3 1x128 row quantisation (quantize_rows_1x128), plain or fused with the permute into
// expert order (semantics: cpu/ops.h), bit-exact with the CPU reference (quant.cuh says why):
//   rows 1x128 (+ gather)  a warp per row, 16 lanes per 128-column block (its half warps alternate blocks):
//                          8 values per lane (one 16-byte load), half-warp max, scale, one 8-byte store
//   rows, token-major      with slot_to_row: a warp per token, quantised once, its codes stored to k rows
#include <cstdint>

#include "core/fp8.h"
#include "cuda/common.cuh"
#include "cuda/ops.h"
#include "cuda/quant.cuh"
#include "cuda/rowwise.cuh"

namespace moe8::cuda {
using namespace quant;  // the shared helpers (quant.cuh)
namespace {

// x: [rows, K] (or src [T, K] when gathering, num_slots = T k); row_to_slot null: no gather.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_rows_kernel(const T* __restrict__ x, const int32_t* __restrict__ row_to_slot, int k, int64_t rows,
                         int64_t K, bool vec, uint8_t* __restrict__ q, float* __restrict__ scale, int64_t num_slots) {
  const int64_t r = warp_row();
  if (r >= rows) return;
  const int64_t KB = quant_blocks(K);
  int64_t src = r;
  if (row_to_slot) {
    const int32_t slot = row_to_slot[r];
    src = slot < 0 || slot >= num_slots ? -1 : slot / k;  // padding, or out of range (unchecked input): zeros
  }
  const T* xr = src >= 0 ? x + src * K : nullptr;
#pragma unroll 2
  for (int64_t b0 = 0; b0 < KB; b0 += 2) {  // the same steps for both halves: the shuffles see the whole warp
    const int64_t b = b0 + half(), k0 = lane_col(b);
    const bool live = b < KB;
    float v[kLaneVals] = {};
    if (live && xr) load_n(xr, k0, K, vec, v);
    quantize_block(v, live, r, b, K, vec, q, scale);
  }
}

// The same rows token-major (x [T, K], each token's k rows slot_to_row[t k .. t k + k - 1], -1: none): a warp
// per token reads and quantises its blocks once and writes the codes to each of its rows, so the tokens
// are read once rather than k times (with L2 misses at large T K) and the quantisation runs once per token
// rather than per row. Rows no slot names are left to zero_unmapped_rows_kernel. k <= kScatterMaxK.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_scatter_kernel(const T* __restrict__ x, const int32_t* __restrict__ slot_to_row, int k, int64_t tokens,
                            int64_t K, bool vec, uint8_t* __restrict__ q, float* __restrict__ scale, int64_t rows) {
  const int64_t t = warp_row();
  if (t >= tokens) return;
  const int64_t KB = quant_blocks(K);
  int64_t dst[kScatterMaxK];
  token_rows(slot_to_row, t, k, dst);
#pragma unroll
  for (int j = 0; j < kScatterMaxK; ++j)
    if (dst[j] >= rows) dst[j] = -1;  // a row out of range (unchecked input): not stored
  const T* xr = x + t * K;
  for (int64_t b0 = 0; b0 < KB; b0 += 2) {
    const int64_t b = b0 + half(), k0 = lane_col(b);
    const bool live = b < KB;
    float v[kLaneVals] = {};
    if (live) load_n(xr, k0, K, vec, v);
    const float s = block_scale(v);
    if (!live) continue;
    uint32_t w[kLaneVals / 4];
    encode_n(v, inv_scale(s), w);
#pragma unroll
    for (int j = 0; j < kScatterMaxK; ++j) {
      if (dst[j] < 0) continue;
      if (threadIdx.x % kBlockLanes == 0) scale[dst[j] * KB + b] = s;
      store_codes<kLaneVals>(q + dst[j] * K, k0, K, vec, w);
    }
  }
}

// Rows r with row_to_slot[r] < 0 (padding) or past num_slots (unchecked input): zero codes, scale 1 (what
// quantize_rows_kernel writes there).
__global__ void __launch_bounds__(kThreads)
    zero_unmapped_rows_kernel(const int32_t* __restrict__ row_to_slot, int64_t rows, int64_t K, uint8_t* __restrict__ q,
                              float* __restrict__ scale, int64_t num_slots) {
  const int64_t r = warp_row();
  if (r >= rows) return;
  const int32_t slot = row_to_slot[r];
  if (slot >= 0 && slot < num_slots) return;
  const int lane = threadIdx.x % 32;
  for (int64_t i = lane; i < K; i += 32) q[r * K + i] = 0;
  const int64_t KB = quant_blocks(K);
  for (int64_t b = lane; b < KB; b += 32) scale[r * KB + b] = 1.f;
}

}  // namespace

void quantize_rows_1x128(const TensorView& x, const TensorView& row_to_slot, const TensorView& slot_to_row, int k,
                         const TensorView& q, const TensorView& scale, void* stream) {
  const int64_t rows = q.shape[0], K = q.shape[1];
  if (rows == 0 || K == 0) return;
  cudaStream_t s = as_stream(stream);
  MOE8_DISPATCH_FLOAT(x.dtype, "quantize_rows_1x128: x", [&] {
    using T = scalar_t;
    const bool vec = K % kLaneVals == 0 && aligned(x.data, sizeof(T) * kLaneVals) && aligned(q.data, kLaneVals);
    if (row_to_slot.present && slot_to_row.present && k <= kScatterMaxK) {
      const int64_t tokens = x.shape[0];
      zero_unmapped_rows_kernel<<<blocks_for_rows(rows), kThreads, 0, s>>>(
          row_to_slot.ptr<int32_t>(), rows, K, q.ptr<uint8_t>(), scale.ptr<float>(), tokens * k);
      check_launch("zero_unmapped_rows_kernel");
      if (tokens == 0) return;
      quantize_scatter_kernel<T><<<blocks_for_rows(tokens), kThreads, 0, s>>>(
          x.ptr<T>(), slot_to_row.ptr<int32_t>(), k, tokens, K, vec, q.ptr<uint8_t>(), scale.ptr<float>(), rows);
      check_launch("quantize_scatter_kernel");
      return;
    }
    quantize_rows_kernel<T><<<blocks_for_rows(rows), kThreads, 0, s>>>(
        x.ptr<T>(), row_to_slot.present ? row_to_slot.ptr<int32_t>() : nullptr, k, rows, K, vec, q.ptr<uint8_t>(),
        scale.ptr<float>(), x.shape[0] * static_cast<int64_t>(k));
    check_launch("quantize_rows_kernel");
  });
}

}  // namespace moe8::cuda
