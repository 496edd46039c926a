// cuda/gathered_rows_sm90.cuh — a CUTLASS sm_90a ptr-array mainloop whose A operand is the tokens' rows
// gathered into expert order inside the operand load: the rows of group e are x[row_to_slot[r] / k] for
// offsets[e] <= r < offsets[e + 1], so no permuted copy of x ([R, K]) is ever written.
//
// The mainloop is CUTLASS's TMA warp-specialised one (`Base`, a CollectiveMma) with its producer's load of A
// replaced: the 32 lanes of the producer warp copy the tile's rows from x with cp.async, a pair of lanes a row
// (alternate 16-byte chunks: whole 32-byte sectors per copy instruction), into the stage's 128-byte swizzled
// layout, the rows' tokens looked up once per tile, and each lane's copies arrive on the stage's barrier; B
// still comes by TMA. The consumers are unchanged. Rows
// past the group's end, rows of no slot (slot < 0) and columns past K are zero-filled. NOTES: the swizzle is a function
// of the shared-memory address bits (16-byte chunk ^= address bits 7-9), as TMA writes and wgmma reads it; one TMA copy
// per row (a 1 x 64 box) gave the same bits but ran at ~1/5 of the GEMM's speed: TMA takes about 60 cycles per request,
// 128 requests per stage. Build: included by grouped_gemm_sm90.cu only (CUTLASS headers, sm_90a).
#pragma once
#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
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
  static constexpr int kChunkElems = 16 / sizeof(ElementA);  // one cp.async: 16 bytes
  static constexpr int kChunks = kBlockK / kChunkElems;      // 16-byte chunks of a row of a stage
  static constexpr int kRowsPerLane = kBlockM / 16;          // two lanes a row: rows lane / 2 + 16 j
  static constexpr uint32_t kNoRow = 0xffffffffu;            // a row offset: no token (zero-filled)
  static_assert(kBlockM % 16 == 0 && kChunks % 2 == 0, "the producer warp's lane pairs take the tile's rows");
  static_assert(kBlockK * sizeof(ElementA) == 128, "one row of a stage is one 128-byte swizzle row");
  static_assert(cute::size<1>(typename Base::DispatchPolicy::ClusterShape{}) == 1,
                "gathered rows are not multicast: no cluster along N");
  static_assert(cute::cosize_v<SmemLayoutA> == kBlockM * kBlockK * Base::DispatchPolicy::Stages,
                "the stages of A are their rows back to back");

  static constexpr uint32_t kTmaBytesB =
      cute::size<1>(TileShape{}) * kBlockK * static_cast<uint32_t>(sizeof(typename Base::ElementB));

  struct Arguments : Base::Arguments {
    GatherSource src;
  };

  struct Params : Base::Params {
    const void* x;
    const int32_t* row_to_slot;
    const int32_t* offsets;
    int64_t kd;
    int32_t tokens, rows, top_k, groups;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shapes, args, workspace);
    p.tma_transaction_bytes = kTmaBytesB;  // the pipeline's leader expects B's bytes; A's copies arrive themselves
    p.x = args.src.x;
    p.kd = args.src.kd;
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
    const int g = group_ < params.groups ? group_ : params.groups - 1;
    int32_t begin = params.offsets[g], end = params.offsets[g + 1];
    begin = begin < 0 ? 0 : (begin > params.rows ? params.rows : begin);
    end = end < begin ? begin : (end > params.rows ? params.rows : end);
    // This lane's rows of the tile, lane / 2 + 16 j, and their tokens (-1: none, zero-filled); the two lanes of a
    // row take alternate 16-byte chunks, so each copy instruction reads 16 whole 32-byte sectors.
    // Each row is kept as one 32-bit element offset into x (token * kd; kNoRow for none; x's elements are within
    // 32 bits, grouped_gemm_gathered_sm90_supported): the producer warp runs on 40 registers, and 64-bit source
    // addresses per row and chunk, hoisted out of the k loop, spilled (ncu: ~15 M local-memory requests at the
    // Qwen3-30B-A3B up projection's shape).
    const auto* x = static_cast<const ElementA*>(params.x);
    const int half = lane % 2;
    uint32_t row_off[kRowsPerLane];
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kRowsPerLane; ++j) {
      const int64_t r = begin + static_cast<int64_t>(m_coord) * kBlockM + lane / 2 + 16 * j;
      const int32_t slot = r < end ? params.row_to_slot[r] : -1;
      const int32_t t = slot >= 0 ? slot / params.top_k : -1;
      row_off[j] = t >= 0 && t < params.tokens ? static_cast<uint32_t>(t) * static_cast<uint32_t>(params.kd) : kNoRow;
    }

    Tensor gB_nkl = get<1>(load_inputs);
    auto block_tma_b = params.tma_load_b.get_slice(0);
    Tensor gB = gB_nkl(_, _, n_coord, _, l_coord);  // (BLK_N,BLK_K,k)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});
    Tensor tBgB = block_tma_b.partition_S(gB);  // (TMA,TMA_N,TMA_K,k)
    Tensor tBsB = block_tma_b.partition_D(sB);  // (TMA,TMA_N,TMA_K,PIPE)
    const uint32_t smem_a = cast_smem_ptr_to_uint(shared_tensors.smem_A.data());

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      // Lane 0, the pipeline's leader, arrives expecting B's bytes; each lane's arrival on A's copies (which
      // counts itself in) comes before B is issued, so the stage completes only once both have landed.
      pipeline.producer_acquire(smem_pipe_write);
      __syncwarp();
      using BarrierType = typename MainloopPipeline::ProducerBarrierType;
      BarrierType* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      const int col0 = *k_tile_iter * kBlockK + half * kChunkElems;  // this lane's first chunk
      const ElementA* x_col = x + col0;
      const uint32_t stage_a = smem_a + static_cast<uint32_t>(stage * kBlockM * kBlockK * sizeof(ElementA));
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kRowsPerLane; ++j) {
        const bool row = row_off[j] != kNoRow;
        // The row's source, x_col + row_off (bytes: mad.wide), made here in each k step: volatile, so the 64-bit
        // address is not hoisted and kept live across the loop.
        const ElementA* src_row;
        asm volatile("mad.wide.u32 %0, %1, %2, %3;\n"
                     : "=l"(src_row)
                     : "r"(row ? row_off[j] : 0u), "r"(static_cast<uint32_t>(sizeof(ElementA))), "l"(x_col));
        const uint32_t row_dst = stage_a + (lane / 2 + 16 * j) * (kBlockK * sizeof(ElementA));
        CUTLASS_PRAGMA_UNROLL
        for (int pair = 0; pair < kChunks / 2; ++pair) {
          const int c = 2 * pair + half;
          // invalid: no bytes read (src-size 0), the address left in the row, so each copy is the row's
          // register plus an immediate offset
          const bool valid = row && col0 + 2 * pair * kChunkElems < params.kd;
          const ElementA* src = src_row + 2 * pair * kChunkElems;
          // the 128-byte swizzle, from the shared-memory address bits as TMA and wgmma read it
          const uint32_t dst = row_dst + c * 16;
          const uint32_t swizzled = dst ^ (((dst >> 7) & 7u) << 4);
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(swizzled), "l"(src),
                       "r"(valid ? 16 : 0));
        }
      }
      cutlass::arch::cpasync_barrier_arrive(reinterpret_cast<uint64_t const*>(barrier));
      __syncwarp();
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
