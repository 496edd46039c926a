// grouped_gemm_mma.cuh — the tensor-core main loop of the grouped GEMMs (16-bit inputs, fp32 accumulators):
// one 128x128 output tile per 256-thread block (8 warps of 64x32), K in steps of 64 through a 3-stage
// cp.async pipeline, mma.sync m16n8k16 fed by ldmatrix (.trans where the stored tile is not K-contiguous).
// Two blocks per SM. Portable to sm_80; the Hopper wgmma/TMA kernels are a separate family.
#pragma once
#include <cstdint>
#include <type_traits>

#include "cuda/common.cuh"

namespace moe8::cuda::gg {

// Element (i, k) of a logical [I, K] operand (I = M for A, N for B). K-major: stored at ptr[i * ld + k];
// otherwise at ptr[k * ld + i]. Elements with i >= i_end or k >= k_end read as zero.
template <typename T>
struct Operand {
  const T* ptr;
  int64_t ld;
  int64_t i_end;
  int64_t k_end;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// NOTES: src-size 0 makes cp.async write zeros without reading src; src still points into the tensor.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
  }
}

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    static_assert(std::is_same_v<T, __half>, "mma_16816: bf16 or f16 only");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// C[kBM, kBN] += A[kBM, k_begin:k_end] · B[kBN, k_begin:k_end]^T for one block.
// Requirements (the launcher checks them): ptr 16-byte aligned; the contiguous extent (k_end for a K-major
// operand, i_end otherwise) and ld multiples of 8, so each 16-byte chunk is wholly inside or outside;
// k_begin a multiple of 8 when the operand is K-major.
template <typename T, bool kAKMajor, bool kBKMajor>
struct MmaMainloop {
  static constexpr int kBM = 128, kBN = 128, kBK = 64, kStages = 3, kThreads = 256;
  static constexpr int kWarpsN = 4, kWarpM = 64, kWarpN = kBN / kWarpsN;  // 2 x 4 warps
  // 64 accumulators per thread (64x32 warp tiles) fit in the 128 registers that two blocks per SM allow.
  static constexpr int kMinBlocks = kWarpN <= 32 ? 2 : 1;
  static constexpr int kMI = kWarpM / 16, kNI = kWarpN / 8;
  // NOTES: 16 bytes of padding per smem row makes the 8 row addresses of every ldmatrix (and of the
  // cp.async chunks) fall into distinct 16-byte bank groups (pitch 144 B for K-major tiles, 272 B otherwise).
  static constexpr int kPad = 8;
  static constexpr int kALd = kAKMajor ? kBK + kPad : kBM + kPad;
  static constexpr int kBLd = kBKMajor ? kBK + kPad : kBN + kPad;
  static constexpr int kAStage = (kAKMajor ? kBM : kBK) * kALd;
  static constexpr int kBStage = (kBKMajor ? kBN : kBK) * kBLd;
  static constexpr int kSmemBytes = kStages * (kAStage + kBStage) * static_cast<int>(sizeof(T));
  static_assert(kMinBlocks * kSmemBytes <= 220 * 1024, "MmaMainloop: shared memory per SM");
  using Acc = float[kMI][kNI][4];

  // Stages the [kI, kBK] tile at (i0, k0) of op into smem s (as [kI][kBK + pad] or [kBK][kI + pad]).
  // Thread t copies the 16-byte chunks (row0 + j * kRowStep, col) of the stored tile, so its column, and
  // hence the contiguous-dimension bound check, is the same for all its chunks.
  template <bool kKMajor, int kI>
  static __device__ __forceinline__ void load_tile(T* s, const Operand<T>& op, int64_t i0, int64_t k0) {
    constexpr int kCols = kKMajor ? kBK : kI;  // contiguous extent of the stored tile
    constexpr int kRows = kKMajor ? kI : kBK;
    constexpr int kLd = kCols + kPad;
    constexpr int kChunksPerRow = kCols / 8;
    constexpr int kRowStep = kThreads / kChunksPerRow;
    static_assert(kThreads % kChunksPerRow == 0 && kRows % kRowStep == 0, "load_tile: uneven split");
    const int row0 = threadIdx.x / kChunksPerRow, col = (threadIdx.x % kChunksPerRow) * 8;
    const int64_t g_col = (kKMajor ? k0 : i0) + col, g_row0 = (kKMajor ? i0 : k0) + row0;
    const int64_t row_end = kKMajor ? op.i_end : op.k_end;
    const bool col_ok = g_col < (kKMajor ? op.k_end : op.i_end);
    const T* src = op.ptr + g_row0 * op.ld + g_col;
    T* dst = s + row0 * kLd + col;
#pragma unroll
    for (int j = 0; j < kRows / kRowStep; ++j) {
      const bool valid = col_ok && g_row0 + j * kRowStep < row_end;
      cp_async_16(dst + j * kRowStep * kLd, valid ? src + j * kRowStep * op.ld : op.ptr, valid);
    }
  }

