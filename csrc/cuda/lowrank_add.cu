// lowrank_add.cu — out[r] = h[r] + t[r] · op(b[e]) for the rows r of expert e, out[r] = h[r] for rows in
// no group: the expert LoRA's B projection fused with the add into the base GEMM's output.
//
// Design. Memory-bound: one read of h, one write of out (a grouped GEMM would write t·b[e] [R, N] and an
// add read it back). The rank (16 for LoRA) is small: each row's t is staged in shared memory, and b[e]
// ([N, rank] or [rank, N], N * rank elements per expert) is read through L1, shared by the block's rows.
// Each thread computes V consecutive outputs of one row (16-byte packs when N and the pointers allow).
// The sum over the rank is formed first and added to h, in the CPU reference's order.
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/ops.h"
#include "cuda/rowwise.cuh"

namespace moe8::cuda {
namespace {

// kKN: b[e] is [rank, N]; else [N, rank], read in packs along the rank when kPackRank.
template <typename T, int V, bool kKN, bool kPackRank>
__global__ void __launch_bounds__(kRowwiseThreads)
    lowrank_add_kernel(const T* __restrict__ h, const T* __restrict__ t, const T* __restrict__ b,
                       const int32_t* __restrict__ offsets, int E, int64_t rows, int64_t N, int rank,
                       T* __restrict__ out) {
  extern __shared__ float s_t[];  // [blockDim.y, rank]: t of each of the block's rows, as fp32
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  float* tr = s_t + threadIdx.y * rank;
  if (r < rows)
    for (int k = threadIdx.x; k < rank; k += blockDim.x) tr[k] = to_float(t[r * rank + k]);
  __syncthreads();
  const int64_t n0 = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * V;
  if (r >= rows || n0 >= N) return;
  float s[V] = {};
  const int e = group_of_row(offsets, E, r);
  if (e >= 0) {
    const T* be = b + static_cast<int64_t>(e) * N * rank;
    if constexpr (kKN) {
      for (int k = 0; k < rank; ++k) {
        const Pack<T, V> bv = *reinterpret_cast<const Pack<T, V>*>(be + k * N + n0);
#pragma unroll
        for (int j = 0; j < V; ++j) s[j] += tr[k] * to_float(bv.v[j]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const T* bn = be + (n0 + j) * rank;
        if constexpr (kPackRank) {
          for (int k0 = 0; k0 < rank; k0 += V) {
            const Pack<T, V> bv = *reinterpret_cast<const Pack<T, V>*>(bn + k0);
#pragma unroll
            for (int i = 0; i < V; ++i) s[j] += tr[k0 + i] * to_float(bv.v[i]);
          }
        } else {
          for (int k = 0; k < rank; ++k) s[j] += tr[k] * to_float(bn[k]);
        }
      }
    }
  }
  const Pack<T, V> hv = *reinterpret_cast<const Pack<T, V>*>(h + r * N + n0);
  Pack<T, V> o;
#pragma unroll
  for (int j = 0; j < V; ++j) o.v[j] = from_float<T>(to_float(hv.v[j]) + s[j]);
  *reinterpret_cast<Pack<T, V>*>(out + r * N + n0) = o;
}

// kNK with 16-byte packs and rank <= kTiledMaxRank: the block's 32 * V columns of b[e] for the expert of
// its first row are staged in shared memory, transposed to [rank, cols] (the [N, rank] rows would otherwise
// be read 256 bytes apart by neighbouring threads), and its blockDim.y threads per column walk kTiledRows
// rows; rows of another expert (at a group boundary) read b from global memory.
constexpr int kTiledRows = 64, kTiledMaxRank = 32;

template <typename T, int V>
__global__ void __launch_bounds__(kRowwiseThreads)
    lowrank_add_nk_tiled_kernel(const T* __restrict__ h, const T* __restrict__ t, const T* __restrict__ b,
                                const int32_t* __restrict__ offsets, int E, int64_t rows, int64_t N, int rank,
                                T* __restrict__ out) {
  constexpr int kCols = 32 * V, kLd = kCols + 4;  // blockDim.x == 32; +4 keeps float4 reads aligned
  extern __shared__ float smem[];
  float* s_b = smem;               // [rank, kLd]: b[e0][c0 + n][k] at s_b[k * kLd + n]
  float* s_t = smem + rank * kLd;  // [kTiledRows, rank]
  const int tid = threadIdx.y * 32 + threadIdx.x, nthreads = 32 * blockDim.y;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTiledRows, c0 = static_cast<int64_t>(blockIdx.y) * kCols;
  const int e0 = group_of_row(offsets, E, r0);
  if (e0 >= 0) {
    const T* be = b + (static_cast<int64_t>(e0) * N + c0) * rank;
    for (int i = tid; i < kCols * rank; i += nthreads) {
      const int n = i / rank, k = i % rank;
      s_b[k * kLd + n] = c0 + n < N ? to_float(be[i]) : 0.f;
    }
  }
  for (int i = tid; i < kTiledRows * rank; i += nthreads) {
    const int64_t r = r0 + i / rank;
    s_t[i] = r < rows ? to_float(t[r0 * rank + i]) : 0.f;
  }
  __syncthreads();
  const int n0 = threadIdx.x * V;
  if (c0 + n0 >= N) return;
  const int64_t end0 = e0 >= 0 ? offsets[e0 + 1] : -1;  // rows [r0, end0) belong to e0
  for (int i = threadIdx.y; i < kTiledRows; i += blockDim.y) {
    const int64_t r = r0 + i;
    if (r >= rows) break;
    const float* tr = s_t + i * rank;
    float s[V] = {};
    if (r < end0) {
#pragma unroll 4
      for (int k = 0; k < rank; ++k) {
        const float* bk = s_b + k * kLd + n0;
#pragma unroll
        for (int j = 0; j < V; ++j) s[j] += tr[k] * bk[j];
      }
    } else {
      const int e = group_of_row(offsets, E, r);
      if (e >= 0) {
        const T* be = b + (static_cast<int64_t>(e) * N + c0 + n0) * rank;
#pragma unroll
        for (int j = 0; j < V; ++j)
          for (int k = 0; k < rank; ++k) s[j] += tr[k] * to_float(be[j * rank + k]);
      }
    }
    const Pack<T, V> hv = *reinterpret_cast<const Pack<T, V>*>(h + r * N + c0 + n0);
    Pack<T, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j) o.v[j] = from_float<T>(to_float(hv.v[j]) + s[j]);
    *reinterpret_cast<Pack<T, V>*>(out + r * N + c0 + n0) = o;
  }
}

template <typename T, int V, bool kKN, bool kPackRank>
void launch(const TensorView& h, const TensorView& t, const TensorView& b, const TensorView& offsets, int64_t N,
            int rank, const TensorView& out, cudaStream_t s) {
  const int64_t rows = h.shape[0];
  const RowGrid g = row_grid(rows, N / V);
  const size_t smem = static_cast<size_t>(g.block.y) * rank * sizeof(float);
  lowrank_add_kernel<T, V, kKN, kPackRank>
      <<<g.grid, g.block, smem, s>>>(h.ptr<T>(), t.ptr<T>(), b.ptr<T>(), offsets.ptr<int32_t>(),
                                     static_cast<int>(b.shape[0]), rows, N, rank, out.ptr<T>());
  check_launch("lowrank_add_kernel");
}

}  // namespace

void grouped_lowrank_add(const TensorView& h, const TensorView& t, const TensorView& b, const TensorView& offsets,
                         WeightLayout layout, const TensorView& out, void* stream) {
  const int64_t rows = h.shape[0], N = h.shape[1];
  const int rank = static_cast<int>(t.shape[1]);
  if (rows == 0 || N == 0) return;
  cudaStream_t s = as_stream(stream);
  const bool kn = layout == WeightLayout::kKN;
  MOE8_DISPATCH_FLOAT(h.dtype, "grouped_lowrank_add: h", [&] {
    using T = scalar_t;
    constexpr int V = 16 / sizeof(T);
    if (!use_packs<T>(N, {h.data, out.data, b.data})) {  // packs need N % V == 0, b's rows too
      if (kn)
        launch<T, 1, true, false>(h, t, b, offsets, N, rank, out, s);
      else
        launch<T, 1, false, false>(h, t, b, offsets, N, rank, out, s);
    } else if (kn) {
      launch<T, V, true, false>(h, t, b, offsets, N, rank, out, s);
    } else if (rank <= kTiledMaxRank) {
      const dim3 block(32, kRowwiseThreads / 32),
          grid(static_cast<unsigned>(ceil_div(rows, kTiledRows)), static_cast<unsigned>(ceil_div(N, 32 * V)));
      const size_t smem = (static_cast<size_t>(rank) * (32 * V + 4) + kTiledRows * rank) * sizeof(float);
      lowrank_add_nk_tiled_kernel<T, V><<<grid, block, smem, s>>>(h.ptr<T>(), t.ptr<T>(), b.ptr<T>(),
                                                                  offsets.ptr<int32_t>(), static_cast<int>(b.shape[0]),
                                                                  rows, N, rank, out.ptr<T>());
      check_launch("lowrank_add_nk_tiled_kernel");
    } else if (rank % V == 0) {
      launch<T, V, false, true>(h, t, b, offsets, N, rank, out, s);
    } else {
      launch<T, V, false, false>(h, t, b, offsets, N, rank, out, s);
    }
  });
}

}  // namespace moe8::cuda
