// permute.cu — moving token rows into and out of expert order:
//   gather_rows:          dst[r] = scale[slot] * src[slot / k], slot = row_to_slot[r] (zeros where slot < 0);
//                         with slot_to_row token-major: each token read once, stored to its k rows
//   combine_rows:         out[t] = sum_k w[t,k] * rows[slot_to_row[t,k]], fp32, one write per token
//   combine_weights_grad: d_w[t,k] = <dy[t], rows[slot_to_row[t,k]]>, fp32
//
// Design. All three are memory-bound: one warp per destination row (gather) or per token (combine, weights
// grad); each lane moves 16-byte packs (8 bf16/f16 or 4 f32) when H and the pointers allow it, and single
// elements otherwise. A warp's loop over packs never contains a shuffle (lanes may leave it at different
// times); the shuffles of the dot products come after it. Sums over slots run in k order, dot products in a
// fixed per-lane order and then a fixed butterfly: same inputs, same bits.
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/ops.h"
#include "cuda/rowwise.cuh"

namespace moe8::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kGradGroup = 4;  // slots whose dot products share one pass over dy[t]
constexpr unsigned kFull = 0xffffffffu;

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> zero_pack() {
  Pack<T, V> z;
#pragma unroll
  for (int j = 0; j < V; ++j) z.v[j] = from_float<T>(0.f);
  return z;
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    gather_rows_kernel(const T* __restrict__ src, const int32_t* __restrict__ row_to_slot, int k,
                       const float* __restrict__ scale, T* __restrict__ dst, int64_t num_rows, int64_t H,
                       int64_t num_slots) {
  using P = Pack<T, V>;
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (r >= num_rows) return;
  const int64_t np = H / V;
  const int slot = row_to_slot[r];
  P* out = reinterpret_cast<P*>(dst + r * H);
  if (slot < 0 || slot >= num_slots) {  // padding, or a slot out of range (unchecked input): zeros
    const P z = zero_pack<T, V>();
#pragma unroll 4
    for (int64_t p = lane; p < np; p += 32) out[p] = z;
    return;
  }
  const P* in = reinterpret_cast<const P*>(src + static_cast<int64_t>(slot / k) * H);
  if (scale == nullptr) {  // a plain copy: bit-exact
#pragma unroll 4
    for (int64_t p = lane; p < np; p += 32) out[p] = in[p];
  } else {
    const float s = scale[slot];
#pragma unroll 4
    for (int64_t p = lane; p < np; p += 32) {
      P a = in[p];
#pragma unroll
      for (int j = 0; j < V; ++j) a.v[j] = from_float<T>(s * to_float(a.v[j]));
      out[p] = a;
    }
  }
}

// gather_rows token-major (slot_to_row given, k <= kScatterMaxK): a warp per token reads its row once and
// stores it (times each slot's scale, when given) to its k rows, instead of every row reading its token
// (k reads of each token, mostly L2 misses once T H is past the L2). Rows no slot names: zero_unmapped_kernel.

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    scatter_rows_kernel(const T* __restrict__ src, const int32_t* __restrict__ slot_to_row, int k,
                        const float* __restrict__ scale, T* __restrict__ dst, int64_t num_tokens, int64_t H,
                        int64_t num_rows) {
  using P = Pack<T, V>;
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= num_tokens) return;
  int64_t r[kScatterMaxK];
  token_rows(slot_to_row, t, k, r);
#pragma unroll
  for (int j = 0; j < kScatterMaxK; ++j)
    if (r[j] >= num_rows) r[j] = -1;  // a row out of range (unchecked input): not stored
  float w[kScatterMaxK];
#pragma unroll
  for (int j = 0; j < kScatterMaxK; ++j) w[j] = j < k && scale != nullptr ? scale[t * k + j] : 1.f;
  const int64_t np = H / V;
  const P* in = reinterpret_cast<const P*>(src + t * H);
  for (int64_t p = lane; p < np; p += 32) {
    const P a = in[p];
#pragma unroll
    for (int j = 0; j < kScatterMaxK; ++j) {
      if (r[j] < 0) continue;
      P o = a;
      if (scale != nullptr) {  // as gather_rows_kernel: bit-exact
#pragma unroll
        for (int i = 0; i < V; ++i) o.v[i] = from_float<T>(w[j] * to_float(a.v[i]));
      }
      reinterpret_cast<P*>(dst + r[j] * H)[p] = o;
    }
  }
}

