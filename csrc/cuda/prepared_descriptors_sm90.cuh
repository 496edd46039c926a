// cuda/prepared_descriptors_sm90.cuh — CUTLASS's ptr-array grouped GEMM with its per-group TMA descriptors made
// once per call, before the GEMM, by prep_store_descriptors_kernel and prep_load_descriptors_kernel (one warp a
// group, in the caller's workspace): D's for the epilogue's stores (PreparedStoreEpilogue: the bf16 forward, dgrad
// and weight gradients, and the FP8 ones), A's and B's for the mainloop's loads (PreparedLoadMainloop: bf16).
//
// CUTLASS's ptr-array kernel keeps one descriptor per CTA for each of A, B and D and rewrites it whenever the next
// tile is in another group: a lane writes the new address and dims in shared memory, the warp copies the descriptor
// out with a release fence, after waiting for the TMA operations still using the old one. For D that is on the
// consumers' critical path, before the next tile's first wgmma; with 64-128 experts nearly every tile starts a new
// group. Here a group change only acquires the group's prepared descriptors and prefetches them into the SM's
// descriptor cache, a whole mainloop ahead of the epilogue's first store (the kernel announces the next tile's group
// before its mainloop). Every address, dim and stride is what CUTLASS's rewrite would have written, so the loads,
// stores and results are the same bits. The same wrappers take one ragged descriptor per operand instead
// (ragged_tma_sm90.cuh: no descriptor per group at all, the rules' default); the epilogue's rewrites D's descriptor
// as CUTLASS does when its Arguments carry neither, so one kernel serves every mix the rules allow
// (heuristics::prepared, heuristics::fp8_prepared). No descriptor is rewritten through CUTLASS's
// tma_descriptor_replace_dims_strides_in_shared_mem: it writes the shared address into an asm input operand, a
// register the compiler may share with any other value it knows to be 0 (replace_dims_strides_in_shared_mem).
// Build: included by grouped_gemm_sm90_impl.cuh and grouped_gemm_fp8_sm90.cu (CUTLASS headers, sm_90a).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/activation.cuh"
#include "cuda/ragged_tma_sm90.cuh"
#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace moe8::cuda::sm90 {

// The group's descriptor made visible to this thread's TMA operations (written by an earlier kernel through the
// generic proxy and released there) and fetched into the SM's descriptor cache.
CUTLASS_DEVICE void acquire_prepared(const cute::TmaDescriptor* desc) {
  cute::tma_descriptor_fence_acquire(desc);
  cute::prefetch_tma_descriptor(desc);
}

template <int I>
CUTLASS_DEVICE void replace_dim(uint32_t smem_desc, uint32_t dim) {
  asm volatile("tensormap.replace.tile.global_dim.shared::cta.b1024.b32 [%0], %1, %2;" ::"r"(smem_desc), "n"(I),
               "r"(dim)
               : "memory");
}
template <int I>
CUTLASS_DEVICE void replace_stride(uint32_t smem_desc, uint64_t stride) {
#if (__CUDACC_VER_MAJOR__ > 12) || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 5)
  const uint64_t field = stride;
#else
  const uint64_t field = stride >> 4;  // older PTX takes the stride without its 4 low bits
#endif
  asm volatile("tensormap.replace.tile.global_stride.shared::cta.b1024.b64 [%0], %1, %2;" ::"r"(smem_desc), "n"(I),
               "l"(field)
               : "memory");
}

// CUTLASS's tma_descriptor_replace_dims_strides_in_shared_mem (the five dims, the four outer byte strides) with the
// descriptor's shared-memory address an input it is: CUTLASS's converts it into a const 0 passed as an input operand.
CUTLASS_DEVICE void replace_dims_strides_in_shared_mem(cute::TmaDescriptor& desc, cute::array<uint32_t, 5> const& dims,
                                                       cute::array<uint64_t, 5> const& strides) {
  const uint32_t d = cute::cast_smem_ptr_to_uint(&desc);
  replace_dim<0>(d, dims[0]);
  replace_dim<1>(d, dims[1]);
  replace_dim<2>(d, dims[2]);
  replace_dim<3>(d, dims[3]);
  replace_dim<4>(d, dims[4]);
  replace_stride<0>(d, strides[1]);
  replace_stride<1>(d, strides[2]);
  replace_stride<2>(d, strides[3]);
  replace_stride<3>(d, strides[4]);
}

