// cuda/ops.h — the CUDA kernels of every op, launched on `stream` (a cudaStream_t), never synchronising
// (but count_out_of_range). Arguments are already validated by api/ (shapes, dtypes, contiguity, index ranges); outputs
// are caller-owned and fully written. Shapes use T tokens, E experts, K = top-k, R rows in expert order, H / N / Kd
// feature sizes.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/params.h"
#include "core/tensor.h"

namespace moe8::cuda {

// logits [T,E] f32|f16|bf16, bias [E] f32 (optional) -> ids [T,K] i32, weights [T,K] f32,
// prob_mean [E] f32, token_frac [E] f32, lse [T] f32.
void route_forward(const TensorView& logits, const TensorView& bias, const RouteParams& p, const TensorView& ids,
                   const TensorView& weights, const TensorView& prob_mean, const TensorView& token_frac,
                   const TensorView& lse, void* stream);

// grad_weights [T,K] f32, grad_prob_mean [E] f32 (optional), grad_lse [T] f32 (optional)
// -> grad_logits [T,E] (dtype of logits).
void route_backward(const TensorView& logits, const TensorView& bias, const RouteParams& p, const TensorView& ids,
                    const TensorView& grad_weights, const TensorView& grad_prob_mean, const TensorView& grad_lse,
                    const TensorView& grad_logits, void* stream);

// ids [T,K] i32 -> counts [E] i32, offsets [E+1] i32 (group starts, each group padded to pad_multiple),
// row_to_slot [R] i32 (slot = t*K + k, -1 for padding and rows past offsets[E]), slot_to_row [T*K] i32.
// Rows of one expert are in ascending slot order.
// workspace: int32, at least plan_workspace_elems(T*K, E) elements (the CPU plan needs none).
void build_dispatch_plan(const TensorView& ids, int num_experts, int pad_multiple, const TensorView& counts,
                         const TensorView& offsets, const TensorView& row_to_slot, const TensorView& slot_to_row,
                         const TensorView& workspace, void* stream);

// dst[r] = scale[slot] * src[slot / K] where slot = row_to_slot[r], or 0 where slot == -1 (padding).
// src [T,H], scale [T*K] f32 (optional), dst [R,H].
// slot_to_row (row_to_slot's inverse, optional): each token read once and stored to its rows (k <= 8).
void gather_rows(const TensorView& src, const TensorView& row_to_slot, const TensorView& slot_to_row, int k,
                 const TensorView& scale, const TensorView& dst, void* stream);

// out[t] = sum_k weights[t,k] * rows[slot_to_row[t,k]] (weights optional: 1), fp32 accumulation;
// slot_to_row == -1 marks a dropped slot, which adds nothing (and gets d_weights 0).
// rows [R,H], slot_to_row [T,K] i32, weights [T,K] f32, out [T,H].
void combine_rows(const TensorView& rows, const TensorView& slot_to_row, const TensorView& weights,
                  const TensorView& out, void* stream);

// d_weights[t,k] = <dy[t], rows[slot_to_row[t,k]]> in fp32. dy [T,H], rows [R,H], d_weights [T,K] f32.
void combine_weights_grad(const TensorView& dy, const TensorView& rows, const TensorView& slot_to_row,
                          const TensorView& d_weights, void* stream);

// c[r] = a[r] · op(b[e]) + bias[e] for offsets[e] <= r < offsets[e+1]; rows past offsets[E] are zeroed.
// a [R,Kd], b [E,N,Kd] (kNK) or [E,Kd,N] (kKN), bias [E,N] (optional), c [R,N]; fp32 accumulation.
void grouped_gemm(const TensorView& a, const TensorView& b, const TensorView& offsets, WeightLayout layout,
                  const TensorView& bias, const TensorView& c, void* stream);

// db[e] = sum over the rows r of group e of dc[r]^T a[r] (kNK: [N,Kd]) or a[r]^T dc[r] (kKN: [Kd,N]);
// dbias[e] = sum of dc[r] (optional). Empty groups give zeros.
void grouped_gemm_wgrad(const TensorView& a, const TensorView& dc, const TensorView& offsets, WeightLayout layout,
                        const TensorView& db, const TensorView& dbias, void* stream);

// out[r] = h[r] + t[r] · op(b[e]) for offsets[e] <= r < offsets[e+1] (fp32 sum over the rank, added to h);
// out[r] = h[r] for rows in no group. h, out [R,N]; t [R,rank]; b [E,N,rank] (kNK) or [E,rank,N] (kKN).
void grouped_lowrank_add(const TensorView& h, const TensorView& t, const TensorView& b, const TensorView& offsets,
                         WeightLayout layout, const TensorView& out, void* stream);

// h [R, 2I] (gated) or [R, I] -> out [R, I].
void activation_forward(const TensorView& h, const ActParams& p, const TensorView& out, void* stream);
// dout [R, I] -> dh (shape of h).
void activation_backward(const TensorView& h, const TensorView& dout, const ActParams& p, const TensorView& dh,
                         void* stream);
// cpu::activation_backward_routed on the GPU (one warp a row: the weight gradient's sum in a fixed order).
// dh_q / dh_scale (optional, together): d h quantised 1x128 too, in the same pass where d h is [gate | up] of
// 16-bit packs with I % 128 == 0, else by quantize_rows_1x128 after it (the same bits either way).
void activation_backward_routed(const TensorView& h, const TensorView& dout, const TensorView& weights,
                                const TensorView& row_to_slot, const ActParams& p, const TensorView& dh,
                                const TensorView& a_w, const TensorView& d_weights, void* stream,
                                const TensorView& dh_q = {}, const TensorView& dh_scale = {});

// Rotary position embedding (rotate_half form), forward or backward: x [B,H,S,D] and out [B,H,S,D] strided
// with a contiguous last dim, cos / sin [B,S,D] or [1,S,D] contiguous; see cpu/ops.h.
// loss.cu: exp and log are CUDA's expf / logf (within 2 ulp), so rows match the CPU reference to ~1e-6
// relative, not bitwise.
void cross_entropy_rows(const TensorView& logits, const TensorView& target, int64_t ignore_index,
                        const TensorView& loss, void* stream);
void rope(const TensorView& x, const TensorView& cos, const TensorView& sin, const TensorView& out, bool backward,
          void* stream);

// RMSNorm (rmsnorm.cu; semantics: cpu/ops.h): x, y [R,H], weight [H] of x's dtype, rstd [R] f32. The backward's
// workspace: f32, at least rmsnorm_heuristics::workspace_rows(R) * H elements (its weight-gradient partials);
// dweight is the same bits on every run.
void rms_norm_forward(const TensorView& x, const TensorView& weight, float eps, const TensorView& y,
                      const TensorView& rstd, void* stream);
void rms_norm_backward(const TensorView& dy, const TensorView& x, const TensorView& weight, const TensorView& rstd,
                       const TensorView& dx, const TensorView& dweight, const TensorView& workspace, void* stream);

// ---- the backend itself (util.cu; csrc/cuda_stub/ answers all of this header in a build without CUDA)
// Whether this build has the CUDA backend: false only from the stub.
bool backend_built();
// CUDA devices visible, 0 when the query fails.
int device_count();
// The current device, or -1 when the query fails.
int current_device_or_none();
// Copies `bytes` from device memory to host memory in stream order and waits for it; false if that failed.
bool copy_to_host(void* dst, const void* src, size_t bytes, void* stream);

// int32 workspace elements build_dispatch_plan needs for num_slots = T*K slots.
size_t plan_workspace_elems(int64_t num_slots, int num_experts);

// Number of values of the int32 array that lie outside [lo, hi); synchronises the stream (validation only).
int64_t count_out_of_range(const int32_t* data, int64_t n, int64_t lo, int64_t hi, void* stream);

// Raises moe8::CudaError naming `what` if the last launch failed.
void check_launch(const char* what);

// ---- FP8 e4m3 (uint8 storage); semantics as in cpu/ops.h, bit-exact with the CPU reference except where
// noted (quant.cuh, grouped_gemm_fp8.cu) ---------------------------------------------------------------

// slot_to_row (row_to_slot's inverse, optional): reads each token once (k <= 8) instead of once per row.
void quantize_rows_1x128(const TensorView& x, const TensorView& row_to_slot, const TensorView& slot_to_row, int k,
                         const TensorView& q, const TensorView& scale, void* stream);
// q_t / scale_t (optional, together): the other layout's copy, [E, K, N] / [E, KB, NB], written in the same pass;
// q / scale absent (with q_t present): that layout only.
void quantize_weight_128x128(const TensorView& w, const TensorView& q, const TensorView& scale, const TensorView& q_t,
                             const TensorView& scale_t, void* stream);
void quantize_cols_1x128(const TensorView& x, const TensorView& offsets, const TensorView& q_t, const TensorView& scale,
                         void* stream);
// Bit-exact with quantize_rows_1x128(activation_forward(h)) run on the GPU; the activation itself may
// differ from the CPU's by a few ulps (expf / erff), so against the CPU only within one e4m3 step.
void swiglu_quant(const TensorView& h, const ActParams& p, const TensorView& q, const TensorView& scale, void* stream);
void quantize_rowwise(const TensorView& x, const TensorView& q, const TensorView& scale, void* stream);
void quantize_tensorwise(const TensorView& x, const TensorView& q, const TensorView& scale, void* stream);
void dequantize(const TensorView& q, const TensorView& scale, int64_t block_rows, int64_t block_cols,
                const TensorView& out, void* stream);
// Portable (any GPU, any shape) blockwise FP8 grouped GEMM: fp32 accumulation per 128-wide K block, then
// scaled and summed in fp32. The Hopper kernel is grouped_gemm_fp8_sm90.h.
void grouped_gemm_fp8(const TensorView& a, const TensorView& a_scale, const TensorView& b, const TensorView& b_scale,
                      const TensorView& offsets, const TensorView& c, void* stream);

}  // namespace moe8::cuda
