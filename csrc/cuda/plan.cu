// plan.cu — the dispatch plan: a stable counting sort of the T*K (token, slot) pairs by expert, giving
// counts, padded group offsets, row_to_slot and slot_to_row.
//
// Design. The slots are cut into nchunks fixed chunks of 256 * steps slots (steps grows with T*K so that
// there are about kTargetChunks chunks); three launches:
//   1. plan_histogram: one block per chunk counts its slots per expert (shared-memory integer atomics,
//      one per expert per warp step: a count does not depend on order) into workspace[e * nchunks + c].
//   2. plan_scan: one block turns each expert's row of the workspace into exclusive prefixes in chunk
//      order, and writes counts and the padded offsets.
//   3. plan_scatter: one block per chunk again. Each warp owns a contiguous run of the chunk's slots and
//      walks it 32 slots at a time; __match_any_sync finds the lanes with the same expert, so a slot's
//      rank is (running count of its expert in this warp) + (equal lanes below it). Rows of an expert
//      thus keep ascending slot order, whatever the timing. The same launch writes -1 into padding rows
//      and into rows past offsets[E].
// Integer work only: the plan is deterministic by construction.
#include <algorithm>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace moe8::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxExperts = 1024;  // as the API allows; next_row below is then 32 KiB
constexpr int64_t kTargetChunks = 128;
constexpr int kMinSteps = 4;
constexpr int kBatch = 4;  // steps whose ids are loaded together, to keep several loads in flight
constexpr unsigned kFull = 0xffffffffu;

struct Chunking {
  int steps;        // 32-slot steps per warp
  int64_t chunk;    // slots per block: kThreads * steps
  int64_t nchunks;  // at least 1, so that the launches below always have a block
};

Chunking plan_chunking(int64_t num_slots) {
  const int64_t steps = std::max<int64_t>(kMinSteps, ceil_div(num_slots, kThreads * kTargetChunks));
  const int64_t chunk = steps * kThreads;
  return {static_cast<int>(steps), chunk, std::max<int64_t>(1, ceil_div(num_slots, chunk))};
}

