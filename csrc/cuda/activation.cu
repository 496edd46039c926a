// activation.cu — the expert activation between the two grouped GEMMs, forward and backward: SwiGLU,
// GPT-OSS clamped SwiGLU (gate/up as two halves or interleaved), and the ungated SiLU and exact GELU.
//
// Design. Elementwise and memory-bound. A block is blockDim.y rows (from blockIdx.x) by blockDim.x packs
// of columns (tile blockIdx.y), narrow rows stacking several to a block; each thread computes V consecutive
// outputs, moving 16-byte packs (V = 8 for bf16/f16, 4 for
// f32) when I and the pointers allow it, single elements otherwise. Math in fp32, one formula per kind in
// act_forward / act_backward (activation.cuh, shared with swiglu_quant and the fused dgrad epilogue), written in
// the CPU reference's order of operations; the layout of gate and up is resolved once per pack in load_inputs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "cuda/activation.cuh"
#include "cuda/common.cuh"
#include "cuda/ops.h"
#include "cuda/quant.cuh"
#include "cuda/rowwise.cuh"

namespace moe8::cuda {
namespace {

constexpr int kMaxThreads = kRowwiseThreads;

// Element offsets, within row r of h, of the gate and up packs for outputs i0 .. i0+V-1. Interleaved:
// the 2V inputs [g, u, g, u, ...] start at 2 * i0 and are read as two packs.
struct Layout {
  bool gated, interleaved;
  int64_t I;
  __device__ __forceinline__ int64_t row_elems() const { return gated ? 2 * I : I; }
};

template <typename T, int V>
__device__ __forceinline__ void load_inputs(const T* row, const Layout& lay, int64_t i0, float (&g)[V], float (&u)[V]) {
  using P = Pack<T, V>;
  if (!lay.gated) {
    const P a = *reinterpret_cast<const P*>(row + i0);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      g[j] = to_float(a.v[j]);
      u[j] = 0.f;
    }
  } else if (!lay.interleaved) {
    const P a = *reinterpret_cast<const P*>(row + i0);
    const P b = *reinterpret_cast<const P*>(row + lay.I + i0);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      g[j] = to_float(a.v[j]);
      u[j] = to_float(b.v[j]);
    }
  } else {
    const P a = *reinterpret_cast<const P*>(row + 2 * i0);
    const P b = *reinterpret_cast<const P*>(row + 2 * i0 + V);
    float x[2 * V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      x[j] = to_float(a.v[j]);
      x[V + j] = to_float(b.v[j]);
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      g[j] = x[2 * j];
      u[j] = x[2 * j + 1];
    }
  }
}

template <typename T, int V>
__device__ __forceinline__ void store_grads(T* row, const Layout& lay, int64_t i0, const float (&dg)[V],
                                            const float (&du)[V]) {
  using P = Pack<T, V>;
  if (!lay.gated) {
    P a;
#pragma unroll
    for (int j = 0; j < V; ++j) a.v[j] = from_float<T>(dg[j]);
    *reinterpret_cast<P*>(row + i0) = a;
  } else if (!lay.interleaved) {
    P a, b;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      a.v[j] = from_float<T>(dg[j]);
      b.v[j] = from_float<T>(du[j]);
    }
    *reinterpret_cast<P*>(row + i0) = a;
    *reinterpret_cast<P*>(row + lay.I + i0) = b;
  } else {
    float x[2 * V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      x[2 * j] = dg[j];
      x[2 * j + 1] = du[j];
    }
    P a, b;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      a.v[j] = from_float<T>(x[j]);
      b.v[j] = from_float<T>(x[V + j]);
    }
    *reinterpret_cast<P*>(row + 2 * i0) = a;
    *reinterpret_cast<P*>(row + 2 * i0 + V) = b;
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(kMaxThreads)
    activation_forward_kernel(const T* __restrict__ h, ActParams p, Layout lay, int64_t rows, T* __restrict__ out) {
  const int64_t i0 = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * V;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (i0 >= lay.I || r >= rows) return;
  float g[V], u[V];
  load_inputs<T, V>(h + r * lay.row_elems(), lay, i0, g, u);
  Pack<T, V> o;
#pragma unroll
  for (int j = 0; j < V; ++j) o.v[j] = from_float<T>(act_forward(p, g[j], u[j]));
  *reinterpret_cast<Pack<T, V>*>(out + r * lay.I + i0) = o;
}

