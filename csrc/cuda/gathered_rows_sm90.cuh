// cuda/gathered_rows_sm90.cuh — CUTLASS sm_90a ptr-array mainloops whose operand from the tokens is gathered into
// expert order inside the operand load: the rows of group e are x[row_to_slot[r] / k] for offsets[e] <= r <
// offsets[e + 1], so no permuted copy of x ([R, K]) is ever written.
//   GatheredRowsMainloop   A is the rows (M, K-major): the forward, a dgrad; copied by one producer warp or two
//   GatheredKRowsMainloop  B is the rows along K (N-major): the weight gradient db[e] = dc^T . rows
//
// Each is CUTLASS's TMA warp-specialised mainloop (`Base`, a CollectiveMma) with its producer's load of the
// gathered operand replaced: the 32 lanes of the producer warp copy the rows from x with cp.async into the
// stage's 128-byte swizzled layout, and each lane's copies arrive on the stage's barrier; the other operand still
// comes by TMA (multicast within a cluster where the CTAs share it). The consumers are unchanged. Rows past the
// group's end, rows of no slot (slot < 0) and columns past x's width are zero-filled. NOTES: the swizzle is a
// function of the shared-memory address bits (16-byte chunk ^= address bits 7-9), as TMA writes and wgmma reads
// it; one TMA copy per row (a 1 x 64 box) gave the same bits but ran at ~1/5 of the GEMM's speed: TMA takes about
// 60 cycles per request, 128 requests per stage. Build: included by grouped_gemm_sm90.cu only (CUTLASS headers,
// sm_90a).
#pragma once
#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/gemm.h"

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

// What both gathered mainloops share: the gather source in the arguments and params, the pipeline's expected bytes
// (only the operand that still comes by TMA: kTmaBytes), the group each tile belongs to, and its row range.
template <class Base, uint32_t kTmaBytes>
struct GatheredMainloopBase : Base {
  using typename Base::TensorMapStorage;

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
    p.tma_transaction_bytes = kTmaBytes;  // the leader expects the TMA operand's bytes; the copies arrive themselves
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

 protected:
  static constexpr uint32_t kNoRow = 0xffffffffu;  // a row offset: no token (zero-filled)

  // The current group's rows [begin, end), clamped to [0, rows].
  CUTLASS_DEVICE void group_rows(Params const& params, int32_t& begin, int32_t& end) const {
    const int g = group_ < params.groups ? group_ : params.groups - 1;
    begin = params.offsets[g];
    end = params.offsets[g + 1];
    begin = begin < 0 ? 0 : (begin > params.rows ? params.rows : begin);
    end = end < begin ? begin : (end > params.rows ? params.rows : end);
  }

  // Row r's slot (-1 past end), and a slot's element offset into x (token * kd; kNoRow for none): two steps, so
  // a slot loaded ahead is not waited for until its offset is needed.
  CUTLASS_DEVICE static int32_t row_slot(Params const& params, int64_t r, int32_t end) {
    return r < end ? params.row_to_slot[r] : -1;
  }
  CUTLASS_DEVICE static uint32_t slot_offset(Params const& params, int32_t slot) {
    const int32_t t = slot >= 0 ? slot / params.top_k : -1;
    return t >= 0 && t < params.tokens ? static_cast<uint32_t>(t) * static_cast<uint32_t>(params.kd) : kNoRow;
  }
  CUTLASS_DEVICE static uint32_t row_offset(Params const& params, int64_t r, int32_t end) {
    return slot_offset(params, row_slot(params, r, end));
  }

  // One 16-byte cp.async into the 128-byte swizzled stage at byte address dst (16-byte chunk ^= address bits
  // 7-9, as TMA writes and wgmma reads it), from src, or zeros (src-size 0, src unread).
  CUTLASS_DEVICE static void copy_chunk(uint32_t dst, const void* src, bool valid) {
    const uint32_t swizzled = dst ^ (((dst >> 7) & 7u) << 4);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(swizzled), "l"(src), "r"(valid ? 16 : 0));
  }

  // x + off elements + col, made where it is used: volatile, so the 64-bit address is not hoisted out of the k
  // loop and kept live in the producer warp's 40 registers (hoisted, they spilled).
  template <class Element>
  CUTLASS_DEVICE static const Element* row_address(const Element* x_col, uint32_t off) {
    const Element* p;
    asm volatile("mad.wide.u32 %0, %1, %2, %3;\n"
                 : "=l"(p)
                 : "r"(off), "r"(static_cast<uint32_t>(sizeof(Element))), "l"(x_col));
    return p;
  }

  int32_t group_ = 0;
};

