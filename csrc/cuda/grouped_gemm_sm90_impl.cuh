// grouped_gemm_sm90_impl.cuh — what the sm_90a grouped GEMM translation units share (grouped_gemm_sm90.cu, the
// GEMMs themselves; grouped_gemm_act_sm90.cu, the down projection's input gradient with the routed activation
// backward in its epilogue): the tile configurations, the GEMM types, the per-group workspace arrays, the prep
// kernels that fill them from the device's offsets, and the CUTLASS launch. Included only where
// MOE8_WITH_CUTLASS is defined.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>

#include "core/error.h"
#include "cuda/common.cuh"
#include "cuda/gathered_rows_sm90.cuh"
#include "cuda/grouped_gemm_sm90.h"
#include "cuda/ops.h"
#include "cuda/prepared_descriptors_sm90.cuh"
#include "cuda/sm90_util.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "the sm90 grouped GEMMs need CUDA 12.3+ (CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)"
#endif

namespace moe8::cuda::sm90 {

using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
using GroupShape = ProblemShape::UnderlyingProblemShape;

// Tile configurations (sm90_heuristics::Tile names them and says which GEMM takes which; why: docs/kernels.md).
// Large: two consumer warpgroups share a 128x256 tile (cooperative); small: each consumer warpgroup owns a
// 64x128 tile and the two alternate mainloop and epilogue (ping-pong), for experts with few rows. Both pair
// CTAs along N in a cluster, so the A tile (activation rows) is multicast to both; N is a fixed model
// width, so the cluster rounding rarely wastes a tile, while pairing along the ragged M would.
using sm90_util::TileConfig;
template <class Tile, class Cluster>
using CooperativeTile = TileConfig<Tile, Cluster, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                   cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

using TileLarge = CooperativeTile<Shape<_128, _256, _64>, Shape<_1, _2, _1>>;
// For an odd number of 256-wide tiles along N: the scheduler rounds each group's tile grid up to whole
// clusters, so a 1x2 cluster would leave a tile idle.
using TileLargeSolo = CooperativeTile<Shape<_128, _256, _64>, Shape<_1, _1, _1>>;
// CTAs paired along M: the pair shares the weight tile (fewer operand bytes per k-step), each group's
// M-tiles rounded up to even. Opt-in (MOE8_SM90_CLUSTER).
using TileLargeM2 = CooperativeTile<Shape<_128, _256, _64>, Shape<_2, _1, _1>>;
// For a rank-sized N (the expert LoRA's x·A[e] and dt·A[e], N = r <= 32). bf16 only.
using TileThin = CooperativeTile<Shape<_128, _32, _128>, Shape<_1, _1, _1>>;
template <class Tile, class Cluster>
using PingpongTile = TileConfig<Tile, Cluster, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
using TileSmall = PingpongTile<Shape<_64, _128, _64>, Shape<_1, _2, _1>>;
// bf16 only: each consumer warpgroup owns a whole 128x128 tile, the epilogue hidden behind the other's
// mainloop, CTAs paired along M (the weight gradient's default for experts with small weights); and a
// 256x128 cooperative tile, CTAs paired along N (a sweep candidate, MOE8_SM90_TILE=tall).
using TilePong128 = PingpongTile<Shape<_128, _128, _64>, Shape<_2, _1, _1>>;
using TileTall = CooperativeTile<Shape<_256, _128, _64>, Shape<_1, _2, _1>>;
// kLarge whose epilogue stores the 128x256 tile in four 128x64 subtiles instead of CUTLASS's eight 128x32 ones: half
// the epilogue's barriers and store waits per tile. What the rules pick in place of kLarge and kSolo for bf16
// (sm90_heuristics::with_epilogue; MOE8_SM90_EPILOGUE=32 or a forced tile gives CUTLASS's subtiles).
struct TileLargeEpi64 : TileLarge {
  using EpilogueTile = Shape<_128, _64>;
};
struct TileLargeSoloEpi64 : TileLargeSolo {
  using EpilogueTile = Shape<_128, _64>;
};

// A configuration's epilogue subtile: its EpilogueTile where it names one, else CUTLASS's choice.
template <class Config, class = void>
struct EpilogueTileOf {
  using type = cutlass::epilogue::collective::EpilogueTileAuto;
};
template <class Config>
struct EpilogueTileOf<Config, std::void_t<typename Config::EpilogueTile>> {
  using type = typename Config::EpilogueTile;
};

// One grouped GEMM: D[g] (M x N, row-major) = A[g] (M x K) · B[g] (K x N), fp32 accumulation, D = acc, or
// what Fusion (an epilogue visitor taking the accumulators) makes of it. kPrepared: the kernel can read and store
// through per-group descriptors made before the launch (prepared_descriptors_sm90.cuh), not rewritten at each group
// change; which of them it does is run_cutlass's `prepared`.
// NOTES: C is void and the fusion's source is void, so the epilogue never reads C; with a non-void C
// and beta = 0 it would still compute 0 * (unloaded C registers).
// kSwiGLU (with kPrepared; ragged descriptors): the up projection's forward with SwiGLU in its epilogue
// (PreparedLoadMainloop's paired B rows, PreparedStoreEpilogue's act output).
template <class T, class LayoutA, class LayoutB, class Config,
          class Fusion = cutlass::epilogue::fusion::LinearCombination<T, float, void>, bool kPrepared = false,
          bool kSwiGLU = false>
struct GroupedGemm {
  using Element = T;
  using Tiles = Config;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 16 / sizeof(T);  // elements per 16 bytes: TMA's alignment
  static constexpr bool kPreparedDescriptors = kPrepared;

