// act_backward_epilogue_sm90.cuh — an epilogue visitor for the sm_90a grouped GEMMs (grouped_gemm_sm90_impl.cuh)
// that runs the routed SwiGLU backward on the down projection's input gradient while it is in registers, instead
// of writing it to [R, I] and reading it back (activation.cu's activation_backward_routed_kernel). SwiGLU with h
// as [gate | up] only (grouped_gemm_act_backward_sm90_supported): the other activations take the two calls.
//
// For the element (m, j) of group e's output, row r = offsets[e] + m:
//   g  = bf16(acc)                               the bits the plain dgrad stores
//   w  = weights[row_to_slot[r]]                 0 for padding rows (row_to_slot < 0 or out of range)
//   a  = silu(h[r, j]) * h[r, I + j], with d h[r, j], d h[r, I + j] from w * g    written to dh (which may be h)
//   D  = w * a                                   what the down projection's weight gradient reads
//   partials[r, 128 columns of N] = sum of a * g over them   (the routing weight's gradient)
// The formulas are activation.cuh's, in the separate kernel's order, so dh and D are the same bits as the plain
// dgrad followed by that kernel. The routing weights' gradient is the same sum in a different order: a thread
// holds rows lane / 4 and lane / 4 + 8 of its warp's 16 (the wgmma accumulator layout) in each 64-row band of
// its warpgroup's tile (one band in the cooperative 128x256 tile, two in the ping-pong 128x128 one), keeps
// their sums in registers, and the four lanes of a row add theirs with two shuffles when the tile ends; a
// second kernel adds a row's parts in order (deterministic). A 256-wide tile writes its sum into the first of
// its two parts and zero into the second.
//
// The epilogue visits a tile's subtiles in a fixed, unrolled order, one visit per subtile and thread. Each visit
// issues the loads of the next subtile's gate and up (32-bit pairs) before it computes its own, so their latency
// overlaps a subtile's work instead of stalling every store. The code is one activation, without the generic
// kinds' switches: the epilogue is unrolled over the subtiles, and a generic body there made the kernel ~20x the
// plain GEMM's code (docs/kernels.md).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <utility>

#include "core/params.h"
#include "cuda/activation.cuh"
#include "cuda/common.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"  // the sm90 epilogue visitors, in their order

namespace moe8::cuda::sm90 {

struct ActBackwardArgs {
  const __nv_bfloat16* h = nullptr;      // [R, 2I]: gate | up
  __nv_bfloat16* dh = nullptr;           // same shape; may be h (each element read, then written, by one thread)
  const float* weights = nullptr;        // [num_slots], the routing weights flattened
  const int32_t* row_to_slot = nullptr;  // [R]
  const int32_t* offsets = nullptr;      // [E + 1]
  float* partials = nullptr;             // [R, parts]
  int64_t rows = 0, num_slots = 0, I = 0;
  int parts = 0;  // ceil(I / kPartCols)
};

// Columns of N per part of the routing weights' gradient: the narrowest tile's width.
constexpr int kPartCols = 128;

// The whole fusion callback of the epilogue (a visitor taking only the accumulators).
struct Sm90RoutedSwiGLUBackward {
  using Arguments = ActBackwardArgs;
  using Params = ActBackwardArgs;
  struct SharedStorage {};

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.h != nullptr && args.dh != nullptr && args.partials != nullptr && args.parts > 0 && args.I % 2 == 0;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE Sm90RoutedSwiGLUBackward() {}
  CUTLASS_HOST_DEVICE Sm90RoutedSwiGLUBackward(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  template <class CTensor, class Residue, int TileN>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    // tCcD is (CPY, CPY_M, CPY_N, EPI_M, EPI_N): a subtile's elements of this thread, then the subtiles.
    using Shape = decltype(cute::shape(std::declval<CTensor>()));
    static constexpr int kSubtileElems = decltype(cute::size(cute::take<0, 3>(Shape{})))::value;
    static constexpr int kEpiM = decltype(cute::size<3>(Shape{}))::value;
    static constexpr int kEpiN = decltype(cute::size<4>(Shape{}))::value;
    static_assert(kSubtileElems % 2 == 0, "the accumulators come in pairs of columns");
    static constexpr int kPairs = kSubtileElems / 2;
    // The thread's rows: offsets 0 and 8 in each 64-row band of the warpgroup's rows (one or two bands).
    static_assert(kEpiM == 1 || kEpiM == 2, "subtiles of 128 rows (cooperative) or 64 rows (ping-pong)");
    static constexpr int kRows = 2 * kEpiM;
    static_assert(TileN % kPartCols == 0, "a tile covers whole parts");
    CUTLASS_DEVICE static int row_of(int s) { return 8 * (s & 1) + 64 * (s >> 1); }
    CUTLASS_DEVICE static int slot_of(int m) { return ((m >> 3) & 1) | (((m >> 6) & 1) << 1); }

    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor c, Residue res, Params const& p, int first_m, int first_n, int M,
                                          int64_t row0, int n_tile)
        : tCcD(c), residue(res), p(p), first_m(first_m), first_n(first_n), row0(row0), n_tile(n_tile) {
      CUTLASS_PRAGMA_UNROLL
      for (int s = 0; s < kRows; ++s) {
        valid[s] = first_m + row_of(s) < M;
        const int32_t given = valid[s] ? p.row_to_slot[row0 + first_m + row_of(s)] : -1;
        w_of[s] = given >= 0 && given < p.num_slots ? p.weights[given] : 0.f;
      }
    }