// Rows r with row_to_slot[r] < 0 (padding): zeros, as gather_rows_kernel writes them.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    zero_unmapped_kernel(const int32_t* __restrict__ row_to_slot, T* __restrict__ dst, int64_t num_rows, int64_t H) {
  using P = Pack<T, V>;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (r >= num_rows || row_to_slot[r] >= 0) return;
  const P z = zero_pack<T, V>();
  P* out = reinterpret_cast<P*>(dst + r * H);
  for (int64_t p = threadIdx.x & 31; p < H / V; p += 32) out[p] = z;
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    combine_rows_kernel(const T* __restrict__ rows, const int32_t* __restrict__ slot_to_row,
                        const float* __restrict__ weights, T* __restrict__ out, int64_t num_tokens, int K, int64_t H,
                        int64_t num_rows) {
  using P = Pack<T, V>;
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= num_tokens) return;
  const int64_t np = H / V;
  const int32_t* my_rows = slot_to_row + t * K;
  const float* my_w = weights != nullptr ? weights + t * K : nullptr;
  P* y = reinterpret_cast<P*>(out + t * H);
  for (int64_t p = lane; p < np; p += 32) {
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.f;
#pragma unroll 4
    for (int k = 0; k < K; ++k) {
      const int r = my_rows[k];
      if (r < 0 || r >= num_rows) continue;  // none, or out of range (unchecked input): adds nothing
      const float w = my_w != nullptr ? my_w[k] : 1.f;
      const P a = reinterpret_cast<const P*>(rows + static_cast<int64_t>(r) * H)[p];
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] += w * to_float(a.v[j]);
    }
    P o;
#pragma unroll
    for (int j = 0; j < V; ++j) o.v[j] = from_float<T>(acc[j]);
    y[p] = o;
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    combine_weights_grad_kernel(const T* __restrict__ dy, const T* __restrict__ rows,
                                const int32_t* __restrict__ slot_to_row, float* __restrict__ d_weights,
                                int64_t num_tokens, int K, int64_t H, int64_t num_rows) {
  using P = Pack<T, V>;
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= num_tokens) return;  // whole warp
  const int64_t np = H / V;
  const P* g = reinterpret_cast<const P*>(dy + t * H);
  for (int k0 = 0; k0 < K; k0 += kGradGroup) {
    int r[kGradGroup];
    float acc[kGradGroup];
#pragma unroll
    for (int u = 0; u < kGradGroup; ++u) {
      r[u] = k0 + u < K ? slot_to_row[t * K + k0 + u] : -1;
      if (r[u] >= num_rows) r[u] = -1;  // out of range (unchecked input): a zero gradient
      acc[u] = 0.f;
    }
    for (int64_t p = lane; p < np; p += 32) {
      const P d = g[p];
      float df[V];
#pragma unroll
      for (int j = 0; j < V; ++j) df[j] = to_float(d.v[j]);
#pragma unroll
      for (int u = 0; u < kGradGroup; ++u) {
        if (r[u] < 0) continue;
        const P a = reinterpret_cast<const P*>(rows + static_cast<int64_t>(r[u]) * H)[p];
#pragma unroll
        for (int j = 0; j < V; ++j) acc[u] += df[j] * to_float(a.v[j]);
      }
    }
#pragma unroll
    for (int u = 0; u < kGradGroup; ++u) {
      float s = acc[u];
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
      if (lane == 0 && k0 + u < K) d_weights[t * K + k0 + u] = r[u] >= 0 ? s : 0.f;
    }
  }
}

unsigned warps_grid(int64_t n) { return static_cast<unsigned>(ceil_div(n, kWarps)); }

}  // namespace

