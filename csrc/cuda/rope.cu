// rope.cu — rotary position embedding (rotate_half form), forward and backward in one kernel.
//
// Design. Elementwise and memory-bound. A thread owns V consecutive pairs (i, i + D/2) of one (b, h, s)
// row: it loads x[i .. i+V) and x[i+half .. i+half+V) and the four matching cos / sin packs, and writes both
// halves of out. V is the widest of 16 bytes / sizeof(T), ..., 2, 1 that divides half, the row strides and
// the pointers' alignment. Threads walk (b, s, h, pack) with h inner, the order of the [B, S, H, D] buffer
// transformers views as [B, H, S, D], so a warp reads contiguous memory and neighbouring heads share a
// cos / sin row. fp32 math in the CPU reference's order of operations, one rounding.
#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "cuda/common.cuh"
#include "cuda/ops.h"
#include "cuda/rowwise.cuh"

namespace moe8::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 16;  // then grid-stride

struct RopeShape {
  int64_t B, H, S, D;
  int64_t xs[3], ys[3];  // element strides of x and out over b, h, s (last dim contiguous)
  int64_t cos_b;         // batch stride of cos / sin: S * D, or 0 to broadcast
};

template <typename T, int V, bool kBackward>
__global__ void __launch_bounds__(kThreads) rope_kernel(const T* __restrict__ x, const T* __restrict__ cos,
                                                        const T* __restrict__ sin, RopeShape p, T* __restrict__ out) {
  using P = Pack<T, V>;
  const int64_t half = p.D / 2, packs = half / V, n = p.B * p.S * p.H * packs;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < n;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = (t % packs) * V, r = t / packs;
    const int64_t h = r % p.H, s = (r / p.H) % p.S, b = r / (p.H * p.S);
    const T* xr = x + b * p.xs[0] + h * p.xs[1] + s * p.xs[2] + i;
    T* yr = out + b * p.ys[0] + h * p.ys[1] + s * p.ys[2] + i;
    const int64_t cr = b * p.cos_b + s * p.D + i;
    const P x1 = *reinterpret_cast<const P*>(xr), x2 = *reinterpret_cast<const P*>(xr + half);
    const P c1 = *reinterpret_cast<const P*>(cos + cr), c2 = *reinterpret_cast<const P*>(cos + cr + half);
    const P s1 = *reinterpret_cast<const P*>(sin + cr), s2 = *reinterpret_cast<const P*>(sin + cr + half);
    P y1, y2;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float lo = to_float(x1.v[j]), hi = to_float(x2.v[j]);
      if constexpr (!kBackward) {  // y = x cos + rotate_half(x) sin
        y1.v[j] = from_float<T>(lo * to_float(c1.v[j]) - hi * to_float(s1.v[j]));
        y2.v[j] = from_float<T>(hi * to_float(c2.v[j]) + lo * to_float(s2.v[j]));
      } else {  // dx = g cos + rotate_half^T(g sin)
        y1.v[j] = from_float<T>(lo * to_float(c1.v[j]) + hi * to_float(s2.v[j]));
        y2.v[j] = from_float<T>(hi * to_float(c2.v[j]) - lo * to_float(s1.v[j]));
      }
    }
    *reinterpret_cast<P*>(yr) = y1;
    *reinterpret_cast<P*>(yr + half) = y2;
  }
}

template <typename T, bool kBackward, int V>
void launch(const TensorView& x, const TensorView& cos, const TensorView& sin, const RopeShape& p,
            const TensorView& out, cudaStream_t stream) {
  const int64_t n = p.B * p.H * p.S * (p.D / 2 / V);
  const auto blocks = static_cast<unsigned>(std::min(ceil_div(n, kThreads), kMaxBlocks));
  rope_kernel<T, V, kBackward>
      <<<blocks, kThreads, 0, stream>>>(x.ptr<T>(), cos.ptr<T>(), sin.ptr<T>(), p, out.ptr<T>());
}

// Every offset a thread forms (half, row strides, pointers) must keep V-element packs aligned.
template <typename T, int V>
bool fits(const RopeShape& p, std::initializer_list<const void*> ptrs) {
  if ((p.D / 2) % V != 0) return false;
  for (int d = 0; d < 3; ++d)
    if (p.xs[d] % V != 0 || p.ys[d] % V != 0) return false;
  for (const void* q : ptrs)
    if (reinterpret_cast<uintptr_t>(q) % (sizeof(T) * V) != 0) return false;
  return true;
}

template <typename T, bool kBackward, int V>
void launch_widest(const TensorView& x, const TensorView& cos, const TensorView& sin, const RopeShape& p,
                   const TensorView& out, cudaStream_t stream) {
  if constexpr (V > 1) {
    if (!fits<T, V>(p, {x.data, cos.data, sin.data, out.data}))
      return launch_widest<T, kBackward, V / 2>(x, cos, sin, p, out, stream);
  }
  launch<T, kBackward, V>(x, cos, sin, p, out, stream);
}

}  // namespace

void rope(const TensorView& x, const TensorView& cos, const TensorView& sin, const TensorView& out, bool backward,
          void* stream) {
  RopeShape p{x.shape[0], x.shape[1], x.shape[2], x.shape[3], {}, {}, 0};
  if (x.numel() == 0) return;
  for (int d = 0; d < 3; ++d) {
    // A size-1 dim is never stepped over; its stride (arbitrary in DLPack) must not spoil the alignment test.
    p.xs[d] = x.shape[d] == 1 ? 0 : x.strides[d];
    p.ys[d] = out.shape[d] == 1 ? 0 : out.strides[d];
  }
  p.cos_b = cos.shape[0] == 1 ? 0 : p.S * p.D;
  cudaStream_t s = as_stream(stream);
  MOE8_DISPATCH_FLOAT(x.dtype, "rope: x", [&] {
    using T = scalar_t;
    constexpr int kWidest = 16 / sizeof(T);
    if (backward)
      launch_widest<T, true, kWidest>(x, cos, sin, p, out, s);
    else
      launch_widest<T, false, kWidest>(x, cos, sin, p, out, s);
    check_launch("rope_kernel");
  });
}

}  // namespace moe8::cuda
