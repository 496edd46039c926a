// grouped_gemm_fp8_sm90.cu — the MoE expert forward GEMM in FP8 on Hopper, DeepSeek-V3 blockwise recipe:
//   c[rows of e] (bf16) = a[rows of e] (e4m3, 1x128 scales) · b[e]^T (e4m3 [N, K], 128x128 scales)
// on CUTLASS's ptr-array warp-specialised cooperative kernel with FP8 block-scaled accumulation
// (KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum): each 128-wide K tile is accumulated by
// wgmma in a fresh fp32 register tile, then multiplied by a_scale[row] * b_scale[n block] and added to
// the running fp32 sum ("promotion every 128 of K"), so the tensor cores' limited accumulation width
// never sees more than 128 products.
//
// Scale layouts. CUTLASS builds each group's scale tensors from the group's problem shape alone (the
// layout_SFA/SFB arguments are not read by the grouped kernel), so each group's scales must be a packed
// block at its scale pointer. Both are taken K-major: a_scale [R, KB] row-major restricted to the group's
// rows is the packed [M_e, KB] block at a_scale + offsets[e] * KB, and b_scale[e] is the packed
// [NB, KB] block — exactly what quantize_rows_1x128 and quantize_weight_128x128 write, no transposes.
// (The scales are read with 4-byte cp.async, not TMA, so K-major costs only more L2 sectors.)
//
// As in grouped_gemm_sm90.cu, a prep kernel (one thread per group) writes per-group shapes, pointers,
// strides and scale pointers into the caller's workspace and zeroes the rows of c past offsets[E]; CUTLASS
// reads the shapes on the device (host_problem_shapes = nullptr), so nothing synchronises.
//
// Build: nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DNDEBUG
//        -DMOE8_WITH_CUTLASS=1 -I<cutlass>/include (cmake/cutlass.cmake does this). Without
//        MOE8_WITH_CUTLASS the file compiles to stubs that report the path unsupported.
#include <cuda_runtime.h>

#include <string>

#include "core/error.h"
#include "cuda/grouped_gemm_fp8_sm90.h"

#if defined(MOE8_WITH_CUTLASS)
#include <algorithm>
#include <type_traits>

#include "core/fp8.h"
#include "cuda/blockwise_promotion_sm90.cuh"
#include "cuda/common.cuh"
#include "cuda/ops.h"
#include "cuda/prepared_descriptors_sm90.cuh"
#include "cuda/sm90_util.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "grouped_gemm_fp8_sm90.cu needs CUDA 12.3+ (CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)"
#endif
#endif

namespace moe8::cuda {

#if defined(MOE8_WITH_CUTLASS)
namespace sm90_fp8 {

using namespace cute;
using namespace sm90_util;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
using GroupShape = ProblemShape::UnderlyingProblemShape;

// Forward: scale granularity (M, N, K) = (1, 128, 128), both scale tensors K-major (see the file comment).
using ScaleConfig =
    cutlass::detail::Sm90BlockwiseScaleConfig<1, kQuantBlock, kQuantBlock, cute::GMMA::Major::K, cute::GMMA::Major::K>;
// Weight gradient: (1, 1, 128) and both MN-major: quantize_cols_1x128's scale[block, column], where one
// group's blocks are a packed [blocks, columns] chunk.
using ScaleConfigWgrad =
    cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, kQuantBlock, cute::GMMA::Major::MN, cute::GMMA::Major::MN>;

// Two tile configurations, both with a K step of one scale block. Large: two consumer warpgroups share a
// 128x128 tile (cooperative); small: each consumer warpgroup owns a 64x128 tile and the two alternate
// mainloop and epilogue (ping-pong), for experts with few rows. CTAs pair along N in a cluster so the
// activation tile is multicast (N is a fixed model width, while pairing along the ragged M would waste).
template <class Tile, class Cluster>
using CooperativeTile =
    TileConfig<Tile, Cluster, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum,
               cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

using TileLarge = CooperativeTile<Shape<_128, _128, _128>, Shape<_1, _2, _1>>;
// TileLarge without the cluster, for an odd number of 128-wide tiles along N (GPT-OSS: N = 2880 or 5760),
// where the 1x2 cluster would round each group's tile grid up by an idle tile (as in grouped_gemm_sm90.cu).
using TileLargeSolo = CooperativeTile<Shape<_128, _128, _128>, Shape<_1, _1, _1>>;
using TileSmall = TileConfig<Shape<_64, _128, _128>, Shape<_1, _2, _1>,
                             cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8BlockScaledAccum,
                             cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;

// D[g] (M x N, row-major, bf16) = A[g] (M x K, row-major) · B[g] (N x K, row-major)^T with block scales.
// NOTES: C is void, so the epilogue never reads a source; alpha = 1 and beta = 0. kOverlap: the consumers
// promote each K tile while the next one's wgmma runs (blockwise_promotion_sm90.cuh), the same bits.
template <class Config, class Scales = ScaleConfig, bool kOverlap = false>
struct Fp8Gemm {
  using ScaleCfg = Scales;
  using LayoutSFA = decltype(Scales::deduce_layoutSFA());
  using LayoutSFB = decltype(Scales::deduce_layoutSFB());
  using ElementAB = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16, kAlignD = 8;  // elements per 16 bytes: TMA's alignment

