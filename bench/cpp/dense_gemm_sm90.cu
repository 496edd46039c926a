// dense_gemm_sm90.cu — one dense bf16 GEMM, D [M, N] = A [M, K] · B [N, K]^T (row-major, the expert forward's
// layout), or L of them strided-batched (a weight each: equal experts), timed on CUTLASS's plain (not ptr-array)
// sm_90a kernels and on cuBLAS: what the tile configurations of moe8's grouped kernels reach without any grouping
// machinery (fixed TMA descriptors, the batch a coordinate), against the library's kernel on the same shape. A
// measurement tool, not part of the extension.
//
//   nvcc -O3 -DNDEBUG -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -I$CUTLASS/include -I$CUTLASS/tools/util/include \
//     bench/cpp/dense_gemm_sm90.cu -lcublas -o dense_gemm_sm90
//   ./dense_gemm_sm90 [M N K [iters [L]]]   (default: Qwen3-30B-A3B's up projection, 131072 1536 2048;
//                                            L 128 with M 1024: its 128 experts of 1,024 rows each)
// (-DNDEBUG as the extension builds: CUTLASS's asserts are calls that serialise the wgmma pipeline.
// CUTLASS: the source/ folder of the pinned nvidia-cutlass wheel's cutlass_library package, or a CUTLASS checkout.)
//
// Prints, per kernel, the median milliseconds of `iters` launches (CUDA events, after warm-up), TFLOP/s, and
// whether its output matches cuBLAS's (max |difference| relative to max |D|).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;
using T = cutlass::bfloat16_t;

#define CHECK_CUDA(x)                                                                 \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

// A launcher of Gemm on args, its workspace allocated once; exits if CUTLASS cannot run the configuration.
template <class Gemm>
std::function<void()> launcher(typename Gemm::Arguments const& args) {
  auto gemm = std::make_shared<Gemm>();
  void* ws = nullptr;
  const size_t bytes = Gemm::get_workspace_size(args);
  if (bytes) CHECK_CUDA(cudaMalloc(&ws, bytes));
  if (gemm->can_implement(args) != cutlass::Status::kSuccess ||
      gemm->initialize(args, ws) != cutlass::Status::kSuccess) {
    std::fprintf(stderr, "CUTLASS: cannot run this configuration\n");
    std::exit(1);
  }
  return [gemm] {
    if (gemm->run() != cutlass::Status::kSuccess) std::exit(2);
  };
}

template <class Tile, class Cluster, class KernelSchedule, class EpilogueSchedule, class EpilogueTile>
struct Dense {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster, EpilogueTile, float, float, void,
      cutlass::layout::RowMajor, 8, T, cutlass::layout::RowMajor, 8, EpilogueSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, 8, T,
      cutlass::layout::ColumnMajor, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // A launcher for D = A · B^T.
  static std::function<void()> make(int M, int N, int K, int L, const T* a, const T* b, T* d, int sms) {
    using SA = typename Kernel::StrideA;
    using SB = typename Kernel::StrideB;
    using SD = typename Kernel::StrideD;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {M, N, K, L},
        {a, cutlass::make_cute_packed_stride(SA{}, {M, K, L}), b, cutlass::make_cute_packed_stride(SB{}, {N, K, L})},
        {{1.0f, 0.0f}, nullptr, SD{}, d, cutlass::make_cute_packed_stride(SD{}, {M, N, L})}};
    args.hw_info.sm_count = sms;
    return launcher<Gemm>(args);
  }
};

using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CoopEpi = cutlass::epilogue::TmaWarpSpecializedCooperative;
using Pong = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using PongEpi = cutlass::epilogue::TmaWarpSpecialized;
using Auto = cutlass::epilogue::collective::EpilogueTileAuto;