    CTensor tCcD;     // coordinates from the thread's first element
    Residue residue;  // the group's (M, N) less the thread's first element
    Params const& p;
    int first_m, first_n;  // the thread's first element in the group's (M, N)
    int64_t row0;          // the group's first row
    int n_tile;
    bool valid[kRows];
    float w_of[kRows];
    float dot[kRows] = {};
    uint32_t gate_next[kPairs], up_next[kPairs];  // the next subtile's h, two bf16 a register

    // Element q of a subtile's pair i: its coordinates in the group, whether it is inside, and its gate's index.
    struct Elem {
      int m, n;
      bool in;
      int64_t at;
    };
    template <class Coords>
    CUTLASS_DEVICE Elem elem(Coords const& c_mn, int i) const {
      const auto c = c_mn(i);
      const int m = static_cast<int>(cute::get<0>(c)), n = static_cast<int>(cute::get<1>(c));
      return {m, n, cute::elem_less(c, residue), (row0 + first_m + m) * 2 * p.I + first_n + n};
    }
    // The two elements of a pair side by side in one row, the first at an even column (the wgmma layout's, known
    // at compile time once the epilogue is unrolled). I is even (can_implement), so then both are inside or
    // neither, and the pair is one aligned 32-bit word.
    CUTLASS_DEVICE static bool adjacent(Elem const& e0, Elem const& e1) { return e0.m == e1.m && e1.n == e0.n + 1; }

