// cuda/l2_prefetch_sm90.cuh — CUTLASS's sm_90a ptr-array TMA mainloop whose producer also asks L2 for each operand
// box a few k steps before it loads it into a stage.
//
// Why: at fine-grained widths the consumer warps of the 128x256 tile wait for a stage's TMA data about as often as
// for their own wgmma (ncu warp-stall sampling, bench/results/epilogue_tiles_h100.md). With four stages the producer
// runs three k steps ahead; at 128 experts every weight byte is read from HBM once per GEMM, and the clusters of a
// group request the same cold lines together. A prefetch (cp.async.bulk.prefetch.tensor, L2 only, no shared memory,
// no barrier) kAhead steps before the load lets that HBM latency pass while earlier stages compute.
//
// Everything but load() is Base's (the consumers, the pipeline, the tensormap updates); load() is CUTLASS's loop with
// the prefetches added. A prefetch only warms L2: the bits are the plain mainloop's. Build: included by
// grouped_gemm_sm90_impl.cuh only (CUTLASS headers, sm_90a).
#pragma once
#include <cstdint>

#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace moe8::cuda::sm90 {

// The L2 prefetch of the TMA box whose first coordinate src's data holds (a slice of a TMA-partitioned coordinate
// tensor), through the tensormap at desc.
template <class Src>
CUTLASS_DEVICE void prefetch_box(void const* desc, Src const& src) {
  auto coord = src.data().coord_;
  cute::detail::explode_tuple(cute::detail::CallCOPY<cute::SM90_TMA_LOAD::PREFETCH>{}, cute::make_tuple(desc),
                              cute::tuple_seq<cute::tuple<void const*>>{}, coord, cute::tuple_seq<decltype(coord)>{});
}

template <class Base, int kAhead>
struct L2PrefetchMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  static_assert(kAhead > 0, "prefetch at least one k step ahead");

  template <class TensorA, class TensorB, class TensorMapA, class TensorMapB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs,
                           cute::tuple<TensorMapA, TensorMapB> const& input_tensormaps, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    using namespace cute;
    if (!cute::elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), typename Base::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});
    using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
    constexpr uint32_t kClusterX = size<0>(ClusterShape{});
    const uint2 cluster_id = {block_rank_in_cluster % kClusterX, block_rank_in_cluster / kClusterX};
    auto block_tma_a = params.tma_load_a.get_slice(cluster_id.y);
    auto block_tma_b = params.tma_load_b.get_slice(cluster_id.x);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor tAgA = block_tma_a.partition_S(get<0>(load_inputs)(_, _, m_coord, _, l_coord));  // (TMA,TMA_M,TMA_K,k)
    Tensor tAsA = block_tma_a.partition_D(sA);                                              // (TMA,TMA_M,TMA_K,PIPE)
    Tensor tBgB = block_tma_b.partition_S(get<1>(load_inputs)(_, _, n_coord, _, l_coord));  // (TMA,TMA_N,TMA_K,k)
    Tensor tBsB = block_tma_b.partition_D(sB);                                              // (TMA,TMA_N,TMA_K,PIPE)
    static_assert(size<1>(decltype(tAgA){}) == 1 && size<2>(decltype(tAgA){}) == 1 && size<1>(decltype(tBgB){}) == 1 &&
                      size<2>(decltype(tBgB){}) == 1,
                  "one TMA box per operand and stage (what prefetch_box covers)");

    // Multicast masks as CUTLASS's mainloop makes them: A to the CTAs of this row of the cluster, B of this column.
    uint16_t mcast_mask_a = 0, mcast_mask_b = 0;
    auto block_layout = Layout<ClusterShape>{};  // (m, n) -> block id
    if constexpr (cute::is_same_v<typename Base::GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
      for (int n = 0; n < size<1>(block_layout); ++n)
        mcast_mask_a |= uint16_t(1) << block_layout(cluster_id.x, n, _0{});
    }
    if constexpr (cute::is_same_v<typename Base::GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      for (int m = 0; m < size<0>(block_layout); ++m)
        mcast_mask_b |= uint16_t(1) << block_layout(m, cluster_id.y, _0{});
    }
    void const* desc_a = get<0>(input_tensormaps);
    void const* desc_b = get<1>(input_tensormaps);

    // The tile's first kAhead steps: asked for before any load of it (the loads below wait for free stages).
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kAhead; ++j) {
      if (j < k_tile_count) {
        prefetch_box(desc_a, tAgA(_, _, _, *k_tile_iter + j));
        prefetch_box(desc_b, tBgB(_, _, _, *k_tile_iter + j));
      }
    }
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      using BarrierType = typename MainloopPipeline::ProducerBarrierType;
      BarrierType* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      copy(params.tma_load_a.with(get<0>(input_tensormaps), *barrier, mcast_mask_a), tAgA(_, _, _, *k_tile_iter),
           tAsA(_, _, _, stage));
      copy(params.tma_load_b.with(get<1>(input_tensormaps), *barrier, mcast_mask_b), tBgB(_, _, _, *k_tile_iter),
           tBsB(_, _, _, stage));
      if (k_tile_count > kAhead) {
        prefetch_box(desc_a, tAgA(_, _, _, *k_tile_iter + kAhead));
        prefetch_box(desc_b, tBgB(_, _, _, *k_tile_iter + kAhead));
      }
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }
};

}  // namespace moe8::cuda::sm90