  using CutlassEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile, typename Config::Cluster,
      typename EpilogueTileOf<Config>::type, float, float,  //
      void, LayoutD*, kAlign,                               // C: none
      T, LayoutD*, kAlign,                                  // D
      typename Config::EpilogueSchedule, Fusion>::CollectiveOp;
  using Epilogue = std::conditional_t<kPrepared, PreparedStoreEpilogue<CutlassEpilogue, kSwiGLU>, CutlassEpilogue>;
  // The same GEMM with its descriptors prepared (heuristics::prepared).
  using WithPreparedDescriptors = GroupedGemm<T, LayoutA, LayoutB, Config, Fusion, true>;

  using CutlassMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,  //
      T, LayoutA*, kAlign,                                  //
      T, LayoutB*, kAlign,                                  //
      float, typename Config::Tile, typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Config::KernelSchedule>::CollectiveOp;
  using Mainloop = std::conditional_t<kPrepared, PreparedLoadMainloop<CutlassMainloop, kSwiGLU>, CutlassMainloop>;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

// The three kinds, in CUTLASS's (M, N, K) terms.
template <class T, class Config>  // a [M, K] row-major · (b[e] [N, K] row-major)^T
using FwdGemm = GroupedGemm<T, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, Config>;
// The up projection's forward with SwiGLU in the epilogue: h = a · gate_up[e]^T [M, 2I] and act = SwiGLU(h) [M, I]
// (grouped_gemm_swiglu_sm90); the 128x64-subtile 128x256 tiles, ragged descriptors.
template <class T, class Config>
using FwdSwiGLUGemm = GroupedGemm<T, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, Config,
                                  cutlass::epilogue::fusion::LinearCombination<T, float, void>, true, true>;
template <class T, class Config>  // a [M, K] row-major · b[e] [K, N] row-major
using DgradGemm = GroupedGemm<T, cutlass::layout::RowMajor, cutlass::layout::RowMajor, Config>;
// M = N, N = Kd, K = rows: A = dc^T (M-major, ld N), B = a (N-major, ld Kd). Never the 64x128 small tile
// (slower at every shape measured, docs/kernels.md).
template <class T, class Config = TileLarge>
using WgradGemm = GroupedGemm<T, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, Config>;

// A GEMM of Plain's tiles, epilogue and operand types whose mainloop is Loader<Plain's> (gathered_rows_sm90.cuh).
template <class PlainGemm, template <class> class Loader>
struct GatheredGemm {
  using Plain = PlainGemm;
  using Element = typename Plain::Element;
  using Mainloop = Loader<typename Plain::Mainloop>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, typename Plain::Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Plain::StrideA;
  using StrideB = typename Plain::StrideB;
  using StrideD = typename Plain::StrideD;
};

// The forward GEMM of rows gathered from the tokens inside the A load: the 128x256 cooperative tile without a
// cluster (the gathered rows are not multicast; CTAs paired along M to share the weight's tile measured no
// faster: 1.49 ms against 1.48 for the gather and the GEMM at Qwen3-30B-A3B's up projection). bf16 only.
// The rows copied by one producer warp or two (sm90_heuristics::gather_load_warps).
template <class Base>
using GatheredRowsOneWarp = GatheredRowsMainloop<Base, 1>;
template <class Base>
using GatheredRowsTwoWarps = GatheredRowsMainloop<Base, 2>;
template <class T>
using GatheredFwdGemm = GatheredGemm<FwdGemm<T, TileLargeSolo>, GatheredRowsOneWarp>;
template <class T>
using GatheredFwdGemmTwoWarps = GatheredGemm<FwdGemm<T, TileLargeSolo>, GatheredRowsTwoWarps>;

// The weight gradient whose B (the tokens' rows along each group's K) is gathered inside its load: the 128x256
// cooperative tile, CTAs paired along N so dc's tile is multicast. bf16 only.
template <class T>
using GatheredWgradGemm = GatheredGemm<WgradGemm<T, TileLarge>, GatheredKRowsMainloop>;

namespace heuristics = sm90_heuristics;
using heuristics::Tile;

// The configuration `tile` names (heuristics::rows_tile / wgrad_tile chose it) as Gemm<T, config>, handed to
// launch; with prepared (heuristics::prepared, the 128x64-subtile tiles) its WithPreparedDescriptors. f16 has only
// the small, large and solo tiles.
template <template <class, class> class Gemm, class T, class Launch>
void launch_tile(Tile tile, bool prepared, Launch&& launch) {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    auto maybe_prepared = [&](auto gemm) {
      using G = decltype(gemm);
      return prepared ? launch(typename G::WithPreparedDescriptors{}) : launch(G{});
    };
    if (tile == Tile::kThin) return launch(Gemm<T, TileThin>{});
    if (tile == Tile::kM2) return launch(Gemm<T, TileLargeM2>{});
    if (tile == Tile::kPong128) return launch(Gemm<T, TilePong128>{});
    if (tile == Tile::kTall) return launch(Gemm<T, TileTall>{});
    if (tile == Tile::kEpi64) return maybe_prepared(Gemm<T, TileLargeEpi64>{});
    if (tile == Tile::kEpi64Solo) return maybe_prepared(Gemm<T, TileLargeSoloEpi64>{});
  }
  if (tile == Tile::kSmall) return launch(Gemm<T, TileSmall>{});
  tile == Tile::kSolo ? launch(Gemm<T, TileLargeSolo>{}) : launch(Gemm<T, TileLarge>{});
}

using sm90_util::stride_with_ld;

// ---------------------------------------------------------------------------------------------------
// Workspace: per-group arrays (fixed slot sizes, so one layout serves every kernel) then CUTLASS's own.

using sm90_util::align_up;
using sm90_util::kAlignWs;
constexpr size_t kSlotShape = 16, kSlotPtr = 8, kSlotStride = 16, kSlotDesc = sizeof(cute::TmaDescriptor),
                 kSlotStarts = sizeof(RaggedStarts);
static_assert(sizeof(GroupShape) <= kSlotShape, "problem shape slot");

inline size_t group_arrays_bytes(int groups) {
  const size_t g = static_cast<size_t>(groups < 1 ? 1 : groups);
  return align_up(g * kSlotShape, kAlignWs) + 3 * align_up(g * kSlotPtr, kAlignWs) +
         3 * align_up(g * kSlotStride, kAlignWs) + align_up(3 * g * kSlotDesc, kAlignWs) +
         align_up(g * kSlotStarts, kAlignWs);
}

struct GroupArrays {
  GroupShape* shapes;
  void** ptr_a;
  void** ptr_b;
  void** ptr_d;
  void* stride_a;
  void* stride_b;
  void* stride_d;
  cute::TmaDescriptor* descs_d;   // prepared descriptors (prepared_descriptors_sm90.cuh): D's, one a group
  cute::TmaDescriptor* descs_ab;  // and A's and B's, two a group
  RaggedStarts* starts;           // each group's first rows in the operands' ragged views
  void* cutlass_ws;               // kAlignWs-aligned
};

inline GroupArrays carve(void* workspace, int groups) {
  const size_t g = static_cast<size_t>(groups < 1 ? 1 : groups);
  sm90_util::Carver c(workspace);
  GroupArrays w;
  w.shapes = static_cast<GroupShape*>(c.take(g * kSlotShape));
  w.ptr_a = static_cast<void**>(c.take(g * kSlotPtr));
  w.ptr_b = static_cast<void**>(c.take(g * kSlotPtr));
  w.ptr_d = static_cast<void**>(c.take(g * kSlotPtr));
  w.stride_a = c.take(g * kSlotStride);
  w.stride_b = c.take(g * kSlotStride);
  w.stride_d = c.take(g * kSlotStride);
  w.descs_d = static_cast<cute::TmaDescriptor*>(c.take(3 * g * kSlotDesc));
  w.descs_ab = w.descs_d + g;
  w.starts = static_cast<RaggedStarts*>(c.take(g * kSlotStarts));
  w.cutlass_ws = c.take(0);
  return w;
}

// Device facts (multiprocessor count, compute capability), the persistent grid size of each kernel and
// CUTLASS's workspace size: shared with the FP8 GEMM (sm90_util.cuh).
using sm90_util::device_facts;
using sm90_util::DeviceFacts;

inline int current_device() { return sm90_util::current_device("grouped_gemm_sm90: cudaGetDevice"); }

template <class G>
int max_active_clusters(int device) {
  return sm90_util::max_active_clusters<typename G::Kernel>(device, "grouped_gemm_sm90: cudaFuncSetAttribute");
}

template <class G>
size_t cutlass_workspace_bytes(int groups, int sms) {
  return sm90_util::cutlass_workspace_bytes<typename G::Gemm>(groups, sms);
}

// Launches the CUTLASS kernel over the group arrays the prep kernel has written (stream-ordered).
template <class A, class = void>
struct takes_gather_source : std::false_type {};
template <class A>
struct takes_gather_source<A, std::void_t<decltype(std::declval<A&>().mainloop.src)>> : std::true_type {};

// gathered: where a gathered-rows mainloop (GatheredFwdGemm) reads its rows from; fusion: the epilogue
// visitor's arguments (nullptr: D = the accumulators); prepared: which of a kPrepared GEMM's descriptors it takes
// from prepare_descriptors (the others CUTLASS rewrites in the kernel), or with prepared.ragged (D) and
// prepared.ragged_loads (A and B), one ragged descriptor each for every group, over `ragged`'s rows; act: a
// FwdSwiGLUGemm's SwiGLU output [R, I] (D, ragged.d, is h [R, 2I]).
template <class G, class FusionArgs = std::nullptr_t>
void run_cutlass(const GroupArrays& w, int groups, int device, int sms, heuristics::Schedule schedule,
                 cudaStream_t stream, const GatherSource* gathered = nullptr, FusionArgs fusion = nullptr,
                 heuristics::Prepared prepared = {}, const RaggedViews& ragged = {}, void* act = nullptr) {
  using Gemm = typename G::Gemm;
  using T = typename G::Element;
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sms;
  hw.max_active_clusters = max_active_clusters<G>(device);
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {groups, w.shapes, nullptr};  // shapes only on the device
  args.mainloop.ptr_A = const_cast<const T**>(reinterpret_cast<T**>(w.ptr_a));
  args.mainloop.dA = static_cast<typename G::StrideA*>(w.stride_a);
  args.mainloop.ptr_B = const_cast<const T**>(reinterpret_cast<T**>(w.ptr_b));
  args.mainloop.dB = static_cast<typename G::StrideB*>(w.stride_b);
  if constexpr (takes_gather_source<typename Gemm::Arguments>::value) args.mainloop.src = *gathered;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = reinterpret_cast<T**>(w.ptr_d);
  args.epilogue.dD = static_cast<typename G::StrideD*>(w.stride_d);
  if constexpr (takes_prepared_descriptors<typename Gemm::Arguments>::value) {
    args.epilogue.descs = prepared.store ? w.descs_d : nullptr;
    args.epilogue.acquire_at_store = prepared.acquire_at_store;
    if (prepared.ragged) {
      args.epilogue.ragged = ragged.d;
      args.epilogue.starts = w.starts;
    }
    args.mainloop.descs = prepared.loads ? w.descs_ab : nullptr;
    if (prepared.ragged_loads) {
      args.mainloop.ragged_a = ragged.a;
      args.mainloop.ragged_b = ragged.b;
      args.mainloop.starts = w.starts;
    }
    if (act != nullptr) {  // FwdSwiGLUGemm: D is h [R, 2I], act [R, I]
      const auto half = static_cast<int32_t>(ragged.d.cols / 2);
      args.epilogue.act = static_cast<T*>(act);
      args.epilogue.half = half;
      args.mainloop.half = half;
    }
  }
  args.hw_info = hw;
  if constexpr (std::is_same_v<FusionArgs, std::nullptr_t>) {
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
  } else {
    args.epilogue.thread = fusion;
  }
  sm90_util::apply_schedule(args, schedule);
  Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess)
    throw CudaError(std::string("grouped_gemm_sm90: CUTLASS cannot implement: ") + cutlassGetStatusString(st));
  st = gemm.initialize(args, w.cutlass_ws, stream);
  if (st != cutlass::Status::kSuccess)
    throw CudaError(std::string("grouped_gemm_sm90: CUTLASS initialize: ") + cutlassGetStatusString(st));
  st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess)
    throw CudaError(std::string("grouped_gemm_sm90: CUTLASS run: ") + cutlassGetStatusString(st));
  check_launch("grouped_gemm_sm90: CUTLASS kernel");
}