void gather_rows(const TensorView& src, const TensorView& row_to_slot, const TensorView& slot_to_row, int k,
                 const TensorView& scale, const TensorView& dst, void* stream) {
  const int64_t num_rows = dst.shape[0], H = dst.shape[1], num_tokens = src.shape[0];
  if (num_rows == 0 || H == 0) return;
  cudaStream_t s = as_stream(stream);
  const float* sc = scale.present ? scale.ptr<float>() : nullptr;
  const bool token_major = slot_to_row.present && k <= kScatterMaxK;
  MOE8_DISPATCH_FLOAT(src.dtype, "gather_rows: src", [&] {
    using T = scalar_t;
    const auto launch = [&](auto v) {
      constexpr int V = decltype(v)::value;
      if (!token_major) {
        gather_rows_kernel<T, V><<<warps_grid(num_rows), kThreads, 0, s>>>(
            src.ptr<T>(), row_to_slot.ptr<int32_t>(), k, sc, dst.ptr<T>(), num_rows, H, num_tokens * k);
        check_launch("gather_rows_kernel");
        return;
      }
      zero_unmapped_kernel<T, V>
          <<<warps_grid(num_rows), kThreads, 0, s>>>(row_to_slot.ptr<int32_t>(), dst.ptr<T>(), num_rows, H);
      check_launch("zero_unmapped_kernel");
      if (num_tokens == 0) return;
      scatter_rows_kernel<T, V><<<warps_grid(num_tokens), kThreads, 0, s>>>(src.ptr<T>(), slot_to_row.ptr<int32_t>(), k,
                                                                            sc, dst.ptr<T>(), num_tokens, H, num_rows);
      check_launch("scatter_rows_kernel");
    };
    if (use_packs<T>(H, {src.data, dst.data}))
      launch(std::integral_constant<int, 16 / sizeof(T)>{});
    else
      launch(std::integral_constant<int, 1>{});
  });
}

void combine_rows(const TensorView& rows, const TensorView& slot_to_row, const TensorView& weights,
                  const TensorView& out, void* stream) {
  const int64_t num_tokens = out.shape[0], H = out.shape[1];
  if (num_tokens == 0 || H == 0) return;
  const int K = static_cast<int>(slot_to_row.numel() / num_tokens);  // [T,K] or flat [T*K]
  cudaStream_t s = as_stream(stream);
  const float* w = weights.present ? weights.ptr<float>() : nullptr;
  MOE8_DISPATCH_FLOAT(out.dtype, "combine_rows: out", [&] {
    using T = scalar_t;
    if (use_packs<T>(H, {rows.data, out.data}))
      combine_rows_kernel<T, 16 / sizeof(T)><<<warps_grid(num_tokens), kThreads, 0, s>>>(
          rows.ptr<T>(), slot_to_row.ptr<int32_t>(), w, out.ptr<T>(), num_tokens, K, H, rows.shape[0]);
    else
      combine_rows_kernel<T, 1><<<warps_grid(num_tokens), kThreads, 0, s>>>(
          rows.ptr<T>(), slot_to_row.ptr<int32_t>(), w, out.ptr<T>(), num_tokens, K, H, rows.shape[0]);
    check_launch("combine_rows_kernel");
  });
}

void combine_weights_grad(const TensorView& dy, const TensorView& rows, const TensorView& slot_to_row,
                          const TensorView& d_weights, void* stream) {
  const int64_t num_tokens = dy.shape[0], H = dy.shape[1];
  if (num_tokens == 0) return;
  const int K = static_cast<int>(slot_to_row.numel() / num_tokens);  // [T,K] or flat [T*K]
  if (K == 0) return;  // H == 0 still runs: the dot products are zeros to write
  cudaStream_t s = as_stream(stream);
  MOE8_DISPATCH_FLOAT(dy.dtype, "combine_weights_grad: dy", [&] {
    using T = scalar_t;
    if (use_packs<T>(H, {dy.data, rows.data}))
      combine_weights_grad_kernel<T, 16 / sizeof(T)>
          <<<warps_grid(num_tokens), kThreads, 0, s>>>(dy.ptr<T>(), rows.ptr<T>(), slot_to_row.ptr<int32_t>(),
                                                       d_weights.ptr<float>(), num_tokens, K, H, rows.shape[0]);
    else
      combine_weights_grad_kernel<T, 1>
          <<<warps_grid(num_tokens), kThreads, 0, s>>>(dy.ptr<T>(), rows.ptr<T>(), slot_to_row.ptr<int32_t>(),
                                                       d_weights.ptr<float>(), num_tokens, K, H, rows.shape[0]);
    check_launch("combine_weights_grad_kernel");
  });
}

}  // namespace moe8::cuda
