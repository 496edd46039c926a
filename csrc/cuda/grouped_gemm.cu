// grouped_gemm.cu — the expert GEMMs of an MoE layer on CUDA: the forward / dgrad grouped GEMM (rows ragged
// per expert) and the weight gradient (reduction ragged per expert), plus the bias gradient.
// Tensor cores (mma.sync, grouped_gemm_mma.cuh) for 16-bit inputs whose sizes allow 16-byte loads, plain
// FFMA (grouped_gemm_simt.cuh) otherwise. Offsets stay on the device: blocks find their work themselves,
// so nothing synchronises, allocates or copies, and the launches can be captured in a CUDA graph.
// Deterministic: every output element is reduced by one thread in a fixed order; no atomics.
#include <climits>
#include <cstdint>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/grouped_gemm_mma.cuh"
#include "cuda/grouped_gemm_simt.cuh"
#include "cuda/ops.h"

namespace moe8::cuda {
namespace gg {

constexpr int kThreads = 256;  // threads per block of both main loops
constexpr int kGroupM = 8;     // M tiles swept together per N tile, for L2 reuse of the expert's weights

// Row offsets[g] as the kernels read it: clamped into [0, rows], so that offsets the API did not check
// (check_indices false) give wrong numbers, never an access outside a, c or dc; a group's end is read as at
// least its begin (group_end).
__device__ __forceinline__ int64_t group_row(const int* __restrict__ offsets, int g, int64_t rows) {
  const int64_t o = offsets[g];
  return o < 0 ? 0 : (o > rows ? rows : o);
}
__device__ __forceinline__ int64_t group_end(const int* __restrict__ offsets, int g, int64_t rows) {
  const int64_t b = group_row(offsets, g, rows), e = group_row(offsets, g + 1, rows);
  return e < b ? b : e;
}

// The forward output tile one block computes. group == E is the pseudo-group of rows [offsets[E], R),
// which are only zeroed.
struct TileJob {
  int group;
  int64_t row_begin, row_end;  // rows of the group
  int m_tile, n_tile;          // tile within the group
};

// Forward tiles are numbered group by group (groups 0..E, each ceil(rows / kBM) * n_tiles tiles). The
// block scans the per-group tile counts from the device offsets (kThreads groups per step) and finds the
// group holding tile `tile`. Returns false, for the whole block, when tile is past the last one.
template <int kBM>
__device__ __forceinline__ bool find_tile(const int* __restrict__ offsets, int num_experts, int64_t rows, int n_tiles,
                                          int tile, TileJob& job) {
  constexpr int kWarps = kThreads / 32;
  __shared__ int s_warp[kWarps];
  __shared__ int s_found[2];  // group, its first tile
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) s_found[0] = -1;
  int base = 0;  // tiles of the groups before this step
  for (int step = 0; step <= num_experts; step += kThreads) {
    const int g = step + threadIdx.x;
    int t = 0;
    if (g <= num_experts) {
      const int64_t end = g < num_experts ? group_end(offsets, g, rows) : rows;
      t = static_cast<int>((end - group_row(offsets, g, rows) + kBM - 1) / kBM) * n_tiles;
    }
    int incl = t;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    int before = 0, total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int s = s_warp[w];
      before += w < warp ? s : 0;
      total += s;
    }
    const int first = base + before + incl - t;
    if (tile >= first && tile < first + t) {  // exactly one thread: the groups' tile ranges are disjoint
      s_found[0] = g;
      s_found[1] = first;
    }
    base += total;
    __syncthreads();         // s_found visible; s_warp free for the next step
    if (tile < base) break;  // tile and base are block-uniform
  }
  const int g = s_found[0];
  if (g < 0) return false;
  job.group = g;
  job.row_begin = group_row(offsets, g, rows);
  job.row_end = g < num_experts ? group_end(offsets, g, rows) : rows;
  const int m_tiles = static_cast<int>((job.row_end - job.row_begin + kBM - 1) / kBM);
  const int local = tile - s_found[1];
  // Within the group, kGroupM consecutive M tiles share each N tile before moving on.
  const int per_band = kGroupM * n_tiles;
  const int band = local / per_band, first_m = band * kGroupM;
  const int band_m = min(m_tiles - first_m, kGroupM);
  const int r = local - band * per_band;
  job.m_tile = first_m + r % band_m;
  job.n_tile = r / band_m;
  return true;
}