// The bytes of one stage of the operand that still comes by TMA (Base's A or B: operand 0 or 1).
template <class Base, int kOperand>
constexpr uint32_t kTmaStageBytes =
    static_cast<uint32_t>(cute::size<kOperand>(typename Base::TileShape{})) *
    static_cast<uint32_t>(cute::size<2>(typename Base::TileShape{})) *
    static_cast<uint32_t>(sizeof(std::conditional_t<kOperand == 0, typename Base::ElementA, typename Base::ElementB>));

// The dispatch policy of a mainloop that also loads from the producer warpgroup's second warp: CUTLASS's ptr-array
// kernels then run its load_auxiliary() there (the MainloopAux warp, which the FP8 blockwise mainloop uses for its
// scales), with the same pipeline and tile order as load(). Everything else is Policy's.
template <class Policy>
struct AuxLoadPolicy : Policy {};

// A gathered: the forward's (and any GEMM's) M rows are the tokens' rows, K-major. kLoadWarps 2: the producer
// warpgroup's first warp (load) copies the tile's first half of rows and issues B, its second (load_auxiliary) the
// other half; per stage both warps meet at a named barrier after their copies' arrivals and before B is issued, so
// the stage cannot complete (B's bytes landed, no arrival pending) before the second warp's arrivals are counted
// in, and neither warp runs a stage ahead of the other.
template <class Base, int kLoadWarps = 1>
struct GatheredRowsMainloop : GatheredMainloopBase<Base, kTmaStageBytes<Base, 1>> {
  using Common = GatheredMainloopBase<Base, kTmaStageBytes<Base, 1>>;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Common::Params;
  using TileShape = typename Base::TileShape;
  using SmemLayoutA = typename Base::SmemLayoutA;
  using ElementA = typename Base::ElementA;
  using DispatchPolicy =
      std::conditional_t<kLoadWarps == 2, AuxLoadPolicy<typename Base::DispatchPolicy>, typename Base::DispatchPolicy>;
  using Common::kNoRow;

  static constexpr int kBlockM = cute::size<0>(TileShape{});
  static constexpr int kBlockK = cute::size<2>(TileShape{});
  static constexpr int kChunkElems = 16 / sizeof(ElementA);           // one cp.async: 16 bytes
  static constexpr int kChunks = kBlockK / kChunkElems;               // 16-byte chunks of a row of a stage
  static constexpr int kRowsPerLane = kBlockM / 16;                   // two lanes a row: rows lane / 2 + 16 j
  static constexpr int kRowsPerWarpLane = kRowsPerLane / kLoadWarps;  // warp w: j in [w, w + 1) * this
  static_assert(kLoadWarps == 1 || kLoadWarps == 2, "one or two loading warps");
  static_assert(kBlockM % (16 * kLoadWarps) == 0 && kChunks % 2 == 0,
                "the producer warps' lane pairs take the tile's rows");
  static_assert(kBlockK * sizeof(ElementA) == 128, "one row of a stage is one 128-byte swizzle row");
  static_assert(cute::size<1>(typename Base::DispatchPolicy::ClusterShape{}) == 1,
                "gathered rows are not multicast: no cluster along N");
  static_assert(cute::cosize_v<SmemLayoutA> == kBlockM * kBlockK * Base::DispatchPolicy::Stages,
                "the stages of A are their rows back to back");
  // NOTES: user barrier 0 (CUTLASS's reserved ones come first); the cooperative kernel and its epilogue use none.
  static constexpr uint32_t kLoadBarrier = 0;

