// api/ops.cpp — validation and backend choice for every op. Nothing reaches a backend unchecked.
#include "api/ops.h"

#include <algorithm>
#include <tuple>
#include <vector>

#include "api/common.h"
#include "core/check.h"
#include "core/fp8.h"
#include "cpu/ops.h"
#include "cuda/grouped_gemm_sm90.h"
#include "cuda/ops.h"
#include "cuda/sm90_heuristics.h"

namespace moe8::api {
namespace {

constexpr int kMaxExperts = 512;  // the CUDA router keeps a token's scores in one warp's registers
constexpr int kMaxTopK = 32;

void check_route_params(const RouteParams& p, int64_t E) {
  MOE8_CHECK(E >= 1 && E <= kMaxExperts, "logits: expected 1..", kMaxExperts, " experts (dim 1), got ", E);
  MOE8_CHECK(p.k >= 1 && p.k <= E && p.k <= kMaxTopK, "k: expected 1 <= k <= min(num_experts=", E, ", ", kMaxTopK,
             "), got ", p.k);
  if (p.scheme == RouteScheme::kSigmoidGroupTopK) {
    MOE8_CHECK(p.n_group >= 1 && E % p.n_group == 0, "n_group: expected a divisor of num_experts=", E, ", got ",
               p.n_group);
    MOE8_CHECK(p.topk_group >= 1 && p.topk_group <= p.n_group, "topk_group: expected 1..n_group=", p.n_group, ", got ",
               p.topk_group);
    MOE8_CHECK(p.topk_group * (E / p.n_group) >= p.k, "topk_group: the ", p.topk_group, " chosen groups hold ",
               p.topk_group * (E / p.n_group), " experts, fewer than k=", p.k);
  }
}

void check_route_common(const TensorView& logits, const TensorView& bias, const RouteParams& p) {
  check_float_matrix("logits", logits);
  check_route_params(p, logits.size(1));
  if (bias.present) {
    check_tensor("bias", bias, "logits", logits);
    check_dtype("bias", bias, {DType::kF32});
    check_shape("bias", bias, {logits.size(1)});
  }
}

}  // namespace

bool cuda_available() { return cuda::device_count() > 0; }

void reload_sm90_overrides() { cuda::sm90_heuristics::reload_sm90_overrides(); }

void route_forward(const TensorView& logits, const TensorView& bias, const RouteParams& p, const TensorView& ids,
                   const TensorView& weights, const TensorView& prob_mean, const TensorView& token_frac,
                   const TensorView& lse, intptr_t stream) {
  check_route_common(logits, bias, p);
  const int64_t T = logits.size(0), E = logits.size(1);
  check_tensor("ids", ids, "logits", logits);
  check_dtype("ids", ids, {DType::kI32});
  check_shape("ids", ids, {T, p.k});
  check_tensor("weights", weights, "logits", logits);
  check_dtype("weights", weights, {DType::kF32});
  check_shape("weights", weights, {T, p.k});
  check_tensor("prob_mean", prob_mean, "logits", logits);
  check_dtype("prob_mean", prob_mean, {DType::kF32});
  check_shape("prob_mean", prob_mean, {E});
  check_tensor("token_frac", token_frac, "logits", logits);
  check_dtype("token_frac", token_frac, {DType::kF32});
  check_shape("token_frac", token_frac, {E});
  check_tensor("lse", lse, "logits", logits);
  check_dtype("lse", lse, {DType::kF32});
  check_shape("lse", lse, {T});
  if (on_cuda(logits, "route_forward")) {
    cuda::route_forward(logits, bias, p, ids, weights, prob_mean, token_frac, lse, as_ptr(stream));
  } else {
    cpu::route_forward(logits, bias, p, ids, weights, prob_mean, token_frac, lse);
  }
}

void route_backward(const TensorView& logits, const TensorView& bias, const RouteParams& p, const TensorView& ids,
                    const TensorView& grad_weights, const TensorView& grad_prob_mean, const TensorView& grad_lse,
                    const TensorView& grad_logits, intptr_t stream, bool check_indices) {
  check_route_common(logits, bias, p);
  const int64_t T = logits.size(0), E = logits.size(1);
  check_tensor("ids", ids, "logits", logits);
  check_dtype("ids", ids, {DType::kI32});
  check_shape("ids", ids, {T, p.k});
  check_tensor("grad_weights", grad_weights, "logits", logits);
  check_dtype("grad_weights", grad_weights, {DType::kF32});
  check_shape("grad_weights", grad_weights, {T, p.k});
  check_optional("grad_prob_mean", grad_prob_mean, "logits", logits);
  if (grad_prob_mean.present) {
    check_dtype("grad_prob_mean", grad_prob_mean, {DType::kF32});
    check_shape("grad_prob_mean", grad_prob_mean, {E});
  }
  check_optional("grad_lse", grad_lse, "logits", logits);
  if (grad_lse.present) {
    check_dtype("grad_lse", grad_lse, {DType::kF32});
    check_shape("grad_lse", grad_lse, {T});
  }
  check_tensor("grad_logits", grad_logits, "logits", logits);
  check_same_dtype("grad_logits", grad_logits, "logits", logits);
  check_shape("grad_logits", grad_logits, {T, E});
  if (checks_values(check_indices, ids)) check_range("ids", ids, 0, E, stream);
  if (on_cuda(logits, "route_backward")) {
    cuda::route_backward(logits, bias, p, ids, grad_weights, grad_prob_mean, grad_lse, grad_logits, as_ptr(stream));
  } else {
    cpu::route_backward(logits, bias, p, ids, grad_weights, grad_prob_mean, grad_lse, grad_logits);
  }
}

int64_t plan_workspace_elems(int64_t num_slots, int num_experts, bool cuda) {
  return cuda ? static_cast<int64_t>(cuda::plan_workspace_elems(num_slots, num_experts)) : 0;
}

int64_t plan_max_rows(int64_t num_slots, int num_experts, int pad_multiple) {
  const int64_t rows = num_slots + static_cast<int64_t>(num_experts) * (pad_multiple - 1);
  return pad_multiple > 1 ? (rows + pad_multiple - 1) / pad_multiple * pad_multiple : rows;  // R a multiple too
}

void build_dispatch_plan(const TensorView& ids, int num_experts, int pad_multiple, const TensorView& counts,
                         const TensorView& offsets, const TensorView& row_to_slot, const TensorView& slot_to_row,
                         const TensorView& workspace, intptr_t stream, bool check_indices) {
  check_present("ids", ids);
  check_ndim("ids", ids, 2);
  check_dtype("ids", ids, {DType::kI32});
  check_contiguous("ids", ids);
  MOE8_CHECK(num_experts >= 1 && num_experts <= kMaxExperts, "num_experts: expected 1..", kMaxExperts, ", got ",
             num_experts);
  MOE8_CHECK(pad_multiple >= 1, "pad_multiple: expected >= 1, got ", pad_multiple);
  const int64_t slots = ids.numel();
  MOE8_CHECK(plan_max_rows(slots, num_experts, pad_multiple) < (int64_t(1) << 31),
             "ids: too many (token, slot) pairs for int32 rows: ", slots);
  for (auto [name, t, n] : {std::make_tuple("counts", &counts, int64_t(num_experts)),
                            std::make_tuple("offsets", &offsets, int64_t(num_experts) + 1),
                            std::make_tuple("slot_to_row", &slot_to_row, slots)}) {
    check_tensor(name, *t, "ids", ids);
    check_dtype(name, *t, {DType::kI32});
    check_shape(name, *t, {n});
  }
  check_tensor("row_to_slot", row_to_slot, "ids", ids);
  check_dtype("row_to_slot", row_to_slot, {DType::kI32});
  check_ndim("row_to_slot", row_to_slot, 1);
  const int64_t need = plan_max_rows(slots, num_experts, pad_multiple);
  MOE8_CHECK(row_to_slot.size(0) >= need, "row_to_slot: expected at least ", need,
             " rows (T*K + E*(pad_multiple-1), rounded up to a multiple of pad_multiple), got ", row_to_slot.size(0));
  if (checks_values(check_indices, ids)) check_range("ids", ids, 0, num_experts, stream);
  if (on_cuda(ids, "build_dispatch_plan")) {
    const int64_t ws = plan_workspace_elems(slots, num_experts, true);
    check_tensor("workspace", workspace, "ids", ids);
    check_dtype("workspace", workspace, {DType::kI32});
    MOE8_CHECK(workspace.numel() >= ws, "workspace: expected at least ", ws, " int32 elements, got ",
               workspace.numel());
    cuda::build_dispatch_plan(ids, num_experts, pad_multiple, counts, offsets, row_to_slot, slot_to_row, workspace,
                              as_ptr(stream));
  } else {
    cpu::build_dispatch_plan(ids, num_experts, pad_multiple, counts, offsets, row_to_slot, slot_to_row);
  }
}

void gather_rows(const TensorView& src, const TensorView& row_to_slot, int k, const TensorView& scale,
                 const TensorView& dst, intptr_t stream, bool check_indices, const TensorView& slot_to_row) {
  check_float_matrix("src", src);
  const int64_t T = src.size(0), H = src.size(1);
  MOE8_CHECK(k >= 1, "k: expected >= 1, got ", k);
  check_tensor("row_to_slot", row_to_slot, "src", src);
  check_dtype("row_to_slot", row_to_slot, {DType::kI32});
  check_ndim("row_to_slot", row_to_slot, 1);
  const int64_t R = row_to_slot.size(0);
  check_optional("scale", scale, "src", src);
  if (scale.present) {
    check_dtype("scale", scale, {DType::kF32});
    MOE8_CHECK(scale.numel() == T * k, "scale: expected ", T * k, " elements (T*k), got shape ", scale.shape_str());
  }
  check_tensor("dst", dst, "src", src);
  check_same_dtype("dst", dst, "src", src);
  check_shape("dst", dst, {R, H});
  const bool check = checks_values(check_indices, src);
  if (check) check_range("row_to_slot", row_to_slot, -1, T * k, stream);
  check_slot_to_row(slot_to_row, row_to_slot, "src", src, T, k, R, stream, check);
  if (on_cuda(src, "gather_rows")) {
    cuda::gather_rows(src, row_to_slot, slot_to_row, k, scale, dst, as_ptr(stream));
  } else {
    cpu::gather_rows(src, row_to_slot, k, scale, dst);
  }
}

void combine_rows(const TensorView& rows, const TensorView& slot_to_row, const TensorView& weights,
                  const TensorView& out, intptr_t stream, bool check_indices) {
  check_float_matrix("rows", rows);
  check_tensor("slot_to_row", slot_to_row, "rows", rows);
  check_dtype("slot_to_row", slot_to_row, {DType::kI32});
  check_ndim("slot_to_row", slot_to_row, 2);
  const int64_t T = slot_to_row.size(0), K = slot_to_row.size(1);
  check_optional("weights", weights, "rows", rows);
  if (weights.present) {
    check_dtype("weights", weights, {DType::kF32});
    check_shape("weights", weights, {T, K});
  }
  check_tensor("out", out, "rows", rows);
  check_same_dtype("out", out, "rows", rows);
  check_shape("out", out, {T, rows.size(1)});
  if (checks_values(check_indices, slot_to_row)) check_range("slot_to_row", slot_to_row, -1, rows.size(0), stream);
  if (on_cuda(rows, "combine_rows")) {
    cuda::combine_rows(rows, slot_to_row, weights, out, as_ptr(stream));
  } else {
    cpu::combine_rows(rows, slot_to_row, weights, out);
  }
}

void combine_weights_grad(const TensorView& dy, const TensorView& rows, const TensorView& slot_to_row,
                          const TensorView& d_weights, intptr_t stream, bool check_indices) {
  check_float_matrix("dy", dy);
  check_tensor("rows", rows, "dy", dy);
  check_same_dtype("rows", rows, "dy", dy);
  check_shape("rows", rows, {-1, dy.size(1)});
  check_tensor("slot_to_row", slot_to_row, "dy", dy);
  check_dtype("slot_to_row", slot_to_row, {DType::kI32});
  check_shape("slot_to_row", slot_to_row, {dy.size(0), -1});
  check_tensor("d_weights", d_weights, "dy", dy);
  check_dtype("d_weights", d_weights, {DType::kF32});
  check_shape("d_weights", d_weights, {dy.size(0), slot_to_row.size(1)});
  if (checks_values(check_indices, slot_to_row)) check_range("slot_to_row", slot_to_row, -1, rows.size(0), stream);
  if (on_cuda(dy, "combine_weights_grad")) {
    cuda::combine_weights_grad(dy, rows, slot_to_row, d_weights, as_ptr(stream));
  } else {
    cpu::combine_weights_grad(dy, rows, slot_to_row, d_weights);
  }
}

int64_t grouped_gemm_workspace_bytes(int num_experts, bool on_cuda) {
  if (on_cuda && num_experts >= 1) {
    // Whether the path exists at all on the current device: a probe with aligned (never dereferenced) pointers.
    TensorView probe = make_view(reinterpret_cast<void*>(256), DType::kBF16, {8, 8}, DeviceType::kCUDA);
    TensorView probe_b = make_view(reinterpret_cast<void*>(256), DType::kBF16, {1, 8, 8}, DeviceType::kCUDA);
    const int device = cuda::current_device_or_none();
    if (device < 0) return 0;
    probe.device_index = probe_b.device_index = device;
    if (cuda::grouped_gemm_sm90_supported(probe, probe_b, WeightLayout::kNK, 8))
      return static_cast<int64_t>(cuda::grouped_gemm_sm90_workspace_bytes(num_experts, 0, 0, 0));
  }
  return 0;
}

namespace {
// The workspace, when given, must be a CUDA uint8 buffer of grouped_gemm_workspace_bytes.
bool usable_workspace(const TensorView& ws, const TensorView& a, int64_t num_experts) {
  if (!ws.present) return false;
  check_tensor("workspace", ws, "a", a);
  check_dtype("workspace", ws, {DType::kU8});
  const int64_t need = grouped_gemm_workspace_bytes(static_cast<int>(num_experts), a.is_cuda());
  MOE8_CHECK(ws.numel() >= need, "workspace: expected at least ", need, " bytes, got ", ws.numel());
  return need > 0;
}

// Expert weights w [E, N, Kd] (kNK) or [E, Kd, N] (kKN) (N = -1: any) on ref's device, E >= 1, and their
// offsets [E+1] int32 there too; returns E.
int64_t check_expert_weights(const char* name, const TensorView& w, const TensorView& offsets, WeightLayout layout,
                             int64_t N, int64_t Kd, const char* ref_name, const TensorView& ref) {
  check_tensor(name, w, ref_name, ref);
  check_ndim(name, w, 3);
  const int64_t E = w.size(0);
  if (layout == WeightLayout::kNK)
    check_shape(name, w, {E, N, Kd});
  else
    check_shape(name, w, {E, Kd, N});
  MOE8_CHECK(E >= 1, name, ": expected at least one expert (dim 0), got shape ", w.shape_str());
  check_tensor("offsets", offsets, ref_name, ref);
  check_dtype("offsets", offsets, {DType::kI32});
  check_shape("offsets", offsets, {E + 1});
  return E;
}

}  // namespace

void grouped_gemm(const TensorView& a, const TensorView& b, const TensorView& offsets, WeightLayout layout,
                  const TensorView& bias, const TensorView& c, intptr_t stream, bool check_indices,
                  const TensorView& workspace) {
  check_float_matrix("a", a);
  const int64_t R = a.size(0), Kd = a.size(1);
  const int64_t E = check_expert_weights("b", b, offsets, layout, -1, Kd, "a", a);
  check_same_dtype("b", b, "a", a);
  const int64_t N = layout == WeightLayout::kNK ? b.size(1) : b.size(2);
  check_optional("bias", bias, "a", a);
  if (bias.present) {
    check_dtype("bias", bias, {a.dtype, DType::kF32});
    check_shape("bias", bias, {E, N});
  }
  check_tensor("c", c, "a", a);
  check_same_dtype("c", c, "a", a);
  check_shape("c", c, {R, N});
  if (checks_values(check_indices, offsets)) check_offsets(offsets, R, stream);
  if (on_cuda(a, "grouped_gemm")) {
    if (!bias.present && usable_workspace(workspace, a, E) && cuda::grouped_gemm_sm90_supported(a, b, layout, N))
      cuda::grouped_gemm_sm90(a, b, offsets, layout, c, workspace.data, workspace.numel(), as_ptr(stream));
    else
      cuda::grouped_gemm(a, b, offsets, layout, bias, c, as_ptr(stream));
  } else {
    cpu::grouped_gemm(a, b, offsets, layout, bias, c);
  }
}

namespace {
// The tokens' rows a gathered GEMM reads: x [T, Kd] float, top_k >= 1, row_to_slot [R] int32 of x's device,
// its slots in [-1, T * top_k) where checked. Returns R.
int64_t check_gather_source(const TensorView& x, const TensorView& row_to_slot, int top_k, bool check_indices,
                            intptr_t stream) {
  check_float_matrix("x", x);
  MOE8_CHECK(top_k >= 1, "top_k: expected at least 1, got ", top_k);
  check_tensor("row_to_slot", row_to_slot, "x", x);
  check_dtype("row_to_slot", row_to_slot, {DType::kI32});
  check_ndim("row_to_slot", row_to_slot, 1);
  if (checks_values(check_indices, row_to_slot)) check_range("row_to_slot", row_to_slot, -1, x.size(0) * top_k, stream);
  return row_to_slot.size(0);
}
}  // namespace

bool gathered_grouped_gemm(const TensorView& x, const TensorView& row_to_slot, int top_k, const TensorView& b,
                           const TensorView& offsets, WeightLayout layout, const TensorView& c, intptr_t stream,
                           bool check_indices, const TensorView& workspace) {
  const int64_t R = check_gather_source(x, row_to_slot, top_k, check_indices, stream), Kd = x.size(1);
  const int64_t E = check_expert_weights("b", b, offsets, layout, -1, Kd, "x", x);
  check_same_dtype("b", b, "x", x);
  const int64_t N = layout == WeightLayout::kNK ? b.size(1) : b.size(2);
  check_tensor("c", c, "x", x);
  check_same_dtype("c", c, "x", x);
  check_shape("c", c, {R, N});
  if (checks_values(check_indices, offsets)) check_offsets(offsets, R, stream);
  if (!on_cuda(x, "gathered_grouped_gemm")) {
    cpu::gathered_grouped_gemm(x, row_to_slot, top_k, b, offsets, layout, c);
    return true;
  }
  if (!usable_workspace(workspace, x, E) || !cuda::grouped_gemm_gathered_sm90_supported(x, b, layout, N)) return false;
  cuda::grouped_gemm_gathered_sm90(x, row_to_slot, top_k, b, offsets, c, workspace.data, workspace.numel(),
                                   as_ptr(stream));
  return true;
}

bool grouped_gemm_swiglu(const TensorView& a, const TensorView& b, const TensorView& offsets, const TensorView& h,
                         const TensorView& act, intptr_t stream, bool check_indices, const TensorView& workspace) {
  check_float_matrix("a", a);
  const int64_t R = a.size(0), Kd = a.size(1);
  const int64_t E = check_expert_weights("b", b, offsets, WeightLayout::kNK, -1, Kd, "a", a);
  check_same_dtype("b", b, "a", a);
  const int64_t N = b.size(1);
  MOE8_CHECK(N % 2 == 0, "b: SwiGLU expects an even 2I, got shape [", E, ", ", N, ", ", Kd, "]");
  check_tensor("h", h, "a", a);
  check_same_dtype("h", h, "a", a);
  check_shape("h", h, {R, N});
  check_tensor("act", act, "a", a);
  check_same_dtype("act", act, "a", a);
  check_shape("act", act, {R, N / 2});
  if (checks_values(check_indices, offsets)) check_offsets(offsets, R, stream);
  if (!on_cuda(a, "grouped_gemm_swiglu")) {
    cpu::grouped_gemm(a, b, offsets, WeightLayout::kNK, TensorView{}, h);
    cpu::activation_forward(h, ActParams{}, act);
    return true;
  }
  if (!usable_workspace(workspace, a, E) || !cuda::grouped_gemm_swiglu_sm90_supported(a, b, N)) return false;
  cuda::grouped_gemm_swiglu_sm90(a, b, offsets, h, act, workspace.data, workspace.numel(), as_ptr(stream));
  return true;
}

bool gathered_grouped_gemm_wgrad(const TensorView& x, const TensorView& row_to_slot, int top_k, const TensorView& dc,
                                 const TensorView& offsets, WeightLayout layout, const TensorView& db, intptr_t stream,
                                 bool check_indices, const TensorView& workspace) {
  const int64_t R = check_gather_source(x, row_to_slot, top_k, check_indices, stream), Kd = x.size(1);
  check_tensor("dc", dc, "x", x);
  check_same_dtype("dc", dc, "x", x);
  check_shape("dc", dc, {R, -1});
  const int64_t E = check_expert_weights("db", db, offsets, layout, dc.size(1), Kd, "x", x);
  check_same_dtype("db", db, "x", x);
  if (checks_values(check_indices, offsets)) check_offsets(offsets, R, stream);
  if (!on_cuda(x, "gathered_grouped_gemm_wgrad") || layout != WeightLayout::kNK || !usable_workspace(workspace, x, E) ||
      !cuda::grouped_gemm_wgrad_gathered_sm90_supported(x, dc, db))
    return false;
  cuda::grouped_gemm_wgrad_gathered_sm90(x, row_to_slot, top_k, dc, offsets, db, workspace.data, workspace.numel(),
                                         as_ptr(stream));
  return true;
}

void grouped_gemm_wgrad(const TensorView& a, const TensorView& dc, const TensorView& offsets, WeightLayout layout,
                        const TensorView& db, const TensorView& dbias, intptr_t stream, bool check_indices,
                        const TensorView& workspace) {
  check_float_matrix("a", a);
  const int64_t R = a.size(0), Kd = a.size(1);
  check_tensor("dc", dc, "a", a);
  check_same_dtype("dc", dc, "a", a);
  check_shape("dc", dc, {R, -1});
  const int64_t N = dc.size(1);
  const int64_t E = check_expert_weights("db", db, offsets, layout, N, Kd, "a", a);
  check_dtype("db", db, {a.dtype, DType::kF32});
  check_optional("dbias", dbias, "a", a);
  if (dbias.present) {
    check_same_dtype("dbias", dbias, "db", db);
    check_shape("dbias", dbias, {E, N});
  }
  if (checks_values(check_indices, offsets)) check_offsets(offsets, R, stream);
  if (on_cuda(a, "grouped_gemm_wgrad")) {
    // The sm_90a wgrad writes db in the inputs' dtype and has no bias term; kKN is kNK with a and dc swapped.
    const bool kn = layout == WeightLayout::kKN;
    const TensorView& lhs = kn ? dc : a;
    const TensorView& rhs = kn ? a : dc;
    if (!dbias.present && db.dtype == a.dtype && usable_workspace(workspace, a, E) &&
        cuda::grouped_gemm_sm90_supported(lhs, db, WeightLayout::kNK, rhs.size(1)))
      cuda::grouped_gemm_wgrad_sm90(lhs, rhs, offsets, db, workspace.data, workspace.numel(), as_ptr(stream));
    else
      cuda::grouped_gemm_wgrad(a, dc, offsets, layout, db, dbias, as_ptr(stream));
  } else {
    cpu::grouped_gemm_wgrad(a, dc, offsets, layout, db, dbias);
  }
}

namespace {
void check_activation(const TensorView& h, const ActParams& p, const TensorView& out, const char* out_name) {
  check_float_matrix("h", h);
  check_tensor(out_name, out, "h", h);
  check_same_dtype(out_name, out, "h", h);
  check_ndim(out_name, out, 2);
  const int64_t I = out.size(1);
  check_shape(out_name, out, {h.size(0), -1});
  if (is_gated(p.kind))
    MOE8_CHECK(h.size(1) == 2 * I, "h: a gated activation expects h.shape[1] == 2 * ", out_name, ".shape[1] = ", 2 * I,
               ", got ", h.size(1));
  else
    MOE8_CHECK(h.size(1) == I, "h: an ungated activation expects h.shape[1] == ", out_name, ".shape[1] = ", I, ", got ",
               h.size(1));
  MOE8_CHECK(p.kind >= ActKind::kSwiGLU && p.kind <= ActKind::kGELU, "kind: unknown activation ",
             static_cast<int>(p.kind));
}
}  // namespace

void grouped_lowrank_add(const TensorView& h, const TensorView& t, const TensorView& b, const TensorView& offsets,
                         WeightLayout layout, const TensorView& out, intptr_t stream, bool check_indices) {
  check_float_matrix("h", h);
  const int64_t R = h.size(0), N = h.size(1);
  check_float_matrix("t", t);
  check_tensor("t", t, "h", h);
  check_same_dtype("t", t, "h", h);
  const int64_t rank = t.size(1);
  check_shape("t", t, {R, rank});
  MOE8_CHECK(rank <= 1024, "t: expected a rank (dim 1) of at most 1024, got ", rank);
  check_expert_weights("b", b, offsets, layout, N, rank, "h", h);
  check_same_dtype("b", b, "h", h);
  check_tensor("out", out, "h", h);
  check_same_dtype("out", out, "h", h);
  check_shape("out", out, {R, N});
  if (checks_values(check_indices, offsets)) check_offsets(offsets, R, stream);
  if (on_cuda(h, "grouped_lowrank_add")) {
    cuda::grouped_lowrank_add(h, t, b, offsets, layout, out, as_ptr(stream));
  } else {
    cpu::grouped_lowrank_add(h, t, b, offsets, layout, out);
  }
}

void activation_forward(const TensorView& h, const ActParams& p, const TensorView& out, intptr_t stream) {
  check_activation(h, p, out, "out");
  if (on_cuda(h, "activation_forward")) {
    cuda::activation_forward(h, p, out, as_ptr(stream));
  } else {
    cpu::activation_forward(h, p, out);
  }
}

void activation_backward(const TensorView& h, const TensorView& dout, const ActParams& p, const TensorView& dh,
                         intptr_t stream) {
  check_activation(h, p, dout, "dout");
  check_tensor("dh", dh, "h", h);
  check_same_dtype("dh", dh, "h", h);
  check_shape("dh", dh, {h.size(0), h.size(1)});
  if (on_cuda(h, "activation_backward")) {
    cuda::activation_backward(h, dout, p, dh, as_ptr(stream));
  } else {
    cpu::activation_backward(h, dout, p, dh);
  }
}

namespace {
// activation_backward_routed's arguments (the fused dgrad checks the same).
void check_routed_backward(const TensorView& h, const TensorView& dout, const TensorView& weights,
                           const TensorView& row_to_slot, const ActParams& p, const TensorView& dh,
                           const TensorView& a_w, const TensorView& d_weights, intptr_t stream, bool check_indices) {
  check_activation(h, p, dout, "dout");
  check_tensor("dh", dh, "h", h);
  check_same_dtype("dh", dh, "h", h);
  check_shape("dh", dh, {h.size(0), h.size(1)});
  check_tensor("a_w", a_w, "h", h);
  check_same_dtype("a_w", a_w, "h", h);
  check_shape("a_w", a_w, {dout.size(0), dout.size(1)});
  check_tensor("weights", weights, "h", h);
  check_dtype("weights", weights, {DType::kF32});
  check_ndim("weights", weights, 1);
  check_tensor("d_weights", d_weights, "h", h);
  check_dtype("d_weights", d_weights, {DType::kF32});
  check_shape("d_weights", d_weights, {weights.size(0)});
  check_tensor("row_to_slot", row_to_slot, "h", h);
  check_dtype("row_to_slot", row_to_slot, {DType::kI32});
  check_shape("row_to_slot", row_to_slot, {h.size(0)});
  if (checks_values(check_indices, row_to_slot)) check_range("row_to_slot", row_to_slot, -1, weights.size(0), stream);
}
}  // namespace

void activation_backward_routed(const TensorView& h, const TensorView& dout, const TensorView& weights,
                                const TensorView& row_to_slot, const ActParams& p, const TensorView& dh,
                                const TensorView& a_w, const TensorView& d_weights, intptr_t stream, bool check_indices,
                                const TensorView& dh_q, const TensorView& dh_scale) {
  check_routed_backward(h, dout, weights, row_to_slot, p, dh, a_w, d_weights, stream, check_indices);
  const bool quantise = dh_q.present;
  MOE8_CHECK(dh_q.present == dh_scale.present, "dh_q and dh_scale: expected both or neither, got ",
             dh_q.present ? "dh_q only" : "dh_scale only");
  if (quantise) {
    check_tensor("dh_q", dh_q, "h", h);
    check_dtype("dh_q", dh_q, {DType::kU8, DType::kF8E4M3});
    check_shape("dh_q", dh_q, {h.size(0), h.size(1)});
    check_tensor("dh_scale", dh_scale, "h", h);
    check_dtype("dh_scale", dh_scale, {DType::kF32});
    check_shape("dh_scale", dh_scale, {h.size(0), quant_blocks(h.size(1))});
  }
  if (on_cuda(h, "activation_backward_routed")) {
    cuda::activation_backward_routed(h, dout, weights, row_to_slot, p, dh, a_w, d_weights, as_ptr(stream), dh_q,
                                     dh_scale);
  } else {
    cpu::activation_backward_routed(h, dout, weights, row_to_slot, p, dh, a_w, d_weights);
    if (quantise) cpu::quantize_rows_1x128(dh, TensorView{}, 1, dh_q, dh_scale);
  }
}

bool grouped_gemm_act_backward(const TensorView& a, const TensorView& b, const TensorView& offsets, WeightLayout layout,
                               const TensorView& h, const TensorView& weights, const TensorView& row_to_slot,
                               const ActParams& p, const TensorView& dh, const TensorView& a_w,
                               const TensorView& partials, const TensorView& d_weights, intptr_t stream,
                               bool check_indices, const TensorView& workspace) {
  check_float_matrix("a", a);
  const int64_t R = a.size(0), Kd = a.size(1);
  const int64_t E = check_expert_weights("b", b, offsets, layout, -1, Kd, "a", a);
  check_same_dtype("b", b, "a", a);
  const int64_t N = layout == WeightLayout::kNK ? b.size(1) : b.size(2);
  check_tensor("a_w", a_w, "a", a);
  check_same_dtype("a_w", a_w, "a", a);
  check_shape("a_w", a_w, {R, N});
  check_tensor("h", h, "a", a);
  check_same_dtype("h", h, "a", a);
  check_shape("h", h, {R, -1});
  check_tensor("partials", partials, "a", a);
  check_dtype("partials", partials, {DType::kF32});
  check_shape("partials", partials, {R, cuda::grouped_gemm_act_backward_sm90_parts(N)});
  if (checks_values(check_indices, offsets)) check_offsets(offsets, R, stream);
  check_routed_backward(h, a_w, weights, row_to_slot, p, dh, a_w, d_weights, stream, check_indices);
  const bool fused = on_cuda(a, "grouped_gemm_act_backward") && layout == WeightLayout::kKN &&
                     usable_workspace(workspace, a, E) && cuda::grouped_gemm_act_backward_sm90_supported(a, b, h, p);
  if (fused) {
    cuda::grouped_gemm_act_backward_sm90(a, b, offsets, h, weights, row_to_slot, p, dh, a_w, partials, d_weights,
                                         workspace.data, workspace.numel(), as_ptr(stream));
  } else {  // checked above
    grouped_gemm(a, b, offsets, layout, TensorView{}, a_w, stream, false, workspace);
    activation_backward_routed(h, a_w, weights, row_to_slot, p, dh, a_w, d_weights, stream, false);
  }
  return fused;
}

}  // namespace moe8::api