template <typename T>
struct alignas(2 * sizeof(T)) Pair {
  T x, y;
};

// Writes (v0, v1) to row[col], row[col + 1], each only if inside [0, cols). pair_ok: one 2-element store
// is aligned (cols even, base pointer aligned to 2 elements; col is always even here).
template <typename T>
__device__ __forceinline__ void store_pair(T* row, int64_t col, int64_t cols, float v0, float v1, bool pair_ok) {
  if (pair_ok && col + 1 < cols) {
    *reinterpret_cast<Pair<T>*>(row + col) = Pair<T>{from_float<T>(v0), from_float<T>(v1)};
  } else {
    if (col < cols) row[col] = from_float<T>(v0);
    if (col + 1 < cols) row[col + 1] = from_float<T>(v1);
  }
}

template <int kBM, int kBN, typename T>
__device__ __forceinline__ void zero_tile(T* c, int64_t m0, int64_t m_end, int64_t n0, int64_t n) {
  for (int idx = threadIdx.x; idx < kBM * kBN; idx += kThreads) {
    const int64_t row = m0 + idx / kBN, col = n0 + idx % kBN;
    if (row < m_end && col < n) c[row * n + col] = from_float<T>(0.f);
  }
}

struct FwdArgs {
  const void* a;  // [R, Kd]
  const void* b;  // [E, N, Kd] or [E, Kd, N]
  const int* offsets;
  const void* bias;  // [E, N] or null
  void* c;           // [R, N]
  int64_t rows, n, k;
  int num_experts, n_tiles;
  bool pair_ok;
};

struct WgradArgs {
  const void* x;  // [R, M'] the operand whose columns index db's rows
  const void* y;  // [R, N'] the operand whose columns index db's columns
  const int* offsets;
  void* db;  // [E, M', N']
  int64_t m, n;
  int64_t rows;  // R
  bool pair_ok;
};

template <typename T, bool kAKMajor, bool kBKMajor, bool kMma>
using Mainloop = std::conditional_t<kMma, MmaMainloop<T, kAKMajor, kBKMajor>, SimtMainloop<T, kAKMajor, kBKMajor>>;

// kMma: tensor-core main loop (16-bit T), else SIMT. kBKMajor: b is [E, N, Kd] (kNK), else [E, Kd, N].
template <typename T, typename TBias, bool kBKMajor, bool kMma>
__global__ void __launch_bounds__(kThreads, (Mainloop<T, true, kBKMajor, kMma>::kMinBlocks))
    grouped_gemm_kernel(const FwdArgs p) {
  using Loop = Mainloop<T, true, kBKMajor, kMma>;
  static_assert(Loop::kThreads == kThreads);
  constexpr int kBM = Loop::kBM, kBN = Loop::kBN;
  TileJob job;
  if (!find_tile<kBM>(p.offsets, p.num_experts, p.rows, p.n_tiles, blockIdx.x, job)) return;
  const int64_t m0 = job.row_begin + static_cast<int64_t>(job.m_tile) * kBM;
  const int64_t n0 = static_cast<int64_t>(job.n_tile) * kBN;
  T* c = static_cast<T*>(p.c);
  if (job.group == p.num_experts) {
    zero_tile<kBM, kBN>(c, m0, job.row_end, n0, p.n);
    return;
  }
  const Operand<T> a{static_cast<const T*>(p.a), p.k, job.row_end, p.k};
  const Operand<T> b{static_cast<const T*>(p.b) + job.group * p.n * p.k, kBKMajor ? p.k : p.n, p.n, p.k};
  const TBias* bias = p.bias ? static_cast<const TBias*>(p.bias) + job.group * p.n : nullptr;
  typename Loop::Acc acc = {};
  if constexpr (kMma) {
    extern __shared__ __align__(128) unsigned char gg_smem[];
    Loop::run(gg_smem, a, m0, b, n0, 0, p.k, acc);
    Loop::for_each_acc(acc, [&](int r, int col, float v0, float v1) {
      const int64_t row = m0 + r, n = n0 + col;
      if (row >= job.row_end) return;  // rows of the next group are its own blocks' work
      if (bias) {
        if (n < p.n) v0 += to_float(bias[n]);
        if (n + 1 < p.n) v1 += to_float(bias[n + 1]);
      }
      store_pair(c + row * p.n, n, p.n, v0, v1, p.pair_ok);
    });
  } else {
    __shared__ __align__(16) typename Loop::Smem smem;
    Loop::run(smem, a, m0, b, n0, 0, p.k, acc);
    Loop::for_each_acc(acc, [&](int r, int col, float v) {
      const int64_t row = m0 + r, n = n0 + col;
      if (row >= job.row_end || n >= p.n) return;
      if (bias) v += to_float(bias[n]);
      c[row * p.n + n] = from_float<T>(v);
    });
  }
}