  template <class TensorA, class TensorB, class TensorMapA, class TensorMapB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs,
                           cute::tuple<TensorMapA, TensorMapB> const& input_tensormaps, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    load_rows<0>(params, pipeline, smem_pipe_write, load_inputs, &input_tensormaps, blk_coord, k_tile_iter,
                 k_tile_count, block_rank_in_cluster, shared_tensors);
  }

  // The second loading warp (kLoadWarps 2): the tile's other half of rows, no B.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load_auxiliary(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                                     cute::tuple<TensorA, TensorB> const& load_inputs, BlockCoord const& blk_coord,
                                     KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                                     uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    static_assert(kLoadWarps == 2, "load_auxiliary runs only with a second loading warp");
    load_rows<1>(params, pipeline, smem_pipe_write, load_inputs, static_cast<const cute::tuple<int, int>*>(nullptr),
                 blk_coord, k_tile_iter, k_tile_count, block_rank_in_cluster, shared_tensors);
  }

  // The second loading warp gets no tensormap update from the kernel, only this, before each group's loads.
  template <class InputTensors, class ProblemShape_MNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const& input_tensors, Params const& params,
                                                     ProblemShape_MNKL problem_shape_mnkl, int32_t next_batch) {
    this->group_ = next_batch;
    return Base::tensors_perform_update(input_tensors, params, problem_shape_mnkl, next_batch);
  }

 private:
  // Warp kPart's rows of each stage (all of them with one loading warp); warp 0 also issues B by TMA.
  template <int kPart, class TensorA, class TensorB, class TensorMaps, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load_rows(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                                cute::tuple<TensorA, TensorB> const& load_inputs, const TensorMaps* input_tensormaps,
                                BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                                uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    using namespace cute;
    constexpr bool kIssueB = kPart == 0;
    const int lane = static_cast<int>(threadIdx.x % 32);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    int32_t begin, end;
    this->group_rows(params, begin, end);
    // This lane's rows of the tile, lane / 2 + 16 j, and their tokens (-1: none, zero-filled); the two lanes of a
    // row take alternate 16-byte chunks, so each copy instruction reads 16 whole 32-byte sectors.
    // Each row is kept as one 32-bit element offset into x (token * kd; kNoRow for none; x's elements are within
    // 32 bits, grouped_gemm_gathered_sm90_supported): the producer warp runs on 40 registers, and 64-bit source
    // addresses per row and chunk, hoisted out of the k loop, spilled (ncu: ~15 M local-memory requests at the
    // Qwen3-30B-A3B up projection's shape).
    const auto* x = static_cast<const ElementA*>(params.x);
    const int half = lane % 2;
    constexpr int kFirstRow = kPart * kRowsPerWarpLane;  // j of this warp's first row
    uint32_t row_off[kRowsPerWarpLane];
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kRowsPerWarpLane; ++j)
      row_off[j] = Common::row_offset(
          params, begin + static_cast<int64_t>(m_coord) * kBlockM + lane / 2 + 16 * (kFirstRow + j), end);

    // B by TMA; in a cluster of CTAs paired along M (they share the weight's tile) multicast, each loading its
    // slice into both, as CUTLASS's mainloop does. The rows of A are each CTA's own.
    using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
    constexpr int kClusterM = cute::size<0>(ClusterShape{});
    const int rank_m = static_cast<int>(block_rank_in_cluster % kClusterM);
    uint16_t mcast_mask_b = 0;
    if constexpr (kClusterM > 1) {
      auto block_layout = Layout<ClusterShape>{};  // (m, n) -> block id
      for (int m = 0; m < kClusterM; ++m) mcast_mask_b |= uint16_t(1) << block_layout(m, 0, Int<0>{});
    }
    Tensor gB_nkl = get<1>(load_inputs);
    auto block_tma_b = params.tma_load_b.get_slice(rank_m);
    Tensor gB = gB_nkl(_, _, n_coord, _, l_coord);  // (BLK_N,BLK_K,k)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});
    Tensor tBgB = block_tma_b.partition_S(gB);  // (TMA,TMA_N,TMA_K,k)
    Tensor tBsB = block_tma_b.partition_D(sB);  // (TMA,TMA_N,TMA_K,PIPE)
    const uint32_t smem_a = cast_smem_ptr_to_uint(shared_tensors.smem_A.data());

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      // Lane 0 of warp 0, the pipeline's leader, arrives expecting B's bytes; each lane's arrival on A's copies
      // (which counts itself in) comes before B is issued, so the stage completes only once both have landed.
      pipeline.producer_acquire(smem_pipe_write);
      __syncwarp();
      using BarrierType = typename MainloopPipeline::ProducerBarrierType;
      BarrierType* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      const int col0 = *k_tile_iter * kBlockK + half * kChunkElems;  // this lane's first chunk
      const ElementA* x_col = x + col0;
      const uint32_t stage_a = smem_a + static_cast<uint32_t>(stage * kBlockM * kBlockK * sizeof(ElementA));
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kRowsPerWarpLane; ++j) {
        const bool row = row_off[j] != kNoRow;
        const ElementA* src_row = Common::row_address(x_col, row ? row_off[j] : 0u);
        const uint32_t row_dst = stage_a + (lane / 2 + 16 * (kFirstRow + j)) * (kBlockK * sizeof(ElementA));
        CUTLASS_PRAGMA_UNROLL
        for (int pair = 0; pair < kChunks / 2; ++pair) {
          // invalid: no bytes read (src-size 0), the address left in the row, so each copy is the row's
          // register plus an immediate offset
          const bool valid = row && col0 + 2 * pair * kChunkElems < params.kd;
          Common::copy_chunk(row_dst + (2 * pair + half) * 16, src_row + 2 * pair * kChunkElems, valid);
        }
      }
      cutlass::arch::cpasync_barrier_arrive(reinterpret_cast<uint64_t const*>(barrier));
      __syncwarp();
      if constexpr (kLoadWarps == 2) cutlass::arch::NamedBarrier::arrive_and_wait(64, kLoadBarrier);
      if constexpr (kIssueB) {
        if (lane == 0)
          copy(params.tma_load_b.with(get<1>(*input_tensormaps), *barrier, mcast_mask_b), tBgB(_, _, _, *k_tile_iter),
               tBsB(_, _, _, stage));
      }
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }
};

