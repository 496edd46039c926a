// sm90_util.cuh — host-side plumbing every CUTLASS sm90a ptr-array grouped GEMM needs: per-device facts
// (SM count, compute capability), the persistent grid size of a kernel (clusters that fit at once), the
// layout of the per-group arrays a device-side prep kernel writes into the caller's workspace, the tile
// order's arguments, and the routing-balance hint (routing_balanced). The shape rules themselves are in
// sm90_heuristics.h.
// Include only from translation units compiled with CUTLASS (MOE8_WITH_CUTLASS); used by the bf16 and the FP8
// grouped GEMMs.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "core/error.h"
#include "cuda/common.cuh"
#include "cuda/sm90_heuristics.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/gemm/gemm.h"

namespace moe8::cuda::sm90_util {

using ::moe8::cuda::current_device;  // these live in common.cuh (the quantisation kernels size grids by them too)
using ::moe8::cuda::device_facts;
using ::moe8::cuda::DeviceFacts;

constexpr size_t kAlignWs = 256;  // every per-group array and CUTLASS's workspace start on this boundary

inline size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// Raises the kernel's dynamic shared-memory limit (needed before any launch or occupancy query) and
// returns how many clusters of it fit on `device` at once (0 if the query fails: CUTLASS then sizes the
// grid by its own heuristic). Cached per kernel and device.
template <class Kernel>
int max_active_clusters(int device, const char* what) {
  static std::array<std::atomic<int>, kMaxDevices> cache{};  // -1 - value once known
  const int cached = cache[device].load(std::memory_order_relaxed);
  if (cached < 0) return -1 - cached;
  const void* fn = reinterpret_cast<const void*>(cutlass::device_kernel<Kernel>);
  cuda_check(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, Kernel::SharedStorageSize), what);
  using Cluster = typename Kernel::ClusterShape;
  const dim3 cluster(cute::size<0>(Cluster{}), cute::size<1>(Cluster{}), cute::size<2>(Cluster{}));
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster.x;
  attr[0].val.clusterDim.y = cluster.y;
  attr[0].val.clusterDim.z = cluster.z;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = cluster;
  cfg.blockDim = dim3(Kernel::MaxThreadsPerBlock, 1, 1);
  cfg.dynamicSmemBytes = Kernel::SharedStorageSize;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, fn, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    n = 0;
  }
  cache[device].store(-1 - n, std::memory_order_relaxed);
  return n;
}

// CUTLASS's own workspace for a grouped launch of `groups` problems whose shapes live on the device.
template <class Gemm>
size_t cutlass_workspace_bytes(int groups, int sms) {
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {groups, nullptr, nullptr};
  args.hw_info.sm_count = sms;
  return Gemm::get_workspace_size(args);
}

// Every grouped stride has one dynamic extent (the leading dimension); the others are static 1 and 0.
template <class Stride>
__host__ __device__ Stride stride_with_ld(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static<std::remove_reference_t<decltype(cute::get<0>(s))>>::value)
    cute::get<1>(s) = ld;
  else
    cute::get<0>(s) = ld;
  return s;
}

// Threads per block of the prep kernels, and their grid: a thread per group, and enough blocks (up to two
// per SM) for the zeroing they also do.
constexpr int kPrepThreads = 256;
inline int prep_blocks(int64_t groups, int64_t zero_vectors, int sms) {
  int64_t blocks = ceil_div(groups, kPrepThreads);
  blocks = std::max<int64_t>(blocks, std::min<int64_t>(ceil_div(zero_vectors, kPrepThreads), 2 * int64_t(sms)));
  return static_cast<int>(std::max<int64_t>(blocks, 1));
}

// Zeroes the rows [offsets[groups], rows) of c (row_vectors 16-byte vectors per row; rows start on 16-byte
// boundaries), which no group covers. Run by every thread of the prep grid.
__device__ __forceinline__ void zero_rows_past_groups(const int32_t* __restrict__ offsets, int groups, int64_t rows,
                                                      void* c, int64_t row_vectors, int64_t tid, int64_t nthreads) {
  const int64_t last = offsets[groups], used = last < 0 ? 0 : (last > rows ? rows : last);
  uint4* c16 = static_cast<uint4*>(c);
  for (int64_t i = used * row_vectors + tid; i < rows * row_vectors; i += nthreads) c16[i] = make_uint4(0, 0, 0, 0);
}

// Zeroes db[e] (per_group 16-byte vectors each) of every group without rows: a wgrad prep kernel gives those
// groups shape (0, 0, 0), so CUTLASS never writes them. Run by every thread of the prep grid.
__device__ __forceinline__ void zero_empty_groups(const int32_t* __restrict__ offsets, int groups, int64_t rows,
                                                  void* db, int64_t per_group, int64_t tid, int64_t nthreads) {
  uint4* db16 = static_cast<uint4*>(db);
  for (int e = 0; e < groups; ++e) {
    int64_t begin, end;
    group_range(offsets, e, rows, begin, end);
    if (end != begin) continue;
    for (int64_t i = tid; i < per_group; i += nthreads) db16[e * per_group + i] = make_uint4(0, 0, 0, 0);
  }
}

