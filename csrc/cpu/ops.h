// cpu/ops.h — the CPU reference of every op. Arguments are already validated by api/ (shapes, dtypes,
// contiguity, index ranges); outputs are caller-owned and fully written. Shapes use T tokens, E experts,
// K = top-k, R rows in expert order, H / N / Kd feature sizes.
#pragma once
#include <vector>

#include "core/adamw.h"
#include "core/params.h"
#include "core/tensor.h"

namespace moe8::cpu {

// logits [T,E] f32|f16|bf16, bias [E] f32 (optional) -> ids [T,K] i32, weights [T,K] f32,
// prob_mean [E] f32, token_frac [E] f32, lse [T] f32.
void route_forward(const TensorView& logits, const TensorView& bias, const RouteParams& p, const TensorView& ids,
                   const TensorView& weights, const TensorView& prob_mean, const TensorView& token_frac,
                   const TensorView& lse);

// grad_weights [T,K] f32, grad_prob_mean [E] f32 (optional), grad_lse [T] f32 (optional)
// -> grad_logits [T,E] (dtype of logits).
void route_backward(const TensorView& logits, const TensorView& bias, const RouteParams& p, const TensorView& ids,
                    const TensorView& grad_weights, const TensorView& grad_prob_mean, const TensorView& grad_lse,
                    const TensorView& grad_logits);

// ids [T,K] i32 -> counts [E] i32, offsets [E+1] i32 (group starts, each group padded to pad_multiple),
// row_to_slot [R] i32 (slot = t*K + k, -1 for padding and rows past offsets[E]), slot_to_row [T*K] i32.
// Rows of one expert are in ascending slot order.
void build_dispatch_plan(const TensorView& ids, int num_experts, int pad_multiple, const TensorView& counts,
                         const TensorView& offsets, const TensorView& row_to_slot, const TensorView& slot_to_row);

// dst[r] = scale[slot] * src[slot / K] where slot = row_to_slot[r], or 0 where slot == -1 (padding).
// src [T,H], scale [T*K] f32 (optional), dst [R,H].
void gather_rows(const TensorView& src, const TensorView& row_to_slot, int k, const TensorView& scale,
                 const TensorView& dst);

// out[t] = sum_k weights[t,k] * rows[slot_to_row[t,k]] (weights optional: 1), fp32 accumulation;
// slot_to_row == -1 marks a dropped slot, which adds nothing (and gets d_weights 0).
// rows [R,H], slot_to_row [T,K] i32, weights [T,K] f32, out [T,H].
void combine_rows(const TensorView& rows, const TensorView& slot_to_row, const TensorView& weights,
                  const TensorView& out);

// d_weights[t,k] = <dy[t], rows[slot_to_row[t,k]]> in fp32. dy [T,H], rows [R,H], d_weights [T,K] f32.
void combine_weights_grad(const TensorView& dy, const TensorView& rows, const TensorView& slot_to_row,
                          const TensorView& d_weights);

// c[r] = a[r] · op(b[e]) + bias[e] for offsets[e] <= r < offsets[e+1]; rows past offsets[E] are zeroed.
// a [R,Kd], b [E,N,Kd] (kNK) or [E,Kd,N] (kKN), bias [E,N] (optional), c [R,N]; fp32 accumulation.
void grouped_gemm(const TensorView& a, const TensorView& b, const TensorView& offsets, WeightLayout layout,
                  const TensorView& bias, const TensorView& c);

// c[r] = x[row_to_slot[r] / top_k] . op(b[e]) for the rows r of expert e (0 where row_to_slot[r] < 0 and past the
// last group): grouped_gemm of the permuted rows, reading them from x.
void gathered_grouped_gemm(const TensorView& x, const TensorView& row_to_slot, int top_k, const TensorView& b,
                           const TensorView& offsets, WeightLayout layout, const TensorView& c);

// db[e] = sum over the rows r of group e of dc[r]^T a[r] (kNK: [N,Kd]) or a[r]^T dc[r] (kKN: [Kd,N]);
// dbias[e] = sum of dc[r] (optional). Empty groups give zeros.
void grouped_gemm_wgrad(const TensorView& a, const TensorView& dc, const TensorView& offsets, WeightLayout layout,
                        const TensorView& db, const TensorView& dbias);

// out[r] = h[r] + t[r] · op(b[e]) per group (rank sum in fp32, then added to h); rows in no group: h[r].
void grouped_lowrank_add(const TensorView& h, const TensorView& t, const TensorView& b, const TensorView& offsets,
                         WeightLayout layout, const TensorView& out);

// h [R, 2I] (gated) or [R, I] -> out [R, I].
void activation_forward(const TensorView& h, const ActParams& p, const TensorView& out);
// dout [R, I] -> dh (shape of h).
void activation_backward(const TensorView& h, const TensorView& dout, const ActParams& p, const TensorView& dh);
// The activation's backward with the routing weights applied here rather than to the rows before the down
// projection's dgrad (ops.activation_down_combine). dout [R, I] is d act(h) of the UNweighted expert outputs;
// for row r with slot s = row_to_slot[r] and w = weights[s] (0 when s < 0):
//   dh[r] = act'(h[r]) (w dout[r]),  a_w[r] = w act(h[r]),  d_weights[s] = <act(h[r]), dout[r]> (fp32)
// (the routing weight's gradient <o_r, dy_t> = <act(h_r) W_e, dy_t> = <act(h_r), dy_t W_e^T>, without the down
// bias). a_w may be dout and dh may be h (each element is read before it is written); d_weights [T*K] f32 is
// written at the slots rows map to only.
void activation_backward_routed(const TensorView& h, const TensorView& dout, const TensorView& weights,
                                const TensorView& row_to_slot, const ActParams& p, const TensorView& dh,
                                const TensorView& a_w, const TensorView& d_weights);

// Rotary position embedding, rotate_half form (Llama, Qwen), with half = D/2:
//   forward:  out = x cos + rotate_half(x) sin,    rotate_half(x) = [-x[half:], x[:half]]
//   backward: out = x cos + rotate_half^T(x sin),  rotate_half^T(u) = [u[half:], -u[:half]]  (x is then dy)
// x [B,H,S,D] and out [B,H,S,D] with any strides but a contiguous last dim (out's own strides), cos and sin
// [B,S,D] or [1,S,D] (broadcast over batch) contiguous, all one float dtype; fp32 math, one rounding.
void rope(const TensorView& x, const TensorView& cos, const TensorView& sin, const TensorView& out, bool backward);

// Cross-entropy of logit rows, the LM loss a chunk of rows at a time: logits [n, V] (float, contiguous),
// target [n] int64 class ids in [0, V) or ignore_index, loss [n] float32. Per row, in float32:
// lse = m + log(sum_j exp(x_j - m)) with m = max_j x_j, loss = lse - x[target] (0 for ignore_index, NaN for
// an id out of [0, V)); the row is then overwritten with the gradient of its loss, softmax(x) - onehot(target)
// = exp(x_j - lse) - [j == target] (all 0 for an ignored row, NaN for an id out of range), rounded to the
// logits' dtype.
void cross_entropy_rows(const TensorView& logits, const TensorView& target, int64_t ignore_index,
                        const TensorView& loss);

// RMSNorm over the rows of x [R,H] (torch.nn.functional.rms_norm(x, (H,), weight, eps)): per row
// rstd = 1 / sqrt(mean(x^2) + eps) in fp32 (the sum in double here), y = x * rstd * weight in fp32, rounded once.
// weight [H] and y [R,H] of x's dtype, rstd [R] float32 (saved for the backward). An H of 0 gives NaN rstd.
void rms_norm_forward(const TensorView& x, const TensorView& weight, float eps, const TensorView& y,
                      const TensorView& rstd);

// Its gradient from rstd: with g = dy * weight and xhat = x * rstd (fp32),
// dx = rstd * (g - xhat * mean(g * xhat)) and dweight = the sum over rows of dy * xhat (double here), rounded to
// weight's dtype (0 for R = 0). dy, dx [R,H] of x's dtype.
void rms_norm_backward(const TensorView& dy, const TensorView& x, const TensorView& weight, const TensorView& rstd,
                       const TensorView& dx, const TensorView& dweight);

// ---- FP8 e4m3 (stored as uint8; conversion, scale rule and NaN policy in core/fp8.h) ----------------
// Every block gets scale = amax(|block|) / 448 (1 for an all-zero block) and q = e4m3(x * (1 / scale)), so that
// x ~= e4m3_to_float(q) * scale. KB = ceil(K/128), NB = ceil(N/128).

// 1x128 along K: x [R,K] f32|f16|bf16 -> q [R,K] u8, scale [R,KB] f32 (row-major).
// With row_to_slot [R] i32 (permute + quantise in one pass): x is src [T,K] and row r is src[slot / k],
// slot = row_to_slot[r]; slot == -1 gives a zero row with scale 1.
void quantize_rows_1x128(const TensorView& x, const TensorView& row_to_slot, int k, const TensorView& q,
                         const TensorView& scale);

// 128x128 blocks of each expert's weight: w [E,N,K] -> q [E,N,K] u8, scale [E,NB,KB] f32.
// q_t / scale_t (optional, together): also the other layout, q_t [E,K,N] = q transposed, scale_t [E,KB,NB].
// q / scale may be left out (together) when q_t is given: the other layout only.
void quantize_weight_128x128(const TensorView& w, const TensorView& q, const TensorView& scale, const TensorView& q_t,
                             const TensorView& scale_t);

// Transposed 1x128 quantisation for the weight gradient (the GEMM reduces over rows, so the blocks run
// along rows): x [R,K] -> q_t [K,R] u8 (q_t[c, r] quantises x[r, c]) and scale [col_scale_blocks(R,E), K]
// f32. Rows of group e (offsets[e] .. offsets[e+1]-1) are cut into 128-row blocks starting at offsets[e],
// so no block straddles two experts; blocks are numbered group by group (block j of group e has index
// sum_{e' < e} ceil(count_e' / 128) + j) and scale[b, c] belongs to block b, column c. Scale rows past the
// last block are 1; columns of q_t past offsets[E] are 0. With groups padded to 128 rows (plan
// pad_multiple 128) block b is simply rows 128 b .. 128 b + 127.
void quantize_cols_1x128(const TensorView& x, const TensorView& offsets, const TensorView& q_t,
                         const TensorView& scale);

// Activation fused with 1x128 quantisation: equal to quantize_rows_1x128(activation_forward(h, p)) with
// the activation rounded to h's dtype. h [R,2I] (gated) or [R,I] -> q [R,I] u8, scale [R,ceil(I/128)].
void swiglu_quant(const TensorView& h, const ActParams& p, const TensorView& q, const TensorView& scale);

// One scale per row: x [...,K] -> q (shape of x) u8, scale [...] f32 (x.shape[:-1]).
void quantize_rowwise(const TensorView& x, const TensorView& q, const TensorView& scale);
// One scale per tensor: x -> q (shape of x) u8, scale [1] f32.
void quantize_tensorwise(const TensorView& x, const TensorView& q, const TensorView& scale);

// out[..., m, k] = e4m3_to_float(q[..., m, k]) * scale[..., m / block_rows, k / block_cols].
// q [M,K] or [B,M,K] u8, scale [ceil(M/block_rows), ceil(K/block_cols)] (or [B, ...]) f32, out float.
void dequantize(const TensorView& q, const TensorView& scale, int64_t block_rows, int64_t block_cols,
                const TensorView& out);

// Blockwise-scaled FP8 grouped GEMM (forward; also dgrad with b = the quantised transposed weight):
// c[r, n] = sum_kb a_scale[r,kb] * b_scale[e, n/128, kb] * sum_{k in block kb} a[r,k] * b[e,n,k] for
// offsets[e] <= r < offsets[e+1]; rows past offsets[E] are zeroed. a [R,K] u8, a_scale [R,KB],
// b [E,N,K] u8, b_scale [E,NB,KB], c [R,N] f32|f16|bf16. The reference accumulates in double.
void grouped_gemm_fp8(const TensorView& a, const TensorView& a_scale, const TensorView& b, const TensorView& b_scale,
                      const TensorView& offsets, const TensorView& c);

// grouped_gemm_fp8 of x's rows quantised 1x128 (quantize_rows_1x128(x, row_to_slot, k) into q [R,K] and
// scale [R,KB], the caller's scratch), into c [R,N]: the two references back to back, the same bits.
void quantize_grouped_gemm_fp8(const TensorView& x, const TensorView& row_to_slot, int k, const TensorView& b,
                               const TensorView& b_scale, const TensorView& offsets, const TensorView& q,
                               const TensorView& scale, const TensorView& c);

// FP8 weight gradient from the transposed quantisations quantize_cols_1x128 writes: for each expert e,
// db[e, n, k] = sum over e's 128-row blocks j of dc_scale[j, n] * a_scale[j, k] * sum_{r in j} dc_t[n, r] *
// a_t[k, r]. dc_t [N,R] u8, dc_scale [NBLK,N], a_t [K,R] u8, a_scale [NBLK,K], db [E,N,K] float; blocks
// numbered expert by expert (quantize_cols_1x128); an expert without rows gets zeros. Accumulates in double.
void grouped_gemm_fp8_wgrad(const TensorView& dc_t, const TensorView& dc_scale, const TensorView& a_t,
                            const TensorView& a_scale, const TensorView& offsets, const TensorView& db);

// One AdamW step (core/adamw.h) over tensors i: params[i], grads[i], exp_avgs[i], exp_avg_sqs[i] of one shape and
// one float dtype (validated by api/), the first, third and fourth updated in place.
void adamw_step(const std::vector<TensorView>& params, const std::vector<TensorView>& grads,
                const std::vector<TensorView>& exp_avgs, const std::vector<TensorView>& exp_avg_sqs,
                const AdamWScalars& s);

}  // namespace moe8::cpu