// moe8's grouped tiles, here on one dense problem: kEpi64 (128x256, 1x2, 128x64 subtiles), kTall (256x128, 1x2),
// kPong128 (128x128 ping-pong, 2x1), kM2-like (128x256, 2x1).
using Epi64 = Dense<Shape<_128, _256, _64>, Shape<_1, _2, _1>, Coop, CoopEpi, Shape<_128, _64>>;
using Tall = Dense<Shape<_256, _128, _64>, Shape<_1, _2, _1>, Coop, CoopEpi, Auto>;
using Pong128 = Dense<Shape<_128, _128, _64>, Shape<_2, _1, _1>, Pong, PongEpi, Auto>;
using Large2x1 = Dense<Shape<_128, _256, _64>, Shape<_2, _1, _1>, Coop, CoopEpi, Shape<_128, _64>>;

// ---------------------------------------------------------------------------------------------------
// The grouped (ptr-array) kernel moe8 runs, on L equal groups of M rows (M a multiple of the tile's 128 and N of its
// 256, so every tile is whole): as CUTLASS builds it (every group its own TMA descriptors, rewritten and fenced by
// each CTA whenever its next tile is in another group), and with fixed descriptors, each tile's group in its TMA
// coordinates: A and B only (FixedAB), or A, B and D (FixedAB + FixedD). Fixed D is only right for whole tiles,
// which these equal groups are; it bounds what fixed descriptors can save.

using GroupShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using PtrCoopEpi = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using PtrCoop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using GTile = Shape<_128, _256, _64>;
using GCluster = Shape<_1, _2, _1>;

using GEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, GTile, GCluster, Shape<_128, _64>, float, float, void,
    cutlass::layout::RowMajor*, 8, T, cutlass::layout::RowMajor*, 8, PtrCoopEpi>::CollectiveOp;
using GMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor*, 8, T,
    cutlass::layout::ColumnMajor*, 8, float, GTile, GCluster,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename GEpilogue::SharedStorage))>,
    PtrCoop>::CollectiveOp;

// Where the equal groups live: A [groups * rows, k], B [groups * n, k], D [groups * rows, n], row-major.
struct EqualGroups {
  const T* a = nullptr;
  const T* b = nullptr;
  T* d = nullptr;
  int groups = 0, rows = 0, n = 0, k = 0;
};

// The mainloop with A and B read through fixed descriptors over all groups: the group (recorded when the kernel
// hands it over) moves the tile's coordinates, nothing rewrites a descriptor.
template <class Base>
struct FixedAB : Base {
  using typename Base::GmemTiledCopyA;
  using typename Base::GmemTiledCopyB;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TileShape;
  using InternalElementA = typename Base::InternalElementA;
  using InternalElementB = typename Base::InternalElementB;
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
  struct Arguments : Base::Arguments {
    EqualGroups eq;
  };
  struct Params : Base::Params {
    int rows, n, groups, rows_per_group;
  };
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape ps, Arguments const& args, void* ws) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(ps, args, ws);
    const EqualGroups& e = args.eq;
    auto ta = make_tensor(reinterpret_cast<InternalElementA const*>(e.a),
                          make_layout(make_shape(e.groups * e.rows, e.k, 1), make_stride(int64_t(e.k), _1{}, _0{})));
    auto tb = make_tensor(reinterpret_cast<InternalElementB const*>(e.b),
                          make_layout(make_shape(e.groups * e.n, e.k, 1), make_stride(int64_t(e.k), _1{}, _0{})));
    p.tma_load_a = make_tma_copy(GmemTiledCopyA{}, ta, SmemLayoutA{}(_, _, Int<0>{}),
                                 make_shape(shape<0>(TileShape{}), shape<2>(TileShape{})), size<1>(ClusterShape{}));
    p.tma_load_b = make_tma_copy(GmemTiledCopyB{}, tb, SmemLayoutB{}(_, _, Int<0>{}),
                                 make_shape(shape<1>(TileShape{}), shape<2>(TileShape{})), size<0>(ClusterShape{}));
    p.rows = e.groups * e.rows;
    p.n = e.groups * e.n;
    p.groups = e.groups;
    p.rows_per_group = e.rows;
    return p;
  }
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& ps, Params const& p) const {
    const int k = get<2>(ps);
    Tensor mA = p.tma_load_a.get_tma_tensor(make_shape(p.rows, k, 1));
    Tensor mB = p.tma_load_b.get_tma_tensor(make_shape(p.n, k, 1));
    return cute::make_tuple(local_tile(mA, TileShape{}, make_coord(_, _, _), Step<_1, Underscore, _1>{}),
                            local_tile(mB, TileShape{}, make_coord(_, _, _), Step<Underscore, _1, _1>{}));
  }
  template <class... Ts>
  CUTLASS_DEVICE void tensormaps_perform_update(Ts&&...) {}
  template <class... Ts>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(Ts&&...) {}
  template <class... Ts>
  CUTLASS_DEVICE void tensormaps_fence_acquire(Ts&&...) {}
  template <class InputTensors, class ProblemShape_MNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const& in, Params const&, ProblemShape_MNKL,
                                                     int32_t next_batch) {
    group_ = next_batch;
    return in;
  }
  template <class TensorA, class TensorB, class MapA, class MapB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& p, typename Base::MainloopPipeline pipeline,
                           typename Base::PipelineState state, cute::tuple<TensorA, TensorB> const& inputs,
                           cute::tuple<MapA, MapB> const&, BlockCoord const& blk, KTileIterator k_iter, int k_count,
                           int thread_idx, uint32_t rank, typename Base::TensorStorage& smem) {
    auto [m, n, k, l] = blk;
    const int per_m = p.rows_per_group / size<0>(TileShape{}), per_n = (p.n / p.groups) / size<1>(TileShape{});
    auto moved = make_coord(m + group_ * per_m, n + group_ * per_n, k, l);
    auto fixed = cute::make_tuple(p.tma_load_a.get_tma_descriptor(), p.tma_load_b.get_tma_descriptor());
    Base::load(p, pipeline, state, inputs, fixed, moved, k_iter, k_count, thread_idx, rank, smem);
  }
  int32_t group_ = 0;
};

