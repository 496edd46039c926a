// cuda/prepared_store_sm90.cuh — the ptr-array epilogue storing D through per-group TMA descriptors made once per
// call, before the GEMM, by prep_store_descriptors_kernel (one warp a group, in the caller's workspace), for the
// forward, dgrad and weight-gradient GEMMs.
//
// CUTLASS's ptr-array epilogue keeps one D descriptor per CTA and warpgroup and rewrites it whenever the next tile
// is in another group: the consumers' first warp writes the new address and dims, copies the descriptor to global
// memory with a release fence, and the whole warpgroup waits on that before its next tile's first wgmma. With 64-128
// experts nearly every tile starts a new group. Here the epilogue only points its TMA stores at the group's
// prepared descriptor (an acquire fence when the group changes); every address, dim and stride is what CUTLASS's
// rewrite would have written, so the stores, and the results, are the same. On equal experts a fixed D descriptor
// took CUTLASS's grouped kernel to the plain kernel's time (bench/results/plain_kernels_h100.md).
// Build: included by grouped_gemm_sm90_impl.cuh only (CUTLASS headers, sm_90a).
#pragma once
#include <cstdint>

#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace moe8::cuda::sm90 {

// Base: CUTLASS's CollectiveEpilogue<Sm90PtrArrayTmaWarpSpecialized...> with a D and no C.
template <class Base>
struct PreparedStoreEpilogue : Base {
  using typename Base::TensorStorage;

  struct Arguments : Base::Arguments {
    const cute::TmaDescriptor* descs = nullptr;  // [groups], written by prep_store_descriptors_kernel
  };
  struct Params : Base::Params {
    const cute::TmaDescriptor* descs;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shape, args, workspace);
    p.descs = args.descs;
    return p;
  }

  CUTLASS_DEVICE PreparedStoreEpilogue(Params const& params, TensorStorage& shared)
      : Base(params, shared), descs_(params.descs) {}

  // The kernel's per-CTA descriptor is never rewritten (nor, with no C, loaded): nothing to update or fence.
  template <bool IsLoad, class... Ts>
  CUTLASS_DEVICE void tensormaps_perform_update(Ts&&...) {}
  template <bool IsLoad, class... Ts>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(Ts&&...) {}
  template <bool IsLoad, class... Ts>
  CUTLASS_DEVICE void tensormaps_fence_acquire(Ts&&...) {}

  // CUTLASS's store through the tile's group's descriptor (the tile coordinate's l is the group: the kernel makes
  // it from the scheduler's group index).
  template <class LoadPipeline, class LoadState, class StorePipeline, class StoreState, class ProblemShapeMNKL,
            class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout, class TiledMma, class TensorMap>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline, LoadState load_state, StorePipeline store_pipeline,
                            StoreState store_state, ProblemShapeMNKL problem_shape, TileShapeMNK tile_shape,
                            TileCoordMNKL tile_coord, cute::Tensor<AccEngine, AccLayout> accumulators,
                            TiledMma tiled_mma, int thread_idx, TensorStorage& shared, TensorMap const&,
                            int subtile_idx = -1) {
    const int group = static_cast<int>(cute::get<3>(tile_coord));
    const cute::TmaDescriptor* desc = descs_ + group;
    if (group != group_) {  // written by an earlier kernel through the generic proxy, released there
      cute::tma_descriptor_fence_acquire(desc);
      group_ = group;
    }
    return Base::store(load_pipeline, load_state, store_pipeline, store_state, problem_shape, tile_shape, tile_coord,
                       accumulators, tiled_mma, thread_idx, shared, desc, subtile_idx);
  }

 private:
  const cute::TmaDescriptor* descs_;
  int group_ = -1;
};

template <class A, class = void>
struct takes_prepared_store : std::false_type {};
template <class A>
struct takes_prepared_store<A, std::void_t<decltype(std::declval<A&>().descs)>> : std::true_type {};

constexpr int kDescWarps = 4;  // groups a block of prep_store_descriptors_kernel

// descs[e]: tma (the epilogue's D descriptor as CUTLASS made it) for group e's D, from what the prep kernel wrote for
// the GEMM (its pointer, problem shape and stride: what CUTLASS's in-kernel rewrite reads), its address and dims put
// in by one lane in shared memory as that rewrite does, then copied out by the warp with the release fence. Groups
// with no output (M or N 0) get no tiles and no descriptor.
template <class Element, class GroupShape, class StrideD, class TmaD>
__global__ void __launch_bounds__(32 * kDescWarps)
    prep_store_descriptors_kernel(const __grid_constant__ TmaD tma, int groups, const GroupShape* __restrict__ shapes,
                                  Element* const* __restrict__ ptr_d, const StrideD* __restrict__ stride_d,
                                  cute::TmaDescriptor* descs) {
  using namespace cute;
  __shared__ cute::TmaDescriptor staged[kDescWarps];
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int group = static_cast<int>(blockIdx.x) * kDescWarps + warp;
  if (group >= groups) return;  // the whole warp
  const GroupShape shape_mnk = shapes[group];
  const int m = get<0>(shape_mnk), n = get<1>(shape_mnk);
  if (m == 0 || n == 0) return;
  if (threadIdx.x % 32 == 0) {
    staged[warp] = *tma.get_tma_descriptor();
    tma_descriptor_replace_addr_in_shared_mem(staged[warp], ptr_d[group]);
    cute::array<uint32_t, 5> shape = {1, 1, 1, 1, 1};
    cute::array<uint64_t, 5> stride = {0, 0, 0, 0, 0};
    Tensor d =
        make_tensor(static_cast<const Element*>(nullptr), make_layout(make_shape(m, n, Int<1>{}), stride_d[group]));
    cute::detail::fill_tma_gmem_shape_stride(tma, d, shape, stride);
    for (uint64_t& s : stride) s = s * sizeof_bits_v<Element> / 8;  // in bytes
    tma_descriptor_replace_dims_strides_in_shared_mem(staged[warp], shape, stride);
  }
  __syncwarp();
  tma_descriptor_cp_fence_release(descs + group, staged[warp]);
}

}  // namespace moe8::cuda::sm90
