// cuda/grouped_gemm_sm90.h — the Hopper (sm_90a) grouped GEMMs of the MoE experts, built on CUTLASS 3.x
// ptr-array kernels (grouped_gemm_sm90.cu). Group offsets stay on the device: a small prep kernel turns
// them into per-group problem shapes, pointers and strides in the caller's workspace, so nothing
// synchronises or allocates and the launches can be captured in a CUDA graph.
// Arguments are validated by the caller (api/); these functions only check what the fast path needs.
// Built without CUTLASS (MOE8_WITH_CUTLASS undefined) they are stubs: supported() is false, the rest throw.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/params.h"
#include "core/tensor.h"

namespace moe8::cuda {

// Bytes of device scratch every entry point below needs for num_experts groups on the current device
// (per-group shapes, pointers and strides, plus CUTLASS's own workspace, which grows with the device's
// multiprocessor count). It does not depend on the offsets; max_rows, n and kd are accepted for future
// tile choices and do not change the result today. Call it only where supported() is true.
size_t grouped_gemm_sm90_workspace_bytes(int num_experts, int64_t max_rows, int64_t n, int64_t kd);

// Whether the sm_90a path can run: built with CUTLASS, a and b bf16 or f16 on a CUDA device of compute
// capability 9.0, same dtype, a [R, Kd], b [E, N, Kd] (kNK) or [E, Kd, N] (kKN) with N == n, Kd and N
// multiples of 8 (16-byte rows for TMA), base pointers 16-byte aligned, sizes within int32.
// For the weight gradient pass db as b with layout kNK.
bool grouped_gemm_sm90_supported(const TensorView& a, const TensorView& b, WeightLayout layout, int64_t n);

// c[r] = a[r] · op(b[e]) for offsets[e] <= r < offsets[e+1]; rows of c past offsets[E] are zeroed.
// a [R, Kd], b [E, N, Kd] (kNK: c = a · b[e]^T, forward) or [E, Kd, N] (kKN: c = a · b[e], e.g. dgrad
// of a kNK weight), offsets [E+1] int32 on the device, c [R, N]; fp32 accumulation, no bias.
void grouped_gemm_sm90(const TensorView& a, const TensorView& b, const TensorView& offsets, WeightLayout layout,
                       const TensorView& c, void* workspace, size_t workspace_bytes, void* stream);

// db[e] = dc[rows of e]^T · a[rows of e] -> [E, N, Kd] (the kNK weight gradient); a [R, Kd], dc [R, N],
// db dtype = a's. Empty groups give zeros. The kKN gradient ([E, Kd, N] = a^T · dc) is the same call
// with a and dc swapped: grouped_gemm_wgrad_sm90(dc, a, offsets, db, ...).
void grouped_gemm_wgrad_sm90(const TensorView& a, const TensorView& dc, const TensorView& offsets, const TensorView& db,
                             void* workspace, size_t workspace_bytes, void* stream);

// Whether grouped_gemm_swiglu_sm90 can run: as grouped_gemm_sm90_supported for b [E, 2I, Kd] (kNK, n = 2I), a and b
// bfloat16, and I a multiple of 128.
bool grouped_gemm_swiglu_sm90_supported(const TensorView& a, const TensorView& b, int64_t n);

// The up projection's forward with SwiGLU in its epilogue: h[r] = a[r] · b[e]^T (as grouped_gemm_sm90, kNK: the same
// bits) and act[r] = SwiGLU(h[r]) with h as [gate | up] (as activation_forward of that h: the same bits), in one
// kernel that never reads h back. a [R, Kd], b [E, 2I, Kd], h [R, 2I], act [R, I], all bfloat16; rows of h and act
// past offsets[E] are zeroed. Each 128x256 tile computes 128 gate and the matching 128 up columns.
void grouped_gemm_swiglu_sm90(const TensorView& a, const TensorView& b, const TensorView& offsets, const TensorView& h,
                              const TensorView& act, void* workspace, size_t workspace_bytes, void* stream);

// Whether grouped_gemm_gathered_sm90 can run: as grouped_gemm_sm90_supported for x as a, b [E, N, Kd] (kNK),
// bfloat16, and x's elements (tokens x Kd) fewer than 2^32 - 1.
bool grouped_gemm_gathered_sm90_supported(const TensorView& x, const TensorView& b, WeightLayout layout, int64_t n);

// c[r] = x[row_to_slot[r] / top_k] · b[e]^T for offsets[e] <= r < offsets[e+1], the rows of x read in the GEMM's
// operand load (no permuted copy); rows with row_to_slot < 0 and rows past offsets[E] are zeroed. x [T, Kd],
// row_to_slot [R] int32, b [E, N, Kd], c [R, N], all bfloat16 but the indices; fp32 accumulation.
void grouped_gemm_gathered_sm90(const TensorView& x, const TensorView& row_to_slot, int top_k, const TensorView& b,
                                const TensorView& offsets, const TensorView& c, void* workspace, size_t workspace_bytes,
                                void* stream);

// Whether grouped_gemm_wgrad_gathered_sm90 can run: x, dc and db bfloat16, as grouped_gemm_sm90_supported for x as
// a and db [E, N, Kd] as b (kNK), dc [R, N] contiguous and 16-byte aligned, x's elements fewer than 2^32 - 1.
bool grouped_gemm_wgrad_gathered_sm90_supported(const TensorView& x, const TensorView& dc, const TensorView& db);

// db[e] = dc[rows of e]^T . x[row_to_slot[r] / top_k for the rows r of e] -> [E, N, Kd], the rows of x read in the
// GEMM's operand load (no permuted copy): grouped_gemm_wgrad_sm90 of the gathered rows, the same bits. Rows with
// row_to_slot < 0 count as zeros; empty groups give zeros. x [T, Kd], row_to_slot [R] int32, dc [R, N].
void grouped_gemm_wgrad_gathered_sm90(const TensorView& x, const TensorView& row_to_slot, int top_k,
                                      const TensorView& dc, const TensorView& offsets, const TensorView& db,
                                      void* workspace, size_t workspace_bytes, void* stream);

// Whether grouped_gemm_act_backward_sm90 can run: SwiGLU with h as [gate | up] (p), as grouped_gemm_sm90_supported
// for a [R, H] and b [E, H, I] (kKN), a, b and h bfloat16, h contiguous, and a shape its tiles serve
// (sm90_heuristics::act_dgrad_tile: not few rows per expert, which take the small tile elsewhere).
bool grouped_gemm_act_backward_sm90_supported(const TensorView& a, const TensorView& b, const TensorView& h,
                                              const ActParams& p);

// Parts of 128 columns along I in that kernel's routing-weight gradient: partials has this many columns.
inline int grouped_gemm_act_backward_sm90_parts(int64_t n) { return static_cast<int>((n + 127) / 128); }

// The down projection's input gradient and the routed SwiGLU backward in one kernel (and a small one after
// it): g = a[r] · b[e] in the epilogue goes through activation_backward_routed (cuda/ops.h) without reaching
// memory: a_w [R, I] = w * act(h), dh like h (may be h), d_weights[slot] = <act(h[r]), g[r]> (the caller zeroes
// it; slots no row maps to keep it), partials [R, parts] float32 scratch. Rows past offsets[E]: a_w and dh zero.
// The same bits as grouped_gemm_sm90 then activation_backward_routed for a_w and dh; d_weights in another order.
void grouped_gemm_act_backward_sm90(const TensorView& a, const TensorView& b, const TensorView& offsets,
                                    const TensorView& h, const TensorView& weights, const TensorView& row_to_slot,
                                    const ActParams& p, const TensorView& dh, const TensorView& a_w,
                                    const TensorView& partials, const TensorView& d_weights, void* workspace,
                                    size_t workspace_bytes, void* stream);

// The routing-balance hint the weight gradient consults for many experts (grouped_gemm_sm90.cu): whether
// the offsets of recent calls on this device had their largest group within 1.25x the mean. Hands these
// offsets [E + 1] (int32, on the device) over as grouped_gemm_wgrad_sm90 does (an asynchronous copy, read
// by a later call; nothing while the stream is captured); MOE8_SM90_BALANCE=balanced|skewed fixes it.
bool grouped_gemm_sm90_routing_balanced(const TensorView& offsets, void* stream);

}  // namespace moe8::cuda
