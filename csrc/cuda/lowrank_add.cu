// lowrank_add.cu — out[r] = h[r] + t[r] · op(b[e]) for the rows r of expert e, out[r] = h[r] for rows in
// no group: the expert LoRA's B projection fused with the add into the base GEMM's output.
//
// Design. Memory-bound: one read of h, one write of out (a grouped GEMM would write t·b[e] [R, N] and an
// add read it back). The rank (16 for LoRA) is small. [E, N, rank] weights with rank <= 32 (the expert
// LoRA's B as HF stores it): for 16-bit values, lowrank_add_nk_ring_kernel streams h and t through a
// shared-memory ring (cp.async, several tiles ahead) and runs the sum on the tensor cores; for f32 (or a t
// without 16-byte alignment) lowrank_add_nk_reg_kernel keeps b's columns in registers along a warp's run of
// rows. Otherwise (and for rows without 16-byte packs) each row's t is staged in shared memory and b[e]
// is read through L1, shared by the block's rows; each thread computes V consecutive outputs of one row.
// The sum over the rank is formed first (fp32) and added to h once, as the CPU reference does.
//
// Offsets the API did not check (check_indices false) cannot move any of the kernels outside its tensors:
// every row index is r < rows (offsets never form an address; the ring kernel's copies of h and t are cut at
// row rows too), the group is group_of_row's (in [0, E) or -1, whatever the values: its search stays between
// offsets[0] and offsets[E]), and offsets[e + 1] only bounds a run of rows sharing a group (a wrong bound
// reloads b earlier, never reads past it; each step along the rows is at least one row). Bad offsets give
// wrong sums, as the grouped GEMM's clamped reads do; the CPU reference clamps them into [previous, rows].
#include <algorithm>
#include <climits>
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

// kNK, 16-bit, rank <= 32, N % 8 == 0, h, out and t 16-byte aligned: the ring kernel, the one these shapes (the
// Qwen3-30B expert LoRA's) run. t · b[e]^T on the tensor cores (mma.sync m16n8k16, kK steps of 16 along the
// rank, padded with zeros), its fp32 sum added to h once.
//
// Why a ring. A kernel that holds the rows it will add in registers keeps too few bytes in flight: the
// register kernel above and a tensor-core one that prefetched one 16-row tile into registers both moved
// 1.2-1.5 TB/s at those shapes (bench/results/lowrank_h200.md), ~24 KB in flight per SM; taking out the FMAs
// or the group lookups changed nothing. cp.async moves h and t into shared memory without holding a register,
// so a warp keeps kRingStages - 1 tiles in flight while it adds one: 3 x 2 KB of h per warp, 16 warps per SM
// (two blocks at 128 registers), 96 KB of h in flight per SM, plus t's rows (0.5 or 1 KB a tile, mostly L2
// hits: every strip of a row reads them).
//
// Why per-lane cp.async and no block barrier (rather than TMA bulk copies of whole rows). Each lane copies
// exactly the four 16-byte chunks of h that the mma's accumulator layout gives it to add (below), into a slot
// only it reads back, so a warp is its own pipeline: no mbarrier phases, no producer warp, no __syncthreads.
// Only t's tile (16 rows x rank, contiguous, copied by the warp's lanes together) is shared across lanes, so a
// __syncwarp after each wait makes it visible and tells a lane that the slot it refills is read by every lane.
//
// Why 64-column strips and not whole rows per warp. b[e]'s fragments for whole rows would take N * rank / 256
// registers a thread (128 at N = 2048, rank 16). A strip keeps them at 16 kK, two blocks fit per SM, and a
// block's 8 warps take 8 adjacent strips (a band of 512 columns) of the same rows, while the blocks of the other
// bands run over the same rows: what is in flight is whole rows, 1 KB runs per band.
//
// Why persistent blocks over contiguous row ranges. b's fragments are reloaded only where the expert changes
// along a warp's rows (rows are in expert order: every ~32 tiles at ~512 rows per expert), not once per block of
// a few tiles, and the pipeline fills once per block. Tiles are equal work, so the rows are split evenly.
//
// Layout. The mma's 8 columns of subtile j are mapped onto the strip's columns so that a thread's accumulators
// are runs of 8 adjacent columns: logical column c of subtile j is column (j / 4) * 32 + (c / 2) * 8 + 2 * (j %
// 4) + c % 2, so lane l holds columns q * 32 + (l % 4) * 8 .. + 7 (q < kRingRuns) of rows l / 4 and l / 4 + 8:
// those are its four chunks of h, read from the ring and written to out in 16-byte packs. A tile across a group
// boundary takes one mma pass per group, the other groups' rows of t read as zeros; rows in no group get h.
constexpr int kRingWarps = 8, kRingRuns = 2, kRingCols = 32 * kRingRuns, kRingTiles = 4 * kRingRuns;
constexpr int kRingBand = kRingWarps * kRingCols, kRingRows = 16, kRingStages = 4, kRingBlocksPerSm = 2;

