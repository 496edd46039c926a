// cuda/blockwise_promotion_sm90.cuh — the consumer of CUTLASS's sm_90a FP8 blockwise-scaled ptr-array mainloop
// with the promotion of each K tile overlapped with the tensor cores' work on the next.
//
// FP8 blockwise scaling accumulates each K tile (one 128-wide scale block) by wgmma into a fresh fp32 register tile
// and then adds it, times the tile's scales, to the running sum ("promotion"). CUTLASS's consumer
// (KernelPtrArrayTmaWarpSpecialized*FP8BlockScaledAccum) waits for each tile's wgmma to finish before promoting
// it and issues the next tile's wgmma only after the promotion, so the tensor cores idle while the warpgroup runs
// the promotion's FFMAs: per 64x128 warpgroup tile and K tile, 64 FFMAs per thread against ~512 clocks of wgmma
// (FP8, m64n128k32 x 4), up to a quarter of the mainloop when the two warpgroups promote at the same time.
//
// OverlappedPromotionMainloop keeps two temporary tiles and runs one K tile ahead: it issues the wgmma of tile
// i + 1 into one, waits for tile i's (wgmma.wait_group 1), promotes tile i from the other and only then releases
// its stage. The arithmetic is the base's, in the base's order (accum += temp * scale, the scales combined as the
// base combines them), so results are the base kernel's bits; the cost is a second temporary tile (64 more fp32
// registers per thread of the 232 the consumers get). The producer, the pipeline and the epilogue are the base's.
// Only promotion every K tile (ScaleGranularityK equal to the tile's K) is implemented, which is moe8's recipe.
// Build: included by grouped_gemm_fp8_sm90.cu only (CUTLASS headers, sm_90a).
#pragma once
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/gemm.h"