// ---------------------------------------------------------------------------------------------------
// Prep kernels. Offsets are clamped to [0, rows] and made nondecreasing, so bad offsets (if validation
// was skipped) give wrong results but never out-of-bounds accesses.

using sm90_util::kPrepThreads;

// Forward / dgrad: group e is (M = its rows, N, K = Kd); rows [offsets[E], R) of c are zeroed.
template <class G>
__global__ void __launch_bounds__(kPrepThreads)
    prep_rows_kernel(const int32_t* __restrict__ offsets, int groups, int64_t rows, int64_t n, int64_t kd, int64_t ldb,
                     const void* a, const void* b, void* c, GroupArrays w, bool a_gathered = false) {
  using T = typename G::Element;
  static_assert(sizeof(typename G::StrideA) <= kSlotStride && sizeof(typename G::StrideB) <= kSlotStride &&
                sizeof(typename G::StrideD) <= kSlotStride);
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = tid; e < groups; e += nthreads) {
    int64_t begin, end;
    group_range(offsets, static_cast<int>(e), rows, begin, end);
    w.shapes[e] = GroupShape(static_cast<int>(end - begin), static_cast<int>(n), static_cast<int>(kd));
    // a gathered-rows mainloop reads x through its own descriptor: every group's A pointer is x itself
    w.ptr_a[e] = const_cast<T*>(static_cast<const T*>(a) + (a_gathered ? 0 : begin * kd));
    w.ptr_b[e] = const_cast<T*>(static_cast<const T*>(b) + e * n * kd);
    w.ptr_d[e] = static_cast<T*>(c) + begin * n;
    // the rows of a's [R, kd], b's [E * n * kd / ldb, ldb] (its experts stacked) and c's [R, n]
    w.starts[e] = {static_cast<int32_t>(begin), static_cast<int32_t>(e * (n * kd / ldb)), static_cast<int32_t>(begin),
                   0};
    static_cast<typename G::StrideA*>(w.stride_a)[e] = stride_with_ld<typename G::StrideA>(kd);
    static_cast<typename G::StrideB*>(w.stride_b)[e] = stride_with_ld<typename G::StrideB>(ldb);
    static_cast<typename G::StrideD*>(w.stride_d)[e] = stride_with_ld<typename G::StrideD>(n);
  }
  sm90_util::zero_rows_past_groups(offsets, groups, rows, c, n * sizeof(T) / 16, tid, nthreads);
}

