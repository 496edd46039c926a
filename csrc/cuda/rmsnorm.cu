// rmsnorm.cu — RMSNorm forward and backward (semantics: cpu/ops.h), and the fixed-order sum of the backward's
// weight-gradient partials.
//   nvcc -std=c++17 -arch=sm_90a -Xptxas -v -Icsrc -c csrc/cuda/rmsnorm.cu   (registers and spills per kernel)
//
// Design. Memory-bound. A row is read by a group of `lanes` threads (rmsnorm_heuristics.h: row_shape), each
// owning the packs lane, lane + lanes, ... of it: V = 16 bytes / sizeof(T) elements where the width and every
// pointer allow, single elements otherwise. Up to kCachePacks packs a thread stay in registers, so x (and dy)
// are read once; the row's sum is a shuffle within the group, plus one exchange through shared memory when the
// group spans warps. A block holds threads / lanes groups that walk rows blockIdx.x * groups + g, then
// gridDim.x * groups further, in lockstep (one trip count for the block, so it may synchronise inside the loop).
// A thread's columns are the same on every row: the forward loads its weight packs once (the backward reads them
// again each row, from L1, to stay within 128 registers), and the backward sums dy * xhat for its columns in
// registers over all of its rows. The groups of a block then add their sums in shared memory
// in group order, the block writes one fp32 row of partials [blocks, H], and rms_norm_dweight_kernel adds those
// rows in a fixed order: dw is the same bits on every run (no atomics). A row wider than lanes * kCachePacks
// packs (past 16K bf16 elements with 16-byte packs) is read twice, its dw sums kept in the block's partial row.
// Math in fp32, in the CPU reference's order of operations; y and dx are rounded once.
#include <cstdint>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/ops.h"
#include "cuda/rmsnorm_heuristics.h"
#include "cuda/rowwise.cuh"

