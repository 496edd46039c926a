// dense_gemm_sm90.cu — one dense bf16 GEMM, D [M, N] = A [M, K] · B [N, K]^T (row-major, the expert forward's
// layout), or L of them strided-batched (a weight each: equal experts), timed on CUTLASS's plain (not ptr-array)
// sm_90a kernels and on cuBLAS: what the tile configurations of moe8's grouped kernels reach without any grouping
// machinery (fixed TMA descriptors, the batch a coordinate), against the library's kernel on the same shape. A
// measurement tool, not part of the extension.
//
//   nvcc -O3 -DNDEBUG -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -I$CUTLASS/include -I$CUTLASS/tools/util/include \
//     bench/cpp/dense_gemm_sm90.cu -lcublas -o dense_gemm_sm90
//   ./dense_gemm_sm90 [M N K [iters [L]]]   (default: Qwen3-30B-A3B's up projection, 131072 1536 2048;
//                                            L 128 with M 1024: its 128 experts of 1,024 rows each)
// (-DNDEBUG as the extension builds: CUTLASS's asserts are calls that serialise the wgmma pipeline.
// CUTLASS: the source/ folder of the pinned nvidia-cutlass wheel's cutlass_library package, or a CUTLASS checkout.)
//
// Prints, per kernel, the median milliseconds of `iters` launches (CUDA events, after warm-up), TFLOP/s, and
// whether its output matches cuBLAS's (max |difference| relative to max |D|).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;
using T = cutlass::bfloat16_t;

#define CHECK_CUDA(x)                                                                 \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

template <class Tile, class Cluster, class KernelSchedule, class EpilogueSchedule, class EpilogueTile>
struct Dense {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster, EpilogueTile, float, float, void,
      cutlass::layout::RowMajor, 8, T, cutlass::layout::RowMajor, 8, EpilogueSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, 8, T,
      cutlass::layout::ColumnMajor, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // A launcher for D = A · B^T, its workspace allocated once.
  static std::function<void()> make(int M, int N, int K, int L, const T* a, const T* b, T* d, int sms) {
    using SA = typename Kernel::StrideA;
    using SB = typename Kernel::StrideB;
    using SD = typename Kernel::StrideD;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {M, N, K, L},
        {a, cutlass::make_cute_packed_stride(SA{}, {M, K, L}), b, cutlass::make_cute_packed_stride(SB{}, {N, K, L})},
        {{1.0f, 0.0f}, nullptr, SD{}, d, cutlass::make_cute_packed_stride(SD{}, {M, N, L})}};
    args.hw_info.sm_count = sms;
    auto gemm = std::make_shared<Gemm>();
    void* ws = nullptr;
    const size_t bytes = Gemm::get_workspace_size(args);
    if (bytes) CHECK_CUDA(cudaMalloc(&ws, bytes));
    if (gemm->can_implement(args) != cutlass::Status::kSuccess ||
        gemm->initialize(args, ws) != cutlass::Status::kSuccess) {
      std::fprintf(stderr, "CUTLASS: cannot run this configuration\n");
      std::exit(1);
    }
    return [gemm] {
      if (gemm->run() != cutlass::Status::kSuccess) std::exit(2);
    };
  }
};

using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CoopEpi = cutlass::epilogue::TmaWarpSpecializedCooperative;
using Pong = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using PongEpi = cutlass::epilogue::TmaWarpSpecialized;
using Auto = cutlass::epilogue::collective::EpilogueTileAuto;

// moe8's grouped tiles, here on one dense problem: kEpi64 (128x256, 1x2, 128x64 subtiles), kTall (256x128, 1x2),
// kPong128 (128x128 ping-pong, 2x1), kM2-like (128x256, 2x1).
using Epi64 = Dense<Shape<_128, _256, _64>, Shape<_1, _2, _1>, Coop, CoopEpi, Shape<_128, _64>>;
using Tall = Dense<Shape<_256, _128, _64>, Shape<_1, _2, _1>, Coop, CoopEpi, Auto>;
using Pong128 = Dense<Shape<_128, _128, _64>, Shape<_2, _1, _1>, Pong, PongEpi, Auto>;
using Large2x1 = Dense<Shape<_128, _256, _64>, Shape<_2, _1, _1>, Coop, CoopEpi, Shape<_128, _64>>;

