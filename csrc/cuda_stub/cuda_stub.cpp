// cuda_stub.cpp — the CUDA backend of a build without CUDA (MOE8_CUDA=OFF or no nvcc; CMakeLists.txt
// compiles this file instead of csrc/cuda/*.cu). Queries answer "nothing here" (no devices, no workspace,
// no fast path); every op raises the error api/ raises for CUDA tensors in such a build, so api/ calls the
// cuda:: entry points without knowing how moe8 was built.
#include "core/error.h"
#include "cuda/grouped_gemm_fp8_sm90.h"
#include "cuda/grouped_gemm_sm90.h"
#include "cuda/ipc.h"
#include "cuda/ops.h"
#include "cuda/optim.h"

namespace moe8::cuda {

// cuda/ops.h
void route_forward(const TensorView&, const TensorView&, const RouteParams&, const TensorView&, const TensorView&,
                   const TensorView&, const TensorView&, const TensorView&, void*) {
  fail_without_cuda("route_forward");
}
void route_backward(const TensorView&, const TensorView&, const RouteParams&, const TensorView&, const TensorView&,
                    const TensorView&, const TensorView&, const TensorView&, void*) {
  fail_without_cuda("route_backward");
}
void build_dispatch_plan(const TensorView&, int, int, const TensorView&, const TensorView&, const TensorView&,
                         const TensorView&, const TensorView&, void*) {
  fail_without_cuda("build_dispatch_plan");
}
void gather_rows(const TensorView&, const TensorView&, const TensorView&, int, const TensorView&, const TensorView&,
                 void*) {
  fail_without_cuda("gather_rows");
}
void combine_rows(const TensorView&, const TensorView&, const TensorView&, const TensorView&, void*) {
  fail_without_cuda("combine_rows");
}
void combine_weights_grad(const TensorView&, const TensorView&, const TensorView&, const TensorView&, void*) {
  fail_without_cuda("combine_weights_grad");
}
void grouped_gemm(const TensorView&, const TensorView&, const TensorView&, WeightLayout, const TensorView&,
                  const TensorView&, void*) {
  fail_without_cuda("grouped_gemm");
}
void grouped_gemm_wgrad(const TensorView&, const TensorView&, const TensorView&, WeightLayout, const TensorView&,
                        const TensorView&, void*) {
  fail_without_cuda("grouped_gemm_wgrad");
}
void grouped_lowrank_add(const TensorView&, const TensorView&, const TensorView&, const TensorView&, WeightLayout,
                         const TensorView&, void*) {
  fail_without_cuda("grouped_lowrank_add");
}
void activation_forward(const TensorView&, const ActParams&, const TensorView&, void*) {
  fail_without_cuda("activation_forward");
}
void activation_backward(const TensorView&, const TensorView&, const ActParams&, const TensorView&, void*) {
  fail_without_cuda("activation_backward");
}
void activation_backward_routed(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                const ActParams&, const TensorView&, const TensorView&, const TensorView&, void*,
                                const TensorView&, const TensorView&) {
  fail_without_cuda("activation_backward_routed");
}
void cross_entropy_rows(const TensorView&, const TensorView&, int64_t, const TensorView&, void*) {
  fail_without_cuda("cross_entropy_rows");
}
void rope(const TensorView&, const TensorView&, const TensorView&, const TensorView&, bool, void*) {
  fail_without_cuda("rope");
}
void rms_norm_forward(const TensorView&, const TensorView&, float, const TensorView&, const TensorView&, void*) {
  fail_without_cuda("rms_norm_forward");
}
void rms_norm_backward(const TensorView&, const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                       const TensorView&, const TensorView&, void*) {
  fail_without_cuda("rms_norm_backward");
}
bool backend_built() { return false; }
int device_count() { return 0; }
int current_device_or_none() { return -1; }
bool copy_to_host(void*, const void*, size_t, void*) { fail_without_cuda("copy_to_host"); }
size_t plan_workspace_elems(int64_t, int) { return 0; }
int64_t count_out_of_range(const int32_t*, int64_t, int64_t, int64_t, void*) {
  fail_without_cuda("count_out_of_range");
}
void check_launch(const char*) { fail_without_cuda("check_launch"); }
void quantize_rows_1x128(const TensorView&, const TensorView&, const TensorView&, int, const TensorView&,
                         const TensorView&, void*) {
  fail_without_cuda("quantize_rows_1x128");
}
void quantize_weight_128x128(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                             const TensorView&, void*) {
  fail_without_cuda("quantize_weight_128x128");
}
void quantize_cols_1x128(const TensorView&, const TensorView&, const TensorView&, const TensorView&, void*) {
  fail_without_cuda("quantize_cols_1x128");
}
void swiglu_quant(const TensorView&, const ActParams&, const TensorView&, const TensorView&, void*) {
  fail_without_cuda("swiglu_quant");
}
void quantize_rowwise(const TensorView&, const TensorView&, const TensorView&, void*) {
  fail_without_cuda("quantize_rowwise");
}
void quantize_tensorwise(const TensorView&, const TensorView&, const TensorView&, void*) {
  fail_without_cuda("quantize_tensorwise");
}
void dequantize(const TensorView&, const TensorView&, int64_t, int64_t, const TensorView&, void*) {
  fail_without_cuda("dequantize");
}
void grouped_gemm_fp8(const TensorView&, const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                      const TensorView&, void*) {
  fail_without_cuda("grouped_gemm_fp8");
}

// cuda/grouped_gemm_sm90.h
size_t grouped_gemm_sm90_workspace_bytes(int, int64_t, int64_t, int64_t) { return 0; }
bool grouped_gemm_sm90_supported(const TensorView&, const TensorView&, WeightLayout, int64_t) { return false; }
void grouped_gemm_sm90(const TensorView&, const TensorView&, const TensorView&, WeightLayout, const TensorView&, void*,
                       size_t, void*) {
  fail_without_cuda("grouped_gemm_sm90");
}
void grouped_gemm_wgrad_sm90(const TensorView&, const TensorView&, const TensorView&, const TensorView&, void*, size_t,
                             void*) {
  fail_without_cuda("grouped_gemm_wgrad_sm90");
}
bool grouped_gemm_sm90_routing_balanced(const TensorView&, void*) { return false; }
bool grouped_gemm_gathered_sm90_supported(const TensorView&, const TensorView&, WeightLayout, int64_t) { return false; }
void grouped_gemm_gathered_sm90(const TensorView&, const TensorView&, int, const TensorView&, const TensorView&,
                                const TensorView&, void*, size_t, void*) {
  fail_without_cuda("grouped_gemm_gathered_sm90");
}
bool grouped_gemm_swiglu_sm90_supported(const TensorView&, const TensorView&, int64_t) { return false; }
void grouped_gemm_swiglu_sm90(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                              const TensorView&, void*, size_t, void*) {
  fail_without_cuda("grouped_gemm_swiglu_sm90");
}
bool grouped_gemm_wgrad_gathered_sm90_supported(const TensorView&, const TensorView&, const TensorView&) {
  return false;
}
void grouped_gemm_wgrad_gathered_sm90(const TensorView&, const TensorView&, int, const TensorView&, const TensorView&,
                                      const TensorView&, void*, size_t, void*) {
  fail_without_cuda("grouped_gemm_wgrad_gathered_sm90");
}
bool grouped_gemm_act_backward_sm90_supported(const TensorView&, const TensorView&, const TensorView&,
                                              const ActParams&) {
  return false;
}
void grouped_gemm_act_backward_sm90(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                    const TensorView&, const TensorView&, const ActParams&, const TensorView&,
                                    const TensorView&, const TensorView&, const TensorView&, void*, size_t, void*) {
  fail_without_cuda("grouped_gemm_act_backward_sm90");
}

// cuda/grouped_gemm_fp8_sm90.h
size_t grouped_gemm_fp8_sm90_workspace_bytes(int) { return 0; }
bool grouped_gemm_fp8_sm90_supported(const TensorView&, const TensorView&, const TensorView&) { return false; }
void grouped_gemm_fp8_sm90(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                           const TensorView&, const TensorView&, void*, size_t, void*) {
  fail_without_cuda("grouped_gemm_fp8_sm90");
}
bool grouped_gemm_fp8_wgrad_sm90_available(int) { return false; }
size_t grouped_gemm_fp8_wgrad_sm90_workspace_bytes(int) { return 0; }
void grouped_gemm_fp8_wgrad_sm90(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                 const TensorView&, const TensorView&, void*, size_t, void*) {
  fail_without_cuda("grouped_gemm_fp8_wgrad_sm90");
}

// cuda/ipc.h: api/ipc.cpp refuses to make a buffer without CUDA, so only the constructor is reachable
IpcBuffer::IpcBuffer(int, const IpcLayout&, int) { fail_without_cuda("IpcBuffer"); }
IpcBuffer::~IpcBuffer() = default;
std::string IpcBuffer::handle() const { return handle_; }
void IpcBuffer::open(const std::vector<std::string>&) {}
void IpcBuffer::close_peers() {}
uint64_t IpcBuffer::error_code() const { return 0; }
void IpcBuffer::synchronize(void*) const {}
void IpcBuffer::barrier(IpcPhase, double, void*) {}
void IpcBuffer::send_rows(const TensorView&, const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                          const TensorView&, int, bool, void*) {}
void IpcBuffer::recv_plan(const TensorView&, const TensorView&, const TensorView&, bool, void*) {}
void IpcBuffer::recv_rows(const TensorView&, const TensorView&, bool, const TensorView&, const TensorView&,
                          const TensorView&, const TensorView&, void*) {}
void IpcBuffer::send_back(const TensorView&, const TensorView&, const TensorView&, void*) {}
void IpcBuffer::recv_back(const TensorView&, const TensorView&, void*) {}

// cuda/optim.h
void adamw_step(const std::vector<TensorView>&, const std::vector<TensorView>&, const std::vector<TensorView>&,
                const std::vector<TensorView>&, const AdamWScalars&, void*) {
  fail_without_cuda("adamw_step");
}

}  // namespace moe8::cuda