// staged (tma's descriptor, in shared memory, by one thread) rewritten for a group's (rows, cols, 1) operand at ptr
// with `stride`: what CUTLASS's in-kernel rewrite writes.
template <class Element, class Tma, class Stride>
CUTLASS_DEVICE void rewrite_in_shared_mem(cute::TmaDescriptor& staged, const Tma& tma, const void* ptr, int rows,
                                          int cols, const Stride& stride) {
  using namespace cute;
  tma_descriptor_replace_addr_in_shared_mem(staged, ptr);
  cute::array<uint32_t, 5> dims = {1, 1, 1, 1, 1};
  cute::array<uint64_t, 5> strides = {0, 0, 0, 0, 0};
  Tensor t = make_tensor(static_cast<const Element*>(nullptr), make_layout(make_shape(rows, cols, Int<1>{}), stride));
  cute::detail::fill_tma_gmem_shape_stride(tma, t, dims, strides);
  for (uint64_t& s : strides) s = s * sizeof_bits_v<Element> / 8;  // in bytes
  replace_dims_strides_in_shared_mem(staged, dims, strides);
}

// Base (a CUTLASS collective) with `descs`, an array of prepared descriptors, added to its Arguments and Params
// (null: CUTLASS's own rewrite), and where the epilogue acquires D's (acquire_at_store; the mainloop ignores it).
template <class Base>
struct TakesDescriptors : Base {
  using Base::Base;
  struct Arguments : Base::Arguments {
    const cute::TmaDescriptor* descs = nullptr;
    bool acquire_at_store = false;
  };
  struct Params : Base::Params {
    const cute::TmaDescriptor* descs;
    bool acquire_at_store;
  };
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, args, workspace);
    p.descs = args.descs;
    p.acquire_at_store = args.acquire_at_store;
    return p;
  }
};

