// test_cuda_util.h — GPU side of the CUDA tests: device buffers, a Runner that calls an op through the
// same code on the CPU or the GPU (poisoning outputs first), and the skip when no device is visible.
// Only compiled when the CUDA backend is built (MOE8_WITH_CUDA).
#pragma once
#ifdef MOE8_WITH_CUDA
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/sm90_heuristics.h"
#include "test_ref.h"

namespace moe8::test {

inline void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Why the CUDA tests cannot run here, or "" when a device is usable.
inline std::string no_cuda_reason() {
  static const std::string reason = [] {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) return std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(e);
    if (n == 0) return std::string("cudaGetDeviceCount returned 0 devices");
    return std::string();
  }();
  return reason;
}

// Every CUDA test derives from this: it skips, printing why, where no GPU is visible.
class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why = no_cuda_reason();
    if (!why.empty()) GTEST_SKIP() << "no CUDA device: " << why;
  }
};

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) { cuda_ok(cudaMalloc(&ptr_, bytes ? bytes : 16), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

// Runs an op through identical code on either device. in(): view of an input (uploaded for the GPU).
// out(): view of an output, poisoned first (host: NaN / -12345; GPU: bytes 0xFF, i.e. NaN, for floats
// and -12345 for integers); finish() synchronises and copies GPU outputs back into their HostTensors.
class Runner {
 public:
  explicit Runner(bool gpu) : gpu_(gpu) {}
  bool gpu() const { return gpu_; }

  TensorView in(const HostTensor& t) {
    if (!gpu_) return t.view();
    DeviceBuffer& d = alloc(t.nbytes());
    cuda_ok(cudaMemcpy(d.get(), t.data(), t.nbytes(), cudaMemcpyHostToDevice), "upload");
    return view_of(d.get(), t.dtype(), t.shape(), DeviceType::kCUDA);
  }
  TensorView opt(const HostTensor* t) { return t ? in(*t) : absent(); }

  TensorView out(HostTensor& t) {
    t.poison();
    if (!gpu_) return t.view();
    DeviceBuffer& d = alloc(t.nbytes());
    if (t.dtype() == DType::kI32 || t.dtype() == DType::kI64)
      cuda_ok(cudaMemcpy(d.get(), t.data(), t.nbytes(), cudaMemcpyHostToDevice), "poison");
    else
      cuda_ok(cudaMemset(d.get(), 0xFF, t.nbytes()), "poison");
    outs_.push_back({&t, d.get()});
    return view_of(d.get(), t.dtype(), t.shape(), DeviceType::kCUDA);
  }

  // A tensor the op reads and overwrites: uploaded as it is, copied back by finish().
  TensorView inout(HostTensor& t) {
    if (!gpu_) return t.view();
    const TensorView v = in(t);
    outs_.push_back({&t, v.data});
    return v;
  }

  // int32 scratch of n elements (device only; absent on the CPU).
  TensorView workspace(int64_t n) {
    if (!gpu_) return absent();
    DeviceBuffer& d = alloc(static_cast<size_t>(n) * 4);
    return view_of(d.get(), DType::kI32, {n}, DeviceType::kCUDA);
  }

  void finish() {
    if (!gpu_) return;
    cuda_ok(cudaDeviceSynchronize(), "synchronize after the op");
    cuda_ok(cudaGetLastError(), "last error after the op");
    for (auto& o : outs_)
      cuda_ok(cudaMemcpy(o.first->data(), o.second, o.first->nbytes(), cudaMemcpyDeviceToHost), "download");
    outs_.clear();
  }

 private:
  DeviceBuffer& alloc(size_t bytes) {
    bufs_.push_back(std::make_unique<DeviceBuffer>(bytes));
    return *bufs_.back();
  }
  bool gpu_;
  std::vector<std::unique_ptr<DeviceBuffer>> bufs_;
  std::vector<std::pair<HostTensor*, void*>> outs_;
};

// Median milliseconds of fn() (launches on the default stream) over 10 runs after 3 warm-ups, CUDA events.
template <typename Fn>
double median_ms(Fn&& fn) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int i = 0; i < 3; ++i) fn();
  std::vector<float> ms;
  for (int i = 0; i < 10; ++i) {
    cudaEventRecord(e0);
    fn();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(ms.begin(), ms.end());
  return static_cast<double>(ms[ms.size() / 2]);
}

// Sets the MOE8_SM90_* override `var` to `value` (null: unsets it) and has the next GEMM see it: the kernels
// read these variables once per process, so this re-reads them (sm90_heuristics::reload_sm90_overrides).
inline void set_override(const char* var, const char* value) {
  if (value != nullptr)
    setenv(var, value, 1);
  else
    unsetenv(var);
  cuda::sm90_heuristics::reload_sm90_overrides();
}

// Runs check(seed) with the override `var` set to each of `values` in turn (a fresh seed each, under a
// SCOPED_TRACE naming the value), then unsets it: every configuration MOE8_SM90_TILE or MOE8_SM90_FP8_TILE
// can force.
template <class Check>
void for_each_forced(const char* var, std::initializer_list<const char*> values, uint64_t seed, Check&& check) {
  for (const char* v : values) {
    SCOPED_TRACE(std::string(var) + "=" + v);
    set_override(var, v);
    check(seed += 100);
  }
  set_override(var, nullptr);
}

}  // namespace moe8::test
#endif  // MOE8_WITH_CUDA