// One warp's slot of one stage: h as [chunk (2 * half + run)][lane] 16-byte chunks (lane-contiguous: a warp's
// read of one chunk is 512 contiguous bytes, free of bank conflicts), then t's [kRingRows, rank] tile.
template <int kK>
struct RingSlot {
  static constexpr int kHBytes = 2 * kRingRuns * 32 * 16;
  static constexpr int kTBytes = kRingRows * 16 * kK * 2;
  static constexpr int kBytes = kHBytes + kTBytes;
  static constexpr int kBlockBytes = kRingWarps * kRingStages * kBytes;
};

// NOTES: the "memory" clobbers keep the compiler from moving the ring's plain shared-memory reads across the
// copies and the wait. src_bytes < 16 copies that many and zero-fills the rest; src stays 16-byte aligned and
// inside its tensor either way.
__device__ __forceinline__ void ring_copy(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(gg::smem_addr(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void ring_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void ring_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kRingStages - 2) : "memory");
}

template <typename T>
__device__ __forceinline__ uint32_t pack_pair(const T* p, bool lo_ok, bool hi_ok) {
  const T zero = from_float<T>(0.f);
  const T v[2] = {lo_ok ? p[0] : zero, hi_ok ? p[1] : zero};
  uint32_t u;
  memcpy(&u, v, sizeof(u));
  return u;
}

template <typename T>
__device__ __forceinline__ uint32_t pack_floats(float lo, float hi) {
  const T v[2] = {from_float<T>(lo), from_float<T>(hi)};
  uint32_t u;
  memcpy(&u, v, sizeof(u));
  return u;
}

