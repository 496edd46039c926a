// api/quant.cpp — validation and backend choice for the FP8 ops (quantisation recipes, dequantisation, the
// blockwise-scaled grouped GEMM). Nothing reaches a backend unchecked.
#include <cstdint>
#include <initializer_list>

#include "api/common.h"
#include "api/ops.h"
#include "core/check.h"
#include "core/fp8.h"
#include "cpu/ops.h"
#include "cuda/grouped_gemm_fp8_sm90.h"
#include "cuda/ops.h"

namespace moe8::api {
namespace {

void check_fp8(const char* name, const TensorView& t) { check_dtype(name, t, {DType::kU8, DType::kF8E4M3}); }

// A float input: present, contiguous, of a float dtype, with `ndim` dimensions.
void check_input(const char* name, const TensorView& t, int ndim) {
  check_present(name, t);
  check_ndim(name, t, ndim);
  check_float(name, t);
  check_contiguous(name, t);
}

void check_q(const char* name, const TensorView& q, const char* ref_name, const TensorView& ref,
             std::initializer_list<int64_t> shape) {
  check_tensor(name, q, ref_name, ref);
  check_fp8(name, q);
  check_shape(name, q, shape);
}

void check_scale(const char* name, const TensorView& s, const char* ref_name, const TensorView& ref,
                 std::initializer_list<int64_t> shape) {
  check_tensor(name, s, ref_name, ref);
  check_dtype(name, s, {DType::kF32});
  check_shape(name, s, shape);
}

// x [T,K] of a 1x128 row quantisation, with row_to_slot [R] (optional: rows gathered from x, -1 none) and its
// inverse slot_to_row [T*k] (optional); returns R, the rows quantised (T without row_to_slot).
int64_t check_rows_input(const TensorView& x, const TensorView& row_to_slot, int k, const TensorView& slot_to_row,
                         intptr_t stream, bool check_indices) {
  check_input("x", x, 2);
  const int64_t T = x.size(0);
  int64_t R = T;
  if (row_to_slot.present) {
    MOE8_CHECK(k >= 1, "k: expected >= 1, got ", k);
    check_tensor("row_to_slot", row_to_slot, "x", x);
    check_dtype("row_to_slot", row_to_slot, {DType::kI32});
    check_ndim("row_to_slot", row_to_slot, 1);
    R = row_to_slot.size(0);
  }
  const bool check = checks_values(check_indices, x);
  if (row_to_slot.present && check) check_range("row_to_slot", row_to_slot, -1, T * k, stream);
  check_slot_to_row(slot_to_row, row_to_slot, "x", x, T, k, R, stream, check);
  return R;
}

// The weight, offsets and output of a blockwise FP8 grouped GEMM of R rows of K (its rows on ref's device,
// named ref_name): b [E,N,K] fp8, b_scale [E, ceil(N/128), ceil(K/128)] f32, offsets [E+1] int32 (values
// checked when check_indices, always on the CPU), c [R,N] float.
void check_fp8_gemm_operands(const char* ref_name, const TensorView& ref, int64_t R, int64_t K, const TensorView& b,
                             const TensorView& b_scale, const TensorView& offsets, const TensorView& c, intptr_t stream,
                             bool check_indices) {
  check_tensor("b", b, ref_name, ref);
  check_fp8("b", b);
  check_ndim("b", b, 3);
  const int64_t E = b.size(0), N = b.size(1);
  check_shape("b", b, {E, N, K});
  MOE8_CHECK(E >= 1, "b: expected at least one expert (dim 0), got shape ", b.shape_str());
  check_scale("b_scale", b_scale, ref_name, ref, {E, quant_blocks(N), quant_blocks(K)});
  check_tensor("offsets", offsets, ref_name, ref);
  check_dtype("offsets", offsets, {DType::kI32});
  check_shape("offsets", offsets, {E + 1});
  check_tensor("c", c, ref_name, ref);
  check_float("c", c);
  check_shape("c", c, {R, N});
  if (checks_values(check_indices, offsets)) check_offsets(offsets, R, stream);
}

// The GEMM of grouped_gemm_fp8 on checked operands: the sm_90a kernel where `workspace` is given and the shapes
// allow, else the portable kernel (CUDA), or the CPU reference.
void run_grouped_gemm_fp8(const char* ref_name, const TensorView& a, const TensorView& a_scale, const TensorView& b,
                          const TensorView& b_scale, const TensorView& offsets, const TensorView& c,
                          const TensorView& workspace, intptr_t stream) {
  if (!on_cuda(a, "grouped_gemm_fp8")) {
    cpu::grouped_gemm_fp8(a, a_scale, b, b_scale, offsets, c);
    return;
  }
  bool fast = false;
  if (workspace.present) {
    check_tensor("workspace", workspace, ref_name, a);
    check_dtype("workspace", workspace, {DType::kU8});
    const int64_t need = grouped_gemm_fp8_workspace_bytes(static_cast<int>(b.size(0)), true);
    MOE8_CHECK(workspace.numel() >= need, "workspace: expected at least ", need, " bytes, got ", workspace.numel());
    fast = need > 0 && cuda::grouped_gemm_fp8_sm90_supported(a, b, c);
  }
  if (fast)
    cuda::grouped_gemm_fp8_sm90(a, a_scale, b, b_scale, offsets, c, workspace.data,
                                static_cast<size_t>(workspace.numel()), as_ptr(stream));
  else
    cuda::grouped_gemm_fp8(a, a_scale, b, b_scale, offsets, c, as_ptr(stream));
}

// Where quantize_grouped_gemm_fp8 keeps a's codes and scales in its scratch: the scales [R, KB] f32 first, the
// codes [R, K] from the next 256-byte boundary (TMA reads them: 16-byte aligned).
constexpr int64_t kScratchAlign = 256;

int64_t align_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

int64_t scratch_codes_offset(int64_t rows, int64_t cols) {
  return align_up(rows * quant_blocks(cols) * static_cast<int64_t>(sizeof(float)), kScratchAlign);
}

}  // namespace

void quantize_rows_1x128(const TensorView& x, const TensorView& row_to_slot, int k, const TensorView& q,
                         const TensorView& scale, intptr_t stream, bool check_indices, const TensorView& slot_to_row) {
  const int64_t R = check_rows_input(x, row_to_slot, k, slot_to_row, stream, check_indices);
  check_q("q", q, "x", x, {R, x.size(1)});
  check_scale("scale", scale, "x", x, {R, quant_blocks(x.size(1))});
  if (on_cuda(x, "quantize_rows_1x128")) {
    cuda::quantize_rows_1x128(x, row_to_slot, slot_to_row, k, q, scale, as_ptr(stream));
  } else {
    cpu::quantize_rows_1x128(x, row_to_slot, k, q, scale);
  }
}

void quantize_weight_128x128(const TensorView& w, const TensorView& q, const TensorView& scale, intptr_t stream,
                             const TensorView& q_t, const TensorView& scale_t) {
  check_input("w", w, 3);
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  MOE8_CHECK(q.present == scale.present, "q and scale: expected both or neither, got ",
             q.present ? "q only" : "scale only");
  MOE8_CHECK(q_t.present == scale_t.present, "q_t and scale_t: expected both or neither, got ",
             q_t.present ? "q_t only" : "scale_t only");
  MOE8_CHECK(q.present || q_t.present, "q and q_t: expected at least one of the two layouts to write, got neither");
  if (q.present) {
    check_q("q", q, "w", w, {E, N, K});
    check_scale("scale", scale, "w", w, {E, quant_blocks(N), quant_blocks(K)});
  }
  if (q_t.present) {
    check_q("q_t", q_t, "w", w, {E, K, N});
    check_scale("scale_t", scale_t, "w", w, {E, quant_blocks(K), quant_blocks(N)});
  }
  if (on_cuda(w, "quantize_weight_128x128")) {
    cuda::quantize_weight_128x128(w, q, scale, q_t, scale_t, as_ptr(stream));
  } else {
    cpu::quantize_weight_128x128(w, q, scale, q_t, scale_t);
  }
}

int64_t col_scale_blocks(int64_t rows, int num_experts) { return moe8::col_scale_blocks(rows, num_experts); }

void quantize_cols_1x128(const TensorView& x, const TensorView& offsets, const TensorView& q_t, const TensorView& scale,
                         intptr_t stream, bool check_indices) {
  check_input("x", x, 2);
  const int64_t R = x.size(0), K = x.size(1);
  check_tensor("offsets", offsets, "x", x);
  check_dtype("offsets", offsets, {DType::kI32});
  check_ndim("offsets", offsets, 1);
  const int64_t E = offsets.size(0) - 1;
  MOE8_CHECK(E >= 1, "offsets: expected E+1 >= 2 values, got shape ", offsets.shape_str());
  check_q("q_t", q_t, "x", x, {K, R});
  check_scale("scale", scale, "x", x, {moe8::col_scale_blocks(R, E), K});
  if (checks_values(check_indices, offsets)) check_offsets(offsets, R, stream);
  if (on_cuda(x, "quantize_cols_1x128")) {
    cuda::quantize_cols_1x128(x, offsets, q_t, scale, as_ptr(stream));
  } else {
    cpu::quantize_cols_1x128(x, offsets, q_t, scale);
  }
}

void swiglu_quant(const TensorView& h, const ActParams& p, const TensorView& q, const TensorView& scale,
                  intptr_t stream) {
  check_input("h", h, 2);
  MOE8_CHECK(p.kind >= ActKind::kSwiGLU && p.kind <= ActKind::kGELU, "kind: unknown activation ",
             static_cast<int>(p.kind));
  check_tensor("q", q, "h", h);
  check_fp8("q", q);
  check_ndim("q", q, 2);
  const int64_t R = h.size(0), I = q.size(1);
  check_shape("q", q, {R, -1});
  if (is_gated(p.kind))
    MOE8_CHECK(h.size(1) == 2 * I, "h: a gated activation expects h.shape[1] == 2 * q.shape[1] = ", 2 * I, ", got ",
               h.size(1));
  else
    MOE8_CHECK(h.size(1) == I, "h: an ungated activation expects h.shape[1] == q.shape[1] = ", I, ", got ", h.size(1));
  check_scale("scale", scale, "h", h, {R, quant_blocks(I)});
  if (on_cuda(h, "swiglu_quant")) {
    cuda::swiglu_quant(h, p, q, scale, as_ptr(stream));
  } else {
    cpu::swiglu_quant(h, p, q, scale);
  }
}

void quantize_rowwise(const TensorView& x, const TensorView& q, const TensorView& scale, intptr_t stream) {
  check_present("x", x);
  MOE8_CHECK(x.ndim == 2 || x.ndim == 3, "x: expected a 2-d or 3-d tensor, got shape ", x.shape_str());
  check_float("x", x);
  check_contiguous("x", x);
  check_tensor("q", q, "x", x);
  check_fp8("q", q);
  bool same = q.ndim == x.ndim;
  for (int d = 0; same && d < x.ndim; ++d) same = q.shape[d] == x.shape[d];
  MOE8_CHECK(same, "q: expected shape ", x.shape_str(), " (same as x), got ", q.shape_str());
  check_tensor("scale", scale, "x", x);
  check_dtype("scale", scale, {DType::kF32});
  same = scale.ndim == x.ndim - 1;
  for (int d = 0; same && d < x.ndim - 1; ++d) same = scale.shape[d] == x.shape[d];
  MOE8_CHECK(same, "scale: expected shape x.shape[:-1] (x is ", x.shape_str(), "), got ", scale.shape_str());
  if (on_cuda(x, "quantize_rowwise")) {
    cuda::quantize_rowwise(x, q, scale, as_ptr(stream));
  } else {
    cpu::quantize_rowwise(x, q, scale);
  }
}

void quantize_tensorwise(const TensorView& x, const TensorView& q, const TensorView& scale, intptr_t stream) {
  check_present("x", x);
  check_float("x", x);
  check_contiguous("x", x);
  check_tensor("q", q, "x", x);
  check_fp8("q", q);
  bool same = q.ndim == x.ndim;
  for (int d = 0; same && d < x.ndim; ++d) same = q.shape[d] == x.shape[d];
  MOE8_CHECK(same, "q: expected shape ", x.shape_str(), " (same as x), got ", q.shape_str());
  check_scale("scale", scale, "x", x, {1});
  if (on_cuda(x, "quantize_tensorwise")) {
    cuda::quantize_tensorwise(x, q, scale, as_ptr(stream));
  } else {
    cpu::quantize_tensorwise(x, q, scale);
  }
}

void dequantize(const TensorView& q, const TensorView& scale, int64_t block_rows, int64_t block_cols,
                const TensorView& out, intptr_t stream) {
  check_present("q", q);
  MOE8_CHECK(q.ndim == 2 || q.ndim == 3, "q: expected a 2-d or 3-d tensor, got shape ", q.shape_str());
  check_fp8("q", q);
  check_contiguous("q", q);
  MOE8_CHECK(block_rows >= 1, "block_rows: expected >= 1, got ", block_rows);
  MOE8_CHECK(block_cols >= 1, "block_cols: expected >= 1, got ", block_cols);
  const int64_t M = q.size(-2), K = q.size(-1);
  const int64_t SM = (M + block_rows - 1) / block_rows, SK = (K + block_cols - 1) / block_cols;
  if (q.ndim == 3)
    check_scale("scale", scale, "q", q, {q.size(0), SM, SK});
  else
    check_scale("scale", scale, "q", q, {SM, SK});
  check_tensor("out", out, "q", q);
  check_float("out", out);
  bool same = out.ndim == q.ndim;
  for (int d = 0; same && d < q.ndim; ++d) same = out.shape[d] == q.shape[d];
  MOE8_CHECK(same, "out: expected shape ", q.shape_str(), " (same as q), got ", out.shape_str());
  if (on_cuda(q, "dequantize")) {
    cuda::dequantize(q, scale, block_rows, block_cols, out, as_ptr(stream));
  } else {
    cpu::dequantize(q, scale, block_rows, block_cols, out);
  }
}

int64_t grouped_gemm_fp8_workspace_bytes(int num_experts, bool on_cuda) {
  if (on_cuda && num_experts >= 1) {
    // Whether the path exists at all on the current device: a probe with aligned (never dereferenced) pointers.
    void* p = reinterpret_cast<void*>(256);
    TensorView a = make_view(p, DType::kU8, {16, 16}, DeviceType::kCUDA);
    TensorView b = make_view(p, DType::kU8, {1, 16, 16}, DeviceType::kCUDA);
    TensorView c = make_view(p, DType::kBF16, {16, 16}, DeviceType::kCUDA);
    const int device = cuda::current_device_or_none();
    if (device < 0) return 0;
    a.device_index = b.device_index = c.device_index = device;
    if (cuda::grouped_gemm_fp8_sm90_supported(a, b, c))
      return static_cast<int64_t>(cuda::grouped_gemm_fp8_sm90_workspace_bytes(num_experts));
  }
  return 0;
}

void grouped_gemm_fp8(const TensorView& a, const TensorView& a_scale, const TensorView& b, const TensorView& b_scale,
                      const TensorView& offsets, const TensorView& c, intptr_t stream, bool check_indices,
                      const TensorView& workspace) {
  check_present("a", a);
  check_ndim("a", a, 2);
  check_fp8("a", a);
  check_contiguous("a", a);
  const int64_t R = a.size(0), K = a.size(1);
  check_scale("a_scale", a_scale, "a", a, {R, quant_blocks(K)});
  check_fp8_gemm_operands("a", a, R, K, b, b_scale, offsets, c, stream, check_indices);
  run_grouped_gemm_fp8("a", a, a_scale, b, b_scale, offsets, c, workspace, stream);
}

int64_t quantize_grouped_gemm_fp8_scratch_bytes(int64_t rows, int64_t cols) {
  MOE8_CHECK(rows >= 0 && cols >= 0, "rows, cols: expected >= 0, got ", rows, ", ", cols);
  return rows == 0 || cols == 0 ? 0 : scratch_codes_offset(rows, cols) + rows * cols;
}

void quantize_grouped_gemm_fp8(const TensorView& x, const TensorView& row_to_slot, int top_k,
                               const TensorView& slot_to_row, const TensorView& b, const TensorView& b_scale,
                               const TensorView& offsets, const TensorView& scratch, const TensorView& c,
                               intptr_t stream, bool check_indices, const TensorView& workspace) {
  const int64_t R = check_rows_input(x, row_to_slot, top_k, slot_to_row, stream, check_indices);
  const int64_t K = x.size(1);
  check_fp8_gemm_operands("x", x, R, K, b, b_scale, offsets, c, stream, check_indices);
  const int64_t need = quantize_grouped_gemm_fp8_scratch_bytes(R, K);
  check_tensor("scratch", scratch, "x", x);
  check_dtype("scratch", scratch, {DType::kU8});
  check_contiguous("scratch", scratch);
  MOE8_CHECK(scratch.numel() >= need, "scratch: expected at least ", need,
             " bytes (quantize_grouped_gemm_fp8_scratch_bytes), got ", scratch.numel());
  MOE8_CHECK(need == 0 || reinterpret_cast<uintptr_t>(scratch.data) % 16 == 0,
             "scratch: expected a 16-byte aligned start, got address ", scratch.data);
  // a's 1x128 codes [R, K] and scales [R, KB] inside the scratch (the scales first)
  uint8_t* base = static_cast<uint8_t*>(scratch.data);
  TensorView a_scale = make_view(base, DType::kF32, {R, quant_blocks(K)}, x.device);
  TensorView a = make_view(need ? base + scratch_codes_offset(R, K) : base, DType::kU8, {R, K}, x.device);
  a.device_index = a_scale.device_index = x.device_index;
  if (on_cuda(x, "quantize_grouped_gemm_fp8")) {
    cuda::quantize_rows_1x128(x, row_to_slot, slot_to_row, top_k, a, a_scale, as_ptr(stream));
    run_grouped_gemm_fp8("x", a, a_scale, b, b_scale, offsets, c, workspace, stream);
  } else {
    cpu::quantize_grouped_gemm_fp8(x, row_to_slot, top_k, b, b_scale, offsets, a, a_scale, c);
  }
}

int64_t grouped_gemm_fp8_wgrad_workspace_bytes(int num_experts, bool on_cuda) {
  if (on_cuda && num_experts >= 1) {
    const int device = cuda::current_device_or_none();
    if (device < 0) return 0;
    if (cuda::grouped_gemm_fp8_wgrad_sm90_available(device))
      return static_cast<int64_t>(cuda::grouped_gemm_fp8_wgrad_sm90_workspace_bytes(num_experts));
  }
  return 0;
}

void grouped_gemm_fp8_wgrad(const TensorView& dc_t, const TensorView& dc_scale, const TensorView& a_t,
                            const TensorView& a_scale, const TensorView& offsets, const TensorView& db, intptr_t stream,
                            bool check_indices, const TensorView& workspace) {
  check_present("dc_t", dc_t);
  check_ndim("dc_t", dc_t, 2);
  check_fp8("dc_t", dc_t);
  check_contiguous("dc_t", dc_t);
  const int64_t N = dc_t.size(0), R = dc_t.size(1);
  check_tensor("a_t", a_t, "dc_t", dc_t);
  check_fp8("a_t", a_t);
  check_ndim("a_t", a_t, 2);
  const int64_t K = a_t.size(0);
  check_shape("a_t", a_t, {K, R});
  check_tensor("offsets", offsets, "dc_t", dc_t);
  check_dtype("offsets", offsets, {DType::kI32});
  check_ndim("offsets", offsets, 1);
  const int64_t E = offsets.size(0) - 1;
  MOE8_CHECK(E >= 1, "offsets: expected at least 2 values (E + 1, E >= 1), got shape ", offsets.shape_str());
  const int64_t NBLK = moe8::col_scale_blocks(R, static_cast<int>(E));
  check_scale("dc_scale", dc_scale, "dc_t", dc_t, {NBLK, N});
  check_scale("a_scale", a_scale, "dc_t", dc_t, {NBLK, K});
  check_tensor("db", db, "dc_t", dc_t);
  check_float("db", db);
  check_shape("db", db, {E, N, K});
  const bool cuda = on_cuda(dc_t, "grouped_gemm_fp8_wgrad");
  if (checks_values(check_indices, offsets)) {
    const std::vector<int32_t> off = host_offsets(offsets, stream);
    check_offsets(offsets, R, stream);
    for (int64_t e = 0; cuda && e <= E; ++e)
      MOE8_CHECK(off[e] % 16 == 0, "offsets: the GPU kernel expects multiples of 16 (plan with pad_multiple 16), got ",
                 "offsets[", e, "] = ", off[e]);
  }
  if (cuda) {
    const int64_t need = grouped_gemm_fp8_wgrad_workspace_bytes(static_cast<int>(E), true);
    MOE8_CHECK(need > 0, "grouped_gemm_fp8_wgrad: on a GPU only the sm_90a (CUTLASS) kernel exists, and it is not ",
               "available here; use the bf16 grouped_gemm_wgrad");
    MOE8_CHECK(workspace.present, "workspace: expected ", need, " bytes of uint8 scratch, got none");
    check_tensor("workspace", workspace, "dc_t", dc_t);
    check_dtype("workspace", workspace, {DType::kU8});
    MOE8_CHECK(workspace.numel() >= need, "workspace: expected at least ", need, " bytes, got ", workspace.numel());
    MOE8_CHECK(db.dtype == DType::kBF16, "db: the GPU kernel writes bfloat16, got ", dtype_name(db.dtype));
    MOE8_CHECK(N % 8 == 0 && K % 8 == 0 && R % 16 == 0, "dc_t, a_t: the GPU kernel needs N, K multiples of 8 and R ",
               "of 16, got N = ", N, ", K = ", K, ", R = ", R);
    cuda::grouped_gemm_fp8_wgrad_sm90(dc_t, dc_scale, a_t, a_scale, offsets, db, workspace.data,
                                      static_cast<size_t>(workspace.numel()), as_ptr(stream));
  } else {
    cpu::grouped_gemm_fp8_wgrad(dc_t, dc_scale, a_t, a_scale, offsets, db);
  }
}

}  // namespace moe8::api
