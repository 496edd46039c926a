// act_backward_epilogue_sm90.cuh — an epilogue visitor for the sm_90a grouped GEMMs (grouped_gemm_sm90_impl.cuh)
// that runs the routed activation backward on the down projection's input gradient while it is in registers,
// instead of writing it to [R, I] and reading it back (activation.cu's activation_backward_routed_kernel).
//
// For the element (m, j) of group e's output, row r = offsets[e] + m:
//   g  = bf16(acc)                               the bits the plain dgrad stores
//   w  = weights[row_to_slot[r]]                 0 for padding rows (row_to_slot < 0 or out of range)
//   a  = act(h[r] gate j, up j), with d h[r] gate j, up j = act'(w * g)  written to dh (which may be h)
//   D  = w * a                                   what the down projection's weight gradient reads
//   partials[r, tile along N] = sum of a * g over the tile's columns   (the routing weight's gradient)
// Every formula is activation.cuh's, in the separate kernel's order, so dh and D are the same bits as the plain
// dgrad followed by that kernel. The routing weights' gradient is the same sum in a different order: each
// thread of the cooperative 128-row tile holds two rows of it (the wgmma accumulator layout: rows lane / 4 and
// lane / 4 + 8 of its warp's 16), keeps their sums in two registers, and the four lanes of a row add theirs
// with two shuffles when the tile ends; a second kernel adds a row's tiles in order (deterministic).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "core/params.h"
#include "cuda/activation.cuh"
#include "cuda/common.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"  // the sm90 epilogue visitors, in their order

namespace moe8::cuda::sm90 {

struct ActBackwardArgs {
  const __nv_bfloat16* h = nullptr;      // [R, gated ? 2I : I]
  __nv_bfloat16* dh = nullptr;           // same shape; may be h (each element read, then written, by one thread)
  const float* weights = nullptr;        // [num_slots], the routing weights flattened
  const int32_t* row_to_slot = nullptr;  // [R]
  const int32_t* offsets = nullptr;      // [E + 1]
  float* partials = nullptr;             // [R, parts]
  int64_t rows = 0, num_slots = 0, I = 0;
  int parts = 0;  // tiles along N: ceil(I / the tile's N)
  bool gated = true;
  ActParams act{};
};

// The whole fusion callback of the epilogue (a visitor taking only the accumulators).
struct Sm90RoutedActBackward {
  using Arguments = ActBackwardArgs;
  using Params = ActBackwardArgs;
  struct SharedStorage {};

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.h != nullptr && args.dh != nullptr && args.partials != nullptr && args.parts > 0;
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

  CUTLASS_HOST_DEVICE Sm90RoutedActBackward() {}
  CUTLASS_HOST_DEVICE Sm90RoutedActBackward(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  template <class CTensor, class Residue>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor c, Residue res, Params const& p, int first_m, int first_n, int M,
                                          int64_t row0, int n_tile)
        : tCcD(c), residue(res), p(p), first_m(first_m), first_n(first_n), row0(row0), n_tile(n_tile) {
      CUTLASS_PRAGMA_UNROLL
      for (int s = 0; s < 2; ++s) {  // the thread's two rows: first_m (bit 3 clear) and first_m + 8
        valid[s] = first_m + 8 * s < M;
        const int32_t given = valid[s] ? p.row_to_slot[row0 + first_m + 8 * s] : -1;
        w_of[s] = given >= 0 && given < p.num_slots ? p.weights[given] : 0.f;
      }
    }

    CTensor tCcD;     // (CPY, CPY_M, CPY_N, EPI_M, EPI_N): coordinates from the thread's first element
    Residue residue;  // the group's (M, N) less the thread's first element
    Params const& p;
    int first_m, first_n;  // the thread's first element in the group's (M, N)
    int64_t row0;          // the group's first row
    int n_tile;
    bool valid[2];
    float w_of[2];
    float dot[2] = {0.f, 0.f};

    // Where the pair of fragment elements i, i + 1 reads and writes h: their rows' slots among the thread's two,
    // whether each is inside the group's (M, N), and whether the two are neighbours in one row (one 4- or 8-byte
    // access for both).
    struct Pair {
      bool in0, in1, joint;
      int s0, s1;
      int64_t g0, u0, g1, u1;  // element offsets in h of each one's gate and up
    };

    template <class Coords>
    CUTLASS_DEVICE Pair locate(Coords const& c_mn, int k) const {
      const auto c0 = c_mn(k), c1 = c_mn(k + 1);
      const int m0 = static_cast<int>(cute::get<0>(c0)), n0 = static_cast<int>(cute::get<1>(c0));
      const int m1 = static_cast<int>(cute::get<0>(c1)), n1 = static_cast<int>(cute::get<1>(c1));
      const int64_t cols = p.gated ? 2 * p.I : p.I;
      const bool pairs = p.gated && p.act.interleaved;  // [g0, u0, g1, u1, ...]
      Pair q;
      q.in0 = cute::elem_less(c0, residue);
      q.in1 = cute::elem_less(c1, residue);
      q.joint = q.in0 && q.in1 && m0 == m1 && n1 == n0 + 1 && (first_n + n0) % 2 == 0;
      q.s0 = (m0 >> 3) & 1;
      q.s1 = (m1 >> 3) & 1;
      q.g0 = (row0 + first_m + m0) * cols + (pairs ? 2 * (first_n + n0) : first_n + n0);
      q.g1 = (row0 + first_m + m1) * cols + (pairs ? 2 * (first_n + n1) : first_n + n1);
      q.u0 = pairs ? q.g0 + 1 : q.g0 + p.I;
      q.u1 = pairs ? q.g1 + 1 : q.g1 + p.I;
      return q;
    }

