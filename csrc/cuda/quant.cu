// quant.cu — FP8 e4m3 quantisation kernels of the training recipes (semantics: cpu/ops.h; conversion and
// NaN policy: core/fp8.h), bit-exact with the CPU reference:
//   rows 1x128 (+ gather)  a warp per row, 16 lanes per 128-column block (its half warps alternate blocks):
//                          8 values per lane (one 16-byte load), half-warp max, scale, one 8-byte store
//   rows, token-major      with slot_to_row: a warp per token, quantised once, its codes stored to k rows
//   weight 128x128         512-thread blocks walking the tiles (the next tile's loads in flight), 32 values
//                          per thread held as loaded; optionally the transposed layout too, via shared memory
//   cols 1x128 (wgrad)     one block per (128-row block of a group, 64 columns), staged in shared memory
//                          and written transposed
//   swiglu_quant           rows 1x128 with the activation computed on the way (activation.cuh), 16-byte
//                          loads of gate and up
//   rowwise / tensorwise   block per row / grid-wide amax (atomicMax on the float bits) then a cast
//   dequantize             one thread per element
// Bit-exactness rests on three things: amax is a max (order-free; fmaxf drops NaN like the CPU's compare),
// the scale, its reciprocal and x * (1 / scale) are IEEE-rounded (__fdiv_rn, __frcp_rn, __fmul_rn, whatever the
// fast-math flags), and the cast is the
// hardware's round-to-nearest-even satfinite conversion that core/fp8.h reproduces.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/fp8.h"
#include "cuda/activation.cuh"
#include "cuda/common.cuh"
#include "cuda/ops.h"
#include "cuda/rowwise.cuh"

