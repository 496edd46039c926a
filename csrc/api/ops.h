// api/ops.h — the entry points of libmoe8: one function per op. Each validates its arguments once
// (presence, shapes, dtypes, devices, contiguity, index ranges) and raises moe8::Error naming the
// argument, expected vs actual; then it runs the CPU reference or the CUDA kernel depending on where the
// tensors live. `stream` is a cudaStream_t as an integer (ignored on the CPU). Outputs are caller-owned.
#pragma once
#include <cstdint>

#include "core/params.h"
#include "core/tensor.h"

namespace moe8::api {

bool cuda_available();  // built with CUDA and a device is visible

void route_forward(const TensorView& logits, const TensorView& bias, const RouteParams& p, const TensorView& ids,
                   const TensorView& weights, const TensorView& prob_mean, const TensorView& token_frac,
                   const TensorView& lse, intptr_t stream);

void route_backward(const TensorView& logits, const TensorView& bias, const RouteParams& p, const TensorView& ids,
                    const TensorView& grad_weights, const TensorView& grad_prob_mean, const TensorView& grad_lse,
                    const TensorView& grad_logits, intptr_t stream, bool check_indices = true);

// Elements of the int32 workspace build_dispatch_plan needs (0 on the CPU).
int64_t plan_workspace_elems(int64_t num_slots, int num_experts, bool on_cuda);

// Rows a plan can use at most: T*K + E*(pad_multiple-1); row_to_slot must have at least that many.
int64_t plan_max_rows(int64_t num_slots, int num_experts, int pad_multiple);

void build_dispatch_plan(const TensorView& ids, int num_experts, int pad_multiple, const TensorView& counts,
                         const TensorView& offsets, const TensorView& row_to_slot, const TensorView& slot_to_row,
                         const TensorView& workspace, intptr_t stream, bool check_indices = true);

void gather_rows(const TensorView& src, const TensorView& row_to_slot, int k, const TensorView& scale,
                 const TensorView& dst, intptr_t stream, bool check_indices = true);

void combine_rows(const TensorView& rows, const TensorView& slot_to_row, const TensorView& weights,
                  const TensorView& out, intptr_t stream, bool check_indices = true);

void combine_weights_grad(const TensorView& dy, const TensorView& rows, const TensorView& slot_to_row,
                          const TensorView& d_weights, intptr_t stream, bool check_indices = true);

// Bytes of uint8 workspace that lets grouped_gemm / grouped_gemm_wgrad take the Hopper (CUTLASS sm_90a)
// path for num_experts groups; 0 when that path is not available (CPU, no CUTLASS, not sm_90).
int64_t grouped_gemm_workspace_bytes(int num_experts, bool on_cuda);

// `workspace` (optional, uint8, grouped_gemm_workspace_bytes long) enables the sm_90a kernels where the
// shapes allow; without it, or where they do not apply (bias, fp32, unaligned sizes), the portable
// kernels run. Both give the same results up to fp32 summation order.
void grouped_gemm(const TensorView& a, const TensorView& b, const TensorView& offsets, WeightLayout layout,
                  const TensorView& bias, const TensorView& c, intptr_t stream, bool check_indices = true,
                  const TensorView& workspace = TensorView{});

void grouped_gemm_wgrad(const TensorView& a, const TensorView& dc, const TensorView& offsets, WeightLayout layout,
                        const TensorView& db, const TensorView& dbias, intptr_t stream, bool check_indices = true,
                        const TensorView& workspace = TensorView{});

void activation_forward(const TensorView& h, const ActParams& p, const TensorView& out, intptr_t stream);

void activation_backward(const TensorView& h, const TensorView& dout, const ActParams& p, const TensorView& dh,
                         intptr_t stream);

}  // namespace moe8::api