  using CutlassEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile, typename Config::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,  //
      void, LayoutD*, kAlignD,                                        // C: none
      ElementD, LayoutD*, kAlignD,                                    // D
      typename Config::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void>>::CollectiveOp;
  // D stored through per-group descriptors made before the launch where run_cutlass hands them over
  // (heuristics::fp8_prepared), through CUTLASS's rewritten one otherwise (prepared_descriptors_sm90.cuh).
  using Epilogue = sm90::PreparedStoreEpilogue<CutlassEpilogue>;

  using SerialMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,     //
      ElementAB, cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB,  //
      ElementAB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignAB,  //
      float, typename Config::Tile, typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Config::KernelSchedule>::CollectiveOp;
  using Mainloop = std::conditional_t<kOverlap, OverlappedPromotionMainloop<SerialMainloop>, SerialMainloop>;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;

  static_assert(sizeof(LayoutSFA) <= 32 && sizeof(LayoutSFB) <= 32, "scale layout slot");
};

// The configurations MOE8_SM90_FP8_TILE can force (see launch_tile), for either scale layout.
using TileM2 = CooperativeTile<Shape<_128, _128, _128>, Shape<_2, _1, _1>>;  // CTAs paired along M
template <class Scales>
struct Fp8Tiles {
  using Large = Fp8Gemm<TileLarge, Scales>;
  using Solo = Fp8Gemm<TileLargeSolo, Scales>;
  using M2 = Fp8Gemm<TileM2, Scales>;
  using Small = Fp8Gemm<TileSmall, Scales>;
  using LargeOverlap = Fp8Gemm<TileLarge, Scales, true>;
  using SmallOverlap = Fp8Gemm<TileSmall, Scales, true>;
};

using FwdLarge = Fp8Tiles<ScaleConfig>::Large;
using FwdLargeSolo = Fp8Tiles<ScaleConfig>::Solo;
using FwdSmall = Fp8Tiles<ScaleConfig>::Small;
// Weight gradient: M = N_out and N = K_in are model widths, K = the group's rows. CTAs paired along N (the
// 1x2 cluster shares the A tile) at every shape: robust under skewed routing (docs/kernels.md).
using Wgrad = Fp8Tiles<ScaleConfigWgrad>::Large;

namespace heuristics = sm90_heuristics;

// The configuration `tile` names (heuristics::fp8_forward_tile / fp8_wgrad_tile chose it), for either scale
// layout, handed to launch.
template <class Scales, class Launch>
void launch_tile(heuristics::Fp8Tile tile, Launch&& launch) {
  using C = Fp8Tiles<Scales>;
  switch (tile) {
    case heuristics::Fp8Tile::kSolo:
      return launch(typename C::Solo{});
    case heuristics::Fp8Tile::kM2:
      return launch(typename C::M2{});
    case heuristics::Fp8Tile::kSmall:
      return launch(typename C::Small{});
    case heuristics::Fp8Tile::kLarge:
      break;
  }
  launch(typename C::Large{});
}

// The same with the consumers' promotion (heuristics::fp8_promotion: kOverlap only on kLarge and kSmall).
template <class Scales, class Launch>
void launch_tile(heuristics::Fp8Tile tile, heuristics::Fp8Promotion promotion, Launch&& launch) {
  using C = Fp8Tiles<Scales>;
  if (promotion == heuristics::Fp8Promotion::kOverlap) {
    if (tile == heuristics::Fp8Tile::kLarge) return launch(typename C::LargeOverlap{});
    if (tile == heuristics::Fp8Tile::kSmall) return launch(typename C::SmallOverlap{});
  }
  launch_tile<Scales>(tile, launch);
}

// What the scale pointers of the prep kernels assume.
static_assert(!FwdLarge::Mainloop::MMajorSFA && !FwdLarge::Mainloop::NMajorSFB, "forward scales are read K-major");
static_assert(FwdLarge::Mainloop::ScaleGranularityM == 1 && FwdLarge::Mainloop::ScaleGranularityN == kQuantBlock &&
                  FwdLarge::Mainloop::ScaleGranularityK == kQuantBlock,
              "1x128 activation and 128x128 weight scales");
static_assert(Wgrad::Mainloop::MMajorSFA && Wgrad::Mainloop::NMajorSFB, "wgrad scales are read MN-major");
static_assert(Wgrad::Mainloop::ScaleGranularityM == 1 && Wgrad::Mainloop::ScaleGranularityN == 1 &&
                  Wgrad::Mainloop::ScaleGranularityK == kQuantBlock,
              "1x128 scales on both wgrad operands");
static_assert(std::is_same_v<FwdLarge::StrideA, Wgrad::StrideA> && std::is_same_v<FwdLarge::StrideB, Wgrad::StrideB> &&
                  std::is_same_v<FwdLarge::StrideD, Wgrad::StrideD>,
              "the wgrad kernel shares the forward's stride layout");

// ---------------------------------------------------------------------------------------------------
// Workspace: per-group arrays (fixed slot sizes), then CUTLASS's own.

constexpr size_t kSlotShape = 16, kSlotPtr = 8, kSlotStride = 16, kSlotLayout = 32,
                 kSlotDesc = sizeof(cute::TmaDescriptor), kSlotStarts = sizeof(sm90::RaggedStarts);
static_assert(sizeof(GroupShape) <= kSlotShape, "problem shape slot");
static_assert(sizeof(FwdLarge::LayoutSFA) <= kSlotLayout && sizeof(FwdLarge::LayoutSFB) <= kSlotLayout &&
                  sizeof(Wgrad::LayoutSFA) <= kSlotLayout && sizeof(Wgrad::LayoutSFB) <= kSlotLayout,
              "scale layout slot");
static_assert(sizeof(FwdLarge::StrideA) <= kSlotStride && sizeof(FwdLarge::StrideB) <= kSlotStride &&
                  sizeof(FwdLarge::StrideD) <= kSlotStride,
              "stride slot");
static_assert(std::is_same_v<FwdLarge::StrideA, FwdLargeSolo::StrideA> &&
                  std::is_same_v<FwdLarge::StrideB, FwdLargeSolo::StrideB> &&
                  std::is_same_v<FwdLarge::StrideD, FwdLargeSolo::StrideD>,
              "one stride layout serves every kernel");
static_assert(std::is_same_v<FwdLarge::StrideA, FwdSmall::StrideA> &&
                  std::is_same_v<FwdLarge::StrideB, FwdSmall::StrideB> &&
                  std::is_same_v<FwdLarge::StrideD, FwdSmall::StrideD>,
              "both tiles share the prep kernel's strides");

inline size_t group_arrays_bytes(int groups) {
  const size_t g = static_cast<size_t>(groups < 1 ? 1 : groups);
  return align_up(g * kSlotShape, kAlignWs) + 5 * align_up(g * kSlotPtr, kAlignWs) +
         3 * align_up(g * kSlotStride, kAlignWs) + 2 * align_up(g * kSlotLayout, kAlignWs) +
         align_up(g * kSlotDesc, kAlignWs) + align_up(g * kSlotStarts, kAlignWs);
}

struct GroupArrays {
  GroupShape* shapes;
  const void** ptr_a;
  const void** ptr_b;
  void** ptr_d;
  const float** ptr_sfa;
  const float** ptr_sfb;
  void* stride_a;
  void* stride_b;
  void* stride_d;
  void* layout_sfa;              // G::LayoutSFA[groups]
  void* layout_sfb;              // G::LayoutSFB[groups]
  cute::TmaDescriptor* descs_d;  // D's prepared descriptors, one a group
  sm90::RaggedStarts* starts;    // each group's first row in D's ragged view (d only)
  void* cutlass_ws;              // kAlignWs-aligned
};

inline GroupArrays carve(void* workspace, int groups) {
  const size_t g = static_cast<size_t>(groups < 1 ? 1 : groups);
  Carver c(workspace);
  GroupArrays w;
  w.shapes = static_cast<GroupShape*>(c.take(g * kSlotShape));
  w.ptr_a = static_cast<const void**>(c.take(g * kSlotPtr));
  w.ptr_b = static_cast<const void**>(c.take(g * kSlotPtr));
  w.ptr_d = static_cast<void**>(c.take(g * kSlotPtr));
  w.ptr_sfa = static_cast<const float**>(c.take(g * kSlotPtr));
  w.ptr_sfb = static_cast<const float**>(c.take(g * kSlotPtr));
  w.stride_a = c.take(g * kSlotStride);
  w.stride_b = c.take(g * kSlotStride);
  w.stride_d = c.take(g * kSlotStride);
  w.layout_sfa = c.take(g * kSlotLayout);
  w.layout_sfb = c.take(g * kSlotLayout);
  w.descs_d = static_cast<cute::TmaDescriptor*>(c.take(g * kSlotDesc));
  w.starts = static_cast<sm90::RaggedStarts*>(c.take(g * kSlotStarts));
  w.cutlass_ws = c.take(0);
  return w;
}

// ---------------------------------------------------------------------------------------------------
// Prep kernel: group e is (M = its rows, N, K); rows [offsets[E], R) of c are zeroed.

template <class G>
__global__ void __launch_bounds__(kPrepThreads)
    prep_fp8_kernel(const int32_t* __restrict__ offsets, int groups, int64_t rows, int64_t n, int64_t kd,
                    const uint8_t* a, const float* a_scale, const uint8_t* b, const float* b_scale, void* c,
                    GroupArrays w) {
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t kb = quant_blocks(kd), nb = quant_blocks(n);
  for (int64_t e = tid; e < groups; e += nthreads) {
    int64_t begin, end;
    group_range(offsets, static_cast<int>(e), rows, begin, end);
    const int m = static_cast<int>(end - begin), ni = static_cast<int>(n), ki = static_cast<int>(kd);
    w.shapes[e] = GroupShape(m, ni, ki);
    w.ptr_a[e] = a + begin * kd;
    w.ptr_b[e] = b + e * n * kd;
    w.ptr_d[e] = static_cast<cutlass::bfloat16_t*>(c) + begin * n;
    w.starts[e] = {0, 0, static_cast<int32_t>(begin), 0};  // c's [R, n] rows
    w.ptr_sfa[e] = a_scale + begin * kb;
    w.ptr_sfb[e] = b_scale + e * nb * kb;
    static_cast<typename G::StrideA*>(w.stride_a)[e] = stride_with_ld<typename G::StrideA>(kd);
    static_cast<typename G::StrideB*>(w.stride_b)[e] = stride_with_ld<typename G::StrideB>(kd);
    static_cast<typename G::StrideD*>(w.stride_d)[e] = stride_with_ld<typename G::StrideD>(n);
    // Not read by the grouped kernel today (it derives the same layouts from the shape); kept consistent.
    static_cast<typename G::LayoutSFA*>(w.layout_sfa)[e] =
        G::ScaleCfg::tile_atom_to_shape_SFA(make_shape(m, ni, ki, 1));
    static_cast<typename G::LayoutSFB*>(w.layout_sfb)[e] =
        G::ScaleCfg::tile_atom_to_shape_SFB(make_shape(m, ni, ki, 1));
  }
  zero_rows_past_groups(offsets, groups, rows, c, n / 8 /* bf16 */, tid, nthreads);
}

// Wgrad prep: group e is (M = N, N = K, K = its rows) over the columns [offsets[e], offsets[e+1]) of dc_t
// [N, R] and a_t [K, R]; its scales are the packed [blocks_e, N] / [blocks_e, K] chunks starting at its
// first block (blocks numbered expert by expert, as quantize_cols_1x128 numbers them). Empty groups get
// shape (0, 0, 0) (no tiles, no K = 0 mainloop) and their db[e] is zeroed here.
template <class G>
__global__ void __launch_bounds__(kPrepThreads)
    prep_fp8_wgrad_kernel(const int32_t* __restrict__ offsets, int groups, int64_t rows, int64_t n, int64_t kd,
                          const uint8_t* dc_t, const float* dc_scale, const uint8_t* a_t, const float* a_scale,
                          void* db, GroupArrays w) {
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = tid; e < groups; e += nthreads) {
    int64_t block0 = 0, begin, end;
    for (int j = 0; j < e; ++j) {  // E is at most a few hundred: a scan per thread is cheaper than a launch
      group_range(offsets, j, rows, begin, end);
      block0 += quant_blocks(end - begin);
    }
    group_range(offsets, static_cast<int>(e), rows, begin, end);
    const int len = static_cast<int>(end - begin), ni = static_cast<int>(n), ki = static_cast<int>(kd);
    w.shapes[e] = len == 0 ? GroupShape(0, 0, 0) : GroupShape(ni, ki, len);
    w.ptr_a[e] = dc_t + begin;
    w.ptr_b[e] = a_t + begin;
    w.ptr_d[e] = static_cast<cutlass::bfloat16_t*>(db) + e * n * kd;
    w.starts[e] = {0, 0, static_cast<int32_t>(e * n), 0};  // db's [E * n, kd] rows
    w.ptr_sfa[e] = dc_scale + block0 * n;
    w.ptr_sfb[e] = a_scale + block0 * kd;
    static_cast<typename G::StrideA*>(w.stride_a)[e] = stride_with_ld<typename G::StrideA>(rows);
    static_cast<typename G::StrideB*>(w.stride_b)[e] = stride_with_ld<typename G::StrideB>(rows);
    static_cast<typename G::StrideD*>(w.stride_d)[e] = stride_with_ld<typename G::StrideD>(kd);
    static_cast<typename G::LayoutSFA*>(w.layout_sfa)[e] =
        G::ScaleCfg::tile_atom_to_shape_SFA(make_shape(ni, ki, len, 1));
    static_cast<typename G::LayoutSFB*>(w.layout_sfb)[e] =
        G::ScaleCfg::tile_atom_to_shape_SFB(make_shape(ni, ki, len, 1));
  }
  zero_empty_groups(offsets, groups, rows, db, n * kd / 8 /* bf16, kd % 8 == 0 */, tid, nthreads);
}

// The tensors' device is the current one, and the caller's workspace holds `need` bytes.
inline void check_device_and_workspace(const char* what, int device, size_t need, const void* workspace, size_t bytes) {
  const int current = current_device(what);
  MOE8_CHECK(current == device, what, ": tensors are on cuda:", device, " but the current device is cuda:", current);
  MOE8_CHECK(workspace != nullptr && bytes >= need, what, ": expected a workspace of at least ", need, " bytes, got ",
             bytes, workspace ? "" : " (null)");
}

// Launches the CUTLASS kernel over the group arrays the prep kernel has written (stream-ordered); with
// prepared.store, D's descriptors made first from them; with prepared.ragged, D's one ragged descriptor over ragged_d
// (prepared_descriptors_sm90.cuh).
template <class G>
void run_cutlass(const GroupArrays& w, int groups, int device, int sms, heuristics::Prepared prepared,
                 sm90::RaggedView ragged_d, cudaStream_t stream) {
  using Gemm = typename G::Gemm;
  using AB = typename G::ElementAB;
  using D = typename G::ElementD;
  const char* what = "grouped_gemm_fp8_sm90";
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sms;
  hw.max_active_clusters = max_active_clusters<typename G::Kernel>(device, what);
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, w.shapes, nullptr},  // shapes only on the device
      {reinterpret_cast<const AB**>(w.ptr_a), static_cast<typename G::StrideA*>(w.stride_a),
       reinterpret_cast<const AB**>(w.ptr_b), static_cast<typename G::StrideB*>(w.stride_b), w.ptr_sfa,
       static_cast<typename G::LayoutSFA*>(w.layout_sfa), w.ptr_sfb, static_cast<typename G::LayoutSFB*>(w.layout_sfb)},
      {},
      hw};
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = reinterpret_cast<D**>(w.ptr_d);
  args.epilogue.dD = static_cast<typename G::StrideD*>(w.stride_d);
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  if (prepared.store) {
    sm90::prepare_store_descriptors<typename G::Epilogue, D, ProblemShape>(
        groups, w.shapes, args.epilogue.ptr_D, args.epilogue.dD, w.cutlass_ws, w.descs_d, stream);
    check_launch("grouped_gemm_fp8_sm90: prep_store_descriptors_kernel");
    args.epilogue.descs = w.descs_d;
    args.epilogue.acquire_at_store = prepared.acquire_at_store;
  }
  if (prepared.ragged) {
    args.epilogue.ragged = ragged_d;
    args.epilogue.starts = w.starts;
  }
  // CUTLASS's tile order (MOE8_SM90_RASTER / _SWIZZLE override it): no other order measured faster
  sm90_util::apply_schedule(args, {});
  Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess)
    throw CudaError(std::string(what) + ": CUTLASS cannot implement: " + cutlassGetStatusString(st));
  st = gemm.initialize(args, w.cutlass_ws, stream);
  if (st != cutlass::Status::kSuccess)
    throw CudaError(std::string(what) + ": CUTLASS initialize: " + cutlassGetStatusString(st));
  st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess)
    throw CudaError(std::string(what) + ": CUTLASS run: " + cutlassGetStatusString(st));
  check_launch("grouped_gemm_fp8_sm90: CUTLASS kernel");
}