template <typename T, int V>
__global__ void __launch_bounds__(kMaxThreads)
    activation_backward_kernel(const T* h, const T* __restrict__ dout, ActParams p, Layout lay, int64_t rows,
                               T* dh) {  // dh may be h (ops.activation_backward_): each thread reads, then writes
  const int64_t i0 = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * V;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (i0 >= lay.I || r >= rows) return;
  float g[V], u[V], dg[V], du[V];
  load_inputs<T, V>(h + r * lay.row_elems(), lay, i0, g, u);
  const Pack<T, V> d = *reinterpret_cast<const Pack<T, V>*>(dout + r * lay.I + i0);
#pragma unroll
  for (int j = 0; j < V; ++j) act_backward(p, g[j], u[j], to_float(d.v[j]), dg[j], du[j]);
  store_grads<T, V>(dh + r * lay.row_elems(), lay, i0, dg, du);
}

// One warp per row (kRoutedWarps rows a block): lanes step through the row's packs, and the routing weight's
// gradient is the warp's sum of act(h) * dout (a fixed order: deterministic).
constexpr int kRoutedWarps = kMaxThreads / 32;

// Quant: d h [gate | up] also quantised 1x128 as stored (rounded to T) into q [rows, 2I] and q_scale
// [rows, 2I / 128], the bits quantize_rows_1x128(d h) gives. Needs V = 8 (a lane's pack is 8 columns, so
// each half warp holds one 128-column block of d gate and one of d up at every step) and I % 128 == 0.
// Quant's kernel is held to 64 registers (4 blocks an SM): at its natural 80 (3 blocks) it took as long as the
// plain kernel and quantize_rows_1x128 after it (Mixtral-8x7B, H200: 2.63 ms against 1.69 + 0.88), at 64 2.28.
template <typename T, int V, bool Quant>
__global__ void __launch_bounds__(kMaxThreads, Quant ? 4 : 0)
    activation_backward_routed_kernel(const T* h, const T* dout, const float* __restrict__ weights,
                                      const int32_t* __restrict__ row_to_slot, ActParams p, Layout lay, int64_t rows,
                                      T* dh, T* a_w, float* __restrict__ d_weights,  // dh may be h, a_w dout
                                      int64_t num_slots, uint8_t* __restrict__ q, float* __restrict__ q_scale) {
  static_assert(!Quant || V == quant::kLaneVals, "a lane's pack is 8 columns of one 128-column block");
  const int lane = threadIdx.x % 32;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRoutedWarps + threadIdx.x / 32;
  if (r >= rows) return;
  const int32_t given = row_to_slot[r];
  const int32_t slot = given < num_slots ? given : -1;  // out of range (unchecked input): as padding, weight 0
  const float w = slot >= 0 ? weights[slot] : 0.f;
  const T* hr = h + r * lay.row_elems();
  T* dhr = dh + r * lay.row_elems();
  const T* dr = dout + r * lay.I;
  T* ar = a_w + r * lay.I;
  float dot = 0.f;
  for (int64_t base = 0; base < lay.I; base += 32 * V) {  // the same steps on every lane (Quant's shuffles)
    const int64_t i0 = base + static_cast<int64_t>(lane) * V;
    const bool live = i0 < lay.I;
    float dg[V] = {}, du[V] = {};
    if (live) {
      float g[V], u[V];
      load_inputs<T, V>(hr, lay, i0, g, u);
      const Pack<T, V> d = *reinterpret_cast<const Pack<T, V>*>(dr + i0);
      Pack<T, V> o;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float dj = to_float(d.v[j]), a = act_value_and_grad(p, g[j], u[j], w * dj, dg[j], du[j]);
        dot += a * dj;
        o.v[j] = from_float<T>(w * a);
      }
      store_grads<T, V>(dhr, lay, i0, dg, du);
      *reinterpret_cast<Pack<T, V>*>(ar + i0) = o;
    }
    if constexpr (Quant) {  // half h of the warp: block base / 128 + h of d gate, and of d up I / 128 further
      float vg[V], vu[V];
#pragma unroll
      for (int j = 0; j < V; ++j) {  // as stored
        vg[j] = live ? to_float(from_float<T>(dg[j])) : 0.f;
        vu[j] = live ? to_float(from_float<T>(du[j])) : 0.f;
      }
      const int64_t b = base / kQuantBlock + quant::half(), W = 2 * lay.I;
      quant::quantize_block(vg, live, r, b, W, true, q, q_scale);
      quant::quantize_block(vu, live, r, lay.I / kQuantBlock + b, W, true, q, q_scale);
    }
  }
  for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  if (lane == 0 && slot >= 0) d_weights[slot] = dot;
}