// Base: CUTLASS's CollectiveEpilogue<Sm90PtrArrayTmaWarpSpecialized...> with a D and no C, its store rebuilt on
// Moe8RaggedTmaStore (WithRaggedStore). D is stored through one of three:
// - ragged (Arguments::ragged.base set): one descriptor for every group, made on the host per call; a group change
//   only reads the group's first row (from its D pointer) for the stores' coordinates;
// - prepared (descs set): descs[group] from prep_store_descriptors_kernel, acquired at a group change;
// - neither: the CTA's descriptor rewritten as CUTLASS's epilogue rewrites it (rewrite_in_shared_mem).
// kSwiGLU (ragged only): D is an up projection's h = [gate | up] [R, 2I] whose 256-wide tile n holds gate columns
// [128 n, 128 n + 128) and up columns [I + 128 n, ...) (PreparedLoadMainloop<..., true> loads B so); the store puts
// each half in its place (paired_col) and each thread writes SwiGLU(gate, up) of its accumulators to act [R, I]
// (store_swiglu).
template <class Base, bool kSwiGLU = false>
struct PreparedStoreEpilogue : TakesDescriptors<WithRaggedStore<Base>> {
  using Cutlass = WithRaggedStore<Base>;
  using typename Cutlass::TensorStorage;
  using ElementD = typename Cutlass::ElementD;
  struct Arguments : TakesDescriptors<Cutlass>::Arguments {
    RaggedView ragged{};
    const RaggedStarts* starts = nullptr;  // with ragged: each group's first row (.d)
    ElementD* act = nullptr;               // kSwiGLU: [R, half]
    int32_t half = 0;                      // kSwiGLU: I
  };
  struct Params : TakesDescriptors<Cutlass>::Params {
    cute::TmaDescriptor ragged_desc;  // valid where ragged.base is set
    const RaggedStarts* starts;
    ElementD* act;
    int32_t half;
  };
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename TakesDescriptors<Cutlass>::Params&>(p) =
        TakesDescriptors<Cutlass>::to_underlying_arguments(problem_shape, args, workspace);
    p.starts = args.ragged.base != nullptr ? args.starts : nullptr;
    MOE8_CHECK(args.ragged.base == nullptr || args.starts != nullptr,
               "grouped GEMM epilogue: a ragged D needs its groups' first rows");
    if (args.ragged.base != nullptr)
      p.ragged_desc =
          ragged_rows_descriptor<ElementD, typename decltype(p.tma_store_d)::Traits, typename Cutlass::InternalStrideD>(
              args.ragged, 1, "grouped GEMM epilogue: D");
    p.act = args.act;
    p.half = args.half;
    MOE8_CHECK(!kSwiGLU || (args.ragged.base != nullptr && args.act != nullptr && args.half > 0 &&
                            args.half % kPairedCols == 0 && args.ragged.cols == 2 * int64_t(args.half)),
               "grouped GEMM epilogue: SwiGLU in the epilogue needs a ragged h of 2 I columns, I a multiple of ",
               kPairedCols, ", and its output");
    return p;
  }

  CUTLASS_DEVICE PreparedStoreEpilogue(Params const& params, TensorStorage& shared)
      : TakesDescriptors<Cutlass>(params, shared),
        descs_(params.descs),
        acquire_at_store_(params.acquire_at_store),
        ragged_(params.starts != nullptr ? &params.ragged_desc : nullptr),
        starts_(params.starts),
        act_(params.act),
        half_(params.half) {}

  // The kernel calls these for D (IsLoad false) when a consumer warpgroup's next tile is in another group, from its
  // first warp (the one whose elected lane issues the TMA stores), before that tile's mainloop. With
  // acquire_at_store only the prefetch is issued here and store() acquires. Ragged: the group's first row, a load
  // whose value is first used by the tile's store, after its mainloop.
  template <bool IsLoad, class Storage, class P, class Map, class Shape>
  CUTLASS_DEVICE void tensormaps_perform_update(Storage& shared, P const& params, Map tensormap, Shape shape,
                                                int32_t next_batch, int32_t warp_group_idx) {
    if constexpr (IsLoad) {  // no C: CUTLASS's does nothing
      return Cutlass::template tensormaps_perform_update<IsLoad>(shared, params, tensormap, shape, next_batch,
                                                                 warp_group_idx);
    } else {
      if (ragged_ != nullptr) {
        if (row0_ < 0) cute::prefetch_tma_descriptor(ragged_);  // the warp's first group
        row0_ = starts_[next_batch].d;
      } else if (descs_ == nullptr) {
        if (cute::elect_one_sync())
          rewrite_in_shared_mem<ElementD>(shared.smem_tensormap_D[warp_group_idx], params.tma_store_d,
                                          params.ptr_D[next_batch], cute::get<0>(shape), cute::get<1>(shape),
                                          params.dD[next_batch]);
      } else if (acquire_at_store_) {
        cute::prefetch_tma_descriptor(descs_ + next_batch);
      } else {
        acquire_prepared(descs_ + next_batch);
      }
    }
  }
  template <bool IsLoad, class Storage, class Map>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(Storage& shared, Map tensormap, int32_t warp_group_idx = 0) {
    if (IsLoad || (descs_ == nullptr && ragged_ == nullptr))
      Cutlass::template tensormaps_cp_fence_release<IsLoad>(shared, tensormap, warp_group_idx);
  }
  template <bool IsLoad, class Map>
  CUTLASS_DEVICE void tensormaps_fence_acquire(Map tensormap) {
    if (IsLoad || (descs_ == nullptr && ragged_ == nullptr))
      Cutlass::template tensormaps_fence_acquire<IsLoad>(tensormap);
  }

  // CUTLASS's store, through the ragged descriptor at the group's rows, the tile's group's prepared descriptor (the
  // tile coordinate's l is the group: the kernel makes it from the scheduler's group index) or the CTA's rewritten
  // one: one instantiation of the store whichever.
  template <class LoadPipeline, class LoadState, class StorePipeline, class StoreState, class ProblemShapeMNKL,
            class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout, class TiledMma, class TensorMap>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline, LoadState load_state, StorePipeline store_pipeline,
                            StoreState store_state, ProblemShapeMNKL problem_shape, TileShapeMNK tile_shape,
                            TileCoordMNKL tile_coord, cute::Tensor<AccEngine, AccLayout> accumulators,
                            TiledMma tiled_mma, int thread_idx, TensorStorage& shared, TensorMap const& tensormap,
                            int subtile_idx = -1) {
    RaggedRows target{tensormap, 0, -1};
    if constexpr (kSwiGLU) {
      store_swiglu(problem_shape, tile_shape, tile_coord, accumulators, tiled_mma, thread_idx);
      target = {ragged_, row0_, static_cast<int32_t>(cute::get<0>(problem_shape)), half_};
    } else if (ragged_ != nullptr) {
      target = {ragged_, row0_, static_cast<int32_t>(cute::get<0>(problem_shape))};
    } else if (descs_ != nullptr) {
      const int group = static_cast<int>(cute::get<3>(tile_coord));
      target.desc = descs_ + group;
      if (acquire_at_store_ && group != acquired_) {  // every thread, as CUTLASS's own acquire
        cute::tma_descriptor_fence_acquire(target.desc);
        acquired_ = group;
      }
    }
    return Cutlass::store(load_pipeline, load_state, store_pipeline, store_state, problem_shape, tile_shape, tile_coord,
                          accumulators, tiled_mma, thread_idx, shared, target, subtile_idx);
  }

 private:
  // act[r, 128 n + j] = SwiGLU(bf16(gate), bf16(up)) for the tile's rows r and its gate column j < 128, from this
  // thread's accumulators, as activation_forward computes it from h (the same bits). The m64n256 wgmma accumulator
  // layout (the cooperative tile's warpgroup) gives a thread elements i = c + 2 r + 4 g: columns 8 g + 2 (lane % 4) + c
  // of rows lane / 4 + 8 r of its warp's 16, so element i + 64 is element i's row 128 columns on (g + 16). A row's 8
  // columns 8 g .. 8 g + 7 lie with the four lanes of a quad, two each: the quad transposes four such groups (two
  // rounds of shuffles) so that each lane stores one group's 16 bytes, four times fewer stores than pairs.
  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma>
  CUTLASS_DEVICE void store_swiglu(ProblemShapeMNKL problem_shape, TileShapeMNK tile_shape, TileCoordMNKL tile_coord,
                                   cute::Tensor<AccEngine, AccLayout> const& acc, TiledMma tiled_mma, int thread_idx) {
    using namespace cute;
    static_assert(size<1>(TileShapeMNK{}) == 2 * kPairedCols, "a tile of 128 gate and 128 up columns");
    constexpr int kElems = decltype(size(acc))::value, kHalf = kElems / 2;
    static_assert(kElems == 128, "one m64n256 accumulator a thread");
    const int group = static_cast<int>(get<3>(tile_coord));
    const int64_t row0 = starts_[group].d;
    const int rows = static_cast<int>(get<0>(problem_shape));
    const int m0 = static_cast<int>(get<0>(tile_coord)) * size<0>(tile_shape);
    ElementD* out = act_ + static_cast<int64_t>(get<1>(tile_coord)) * kPairedCols;
    Tensor coords = tiled_mma.get_thread_slice(thread_idx).partition_C(make_identity_tensor(take<0, 2>(tile_shape)));
    const int quad_lane = threadIdx.x % 4;
    const bool odd = quad_lane & 1, high = quad_lane & 2;
    ActParams swiglu;
    swiglu.kind = ActKind::kSwiGLU;
    auto act_pair = [&](int i) {  // elements i, i + 1 as two bf16 in one word
      cutlass::Array<ElementD, 2> pair;
      CUTLASS_PRAGMA_UNROLL
      for (int t = 0; t < 2; ++t)
        pair[t] = ElementD(act_forward(swiglu, static_cast<float>(ElementD(acc(i + t))),
                                       static_cast<float>(ElementD(acc(i + t + kHalf)))));
      return reinterpret_cast<uint32_t const&>(pair);
    };
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 2; ++r) {
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kHalf / 16; ++b) {  // groups 4 b .. 4 b + 3
        uint32_t w[4];
        CUTLASS_PRAGMA_UNROLL
        for (int g = 0; g < 4; ++g) w[g] = act_pair(2 * r + 4 * (4 * b + g));
        // lane q holds group 4 b + g's words of lane q at w[g]; after: group 4 b + q's words of lanes 0-3 at w[0-3]
        uint32_t x = __shfl_xor_sync(0xffffffffu, odd ? w[0] : w[1], 1);
        uint32_t y = __shfl_xor_sync(0xffffffffu, odd ? w[2] : w[3], 1);
        w[0] = odd ? x : w[0];
        w[1] = odd ? w[1] : x;
        w[2] = odd ? y : w[2];
        w[3] = odd ? w[3] : y;
        x = __shfl_xor_sync(0xffffffffu, high ? w[0] : w[2], 2);
        y = __shfl_xor_sync(0xffffffffu, high ? w[1] : w[3], 2);
        w[0] = high ? x : w[0];
        w[1] = high ? y : w[1];
        w[2] = high ? w[2] : x;
        w[3] = high ? w[3] : y;
        const int first = 2 * r + 16 * b;  // this lane's element of group 4 b: its row, column 32 b + 2 q
        const int m = m0 + static_cast<int>(get<0>(coords(first)));
        const int col = static_cast<int>(get<1>(coords(first))) + 6 * quad_lane;  // 8 (4 b + q)
        if (m < rows) *reinterpret_cast<uint4*>(out + (row0 + m) * half_ + col) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }

  const cute::TmaDescriptor* descs_;
  bool acquire_at_store_;
  int acquired_ = -1;                  // the group whose descriptor this thread last acquired (acquire_at_store)
  const cute::TmaDescriptor* ragged_;  // the ragged descriptor (in the kernel's parameters) or null
  const RaggedStarts* starts_;         // with ragged_: each group's first rows
  ElementD* act_;                      // kSwiGLU
  int32_t half_;
  int32_t row0_ = -1;  // the current group's first row of D (ragged; the hook's warp only)
};

