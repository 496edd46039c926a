// api/ops.h — the entry points of libmoe8: one function per op. Each validates its arguments once
// (presence, shapes, dtypes, devices, contiguity, index ranges) and raises moe8::Error naming the
// argument, expected vs actual; then it runs the CPU reference or the CUDA kernel depending on where the
// tensors live. `stream` is a cudaStream_t as an integer (ignored on the CPU). Outputs are caller-owned.
#pragma once
#include <cstdint>
#include <vector>

#include "core/params.h"
#include "core/tensor.h"

namespace moe8::api {

bool cuda_available();  // built with CUDA and a device is visible
// Reads the MOE8_SM90_* tuning overrides from the environment again (they are read once per process
// otherwise): for benchmark sweeps that change them between calls.
void reload_sm90_overrides();

void route_forward(const TensorView& logits, const TensorView& bias, const RouteParams& p, const TensorView& ids,
                   const TensorView& weights, const TensorView& prob_mean, const TensorView& token_frac,
                   const TensorView& lse, intptr_t stream);

void route_backward(const TensorView& logits, const TensorView& bias, const RouteParams& p, const TensorView& ids,
                    const TensorView& grad_weights, const TensorView& grad_prob_mean, const TensorView& grad_lse,
                    const TensorView& grad_logits, intptr_t stream, bool check_indices = true);

// Elements of the int32 workspace build_dispatch_plan needs (0 on the CPU).
int64_t plan_workspace_elems(int64_t num_slots, int num_experts, bool on_cuda);

// Rows a plan can use at most: T*K + E*(pad_multiple-1), rounded up to a multiple of pad_multiple (so a
// padded plan's R is aligned like its offsets); row_to_slot must have at least that many.
int64_t plan_max_rows(int64_t num_slots, int num_experts, int pad_multiple);

void build_dispatch_plan(const TensorView& ids, int num_experts, int pad_multiple, const TensorView& counts,
                         const TensorView& offsets, const TensorView& row_to_slot, const TensorView& slot_to_row,
                         const TensorView& workspace, intptr_t stream, bool check_indices = true);

// slot_to_row [T*k] (optional: row_to_slot's inverse, slot -> row, -1 none): the same result; the CUDA kernel
// then reads each token once and stores it to its rows (k <= 8).
void gather_rows(const TensorView& src, const TensorView& row_to_slot, int k, const TensorView& scale,
                 const TensorView& dst, intptr_t stream, bool check_indices = true,
                 const TensorView& slot_to_row = TensorView{});

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

// c[r] = x[row_to_slot[r] / top_k] · op(b[e]) for the rows r of expert e (grouped_gemm of
// permute(x, row_to_slot), 0 where row_to_slot[r] < 0), the rows read from x inside the GEMM: x [T, Kd],
// row_to_slot [R] int32 (slots < T * top_k), b as for grouped_gemm, c [R, N], no bias. On the CPU the reference
// runs; on a GPU the sm_90a kernel with `workspace` where it applies (bfloat16, kNK), and otherwise nothing runs
// and false is returned (the caller permutes and calls grouped_gemm). Returns whether c was written.
bool gathered_grouped_gemm(const TensorView& x, const TensorView& row_to_slot, int top_k, const TensorView& b,
                           const TensorView& offsets, WeightLayout layout, const TensorView& c, intptr_t stream,
                           bool check_indices = true, const TensorView& workspace = TensorView{});

// The up projection's forward and its SwiGLU: h = grouped_gemm(a, b, offsets, kNK) [R, 2I] and act =
// activation_forward(h, SwiGLU with h as [gate | up]) [R, I], a [R, Kd], b [E, 2I, Kd], no bias. On the CPU the
// reference runs both; on a GPU the sm_90a kernel that computes act in the GEMM's epilogue where it applies (bfloat16,
// I a multiple of 128, `workspace`; the same bits as the two calls), and otherwise nothing runs and false is returned
// (the caller makes the two calls). Returns whether h and act were written.
bool grouped_gemm_swiglu(const TensorView& a, const TensorView& b, const TensorView& offsets, const TensorView& h,
                         const TensorView& act, intptr_t stream, bool check_indices = true,
                         const TensorView& workspace = TensorView{});

// db = grouped_gemm_wgrad(permute(x, row_to_slot), dc, offsets, layout) without the permuted rows: the sm_90a
// kernel reads them from x inside the GEMM where it applies (a GPU, bfloat16, kNK, `workspace`). Checks as
// gathered_grouped_gemm with dc [R, N] and db the weight's shape; where no kernel applies (the CPU among them)
// nothing runs and false is returned (the caller permutes and calls grouped_gemm_wgrad). Returns whether db was
// written.
bool gathered_grouped_gemm_wgrad(const TensorView& x, const TensorView& row_to_slot, int top_k, const TensorView& dc,
                                 const TensorView& offsets, WeightLayout layout, const TensorView& db, intptr_t stream,
                                 bool check_indices = true, const TensorView& workspace = TensorView{});

// out = h + grouped_gemm(t, b, offsets, layout) in one pass over h (the expert LoRA's B projection added to the
// base GEMM's output): h, out [R,N]; t [R,rank] (rank <= 1024); b [E,N,rank] (kNK) or [E,rank,N] (kKN); one float
// dtype for all four. Rows in no group get h.
void grouped_lowrank_add(const TensorView& h, const TensorView& t, const TensorView& b, const TensorView& offsets,
                         WeightLayout layout, const TensorView& out, intptr_t stream, bool check_indices = true);

void activation_forward(const TensorView& h, const ActParams& p, const TensorView& out, intptr_t stream);

void activation_backward(const TensorView& h, const TensorView& dout, const ActParams& p, const TensorView& dh,
                         intptr_t stream);

// The activation's backward with the routing weights applied here (semantics: cpu/ops.h): h [R,2I] (gated) or
// [R,I]; dout, a_w [R,I] (a_w may be dout); dh like h (may be h); one float dtype; weights, d_weights [T*K]
// float32; row_to_slot [R] int32 in [-1, T*K). dh_q [R, W] uint8 and dh_scale [R, ceil(W/128)] float32 (optional,
// together; W = h's width): d h quantised 1x128 as well, the bits quantize_rows_1x128(dh) gives (what an FP8 dgrad of
// the up projection reads), on the GPU in the same pass where it can.
void activation_backward_routed(const TensorView& h, const TensorView& dout, const TensorView& weights,
                                const TensorView& row_to_slot, const ActParams& p, const TensorView& dh,
                                const TensorView& a_w, const TensorView& d_weights, intptr_t stream,
                                bool check_indices = true, const TensorView& dh_q = {},
                                const TensorView& dh_scale = {});

// The down projection's input gradient followed by the routed activation backward:
//   a_w = grouped_gemm(a, b, offsets, layout); activation_backward_routed(h, a_w, weights, row_to_slot, p, dh,
//   a_w, d_weights)
// (a [R, Kd] the unweighted rows of dy, b the down weight, a_w [R, N]; the rest as activation_backward_routed;
// partials [R, grouped_gemm_act_backward_sm90_parts(N)] float32 scratch). On an sm_90a GPU, SwiGLU with h as
// [gate | up], bfloat16 with the kKN layout and `workspace`, one GEMM does both (the activation backward in its
// epilogue: the same bits for a_w and dh, d_weights summed in another order, and a_w's rows past offsets[E], which are
// in no group, zero where the two calls write w * act(h)); elsewhere the two calls run. Returns whether it was fused.
bool grouped_gemm_act_backward(const TensorView& a, const TensorView& b, const TensorView& offsets, WeightLayout layout,
                               const TensorView& h, const TensorView& weights, const TensorView& row_to_slot,
                               const ActParams& p, const TensorView& dh, const TensorView& a_w,
                               const TensorView& partials, const TensorView& d_weights, intptr_t stream,
                               bool check_indices = true, const TensorView& workspace = TensorView{});

// ---- cross-entropy rows (api/loss.cpp; semantics: cpu/ops.h): the LM loss of logits [n, V] against target
// [n] int64 (ids in [0, V) or ignore_index) -> loss [n] float32, each logits row overwritten with its
// gradient softmax - onehot (0 for ignored rows; NaN loss and gradient for an id out of range). ---------
void cross_entropy_rows(const TensorView& logits, const TensorView& target, int64_t ignore_index,
                        const TensorView& loss, intptr_t stream);

// ---- rotary position embedding (api/rope.cpp), rotate_half form (Llama, Qwen); semantics: cpu/ops.h ----
// x [B,H,S,D] (any strides, last dim contiguous; typically a [B,S,H,D] buffer seen through transpose(1, 2)),
// cos, sin [B,S,D] or [1,S,D] contiguous, D even, one float dtype -> out [B,H,S,D] (last dim contiguous,
// its own strides, no two elements at one address). backward: x is dy and out is dx.
void rope(const TensorView& x, const TensorView& cos, const TensorView& sin, const TensorView& out, bool backward,
          intptr_t stream);

// ---- RMSNorm (api/rmsnorm.cpp; semantics: cpu/ops.h, torch.nn.functional.rms_norm over the last dim) ----------
// x [R,H] contiguous float, weight [H] of x's dtype, eps finite >= 0 -> y [R,H] (x's dtype), rstd [R] float32.
void rms_norm_forward(const TensorView& x, const TensorView& weight, double eps, const TensorView& y,
                      const TensorView& rstd, intptr_t stream);

// float32 elements of the workspace rms_norm_backward needs for x [rows, cols] on a GPU (0 on the CPU): a
// function of the shape alone.
int64_t rms_norm_workspace_elems(int64_t rows, int64_t cols, bool on_cuda);

// dy, x [R,H], weight [H], rstd [R] float32 (rms_norm_forward's) -> dx [R,H], dweight [H] (weight's dtype; the
// same bits on every run). workspace: float32, rms_norm_workspace_elems long, on x's device (GPU only).
void rms_norm_backward(const TensorView& dy, const TensorView& x, const TensorView& weight, const TensorView& rstd,
                       const TensorView& dx, const TensorView& dweight, const TensorView& workspace, intptr_t stream);

// ---- FP8 e4m3 (api/quant.cpp). Quantised tensors are uint8 or float8_e4m3fn; scales float32. Semantics
// and layouts: cpu/ops.h; conversion and NaN policy: core/fp8.h. CPU and CUDA results are bit-identical
// (swiglu_quant: within one e4m3 step, see cuda/ops.h). -----------------------------------------------

// x [R,K] -> q [R,K], scale [R, ceil(K/128)]. With row_to_slot [R'] int32 (fused permute + quantise):
// x is src [T,K], row r of q is src[row_to_slot[r] / k] (-1: zeros, scale 1), q [R',K]. slot_to_row [T*k]
// (optional, with row_to_slot; the plan's inverse of it: slot s -> its row, -1 none): the same result, the
// CUDA kernel then reads and quantises each token once and stores it to its rows (k <= 8).
void quantize_rows_1x128(const TensorView& x, const TensorView& row_to_slot, int k, const TensorView& q,
                         const TensorView& scale, intptr_t stream, bool check_indices = true,
                         const TensorView& slot_to_row = TensorView{});

// w [E,N,K] -> q [E,N,K], scale [E, ceil(N/128), ceil(K/128)]. With q_t [E,K,N] and scale_t [E, ceil(K/128),
// ceil(N/128)] (optional, together): also the other layout's copy, q and scale transposed, in the same pass.
// q / scale may be left out (together) when q_t / scale_t are given: only the other layout is written.
void quantize_weight_128x128(const TensorView& w, const TensorView& q, const TensorView& scale, intptr_t stream,
                             const TensorView& q_t = TensorView{}, const TensorView& scale_t = TensorView{});

// Rows of the scale tensor quantize_cols_1x128 writes: ceil(rows/128) + num_experts.
int64_t col_scale_blocks(int64_t rows, int num_experts);

// x [R,K], offsets [E+1] -> q_t [K,R], scale [col_scale_blocks(R,E), K] (128-row blocks within groups).
void quantize_cols_1x128(const TensorView& x, const TensorView& offsets, const TensorView& q_t, const TensorView& scale,
                         intptr_t stream, bool check_indices = true);

// activation_forward fused with 1x128 quantisation: h [R,2I] (gated) or [R,I] -> q [R,I], scale [R,ceil(I/128)].
void swiglu_quant(const TensorView& h, const ActParams& p, const TensorView& q, const TensorView& scale,
                  intptr_t stream);

// x [...,K] (2-d or 3-d) -> q (shape of x), scale x.shape[:-1].
void quantize_rowwise(const TensorView& x, const TensorView& q, const TensorView& scale, intptr_t stream);
// x (any shape) -> q (shape of x), scale [1].
void quantize_tensorwise(const TensorView& x, const TensorView& q, const TensorView& scale, intptr_t stream);

// out = e4m3(q) * scale broadcast over block_rows x block_cols blocks; q [M,K] or [B,M,K],
// scale [ceil(M/block_rows), ceil(K/block_cols)] (or [B, ...]), out float of q's shape.
void dequantize(const TensorView& q, const TensorView& scale, int64_t block_rows, int64_t block_cols,
                const TensorView& out, intptr_t stream);

// Bytes of uint8 workspace that lets grouped_gemm_fp8 take the Hopper (CUTLASS sm_90a) path; 0 where
// that path is not available (CPU, no CUTLASS, not sm_90).
int64_t grouped_gemm_fp8_workspace_bytes(int num_experts, bool on_cuda);

// Blockwise-scaled FP8 grouped GEMM (kNK): a [R,K] fp8, a_scale [R, ceil(K/128)], b [E,N,K] fp8,
// b_scale [E, ceil(N/128), ceil(K/128)], offsets [E+1] -> c [R,N] float (bf16 for the Hopper path).
// `workspace` (optional, grouped_gemm_fp8_workspace_bytes long) enables the sm_90a kernel where the shapes
// allow (c bf16, K % 16 == 0, N % 8 == 0); otherwise a slow portable kernel runs.
void grouped_gemm_fp8(const TensorView& a, const TensorView& a_scale, const TensorView& b, const TensorView& b_scale,
                      const TensorView& offsets, const TensorView& c, intptr_t stream, bool check_indices = true,
                      const TensorView& workspace = TensorView{});

// Bytes of uint8 scratch quantize_grouped_gemm_fp8 needs for `rows` rows of `cols`: their 1x128 codes and scales.
int64_t quantize_grouped_gemm_fp8_scratch_bytes(int64_t rows, int64_t cols);

// quantize_rows_1x128 then grouped_gemm_fp8 in one call (an FP8 linear layer's forward: x [M,K], offsets
// [0, M]; the experts' GEMMs on their rows, gathered from the tokens with row_to_slot): the same kernels, the same
// bits. x [T,K] float, row_to_slot [R] int32 / top_k / slot_to_row [T*top_k] (optional, as in quantize_rows_1x128;
// without them R = T), b [E,N,K] fp8, b_scale [E, ceil(N/128), ceil(K/128)], offsets [E+1] -> c [R,N] float.
// scratch: uint8, quantize_grouped_gemm_fp8_scratch_bytes(R, K) long at least, 16-byte aligned, on x's device
// (the quantised rows live there between the two kernels); workspace: as for grouped_gemm_fp8.
void quantize_grouped_gemm_fp8(const TensorView& x, const TensorView& row_to_slot, int top_k,
                               const TensorView& slot_to_row, const TensorView& b, const TensorView& b_scale,
                               const TensorView& offsets, const TensorView& scratch, const TensorView& c,
                               intptr_t stream, bool check_indices = true, const TensorView& workspace = TensorView{});

// Bytes of uint8 workspace that lets grouped_gemm_fp8_wgrad take the Hopper (CUTLASS sm_90a) path; 0 where
// that path is not available.
int64_t grouped_gemm_fp8_wgrad_workspace_bytes(int num_experts, bool on_cuda);

// FP8 weight gradient (see cpu::grouped_gemm_fp8_wgrad): dc_t [N,R] fp8 and dc_scale [NBLK,N], a_t [K,R]
// fp8 and a_scale [NBLK,K] (both from quantize_cols_1x128 with the same offsets), offsets [E+1] -> db [E,N,K]
// float (bf16 for the Hopper path). On CUDA only the sm_90a kernel exists: it needs `workspace`
// (grouped_gemm_fp8_wgrad_workspace_bytes long), db bf16, N, K multiples of 8, R and every offsets[e]
// multiples of 16 (TMA rows; plan with pad_multiple 16); check_indices checks the offsets on the host.
void grouped_gemm_fp8_wgrad(const TensorView& dc_t, const TensorView& dc_scale, const TensorView& a_t,
                            const TensorView& a_scale, const TensorView& offsets, const TensorView& db, intptr_t stream,
                            bool check_indices = true, const TensorView& workspace = TensorView{});

// ---- optimizer steps (api/optim.cpp; semantics: core/adamw.h) ----------------------------------------------------
// One AdamW step (decoupled weight decay) of tensors i = 0..n-1: params[i] (updated), grads[i], exp_avgs[i] and
// exp_avg_sqs[i] (updated), each contiguous, of params[i]'s shape, all of one float dtype on one device; step is the
// step count this update makes (1 for the first). lr, eps, weight_decay >= 0, betas in [0, 1). CPU and CUDA results
// are bit-identical (float32 arithmetic, every rounding explicit).
void adamw_step(const std::vector<TensorView>& params, const std::vector<TensorView>& grads,
                const std::vector<TensorView>& exp_avgs, const std::vector<TensorView>& exp_avg_sqs, double lr,
                double beta1, double beta2, double eps, double weight_decay, int64_t step, bool maximize,
                intptr_t stream);

}  // namespace moe8::api
