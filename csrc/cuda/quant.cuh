// quant.cuh — what the FP8 e4m3 quantisation kernels share (quant_rows.cu, quant_weight.cu, quant_cols.cu,
// swiglu_quant.cu, quant_rowwise.cu, dequantize.cu, grouped_gemm_fp8.cu): the e4m3 conversions, the scale of
// an amax, warp and block maxima, packed loads, encodes and stores, and the 1x128 row machinery (a warp per
// row, 16 lanes per 128-column block).
// Bit-exactness with the CPU reference (semantics: cpu/ops.h; conversion and NaN policy: core/fp8.h) rests
// on three things: amax is a max (order-free; fmaxf drops NaN like the CPU's compare), the scale, its
// reciprocal and x * (1 / scale) are IEEE-rounded (__fdiv_rn, __frcp_rn, __fmul_rn, whatever the fast-math
// flags), and the cast is the hardware's round-to-nearest-even satfinite conversion that core/fp8.h
// reproduces.
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>

#include "core/fp8.h"
#include "cuda/common.cuh"
#include "cuda/rowwise.cuh"

namespace moe8::cuda::quant {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

__device__ __forceinline__ uint8_t to_e4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float e4m3_value(uint8_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3)));  // exact: e4m3 is a subset of f16
}

__device__ __forceinline__ float scale_of(float amax) { return amax > 0.f ? __fdiv_rn(amax, kE4M3Max) : 1.f; }
// core/fp8.h's e4m3_inv_scale: the values are multiplied by it (one rounding each, as on the CPU).
__device__ __forceinline__ float inv_scale(float s) { return __frcp_rn(s); }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Max over the block of Warps warps (all threads must call); the result is returned to every thread.
template <int Warps = kWarpsPerBlock>
__device__ __forceinline__ float block_max(float v) {
  __shared__ float part[Warps];
  v = warp_max(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // `part` may still be read from a previous call
  if (lane == 0) part[warp] = v;
  __syncthreads();
  float m = lane < Warps ? part[lane] : 0.f;
  return warp_max(m);
}

// V consecutive values of a row starting at column k0 (zeros past K); one vector load when the caller
// knows the row's packs are aligned (vec) and the V are in range.
template <int V, typename T>
__device__ __forceinline__ void load_n(const T* row, int64_t k0, int64_t K, bool vec, float (&v)[V]) {
  if (vec && k0 + V <= K) {
    const Pack<T, V> p = *reinterpret_cast<const Pack<T, V>*>(row + k0);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = to_float(p.v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = k0 + j < K ? to_float(row[k0 + j]) : 0.f;
  }
}

// The e4m3 codes of V values times inv, packed 4 to a word (value j in byte j % 4 of word j / 4), two
// values per conversion instruction.
template <int V>
__device__ __forceinline__ void encode_n(const float (&v)[V], float inv, uint32_t (&w)[V / 4]) {
  static_assert(V % 4 == 0, "whole words");
#pragma unroll
  for (int i = 0; i < V / 4; ++i) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(v[4 * i], inv), __fmul_rn(v[4 * i + 1], inv)),
                                                 __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(
        make_float2(__fmul_rn(v[4 * i + 2], inv), __fmul_rn(v[4 * i + 3], inv)), __NV_SATFINITE, __NV_E4M3);
    w[i] = lo | (hi << 16);
  }
}

// Writes V codes at row[k0 ..] (those before K): one 4- or 8-byte store when vec and all V are in range.
template <int V>
__device__ __forceinline__ void store_codes(uint8_t* row, int64_t k0, int64_t K, bool vec, const uint32_t (&w)[V / 4]) {
  static_assert(V == 4 || V == 8, "4 or 8 codes per store");
  if (vec && k0 + V <= K) {
    if constexpr (V == 4)
      *reinterpret_cast<uint32_t*>(row + k0) = w[0];
    else
      *reinterpret_cast<uint2*>(row + k0) = make_uint2(w[0], w[1]);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j)
      if (k0 + j < K) row[k0 + j] = static_cast<uint8_t>(w[j / 4] >> (8 * (j % 4)));
  }
}

template <int V>
__device__ __forceinline__ void store_n(uint8_t* row, int64_t k0, int64_t K, bool vec, const float (&v)[V], float s) {
  uint32_t w[V / 4];
  encode_n(v, inv_scale(s), w);
  store_codes<V>(row, k0, K, vec, w);
}

// The 1x128 row kernels: a warp per row, its two half warps taking the row's 128-column blocks in turn
// (half h: blocks h, h + 2, ...), 16 lanes per block with 8 values each (one 16-byte load). The row's
// source is resolved once and no lane divides an index per block, which keeps the kernels memory-bound
// rather than issue-bound (docs/kernels.md).
constexpr int kLaneVals = 8;
constexpr int kBlockLanes = kQuantBlock / kLaneVals;  // 16

__device__ __forceinline__ float half_warp_max(float v) {
#pragma unroll
  for (int o = kBlockLanes / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The scale of the 128 values 16 lanes hold (8 each; all 32 lanes must call).
__device__ __forceinline__ float block_scale(const float (&v)[kLaneVals]) {
  float m = 0.f;
#pragma unroll
  for (int j = 0; j < kLaneVals; ++j) m = fmaxf(m, fabsf(v[j]));
  return scale_of(half_warp_max(m));
}

// The lane's place in its row: block b0 + half() of each step of two, columns k0 .. k0 + 7 of it.
__device__ __forceinline__ int half() { return (threadIdx.x / kBlockLanes) % 2; }
__device__ __forceinline__ int64_t lane_col(int64_t b) {
  return b * kQuantBlock + (threadIdx.x % kBlockLanes) * kLaneVals;
}

// Quantises block b of row r of q [., K] from the lane's 8 values (columns lane_col(b) ..): its scale and
// codes. All 32 lanes call it (the block's max is a half-warp shuffle); only live ones write.
__device__ __forceinline__ void quantize_block(const float (&v)[kLaneVals], bool live, int64_t r, int64_t b, int64_t K,
                                               bool vec, uint8_t* q, float* scale) {
  const float s = block_scale(v);
  if (!live) return;
  if (threadIdx.x % kBlockLanes == 0) scale[r * quant_blocks(K) + b] = s;
  store_n(q + r * K, lane_col(b), K, vec, v, s);
}

// Grid of the row kernels: a warp per row.
inline unsigned blocks_for_rows(int64_t rows) { return static_cast<unsigned>(ceil_div(rows, kWarpsPerBlock)); }
__device__ __forceinline__ int64_t warp_row() {
  return static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
}

inline bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Grid of the grid-stride kernels: a block per kThreads elements, at most 4096 blocks.
inline unsigned grid_stride_blocks(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, kThreads), 4096)));
}

}  // namespace moe8::cuda::quant