// Base: CUTLASS's CollectiveMma<MainloopSm90ArrayTmaGmmaWarpSpecialized...> (A and B both by TMA). A and B are read
// through one of two (a GEMM that rewrites them runs CUTLASS's own mainloop):
// - ragged (Arguments::ragged_a and ragged_b set): one descriptor each for every group, made on the host per call; a
//   group change only reads the group's first rows (RaggedStarts) and row counts for the coordinates;
// - prepared (descs set): descs[2 group], descs[2 group + 1] from prep_load_descriptors_kernel.
// kPairedB (ragged only; the forward of an up projection, B = its [gate | up] weight rows, 2 I of them a group): the
// 256-row B tile n is loaded as gate rows [128 n, 128 n + 128) and up rows [I + 128 n, ...), two boxes of 128 rows,
// so that the tile's output columns pair each gate column with its up column (PreparedStoreEpilogue<..., true>).
template <class Base, bool kPairedB = false>
struct PreparedLoadMainloop : TakesDescriptors<Base> {
  // one group's (not StrideA and the like: the kernel reads the mainloop's to tell a grouped GEMM)
  using OneElementA = typename Base::InternalElementA;
  using OneElementB = typename Base::InternalElementB;
  using OneStrideA = typename Base::InternalStrideA;
  using OneStrideB = typename Base::InternalStrideB;
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
  struct Arguments : TakesDescriptors<Base>::Arguments {
    RaggedView ragged_a{}, ragged_b{};     // both or neither
    const RaggedStarts* starts = nullptr;  // with them: each group's first rows (.a, .b)
    int32_t half = 0;                      // kPairedB: I
  };
  struct Params : TakesDescriptors<Base>::Params {
    cute::TmaDescriptor ragged_a_desc, ragged_b_desc;  // valid where starts is set (kPairedB: B's box 128 rows)
    const RaggedStarts* starts;
    int32_t half;
  };
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename TakesDescriptors<Base>::Params&>(p) =
        TakesDescriptors<Base>::to_underlying_arguments(problem_shape, args, workspace);
    const bool ragged = args.ragged_a.base != nullptr;
    MOE8_CHECK(ragged == (args.ragged_b.base != nullptr) && ragged == (args.starts != nullptr),
               "grouped GEMM mainloop: A and B are both ragged, with their groups' first rows, or neither");
    MOE8_CHECK(ragged != (args.descs != nullptr), "grouped GEMM mainloop: A and B are read through ragged or prepared",
               " descriptors, one of the two (CUTLASS's own mainloop rewrites them)");
    p.starts = args.starts;
    if (ragged) {
      // multicast as CUTLASS's atoms: A over the cluster's CTAs along N, B along M
      p.ragged_a_desc = ragged_rows_descriptor<OneElementA, typename decltype(p.tma_load_a)::Traits, OneStrideA>(
          args.ragged_a, cute::size<1>(ClusterShape{}), "grouped GEMM mainloop: A");
      p.ragged_b_desc = ragged_rows_descriptor<OneElementB, typename decltype(p.tma_load_b)::Traits, OneStrideB>(
          args.ragged_b, cute::size<0>(ClusterShape{}) * (kPairedB ? 2 : 1), "grouped GEMM mainloop: B");
    }
    p.half = args.half;
    MOE8_CHECK(!kPairedB || (ragged && args.half > 0 && args.half % kPairedCols == 0),
               "grouped GEMM mainloop: paired gate and up rows need ragged descriptors and I a multiple of ",
               kPairedCols);
    return p;
  }

  // The producer warp's calls at each group change (its first tile's group included), in the kernel's order:
  // perform_update, cp_fence_release, then, before the first load, fence_acquire: only the first does anything.
  template <class Storage, class Maps, class Shape>
  CUTLASS_DEVICE void tensormaps_perform_update(Storage&, Params const& params, Maps const&, Shape shape,
                                                int32_t next_batch) {
    descs_ = params.descs;
    if (params.starts != nullptr) {
      if (ragged_a_.desc == nullptr) {  // the first group
        ragged_a_.desc = &params.ragged_a_desc;
        ragged_b_.desc = &params.ragged_b_desc;
        cute::prefetch_tma_descriptor(ragged_a_.desc);
        cute::prefetch_tma_descriptor(ragged_b_.desc);
      }
      // the group's rows of each operand: its non-contiguous mode (A: M, or K where M is contiguous; B: N, or K)
      constexpr bool kAColsFirst =
          cute::is_static<std::remove_reference_t<decltype(cute::get<0>(OneStrideA{}))>>::value;
      constexpr bool kBColsFirst =
          cute::is_static<std::remove_reference_t<decltype(cute::get<0>(OneStrideB{}))>>::value;
      const int32_t m = cute::get<0>(shape), n = cute::get<1>(shape), k = cute::get<2>(shape);
      ragged_a_.rows = kAColsFirst ? k : m;
      ragged_b_.rows = kBColsFirst ? k : n;
      const RaggedStarts starts = params.starts[next_batch];
      ragged_a_.row0 = starts.a;
      ragged_b_.row0 = starts.b;
      return;
    }
    group_ = next_batch;
    acquire_prepared(descs_ + 2 * group_);
    acquire_prepared(descs_ + 2 * group_ + 1);
  }
  template <class Storage, class Maps>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(Storage&, Maps const&) {}
  template <class Maps>
  CUTLASS_DEVICE void tensormaps_fence_acquire(Maps const&) {}

  // CUTLASS's load through the ragged descriptors (load_ragged), or through the group's prepared descriptors.
  template <class TensorA, class TensorB, class MapA, class MapB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, typename Base::MainloopPipeline pipeline,
                           typename Base::PipelineState state, cute::tuple<TensorA, TensorB> const& inputs,
                           cute::tuple<MapA, MapB> const&, BlockCoord const& blk, KTileIterator k_iter, int k_count,
                           int thread_idx, uint32_t rank, typename Base::TensorStorage& smem) {
    if (ragged_a_.desc != nullptr)
      return load_ragged(params, pipeline, state, inputs, blk, k_iter, k_count, rank, smem);
    Base::load(params, pipeline, state, inputs, cute::make_tuple(descs_ + 2 * group_, descs_ + 2 * group_ + 1), blk,
               k_iter, k_count, thread_idx, rank, smem);
  }

 private:
  // CUTLASS's load (sm90_mma_array_tma_gmma_ss_warpspecialized.hpp: the same partitions, multicast masks and stage
  // order), each copy a ragged one at the group's rows.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load_ragged(Params const& params, typename Base::MainloopPipeline pipeline,
                                  typename Base::PipelineState write, cute::tuple<TensorA, TensorB> const& inputs,
                                  BlockCoord const& blk, KTileIterator k_iter, int k_count, uint32_t rank,
                                  typename Base::TensorStorage& smem) {
    using namespace cute;
    using LoadA = RaggedLoadOf<decltype(params.tma_load_a)>;
    using LoadB = RaggedLoadOf<decltype(params.tma_load_b)>;
    if (!elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(smem.smem_A.data()), typename Base::SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
    Tensor sB = make_tensor(make_smem_ptr(smem.smem_B.data()), typename Base::SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)
    constexpr uint32_t kClusterX = size<0>(ClusterShape{});
    const uint32_t bx = rank % kClusterX, by = rank / kClusterX;
    auto block_tma_a = params.tma_load_a.get_slice(by);
    auto block_tma_b = params.tma_load_b.get_slice(bx);
    const auto [m, n, k, l] = blk;
    Tensor tAgA = block_tma_a.partition_S(get<0>(inputs)(_, _, m, _, l));  // (TMA,TMA_M,TMA_K,k)
    Tensor tAsA = block_tma_a.partition_D(sA);                             // (TMA,TMA_M,TMA_K,PIPE)
    Tensor tBgB = block_tma_b.partition_S(get<1>(inputs)(_, _, n, _, l));  // (TMA,TMA_N,TMA_K,k)
    Tensor tBsB = block_tma_b.partition_D(sB);                             // (TMA,TMA_N,TMA_K,PIPE)
    uint16_t mask_a = 0, mask_b = 0;
    auto block_layout = Layout<ClusterShape>{};  // (m,n) -> block_id
    if constexpr (LoadA::kMulticast)
      for (int j = 0; j < size<1>(block_layout); ++j) mask_a |= uint16_t(1) << block_layout(bx, j, Int<0>{});
    if constexpr (LoadB::kMulticast)
      for (int i = 0; i < size<0>(block_layout); ++i) mask_b |= uint16_t(1) << block_layout(i, by, Int<0>{});
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_count > 0; --k_count) {
      pipeline.producer_acquire(write);
      uint64_t* barrier = pipeline.producer_get_barrier(write);
      const int stage = write.index();
      copy(LoadA::make(ragged_a_, *barrier, mask_a), tAgA(_, _, _, *k_iter), tAsA(_, _, _, stage));
      if constexpr (kPairedB)
        load_paired_b(params.half, static_cast<int32_t>(n), static_cast<int32_t>(*k_iter), *barrier, smem, stage);
      else
        copy(LoadB::make(ragged_b_, *barrier, mask_b), tBgB(_, _, _, *k_iter), tBsB(_, _, _, stage));
      ++k_iter;
      ++write;
    }
  }

  // kPairedB: B's tile n for k-block k into the stage: its gate rows, then its up rows (the stage's rows 128-255
  // start 128 rows of 128-byte swizzle atoms in: 16 KB, aligned as a TMA box needs). The two boxes carry the stage's
  // B bytes that the pipeline's barrier expects.
  CUTLASS_DEVICE void load_paired_b(int32_t half, int32_t n, int32_t k, uint64_t& barrier,
                                    typename Base::TensorStorage& smem, int stage) {
    using namespace cute;
    using TileShape = typename Base::TileShape;
    static_assert(size<1>(TileShape{}) == 2 * kPairedCols && size<0>(ClusterShape{}) == 1,
                  "a 256-row B tile, not multicast along M");
    constexpr int kRowElems = size<2>(TileShape{});  // K-major: one row of the box
    static_assert(cosize_v<typename Base::SmemLayoutB> ==
                      size<1>(TileShape{}) * kRowElems * size<2>(typename Base::SmemLayoutB{}),
                  "B's stages packed one after another");
    auto* stage_b = smem.smem_B.data() + stage * size<1>(TileShape{}) * kRowElems;
    constexpr uint64_t kHint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const RaggedCoords c(ragged_b_, k * kRowElems, (h == 0 ? 0 : half) + n * kPairedCols);
      SM90_TMA_LOAD_4D::copy(ragged_b_.desc, &barrier, kHint, stage_b + h * kPairedCols * kRowElems, c.col, c.row,
                             c.end, c.bound);
    }
  }

  const cute::TmaDescriptor* descs_ = nullptr;
  int32_t group_ = 0;
  RaggedRows ragged_a_{nullptr, 0, 0}, ragged_b_{nullptr, 0, 0};  // the current group's rows (ragged)
};

