// quant_weight.cu — FP8 e4m3 128x128 weight quantisation (quantize_weight_128x128), optionally writing the
// transposed layout too in the same pass (semantics: cpu/ops.h), bit-exact with the CPU reference
// (quant.cuh says why): 512-thread blocks walking the tiles (the next tile's loads in flight), 32 values per
// thread held as loaded; the transposed copy goes through shared memory.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/fp8.h"
#include "cuda/common.cuh"
#include "cuda/ops.h"
#include "cuda/quant.cuh"

namespace moe8::cuda {
using namespace quant;  // the shared helpers (quant.cuh)
namespace {

// 512-thread blocks, two per SM (one for float), each walking tiles (e, nb, kb) t = blockIdx.x, + gridDim.x, ...:
// thread t owns columns 4 (t % 32) .. +3 of rows t / 32 + 16 i, i < 8, held as loaded (8 packs of 4), and issues the
// loads of its next tile before it reduces and stores the current one (load, block max and store in turn
// leave a block latency-bound; docs/kernels.md).
// With q_t (the other layout, [E, K, N], and scale_t [E, KB, NB]) the tile's codes are also staged in shared
// memory and written transposed: the same codes and scale, so the dgrad's copy costs one more byte per weight
// written, instead of a second pass. q may be null (q_t only): a weight quantised for the other layout with no
// transposed bf16 copy made first. vec_t: N % 4 == 0 and q_t aligned (4-byte stores of 4 columns n).
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
    if (threadIdx.x == 0 && scale != nullptr) scale[t] = s;
    const float inv = inv_scale(s);
    uint8_t* dst = q + g.first;  // q == nullptr (only the other layout written): never stored through
#pragma unroll
    for (int i = 0; i < kWeightRows; ++i, dst += kWeightWarps * K) {
      float v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = raw[i].at(j);
      uint32_t code[1];
      encode_n(v, inv, code);
      if (q != nullptr && r0 + kWeightWarps * i < g.rows) store_codes<4>(dst, 0, g.cols - c, g.packed, code);
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

}  // namespace

void quantize_weight_128x128(const TensorView& w, const TensorView& q, const TensorView& scale, const TensorView& q_t,
                             const TensorView& scale_t, void* stream) {
  const int64_t E = w.shape[0], N = w.shape[1], K = w.shape[2];
  const int64_t tiles = E * quant_blocks(N) * quant_blocks(K);
  if (tiles == 0) return;
  MOE8_DISPATCH_FLOAT(w.dtype, "quantize_weight_128x128: w", [&] {
    using T = scalar_t;
    const bool vec = K % 4 == 0 && aligned(w.data, 4 * sizeof(T)) && (!q.present || aligned(q.data, 4));
    const bool vec_t = q_t.present && N % 4 == 0 && aligned(q_t.data, 4);
    // as many blocks as fit at once (the kernel's launch bounds), walking the tiles; at most one per tile
    const int sms = std::max(1, device_facts(current_device("quantize_weight_128x128: cudaGetDevice")).sms);
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(tiles, weight_blocks_per_sm<T>() * sms));
    quantize_weight_kernel<T><<<grid, kWeightThreads, 0, as_stream(stream)>>>(
        w.ptr<T>(), N, K, tiles, vec, q.present ? q.ptr<uint8_t>() : nullptr, q.present ? scale.ptr<float>() : nullptr,
        q_t.present ? q_t.ptr<uint8_t>() : nullptr, scale_t.present ? scale_t.ptr<float>() : nullptr, vec_t);
    check_launch("quantize_weight_kernel");
  });
}

}  // namespace moe8::cuda