__device__ __forceinline__ int warp_inclusive_scan(int v, int lane) {
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(kFull, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

// An id as the plan reads it: -1 (the slot joins no expert) where it lies outside [0, E), so that ids the API
// was told not to check can never index past the E counters or rows.
__device__ __forceinline__ int plan_id(const int32_t* __restrict__ ids, int64_t i, int E) {
  const int x = ids[i];
  return x >= 0 && x < E ? x : -1;
}

__global__ void __launch_bounds__(kThreads)
    plan_histogram_kernel(const int32_t* __restrict__ ids, int64_t num_slots, int E, int64_t chunk, int nchunks,
                          int32_t* __restrict__ ws) {
  __shared__ int hist[kMaxExperts];
  for (int e = threadIdx.x; e < E; e += kThreads) hist[e] = 0;
  __syncthreads();
  const int64_t begin = blockIdx.x * chunk, end = std::min(num_slots, begin + chunk);
  const unsigned below = (1u << (threadIdx.x & 31)) - 1u;
  // One atomic per distinct expert per warp step: skewed routing would otherwise queue on one counter.
  // The trip count is the same for every thread, so the full-mask match is legal.
  for (int64_t i0 = begin; i0 < end; i0 += kThreads) {
    const int64_t i = i0 + threadIdx.x;
    const int x = i < end ? plan_id(ids, i, E) : -1;
    const unsigned peers = __match_any_sync(kFull, x);
    if (x >= 0 && (peers & below) == 0) atomicAdd(&hist[x], __popc(peers));
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kThreads) ws[static_cast<int64_t>(e) * nchunks + blockIdx.x] = hist[e];
}

// One warp per expert (in turn): exclusive scan of its chunk counts, 4 x 32 chunks per load batch.
__global__ void __launch_bounds__(1024) plan_scan_kernel(int32_t* __restrict__ ws, int nchunks, int E, int pad,
                                                         int32_t* __restrict__ counts, int32_t* __restrict__ offsets) {
  __shared__ int total[kMaxExperts];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int e = warp; e < E; e += 32) {
    int32_t* row = ws + static_cast<int64_t>(e) * nchunks;
    int carry = 0;
    for (int c0 = 0; c0 < nchunks; c0 += 4 * 32) {
      int v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int c = c0 + 32 * u + lane;
        v[u] = c < nchunks ? row[c] : 0;
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int c = c0 + 32 * u + lane;
        const int incl = warp_inclusive_scan(v[u], lane);
        if (c < nchunks) row[c] = carry + incl - v[u];
        carry += __shfl_sync(kFull, incl, 31);
      }
    }
    if (lane == 0) {
      total[e] = carry;
      counts[e] = carry;
    }
  }
  __syncthreads();
  if (warp == 0) {
    if (lane == 0) offsets[0] = 0;
    int carry = 0;
    for (int e0 = 0; e0 < E; e0 += 32) {
      const int e = e0 + lane;
      const int v = e < E ? (total[e] + pad - 1) / pad * pad : 0;
      const int incl = warp_inclusive_scan(v, lane);
      if (e < E) offsets[e + 1] = carry + incl;
      carry += __shfl_sync(kFull, incl, 31);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    plan_scatter_kernel(const int32_t* __restrict__ ids, int64_t num_slots, int E, int steps, int nchunks,
                        const int32_t* __restrict__ ws, const int32_t* __restrict__ counts,
                        const int32_t* __restrict__ offsets, int pad, int32_t* __restrict__ row_to_slot,
                        int64_t num_rows, int32_t* __restrict__ slot_to_row) {
  __shared__ int next_row[kWarps][kMaxExperts];  // per warp: the row its next slot of expert e goes to
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned below = (1u << lane) - 1u;
  const int64_t begin = blockIdx.x * static_cast<int64_t>(kThreads) * steps + static_cast<int64_t>(warp) * 32 * steps;
  const int64_t end = std::min(num_slots, begin + static_cast<int64_t>(32) * steps);
  int* mine = next_row[warp];

  // Pass 1: how many slots of each expert this warp holds.
  for (int e = lane; e < E; e += 32) mine[e] = 0;
  __syncwarp();
  for (int s0 = 0; s0 < steps && begin + 32 * s0 < end; s0 += kBatch) {
    int x[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t i = begin + 32 * (s0 + u) + lane;
      x[u] = (s0 + u < steps && i < end) ? plan_id(ids, i, E) : -1;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const unsigned peers = __match_any_sync(kFull, x[u]);
      if (x[u] >= 0 && (peers & below) == 0) mine[x[u]] += __popc(peers);
      __syncwarp();
    }
  }
  __syncthreads();

  // Exclusive scan over the warps, in order, from the chunk's base row of each expert.
  for (int e = threadIdx.x; e < E; e += kThreads) {
    int run = offsets[e] + ws[static_cast<int64_t>(e) * nchunks + blockIdx.x];
    for (int w = 0; w < kWarps; ++w) {
      const int c = next_row[w][e];
      next_row[w][e] = run;
      run += c;
    }
  }
  __syncthreads();

  // Pass 2: the same walk, now assigning rows.
  for (int s0 = 0; s0 < steps && begin + 32 * s0 < end; s0 += kBatch) {
    int x[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t i = begin + 32 * (s0 + u) + lane;
      x[u] = (s0 + u < steps && i < end) ? plan_id(ids, i, E) : -1;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const unsigned peers = __match_any_sync(kFull, x[u]);
      const int base = x[u] >= 0 ? mine[x[u]] : 0;
      __syncwarp();  // every peer has read mine[x] before the leader moves it
      if (x[u] >= 0) {
        const int64_t i = begin + 32 * (s0 + u) + lane;
        const int row = base + __popc(peers & below);
        row_to_slot[row] = static_cast<int32_t>(i);
        slot_to_row[i] = row;
        if ((peers & below) == 0) mine[x[u]] = base + __popc(peers);
      } else if (s0 + u < steps && begin + 32 * (s0 + u) + lane < end) {
        slot_to_row[begin + 32 * (s0 + u) + lane] = -1;  // an id out of range: no row
      }
      __syncwarp();
    }
  }

  // Rows holding no slot: each group's padding, then everything from offsets[E] to the end.
  const int64_t pad_units = pad > 1 ? static_cast<int64_t>(E) * (pad - 1) : 0;
  const int64_t tail = offsets[E];
  const int64_t units = pad_units + (num_rows - tail);
  for (int64_t u = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; u < units;
       u += static_cast<int64_t>(gridDim.x) * kThreads) {
    int64_t row;
    if (u < pad_units) {
      const int e = static_cast<int>(u / (pad - 1));
      row = offsets[e] + counts[e] + u % (pad - 1);
      if (row >= offsets[e + 1]) continue;
    } else {
      row = tail + (u - pad_units);
    }
    row_to_slot[row] = -1;
  }
}

}  // namespace

size_t plan_workspace_elems(int64_t num_slots, int num_experts) {
  return static_cast<size_t>(plan_chunking(num_slots).nchunks) * static_cast<size_t>(num_experts);
}

void build_dispatch_plan(const TensorView& ids, int num_experts, int pad_multiple, const TensorView& counts,
                         const TensorView& offsets, const TensorView& row_to_slot, const TensorView& slot_to_row,
                         const TensorView& workspace, void* stream) {
  MOE8_CHECK(num_experts >= 1 && num_experts <= kMaxExperts, "build_dispatch_plan: num_experts must be in [1, ",
             kMaxExperts, "] on CUDA, got ", num_experts);
  cudaStream_t s = as_stream(stream);
  const int64_t num_slots = ids.numel();
  const int pad = std::max(1, pad_multiple);
  const Chunking ch = plan_chunking(num_slots);
  const int nchunks = static_cast<int>(ch.nchunks);
  int32_t* ws = workspace.ptr<int32_t>();

  plan_histogram_kernel<<<nchunks, kThreads, 0, s>>>(ids.ptr<int32_t>(), num_slots, num_experts, ch.chunk, nchunks, ws);
  check_launch("build_dispatch_plan: plan_histogram_kernel");
  plan_scan_kernel<<<1, 1024, 0, s>>>(ws, nchunks, num_experts, pad, counts.ptr<int32_t>(), offsets.ptr<int32_t>());
  check_launch("build_dispatch_plan: plan_scan_kernel");
  plan_scatter_kernel<<<nchunks, kThreads, 0, s>>>(
      ids.ptr<int32_t>(), num_slots, num_experts, ch.steps, nchunks, ws, counts.ptr<int32_t>(), offsets.ptr<int32_t>(),
      pad, row_to_slot.ptr<int32_t>(), row_to_slot.shape[0], slot_to_row.ptr<int32_t>());
  check_launch("build_dispatch_plan: plan_scatter_kernel");
}

}  // namespace moe8::cuda