// Wgrad: group e is (M = N, N = Kd, K = its rows); empty groups get shape (0, 0, 0), which the group
// scheduler gives no tiles, and their db[e] is zeroed here.
// NOTES: a group with K = 0 must not reach CUTLASS: its mainloop would run no MMA and the epilogue
// would store the never-initialised accumulators.
template <class G>
__global__ void __launch_bounds__(kPrepThreads)
    prep_wgrad_kernel(const int32_t* __restrict__ offsets, int groups, int64_t rows, int64_t n, int64_t kd,
                      const void* a, const void* dc, void* db, GroupArrays w, bool a_gathered = false) {
  using T = typename G::Element;
  static_assert(sizeof(typename G::StrideA) <= kSlotStride && sizeof(typename G::StrideB) <= kSlotStride &&
                sizeof(typename G::StrideD) <= kSlotStride);
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = tid; e < groups; e += nthreads) {
    int64_t begin, end;
    group_range(offsets, static_cast<int>(e), rows, begin, end);
    const bool empty = end == begin;
    w.shapes[e] = empty ? GroupShape(0, 0, 0)
                        : GroupShape(static_cast<int>(n), static_cast<int>(kd), static_cast<int>(end - begin));
    w.ptr_a[e] = const_cast<T*>(static_cast<const T*>(dc) + begin * n);
    // a gathered-rows mainloop reads x through its own loads: every group's B pointer is x itself
    w.ptr_b[e] = const_cast<T*>(static_cast<const T*>(a) + (a_gathered ? 0 : begin * kd));
    w.ptr_d[e] = static_cast<T*>(db) + e * n * kd;
    // the rows of dc's [R, n], a's [R, kd] and db's [E * n, kd]
    w.starts[e] = {static_cast<int32_t>(begin), static_cast<int32_t>(begin), static_cast<int32_t>(e * n), 0};
    static_cast<typename G::StrideA*>(w.stride_a)[e] = stride_with_ld<typename G::StrideA>(n);
    static_cast<typename G::StrideB*>(w.stride_b)[e] = stride_with_ld<typename G::StrideB>(kd);
    static_cast<typename G::StrideD*>(w.stride_d)[e] = stride_with_ld<typename G::StrideD>(kd);
  }
  sm90_util::zero_empty_groups(offsets, groups, rows, db, n * kd / 8 /* 16-byte vectors of one db[e] */, tid, nthreads);
}