  static __device__ __forceinline__ void load_stage(T* sa, T* sb, const Operand<T>& a, int64_t m0, const Operand<T>& b,
                                                    int64_t n0, int64_t k0) {
    load_tile<kAKMajor, kBM>(sa, a, m0, k0);
    load_tile<kBKMajor, kBN>(sb, b, n0, k0);
  }

  static __device__ __forceinline__ void compute_stage(const T* sa, const T* sb, Acc& acc) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = (warp / kWarpsN) * kWarpM, wn = (warp % kWarpsN) * kWarpN;
#pragma unroll
    for (int ks = 0; ks < kBK; ks += 16) {
      uint32_t af[kMI][4], bf[kNI][2];
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi) {
        // Matrices 0..3 of the x4 are a0..a3: (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15).
        if constexpr (kAKMajor) {
          const int m = wm + mi * 16 + (lane & 15), k = ks + (lane >> 4) * 8;
          ldmatrix_x4<false>(af[mi], sa + m * kALd + k);
        } else {
          const int m = wm + mi * 16 + ((lane >> 3) & 1) * 8, k = ks + (lane & 7) + (lane >> 4) * 8;
          ldmatrix_x4<true>(af[mi], sa + k * kALd + m);
        }
      }
#pragma unroll
      for (int nj = 0; nj < kNI / 2; ++nj) {
        // Matrices 0..3 are b0, b1 of n-tile 2nj and b0, b1 of n-tile 2nj+1:
        // (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
        uint32_t r[4];
        if constexpr (kBKMajor) {
          const int n = wn + nj * 16 + (lane & 7) + (lane >> 4) * 8, k = ks + ((lane >> 3) & 1) * 8;
          ldmatrix_x4<false>(r, sb + n * kBLd + k);
        } else {
          const int n = wn + nj * 16 + (lane >> 4) * 8, k = ks + (lane & 7) + ((lane >> 3) & 1) * 8;
          ldmatrix_x4<true>(r, sb + k * kBLd + n);
        }
        bf[2 * nj][0] = r[0];
        bf[2 * nj][1] = r[1];
        bf[2 * nj + 1][0] = r[2];
        bf[2 * nj + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
        for (int ni = 0; ni < kNI; ++ni) mma_16816<T>(acc[mi][ni], af[mi], bf[ni]);
    }
  }

  // acc must be zeroed by the caller. All threads of the block must call this (it synchronises).
  static __device__ __forceinline__ void run(unsigned char* smem, const Operand<T>& a, int64_t m0, const Operand<T>& b,
                                             int64_t n0, int64_t k_begin, int64_t k_end, Acc& acc) {
    T* sa = reinterpret_cast<T*>(smem);
    T* sb = sa + kStages * kAStage;
    const int num_k = static_cast<int>((k_end - k_begin + kBK - 1) / kBK);
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < num_k) load_stage(sa + s * kAStage, sb + s * kBStage, a, m0, b, n0, k_begin + s * kBK);
      cp_async_commit();  // empty groups too, so that group i always holds k-tile i
    }
    for (int kt = 0; kt < num_k; ++kt) {
      cp_async_wait<kStages - 2>();  // k-tile kt has landed (this thread's part) ...
      __syncthreads();               // ... for every thread, and stage (kt - 1) % kStages is free again
      const int next = kt + kStages - 1;
      if (next < num_k) {
        const int s = next % kStages;
        load_stage(sa + s * kAStage, sb + s * kBStage, a, m0, b, n0, k_begin + static_cast<int64_t>(next) * kBK);
      }
      cp_async_commit();
      const int s = kt % kStages;
      compute_stage(sa + s * kAStage, sb + s * kBStage, acc);
    }
    cp_async_wait<0>();
  }

  // Calls f(row, col, v0, v1) for the accumulator pairs (row, col) and (row, col + 1) of this thread,
  // row and col relative to the tile origin.
  template <class F>
  static __device__ __forceinline__ void for_each_acc(const Acc& acc, F&& f) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = (warp / kWarpsN) * kWarpM, wn = (warp % kWarpsN) * kWarpN;
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          f(wm + mi * 16 + (lane >> 2) + h * 8, wn + ni * 8 + (lane & 3) * 2, acc[mi][ni][2 * h],
            acc[mi][ni][2 * h + 1]);
  }
};

}  // namespace moe8::cuda::gg