namespace moe8::cuda {
namespace {

namespace h = rmsnorm_heuristics;

constexpr int kMaxThreads = h::kMaxLanes;  // >= h::kBlockThreads
constexpr int kCache = h::kCachePacks;
constexpr int kWarpsMax = kMaxThreads / 32;

// Which rows and columns a thread works on: group g of the block, lane `lane` of lanes.
struct Lanes {
  int lanes, lane, g, groups;
  __device__ __forceinline__ explicit Lanes(int n)
      : lanes(n), lane(threadIdx.x & (n - 1)), g(threadIdx.x / n), groups(blockDim.x / n) {}
};

// The sum of v over the lanes of each group, in every lane. A group within a warp: shuffles. A group of several
// warps: their sums through red (the caller alternates two buffers between rows, so one barrier a row suffices).
// lanes is uniform across the block, and every thread of it calls this (the row loops share one trip count).
__device__ __forceinline__ float group_sum(float v, int lanes, float* red) {
  const int width = lanes < 32 ? lanes : 32;
  for (int o = width / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lanes <= 32) return v;
  const int warp = threadIdx.x / 32, warps = lanes / 32, first = warp / warps * warps;
  if (threadIdx.x % 32 == 0) red[warp] = v;
  __syncthreads();
  float s = 0.f;
  for (int w = 0; w < warps; ++w) s += red[first + w];
  return s;
}

__device__ __forceinline__ float inv_rms(float sum_sq, int64_t cols, float eps) {
  return 1.f / sqrtf(sum_sq / static_cast<float>(cols) + eps);
}

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}

template <typename T, int V>
__device__ __forceinline__ void store(T* p, const Pack<T, V>& v) {
  *reinterpret_cast<Pack<T, V>*>(p) = v;
}

// x, y [rows, cols]; w [cols]; rstd [rows] f32. kCached: the row in registers (lanes * kCache >= cols / V).
template <typename T, int V, bool kCached>
__global__ void __launch_bounds__(kMaxThreads)
    rms_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, int64_t rows, int64_t cols, float eps,
                            int lanes, T* __restrict__ y, float* __restrict__ rstd) {
  using P = Pack<T, V>;
  __shared__ float red[2][kWarpsMax];
  const Lanes t(lanes);
  const int packs = static_cast<int>(cols / V);
  P wc[kCached ? kCache : 1];
  if constexpr (kCached) {
#pragma unroll
    for (int c = 0; c < kCache; ++c) {
      const int i = t.lane + c * lanes;
      if (i < packs) wc[c] = load<T, V>(w + static_cast<int64_t>(i) * V);
    }
  }
  int parity = 0;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * t.groups; base < rows;
       base += static_cast<int64_t>(gridDim.x) * t.groups, parity ^= 1) {
    const int64_t r = base + t.g;
    const bool live = r < rows;
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    float ss = 0.f;
    P xc[kCached ? kCache : 1];
    if constexpr (kCached) {
#pragma unroll
      for (int c = 0; c < kCache; ++c) {
        const int i = t.lane + c * lanes;
        if (live && i < packs) {
          xc[c] = load<T, V>(xr + static_cast<int64_t>(i) * V);
#pragma unroll
          for (int j = 0; j < V; ++j) ss += to_float(xc[c].v[j]) * to_float(xc[c].v[j]);
        }
      }
    } else {
      for (int i = t.lane; live && i < packs; i += lanes) {
        const P a = load<T, V>(xr + static_cast<int64_t>(i) * V);
#pragma unroll
        for (int j = 0; j < V; ++j) ss += to_float(a.v[j]) * to_float(a.v[j]);
      }
    }
    ss = group_sum(ss, lanes, red[parity]);
    if (!live) continue;
    const float rs = inv_rms(ss, cols, eps);
    if (t.lane == 0) rstd[r] = rs;
    if constexpr (kCached) {
#pragma unroll
      for (int c = 0; c < kCache; ++c) {
        const int i = t.lane + c * lanes;
        if (i < packs) {
          P o;
#pragma unroll
          for (int j = 0; j < V; ++j) o.v[j] = from_float<T>(to_float(xc[c].v[j]) * rs * to_float(wc[c].v[j]));
          store<T, V>(yr + static_cast<int64_t>(i) * V, o);
        }
      }
    } else {
      for (int i = t.lane; i < packs; i += lanes) {
        const P a = load<T, V>(xr + static_cast<int64_t>(i) * V), b = load<T, V>(w + static_cast<int64_t>(i) * V);
        P o;
#pragma unroll
        for (int j = 0; j < V; ++j) o.v[j] = from_float<T>(to_float(a.v[j]) * rs * to_float(b.v[j]));
        store<T, V>(yr + static_cast<int64_t>(i) * V, o);
      }
    }
  }
}