// The epilogue with D stored through one fixed descriptor over all rows (whole tiles only: see above).
template <class Base>
struct FixedD : Base {
  using typename Base::TensorStorage;
  struct Arguments : Base::Arguments {
    EqualGroups eq;
  };
  struct Params : Base::Params {
    int rows, rows_per_group;
  };
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& ps, Arguments const& args, void* ws) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(ps, args, ws);
    const EqualGroups& e = args.eq;
    auto td = make_tensor(make_gmem_ptr(e.d),
                          make_layout(make_shape(e.groups * e.rows, e.n, 1), make_stride(int64_t(e.n), _1{}, _0{})));
    using EpiTile = typename Base::EpilogueTile;  // D's smem layout as the epilogue makes it (row-major D)
    auto smem_d = tile_to_shape(typename Base::SmemLayoutAtomD{},
                                make_shape(size<0>(EpiTile{}), size<1>(EpiTile{}), Int<1>{}), Step<_1, _2, _3>{});
    p.tma_store_d = make_tma_copy(typename Base::CopyOpS2G{}, td, take<0, 2>(smem_d), EpiTile{}, _1{});
    p.rows = e.groups * e.rows;
    p.rows_per_group = e.rows;
    return p;
  }
  CUTLASS_DEVICE FixedD(Params const& p, TensorStorage& s)
      : Base(p, s), desc_(p.tma_store_d.get_tma_descriptor()), rows_(p.rows), per_m_(p.rows_per_group / 128) {}
  template <bool IsLoad, class... Ts>
  CUTLASS_DEVICE void tensormaps_perform_update(Ts&&...) {}
  template <bool IsLoad, class... Ts>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(Ts&&...) {}
  template <bool IsLoad, class... Ts>
  CUTLASS_DEVICE void tensormaps_fence_acquire(Ts&&...) {}
  template <class LP, class LPS, class SP, class SPS, class PS, class TS, class TC, class AE, class AL, class TM,
            class Map>
  CUTLASS_DEVICE auto store(LP lp, LPS lps, SP sp, SPS sps, PS ps, TS ts, TC tc, cute::Tensor<AE, AL> acc, TM tm,
                            int thread_idx, TensorStorage& smem, Map const&, int subtile_idx = -1) {
    auto [M, N, K, L] = ps;
    auto [m, n, k, l] = tc;
    return Base::store(lp, lps, sp, sps, make_shape(rows_, N, K, L), ts, make_coord(m + int(l) * per_m_, n, k, l), acc,
                       tm, thread_idx, smem, desc_, subtile_idx);
  }
  cute::TmaDescriptor const* desc_;
  int rows_, per_m_;
};