// db[e] = x[rows of e]^T · y[rows of e]: a GEMM whose reduction runs over the group's rows, so the grid is
// (N' tiles, M' tiles, E) with no search; an empty group leaves acc zero and writes zeros.
template <typename T, typename TOut, bool kMma>
__global__ void __launch_bounds__(kThreads, (Mainloop<T, false, false, kMma>::kMinBlocks))
    grouped_gemm_wgrad_kernel(const WgradArgs p) {
  using Loop = Mainloop<T, false, false, kMma>;
  static_assert(Loop::kThreads == kThreads);
  const int e = blockIdx.z;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * Loop::kBM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * Loop::kBN;
  const int64_t r0 = group_row(p.offsets, e, p.rows), r1 = group_end(p.offsets, e, p.rows);
  const Operand<T> x{static_cast<const T*>(p.x), p.m, p.m, r1};
  const Operand<T> y{static_cast<const T*>(p.y), p.n, p.n, r1};
  TOut* db = static_cast<TOut*>(p.db) + e * p.m * p.n;
  typename Loop::Acc acc = {};
  if constexpr (kMma) {
    extern __shared__ __align__(128) unsigned char gg_smem[];
    Loop::run(gg_smem, x, m0, y, n0, r0, r1, acc);
    Loop::for_each_acc(acc, [&](int r, int col, float v0, float v1) {
      const int64_t row = m0 + r;
      if (row < p.m) store_pair(db + row * p.n, n0 + col, p.n, v0, v1, p.pair_ok);
    });
  } else {
    __shared__ __align__(16) typename Loop::Smem smem;
    Loop::run(smem, x, m0, y, n0, r0, r1, acc);
    Loop::for_each_acc(acc, [&](int r, int col, float v) {
      const int64_t row = m0 + r, n = n0 + col;
      if (row < p.m && n < p.n) db[row * p.n + n] = from_float<TOut>(v);
    });
  }
}

// dbias[e, n] = sum of dc[r, n] over the rows of group e. Block (32 columns, 8 row slices); the slices are
// summed in a fixed order, so the result is deterministic.
constexpr int kBiasCols = 32, kBiasSlices = 8;

template <typename T, typename TOut>
__global__ void __launch_bounds__(kBiasCols* kBiasSlices)
    grouped_bias_grad_kernel(const T* __restrict__ dc, const int* __restrict__ offsets, int64_t n, int64_t rows,
                             TOut* __restrict__ dbias) {
  __shared__ float part[kBiasSlices][kBiasCols + 1];
  const int e = blockIdx.y;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kBiasCols + threadIdx.x;
  const int64_t r0 = group_row(offsets, e, rows), r1 = group_end(offsets, e, rows);
  float s = 0.f;
  if (col < n) {
#pragma unroll 4
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kBiasSlices) s += to_float(dc[r * n + col]);
  }
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < kBiasSlices; ++i) t += part[i][threadIdx.x];
    dbias[e * n + col] = from_float<TOut>(t);
  }
}