// The routed kernel of T's packs, with d h's quantisation where asked (only for packs of 8 values).
template <typename T, int V>
auto routed_kernel(bool with_codes) {
  if constexpr (V == quant::kLaneVals) {
    if (with_codes) return activation_backward_routed_kernel<T, V, true>;
  }
  return activation_backward_routed_kernel<T, V, false>;
}

}  // namespace

void activation_forward(const TensorView& h, const ActParams& p, const TensorView& out, void* stream) {
  const int64_t rows = out.shape[0], I = out.shape[1];
  if (rows == 0 || I == 0) return;
  cudaStream_t s = as_stream(stream);
  const Layout lay{is_gated(p.kind), p.interleaved, I};
  MOE8_DISPATCH_FLOAT(h.dtype, "activation_forward: h", [&] {
    using T = scalar_t;
    constexpr int V = 16 / sizeof(T);
    if (use_packs<T>(I, {h.data, out.data})) {
      const RowGrid g = row_grid(rows, I / V);
      activation_forward_kernel<T, V><<<g.grid, g.block, 0, s>>>(h.ptr<T>(), p, lay, rows, out.ptr<T>());
    } else {
      const RowGrid g = row_grid(rows, I);
      activation_forward_kernel<T, 1><<<g.grid, g.block, 0, s>>>(h.ptr<T>(), p, lay, rows, out.ptr<T>());
    }
    check_launch("activation_forward_kernel");
  });
}

void activation_backward(const TensorView& h, const TensorView& dout, const ActParams& p, const TensorView& dh,
                         void* stream) {
  const int64_t rows = dout.shape[0], I = dout.shape[1];
  if (rows == 0 || I == 0) return;
  cudaStream_t s = as_stream(stream);
  const Layout lay{is_gated(p.kind), p.interleaved, I};
  MOE8_DISPATCH_FLOAT(h.dtype, "activation_backward: h", [&] {
    using T = scalar_t;
    constexpr int V = 16 / sizeof(T);
    if (use_packs<T>(I, {h.data, dout.data, dh.data})) {
      const RowGrid g = row_grid(rows, I / V);
      activation_backward_kernel<T, V><<<g.grid, g.block, 0, s>>>(h.ptr<T>(), dout.ptr<T>(), p, lay, rows, dh.ptr<T>());
    } else {
      const RowGrid g = row_grid(rows, I);
      activation_backward_kernel<T, 1><<<g.grid, g.block, 0, s>>>(h.ptr<T>(), dout.ptr<T>(), p, lay, rows, dh.ptr<T>());
    }
    check_launch("activation_backward_kernel");
  });
}

void activation_backward_routed(const TensorView& h, const TensorView& dout, const TensorView& weights,
                                const TensorView& row_to_slot, const ActParams& p, const TensorView& dh,
                                const TensorView& a_w, const TensorView& d_weights, void* stream,
                                const TensorView& dh_q, const TensorView& dh_scale) {
  const int64_t rows = dout.shape[0], I = dout.shape[1];
  if (rows == 0) return;
  cudaStream_t s = as_stream(stream);
  const Layout lay{is_gated(p.kind), p.interleaved, I};
  const unsigned grid = static_cast<unsigned>(ceil_div(rows, kRoutedWarps));
  const bool quantise = dh_q.present;
  bool quantised = false;
  MOE8_DISPATCH_FLOAT(h.dtype, "activation_backward_routed: h", [&] {
    using T = scalar_t;
    constexpr int V = 16 / sizeof(T);
    const auto launch = [&](auto kernel) {
      kernel<<<grid, kMaxThreads, 0, s>>>(h.ptr<T>(), dout.ptr<T>(), weights.ptr<float>(), row_to_slot.ptr<int32_t>(),
                                          p, lay, rows, dh.ptr<T>(), a_w.ptr<T>(), d_weights.ptr<float>(),
                                          weights.shape[0], static_cast<uint8_t*>(dh_q.data),
                                          static_cast<float*>(dh_scale.data));
    };
    const bool packs = use_packs<T>(I, {h.data, dout.data, dh.data, a_w.data});
    quantised = quantise && packs && V == quant::kLaneVals && lay.gated && !lay.interleaved && I % kQuantBlock == 0 &&
                quant::aligned(dh_q.data, quant::kLaneVals);
    if (packs)
      launch(routed_kernel<T, V>(quantised));
    else
      launch(activation_backward_routed_kernel<T, 1, false>);
    check_launch("activation_backward_routed_kernel");
  });
  if (quantise && !quantised) quantize_rows_1x128(dh, TensorView{}, TensorView{}, 1, dh_q, dh_scale, stream);
}

}  // namespace moe8::cuda