// B gathered along K: the weight gradient's B is the tokens' rows (db[e] = dc[rows of e]^T . x[tokens of the
// rows]), N-major; its K is the group's rows. Each k step's 64 rows are looked up one step ahead (lane l: rows
// l and 32 + l of the step) and handed along the warp by shuffles; a copy instruction covers 32 / kLanesPerRow
// rows, each lane a 16-byte chunk of one, so a row's 2 * BLK_N bytes are read whole. A (dc^T) still comes by
// TMA, multicast within a cluster of CTAs paired along N (they share it). The smem layout of an N-major stage
// (CUTLASS's builder: 64 x 8 swizzle atoms along K first, then along N): the 64 columns of block nb at row k
// are the 128-byte line at nb * 64 * BLK_K * 2 + 128 k.
template <class Base>
struct GatheredKRowsMainloop : GatheredMainloopBase<Base, kTmaStageBytes<Base, 0>> {
  using Common = GatheredMainloopBase<Base, kTmaStageBytes<Base, 0>>;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Common::Params;
  using TileShape = typename Base::TileShape;
  using SmemLayoutB = typename Base::SmemLayoutB;
  using ElementB = typename Base::ElementB;
  using Common::kNoRow;

  static constexpr int kBlockN = cute::size<1>(TileShape{});
  static constexpr int kBlockK = cute::size<2>(TileShape{});
  static constexpr int kChunkElems = 16 / sizeof(ElementB);
  static constexpr int kRowChunks = kBlockN / kChunkElems;  // 16-byte chunks of one row of the tile
  static constexpr int kLanesPerRow = kRowChunks < 32 ? kRowChunks : 32;
  static constexpr int kChunksPerLane = kRowChunks / kLanesPerRow;
  static constexpr int kRowsPerCopy = 32 / kLanesPerRow;  // rows one copy instruction of the warp covers
  static constexpr uint32_t kColumnBlockBytes = 64 * kBlockK * sizeof(ElementB);
  static_assert(kBlockK == 64, "a k step's rows are two per lane");
  static_assert(kBlockN % 64 == 0 && kRowChunks % kLanesPerRow == 0 && 32 % kLanesPerRow == 0,
                "the tile's N is whole 128-byte swizzle lines");
  static_assert(64 * sizeof(ElementB) == 128, "64 columns make one 128-byte swizzle line");
  static_assert(cute::size<0>(typename Base::DispatchPolicy::ClusterShape{}) == 1,
                "gathered rows are not multicast: no cluster along M");
  static_assert(cute::cosize_v<SmemLayoutB> == kBlockN * kBlockK * Base::DispatchPolicy::Stages,
                "the stages of B are back to back");
  static_assert(cutlass::gemm::detail::is_major<0, typename Base::StrideB>(), "B is N-major (the rows of x)");

  template <class TensorA, class TensorB, class TensorMapA, class TensorMapB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs,
                           cute::tuple<TensorMapA, TensorMapB> const& input_tensormaps, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    using namespace cute;
    const int lane = static_cast<int>(threadIdx.x % 32);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    int32_t begin, end;
    this->group_rows(params, begin, end);