inline bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Every call, not once: the limit is per device, and the call is cheap and allowed during graph capture.
template <typename Kernel>
void allow_smem(Kernel kernel, int smem_bytes) {
  if (smem_bytes <= 48 * 1024) return;
  cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes),
             "grouped_gemm: cudaFuncSetAttribute");
  // Two blocks per SM need the largest shared-memory carveout; it is a hint, so the driver may still pick.
  cuda_check(
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared),
      "grouped_gemm: cudaFuncSetAttribute");
}

template <typename T, typename TBias, bool kBKMajor, bool kMma>
void launch_forward(FwdArgs p, cudaStream_t stream) {
  using Loop = Mainloop<T, true, kBKMajor, kMma>;
  p.n_tiles = static_cast<int>(ceil_div(p.n, Loop::kBN));
  // Tiles per group are ceil(rows_g / kBM) * n_tiles; summed over the E + 1 groups (tail included) that
  // is at most (ceil(R / kBM) + E + 1) * n_tiles. Blocks past the actual count exit at once.
  const int64_t bound = (ceil_div(p.rows, Loop::kBM) + p.num_experts + 1) * static_cast<int64_t>(p.n_tiles);
  MOE8_CHECK(bound <= INT_MAX, "grouped_gemm: too many tiles (", bound, ") for one launch");
  auto kernel = grouped_gemm_kernel<T, TBias, kBKMajor, kMma>;
  allow_smem(kernel, Loop::kSmemBytes);
  kernel<<<static_cast<unsigned>(bound), kThreads, Loop::kSmemBytes, stream>>>(p);
}

template <typename T, typename TBias>
void launch_forward(const FwdArgs& p, bool kn, bool mma_ok, cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float>) {
    if (mma_ok) {
      kn ? launch_forward<T, TBias, false, true>(p, stream) : launch_forward<T, TBias, true, true>(p, stream);
      return;
    }
  }
  kn ? launch_forward<T, TBias, false, false>(p, stream) : launch_forward<T, TBias, true, false>(p, stream);
}

template <typename T, typename TOut, bool kMma>
void launch_wgrad(const WgradArgs& p, int num_experts, cudaStream_t stream) {
  using Loop = Mainloop<T, false, false, kMma>;
  const int64_t gx = ceil_div(p.n, Loop::kBN), gy = ceil_div(p.m, Loop::kBM);
  MOE8_CHECK(gy <= 65535 && num_experts <= 65535, "grouped_gemm_wgrad: too many tiles (", gy, " x ", num_experts,
             ") for one launch");
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy), num_experts);
  auto kernel = grouped_gemm_wgrad_kernel<T, TOut, kMma>;
  allow_smem(kernel, Loop::kSmemBytes);
  kernel<<<grid, kThreads, Loop::kSmemBytes, stream>>>(p);
}

template <typename T, typename TOut>
void launch_wgrad(const WgradArgs& p, int num_experts, bool mma_ok, cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float>) {
    if (mma_ok) return launch_wgrad<T, TOut, true>(p, num_experts, stream);
  }
  launch_wgrad<T, TOut, false>(p, num_experts, stream);
}

}  // namespace gg

