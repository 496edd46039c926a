// common.cuh — what every CUDA kernel file shares: storage-type traits, float conversion, launch checks,
// and the dtype dispatch used by launchers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <mutex>

#include "core/error.h"
#include "core/tensor.h"

namespace moe8::cuda {

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  return static_cast<float>(v);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half v) {
  return __half2float(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  return static_cast<T>(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw CudaError(std::string(what) + ": " + cudaGetErrorString(e));
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

constexpr int kMaxDevices = 64;

// What kernels size their grids by, queried once per device (zeros if the query fails).
struct DeviceFacts {
  int sms = 0, major = 0, minor = 0;
};

inline DeviceFacts device_facts(int device) {
  static std::array<std::once_flag, kMaxDevices> once;
  static std::array<DeviceFacts, kMaxDevices> facts;
  if (device < 0 || device >= kMaxDevices) return {};
  std::call_once(once[device], [device] {
    DeviceFacts f;
    if (cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&f.major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&f.minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
      (void)cudaGetLastError();
      f = DeviceFacts{};
    }
    facts[device] = f;
  });
  return facts[device];
}

inline int current_device(const char* what) {
  int d = 0;
  cuda_check(cudaGetDevice(&d), what);
  return d;
}

// Rows [begin, end) of group e as the kernels that walk groups read them: offsets clamped to [0, rows], and
// each end to at least its begin. Bad offsets (validation skipped) give wrong results, never an access outside
// the tensors.
__device__ __forceinline__ void group_range(const int32_t* __restrict__ offsets, int e, int64_t rows, int64_t& begin,
                                            int64_t& end) {
  const int64_t b = offsets[e], x = offsets[e + 1];
  begin = b < 0 ? 0 : (b > rows ? rows : b);
  end = x < begin ? begin : (x > rows ? rows : x);
}

}  // namespace moe8::cuda

// Calls F.template operator()<T>() with T the CUDA storage type of a float dtype (f32, f16, bf16).
#define MOE8_DISPATCH_FLOAT(dtype, NAME, ...)                                  \
  [&] {                                                                        \
    switch (dtype) {                                                           \
      case ::moe8::DType::kF32: {                                              \
        using scalar_t = float;                                                \
        return __VA_ARGS__();                                                  \
      }                                                                        \
      case ::moe8::DType::kF16: {                                              \
        using scalar_t = __half;                                               \
        return __VA_ARGS__();                                                  \
      }                                                                        \
      case ::moe8::DType::kBF16: {                                             \
        using scalar_t = __nv_bfloat16;                                        \
        return __VA_ARGS__();                                                  \
      }                                                                        \
      default:                                                                 \
        ::moe8::fail(NAME, ": unsupported dtype ", ::moe8::dtype_name(dtype)); \
    }                                                                          \
  }()