inline bool fp8_storage(DType d) { return d == DType::kU8 || d == DType::kF8E4M3; }

}  // namespace sm90_fp8

size_t grouped_gemm_fp8_sm90_workspace_bytes(int num_experts) {
  using namespace sm90_fp8;
  const DeviceFacts f = device_facts(current_device("grouped_gemm_fp8_sm90: cudaGetDevice"));
  const int sms = f.sms > 0 ? f.sms : 1;
  using C = Fp8Tiles<ScaleConfig>;
  const size_t cut = max_workspace_bytes<C::Large::Gemm, C::Solo::Gemm, C::M2::Gemm, C::Small::Gemm,
                                         C::LargeOverlap::Gemm, C::SmallOverlap::Gemm>(num_experts, sms);
  return kAlignWs /* base alignment slack */ + group_arrays_bytes(num_experts) + align_up(cut, kAlignWs);
}

bool grouped_gemm_fp8_sm90_supported(const TensorView& a, const TensorView& b, const TensorView& c) {
  using namespace sm90_fp8;
  for (const TensorView* t : {&a, &b, &c})
    if (!t->present || !t->is_cuda() || t->device_index != a.device_index || !t->is_contiguous() ||
        reinterpret_cast<uintptr_t>(t->data) % 16 != 0)
      return false;
  if (!fp8_storage(a.dtype) || !fp8_storage(b.dtype) || c.dtype != DType::kBF16) return false;
  if (a.ndim != 2 || b.ndim != 3 || c.ndim != 2) return false;
  const int64_t rows = a.shape[0], kd = a.shape[1], experts = b.shape[0], n = b.shape[1];
  if (b.shape[2] != kd || c.shape[0] != rows || c.shape[1] != n) return false;
  if (n <= 0 || kd <= 0 || kd % 16 != 0 || n % 8 != 0) return false;
  constexpr int64_t kMaxInt = 2147483647;
  if (rows > kMaxInt || n > kMaxInt || kd > kMaxInt || experts > kMaxInt || experts < 1) return false;
  const DeviceFacts f = device_facts(a.device_index);
  return f.major == 9 && f.minor == 0;
}

