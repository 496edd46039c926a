// cuda/gathered_rows_sm90.cuh — a CUTLASS sm_90a ptr-array mainloop whose A operand is the tokens' rows
// gathered into expert order inside the operand load: the rows of group e are x[row_to_slot[r] / k] for
// offsets[e] <= r < offsets[e + 1], so no permuted copy of x ([R, K]) is ever written.
//
// The mainloop is CUTLASS's TMA warp-specialised one (`Base`, a CollectiveMma) with its producer's load of A
// replaced: every row of an A tile is one 2D TMA copy of a (1 x BLK_K) box of x, issued by the 32 lanes of
// the producer warp into the row's place in the stage, onto the stage's barrier (the bytes sum to the
// tile's, so the pipeline and the consumers are unchanged). Rows past the group's end and rows of no slot
// (slot < 0) copy row T of x, which is out of bounds: TMA fills them with zeros.
// NOTES: TMA applies the 128-byte swizzle from the shared-memory address bits, so a one-row box written at
// row i of a 1024-byte aligned tile lands where the full tile's box puts that row.
// Build: included by grouped_gemm_sm90.cu only (CUTLASS headers, sm_90a).
#pragma once
#include <cuda.h>

#include <cstdint>

#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cuda_host_adapter.hpp"
#include "cutlass/cutlass.h"

namespace moe8::cuda::sm90 {

// Where the gathered rows come from: x [tokens, kd] row-major, the plan's row_to_slot [rows] (slot = token *
// top_k + j, or < 0) and the groups' offsets [groups + 1].
struct GatherSource {
  const void* x = nullptr;
  int64_t tokens = 0, kd = 0;
  const int32_t* row_to_slot = nullptr;
  const int32_t* offsets = nullptr;
  int64_t rows = 0;
  int top_k = 1;
};

// The TMA descriptor of x for one-row boxes of `box_k` elements, 128-byte swizzled (bf16 / f16: box_k = 64).
inline cute::TmaDescriptor gathered_rows_tensormap(const GatherSource& src, int box_k, CUtensorMapDataType dtype,
                                                   int elem_bytes) {
  cute::TmaDescriptor desc{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(src.kd), static_cast<cuuint64_t>(src.tokens)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(src.kd * elem_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_k), 1};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
      &desc, dtype, 2, const_cast<void*>(src.x), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) desc = cute::TmaDescriptor{};  // the caller checks gathered_rows_tensormap_ok
  return desc;
}

template <class Base>
struct GatheredRowsMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorMapStorage;
  using typename Base::TensorStorage;
  using TileShape = typename Base::TileShape;
  using SmemLayoutA = typename Base::SmemLayoutA;
  using ElementA = typename Base::ElementA;

  static constexpr int kBlockM = cute::size<0>(TileShape{});
  static constexpr int kBlockK = cute::size<2>(TileShape{});
  static constexpr int kRowsPerLane = kBlockM / 32;
  static_assert(kBlockM % 32 == 0, "the producer warp's lanes take the tile's rows in turn");
  static_assert(kBlockK * sizeof(ElementA) == 128, "one row of a stage is one 128-byte swizzle row");
  static_assert(cute::size<1>(typename Base::DispatchPolicy::ClusterShape{}) == 1,
                "gathered rows are not multicast: no cluster along N");
  static_assert(cute::cosize_v<SmemLayoutA> == kBlockM * kBlockK * Base::DispatchPolicy::Stages,
                "the stages of A are their rows back to back");

  struct Arguments : Base::Arguments {
    GatherSource src;
  };

  struct Params : Base::Params {
    cute::TmaDescriptor x_map;
    const int32_t* row_to_slot;
    const int32_t* offsets;
    int32_t tokens, rows, top_k, groups;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shapes, args, workspace);
    constexpr CUtensorMapDataType dtype =
        std::is_same_v<ElementA, cutlass::half_t> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    p.x_map = gathered_rows_tensormap(args.src, kBlockK, dtype, sizeof(ElementA));
    p.row_to_slot = args.src.row_to_slot;
    p.offsets = args.src.offsets;
    p.tokens = static_cast<int32_t>(args.src.tokens);
    p.rows = static_cast<int32_t>(args.src.rows);
    p.top_k = args.src.top_k;
    p.groups = problem_shapes.groups();
    return p;
  }

  // The kernel hands load() no group index (its block coordinate's l is 0 for grouped GEMMs); it updates the
  // tensormaps before each group's loads, which records the group.
  template <class TensorMapA, class TensorMapB, class ProblemShape_MNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage& shared_tensormaps, Params const& params,
                                                cute::tuple<TensorMapA, TensorMapB> const& input_tensormaps,
                                                ProblemShape_MNKL problem_shape_mnkl, int32_t next_batch) {
    group_ = next_batch;
    Base::tensormaps_perform_update(shared_tensormaps, params, input_tensormaps, problem_shape_mnkl, next_batch);
  }

  template <class TensorA, class TensorB, class TensorMapA, class TensorMapB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs,
                           cute::tuple<TensorMapA, TensorMapB> const& input_tensormaps, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    using namespace cute;
    const int lane = static_cast<int>(threadIdx.x % 32);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;

    // This lane's rows of the tile: the tokens they are read from (row `tokens` is out of bounds: zeros).
    const int g = group_ < params.groups ? group_ : params.groups - 1;
    int32_t begin = params.offsets[g], end = params.offsets[g + 1];
    begin = begin < 0 ? 0 : (begin > params.rows ? params.rows : begin);
    end = end < begin ? begin : (end > params.rows ? params.rows : end);
    int32_t token[kRowsPerLane];
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kRowsPerLane; ++j) {
      const int64_t r = begin + static_cast<int64_t>(m_coord) * kBlockM + lane + 32 * j;
      const int32_t slot = r < end ? params.row_to_slot[r] : -1;
      const int32_t t = slot >= 0 ? slot / params.top_k : params.tokens;
      token[j] = t < params.tokens ? t : params.tokens;
    }

    Tensor gB_nkl = get<1>(load_inputs);
    auto block_tma_b = params.tma_load_b.get_slice(0);
    Tensor gB = gB_nkl(_, _, n_coord, _, l_coord);  // (BLK_N,BLK_K,k)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});
    Tensor tBgB = block_tma_b.partition_S(gB);  // (TMA,TMA_N,TMA_K,k)
    Tensor tBsB = block_tma_b.partition_D(sB);  // (TMA,TMA_N,TMA_K,PIPE)
    auto* smem_a = reinterpret_cast<ElementA*>(shared_tensors.smem_A.data());
    constexpr uint64_t kHint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);  // every lane waits; lane 0 (the leader) expects the bytes
      __syncwarp();
      using BarrierType = typename MainloopPipeline::ProducerBarrierType;
      BarrierType* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      const int32_t k0 = static_cast<int32_t>(*k_tile_iter) * kBlockK;
      ElementA* stage_a = smem_a + static_cast<int64_t>(stage) * kBlockM * kBlockK;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kRowsPerLane; ++j)
        SM90_TMA_LOAD_2D::copy(&params.x_map, reinterpret_cast<uint64_t*>(barrier), kHint,
                               stage_a + (lane + 32 * j) * kBlockK, k0, token[j]);
      if (lane == 0)
        copy(params.tma_load_b.with(get<1>(input_tensormaps), *barrier, uint16_t(0)), tBgB(_, _, _, *k_tile_iter),
             tBsB(_, _, _, stage));
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

 private:
  int32_t group_ = 0;
};

}  // namespace moe8::cuda::sm90
