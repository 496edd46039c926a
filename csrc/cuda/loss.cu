// loss.cu — cross-entropy rows of the chunked LM loss (semantics: cpu/ops.h): a block per row, two passes
// over it. Pass 1 keeps a running (max, sum of exp(x - max)) per thread over V-element packs (one rescale
// per pack whose max is new, one exponential per value), combined across the block, and copies the row's first
// packs (up to kStageBytes) into shared memory; pass 2 overwrites the row with exp(x - lse) - [j == target],
// reading the staged packs from shared memory and the rest again from global memory. The row's target logit
// is read between the passes. A Qwen3 row (151,936 bf16 logits, 297 KiB) stages 192 KiB: a block fills an
// SM's shared memory, so ~132 rows are in flight and the ~105 KiB each reads twice (14 MB) fits in L2: meant
// to cross DRAM once each way instead of reading the row twice (the kernel runs below the memory rate either
// way, 2.4 TB/s, so the saving is not measured apart). The per-value exponentials are __expf
// (ex2.approx of x log2 e, 2 ulp near the row's max, where the terms that matter are): 14% faster than expf
// on 8,192 Qwen3 rows (bench/results/loss_h200.md). Float32 math, so not bitwise the CPU reference.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/ops.h"
#include "cuda/rowwise.cuh"

namespace moe8::cuda {
namespace {

constexpr int kThreads = 1024, kWarps = kThreads / 32;
constexpr int64_t kStageBytes = 192 << 10;  // at most; of the 227 KiB an sm_90 block may take

// (max, sum of exp(x - max)) pairs combined; an all -inf side contributes nothing.
struct MaxSum {
  float m, s;
};

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

template <typename T, int V>
__device__ __forceinline__ void load_pack(const T* row, int64_t j, int64_t C, bool vec, float (&v)[V]) {
  if (vec && j + V <= C) {
    const Pack<T, V> p = *reinterpret_cast<const Pack<T, V>*>(row + j);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = to_float(p.v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = j + k < C ? to_float(row[j + k]) : -INFINITY;
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_rows_kernel(T* __restrict__ logits, const int64_t* __restrict__ target, int64_t C,
                              int64_t ignore_index, bool vec, int64_t staged, float* __restrict__ loss) {
  extern __shared__ uint4 stage_words[];  // packs [staged] of the row (16 bytes each)
  Pack<T, V>* stage = reinterpret_cast<Pack<T, V>*>(stage_words);
  __shared__ MaxSum part[kWarps];
  __shared__ float lse_s, xt_s;
  T* row = logits + static_cast<int64_t>(blockIdx.x) * C;
  MaxSum acc{-INFINITY, 0.f};
  int nan = 0;  // a NaN logit makes the row's lse NaN, as on the CPU (fmaxf would drop it from the max)
#pragma unroll 4
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * V; j < C; j += static_cast<int64_t>(kThreads) * V) {
    float v[V];
    if (j / V < staged) {  // staged implies vec and a whole pack
      const Pack<T, V> p = *reinterpret_cast<const Pack<T, V>*>(row + j);
      stage[j / V] = p;
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = to_float(p.v[k]);
    } else {
      load_pack<T, V>(row, j, C, vec, v);
    }
    float pm = v[0];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      pm = fmaxf(pm, v[k]);
      nan |= isnan(v[k]);
    }
    if (pm > acc.m) {
      acc.s *= __expf(acc.m - pm);
      acc.m = pm;
    }
    if (acc.m != -INFINITY) {
#pragma unroll
      for (int k = 0; k < V; ++k) acc.s += __expf(v[k] - acc.m);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    acc = combine(acc, {__shfl_xor_sync(0xffffffffu, acc.m, o), __shfl_xor_sync(0xffffffffu, acc.s, o)});
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = acc;
  nan = __syncthreads_or(nan);
  const int64_t t = target[blockIdx.x];
  const bool ignored = t == ignore_index, in_range = t >= 0 && t < C;
  if (threadIdx.x == 0) {
    MaxSum all = part[0];
    for (int w = 1; w < kWarps; ++w) all = combine(all, part[w]);
    lse_s = nan ? NAN : all.m + logf(all.s);
    xt_s = in_range ? to_float(row[t]) : 0.f;
    loss[blockIdx.x] = ignored ? 0.f : in_range ? lse_s - xt_s : NAN;
  }
  __syncthreads();  // the target's logit is read before pass 2 overwrites it
  const float lse = lse_s;
#pragma unroll 4
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * V; j < C; j += static_cast<int64_t>(kThreads) * V) {
    float v[V];
    if (j / V < staged) {
      const Pack<T, V> p = stage[j / V];
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = to_float(p.v[k]);
    } else {
      load_pack<T, V>(row, j, C, vec, v);
    }
    Pack<T, V> out;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float g = ignored ? 0.f : in_range ? __expf(v[k] - lse) - (j + k == t ? 1.f : 0.f) : NAN;
      out.v[k] = from_float<T>(g);
    }
    if (vec && j + V <= C) {
      *reinterpret_cast<Pack<T, V>*>(row + j) = out;
    } else {
      for (int k = 0; k < V && j + k < C; ++k) row[j + k] = out.v[k];
    }
  }
}

}  // namespace

void cross_entropy_rows(const TensorView& logits, const TensorView& target, int64_t ignore_index,
                        const TensorView& loss, void* stream) {
  const int64_t n = logits.shape[0], C = logits.shape[1];
  if (n == 0) return;
  MOE8_DISPATCH_FLOAT(logits.dtype, "cross_entropy_rows: logits", [&] {
    using T = scalar_t;
    constexpr int V = 16 / sizeof(T);  // one 16-byte load per pack
    const bool vec = C % V == 0 && reinterpret_cast<uintptr_t>(logits.data) % 16 == 0;
    int device = 0, optin = 0;  // the shared memory a block may take on this GPU (227 KiB on sm_90, 99 on sm_89)
    cuda_check(cudaGetDevice(&device), "cross_entropy_rows: cudaGetDevice");
    cuda_check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
               "cross_entropy_rows: cudaDeviceGetAttribute");
    const int64_t budget = std::min<int64_t>(kStageBytes, optin - 1024);  // leaves the static part its room
    const int64_t staged = vec ? std::clamp<int64_t>(budget / 16, 0, C / V) : 0;
    const size_t smem = static_cast<size_t>(staged) * 16;
    cuda_check(cudaFuncSetAttribute(cross_entropy_rows_kernel<T, V>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)),
               "cross_entropy_rows: cudaFuncSetAttribute");
    cross_entropy_rows_kernel<T, V><<<static_cast<unsigned>(n), kThreads, smem, as_stream(stream)>>>(
        logits.ptr<T>(), target.ptr<int64_t>(), C, ignore_index, vec, staged, loss.ptr<float>());
    check_launch("cross_entropy_rows_kernel");
  });
}

}  // namespace moe8::cuda
