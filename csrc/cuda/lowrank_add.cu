// lowrank_add.cu — out[r] = h[r] + t[r] · op(b[e]) for the rows r of expert e, out[r] = h[r] for rows in
// no group: the expert LoRA's B projection fused with the add into the base GEMM's output.
//
// Design. Memory-bound: one read of h, one write of out (a grouped GEMM would write t·b[e] [R, N] and an
// add read it back). The rank (16 for LoRA) is small. [E, N, rank] weights with rank <= 32 (the expert
// LoRA's B as HF stores it): lowrank_add_nk_reg_kernel keeps b's columns in registers along a warp's run of
// rows, or, for 16-bit values and rank <= 16, lowrank_add_nk_mma_kernel runs the sum on the tensor cores.
// Otherwise (and for rows without 16-byte packs) each row's t is staged in shared memory and b[e]
// is read through L1, shared by the block's rows; each thread computes V consecutive outputs of one row.
// The sum over the rank is formed first and added to h, in the CPU reference's order.
//
// Offsets the API did not check (check_indices false) cannot move either kernel outside its tensors: every
// row index is r < rows (offsets never form an address), the group is group_of_row's (in [0, E) or -1,
// whatever the values: its search stays between offsets[0] and offsets[E]), and offsets[e + 1] only bounds a
// run of rows sharing a group (a wrong bound reloads b earlier, never reads past it). Bad offsets give wrong
// sums, as the grouped GEMM's clamped reads do; the CPU reference clamps them into [previous, rows].
#include <cstdint>
#include <cstring>

#include "cuda/common.cuh"
#include "cuda/grouped_gemm_mma.cuh"
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

// kNK, rank <= 32: each warp owns a strip of columns over a run of kWarpRows rows; a thread owns kChunks
// pairs of adjacent columns, 64 apart (lanes read h in 128-byte rows, and b[e]'s [2, rank] block for a pair
// in 16-byte packs). b[e] for a thread's columns is held in registers (fp32, the rank padded with zeros to
// kRank) and reloaded only when the expert changes along the run; the run's t is staged in shared memory
// (fp32) and read as broadcasts. kUnroll rows' h are loaded before any is used (memory-level parallelism),
// so a row costs one read of h and one write of out. (The [N, rank] rows, read 2 * rank bytes apart by
// neighbouring threads, made the row-parallel kernel above 7x slower than its bytes at the Qwen3-30B
// expert LoRA shapes.)
constexpr int kWarpRows = 64, kRegWarps = 4, kUnroll = 8, kRegMaxRank = 32;

template <int kRank>
constexpr int kRegChunks = kRank <= 16 ? 2 : 1;  // 64 fp32 registers of b either way

