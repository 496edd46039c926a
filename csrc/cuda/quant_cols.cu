// quant_cols.cu — FP8 e4m3 1x128 column quantisation for the weight gradient (quantize_cols_1x128): each
// group's rows in blocks of 128 down every column, written transposed (semantics: cpu/ops.h), bit-exact with
// the CPU reference (quant.cuh says why). Two kernels: the packed one (2-byte x in 16-byte packs, 128 columns a
// block, the default) and the staged one (any x, 64 columns a block, one element a load); MOE8_QUANT_COLS picks
// one for comparisons (sm90_heuristics.h).
#include <cstdint>

#include "core/fp8.h"
#include "cuda/common.cuh"
#include "cuda/ops.h"
#include "cuda/quant.cuh"
#include "cuda/sm90_heuristics.h"

namespace moe8::cuda {
using namespace quant;  // the shared helpers (quant.cuh)
namespace heuristics = sm90_heuristics;
namespace {

constexpr int kColTile = 64;

// The rows of block b, as every kernel here numbers them (cpu/ops.h): r0 (-1 for a tail block, past the last
// group's blocks), r1; the rows the groups use and the blocks they number. The whole block calls it (the first
// warp finds b's group, the others wait at the barrier).
struct ColBlock {
  int64_t r0, r1, used, used_blocks;
};

__device__ ColBlock locate_col_block(const int32_t* __restrict__ offsets, int groups, int64_t R, int64_t b) {
  __shared__ int64_t info[4];
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
  return {info[0], info[1], info[2], info[3]};
}

// A tail block's work on its kCols columns from c0: scale 1; and zero q_t[:, used:R] in 128-row chunks shared
// among the tail blocks. There are enough: sum_e ceil(count_e / 128) <= ceil(used / 128) + E - 1, so the
// nblocks - used_blocks tail blocks number at least ceil(R / 128) - ceil(used / 128) + 1 >= ceil((R - used) / 128).
template <int kCols>
__device__ void tail_col_block(const ColBlock& blk, int64_t b, int64_t c0, int64_t R, int64_t K, int64_t nblocks,
                               uint8_t* __restrict__ q_t, float* __restrict__ scale) {
  constexpr int kColsPerWarp = kCols / kWarpsPerBlock;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x < kCols && c0 + threadIdx.x < K) scale[b * K + c0 + threadIdx.x] = 1.f;
  for (int64_t j = b - blk.used_blocks; blk.used + j * kQuantBlock < R; j += nblocks - blk.used_blocks) {
    const int64_t rs = blk.used + j * kQuantBlock, re = min(R, rs + kQuantBlock);
    for (int cc = 0; cc < kColsPerWarp; ++cc) {
      const int64_t col = c0 + warp * kColsPerWarp + cc;
      if (col >= K) break;
      for (int64_t r = rs + lane; r < re; r += 32) q_t[col * R + r] = 0;
    }
  }
}

// Grid (blocks, ceil(K / 64)). Block b of the group numbering in cpu/ops.h; blocks past the last one set
// their scales to 1 and zero the columns of q_t past offsets[E] (together they cover them: tail_col_block).
// Groups are read through group_range, so offsets the API did not check give wrong numbers (columns past the
// blocks may stay unwritten), never an access outside x, q_t or scale.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_cols_kernel(const T* __restrict__ x, const int32_t* __restrict__ offsets, int groups, int64_t R, int64_t K,
                         int64_t nblocks, uint8_t* __restrict__ q_t, float* __restrict__ scale) {
  __shared__ float tile[kQuantBlock][kColTile + 1];
  __shared__ float part[kThreads / kColTile][kColTile];
  const int64_t b = blockIdx.x, c0 = static_cast<int64_t>(blockIdx.y) * kColTile;
  const ColBlock blk = locate_col_block(offsets, groups, R, b);
  if (blk.r0 < 0) return tail_col_block<kColTile>(blk, b, c0, R, K, nblocks, q_t, scale);
  const int64_t r0 = blk.r0, n = blk.r1 - blk.r0;
  const int c = threadIdx.x % kColTile, sub = threadIdx.x / kColTile;  // column in the tile, row phase (0..3)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kColsPerWarp = kColTile / kWarpsPerBlock;  // 8
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

// The packed kernel, for 2-byte x whose rows move as 16-byte packs (K a multiple of 8, x 16-byte aligned): a
// block per (128-row block, 128 columns). Thread t holds columns 8 (t % 16) .. + 7 of rows 4 (t / 16) .. + 3 and
// 64 + the same: eight 16-byte loads, all issued before any use, where the staged kernel above loads one
// element a thread at a time. Column maxima: in registers over the thread's 8 rows, a shuffle with the other
// half warp, then the 8 warps through shared memory. Its codes go into shared memory transposed, 4 rows a word,
// and leave as 128 consecutive bytes of q_t's row per column and warp instruction. The same arithmetic as the
// staged kernel: the same bits.
constexpr int kPackCols = 128;
constexpr int kPackVals = 8;                                             // a 16-byte pack of 2-byte values
constexpr int kPackGroups = kPackCols / kPackVals;                       // 16 threads across a row of the tile
constexpr int kPackRowGroups = kThreads / kPackGroups;                   // 16
constexpr int kPackRows = 4;                                             // consecutive rows a thread holds per half
constexpr int kPackHalves = kQuantBlock / (kPackRowGroups * kPackRows);  // 2
constexpr int kCodeWords = kQuantBlock / 4 + 1;                          // a column of codes, 4 rows a word, padded
static_assert(kPackHalves == 2, "two halves of 64 rows");

// Three blocks an SM (at most 85 registers): 96 KB of loads in flight, each block's phases overlapping others'.
template <typename T>
__global__ void __launch_bounds__(kThreads, 3)
    quantize_cols_packed_kernel(const T* __restrict__ x, const int32_t* __restrict__ offsets, int groups, int64_t R,
                                int64_t K, int64_t nblocks, uint8_t* __restrict__ q_t, float* __restrict__ scale) {
  static_assert(sizeof(T) == 2, "8 values a 16-byte pack");
  __shared__ uint32_t codes[kPackCols][kCodeWords];
  __shared__ float part[kWarpsPerBlock][kPackCols];
  __shared__ float col_scale[kPackCols];
  const int64_t b = blockIdx.x, c0 = static_cast<int64_t>(blockIdx.y) * kPackCols;
  const ColBlock blk = locate_col_block(offsets, groups, R, b);
  if (blk.r0 < 0) return tail_col_block<kPackCols>(blk, b, c0, R, K, nblocks, q_t, scale);
  const int64_t r0 = blk.r0, n = blk.r1 - blk.r0;
  const int cg = threadIdx.x % kPackGroups, rg = threadIdx.x / kPackGroups;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t k0 = c0 + cg * kPackVals;
  const bool live_cols = k0 < K;  // K % 8 == 0: a pack is all in or all out

  Pack<T, kPackVals> v[kPackHalves][kPackRows];
#pragma unroll
  for (int h = 0; h < kPackHalves; ++h)
#pragma unroll
    for (int i = 0; i < kPackRows; ++i) {
      const int row = h * (kQuantBlock / 2) + rg * kPackRows + i;
      if (live_cols && row < n) {
        v[h][i] = *reinterpret_cast<const Pack<T, kPackVals>*>(x + (r0 + row) * K + k0);
      } else {
#pragma unroll
        for (int j = 0; j < kPackVals; ++j) v[h][i].v[j] = T(0.f);
      }
    }

  float m[kPackVals];
#pragma unroll
  for (int j = 0; j < kPackVals; ++j) {
    m[j] = 0.f;
#pragma unroll
    for (int h = 0; h < kPackHalves; ++h)
#pragma unroll
      for (int i = 0; i < kPackRows; ++i) m[j] = fmaxf(m[j], fabsf(to_float(v[h][i].v[j])));
    m[j] = fmaxf(m[j], __shfl_xor_sync(0xffffffffu, m[j], kPackGroups));  // the other row group of the warp
  }
  if (lane < kPackGroups)
#pragma unroll
    for (int j = 0; j < kPackVals; ++j) part[warp][cg * kPackVals + j] = m[j];
  __syncthreads();
  if (threadIdx.x < kPackCols) {
    float mm = part[0][threadIdx.x];
#pragma unroll
    for (int w = 1; w < kWarpsPerBlock; ++w) mm = fmaxf(mm, part[w][threadIdx.x]);
    const float s = scale_of(mm);
    col_scale[threadIdx.x] = s;
    if (c0 + threadIdx.x < K) scale[b * K + c0 + threadIdx.x] = s;
  }
  __syncthreads();

#pragma unroll
  for (int j = 0; j < kPackVals; ++j) {
    const int c = cg * kPackVals + j;
    const float inv = inv_scale(col_scale[c]);
#pragma unroll
    for (int h = 0; h < kPackHalves; ++h) {
      float f[kPackRows];
#pragma unroll
      for (int i = 0; i < kPackRows; ++i) f[i] = to_float(v[h][i].v[j]);
      uint32_t word[1];
      encode_n<kPackRows>(f, inv, word);
      codes[c][h * (kQuantBlock / 8) + rg] = word[0];  // rows 4 rg .. + 3 of half h: word (64 h + 4 rg) / 4
    }
  }
  __syncthreads();

  // Write transposed: warp w writes columns 16w .. 16w+15, each lane a word of 4 rows.
  constexpr int kColsPerWarp = kPackCols / kWarpsPerBlock;
  const bool vec = n == kQuantBlock && R % 4 == 0 && r0 % 4 == 0 && reinterpret_cast<uintptr_t>(q_t) % 4 == 0;
  for (int cc = 0; cc < kColsPerWarp; ++cc) {
    const int tc = warp * kColsPerWarp + cc;
    const int64_t col = c0 + tc;
    if (col >= K) break;
    uint8_t* out = q_t + col * R + r0;
    const uint32_t word = codes[tc][lane];
    if (vec) {
      reinterpret_cast<uint32_t*>(out)[lane] = word;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (4 * lane + j < n) out[4 * lane + j] = static_cast<uint8_t>(word >> (8 * j));
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
    if constexpr (sizeof(T) == 2) {
      if (use_packs<T>(K, {x.data}) &&
          heuristics::quant_cols_kernel(heuristics::sm90_overrides()) == heuristics::QuantCols::kPacked) {
        const dim3 grid(static_cast<unsigned>(nblocks), static_cast<unsigned>(ceil_div(K, kPackCols)));
        quantize_cols_packed_kernel<T><<<grid, kThreads, 0, as_stream(stream)>>>(
            x.ptr<T>(), offsets.ptr<int32_t>(), groups, R, K, nblocks, q_t.ptr<uint8_t>(), scale.ptr<float>());
        check_launch("quantize_cols_packed_kernel");
        return;
      }
    }
    const dim3 grid(static_cast<unsigned>(nblocks), static_cast<unsigned>(ceil_div(K, kColTile)));
    quantize_cols_kernel<T><<<grid, kThreads, 0, as_stream(stream)>>>(x.ptr<T>(), offsets.ptr<int32_t>(), groups, R, K,
                                                                      nblocks, q_t.ptr<uint8_t>(), scale.ptr<float>());
    check_launch("quantize_cols_kernel");
  });
}

}  // namespace moe8::cuda
