// rowwise.cuh — what the row-wise kernels share (activation, permute, rope, lowrank_add, the FP8 GEMM):
// 16-byte packs of a row and when they can be used, the launch shape (a block is blockDim.y rows by
// blockDim.x packs of V consecutive columns), the expert group of a row, and a token's rows for the
// token-major kernels.
#pragma once
#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "cuda/common.cuh"

namespace moe8::cuda {

constexpr int kRowwiseThreads = 256;

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// True when rows of `cols` elements can move as 16-byte packs: cols a multiple of the pack and every
// pointer 16-byte aligned.
template <typename T>
bool use_packs(int64_t cols, std::initializer_list<const void*> ptrs) {
  constexpr int V = 16 / sizeof(T);
  if (cols % V != 0) return false;
  for (const void* q : ptrs)
    if (reinterpret_cast<uintptr_t>(q) % 16 != 0) return false;
  return true;
}

struct RowGrid {
  dim3 grid, block;
};

// x: packs of a row (whole warps, at most kRowwiseThreads); y: rows filling the rest of the block.
// grid.x: row tiles, grid.y: pack tiles.
inline RowGrid row_grid(int64_t rows, int64_t packs) {
  const int64_t tx = std::min<int64_t>(kRowwiseThreads, ceil_div(packs, 32) * 32), ty = kRowwiseThreads / tx;
  return {dim3(static_cast<unsigned>(ceil_div(rows, ty)), static_cast<unsigned>(ceil_div(packs, tx))),
          dim3(static_cast<unsigned>(tx), static_cast<unsigned>(ty))};
}

// The group e with offsets[e] <= r < offsets[e+1] (offsets [E+1], nondecreasing), or -1 when r is in none.
__device__ __forceinline__ int group_of_row(const int32_t* __restrict__ offsets, int E, int64_t r) {
  if (r < offsets[0] || r >= offsets[E]) return -1;
  int lo = 0, hi = E;  // offsets[lo] <= r < offsets[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (offsets[mid] <= r)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// The token-major kernels (permute.cu's scatter_rows, quant_rows.cu's quantize_scatter) take a token's rows from
// the plan's slot_to_row and keep them in registers: k <= kScatterMaxK (their launchers fall back to the
// row-by-row kernels past it). r[j] = slot_to_row[t k + j] for j < k, -1 after.
constexpr int kScatterMaxK = 8;

__device__ __forceinline__ void token_rows(const int32_t* __restrict__ slot_to_row, int64_t t, int k,
                                           int64_t (&r)[kScatterMaxK]) {
#pragma unroll
  for (int j = 0; j < kScatterMaxK; ++j) r[j] = j < k ? slot_to_row[t * k + j] : -1;
}

}  // namespace moe8::cuda