template <class A, class = void>
struct takes_prepared_descriptors : std::false_type {};
template <class A>
struct takes_prepared_descriptors<
    A, std::void_t<decltype(std::declval<A&>().epilogue.descs), decltype(std::declval<A&>().mainloop.descs)>>
    : std::true_type {};

constexpr int kDescWarps = 4;  // groups a block of the prep_*_descriptors_kernels

// One descriptor made as CUTLASS's in-kernel rewrite makes it: tma's, with the group's address, and dims and
// strides from its (rows, cols, 1) shape and stride, by one lane in shared memory; then copied out by the whole warp
// (the copy is warp-aligned) with the release fence.
template <class Element, class Tma, class Stride>
CUTLASS_DEVICE void prepare_descriptor(cute::TmaDescriptor& staged, const Tma& tma, const void* ptr, int rows, int cols,
                                       const Stride& stride, cute::TmaDescriptor* out) {
  if (threadIdx.x % 32 == 0) {
    staged = *tma.get_tma_descriptor();
    rewrite_in_shared_mem<Element>(staged, tma, ptr, rows, cols, stride);
  }
  __syncwarp();
  cute::tma_descriptor_cp_fence_release(out, staged);
  __syncwarp();
}

// This warp's group of a prep_*_descriptors_kernel (one warp a group) and its (M, N, K); false for a warp past the
// last group or a group with no work (M, N or K 0: no tiles, so no descriptor is read).
template <class GroupShape>
CUTLASS_DEVICE bool warp_group_with_work(int groups, const GroupShape* shapes, int& group, int& m, int& n, int& k) {
  group = static_cast<int>(blockIdx.x) * kDescWarps + static_cast<int>(threadIdx.x / 32);
  if (group >= groups) return false;
  const GroupShape shape_mnk = shapes[group];
  m = cute::get<0>(shape_mnk), n = cute::get<1>(shape_mnk), k = cute::get<2>(shape_mnk);
  return m != 0 && n != 0 && k != 0;
}