    CUTLASS_DEVICE static uint32_t load_pair(const __nv_bfloat16* h, Elem const& e0, Elem const& e1, int64_t shift) {
      if (adjacent(e0, e1)) return e0.in ? *reinterpret_cast<const uint32_t*>(h + e0.at + shift) : 0u;
      const uint32_t lo = e0.in ? __bfloat16_as_ushort(h[e0.at + shift]) : 0u;
      const uint32_t hi = e1.in ? __bfloat16_as_ushort(h[e1.at + shift]) : 0u;
      return lo | (hi << 16);
    }
    CUTLASS_DEVICE static void store_pair(__nv_bfloat16* dh, Elem const& e0, Elem const& e1, int64_t shift, float v0,
                                          float v1) {
      const __nv_bfloat16 b0 = from_float<__nv_bfloat16>(v0), b1 = from_float<__nv_bfloat16>(v1);
      if (adjacent(e0, e1)) {
        if (e0.in) *reinterpret_cast<__nv_bfloat162*>(dh + e0.at + shift) = __nv_bfloat162(b0, b1);
        return;
      }
      if (e0.in) dh[e0.at + shift] = b0;
      if (e1.in) dh[e1.at + shift] = b1;
    }
    CUTLASS_DEVICE static float low(uint32_t v) { return __uint_as_float(v << 16); }
    CUTLASS_DEVICE static float high(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

    CUTLASS_DEVICE void fetch(int epi_m, int epi_n) {
      using cute::_;
      auto c_mn = tCcD(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int q = 0; q < kPairs; ++q) {
        const Elem e0 = elem(c_mn, 2 * q), e1 = elem(c_mn, 2 * q + 1);
        gate_next[q] = load_pair(p.h, e0, e1, 0);
        up_next[q] = load_pair(p.h, e0, e1, p.I);
      }
    }

    CUTLASS_DEVICE void begin() { fetch(0, 0); }

    template <typename ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<float, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const& acc, int epi_v, int epi_m, int epi_n) {
      using cute::_;
      static_assert(FragmentSize == kSubtileElems, "one visit a subtile: the next subtile's loads start in it");
      uint32_t gate[kPairs], up[kPairs];
      CUTLASS_PRAGMA_UNROLL
      for (int q = 0; q < kPairs; ++q) gate[q] = gate_next[q], up[q] = up_next[q];
      const int next_m = epi_m + 1 < kEpiM ? epi_m + 1 : 0, next_n = epi_m + 1 < kEpiM ? epi_n : epi_n + 1;
      if (next_n < kEpiN) fetch(next_m, next_n);  // the epilogue's order: epi_m inner, epi_n outer

      cutlass::Array<float, FragmentSize> out;
      auto c_mn = tCcD(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int q = 0; q < kPairs; ++q) {
        const Elem e[2] = {elem(c_mn, 2 * q), elem(c_mn, 2 * q + 1)};
        const float gv[2] = {low(gate[q]), high(gate[q])}, uv[2] = {low(up[q]), high(up[q])};
        float dg[2], du[2];
        CUTLASS_PRAGMA_UNROLL
        for (int t = 0; t < 2; ++t) {
          const int s = slot_of(e[t].m);
          const float w = w_of[s];
          const float g = to_float(from_float<__nv_bfloat16>(static_cast<float>(acc[2 * q + t])));
          const float a = swiglu_value_and_grad(gv[t], uv[t], w * g, dg[t], du[t]);
          if (e[t].in) dot[s] += a * g;
          out[2 * q + t] = e[t].in ? w * a : 0.f;
        }
        store_pair(p.dh, e[0], e[1], 0, dg[0], dg[1]);
        store_pair(p.dh, e[0], e[1], p.I, du[0], du[1]);
      }
      return out;
    }

    CUTLASS_DEVICE void end() {
      const bool writer = threadIdx.x % 4 == 0;
      constexpr int kSplit = TileN / kPartCols;
      CUTLASS_PRAGMA_UNROLL
      for (int s = 0; s < kRows; ++s) {
        float v = dot[s];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (!writer || !valid[s]) continue;
        float* part = p.partials + (row0 + first_m + row_of(s)) * p.parts + n_tile * kSplit;
        part[0] = v;
        CUTLASS_PRAGMA_UNROLL
        for (int t = 1; t < kSplit; ++t)
          if (n_tile * kSplit + t < p.parts) part[t] = 0.f;
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    const int M = static_cast<int>(cute::get<0>(args.problem_shape_mnkl));
    const int N = static_cast<int>(cute::get<1>(args.problem_shape_mnkl));
    const int n_tile = static_cast<int>(cute::get<1>(args.tile_coord_mnkl));
    const int group = static_cast<int>(cute::get<3>(args.tile_coord_mnkl));
    int64_t begin, end;
    group_range(params.offsets, group, params.rows, begin, end);
    const int first_m = M - static_cast<int>(cute::get<0>(args.residue_tCcD));
    const int first_n = N - static_cast<int>(cute::get<1>(args.residue_tCcD));
    constexpr int kTileN = decltype(cute::size<1>(args.tile_shape_mnk))::value;
    return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(args.residue_tCcD), kTileN>(
        args.tCcD, args.residue_tCcD, params, first_m, first_n, M, begin, n_tile);
  }
};

}  // namespace moe8::cuda::sm90