namespace moe8::cuda {
namespace {

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
// source is resolved once and no lane divides an index per block: ncu showed the earlier form (a half warp
// per (row, block) item, found by 64-bit division) issue-bound at 84% of the issue slots, not memory-bound.
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

// ---------------------------------------------------------------------------------------- rows 1x128

// x: [rows, K] (or src [T, K] when gathering); row_to_slot null: no gather.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    quantize_rows_kernel(const T* __restrict__ x, const int32_t* __restrict__ row_to_slot, int k, int64_t rows,
                         int64_t K, bool vec, uint8_t* __restrict__ q, float* __restrict__ scale) {
  const int64_t r = warp_row();
  if (r >= rows) return;
  const int64_t KB = quant_blocks(K);
  int64_t src = r;
  if (row_to_slot) {
    const int32_t slot = row_to_slot[r];
    src = slot < 0 ? -1 : slot / k;
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
                            int64_t K, bool vec, uint8_t* __restrict__ q, float* __restrict__ scale) {
  const int64_t t = warp_row();
  if (t >= tokens) return;
  const int64_t KB = quant_blocks(K);
  int64_t dst[kScatterMaxK];
  token_rows(slot_to_row, t, k, dst);
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

// Rows r with row_to_slot[r] < 0 (padding): zero codes, scale 1 (what quantize_rows_kernel writes there).
__global__ void __launch_bounds__(kThreads)
    zero_unmapped_rows_kernel(const int32_t* __restrict__ row_to_slot, int64_t rows, int64_t K, uint8_t* __restrict__ q,
                              float* __restrict__ scale) {
  const int64_t r = warp_row();
  if (r >= rows || row_to_slot[r] >= 0) return;
  const int lane = threadIdx.x % 32;
  for (int64_t i = lane; i < K; i += 32) q[r * K + i] = 0;
  const int64_t KB = quant_blocks(K);
  for (int64_t b = lane; b < KB; b += 32) scale[r * KB + b] = 1.f;
}

// ------------------------------------------------------------------------------------ weight 128x128

// 512-thread blocks, two per SM (one for float), each walking tiles (e, nb, kb) t = blockIdx.x, + gridDim.x, ...:
// thread t owns columns 4 (t % 32) .. +3 of rows t / 32 + 16 i, i < 8, held as loaded (8 packs of 4), and issues the
// loads of its next tile before it reduces and stores the current one (load, block max and store in turn
// leave a block latency-bound: as one 256-thread block per tile, 93 registers and 16 warps per SM, this moved
// ~1.2 TB/s on the H200, as one 512-thread block per tile ~2.0, walking tiles like this 3.1-3.7 TB/s;
// bench_fp8_refresh.py).
// With q_t (the other layout, [E, K, N], and scale_t [E, KB, NB]) the tile's codes are also staged in shared
// memory and written transposed: the same codes and scale, so the dgrad's copy costs one more byte per weight
// written, instead of a second pass. vec_t: N % 4 == 0 and q_t aligned (4-byte stores of 4 columns n).
constexpr int kWeightThreads = 512, kWeightWarps = kWeightThreads / 32;
constexpr int kWeightRows = kQuantBlock / kWeightWarps;  // rows per thread: 8
// Blocks per SM (the launch bounds: 64 registers for 16-bit T; float's two tiles of values need ~113).
template <typename T>
constexpr int weight_blocks_per_sm() {
  return sizeof(T) == 4 ? 1 : 2;
}

// Tile t of w [E, N, K] and this thread's part of it: its first element, the tile's rows / cols in range.
struct WeightTile {
  int64_t e, nb, kb, first;
  int rows, cols;
  bool packed;  // this thread's 4 columns in range and vector-aligned
};

__device__ __forceinline__ WeightTile weight_tile(int64_t t, int64_t N, int64_t K, bool vec) {
  const int64_t NB = quant_blocks(N), KB = quant_blocks(K);
  WeightTile g;
  g.e = t / (NB * KB);
  g.nb = (t / KB) % NB;
  g.kb = t % KB;
  const int r0 = threadIdx.x / 32, c = (threadIdx.x % 32) * 4;
  g.rows = static_cast<int>(min(static_cast<int64_t>(kQuantBlock), N - g.nb * kQuantBlock));
  g.cols = static_cast<int>(min(static_cast<int64_t>(kQuantBlock), K - g.kb * kQuantBlock));
  g.packed = vec && c + 4 <= g.cols;
  g.first = (g.e * N + g.nb * kQuantBlock + r0) * K + g.kb * kQuantBlock + c;
  return g;
}

// 4 values of T as loaded, their bits packed in 32-bit words (a Pack of 16-bit T would take a register per
// value, and two tiles of them, this one and the next in flight, would not fit in 64 registers).
template <typename T>
struct alignas(4 * sizeof(T)) RawPack {
  uint32_t w[sizeof(T)];
  __device__ __forceinline__ float at(int j) const {
    if constexpr (sizeof(T) == 4) {
      return __uint_as_float(w[j]);
    } else {
      const uint32_t bits = (w[j / 2] >> (16 * (j % 2))) & 0xffffu;
      if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return __uint_as_float(bits << 16);
      else
        return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
    }
  }
};

template <typename T>
__device__ __forceinline__ void load_tile(const T* w, const WeightTile& g, int64_t K, RawPack<T> (&raw)[kWeightRows]) {
  using Bits = std::conditional_t<sizeof(T) == 2, uint16_t, uint32_t>;
  const int r0 = threadIdx.x / 32, c = (threadIdx.x % 32) * 4;
  const T* src = w + g.first;
#pragma unroll
  for (int i = 0; i < kWeightRows; ++i, src += kWeightWarps * K) {
    const bool live = r0 + kWeightWarps * i < g.rows;
    if (live && g.packed) {
      raw[i] = *reinterpret_cast<const RawPack<T>*>(src);
    } else {
#pragma unroll
      for (int j = 0; j < static_cast<int>(sizeof(T)); ++j) raw[i].w[j] = 0;  // 0 bits: +0
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t bits = live && c + j < g.cols ? reinterpret_cast<const Bits*>(src)[j] : 0u;
        if constexpr (sizeof(T) == 4)
          raw[i].w[j] = bits;
        else
          raw[i].w[j / 2] |= bits << (16 * (j % 2));
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kWeightThreads, weight_blocks_per_sm<T>())
    quantize_weight_kernel(const T* __restrict__ w, int64_t N, int64_t K, int64_t tiles, bool vec,
                           uint8_t* __restrict__ q, float* __restrict__ scale, uint8_t* __restrict__ q_t,
                           float* __restrict__ scale_t, bool vec_t) {
  constexpr int kStride = kQuantBlock + 4;                         // bytes per staged row (k), 4-aligned
  __shared__ __align__(16) uint8_t staged[kQuantBlock * kStride];  // [k][n] codes (with q_t)
  const int64_t NB = quant_blocks(N), KB = quant_blocks(K);
  const int r0 = threadIdx.x / 32, c = (threadIdx.x % 32) * 4;
  RawPack<T> raw[kWeightRows];
  load_tile(w, weight_tile(blockIdx.x, N, K, vec), K, raw);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t t_next = t + gridDim.x;
    RawPack<T> next[kWeightRows];
    if (t_next < tiles) load_tile(w, weight_tile(t_next, N, K, vec), K, next);  // in flight meanwhile
    const WeightTile g = weight_tile(t, N, K, vec);  // recomputed: fewer registers held across the loads
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < kWeightRows; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) m = fmaxf(m, fabsf(raw[i].at(j)));
    const float s = scale_of(block_max<kWeightWarps>(m));  // its first barrier: staged is free again
    if (threadIdx.x == 0) scale[t] = s;
    const float inv = inv_scale(s);
    uint8_t* dst = q + g.first;
#pragma unroll
    for (int i = 0; i < kWeightRows; ++i, dst += kWeightWarps * K) {
      float v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = raw[i].at(j);
      uint32_t code[1];
      encode_n(v, inv, code);
      if (r0 + kWeightWarps * i < g.rows) store_codes<4>(dst, 0, g.cols - c, g.packed, code);
      if (q_t != nullptr) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          staged[(c + j) * kStride + r0 + kWeightWarps * i] = static_cast<uint8_t>(code[0] >> (8 * j));
      }
    }
    if (q_t != nullptr) {
      if (threadIdx.x == 0) scale_t[(g.e * KB + g.kb) * NB + g.nb] = s;
      __syncthreads();
      // Row k of the tile (a warp per row, rows r0 + 16 i): lane l writes columns n0 + c .. + 3.
      uint8_t* dst_t = q_t + (g.e * K + g.kb * kQuantBlock + r0) * N + g.nb * kQuantBlock + c;
      const bool packed_t = vec_t && c + 4 <= g.rows;
#pragma unroll
      for (int i = 0; i < kWeightRows; ++i, dst_t += kWeightWarps * N) {
        const int kr = r0 + kWeightWarps * i;
        if (kr >= g.cols) break;
        const uint32_t word[1] = {*reinterpret_cast<const uint32_t*>(&staged[kr * kStride + c])};
        store_codes<4>(dst_t, 0, g.rows - c, packed_t, word);
      }
    }
#pragma unroll
    for (int i = 0; i < kWeightRows; ++i) raw[i] = next[i];
  }
}

// -------------------------------------------------------------------------------- cols 1x128 (wgrad)

constexpr int kColTile = 64;

// Grid (blocks, ceil(K / 64)). Block b of the group numbering in cpu/ops.h; blocks past the last one set
// their scales to 1 and zero the columns of q_t past offsets[E] (together they cover them: see below).
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
    for (int e = e0; e < e1; ++e) local += quant_blocks(offsets[e + 1] - offsets[e]);
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
      info[2] = offsets[groups];
      info[3] = total;
    }
    __syncwarp();
    int64_t base = incl - local;
    if (b >= base && b < incl) {  // exactly one lane, unless b is a tail block
      for (int e = e0; e < e1; ++e) {
        const int64_t begin = offsets[e], end = offsets[e + 1], nb = quant_blocks(end - begin);
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

// ------------------------------------------------------------------------------------ swiglu_quant

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

// ------------------------------------------------------------------------------ rowwise / tensorwise

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

// ------------------------------------------------------------------------------------------- dequantize

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

// ----------------------------------------------------------------------------- portable FP8 grouped GEMM

// One thread per output (grid: rows x 128-column chunks): slow, but any GPU and any shape. Row r's group is
// found by binary search.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    grouped_gemm_fp8_kernel(const uint8_t* __restrict__ a, const float* __restrict__ sa, const uint8_t* __restrict__ b,
                            const float* __restrict__ sb, const int32_t* __restrict__ offsets, int groups, int64_t R,
                            int64_t N, int64_t K, T* __restrict__ c) {
  const int64_t r = blockIdx.x, n = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (n >= N) return;
  if (r >= offsets[groups]) {
    c[r * N + n] = from_float<T>(0.f);
    return;
  }
  const int64_t e = group_of_row(offsets, groups, r), KB = quant_blocks(K), NB = quant_blocks(N);
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

unsigned grid_stride_blocks(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, kThreads), 4096)));
}

}  // namespace

