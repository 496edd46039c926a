// optim.cu — the AdamW step. The tensors of a batch are cut into chunks of kChunk elements, one block a chunk; a
// thread updates 16-byte packs of the four tensors, kUnroll packs loaded before any is stored so that enough bytes
// are in flight to stream them at the memory's rate. Each element is core/adamw.h's update: the CPU reference's bits.
#include "core/adamw.h"
#include "cuda/common.cuh"
#include "cuda/ops.h"
#include "cuda/optim.h"

namespace moe8::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int64_t kChunk = 16384;  // elements per block: a multiple of every pack size

// A batch of tensors, passed by value (under the 4 KB kernel-argument limit).
struct AdamWBatch {
  void* p[kAdamWBatch];
  const void* g[kAdamWBatch];
  void* m[kAdamWBatch];
  void* v[kAdamWBatch];
  int64_t n[kAdamWBatch];
  int64_t first_chunk[kAdamWBatch + 1];  // the chunks of the tensors before each, then the total
  bool packed[kAdamWBatch];              // all four pointers 16-byte aligned
};
static_assert(sizeof(AdamWBatch) <= 4000, "AdamWBatch must fit the kernel-argument space");

template <typename T>
__device__ __forceinline__ void update_one(const AdamWScalars& s, T* p, const T* g, T* m, T* v, int64_t j) {
  float pf = to_float(p[j]), mf = to_float(m[j]), vf = to_float(v[j]);
  adamw_update(s, to_float(g[j]), pf, mf, vf);
  p[j] = from_float<T>(pf);
  m[j] = from_float<T>(mf);
  v[j] = from_float<T>(vf);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) adamw_kernel(const __grid_constant__ AdamWBatch b, const AdamWScalars s) {
  const int64_t c = blockIdx.x;
  int t = 0;
  while (c >= b.first_chunk[t + 1]) ++t;
  T* __restrict__ p = static_cast<T*>(b.p[t]);
  const T* __restrict__ g = static_cast<const T*>(b.g[t]);
  T* __restrict__ m = static_cast<T*>(b.m[t]);
  T* __restrict__ v = static_cast<T*>(b.v[t]);
  const int64_t begin = (c - b.first_chunk[t]) * kChunk;
  const int64_t end = min(b.n[t], begin + kChunk);
  int64_t tail = begin;
  if (b.packed[t]) {
    constexpr int kN = 16 / sizeof(T);
    const int64_t packs = (end - begin) / kN;
    for (int64_t base = threadIdx.x; base < packs; base += kThreads * kUnroll) {
      uint4 pv[kUnroll], gv[kUnroll], mv[kUnroll], vv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * kThreads;
        if (i < packs) {
          const int64_t j = begin + i * kN;
          pv[u] = __ldcs(reinterpret_cast<const uint4*>(p + j));
          gv[u] = __ldcs(reinterpret_cast<const uint4*>(g + j));
          mv[u] = __ldcs(reinterpret_cast<const uint4*>(m + j));
          vv[u] = __ldcs(reinterpret_cast<const uint4*>(v + j));
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * kThreads;
        if (i < packs) {
          T* pe = reinterpret_cast<T*>(&pv[u]);
          const T* ge = reinterpret_cast<const T*>(&gv[u]);
          T* me = reinterpret_cast<T*>(&mv[u]);
          T* ve = reinterpret_cast<T*>(&vv[u]);
#pragma unroll
          for (int e = 0; e < kN; ++e) {
            float pf = to_float(pe[e]), mf = to_float(me[e]), vf = to_float(ve[e]);
            adamw_update(s, to_float(ge[e]), pf, mf, vf);
            pe[e] = from_float<T>(pf);
            me[e] = from_float<T>(mf);
            ve[e] = from_float<T>(vf);
          }
          const int64_t j = begin + i * kN;
          __stcs(reinterpret_cast<uint4*>(p + j), pv[u]);
          __stcs(reinterpret_cast<uint4*>(m + j), mv[u]);
          __stcs(reinterpret_cast<uint4*>(v + j), vv[u]);
        }
      }
    }
    tail = begin + packs * kN;
  }
  for (int64_t j = tail + threadIdx.x; j < end; j += kThreads) update_one(s, p, g, m, v, j);
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

void adamw_step(const std::vector<TensorView>& params, const std::vector<TensorView>& grads,
                const std::vector<TensorView>& exp_avgs, const std::vector<TensorView>& exp_avg_sqs,
                const AdamWScalars& s, void* stream) {
  if (params.empty()) return;
  MOE8_DISPATCH_FLOAT(params[0].dtype, "adamw_step", [&] {
    for (size_t first = 0; first < params.size(); first += kAdamWBatch) {
      const size_t count = std::min<size_t>(kAdamWBatch, params.size() - first);
      AdamWBatch b{};
      int64_t chunks = 0;
      for (size_t i = 0; i < count; ++i) {
        const size_t k = first + i;
        b.p[i] = params[k].data;
        b.g[i] = grads[k].data;
        b.m[i] = exp_avgs[k].data;
        b.v[i] = exp_avg_sqs[k].data;
        b.n[i] = params[k].numel();
        b.packed[i] = aligned16(b.p[i]) && aligned16(b.g[i]) && aligned16(b.m[i]) && aligned16(b.v[i]);
        b.first_chunk[i] = chunks;
        chunks += ceil_div(b.n[i], kChunk);
      }
      for (size_t i = count; i <= static_cast<size_t>(kAdamWBatch); ++i) b.first_chunk[i] = chunks;
      if (chunks == 0) continue;
      MOE8_CHECK(chunks < (int64_t{1} << 31), "adamw_step: ", chunks, " chunks of ", kChunk,
                 " elements exceed one grid; pass fewer tensors per call");
      adamw_kernel<scalar_t><<<static_cast<unsigned>(chunks), kThreads, 0, as_stream(stream)>>>(b, s);
      check_launch("adamw_step");
    }
  });
}

}  // namespace moe8::cuda