void grouped_gemm_fp8_sm90(const TensorView& a, const TensorView& a_scale, const TensorView& b,
                           const TensorView& b_scale, const TensorView& offsets, const TensorView& c, void* workspace,
                           size_t workspace_bytes, void* stream) {
  using namespace sm90_fp8;
  const char* what = "grouped_gemm_fp8_sm90";
  MOE8_CHECK(grouped_gemm_fp8_sm90_supported(a, b, c), what,
             ": unsupported arguments (see grouped_gemm_fp8_sm90_supported)");
  const int groups = static_cast<int>(offsets.shape[0] - 1);
  const int64_t rows = a.shape[0], kd = a.shape[1], n = c.shape[1];
  const int device = a.device_index;
  check_device_and_workspace(what, device, grouped_gemm_fp8_sm90_workspace_bytes(groups), workspace, workspace_bytes);
  const DeviceFacts f = device_facts(device);
  const GroupArrays w = carve(workspace, groups);
  cudaStream_t s = as_stream(stream);
  const heuristics::Sm90Overrides& env = heuristics::sm90_overrides();
  auto launch = [&](auto g) {
    using G = decltype(g);
    prep_fp8_kernel<G><<<prep_blocks(groups, rows * n / 8, f.sms), kPrepThreads, 0, s>>>(
        offsets.ptr<int32_t>(), groups, rows, n, kd, a.ptr<uint8_t>(), a_scale.ptr<float>(), b.ptr<uint8_t>(),
        b_scale.ptr<float>(), c.data, w);
    check_launch("grouped_gemm_fp8_sm90: prep_fp8_kernel");
    if (groups > 0 && rows > 0)
      run_cutlass<G>(w, groups, device, f.sms, heuristics::fp8_prepared(env), sm90::RaggedView{c.data, rows, n, n}, s);
  };
  const heuristics::Fp8Tile tile = heuristics::fp8_forward_tile(n, rows, groups, env);
  launch_tile<ScaleConfig>(tile, heuristics::fp8_promotion(tile, false, env), launch);
}