// Bump allocator over the caller's workspace: take(bytes) returns the next kAlignWs-aligned slice.
struct Carver {
  uintptr_t p;
  explicit Carver(void* base) : p(align_up(reinterpret_cast<uintptr_t>(base), kAlignWs)) {}
  void* take(size_t bytes) {
    void* r = reinterpret_cast<void*>(p);
    p += align_up(bytes, kAlignWs);
    return r;
  }
};

// The tile order of a grouped GEMM (sm90_heuristics::Schedule), after the environment's overrides.
using sm90_heuristics::Schedule;

template <class Arguments>
void apply_schedule(Arguments& args, Schedule s) {
  s = sm90_heuristics::with_overrides(s, sm90_heuristics::sm90_overrides());
  using Raster = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order = s.along_n ? Raster::AlongN : Raster::AlongM;
  args.scheduler.max_swizzle_size = s.swizzle;
}

// Whether the routing that recent grouped GEMM calls saw was balanced (the largest group at most
// kBalancedMaxOverMean times the mean), for the tile choices whose best answer depends on it (see
// grouped_gemm_sm90.cu). The group sizes stay on the device, so nothing here waits for them: a call copies
// its offsets to pinned host memory asynchronously on its stream (one copy in flight per device, at most
// every kBalanceEvery calls) and a later call reads the copy once its event has completed. Until one has,
// and while the stream is being captured into a CUDA graph, the last answer stands (at first: false).
// MOE8_SM90_BALANCE=balanced|skewed fixes the answer (for tests and sweeps); unset or auto: measured.
constexpr double kBalancedMaxOverMean = 1.25;
constexpr int kBalanceMaxGroups = 1024;
constexpr int kBalanceEvery = 8;

inline bool routing_balanced(const int32_t* offsets, int groups, int device, cudaStream_t stream) {
  using sm90_heuristics::Balance;
  const Balance mode = sm90_heuristics::sm90_overrides().balance.get().value_or(Balance::kAuto);
  if (mode != Balance::kAuto) return mode == Balance::kBalanced;
  struct State {
    std::mutex mu;
    int32_t* host = nullptr;  // pinned, kBalanceMaxGroups + 1 offsets
    cudaEvent_t done = nullptr;
    int in_flight = 0;  // groups of the copy in flight (0: none)
    int since = 0;      // calls since the last copy landed
    bool measured = false, balanced = false, off = false;
  };
  static std::array<State, kMaxDevices> states;
  if (groups < 1 || groups > kBalanceMaxGroups || device < 0 || device >= kMaxDevices) return false;
  State& st = states[device];
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.off) return st.balanced;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
    (void)cudaGetLastError();
    return st.balanced;
  }
  auto give_up = [&] {  // an error here only loses the hint, never the GEMM
    (void)cudaGetLastError();
    st.off = true;
    return st.balanced;
  };
  if (st.in_flight > 0) {
    const cudaError_t q = cudaEventQuery(st.done);
    if (q == cudaErrorNotReady) return st.balanced;
    if (q != cudaSuccess) return give_up();
    const int32_t total = st.host[st.in_flight] - st.host[0];
    int32_t largest = 0;
    for (int g = 0; g < st.in_flight; ++g) largest = std::max(largest, st.host[g + 1] - st.host[g]);
    st.balanced = total > 0 && largest <= kBalancedMaxOverMean * total / st.in_flight;
    st.in_flight = 0;
    st.since = 0;
    st.measured = true;
  }
  if (st.measured && ++st.since < kBalanceEvery) return st.balanced;
  if (st.host == nullptr && (cudaMallocHost(&st.host, sizeof(int32_t) * (kBalanceMaxGroups + 1)) != cudaSuccess ||
                             cudaEventCreateWithFlags(&st.done, cudaEventDisableTiming) != cudaSuccess))
    return give_up();
  if (cudaMemcpyAsync(st.host, offsets, sizeof(int32_t) * (groups + 1), cudaMemcpyDeviceToHost, stream) !=
          cudaSuccess ||
      cudaEventRecord(st.done, stream) != cudaSuccess)
    return give_up();
  st.in_flight = groups;
  return st.balanced;
}

// The largest CUTLASS workspace among the Gemm types (each a GemmUniversalAdapter).
template <class... Gemms>
size_t max_workspace_bytes(int groups, int sms) {
  return std::max({size_t{0}, cutlass_workspace_bytes<Gemms>(groups, sms)...});
}

// A tile configuration of a CUTLASS sm_90a grouped GEMM: CTA tile (M, N, K), cluster, mainloop and
// epilogue schedules (what GroupedGemm / Fp8Gemm read from it).
template <class TileShape, class ClusterShape, class MainloopSchedule, class EpilogueScheduleT>
struct TileConfig {
  using Tile = TileShape;
  using Cluster = ClusterShape;
  using KernelSchedule = MainloopSchedule;
  using EpilogueSchedule = EpilogueScheduleT;
};

}  // namespace moe8::cuda::sm90_util