void grouped_gemm(const TensorView& a, const TensorView& b, const TensorView& offsets, WeightLayout layout,
                  const TensorView& bias, const TensorView& c, void* stream) {
  gg::FwdArgs p{};
  p.rows = a.shape[0];
  p.k = a.shape[1];
  p.n = c.shape[1];
  p.num_experts = static_cast<int>(offsets.shape[0]) - 1;
  if (p.rows == 0 || p.n == 0) return;
  p.a = a.data;
  p.b = b.data;
  p.offsets = offsets.ptr<const int>();
  p.bias = bias.present ? bias.data : nullptr;
  p.c = c.data;
  const bool kn = layout == WeightLayout::kKN;
  const int esize = dtype_size(a.dtype);
  p.pair_ok = p.n % 2 == 0 && gg::aligned(c.data, 2 * esize);
  // 16-byte cp.async chunks: rows of a and of b must start on 16 bytes and end on a chunk boundary.
  const bool mma_ok =
      esize == 2 && p.k % 8 == 0 && (!kn || p.n % 8 == 0) && gg::aligned(a.data, 16) && gg::aligned(b.data, 16);
  MOE8_DISPATCH_FLOAT(a.dtype, "grouped_gemm", [&] {
    if (bias.present && bias.dtype != a.dtype)
      gg::launch_forward<scalar_t, float>(p, kn, mma_ok, as_stream(stream));
    else
      gg::launch_forward<scalar_t, scalar_t>(p, kn, mma_ok, as_stream(stream));
  });
  check_launch("grouped_gemm");
}

void grouped_gemm_wgrad(const TensorView& a, const TensorView& dc, const TensorView& offsets, WeightLayout layout,
                        const TensorView& db, const TensorView& dbias, void* stream) {
  const int num_experts = static_cast<int>(offsets.shape[0]) - 1;
  if (num_experts <= 0) return;
  const int64_t kd = a.shape[1], n = dc.shape[1];
  const bool kn = layout == WeightLayout::kKN;
  const bool out_f32 = db.dtype == DType::kF32;
  const int esize = dtype_size(a.dtype);
  cudaStream_t s = as_stream(stream);
  // kNK: db[e] [N, Kd] = dc^T a; kKN: db[e] [Kd, N] = a^T dc.
  gg::WgradArgs p{};
  p.x = kn ? a.data : dc.data;
  p.y = kn ? dc.data : a.data;
  p.offsets = offsets.ptr<const int>();
  p.db = db.data;
  p.m = kn ? kd : n;
  p.n = kn ? n : kd;
  p.rows = a.shape[0];
  p.pair_ok = p.n % 2 == 0 && gg::aligned(db.data, 2 * dtype_size(db.dtype));
  const bool mma_ok = esize == 2 && kd % 8 == 0 && n % 8 == 0 && gg::aligned(a.data, 16) && gg::aligned(dc.data, 16);
  if (p.m > 0 && p.n > 0) {
    MOE8_DISPATCH_FLOAT(a.dtype, "grouped_gemm_wgrad", [&] {
      if (out_f32)
        gg::launch_wgrad<scalar_t, float>(p, num_experts, mma_ok, s);
      else
        gg::launch_wgrad<scalar_t, scalar_t>(p, num_experts, mma_ok, s);
    });
    check_launch("grouped_gemm_wgrad");
  }
  if (dbias.present && n > 0) {
    MOE8_CHECK(num_experts <= 65535, "grouped_gemm_wgrad: too many experts (", num_experts, ") for one launch");
    const dim3 grid(static_cast<unsigned>(ceil_div(n, gg::kBiasCols)), num_experts);
    const dim3 block(gg::kBiasCols, gg::kBiasSlices);
    const int* off = offsets.ptr<const int>();
    MOE8_DISPATCH_FLOAT(a.dtype, "grouped_gemm_wgrad", [&] {
      const scalar_t* g = dc.ptr<const scalar_t>();
      if (dbias.dtype == DType::kF32)
        gg::grouped_bias_grad_kernel<scalar_t, float><<<grid, block, 0, s>>>(g, off, n, a.shape[0], dbias.ptr<float>());
      else
        gg::grouped_bias_grad_kernel<scalar_t, scalar_t>
            <<<grid, block, 0, s>>>(g, off, n, a.shape[0], dbias.ptr<scalar_t>());
    });
    check_launch("grouped_gemm_wgrad");
  }
}

}  // namespace moe8::cuda