// Block x: band x % bands (kRingBand columns), part x / bands of the row tiles (of `parts`, contiguous).
template <typename T, int kK>
__global__ void __launch_bounds__(32 * kRingWarps, kRingBlocksPerSm)
    lowrank_add_nk_ring_kernel(const T* __restrict__ h, const T* __restrict__ t, const T* __restrict__ b,
                               const int32_t* __restrict__ offsets, int E, int64_t rows, int64_t N, int rank,
                               int64_t parts, T* __restrict__ out) {
  using Slot = RingSlot<kK>;
  extern __shared__ float4 ring_smem[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, tig = lane % 4;
  const int64_t bands = (N + kRingBand - 1) / kRingBand, tiles = (rows + kRingRows - 1) / kRingRows;
  const int64_t band = blockIdx.x % bands, part = blockIdx.x / bands;
  const int64_t strip = band * kRingBand + warp * kRingCols;
  const int64_t tile_begin = part * tiles / parts, n_tiles = (part + 1) * tiles / parts - tile_begin;
  if (strip >= N || n_tiles <= 0) return;  // warp-uniform: no barrier below spans more than a warp
  const int64_t r_end = min(rows, (tile_begin + n_tiles) * kRingRows);
  unsigned char* ring = reinterpret_cast<unsigned char*>(ring_smem) + warp * kRingStages * Slot::kBytes;
  int64_t col[kRingRuns];  // the first of this lane's 8 columns in each run
  bool ok[kRingRuns];      // N % 8 == 0: a run is wholly inside or outside
#pragma unroll
  for (int q = 0; q < kRingRuns; ++q) {
    col[q] = strip + q * 32 + tig * 8;
    ok[q] = col[q] < N;
  }
  // Tile `tile`'s rows of h (this lane's chunks) and of t (the warp's lanes together: t's rows of a tile are
  // contiguous, 32 * rank bytes from a 32-byte aligned start, the last tile's cut short) into `slot`.
  const auto fill = [&](int64_t tile, int slot) {
    unsigned char* dst = ring + slot * Slot::kBytes;
    const int64_t r0 = tile * kRingRows;
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int q = 0; q < kRingRuns; ++q) {
        const int64_t row = r0 + g + 8 * half;
        const bool in = row < rows && ok[q];
        ring_copy(dst + ((2 * half + q) * 32 + lane) * 16, in ? h + row * N + col[q] : h, in ? 16 : 0);
      }
    const int64_t t_bytes = (min(rows, r0 + kRingRows) - r0) * rank * static_cast<int64_t>(sizeof(T));
    const unsigned char* src = reinterpret_cast<const unsigned char*>(t + r0 * rank);
#pragma unroll
    for (int i = 0; i < kK; ++i) {
      const int at = 16 * (lane + 32 * i);  // 2 * rank <= 32 kK chunks
      if (at < t_bytes)
        ring_copy(dst + Slot::kHBytes + at, src + at, static_cast<int>(t_bytes - at < 16 ? t_bytes - at : 16));
    }
  };
  // b[e]'s fragment of each subtile and step s: k = 16 s + 2 tig, +1 and 16 s + 2 tig + 8, +9 of column g
  uint32_t bf[kRingTiles][2 * kK];
  int loaded = -1;
  int e = -1;                                // the group of the rows up to run_end (warp-uniform, like every row bound)
  int64_t run_end = tile_begin * kRingRows;  // the first row past those e is known for: searched again only there
  const auto add_tile = [&](int64_t tile, int slot) {
    const unsigned char* src = ring + slot * Slot::kBytes;
    const T* st = reinterpret_cast<const T*>(src + Slot::kHBytes);  // [kRingRows, rank]
    const int64_t r0 = tile * kRingRows;
    const int n_rows = static_cast<int>(min(static_cast<int64_t>(kRingRows), rows - r0));  // rows of the tile, from r0
    // t's rows in the mma's A layout (rows g and g + 8, k = 16 s + 2 tig, +1 in a0, a1 and + 8, +9 in a2, a3;
    // zeros past the rank), masked below to each group's rows
    uint32_t ta[kK][4];
#pragma unroll
    for (int step = 0; step < kK; ++step)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i % 2), k = 16 * step + 2 * tig + 8 * (i / 2);
        ta[step][i] = pack_pair(st + row * rank + (k < rank ? k : 0), k < rank, k + 1 < rank);
      }
    // One run of 32 columns at a time: 16 accumulators live, not 32 (what lets rank 32 fit without spills). The
    // second run walks the tile's groups again from the state the first found at the tile's start.
    const int e_tile = e;
    const int64_t run_end_tile = run_end;
#pragma unroll
    for (int q = 0; q < kRingRuns; ++q) {
      if (q > 0) {
        e = e_tile;
        run_end = run_end_tile;
      }
      float d[4][4] = {};
      for (int lo = 0; lo < n_rows;) {  // each group's rows [lo, hi) of the tile
        const int64_t r = r0 + lo;
        if (r >= run_end) {
          e = group_of_row(offsets, E, r);
          run_end = e >= 0 ? offsets[e + 1] : (r < offsets[0] ? offsets[0] : r_end);
          run_end = max(run_end, r + 1);  // a step of at least one row, whatever the offsets
        }
        const int hi = static_cast<int>(min(run_end - r0, static_cast<int64_t>(n_rows)));
        if (e >= 0) {
          if (e != loaded) {
            const T* be = b + static_cast<int64_t>(e) * N * rank;
#pragma unroll
            for (int j = 0; j < kRingTiles; ++j) {
              const int64_t n = strip + (j / 4) * 32 + (g / 2) * 8 + 2 * (j % 4) + g % 2;
#pragma unroll
              for (int kk = 0; kk < 2 * kK; ++kk) {
                const int k = 2 * tig + 8 * kk;
                bf[j][kk] = pack_pair(be + (n < N ? n : 0) * rank + (k < rank ? k : 0), n < N && k < rank,
                                      n < N && k + 1 < rank);
              }
            }
            loaded = e;
          }
#pragma unroll
          for (int step = 0; step < kK; ++step) {
            uint32_t a[4];  // t's rows of this group only
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int row = g + 8 * (i % 2);
              a[i] = row >= lo && row < hi ? ta[step][i] : 0u;
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const uint32_t bj[2] = {bf[4 * q + j][2 * step], bf[4 * q + j][2 * step + 1]};
              gg::mma_16816<T>(d[j], a, bj);
            }
          }
        }
        lo = hi;
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = g + 8 * half;
        if (row >= n_rows || !ok[q]) continue;
        // NOTES: __stwb (st.global.wb, the default policy) keeps the store one 16-byte access; a plain store of
        // the pack was split into 4-byte ones for the first run.
        const uint4 hv = *reinterpret_cast<const uint4*>(src + ((2 * half + q) * 32 + lane) * 16);
        const uint32_t hp[4] = {hv.x, hv.y, hv.z, hv.w};
        uint32_t op[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          T hh[2];
          memcpy(hh, &hp[p], sizeof(hh));
          op[p] = pack_floats<T>(to_float(hh[0]) + d[p][2 * half], to_float(hh[1]) + d[p][2 * half + 1]);
        }
        const uint4 w = make_uint4(op[0], op[1], op[2], op[3]);
        __stwb(reinterpret_cast<uint4*>(out + (r0 + row) * N + col[q]), w);
      }
    }
  };
  // Group i of a lane's copies holds tile i (empty groups past the last tile keep the count).
