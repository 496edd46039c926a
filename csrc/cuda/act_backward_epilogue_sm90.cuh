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

    // Outputs j and j + 1 (V = 2, j even) or j alone (V = 1) of row m (slot s of the thread's two).
    template <int V>
    CUTLASS_DEVICE void one(const float (&acc)[V], float (&out)[V], int s, int m, int j) {
      const float w = w_of[s];
      const int64_t cols = p.gated ? 2 * p.I : p.I;
      const int64_t base = (row0 + m) * cols;
      const bool pairs = p.gated && p.act.interleaved;  // [g0, u0, g1, u1, ...]
      const int64_t gi = base + (pairs ? 2 * j : j), ui = pairs ? gi + 1 : gi + p.I;
      float gate[V], up[V], dg[V], du[V];
      if (V == 2 && pairs) {
        const uint2 v = *reinterpret_cast<const uint2*>(p.h + gi);
        const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v);
        CUTLASS_PRAGMA_UNROLL
        for (int t = 0; t < V; ++t) gate[t] = to_float(e[2 * t]), up[t] = to_float(e[2 * t + 1]);
      } else if (V == 2) {
        const __nv_bfloat162 gv = *reinterpret_cast<const __nv_bfloat162*>(p.h + gi);
        gate[0] = to_float(gv.x), gate[V - 1] = to_float(gv.y);
        if (p.gated) {
          const __nv_bfloat162 uv = *reinterpret_cast<const __nv_bfloat162*>(p.h + ui);
          up[0] = to_float(uv.x), up[V - 1] = to_float(uv.y);
        } else {
          up[0] = up[V - 1] = 0.f;
        }
      } else {
        gate[0] = to_float(p.h[gi]);
        up[0] = p.gated ? to_float(p.h[ui]) : 0.f;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int t = 0; t < V; ++t) {
        const float g = to_float(from_float<__nv_bfloat16>(acc[t]));  // the bits the plain dgrad stores
        const float a = act_value_and_grad(p.act, gate[t], up[t], w * g, dg[t], du[t]);
        dot[s] += a * g;
        out[t] = w * a;
      }
      if (V == 2 && pairs) {
        uint2 v;
        __nv_bfloat16* e = reinterpret_cast<__nv_bfloat16*>(&v);
        CUTLASS_PRAGMA_UNROLL
        for (int t = 0; t < V; ++t)
          e[2 * t] = from_float<__nv_bfloat16>(dg[t]), e[2 * t + 1] = from_float<__nv_bfloat16>(du[t]);
        *reinterpret_cast<uint2*>(p.dh + gi) = v;
      } else if (V == 2) {
        *reinterpret_cast<__nv_bfloat162*>(p.dh + gi) =
            __nv_bfloat162(from_float<__nv_bfloat16>(dg[0]), from_float<__nv_bfloat16>(dg[V - 1]));
        if (p.gated)
          *reinterpret_cast<__nv_bfloat162*>(p.dh + ui) =
              __nv_bfloat162(from_float<__nv_bfloat16>(du[0]), from_float<__nv_bfloat16>(du[V - 1]));
      } else {
        p.dh[gi] = from_float<__nv_bfloat16>(dg[0]);
        if (p.gated) p.dh[ui] = from_float<__nv_bfloat16>(du[0]);
      }
    }

    template <typename ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<float, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const& acc, int epi_v, int epi_m, int epi_n) {
      using cute::_;
      static_assert(FragmentSize % 2 == 0, "the accumulators come in pairs of columns");
      cutlass::Array<float, FragmentSize> out;
      auto c_mn = tCcD(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; i += 2) {
        const auto c0 = c_mn(epi_v * FragmentSize + i), c1 = c_mn(epi_v * FragmentSize + i + 1);
        const int m0 = static_cast<int>(cute::get<0>(c0)), n0 = static_cast<int>(cute::get<1>(c0));
        const int m1 = static_cast<int>(cute::get<0>(c1)), n1 = static_cast<int>(cute::get<1>(c1));
        const bool in0 = cute::elem_less(c0, residue), in1 = cute::elem_less(c1, residue);
        out[i] = out[i + 1] = 0.f;
        if (m0 == m1 && n1 == n0 + 1 && in0 && in1 && (first_n + n0) % 2 == 0) {
          const float a[2] = {static_cast<float>(acc[i]), static_cast<float>(acc[i + 1])};
          float o[2];
          one<2>(a, o, (m0 >> 3) & 1, first_m + m0, first_n + n0);
          out[i] = o[0], out[i + 1] = o[1];
          continue;
        }
        if (in0) {
          const float a[1] = {static_cast<float>(acc[i])};
          float o[1];
          one<1>(a, o, (m0 >> 3) & 1, first_m + m0, first_n + n0);
          out[i] = o[0];
        }
        if (in1) {
          const float a[1] = {static_cast<float>(acc[i + 1])};
          float o[1];
          one<1>(a, o, (m1 >> 3) & 1, first_m + m1, first_n + n1);
          out[i + 1] = o[0];
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