template <class Mainloop, class Epilogue>
struct GroupedGemm {
  using Kernel = cutlass::gemm::kernel::GemmUniversal<GroupShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;

  template <class A, class = void>
  struct has_eq : std::false_type {};
  template <class A>
  struct has_eq<A, std::void_t<decltype(std::declval<A&>().eq)>> : std::true_type {};
  template <class Args>
  static void set_eq(Args& args, EqualGroups const& e) {
    if constexpr (has_eq<decltype(args.mainloop)>::value) args.mainloop.eq = e;
    if constexpr (has_eq<decltype(args.epilogue)>::value) args.epilogue.eq = e;
  }

  // A launcher over the equal groups: the per-group arrays made once on the device.
  static std::function<void()> make(EqualGroups e, int sms) {
    using PS = typename GroupShape::UnderlyingProblemShape;
    std::vector<PS> shapes(e.groups, PS(e.rows, e.n, e.k));
    std::vector<const T*> pa(e.groups), pb(e.groups);
    std::vector<T*> pd(e.groups);
    std::vector<StrideA> sa(e.groups, cutlass::make_cute_packed_stride(StrideA{}, {e.rows, e.k, 1}));
    std::vector<StrideB> sb(e.groups, cutlass::make_cute_packed_stride(StrideB{}, {e.n, e.k, 1}));
    std::vector<StrideD> sd(e.groups, cutlass::make_cute_packed_stride(StrideD{}, {e.rows, e.n, 1}));
    for (int g = 0; g < e.groups; ++g) {
      pa[g] = e.a + size_t(g) * e.rows * e.k;
      pb[g] = e.b + size_t(g) * e.n * e.k;
      pd[g] = e.d + size_t(g) * e.rows * e.n;
    }
    auto up = [](const auto& v) {
      void* p = nullptr;
      CHECK_CUDA(cudaMalloc(&p, sizeof(v[0]) * v.size()));
      CHECK_CUDA(cudaMemcpy(p, v.data(), sizeof(v[0]) * v.size(), cudaMemcpyHostToDevice));
      return p;
    };
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {e.groups, static_cast<PS*>(up(shapes)), nullptr};
    args.mainloop.ptr_A = static_cast<const T**>(up(pa));
    args.mainloop.dA = static_cast<StrideA*>(up(sa));
    args.mainloop.ptr_B = static_cast<const T**>(up(pb));
    args.mainloop.dB = static_cast<StrideB*>(up(sb));
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = nullptr;
    args.epilogue.ptr_D = static_cast<T**>(up(pd));
    args.epilogue.dD = static_cast<StrideD*>(up(sd));
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.hw_info.sm_count = sms;
    set_eq(args, e);
    return launcher<Gemm>(args);
  }
};

using Ptr = GroupedGemm<GMainloop, GEpilogue>;
using PtrFixedAB = GroupedGemm<FixedAB<GMainloop>, GEpilogue>;
using PtrFixedABD = GroupedGemm<FixedAB<GMainloop>, FixedD<GEpilogue>>;

__global__ void fill(T* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    p[i] = T((static_cast<float>(x & 0xffff) / 65535.0f - 0.5f));
  }
}

float median_ms(const std::function<void()>& f, int iters) {
  for (int i = 0; i < 5; ++i) f();
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> ms(iters);
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  for (int i = 0; i < iters; ++i) {
    CHECK_CUDA(cudaEventRecord(e0));
    f();
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    CHECK_CUDA(cudaEventElapsedTime(&ms[i], e0, e1));
  }
  std::sort(ms.begin(), ms.end());
  return ms[iters / 2];
}