template <typename T, int kRank>
__global__ void __launch_bounds__(32 * kRegWarps, 4)
    lowrank_add_nk_reg_kernel(const T* __restrict__ h, const T* __restrict__ t, const T* __restrict__ b,
                              const int32_t* __restrict__ offsets, int E, int64_t rows, int64_t N, int rank,
                              bool b_packs, T* __restrict__ out) {
  constexpr int kChunks = kRegChunks<kRank>, kPack = 16 / sizeof(T);
  using P2 = Pack<T, 2>;
  using PB = Pack<T, kPack>;
  extern __shared__ float4 smem4[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t r_begin = (static_cast<int64_t>(blockIdx.x) * kRegWarps + warp) * kWarpRows;
  if (r_begin >= rows) return;
  const int nrows = static_cast<int>(min(rows - r_begin, static_cast<int64_t>(kWarpRows)));
  float* s_t = reinterpret_cast<float*>(smem4) + warp * kWarpRows * kRank;  // [kWarpRows, kRank]
  for (int i = lane; i < kWarpRows * kRank; i += 32) {
    const int row = i / kRank, k = i % kRank;
    s_t[i] = row < nrows && k < rank ? to_float(t[(r_begin + row) * rank + k]) : 0.f;
  }
  __syncwarp();
  int64_t col[kChunks];
  bool ok[kChunks];
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    col[j] = static_cast<int64_t>(blockIdx.y) * 64 * kChunks + 64 * j + 2 * lane;
    ok[j] = col[j] < N;
  }
  float bw[2 * kChunks][kRank];  // [column][k]
  int e = -1;
  int64_t next = -1;  // the first row past the rows that bw is for (warp-uniform)
  for (int u0 = 0; u0 < nrows; u0 += kUnroll) {
    P2 hv[kUnroll][kChunks];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int j = 0; j < kChunks; ++j)
        if (ok[j] && u0 + u < nrows) hv[u][j] = *reinterpret_cast<const P2*>(h + (r_begin + u0 + u) * N + col[j]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = u0 + u;
      if (i >= nrows) break;
      const int64_t r = r_begin + i;
      if (r >= next) {  // a new expert (or the rows before/after every group): reload b's columns
        e = group_of_row(offsets, E, r);
        next = e >= 0 ? offsets[e + 1] : (r < offsets[0] ? offsets[0] : rows);
#pragma unroll
        for (int j = 0; j < kChunks; ++j) {
          const T* be = b + (static_cast<int64_t>(e >= 0 ? e : 0) * N + col[j]) * rank;  // [2, rank]
          if (e >= 0 && ok[j] && b_packs) {  // rank == kRank, 16-byte aligned
#pragma unroll
            for (int q = 0; q < 2 * kRank / kPack; ++q) {
              const PB p = reinterpret_cast<const PB*>(be)[q];
#pragma unroll
              for (int v = 0; v < kPack; ++v)
                bw[2 * j + (q * kPack + v) / kRank][(q * kPack + v) % kRank] = to_float(p.v[v]);
            }
          } else {
#pragma unroll
            for (int c = 0; c < 2; ++c)
#pragma unroll
              for (int k = 0; k < kRank; ++k)
                bw[2 * j + c][k] = e >= 0 && ok[j] && k < rank ? to_float(be[c * rank + k]) : 0.f;
          }
        }
      }
      float s[2 * kChunks] = {};
      const float4* tr = reinterpret_cast<const float4*>(s_t + i * kRank);
#pragma unroll
      for (int k4 = 0; k4 < kRank / 4; ++k4) {
        const float4 tk = tr[k4];
#pragma unroll
        for (int c = 0; c < 2 * kChunks; ++c) {
          s[c] += tk.x * bw[c][4 * k4];
          s[c] += tk.y * bw[c][4 * k4 + 1];
          s[c] += tk.z * bw[c][4 * k4 + 2];
          s[c] += tk.w * bw[c][4 * k4 + 3];
        }
      }
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        if (!ok[j]) continue;
        P2 o;
        o.v[0] = from_float<T>(to_float(hv[u][j].v[0]) + s[2 * j]);
        o.v[1] = from_float<T>(to_float(hv[u][j].v[1]) + s[2 * j + 1]);
        *reinterpret_cast<P2*>(out + r * N + col[j]) = o;
      }
    }
  }
}

// kNK, 16-bit, rank <= 32: t · b[e]^T on the tensor cores (mma.sync m16n8k16, kK steps of 16 along the rank,
// padded with zeros) instead of the fp32 FMAs and shared-memory broadcasts of the kernel above: as fast at rank
// 16, 1.5-1.7x faster at rank 32 (Qwen3-30B expert LoRA shapes, bench/results/lowrank_h200.md). Both move
// 1.2-1.5 TB/s: a warp keeps one tile's rows in flight, too few bytes per SM. A warp owns a strip of kMmaCols columns
// over a run of kMmaWarpRows rows, 16 rows at a time. The mma's 8 columns of subtile j are mapped onto the
// strip's columns so that a thread's accumulators are runs of 8 adjacent columns: logical column c of subtile
// j is column (j / 4) * 32 + (c / 2) * 8 + 2 * (j % 4) + c % 2, so lane l holds columns q * 32 + (l % 4) * 8
// .. + 7 (q < kMmaRuns) of rows l / 4 and l / 4 + 8, and h is read and out written in 16-byte packs, four
// lanes covering 64 contiguous bytes of a row. The next tile's rows of h and t are loaded while a tile is
// computed; the group is searched for again only where its rows end, and b[e]'s fragments (8 kK registers
// per run, packed pairs) reloaded only when it changes. A tile across a group boundary takes one mma pass per
// group, the other groups' rows of t read as zeros; rows in no group get h. The sum over the rank is the
// mma's (fp32), then added to h once, as in the kernels above.
constexpr int kMmaWarpRows = 128, kMmaRuns = 2, kMmaCols = 32 * kMmaRuns, kMmaTiles = 4 * kMmaRuns;