// ---------------------------------------------------------------------------------------------- launchers

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
      zero_unmapped_rows_kernel<<<blocks_for_rows(rows), kThreads, 0, s>>>(row_to_slot.ptr<int32_t>(), rows, K,
                                                                           q.ptr<uint8_t>(), scale.ptr<float>());
      check_launch("zero_unmapped_rows_kernel");
      if (tokens == 0) return;
      quantize_scatter_kernel<T><<<blocks_for_rows(tokens), kThreads, 0, s>>>(
          x.ptr<T>(), slot_to_row.ptr<int32_t>(), k, tokens, K, vec, q.ptr<uint8_t>(), scale.ptr<float>());
      check_launch("quantize_scatter_kernel");
      return;
    }
    quantize_rows_kernel<T><<<blocks_for_rows(rows), kThreads, 0, s>>>(
        x.ptr<T>(), row_to_slot.present ? row_to_slot.ptr<int32_t>() : nullptr, k, rows, K, vec, q.ptr<uint8_t>(),
        scale.ptr<float>());
    check_launch("quantize_rows_kernel");
  });
}

void quantize_weight_128x128(const TensorView& w, const TensorView& q, const TensorView& scale, const TensorView& q_t,
                             const TensorView& scale_t, void* stream) {
  const int64_t E = w.shape[0], N = w.shape[1], K = w.shape[2];
  const int64_t tiles = E * quant_blocks(N) * quant_blocks(K);
  if (tiles == 0) return;
  MOE8_DISPATCH_FLOAT(w.dtype, "quantize_weight_128x128: w", [&] {
    using T = scalar_t;
    const bool vec = K % 4 == 0 && aligned(w.data, 4 * sizeof(T)) && aligned(q.data, 4);
    const bool vec_t = q_t.present && N % 4 == 0 && aligned(q_t.data, 4);
    // as many blocks as fit at once (the kernel's launch bounds), walking the tiles; at most one per tile
    const int sms = std::max(1, device_facts(current_device("quantize_weight_128x128: cudaGetDevice")).sms);
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(tiles, weight_blocks_per_sm<T>() * sms));
    quantize_weight_kernel<T><<<grid, kWeightThreads, 0, as_stream(stream)>>>(
        w.ptr<T>(), N, K, tiles, vec, q.ptr<uint8_t>(), scale.ptr<float>(), q_t.present ? q_t.ptr<uint8_t>() : nullptr,
        scale_t.present ? scale_t.ptr<float>() : nullptr, vec_t);
    check_launch("quantize_weight_kernel");
  });
}

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