    // A by TMA, multicast to the CTAs of the cluster (paired along N: they share dc's tile), as CUTLASS does.
    using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
    constexpr int kClusterN = cute::size<1>(ClusterShape{});
    const int rank_n = static_cast<int>(block_rank_in_cluster);  // the cluster is 1 x kClusterN
    uint16_t mcast_mask_a = 0;
    if constexpr (kClusterN > 1) {
      auto block_layout = Layout<ClusterShape>{};  // (m, n) -> block id
      for (int n = 0; n < kClusterN; ++n) mcast_mask_a |= uint16_t(1) << block_layout(0, n, Int<0>{});
    }
    Tensor gA_mkl = get<0>(load_inputs);
    auto block_tma_a = params.tma_load_a.get_slice(rank_n);
    Tensor gA = gA_mkl(_, _, m_coord, _, l_coord);  // (BLK_M,BLK_K,k)
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), typename Base::SmemLayoutA{});
    Tensor tAgA = block_tma_a.partition_S(gA);  // (TMA,TMA_M,TMA_K,k)
    Tensor tAsA = block_tma_a.partition_D(sA);  // (TMA,TMA_M,TMA_K,PIPE)
    const uint32_t smem_b = cast_smem_ptr_to_uint(shared_tensors.smem_B.data());

    // This lane's columns of a row: chunks lane % kLanesPerRow + kLanesPerRow i; its row of a copy: lane /
    // kLanesPerRow.
    const auto* x = static_cast<const ElementB*>(params.x);
    const int col_chunk = lane % kLanesPerRow, row_in_copy = lane / kLanesPerRow;
    const int64_t col0 = static_cast<int64_t>(n_coord) * kBlockN + col_chunk * kChunkElems;
    const ElementB* x_col = x + col0;
    // The first k step's slots, then each step's next ones loaded while its copies go out (ncu: with the token
    // made from the slot as soon as it was loaded, the producer waited on each load and the GEMM ran at ~1/2 speed).
    int64_t r0 = begin + static_cast<int64_t>(*k_tile_iter) * kBlockK;
    int32_t slot_lo = Common::row_slot(params, r0 + lane, end), slot_hi = Common::row_slot(params, r0 + 32 + lane, end);

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      const uint32_t lo = Common::slot_offset(params, slot_lo), hi = Common::slot_offset(params, slot_hi);
      r0 += kBlockK;
      slot_lo = Common::row_slot(params, r0 + lane, end);  // past the group's end: -1, nothing loaded
      slot_hi = Common::row_slot(params, r0 + 32 + lane, end);
      pipeline.producer_acquire(smem_pipe_write);
      __syncwarp();
      using BarrierType = typename MainloopPipeline::ProducerBarrierType;
      BarrierType* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      const uint32_t stage_b = smem_b + static_cast<uint32_t>(stage * kBlockN * kBlockK * sizeof(ElementB));
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kBlockK; j += kRowsPerCopy) {
        const int k = j + row_in_copy;  // this lane's row of the step; k < 32 for all lanes or none
        const uint32_t off = __shfl_sync(0xffffffffu, j < 32 ? lo : hi, k % 32);
        const bool row = off != kNoRow;
        const ElementB* src_row = Common::row_address(x_col, row ? off : 0u);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kChunksPerLane; ++i) {
          const int n = (col_chunk + kLanesPerRow * i) * kChunkElems;  // the chunk's first column in the tile
          const bool valid = row && col0 + kLanesPerRow * i * kChunkElems < params.kd;
          const uint32_t dst = stage_b + (n / 64) * kColumnBlockBytes + k * 128 + (n % 64) * sizeof(ElementB);
          Common::copy_chunk(dst, src_row + kLanesPerRow * i * kChunkElems, valid);
        }
      }
      cutlass::arch::cpasync_barrier_arrive(reinterpret_cast<uint64_t const*>(barrier));
      __syncwarp();
      if (lane == 0)
        copy(params.tma_load_a.with(get<0>(input_tensormaps), *barrier, mcast_mask_a), tAgA(_, _, _, *k_tile_iter),
             tAsA(_, _, _, stage));
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }
};

}  // namespace moe8::cuda::sm90

// CUTLASS's kernels run load_auxiliary() in the MainloopAux warp for the policies this trait names.
namespace cutlass::gemm::kernel::detail {
template <class Policy>
struct HasAuxiliaryLoad<moe8::cuda::sm90::AuxLoadPolicy<Policy>> : cute::true_type {};
}  // namespace cutlass::gemm::kernel::detail