// dy, x, dx [rows, cols]; w [cols]; rstd [rows] f32 -> dx, and partial [gridDim.x, cols] f32: row b the sum of
// dy * xhat over the rows block b walked. Dynamic shared memory: groups * cols floats when kCached and groups > 1.
template <typename T, int V, bool kCached>
__global__ void __launch_bounds__(kMaxThreads)
    rms_norm_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                             const float* __restrict__ rstd, int64_t rows, int64_t cols, int lanes, T* __restrict__ dx,
                             float* __restrict__ partial) {
  using P = Pack<T, V>;
  __shared__ float red[2][kWarpsMax];
  extern __shared__ float group_dw[];  // [groups, cols]
  const Lanes t(lanes);
  const int packs = static_cast<int>(cols / V);
  const float inv_cols = 1.f / static_cast<float>(cols);
  float* prow = partial + static_cast<int64_t>(blockIdx.x) * cols;  // this block's partial row
  float acc[kCached ? kCache : 1][V];
  if constexpr (kCached) {
#pragma unroll
    for (int c = 0; c < kCache; ++c)
#pragma unroll
      for (int j = 0; j < V; ++j) acc[c][j] = 0.f;
  } else {  // one group a block: each thread sums its columns straight into the block's partial row
    for (int i = t.lane; i < packs; i += lanes)
#pragma unroll
      for (int j = 0; j < V; ++j) prow[static_cast<int64_t>(i) * V + j] = 0.f;
  }
  int parity = 0;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * t.groups; base < rows;
       base += static_cast<int64_t>(gridDim.x) * t.groups, parity ^= 1) {
    const int64_t r = base + t.g;
    const bool live = r < rows;
    const float rs = live ? rstd[r] : 0.f;
    const int64_t at = r * cols;
    float dot = 0.f;  // sum of g * xhat, g = dy * w, xhat = x * rstd
    P xc[kCached ? kCache : 1] = {}, dc[kCached ? kCache : 1] = {};
    if constexpr (kCached) {
#pragma unroll
      for (int c = 0; c < kCache; ++c) {
        const int i = t.lane + c * lanes;
        if (live && i < packs) {
          xc[c] = load<T, V>(x + at + static_cast<int64_t>(i) * V);
          dc[c] = load<T, V>(dy + at + static_cast<int64_t>(i) * V);
          const P b = load<T, V>(w + static_cast<int64_t>(i) * V);
#pragma unroll
          for (int j = 0; j < V; ++j) dot += to_float(dc[c].v[j]) * to_float(b.v[j]) * (to_float(xc[c].v[j]) * rs);
        }
      }
    } else {
      for (int i = t.lane; live && i < packs; i += lanes) {
        const int64_t e = at + static_cast<int64_t>(i) * V;
        const P a = load<T, V>(x + e), d = load<T, V>(dy + e), b = load<T, V>(w + static_cast<int64_t>(i) * V);
#pragma unroll
        for (int j = 0; j < V; ++j) dot += to_float(d.v[j]) * to_float(b.v[j]) * (to_float(a.v[j]) * rs);
      }
    }
    dot = group_sum(dot, lanes, red[parity]);
    if (!live) continue;
    const float mean = dot * inv_cols;
    if constexpr (kCached) {
#pragma unroll
      for (int c = 0; c < kCache; ++c) {
        const int i = t.lane + c * lanes;
        if (i < packs) {
          const P b = load<T, V>(w + static_cast<int64_t>(i) * V);
          P o;
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const float d = to_float(dc[c].v[j]), xhat = to_float(xc[c].v[j]) * rs;
            o.v[j] = from_float<T>(rs * (d * to_float(b.v[j]) - xhat * mean));
            acc[c][j] += d * xhat;
          }
          store<T, V>(dx + at + static_cast<int64_t>(i) * V, o);
        }
      }
    } else {
      for (int i = t.lane; i < packs; i += lanes) {
        const int64_t e = at + static_cast<int64_t>(i) * V;
        const P a = load<T, V>(x + e), d = load<T, V>(dy + e), b = load<T, V>(w + static_cast<int64_t>(i) * V);
        P o;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float dj = to_float(d.v[j]), xhat = to_float(a.v[j]) * rs;
          o.v[j] = from_float<T>(rs * (dj * to_float(b.v[j]) - xhat * mean));
          prow[static_cast<int64_t>(i) * V + j] += dj * xhat;
        }
        store<T, V>(dx + e, o);
      }
    }
  }
  if constexpr (kCached) {
    float* dst = t.groups == 1 ? prow : group_dw + static_cast<int64_t>(t.g) * cols;
#pragma unroll
    for (int c = 0; c < kCache; ++c) {
      const int i = t.lane + c * lanes;
      if (i < packs)
#pragma unroll
        for (int j = 0; j < V; ++j) dst[static_cast<int64_t>(i) * V + j] = acc[c][j];
    }
    if (t.groups > 1) {  // uniform: the groups' sums added in group order
      __syncthreads();
      for (int64_t col = threadIdx.x; col < cols; col += blockDim.x) {
        float s = 0.f;
        for (int q = 0; q < t.groups; ++q) s += group_dw[q * cols + col];
        prow[col] = s;
      }
    }
  }
}

// dw[col] = the sum of partial[b, col] over b < blocks: slice y of kSlices adds rows y, y + kSlices, ..., and
// the slices are added in order. The same bits for the same number of partial rows.
constexpr int kReduceCols = 32, kSlices = 8;

template <typename T>
__global__ void __launch_bounds__(kReduceCols* kSlices)
    rms_norm_dweight_kernel(const float* __restrict__ partial, int64_t blocks, int64_t cols, T* __restrict__ dw) {
  __shared__ float part[kSlices][kReduceCols + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kReduceCols + threadIdx.x;
  float s = 0.f;
  if (col < cols)
    for (int64_t b = threadIdx.y; b < blocks; b += kSlices) s += partial[b * cols + col];
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || col >= cols) return;
  float total = 0.f;
#pragma unroll
  for (int k = 0; k < kSlices; ++k) total += part[k][threadIdx.x];
  dw[col] = from_float<T>(total);
}

