// quant_cols.cu — FP8 e4m3 1x128 column quantisation for the weight gradient (quantize_cols_1x128): each
// group's rows in blocks of 128 down every column, written transposed (semantics: cpu/ops.h), bit-exact with
// the CPU reference (quant.cuh says why). One block per (128-row block of a group, 64 columns), staged in
// shared memory.
#include <cstdint>

#include "core/fp8.h"
#include "cuda/common.cuh"
#include "cuda/ops.h"
#include "cuda/quant.cuh"

namespace moe8::cuda {
using namespace quant;  // the shared helpers (quant.cuh)
namespace {

constexpr int kColTile = 64;

// Grid (blocks, ceil(K / 64)). Block b of the group numbering in cpu/ops.h; blocks past the last one set
// their scales to 1 and zero the columns of q_t past offsets[E] (together they cover them: see below). Groups
// are read through group_range, so offsets the API did not check give wrong numbers (columns past the blocks
// may stay unwritten), never an access outside x, q_t or scale.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_cols_kernel(const T* __restrict__ x, const int32_t* __restrict__ offsets, int groups, int64_t R, int64_t K,
                         int64_t nblocks, uint8_t* __restrict__ q_t, float* __restrict__ scale) {
  __shared__ float tile[kQuantBlock][kColTile + 1];
  __shared__ float part[kThreads / kColTile][kColTile];
  __shared__ int64_t info[4];  // r0, r1 (rows of this block; r0 = -1: a tail block), used rows, used blocks
  const int64_t b = blockIdx.x, c0 = static_cast<int64_t>(blockIdx.y) * kColTile;
  if (threadIdx.x < 32) {
    // Find the group of block b: lanes count the blocks of consecutive runs of groups, a warp scan turns
    // the counts into first block numbers, and the lane whose run holds b walks it.
    const int lane = threadIdx.x, per = (groups + 31) / 32;
    const int e0 = min(groups, lane * per), e1 = min(groups, e0 + per);
    int64_t local = 0;
    for (int e = e0; e < e1; ++e) {
      int64_t begin, end;
      group_range(offsets, e, R, begin, end);
      local += quant_blocks(end - begin);
    }
    int64_t incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t t = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += t;
    }
    const int64_t total = __shfl_sync(0xffffffffu, incl, 31);
    if (lane == 0) {
      info[0] = -1;
      info[1] = -1;
      info[2] = min(R, max(int64_t{0}, static_cast<int64_t>(offsets[groups])));
      info[3] = total;
    }
    __syncwarp();
    int64_t base = incl - local;
    if (b >= base && b < incl) {  // exactly one lane, unless b is a tail block
      for (int e = e0; e < e1; ++e) {
        int64_t begin, end;
        group_range(offsets, e, R, begin, end);
        const int64_t nb = quant_blocks(end - begin);
        if (b < base + nb) {
          const int64_t r0 = begin + (b - base) * kQuantBlock;
          info[0] = r0;
          info[1] = min(end, r0 + kQuantBlock);
          break;
        }
        base += nb;
      }
    }
  }
  __syncthreads();
  const int64_t r0 = info[0], n = info[1] - info[0], used = info[2], used_blocks = info[3];
  const int c = threadIdx.x % kColTile, sub = threadIdx.x / kColTile;  // column in the tile, row phase (0..3)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kColsPerWarp = kColTile / kWarpsPerBlock;  // 8
  if (r0 < 0) {
    // Tail: scale 1; and zero q_t[:, used:R] in 128-row chunks shared among the tail blocks. There are
    // enough: sum_e ceil(count_e / 128) <= ceil(used / 128) + E - 1, so the nblocks - used_blocks tail
    // blocks number at least ceil(R / 128) - ceil(used / 128) + 1 >= ceil((R - used) / 128).
    if (sub == 0 && c0 + c < K) scale[b * K + c0 + c] = 1.f;
    for (int64_t j = b - used_blocks; used + j * kQuantBlock < R; j += nblocks - used_blocks) {
      const int64_t rs = used + j * kQuantBlock, re = min(R, rs + kQuantBlock);
      for (int cc = 0; cc < kColsPerWarp; ++cc) {
        const int64_t col = c0 + warp * kColsPerWarp + cc;
        if (col >= K) break;
        for (int64_t r = rs + lane; r < re; r += 32) q_t[col * R + r] = 0;
      }
    }
    return;
  }
  // Load the block's rows (coalesced along columns), keep per-thread column maxima.
  float m = 0.f;
  for (int i = sub; i < kQuantBlock; i += kThreads / kColTile) {
    float v = 0.f;
    if (i < n && c0 + c < K) v = to_float(x[(r0 + i) * K + c0 + c]);
    tile[i][c] = v;
    m = fmaxf(m, fabsf(v));
  }
  part[sub][c] = m;
  __syncthreads();
  if (sub == 0) {
#pragma unroll
    for (int p = 1; p < kThreads / kColTile; ++p) m = fmaxf(m, part[p][c]);
    const float s = scale_of(m);
    part[0][c] = s;
    if (c0 + c < K) scale[b * K + c0 + c] = s;
  }
  __syncthreads();
  // Write transposed: warp w writes columns 8w .. 8w+7, each as 128 consecutive bytes of q_t's row.
  const bool vec = n == kQuantBlock && R % 4 == 0 && r0 % 4 == 0 && reinterpret_cast<uintptr_t>(q_t) % 4 == 0;
  for (int cc = 0; cc < kColsPerWarp; ++cc) {
    const int tc = warp * kColsPerWarp + cc;
    const int64_t col = c0 + tc;
    if (col >= K) break;
    const float inv = inv_scale(part[0][tc]);
    uint8_t* out = q_t + col * R + r0;
    if (vec) {
      uint32_t word = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        word |= static_cast<uint32_t>(to_e4m3(__fmul_rn(tile[lane * 4 + j][tc], inv))) << (8 * j);
      reinterpret_cast<uint32_t*>(out)[lane] = word;
    } else {
      for (int i = lane; i < n; i += 32) out[i] = to_e4m3(__fmul_rn(tile[i][tc], inv));
    }
  }
}

}  // namespace

void quantize_cols_1x128(const TensorView& x, const TensorView& offsets, const TensorView& q_t, const TensorView& scale,
                         void* stream) {
  const int64_t R = x.shape[0], K = x.shape[1], nblocks = scale.shape[0];
  const int groups = static_cast<int>(offsets.shape[0] - 1);
  if (K == 0 || nblocks == 0) return;
  MOE8_DISPATCH_FLOAT(x.dtype, "quantize_cols_1x128: x", [&] {
    using T = scalar_t;
    const dim3 grid(static_cast<unsigned>(nblocks), static_cast<unsigned>(ceil_div(K, kColTile)));
    quantize_cols_kernel<T><<<grid, kThreads, 0, as_stream(stream)>>>(x.ptr<T>(), offsets.ptr<int32_t>(), groups, R, K,
                                                                      nblocks, q_t.ptr<uint8_t>(), scale.ptr<float>());
    check_launch("quantize_cols_kernel");
  });
}

}  // namespace moe8::cuda