namespace moe8::cuda::sm90_fp8 {

template <class Base>
struct OverlappedPromotionMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using TileShape = typename Base::TileShape;
  using TiledMma = typename Base::TiledMma;
  using SmemLayoutA = typename Base::SmemLayoutA;
  using SmemLayoutB = typename Base::SmemLayoutB;
  using SmemLayoutSFA = typename Base::SmemLayoutSFA;
  using SmemLayoutSFB = typename Base::SmemLayoutSFB;
  using ElementBlockScale = typename Base::ElementBlockScale;
  static constexpr int kScaleMs = Base::ScaleMsPerTile;
  static constexpr int kScaleNs = Base::ScaleNsPerTile;
  static_assert(Base::ScaleGranularityK == cute::size<2>(TileShape{}),
                "one scale block per K tile: every K tile is promoted");

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum, int k_tile_count,
                          int thread_idx, TensorStorage& shared_tensors, Params const& /*mainloop_params*/) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "the accumulators are registers");

    // The stages' operands and scales, as the base views them.
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)
    Tensor sSFA =
        make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()),
                    make_layout(make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                                           make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
                                make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                                            make_stride(stride<1>(SmemLayoutSFA{}), stride<2>(SmemLayoutSFA{})))));
    Tensor sSFB =
        make_tensor(make_smem_ptr(shared_tensors.smem_SFB.data()),
                    make_layout(make_shape(get<0>(TileShape{}), shape<0>(SmemLayoutSFB{}),
                                           make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
                                make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                                            make_stride(stride<1>(SmemLayoutSFB{}), stride<2>(SmemLayoutSFB{})))));

    constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    Layout warp_group_thread_layout = make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    const int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));
    Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);     // (MMA,MMA_M,MMA_N,(MMA_K,PIPE))
    Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);     // (MMA,MMA_M,MMA_N,(MMA_K,PIPE))
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA,MMA_M,MMA_K,PIPE)
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA,MMA_N,MMA_K,PIPE)
    CUTE_STATIC_ASSERT_V(size<1>(tCrA) == size<1>(accum));
    CUTE_STATIC_ASSERT_V(size<1>(tCrB) == size<2>(accum));

    // This thread's scales of a stage (stride-0 modes kept: one register per distinct scale).
    Tensor tCrSFA = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));  // (MMA,MMA_M,MMA_N)
    Tensor tCrSFB = make_tensor_like<ElementBlockScale>(tCsSFB(_, _, _, _0{}));  // (MMA,MMA_M,MMA_N)
    Tensor temp0 = make_fragment_like(accum);
    Tensor temp1 = make_fragment_like(accum);

    // The wgmma of the stage `stage` into `temp` (overwritten: the first k block does not accumulate).
    auto issue = [&](auto& temp, int stage) {
      tiled_mma.accumulate_ = cute::GMMA::ScaleOut::Zero;
      cute::warpgroup_fence_operand(temp);
      cute::warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
        cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), temp);
        tiled_mma.accumulate_ = cute::GMMA::ScaleOut::One;
      }
      cute::warpgroup_commit_batch();
      cute::warpgroup_fence_operand(temp);
    };
    // accum += temp * the stage's scales, combined in the base's order; temp's wgmma has completed.
    auto promote = [&](auto& temp, int stage) {
      cute::warpgroup_fence_operand(temp);
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), tCrSFA);
      copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), tCrSFB);
      if constexpr (kScaleMs == 1 && kScaleNs == 1) {
        const ElementBlockScale scale_ab = tCrSFA(_0{}) * tCrSFB(_0{});
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += temp(i) * scale_ab;
      } else if constexpr (kScaleMs > 1 && kScaleNs == 1) {
        const ElementBlockScale scale_b = tCrSFB(_0{});
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(filter_zeros(tCrSFA)); ++i)
          filter_zeros(tCrSFA)(i) = filter_zeros(tCrSFA)(i) * scale_b;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += temp(i) * tCrSFA(i);
      } else if constexpr (kScaleMs == 1 && kScaleNs > 1) {
        const ElementBlockScale scale_a = tCrSFA(_0{});
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(filter_zeros(tCrSFB)); ++i)
          filter_zeros(tCrSFB)(i) = filter_zeros(tCrSFB)(i) * scale_a;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += temp(i) * tCrSFB(i);
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += temp(i) * tCrSFA(i) * tCrSFB(i);
      }
      cute::warpgroup_fence_operand(accum);
    };

    clear(accum);
    cute::warpgroup_fence_operand(accum);
    if (k_tile_count <= 0) return;

    // Stage i is released once tile i is promoted, except the last, which mma_tail releases.
    PipelineState smem_pipe_release = smem_pipe_read;
    pipeline.consumer_wait(smem_pipe_read);
    issue(temp0, smem_pipe_read.index());
    ++smem_pipe_read;
    int remaining = k_tile_count - 1;  // tiles not yet issued; temp0 holds the one in flight
    // NOTES: two tiles per trip, so which temporary holds which tile is known at compile time (registers are not
    // indexable).
    CUTLASS_PRAGMA_NO_UNROLL
    for (; remaining >= 2; remaining -= 2) {
      pipeline.consumer_wait(smem_pipe_read);
      issue(temp1, smem_pipe_read.index());
      ++smem_pipe_read;
      cute::warpgroup_wait<1>();
      promote(temp0, smem_pipe_release.index());
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;

      pipeline.consumer_wait(smem_pipe_read);
      issue(temp0, smem_pipe_read.index());
      ++smem_pipe_read;
      cute::warpgroup_wait<1>();
      promote(temp1, smem_pipe_release.index());
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;
    }
    if (remaining == 1) {
      pipeline.consumer_wait(smem_pipe_read);
      issue(temp1, smem_pipe_read.index());
      cute::warpgroup_wait<1>();
      promote(temp0, smem_pipe_release.index());
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;
      cute::warpgroup_wait<0>();
      promote(temp1, smem_pipe_release.index());
    } else {
      cute::warpgroup_wait<0>();
      promote(temp0, smem_pipe_release.index());
    }
  }
};

}  // namespace moe8::cuda::sm90_fp8