#pragma unroll
  for (int s = 0; s < kRingStages - 1; ++s) {
    if (s < n_tiles) fill(tile_begin + s, s);
    ring_commit();
  }
  int slot = 0;
  for (int64_t i = 0; i < n_tiles; ++i) {
    ring_wait();   // this lane's copies of tile i have landed
    __syncwarp();  // ... and every lane's (t's chunks), and every lane is done with tile i - 1's slot
    if (i + kRingStages - 1 < n_tiles) fill(tile_begin + i + kRingStages - 1, slot == 0 ? kRingStages - 1 : slot - 1);
    ring_commit();
    add_tile(tile_begin + i, slot);
    slot = slot == kRingStages - 1 ? 0 : slot + 1;
  }
}

template <typename T, int kK>
void launch_nk_ring(const TensorView& h, const TensorView& t, const TensorView& b, const TensorView& offsets, int64_t N,
                    int rank, const TensorView& out, cudaStream_t s) {
  const int64_t rows = h.shape[0], bands = ceil_div(N, kRingBand), tiles = ceil_div(rows, kRingRows);
  // As many blocks as run at once, split evenly over the bands; never more parts than tiles.
  const int64_t sms = std::max(1, device_facts(h.device_index).sms);
  const int64_t parts = std::min(tiles, std::max<int64_t>(1, ceil_div(sms * kRingBlocksPerSm, bands)));
  MOE8_CHECK(bands * parts <= INT_MAX, "grouped_lowrank_add: too many column bands (", bands, ") for one launch");
  constexpr int smem = RingSlot<kK>::kBlockBytes;
  auto kernel = lowrank_add_nk_ring_kernel<T, kK>;
  // Every call, not once: the limit is per device, and the call is cheap and allowed during graph capture.
  cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             "grouped_lowrank_add: cudaFuncSetAttribute");
  cuda_check(
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared),
      "grouped_lowrank_add: cudaFuncSetAttribute");
  kernel<<<static_cast<unsigned>(bands * parts), 32 * kRingWarps, smem, s>>>(
      h.ptr<T>(), t.ptr<T>(), b.ptr<T>(), offsets.ptr<int32_t>(), static_cast<int>(b.shape[0]), rows, N, rank, parts,
      out.ptr<T>());
  check_launch("lowrank_add_nk_ring_kernel");
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
    if constexpr (sizeof(T) == 2) {  // b is read in pairs of 16-bit values: any alignment
      if (!kn && rank <= kRegMaxRank && use_packs<T>(N, {h.data, out.data, t.data})) {
        if (rank <= 16) return launch_nk_ring<T, 1>(h, t, b, offsets, N, rank, out, s);
        return launch_nk_ring<T, 2>(h, t, b, offsets, N, rank, out, s);
      }
    }
    if (!use_packs<T>(N, {h.data, out.data, b.data})) {  // packs need N % V == 0, b's rows too
      if (kn)
        launch<T, 1, true, false>(h, t, b, offsets, N, rank, out, s);
      else
        launch<T, 1, false, false>(h, t, b, offsets, N, rank, out, s);
    } else if (kn) {
      launch<T, V, true, false>(h, t, b, offsets, N, rank, out, s);
    } else if (rank <= kRegMaxRank) {  // f32, or a 16-bit t without 16-byte alignment
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