std::vector<float> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  CHECK_CUDA(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = static_cast<float>(h[i]);
  return f;
}

int main(int argc, char** argv) {
  const int M = argc > 3 ? std::atoi(argv[1]) : 131072, N = argc > 3 ? std::atoi(argv[2]) : 1536,
            K = argc > 3 ? std::atoi(argv[3]) : 2048, iters = argc > 4 ? std::atoi(argv[4]) : 20,
            L = argc > 5 ? std::atoi(argv[5]) : 1;
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs; %d x D [%d, %d] = A [%d, %d] . B [%d, %d]^T, bf16, fp32 accumulation\n", prop.name, sms, L,
              M, N, M, K, N, K);
  const size_t na = size_t(L) * M * K, nb = size_t(L) * N * K, nd = size_t(L) * M * N;
  T *a, *b, *d;
  CHECK_CUDA(cudaMalloc(&a, sizeof(T) * na));
  CHECK_CUDA(cudaMalloc(&b, sizeof(T) * nb));
  CHECK_CUDA(cudaMalloc(&d, sizeof(T) * nd));
  fill<<<1024, 256>>>(a, na, 1);
  fill<<<1024, 256>>>(b, nb, 2);
  cublasHandle_t h;
  cublasCreate(&h);
  const float one = 1.0f, zero = 0.0f;
  auto cublas = [&] {  // row-major D = A . B^T as column-major D^T = B . A^T
    if (L == 1)
      cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, b, CUDA_R_16BF, K, a, CUDA_R_16BF, K, &zero, d,
                   CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    else
      cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, b, CUDA_R_16BF, K, (long long)N * K, a,
                                 CUDA_R_16BF, K, (long long)M * K, &zero, d, CUDA_R_16BF, N, (long long)M * N, L,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  const double flop = 2.0 * M * N * K * L;
  cublas();
  CHECK_CUDA(cudaDeviceSynchronize());
  const std::vector<float> ref = to_host(d, nd);
  float ref_max = 0;
  for (float v : ref) ref_max = std::max(ref_max, std::fabs(v));
  struct Case {
    const char* name;
    std::function<void()> run;
  };
  std::vector<Case> cases = {{"cublas", cublas},
                             {"epi64 128x256 1x2 coop", Epi64::make(M, N, K, L, a, b, d, sms)},
                             {"tall 256x128 1x2 coop", Tall::make(M, N, K, L, a, b, d, sms)},
                             {"pong128 128x128 2x1 ping-pong", Pong128::make(M, N, K, L, a, b, d, sms)},
                             {"128x256 2x1 coop", Large2x1::make(M, N, K, L, a, b, d, sms)}};
  if (L > 1 && M % 128 == 0 && N % 512 == 0) {  // whole tiles, an even number of 256-wide ones (the 1x2 cluster)
    const EqualGroups e{a, b, d, L, M, N, K};
    cases.push_back({"grouped ptr-array (moe8's kernel)", Ptr::make(e, sms)});
    cases.push_back({"grouped, A and B fixed", PtrFixedAB::make(e, sms)});
    cases.push_back({"grouped, A, B and D fixed", PtrFixedABD::make(e, sms)});
  }
  for (int round = 0; round < 2;
       ++round) {  // twice, round-robin: the second round after every kernel warmed the clocks
    for (const Case& c : cases) {
      const float ms = median_ms(c.run, iters);
      CHECK_CUDA(cudaDeviceSynchronize());
      const std::vector<float> out = to_host(d, nd);
      float diff = 0;
      for (size_t i = 0; i < out.size(); ++i) diff = std::max(diff, std::fabs(out[i] - ref[i]));
      std::printf("round %d  %-32s %8.3f ms %7.1f TFLOP/s  max|diff|/max|D| %.2e\n", round, c.name, ms, flop / ms / 1e9,
                  diff / ref_max);
    }
  }
  return 0;
}