using sm90_util::prep_blocks;

// A kPrepared GEMM's descriptors for this call, the ones `prepared` asks for, from the group arrays its prep kernel
// wrote (stream-ordered: after that kernel, before the GEMM): D's as its epilogue makes it, A's and B's as its
// mainloop does, each group's put in on the device.
template <class G>
void prepare_descriptors(const GroupArrays& w, int groups, heuristics::Prepared prepared, cudaStream_t stream) {
  static_assert(G::kPreparedDescriptors, "a GEMM taking prepared descriptors");
  using T = typename G::Element;
  using Main = typename G::Mainloop;
  if (groups == 0) return;
  if (prepared.store) {
    prepare_store_descriptors<typename G::Epilogue, T, ProblemShape>(groups, w.shapes, reinterpret_cast<T**>(w.ptr_d),
                                                                     static_cast<typename G::StrideD*>(w.stride_d),
                                                                     w.cutlass_ws, w.descs_d, stream);
    check_launch("grouped_gemm_sm90: prep_store_descriptors_kernel");
  }
  if (!prepared.loads) return;
  // The templates, as for D's: one host encode per GEMM type.
  static const auto tma_ab = [&] {
    typename Main::Arguments main{};
    main.ptr_A = const_cast<const T**>(reinterpret_cast<T**>(w.ptr_a));
    main.dA = static_cast<typename G::StrideA*>(w.stride_a);
    main.ptr_B = const_cast<const T**>(reinterpret_cast<T**>(w.ptr_b));
    main.dB = static_cast<typename G::StrideB*>(w.stride_b);
    main.descs = w.descs_ab;  // the mode these templates are for (the wrapper takes ragged or prepared, one)
    const auto m = Main::to_underlying_arguments(ProblemShape{groups, w.shapes, nullptr}, main, w.cutlass_ws);
    return cute::make_tuple(m.tma_load_a, m.tma_load_b);
  }();
  prep_load_descriptors_kernel<T><<<(groups + kDescWarps - 1) / kDescWarps, 32 * kDescWarps, 0, stream>>>(
      cute::get<0>(tma_ab), cute::get<1>(tma_ab), groups, w.shapes, reinterpret_cast<T* const*>(w.ptr_a),
      reinterpret_cast<T* const*>(w.ptr_b), static_cast<const typename G::StrideA*>(w.stride_a),
      static_cast<const typename G::StrideB*>(w.stride_b), w.descs_ab);
  check_launch("grouped_gemm_sm90: prep_load_descriptors_kernel");
}