template <typename T>
__device__ __forceinline__ uint32_t pack_pair(const T* p, bool lo_ok, bool hi_ok) {
  const T zero = from_float<T>(0.f);
  const T v[2] = {lo_ok ? p[0] : zero, hi_ok ? p[1] : zero};
  uint32_t u;
  memcpy(&u, v, sizeof(u));
  return u;
}

template <typename T, int kK>
__global__ void __launch_bounds__(32 * kRegWarps)
    lowrank_add_nk_mma_kernel(const T* __restrict__ h, const T* __restrict__ t, const T* __restrict__ b,
                              const int32_t* __restrict__ offsets, int E, int64_t rows, int64_t N, int rank,
                              T* __restrict__ out) {
  using P = Pack<T, 8>;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, tig = lane % 4;
  // Blocks in a row take the strips of the same rows: what runs at once reads whole rows of h, not a strip of
  // every row (64 of a row's 2-4 KB at a time, a third of the bandwidth).
  const int64_t strips = (N + kMmaCols - 1) / kMmaCols, block = blockIdx.x;
  const int64_t r_begin = ((block / strips) * kRegWarps + warp) * kMmaWarpRows;
  if (r_begin >= rows) return;
  const int64_t r_end = min(rows, r_begin + kMmaWarpRows);
  const int64_t strip = (block % strips) * kMmaCols;
  int64_t col[kMmaRuns];  // the first of this lane's 8 columns in each run
  bool ok[kMmaRuns];      // N % 8 == 0: a run is wholly inside or outside
#pragma unroll
  for (int q = 0; q < kMmaRuns; ++q) {
    col[q] = strip + q * 32 + tig * 8;
    ok[q] = col[q] < N;
  }
  // b[e]'s fragment of each subtile and step s: k = 16 s + 2 tig, +1 and 16 s + 2 tig + 8, +9 of column g
  uint32_t bf[kMmaTiles][2 * kK];
  int loaded = -1;
  // A tile's rows of h, and of t in the mma's A layout (rows g and g + 8, k = 16 s + 2 tig, +1 in a0, a1 and
  // + 8, +9 in a2, a3; zeros past the rank), loaded one tile ahead.
  const auto load_rows = [&](P(&dst)[2][kMmaRuns], uint32_t(&ta)[kK][4], int64_t r0) {
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int q = 0; q < kMmaRuns; ++q) {
        const int64_t row = r0 + g + 8 * half;
        if (row < r_end && ok[q]) dst[half][q] = *reinterpret_cast<const P*>(h + row * N + col[q]);
      }
#pragma unroll
    for (int step = 0; step < kK; ++step)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t row = r0 + g + 8 * (i % 2);
        const int k = 16 * step + 2 * tig + 8 * (i / 2);
        const bool in = row < r_end;
        ta[step][i] = pack_pair(t + (in ? row : 0) * rank + (k < rank ? k : 0), in && k < rank, in && k + 1 < rank);
      }
  };
  int e = -1;                 // the group of the rows up to run_end (warp-uniform, like every row bound here)
  int64_t run_end = r_begin;  // the first row past those e is known for: searched again only there
  P hv[2][kMmaRuns], hn[2][kMmaRuns];
  uint32_t tv[kK][4], tn[kK][4];
  load_rows(hv, tv, r_begin);
  for (int64_t r0 = r_begin; r0 < r_end; r0 += 16) {
    if (r0 + 16 < r_end) load_rows(hn, tn, r0 + 16);  // the next tile's rows in flight while this one is done
    float d[kMmaTiles][4] = {};
    const int64_t tile_end = min(r0 + 16, r_end);
    for (int64_t r = r0; r < tile_end;) {  // each group's rows of the tile
      if (r >= run_end) {
        e = group_of_row(offsets, E, r);
        run_end = e >= 0 ? offsets[e + 1] : (r < offsets[0] ? offsets[0] : r_end);
        run_end = max(run_end, r + 1);  // a step of at least one row, whatever the offsets
      }
      const int64_t end = min(run_end, tile_end);
      if (e >= 0) {
        if (e != loaded) {
          const T* be = b + static_cast<int64_t>(e) * N * rank;
#pragma unroll
          for (int j = 0; j < kMmaTiles; ++j) {
            const int64_t n = strip + (j / 4) * 32 + (g / 2) * 8 + 2 * (j % 4) + g % 2;
#pragma unroll
            for (int kk = 0; kk < 2 * kK; ++kk) {
              const int k = 2 * tig + 8 * kk;
              bf[j][kk] =
                  pack_pair(be + (n < N ? n : 0) * rank + (k < rank ? k : 0), n < N && k < rank, n < N && k + 1 < rank);
            }
          }
          loaded = e;
        }
#pragma unroll
        for (int step = 0; step < kK; ++step) {
          uint32_t a[4];  // t's rows of this group only
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int64_t row = r0 + g + 8 * (i % 2);
            a[i] = row >= r && row < end ? tv[step][i] : 0u;
          }
#pragma unroll
          for (int j = 0; j < kMmaTiles; ++j) {
            const uint32_t bj[2] = {bf[j][2 * step], bf[j][2 * step + 1]};
            gg::mma_16816<T>(d[j], a, bj);
          }
        }
      }
      r = end;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int q = 0; q < kMmaRuns; ++q) {
        const int64_t row = r0 + g + 8 * half;
        if (row >= r_end || !ok[q]) continue;
        P o;
#pragma unroll
        for (int v = 0; v < 8; ++v)
          o.v[v] = from_float<T>(to_float(hv[half][q].v[v]) + d[4 * q + v / 2][2 * half + v % 2]);
        *reinterpret_cast<P*>(out + row * N + col[q]) = o;
      }
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int q = 0; q < kMmaRuns; ++q) hv[half][q] = hn[half][q];
#pragma unroll
    for (int step = 0; step < kK; ++step)