// descs_d[e] for each group e with work, from what the prep kernel wrote for the GEMM (its pointer, problem shape and
// stride: what CUTLASS's rewrite reads) and the epilogue's D descriptor tma_d. It serves the bf16 and the FP8 GEMMs.
template <class Element, class GroupShape, class StrideD, class TmaD>
__global__ void __launch_bounds__(32 * kDescWarps)
    prep_store_descriptors_kernel(const __grid_constant__ TmaD tma_d, int groups, const GroupShape* __restrict__ shapes,
                                  Element* const* __restrict__ ptr_d, const StrideD* __restrict__ stride_d,
                                  cute::TmaDescriptor* descs_d) {
  __shared__ cute::TmaDescriptor staged[kDescWarps];
  int group, m, n, k;
  if (!warp_group_with_work(groups, shapes, group, m, n, k)) return;  // the whole warp
  prepare_descriptor<Element>(staged[threadIdx.x / 32], tma_d, ptr_d[group], m, n, stride_d[group], descs_d + group);
}

// The same for the mainloop's A and B: descs_ab[2e], descs_ab[2e + 1] from tma_a, tma_b.
template <class Element, class GroupShape, class StrideA, class StrideB, class TmaA, class TmaB>
__global__ void __launch_bounds__(32 * kDescWarps)
    prep_load_descriptors_kernel(const __grid_constant__ TmaA tma_a, const __grid_constant__ TmaB tma_b, int groups,
                                 const GroupShape* __restrict__ shapes, Element* const* __restrict__ ptr_a,
                                 Element* const* __restrict__ ptr_b, const StrideA* __restrict__ stride_a,
                                 const StrideB* __restrict__ stride_b, cute::TmaDescriptor* descs_ab) {
  __shared__ cute::TmaDescriptor staged[kDescWarps];
  int group, m, n, k;
  if (!warp_group_with_work(groups, shapes, group, m, n, k)) return;  // the whole warp
  cute::TmaDescriptor& stage = staged[threadIdx.x / 32];
  prepare_descriptor<Element>(stage, tma_a, ptr_a[group], m, k, stride_a[group], descs_ab + 2 * group);
  prepare_descriptor<Element>(stage, tma_b, ptr_b[group], n, k, stride_b[group], descs_ab + 2 * group + 1);
}