    // All of a fragment's loads of h are issued before any store to dh (which may be h), so they are in flight
    // together rather than one after another.
    template <typename ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<float, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const& acc, int epi_v, int epi_m, int epi_n) {
      using cute::_;
      static_assert(FragmentSize % 2 == 0, "the accumulators come in pairs of columns");
      const auto c_mn = tCcD(_, _, _, epi_m, epi_n);
      const bool pairs = p.gated && p.act.interleaved;
      float gate[FragmentSize], up[FragmentSize];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; i += 2) {
        const Pair q = locate(c_mn, epi_v * FragmentSize + i);
        gate[i] = up[i] = gate[i + 1] = up[i + 1] = 0.f;
        if (q.joint && pairs) {
          const uint2 v = *reinterpret_cast<const uint2*>(p.h + q.g0);
          const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v);
          gate[i] = to_float(e[0]), up[i] = to_float(e[1]), gate[i + 1] = to_float(e[2]), up[i + 1] = to_float(e[3]);
        } else if (q.joint) {
          const __nv_bfloat162 gv = *reinterpret_cast<const __nv_bfloat162*>(p.h + q.g0);
          gate[i] = to_float(gv.x), gate[i + 1] = to_float(gv.y);
          if (p.gated) {
            const __nv_bfloat162 uv = *reinterpret_cast<const __nv_bfloat162*>(p.h + q.u0);
            up[i] = to_float(uv.x), up[i + 1] = to_float(uv.y);
          }
        } else {
          if (q.in0) gate[i] = to_float(p.h[q.g0]), up[i] = p.gated ? to_float(p.h[q.u0]) : 0.f;
          if (q.in1) gate[i + 1] = to_float(p.h[q.g1]), up[i + 1] = p.gated ? to_float(p.h[q.u1]) : 0.f;
        }
      }
      cutlass::Array<float, FragmentSize> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; i += 2) {
        const Pair q = locate(c_mn, epi_v * FragmentSize + i);
        float dg[2], du[2];
        CUTLASS_PRAGMA_UNROLL
        for (int t = 0; t < 2; ++t) {
          const int s = t == 0 ? q.s0 : q.s1;
          const float w = w_of[s];
          const float g =
              to_float(from_float<__nv_bfloat16>(static_cast<float>(acc[i + t])));  // the plain dgrad's bits
          const float a = act_value_and_grad(p.act, gate[i + t], up[i + t], w * g, dg[t], du[t]);
          const bool in = t == 0 ? q.in0 : q.in1;
          if (in) dot[s] += a * g;
          out[i + t] = in ? w * a : 0.f;
        }
        if (q.joint && pairs) {
          uint2 v;
          __nv_bfloat16* e = reinterpret_cast<__nv_bfloat16*>(&v);
          e[0] = from_float<__nv_bfloat16>(dg[0]), e[1] = from_float<__nv_bfloat16>(du[0]);
          e[2] = from_float<__nv_bfloat16>(dg[1]), e[3] = from_float<__nv_bfloat16>(du[1]);
          *reinterpret_cast<uint2*>(p.dh + q.g0) = v;
        } else if (q.joint) {
          *reinterpret_cast<__nv_bfloat162*>(p.dh + q.g0) =
              __nv_bfloat162(from_float<__nv_bfloat16>(dg[0]), from_float<__nv_bfloat16>(dg[1]));
          if (p.gated)
            *reinterpret_cast<__nv_bfloat162*>(p.dh + q.u0) =
                __nv_bfloat162(from_float<__nv_bfloat16>(du[0]), from_float<__nv_bfloat16>(du[1]));
        } else {
          if (q.in0) {
            p.dh[q.g0] = from_float<__nv_bfloat16>(dg[0]);
            if (p.gated) p.dh[q.u0] = from_float<__nv_bfloat16>(du[0]);
          }
          if (q.in1) {
            p.dh[q.g1] = from_float<__nv_bfloat16>(dg[1]);
            if (p.gated) p.dh[q.u1] = from_float<__nv_bfloat16>(du[1]);
          }
        }
      }
      return out;
    }

    CUTLASS_DEVICE void end() {
      const bool writer = threadIdx.x % 4 == 0;
      CUTLASS_PRAGMA_UNROLL
      for (int s = 0; s < 2; ++s) {
        float v = dot[s];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (writer && valid[s]) p.partials[(row0 + first_m + 8 * s) * p.parts + n_tile] = v;
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
    return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(args.residue_tCcD)>(
        args.tCcD, args.residue_tCcD, params, first_m, first_n, M, begin, n_tile);
  }
};

}  // namespace moe8::cuda::sm90