#pragma unroll
      for (int i = 0; i < 4; ++i) tv[step][i] = tn[step][i];
  }
}

template <typename T, int kK>
void launch_nk_mma(const TensorView& h, const TensorView& t, const TensorView& b, const TensorView& offsets, int64_t N,
                   int rank, const TensorView& out, cudaStream_t s) {
  const int64_t rows = h.shape[0];
  const int64_t blocks = ceil_div(rows, int64_t{kRegWarps} * kMmaWarpRows) * ceil_div(N, int64_t{kMmaCols});
  const dim3 grid(static_cast<unsigned>(blocks));
  lowrank_add_nk_mma_kernel<T, kK><<<grid, 32 * kRegWarps, 0, s>>>(h.ptr<T>(), t.ptr<T>(), b.ptr<T>(),
                                                                   offsets.ptr<int32_t>(), static_cast<int>(b.shape[0]),
                                                                   rows, N, rank, out.ptr<T>());
  check_launch("lowrank_add_nk_mma_kernel");
}

template <typename T, int kRank>
void launch_nk_reg(const TensorView& h, const TensorView& t, const TensorView& b, const TensorView& offsets, int64_t N,
                   int rank, const TensorView& out, cudaStream_t s) {
  const int64_t rows = h.shape[0];
  const dim3 grid(static_cast<unsigned>(ceil_div(rows, int64_t{kRegWarps} * kWarpRows)),
                  static_cast<unsigned>(ceil_div(N, int64_t{64} * kRegChunks<kRank>)));
  const size_t smem = static_cast<size_t>(kRegWarps) * kWarpRows * kRank * sizeof(float);
  const bool b_packs = rank == kRank && reinterpret_cast<uintptr_t>(b.data) % 16 == 0;
  lowrank_add_nk_reg_kernel<T, kRank>
      <<<grid, 32 * kRegWarps, smem, s>>>(h.ptr<T>(), t.ptr<T>(), b.ptr<T>(), offsets.ptr<int32_t>(),
                                          static_cast<int>(b.shape[0]), rows, N, rank, b_packs, out.ptr<T>());
  check_launch("lowrank_add_nk_reg_kernel");
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
    } else if (rank <= kRegMaxRank) {
      if constexpr (sizeof(T) == 2) {
        if (rank <= 16) return launch_nk_mma<T, 1>(h, t, b, offsets, N, rank, out, s);
        return launch_nk_mma<T, 2>(h, t, b, offsets, N, rank, out, s);
      }
      if (rank <= 16)
        launch_nk_reg<T, 16>(h, t, b, offsets, N, rank, out, s);
      else
        launch_nk_reg<T, kRegMaxRank>(h, t, b, offsets, N, rank, out, s);
    } else if (rank % V == 0) {
      launch<T, V, false, true>(h, t, b, offsets, N, rank, out, s);
    } else {
      launch<T, V, false, false>(h, t, b, offsets, N, rank, out, s);
    }
  });
}

}  // namespace moe8::cuda