// D's descriptors for this call of a GEMM whose epilogue is Epi (a PreparedStoreEpilogue), from the group arrays its
// prep kernel wrote (stream-ordered: after that kernel, before the GEMM). The template descriptor is CUTLASS's, made
// once per epilogue type: every address, dim and stride in it is replaced on the device (the first call's pointer
// array stands in for its address, as in CUTLASS's own).
template <class Epi, class Element, class ProblemShape, class GroupShape, class StrideD>
void prepare_store_descriptors(int groups, GroupShape* shapes, Element** ptr_d, StrideD* stride_d, void* cutlass_ws,
                               cute::TmaDescriptor* descs_d, cudaStream_t stream) {
  if (groups == 0) return;
  static const auto tma_d = [&] {
    typename Epi::Arguments args{};
    args.ptr_D = ptr_d;
    args.dD = stride_d;
    return Epi::to_underlying_arguments(ProblemShape{groups, shapes, nullptr}, args, cutlass_ws).tma_store_d;
  }();
  prep_store_descriptors_kernel<Element><<<(groups + kDescWarps - 1) / kDescWarps, 32 * kDescWarps, 0, stream>>>(
      tma_d, groups, shapes, ptr_d, stride_d, descs_d);
}

}  // namespace moe8::cuda::sm90
