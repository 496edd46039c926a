// util.cu — launch checking, the device queries and host copy the API needs, and the synchronous
// index-range check it uses for validation.
#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace moe8::cuda {

void check_launch(const char* what) { cuda_check(cudaGetLastError(), what); }

bool backend_built() { return true; }

int device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

int current_device_or_none() {
  int device = 0;
  return cudaGetDevice(&device) == cudaSuccess ? device : -1;
}

bool copy_to_host(void* dst, const void* src, size_t bytes, void* stream) {
  cudaStream_t s = as_stream(stream);
  cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s);  // a failure shows in the synchronisation
  return cudaStreamSynchronize(s) == cudaSuccess;
}

__global__ void count_out_of_range_kernel(const int32_t* data, int64_t n, int64_t lo, int64_t hi,
                                          unsigned long long* bad) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t v = data[i];
    local += (v < lo || v >= hi) ? 1ull : 0ull;
  }
  if (local) atomicAdd(bad, local);  // integer atomics: the count is exact whatever the order
}

int64_t count_out_of_range(const int32_t* data, int64_t n, int64_t lo, int64_t hi, void* stream) {
  if (n == 0) return 0;
  cudaStream_t s = as_stream(stream);
  unsigned long long* d_bad = nullptr;
  cuda_check(cudaMallocAsync(&d_bad, sizeof(unsigned long long), s), "count_out_of_range: cudaMallocAsync");
  cuda_check(cudaMemsetAsync(d_bad, 0, sizeof(unsigned long long), s), "count_out_of_range: memset");
  int blocks = static_cast<int>(std::min<int64_t>(1024, ceil_div(n, 256)));
  count_out_of_range_kernel<<<blocks, 256, 0, s>>>(data, n, lo, hi, d_bad);
  check_launch("count_out_of_range");
  unsigned long long bad = 0;
  cuda_check(cudaMemcpyAsync(&bad, d_bad, sizeof(bad), cudaMemcpyDeviceToHost, s), "count_out_of_range: copy");
  cuda_check(cudaStreamSynchronize(s), "count_out_of_range: sync");
  cuda_check(cudaFreeAsync(d_bad, s), "count_out_of_range: free");
  return static_cast<int64_t>(bad);
}

}  // namespace moe8::cuda