// ---------------------------------------------------------------------------------------------------

inline bool dtype_built(DType d) { return d == DType::kBF16 || d == DType::kF16; }

template <class F>
void dispatch_dtype(DType d, const char* what, F&& f) {
  if (d == DType::kBF16)
    f(cutlass::bfloat16_t{});
  else if (d == DType::kF16)
    f(cutlass::half_t{});
  else
    fail(what, ": the sm90 grouped GEMM takes bfloat16 or float16, got ", dtype_name(d));
}

struct Checked {
  int device, sms;
  GroupArrays w;
};

inline Checked check_call(const char* what, const TensorView& ref, int groups, void* workspace, size_t bytes) {
  MOE8_CHECK(groups >= 0, what, ": expected at least 0 groups, got ", groups);
  const int device = ref.device_index;
  const DeviceFacts f = device_facts(device);
  MOE8_CHECK(f.major == 9 && f.minor == 0, what, ": needs a compute capability 9.0 device, device ", device, " is ",
             f.major, ".", f.minor);
  int current = current_device();
  MOE8_CHECK(current == device, what, ": tensors are on cuda:", device, " but the current device is cuda:", current);
  const size_t need = grouped_gemm_sm90_workspace_bytes(groups, 0, 0, 0);
  MOE8_CHECK(workspace != nullptr && bytes >= need, what, ": expected a workspace of at least ", need, " bytes, got ",
             bytes, workspace ? "" : " (null)");
  return {device, f.sms, carve(workspace, groups)};
}

}  // namespace moe8::cuda::sm90
