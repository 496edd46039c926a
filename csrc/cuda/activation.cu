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

template <typename T, int V>
__global__ void __launch_bounds__(kMaxThreads)
    activation_backward_routed_kernel(const T* h, const T* dout, const float* __restrict__ weights,
                                      const int32_t* __restrict__ row_to_slot, ActParams p, Layout lay, int64_t rows,
                                      T* dh, T* a_w, float* __restrict__ d_weights,  // dh may be h, a_w dout
                                      int64_t num_slots) {
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
  for (int64_t i0 = static_cast<int64_t>(lane) * V; i0 < lay.I; i0 += 32 * V) {
    float g[V], u[V], dg[V], du[V];
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
  for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  if (lane == 0 && slot >= 0) d_weights[slot] = dot;
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
                                const TensorView& a_w, const TensorView& d_weights, void* stream) {
  const int64_t rows = dout.shape[0], I = dout.shape[1];
  if (rows == 0) return;
  cudaStream_t s = as_stream(stream);
  const Layout lay{is_gated(p.kind), p.interleaved, I};
  const unsigned grid = static_cast<unsigned>(ceil_div(rows, kRoutedWarps));
  MOE8_DISPATCH_FLOAT(h.dtype, "activation_backward_routed: h", [&] {
    using T = scalar_t;
    constexpr int V = 16 / sizeof(T);
    const auto launch = [&](auto kernel) {
      kernel<<<grid, kMaxThreads, 0, s>>>(h.ptr<T>(), dout.ptr<T>(), weights.ptr<float>(), row_to_slot.ptr<int32_t>(),
                                          p, lay, rows, dh.ptr<T>(), a_w.ptr<T>(), d_weights.ptr<float>(),
                                          weights.shape[0]);
    };
    if (use_packs<T>(I, {h.data, dout.data, dh.data, a_w.data}))
      launch(activation_backward_routed_kernel<T, V>);
    else
      launch(activation_backward_routed_kernel<T, 1>);
    check_launch("activation_backward_routed_kernel");
  });
}

}  // namespace moe8::cuda
