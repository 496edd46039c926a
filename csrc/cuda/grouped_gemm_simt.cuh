// grouped_gemm_simt.cuh — the plain-FFMA main loop of the grouped GEMMs: fp32 inputs (no TF32, for
// accuracy) and 16-bit inputs whose sizes or pointers rule out 16-byte loads. One 128x128 output tile per
// 256-thread block, 8x8 outputs per thread, K in steps of 8, guarded element loads (any shape, any
// alignment) staged through registers into double-buffered fp32 shared memory.
#pragma once
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/grouped_gemm_mma.cuh"  // Operand

namespace moe8::cuda::gg {

template <typename T, bool kAKMajor, bool kBKMajor>
struct SimtMainloop {
  static constexpr int kBM = 128, kBN = 128, kBK = 8, kThreads = 256;
  static constexpr int kLoads = kBM * kBK / kThreads;  // elements per thread per operand per k-tile
  static_assert(kBM == kBN && kBM * kBK % kThreads == 0, "SimtMainloop: tile shape");
  // NOTES: tiles are stored k-outer ([k][i]) so the compute loop reads float4 rows; the pad of 4 floats
  // keeps the transposing stores of K-major tiles (8 k x 4 i per warp) free of bank conflicts.
  static constexpr int kLd = kBM + 4;
  struct Smem {
    float a[2][kBK][kLd];
    float b[2][kBK][kLd];
  };
  static constexpr int kSmemBytes = 0;  // dynamic; Smem is static shared memory
  static constexpr int kMinBlocks = 1;  // 64 accumulators + 16 prefetch registers do not fit in 128
  using Acc = float[8][8];

  template <bool kKMajor>
  static __device__ __forceinline__ void load_regs(float (&r)[kLoads], const Operand<T>& op, int64_t i0, int64_t k0) {
#pragma unroll
    for (int it = 0; it < kLoads; ++it) {
      const int e = threadIdx.x + it * kThreads;
      // Consecutive threads walk the contiguous dimension, so global reads coalesce.
      const int i = kKMajor ? e / kBK : e % kBM, k = kKMajor ? e % kBK : e / kBM;
      const int64_t gi = i0 + i, gk = k0 + k;
      r[it] = (gi < op.i_end && gk < op.k_end) ? to_float(op.ptr[kKMajor ? gi * op.ld + gk : gk * op.ld + gi]) : 0.f;
    }
  }

  template <bool kKMajor>
  static __device__ __forceinline__ void store_regs(float (*s)[kLd], const float (&r)[kLoads]) {
#pragma unroll
    for (int it = 0; it < kLoads; ++it) {
      const int e = threadIdx.x + it * kThreads;
      const int i = kKMajor ? e / kBK : e % kBM, k = kKMajor ? e % kBK : e / kBM;
      s[k][i] = r[it];
    }
  }

  // acc must be zeroed by the caller. All threads of the block must call this (it synchronises).
  static __device__ __forceinline__ void run(Smem& s, const Operand<T>& a, int64_t m0, const Operand<T>& b, int64_t n0,
                                             int64_t k_begin, int64_t k_end, Acc& acc) {
    const int num_k = static_cast<int>((k_end - k_begin + kBK - 1) / kBK);
    if (num_k <= 0) return;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float ra[kLoads], rb[kLoads];
    load_regs<kAKMajor>(ra, a, m0, k_begin);
    load_regs<kBKMajor>(rb, b, n0, k_begin);
    store_regs<kAKMajor>(s.a[0], ra);
    store_regs<kBKMajor>(s.b[0], rb);
    __syncthreads();
    for (int kt = 0; kt < num_k; ++kt) {
      const int buf = kt & 1;
      const bool more = kt + 1 < num_k;
      if (more) {  // global loads in flight while this k-tile is computed
        const int64_t k0 = k_begin + static_cast<int64_t>(kt + 1) * kBK;
        load_regs<kAKMajor>(ra, a, m0, k0);
        load_regs<kBKMajor>(rb, b, n0, k0);
      }
#pragma unroll
      for (int k = 0; k < kBK; ++k) {
        float av[8], bv[8];
        *reinterpret_cast<float4*>(av) = *reinterpret_cast<const float4*>(&s.a[buf][k][ty * 4]);
        *reinterpret_cast<float4*>(av + 4) = *reinterpret_cast<const float4*>(&s.a[buf][k][64 + ty * 4]);
        *reinterpret_cast<float4*>(bv) = *reinterpret_cast<const float4*>(&s.b[buf][k][tx * 4]);
        *reinterpret_cast<float4*>(bv + 4) = *reinterpret_cast<const float4*>(&s.b[buf][k][64 + tx * 4]);
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
      }
      if (more) {  // the other buffer was last read in iteration kt - 1, before the barrier below it
        store_regs<kAKMajor>(s.a[buf ^ 1], ra);
        store_regs<kBKMajor>(s.b[buf ^ 1], rb);
      }
      __syncthreads();
    }
  }

  // Calls f(row, col, v) for every accumulator of this thread, row and col relative to the tile origin.
  template <class F>
  static __device__ __forceinline__ void for_each_acc(const Acc& acc, F&& f) {
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) f((i / 4) * 64 + ty * 4 + i % 4, (j / 4) * 64 + tx * 4 + j % 4, acc[i][j]);
  }
};

}  // namespace moe8::cuda::gg