__global__ void fill(T* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    p[i] = T((static_cast<float>(x & 0xffff) / 65535.0f - 0.5f));
  }
}

float median_ms(const std::function<void()>& f, int iters) {
  for (int i = 0; i < 5; ++i) f();
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> ms(iters);
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  for (int i = 0; i < iters; ++i) {
    CHECK_CUDA(cudaEventRecord(e0));
    f();
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    CHECK_CUDA(cudaEventElapsedTime(&ms[i], e0, e1));
  }
  std::sort(ms.begin(), ms.end());
  return ms[iters / 2];
}

std::vector<float> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  CHECK_CUDA(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = static_cast<float>(h[i]);
  return f;
}

int main(int argc, char** argv) {
  const int M = argc > 3 ? std::atoi(argv[1]) : 131072, N = argc > 3 ? std::atoi(argv[2]) : 1536,
            K = argc > 3 ? std::atoi(argv[3]) : 2048, iters = argc > 4 ? std::atoi(argv[4]) : 20,
            L = argc > 5 ? std::atoi(argv[5]) : 1;
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs; %d x D [%d, %d] = A [%d, %d] . B [%d, %d]^T, bf16, fp32 accumulation\n", prop.name, sms, L,
              M, N, M, K, N, K);
  const size_t na = size_t(L) * M * K, nb = size_t(L) * N * K, nd = size_t(L) * M * N;
  T *a, *b, *d;
  CHECK_CUDA(cudaMalloc(&a, sizeof(T) * na));
  CHECK_CUDA(cudaMalloc(&b, sizeof(T) * nb));
  CHECK_CUDA(cudaMalloc(&d, sizeof(T) * nd));
  fill<<<1024, 256>>>(a, na, 1);
  fill<<<1024, 256>>>(b, nb, 2);
  cublasHandle_t h;
  cublasCreate(&h);
  const float one = 1.0f, zero = 0.0f;
  auto cublas = [&] {  // row-major D = A . B^T as column-major D^T = B . A^T
    if (L == 1)
      cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, b, CUDA_R_16BF, K, a, CUDA_R_16BF, K, &zero, d,
                   CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    else
      cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, b, CUDA_R_16BF, K, (long long)N * K, a,
                                 CUDA_R_16BF, K, (long long)M * K, &zero, d, CUDA_R_16BF, N, (long long)M * N, L,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  const double flop = 2.0 * M * N * K * L;
  cublas();
  CHECK_CUDA(cudaDeviceSynchronize());
  const std::vector<float> ref = to_host(d, nd);
  float ref_max = 0;
  for (float v : ref) ref_max = std::max(ref_max, std::fabs(v));
  struct Case {
    const char* name;
    std::function<void()> run;
  };
  std::vector<Case> cases = {{"cublas", cublas},
                             {"epi64 128x256 1x2 coop", Epi64::make(M, N, K, L, a, b, d, sms)},
                             {"tall 256x128 1x2 coop", Tall::make(M, N, K, L, a, b, d, sms)},
                             {"pong128 128x128 2x1 ping-pong", Pong128::make(M, N, K, L, a, b, d, sms)},
                             {"128x256 2x1 coop", Large2x1::make(M, N, K, L, a, b, d, sms)}};
  for (int round = 0; round < 2;
       ++round) {  // twice, round-robin: the second round after every kernel warmed the clocks
    for (const Case& c : cases) {
      const float ms = median_ms(c.run, iters);
      CHECK_CUDA(cudaDeviceSynchronize());
      const std::vector<float> out = to_host(d, nd);
      float diff = 0;
      for (size_t i = 0; i < out.size(); ++i) diff = std::max(diff, std::fabs(out[i] - ref[i]));
      std::printf("round %d  %-32s %8.3f ms %7.1f TFLOP/s  max|diff|/max|D| %.2e\n", round, c.name, ms, flop / ms / 1e9,
                  diff / ref_max);
    }
  }
  return 0;
}