bool grouped_gemm_fp8_wgrad_sm90_available(int device) {
  const sm90_util::DeviceFacts f = sm90_util::device_facts(device);
  return f.major == 9 && f.minor == 0;
}

size_t grouped_gemm_fp8_wgrad_sm90_workspace_bytes(int num_experts) {
  using namespace sm90_fp8;
  const DeviceFacts f = device_facts(current_device("grouped_gemm_fp8_wgrad_sm90: cudaGetDevice"));
  const int sms = f.sms > 0 ? f.sms : 1;
  using C = Fp8Tiles<ScaleConfigWgrad>;
  const size_t cut = max_workspace_bytes<C::Large::Gemm, C::Solo::Gemm, C::M2::Gemm, C::Small::Gemm,
                                         C::LargeOverlap::Gemm, C::SmallOverlap::Gemm>(num_experts, sms);
  return kAlignWs + group_arrays_bytes(num_experts) + align_up(cut, kAlignWs);
}

void grouped_gemm_fp8_wgrad_sm90(const TensorView& dc_t, const TensorView& dc_scale, const TensorView& a_t,
                                 const TensorView& a_scale, const TensorView& offsets, const TensorView& db,
                                 void* workspace, size_t workspace_bytes, void* stream) {
  using namespace sm90_fp8;
  const char* what = "grouped_gemm_fp8_wgrad_sm90";
  const int groups = static_cast<int>(offsets.shape[0] - 1);
  const int64_t n = dc_t.shape[0], rows = dc_t.shape[1], kd = a_t.shape[0];
  MOE8_CHECK(db.dtype == DType::kBF16 && n % 8 == 0 && kd % 8 == 0 && rows % 16 == 0, what,
             ": needs db bfloat16, N and K multiples of 8 and R of 16");
  const int device = dc_t.device_index;
  MOE8_CHECK(grouped_gemm_fp8_wgrad_sm90_available(device), what, ": needs a compute capability 9.0 device");
  check_device_and_workspace(what, device, grouped_gemm_fp8_wgrad_sm90_workspace_bytes(groups), workspace,
                             workspace_bytes);
  const DeviceFacts f = device_facts(device);
  const GroupArrays w = carve(workspace, groups);
  cudaStream_t s = as_stream(stream);
  const heuristics::Sm90Overrides& env = heuristics::sm90_overrides();
  auto launch = [&](auto g) {
    using G = decltype(g);
    prep_fp8_wgrad_kernel<G><<<prep_blocks(groups, n * kd / 8, f.sms), kPrepThreads, 0, s>>>(
        offsets.ptr<int32_t>(), groups, rows, n, kd, dc_t.ptr<uint8_t>(), dc_scale.ptr<float>(), a_t.ptr<uint8_t>(),
        a_scale.ptr<float>(), db.data, w);
    check_launch("grouped_gemm_fp8_wgrad_sm90: prep_fp8_wgrad_kernel");
    if (groups > 0 && rows > 0)
      run_cutlass<G>(w, groups, device, f.sms, heuristics::fp8_prepared(env),
                     sm90::RaggedView{db.data, groups * n, kd, kd}, s);
  };
  const heuristics::Fp8Tile tile = heuristics::fp8_wgrad_tile(env);
  launch_tile<ScaleConfigWgrad>(tile, heuristics::fp8_promotion(tile, true, env), launch);
}

#else  // !MOE8_WITH_CUTLASS: stubs

bool grouped_gemm_fp8_wgrad_sm90_available(int) { return false; }

size_t grouped_gemm_fp8_wgrad_sm90_workspace_bytes(int) { return 0; }

void grouped_gemm_fp8_wgrad_sm90(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                 const TensorView&, const TensorView&, void*, size_t, void*) {
  fail("grouped_gemm_fp8_wgrad_sm90: moe8 was built without CUTLASS (MOE8_WITH_CUTLASS)");
}

size_t grouped_gemm_fp8_sm90_workspace_bytes(int) { return 0; }

bool grouped_gemm_fp8_sm90_supported(const TensorView&, const TensorView&, const TensorView&) { return false; }

void grouped_gemm_fp8_sm90(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                           const TensorView&, const TensorView&, void*, size_t, void*) {
  fail("grouped_gemm_fp8_sm90: moe8 was built without CUTLASS (MOE8_WITH_CUTLASS); use grouped_gemm_fp8");
}

#endif  // MOE8_WITH_CUTLASS

}  // namespace moe8::cuda
