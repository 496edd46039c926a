// cuda/grouped_gemm_fp8_sm90.h — the Hopper (sm_90a) FP8 grouped GEMM of the MoE experts with DeepSeek-V3
// blockwise scaling (1x128 activation scales, 128x128 weight scales, fp32 promotion every 128 of K), on
// CUTLASS's ptr-array "FP8 block-scaled accumulation" kernel (grouped_gemm_fp8_sm90.cu). As in
// grouped_gemm_sm90.h, a prep kernel turns the device-side offsets into per-group shapes, pointers,
// strides and scale pointers inside the caller's workspace: no host sync, no allocation, graph-capturable.
// Arguments are validated by the caller (api/); these functions only check what the fast path needs.
// Built without CUTLASS (MOE8_WITH_CUTLASS undefined) they are stubs: supported() is false, the rest throw.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/tensor.h"

namespace moe8::cuda {

// Bytes of device scratch grouped_gemm_fp8_sm90 needs for num_experts groups on the current device.
// Call it only where supported() can be true (a CUDA device is current).
size_t grouped_gemm_fp8_sm90_workspace_bytes(int num_experts);

// Whether the sm_90a path can run: built with CUTLASS, a compute capability 9.0 device, a [R, K] and
// b [E, N, K] FP8 (uint8 or float8_e4m3fn storage) and c [R, N] bfloat16 on that device, contiguous,
// K a multiple of 16 and N of 8 (16-byte rows for TMA), base pointers 16-byte aligned, sizes within int32.
bool grouped_gemm_fp8_sm90_supported(const TensorView& a, const TensorView& b, const TensorView& c);

// c[r] = sum_kb a_scale[r, kb] * b_scale[e, n / 128, kb] * (a[r, block kb] · b[e, n, block kb]) for
// offsets[e] <= r < offsets[e+1] (kNK: c = a · b[e]^T); rows of c past offsets[E] are zeroed.
// a [R, K] e4m3, a_scale [R, ceil(K/128)] f32 (row-major, as quantize_rows_1x128 writes it),
// b [E, N, K] e4m3, b_scale [E, ceil(N/128), ceil(K/128)] f32 (as quantize_weight_128x128 writes it),
// offsets [E+1] int32 on the device, c [R, N] bf16. The dgrad of a kNK weight is the same call with b the
// quantised transposed weight [E, K, N] (FP8 wgmma reads both operands K-major).
void grouped_gemm_fp8_sm90(const TensorView& a, const TensorView& a_scale, const TensorView& b,
                           const TensorView& b_scale, const TensorView& offsets, const TensorView& c, void* workspace,
                           size_t workspace_bytes, void* stream);

// The FP8 weight gradient (see api::grouped_gemm_fp8_wgrad): db[e] (bf16 [N, K]) = the 1x128-block-scaled
// product of dc_t[:, rows of e] and a_t[:, rows of e] (the transposed quantisations quantize_cols_1x128
// writes), a grouped GEMM with ragged K. Preconditions, checked by the caller: every offsets[e] and R
// multiples of 16 (TMA), N and K multiples of 8, a CUTLASS build on a compute capability 9.0 device.
bool grouped_gemm_fp8_wgrad_sm90_available(int device);
size_t grouped_gemm_fp8_wgrad_sm90_workspace_bytes(int num_experts);
void grouped_gemm_fp8_wgrad_sm90(const TensorView& dc_t, const TensorView& dc_scale, const TensorView& a_t,
                                 const TensorView& a_scale, const TensorView& offsets, const TensorView& db,
                                 void* workspace, size_t workspace_bytes, void* stream);

}  // namespace moe8::cuda