// Calls f(integral_constant<V>, bool_constant<kCached>) for the pack width and path chosen.
template <typename T, typename F>
void with_variant(bool wide, bool cached, F&& f) {
  constexpr int kWide = 16 / sizeof(T);
  if (wide) {
    if (cached)
      f(std::integral_constant<int, kWide>{}, std::true_type{});
    else
      f(std::integral_constant<int, kWide>{}, std::false_type{});
  } else {
    if (cached)
      f(std::integral_constant<int, 1>{}, std::true_type{});
    else
      f(std::integral_constant<int, 1>{}, std::false_type{});
  }
}

}  // namespace

void rms_norm_forward(const TensorView& x, const TensorView& weight, float eps, const TensorView& y,
                      const TensorView& rstd, void* stream) {
  const int64_t rows = x.shape[0], cols = x.shape[1];
  if (rows == 0) return;
  cudaStream_t s = as_stream(stream);
  MOE8_DISPATCH_FLOAT(x.dtype, "rms_norm_forward: x", [&] {
    using T = scalar_t;
    const bool wide = use_packs<T>(cols, {x.data, weight.data, y.data});
    const h::RowShape shape = h::row_shape(wide ? cols / (16 / sizeof(T)) : cols);
    const auto grid = static_cast<unsigned>(h::forward_blocks(rows, shape));
    with_variant<T>(wide, shape.cached, [&](auto v, auto cached) {
      rms_norm_forward_kernel<T, decltype(v)::value, decltype(cached)::value><<<grid, shape.threads, 0, s>>>(
          x.ptr<T>(), weight.ptr<T>(), rows, cols, eps, shape.lanes, y.ptr<T>(), rstd.ptr<float>());
    });
    check_launch("rms_norm_forward_kernel");
  });
}

void rms_norm_backward(const TensorView& dy, const TensorView& x, const TensorView& weight, const TensorView& rstd,
                       const TensorView& dx, const TensorView& dweight, const TensorView& workspace, void* stream) {
  const int64_t rows = x.shape[0], cols = x.shape[1];
  cudaStream_t s = as_stream(stream);
  if (cols == 0) return;
  if (rows == 0) {  // no rows: a zero weight gradient (all-zero bits are 0 in every float dtype)
    cuda_check(cudaMemsetAsync(dweight.data, 0, static_cast<size_t>(cols) * dtype_size(dweight.dtype), s),
               "rms_norm_backward: zero dweight");
    return;
  }
  const int sms = device_facts(current_device("rms_norm_backward")).sms;
  MOE8_DISPATCH_FLOAT(x.dtype, "rms_norm_backward: x", [&] {
    using T = scalar_t;
    const bool wide = use_packs<T>(cols, {dy.data, x.data, weight.data, dx.data});
    const h::RowShape shape = h::row_shape(wide ? cols / (16 / sizeof(T)) : cols);
    const int64_t blocks = h::backward_blocks(rows, shape, sms);
    const size_t smem = shape.cached && shape.rows_per_block() > 1
                            ? static_cast<size_t>(shape.rows_per_block()) * cols * sizeof(float)
                            : 0;
    float* partial = workspace.ptr<float>();
    with_variant<T>(wide, shape.cached, [&](auto v, auto cached) {
      rms_norm_backward_kernel<T, decltype(v)::value, decltype(cached)::value>
          <<<static_cast<unsigned>(blocks), shape.threads, smem, s>>>(dy.ptr<T>(), x.ptr<T>(), weight.ptr<T>(),
                                                                      rstd.ptr<float>(), rows, cols, shape.lanes,
                                                                      dx.ptr<T>(), partial);
    });
    check_launch("rms_norm_backward_kernel");
    const dim3 block(kReduceCols, kSlices);
    rms_norm_dweight_kernel<T>
        <<<static_cast<unsigned>(ceil_div(cols, kReduceCols)), block, 0, s>>>(partial, blocks, cols, dweight.ptr<T>());
    check_launch("rms_norm_dweight_kernel");
  });
}

}  // namespace moe8::cuda
