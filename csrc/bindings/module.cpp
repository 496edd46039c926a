// module.cpp — the moe8._C extension: converts DLPack arrays (any framework) to TensorViews and calls
// api/. Nothing else happens here: validation and dispatch live in api/.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <vector>

#include "api/ops.h"
#include "bindings/view.h"
#include "core/error.h"
#include "cuda/grouped_gemm_sm90.h"

namespace nb = nanobind;
using moe8::TensorView;

void bind_ipc(nb::module_& m);  // bindings/ipc.cpp

namespace {

using moe8::bindings::Array;
using moe8::bindings::OptArray;
using moe8::bindings::view;

moe8::RouteParams route_params(int scheme, int k, bool renormalize, int n_group, int topk_group, float scaling) {
  MOE8_CHECK(scheme >= 0 && scheme <= 2, "scheme: expected 0 (softmax), 1 (sigmoid_group) or 2 (topk_softmax), got ",
             scheme);
  moe8::RouteParams p;
  p.scheme = static_cast<moe8::RouteScheme>(scheme);
  p.k = k;
  p.renormalize = renormalize;
  p.n_group = n_group;
  p.topk_group = topk_group;
  p.scaling = scaling;
  return p;
}

moe8::ActParams act_params(int kind, bool interleaved, float alpha, float limit) {
  MOE8_CHECK(kind >= 0 && kind <= 3, "activation: expected 0 (swiglu), 1 (swiglu_clamped), 2 (silu) or 3 (gelu), got ",
             kind);
  moe8::ActParams p;
  p.kind = static_cast<moe8::ActKind>(kind);
  p.interleaved = interleaved;
  p.alpha = alpha;
  p.limit = limit;
  return p;
}

// A list argument's arrays as views, each named like list[i].
std::vector<TensorView> views(const std::vector<Array>& arrays, const char* list) {
  std::vector<TensorView> out;
  out.reserve(arrays.size());
  for (size_t i = 0; i < arrays.size(); ++i)
    out.push_back(view(arrays[i], (std::string(list) + "[" + std::to_string(i) + "]").c_str()));
  return out;
}

moe8::WeightLayout layout_of(int layout) {
  MOE8_CHECK(layout == 0 || layout == 1, "layout: expected 0 (nk) or 1 (kn), got ", layout);
  return static_cast<moe8::WeightLayout>(layout);
}

// What this build holds (CMakeLists.txt defines these for this file): "cpu" (CUDA-less: csrc/cuda_stub),
// "cuda" (CUDA kernels, no CUTLASS) or "cuda+cutlass" (the sm90a CUTLASS kernels too); the nvcc -gencode flags
// the kernels were compiled with; the CUDA toolkit and CUTLASS versions. Empty strings where absent.
nb::dict build_info() {
  nb::dict d;
#if defined(MOE8_WITH_CUDA) && defined(MOE8_BUILD_CUTLASS_VERSION)
  d["backend"] = "cuda+cutlass";
  d["cutlass_version"] = std::string(MOE8_BUILD_CUTLASS_VERSION);
#elif defined(MOE8_WITH_CUDA)
  d["backend"] = "cuda";
  d["cutlass_version"] = std::string();
#else
  d["backend"] = "cpu";
  d["cutlass_version"] = std::string();
#endif
#if defined(MOE8_WITH_CUDA) && defined(MOE8_BUILD_GENCODE) && defined(MOE8_BUILD_CUDA_VERSION)
  d["gencode"] = std::string(MOE8_BUILD_GENCODE);
  d["cuda_version"] = std::string(MOE8_BUILD_CUDA_VERSION);
#else
  d["gencode"] = std::string();
  d["cuda_version"] = std::string();
#endif
  return d;
}

}  // namespace

#define V(x) view(x, #x)

NB_MODULE(_C, m) {
  m.doc() = "moe8 core: fused MoE routing, dispatch plan, permutation, grouped GEMM and activations";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const moe8::CudaError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
  m.def("cuda_available", &moe8::api::cuda_available);
  m.def("build_info", &build_info);
  m.def("reload_sm90_overrides", &moe8::api::reload_sm90_overrides);
  bind_ipc(m);
  m.def(
      "route_forward",
      [](Array logits, OptArray bias, int scheme, int k, bool renormalize, int n_group, int topk_group, float scaling,
         Array ids, Array weights, Array prob_mean, Array token_frac, Array lse, intptr_t stream) {
        moe8::api::route_forward(V(logits), V(bias), route_params(scheme, k, renormalize, n_group, topk_group, scaling),
                                 V(ids), V(weights), V(prob_mean), V(token_frac), V(lse), stream);
      },
      nb::arg("logits"), nb::arg("bias").none(), nb::arg("scheme"), nb::arg("k"), nb::arg("renormalize"),
      nb::arg("n_group"), nb::arg("topk_group"), nb::arg("scaling"), nb::arg("ids"), nb::arg("weights"),
      nb::arg("prob_mean"), nb::arg("token_frac"), nb::arg("lse"), nb::arg("stream") = 0);
  m.def(
      "route_backward",
      [](Array logits, OptArray bias, int scheme, int k, bool renormalize, int n_group, int topk_group, float scaling,
         Array ids, Array grad_weights, OptArray grad_prob_mean, OptArray grad_lse, Array grad_logits, intptr_t stream,
         bool check_indices) {
        moe8::api::route_backward(
            V(logits), V(bias), route_params(scheme, k, renormalize, n_group, topk_group, scaling), V(ids),
            V(grad_weights), V(grad_prob_mean), V(grad_lse), V(grad_logits), stream, check_indices);
      },
      nb::arg("logits"), nb::arg("bias").none(), nb::arg("scheme"), nb::arg("k"), nb::arg("renormalize"),
      nb::arg("n_group"), nb::arg("topk_group"), nb::arg("scaling"), nb::arg("ids"), nb::arg("grad_weights"),
      nb::arg("grad_prob_mean").none(), nb::arg("grad_lse").none(), nb::arg("grad_logits"), nb::arg("stream") = 0,
      nb::arg("check_indices") = true);
  m.def("plan_workspace_elems", &moe8::api::plan_workspace_elems, nb::arg("num_slots"), nb::arg("num_experts"),
        nb::arg("on_cuda"));
  m.def("plan_max_rows", &moe8::api::plan_max_rows, nb::arg("num_slots"), nb::arg("num_experts"),
        nb::arg("pad_multiple"));
  m.def(
      "build_dispatch_plan",
      [](Array ids, int num_experts, int pad_multiple, Array counts, Array offsets, Array row_to_slot,
         Array slot_to_row, OptArray workspace, intptr_t stream, bool check_indices) {
        moe8::api::build_dispatch_plan(V(ids), num_experts, pad_multiple, V(counts), V(offsets), V(row_to_slot),
                                       V(slot_to_row), V(workspace), stream, check_indices);
      },
      nb::arg("ids"), nb::arg("num_experts"), nb::arg("pad_multiple"), nb::arg("counts"), nb::arg("offsets"),
      nb::arg("row_to_slot"), nb::arg("slot_to_row"), nb::arg("workspace").none(), nb::arg("stream") = 0,
      nb::arg("check_indices") = true);
  m.def(
      "gather_rows",
      [](Array src, Array row_to_slot, int k, OptArray scale, Array dst, intptr_t stream, bool check_indices,
         OptArray slot_to_row) {
        moe8::api::gather_rows(V(src), V(row_to_slot), k, V(scale), V(dst), stream, check_indices, V(slot_to_row));
      },
      nb::arg("src"), nb::arg("row_to_slot"), nb::arg("k"), nb::arg("scale").none(), nb::arg("dst"),
      nb::arg("stream") = 0, nb::arg("check_indices") = true, nb::arg("slot_to_row").none() = nb::none());
  m.def(
      "combine_rows",
      [](Array rows, Array slot_to_row, OptArray weights, Array out, intptr_t stream, bool check_indices) {
        moe8::api::combine_rows(V(rows), V(slot_to_row), V(weights), V(out), stream, check_indices);
      },
      nb::arg("rows"), nb::arg("slot_to_row"), nb::arg("weights").none(), nb::arg("out"), nb::arg("stream") = 0,
      nb::arg("check_indices") = true);
  m.def(
      "combine_weights_grad",
      [](Array dy, Array rows, Array slot_to_row, Array d_weights, intptr_t stream, bool check_indices) {
        moe8::api::combine_weights_grad(V(dy), V(rows), V(slot_to_row), V(d_weights), stream, check_indices);
      },
      nb::arg("dy"), nb::arg("rows"), nb::arg("slot_to_row"), nb::arg("d_weights"), nb::arg("stream") = 0,
      nb::arg("check_indices") = true);
  m.def("grouped_gemm_workspace_bytes", &moe8::api::grouped_gemm_workspace_bytes, nb::arg("num_experts"),
        nb::arg("on_cuda"));
  m.def(
      "grouped_gemm",
      [](Array a, Array b, Array offsets, int layout, OptArray bias, Array c, intptr_t stream, bool check_indices,
         OptArray workspace) {
        moe8::api::grouped_gemm(V(a), V(b), V(offsets), layout_of(layout), V(bias), V(c), stream, check_indices,
                                V(workspace));
      },
      nb::arg("a"), nb::arg("b"), nb::arg("offsets"), nb::arg("layout"), nb::arg("bias").none(), nb::arg("c"),
      nb::arg("stream") = 0, nb::arg("check_indices") = true, nb::arg("workspace").none() = nb::none());
  m.def(
      "gathered_grouped_gemm",
      [](Array x, Array row_to_slot, int top_k, Array b, Array offsets, int layout, Array c, intptr_t stream,
         bool check_indices, OptArray workspace) {
        return moe8::api::gathered_grouped_gemm(V(x), V(row_to_slot), top_k, V(b), V(offsets), layout_of(layout), V(c),
                                                stream, check_indices, V(workspace));
      },
      nb::arg("x"), nb::arg("row_to_slot"), nb::arg("top_k"), nb::arg("b"), nb::arg("offsets"), nb::arg("layout"),
      nb::arg("c"), nb::arg("stream") = 0, nb::arg("check_indices") = true, nb::arg("workspace").none() = nb::none());
  m.def(
      "grouped_gemm_swiglu",
      [](Array a, Array b, Array offsets, Array h, Array act, intptr_t stream, bool check_indices, OptArray workspace) {
        return moe8::api::grouped_gemm_swiglu(V(a), V(b), V(offsets), V(h), V(act), stream, check_indices,
                                              V(workspace));
      },
      nb::arg("a"), nb::arg("b"), nb::arg("offsets"), nb::arg("h"), nb::arg("act"), nb::arg("stream") = 0,
      nb::arg("check_indices") = true, nb::arg("workspace").none() = nb::none());
  m.def(
      "gathered_grouped_gemm_wgrad",
      [](Array x, Array row_to_slot, int top_k, Array dc, Array offsets, int layout, Array db, intptr_t stream,
         bool check_indices, OptArray workspace) {
        return moe8::api::gathered_grouped_gemm_wgrad(V(x), V(row_to_slot), top_k, V(dc), V(offsets), layout_of(layout),
                                                      V(db), stream, check_indices, V(workspace));
      },
      nb::arg("x"), nb::arg("row_to_slot"), nb::arg("top_k"), nb::arg("dc"), nb::arg("offsets"), nb::arg("layout"),
      nb::arg("db"), nb::arg("stream") = 0, nb::arg("check_indices") = true, nb::arg("workspace").none() = nb::none());
  m.def(
      "grouped_gemm_wgrad",
      [](Array a, Array dc, Array offsets, int layout, Array db, OptArray dbias, intptr_t stream, bool check_indices,
         OptArray workspace) {
        moe8::api::grouped_gemm_wgrad(V(a), V(dc), V(offsets), layout_of(layout), V(db), V(dbias), stream,
                                      check_indices, V(workspace));
      },
      nb::arg("a"), nb::arg("dc"), nb::arg("offsets"), nb::arg("layout"), nb::arg("db"), nb::arg("dbias").none(),
      nb::arg("stream") = 0, nb::arg("check_indices") = true, nb::arg("workspace").none() = nb::none());
  m.def(
      "grouped_lowrank_add",
      [](Array h, Array t, Array b, Array offsets, int layout, Array out, intptr_t stream, bool check_indices) {
        moe8::api::grouped_lowrank_add(V(h), V(t), V(b), V(offsets), layout_of(layout), V(out), stream, check_indices);
      },
      nb::arg("h"), nb::arg("t"), nb::arg("b"), nb::arg("offsets"), nb::arg("layout"), nb::arg("out"),
      nb::arg("stream") = 0, nb::arg("check_indices") = true);
  m.def(
      "activation_forward",
      [](Array h, int kind, bool interleaved, float alpha, float limit, Array out, intptr_t stream) {
        moe8::api::activation_forward(V(h), act_params(kind, interleaved, alpha, limit), V(out), stream);
      },
      nb::arg("h"), nb::arg("kind"), nb::arg("interleaved"), nb::arg("alpha"), nb::arg("limit"), nb::arg("out"),
      nb::arg("stream") = 0);
  m.def(
      "activation_backward",
      [](Array h, Array dout, int kind, bool interleaved, float alpha, float limit, Array dh, intptr_t stream) {
        moe8::api::activation_backward(V(h), V(dout), act_params(kind, interleaved, alpha, limit), V(dh), stream);
      },
      nb::arg("h"), nb::arg("dout"), nb::arg("kind"), nb::arg("interleaved"), nb::arg("alpha"), nb::arg("limit"),
      nb::arg("dh"), nb::arg("stream") = 0);
  m.def(
      "activation_backward_routed",
      [](Array h, Array dout, Array weights, Array row_to_slot, int kind, bool interleaved, float alpha, float limit,
         Array dh, Array a_w, Array d_weights, intptr_t stream, bool check_indices, OptArray dh_q, OptArray dh_scale) {
        moe8::api::activation_backward_routed(V(h), V(dout), V(weights), V(row_to_slot),
                                              act_params(kind, interleaved, alpha, limit), V(dh), V(a_w), V(d_weights),
                                              stream, check_indices, V(dh_q), V(dh_scale));
      },
      nb::arg("h"), nb::arg("dout"), nb::arg("weights"), nb::arg("row_to_slot"), nb::arg("kind"),
      nb::arg("interleaved"), nb::arg("alpha"), nb::arg("limit"), nb::arg("dh"), nb::arg("a_w"), nb::arg("d_weights"),
      nb::arg("stream") = 0, nb::arg("check_indices") = true, nb::arg("dh_q").none() = nb::none(),
      nb::arg("dh_scale").none() = nb::none());
  m.def(
      "grouped_gemm_act_backward",
      [](Array a, Array b, Array offsets, int layout, Array h, Array weights, Array row_to_slot, int kind,
         bool interleaved, float alpha, float limit, Array dh, Array a_w, Array partials, Array d_weights,
         intptr_t stream, bool check_indices, OptArray workspace) {
        return moe8::api::grouped_gemm_act_backward(V(a), V(b), V(offsets), layout_of(layout), V(h), V(weights),
                                                    V(row_to_slot), act_params(kind, interleaved, alpha, limit), V(dh),
                                                    V(a_w), V(partials), V(d_weights), stream, check_indices,
                                                    V(workspace));
      },
      nb::arg("a"), nb::arg("b"), nb::arg("offsets"), nb::arg("layout"), nb::arg("h"), nb::arg("weights"),
      nb::arg("row_to_slot"), nb::arg("kind"), nb::arg("interleaved"), nb::arg("alpha"), nb::arg("limit"),
      nb::arg("dh"), nb::arg("a_w"), nb::arg("partials"), nb::arg("d_weights"), nb::arg("stream") = 0,
      nb::arg("check_indices") = true, nb::arg("workspace").none() = nb::none());
  m.def("grouped_gemm_act_backward_parts", &moe8::cuda::grouped_gemm_act_backward_sm90_parts, nb::arg("n"));
  m.def(
      "cross_entropy_rows",
      [](Array logits, Array target, int64_t ignore_index, Array loss, intptr_t stream) {
        moe8::api::cross_entropy_rows(V(logits), V(target), ignore_index, V(loss), stream);
      },
      nb::arg("logits"), nb::arg("target"), nb::arg("ignore_index"), nb::arg("loss"), nb::arg("stream") = 0);
  m.def(
      "rope",
      [](Array x, Array cos, Array sin, Array out, bool backward, intptr_t stream) {
        moe8::api::rope(V(x), V(cos), V(sin), V(out), backward, stream);
      },
      nb::arg("x"), nb::arg("cos"), nb::arg("sin"), nb::arg("out"), nb::arg("backward") = false, nb::arg("stream") = 0);
  m.def(
      "rms_norm_forward",
      [](Array x, Array weight, double eps, Array y, Array rstd, intptr_t stream) {
        moe8::api::rms_norm_forward(V(x), V(weight), eps, V(y), V(rstd), stream);
      },
      nb::arg("x"), nb::arg("weight"), nb::arg("eps"), nb::arg("y"), nb::arg("rstd"), nb::arg("stream") = 0);
  m.def("rms_norm_workspace_elems", &moe8::api::rms_norm_workspace_elems, nb::arg("rows"), nb::arg("cols"),
        nb::arg("on_cuda"));
  m.def(
      "rms_norm_backward",
      [](Array dy, Array x, Array weight, Array rstd, Array dx, Array dweight, OptArray workspace, intptr_t stream) {
        moe8::api::rms_norm_backward(V(dy), V(x), V(weight), V(rstd), V(dx), V(dweight), V(workspace), stream);
      },
      nb::arg("dy"), nb::arg("x"), nb::arg("weight"), nb::arg("rstd"), nb::arg("dx"), nb::arg("dweight"),
      nb::arg("workspace").none(), nb::arg("stream") = 0);
  // ---- optimizer steps (api/ops.h)
  m.def(
      "adamw_step",
      [](const std::vector<Array>& params, const std::vector<Array>& grads, const std::vector<Array>& exp_avgs,
         const std::vector<Array>& exp_avg_sqs, double lr, double beta1, double beta2, double eps, double weight_decay,
         int64_t step, bool maximize, intptr_t stream) {
        moe8::api::adamw_step(views(params, "params"), views(grads, "grads"), views(exp_avgs, "exp_avgs"),
                              views(exp_avg_sqs, "exp_avg_sqs"), lr, beta1, beta2, eps, weight_decay, step, maximize,
                              stream);
      },
      nb::arg("params"), nb::arg("grads"), nb::arg("exp_avgs"), nb::arg("exp_avg_sqs"), nb::arg("lr"), nb::arg("beta1"),
      nb::arg("beta2"), nb::arg("eps"), nb::arg("weight_decay"), nb::arg("step"), nb::arg("maximize") = false,
      nb::arg("stream") = 0);
  // ---- FP8 e4m3: quantised tensors as uint8 or float8_e4m3fn, scales float32 (api/ops.h)
  m.def(
      "quantize_rows_1x128",
      [](Array x, OptArray row_to_slot, int k, Array q, Array scale, intptr_t stream, bool check_indices,
         OptArray slot_to_row) {
        moe8::api::quantize_rows_1x128(V(x), V(row_to_slot), k, V(q), V(scale), stream, check_indices, V(slot_to_row));
      },
      nb::arg("x"), nb::arg("row_to_slot").none(), nb::arg("k"), nb::arg("q"), nb::arg("scale"), nb::arg("stream") = 0,
      nb::arg("check_indices") = true, nb::arg("slot_to_row").none() = nb::none());
  m.def(
      "quantize_weight_128x128",
      [](Array w, OptArray q, OptArray scale, intptr_t stream, OptArray q_t, OptArray scale_t) {
        moe8::api::quantize_weight_128x128(V(w), V(q), V(scale), stream, V(q_t), V(scale_t));
      },
      nb::arg("w"), nb::arg("q").none(), nb::arg("scale").none(), nb::arg("stream") = 0,
      nb::arg("q_t").none() = nb::none(), nb::arg("scale_t").none() = nb::none());
  m.def("col_scale_blocks", &moe8::api::col_scale_blocks, nb::arg("rows"), nb::arg("num_experts"));
  m.def(
      "quantize_cols_1x128",
      [](Array x, Array offsets, Array q_t, Array scale, intptr_t stream, bool check_indices) {
        moe8::api::quantize_cols_1x128(V(x), V(offsets), V(q_t), V(scale), stream, check_indices);
      },
      nb::arg("x"), nb::arg("offsets"), nb::arg("q_t"), nb::arg("scale"), nb::arg("stream") = 0,
      nb::arg("check_indices") = true);
  m.def(
      "swiglu_quant",
      [](Array h, int kind, bool interleaved, float alpha, float limit, Array q, Array scale, intptr_t stream) {
        moe8::api::swiglu_quant(V(h), act_params(kind, interleaved, alpha, limit), V(q), V(scale), stream);
      },
      nb::arg("h"), nb::arg("kind"), nb::arg("interleaved"), nb::arg("alpha"), nb::arg("limit"), nb::arg("q"),
      nb::arg("scale"), nb::arg("stream") = 0);
  m.def(
      "quantize_rowwise",
      [](Array x, Array q, Array scale, intptr_t stream) { moe8::api::quantize_rowwise(V(x), V(q), V(scale), stream); },
      nb::arg("x"), nb::arg("q"), nb::arg("scale"), nb::arg("stream") = 0);
  m.def(
      "quantize_tensorwise",
      [](Array x, Array q, Array scale, intptr_t stream) {
        moe8::api::quantize_tensorwise(V(x), V(q), V(scale), stream);
      },
      nb::arg("x"), nb::arg("q"), nb::arg("scale"), nb::arg("stream") = 0);
  m.def(
      "dequantize",
      [](Array q, Array scale, int64_t block_rows, int64_t block_cols, Array out, intptr_t stream) {
        moe8::api::dequantize(V(q), V(scale), block_rows, block_cols, V(out), stream);
      },
      nb::arg("q"), nb::arg("scale"), nb::arg("block_rows"), nb::arg("block_cols"), nb::arg("out"),
      nb::arg("stream") = 0);
  m.def("grouped_gemm_fp8_workspace_bytes", &moe8::api::grouped_gemm_fp8_workspace_bytes, nb::arg("num_experts"),
        nb::arg("on_cuda"));
  m.def(
      "grouped_gemm_fp8",
      [](Array a, Array a_scale, Array b, Array b_scale, Array offsets, Array c, intptr_t stream, bool check_indices,
         OptArray workspace) {
        moe8::api::grouped_gemm_fp8(V(a), V(a_scale), V(b), V(b_scale), V(offsets), V(c), stream, check_indices,
                                    V(workspace));
      },
      nb::arg("a"), nb::arg("a_scale"), nb::arg("b"), nb::arg("b_scale"), nb::arg("offsets"), nb::arg("c"),
      nb::arg("stream") = 0, nb::arg("check_indices") = true, nb::arg("workspace").none() = nb::none());
  m.def("quantize_grouped_gemm_fp8_scratch_bytes", &moe8::api::quantize_grouped_gemm_fp8_scratch_bytes, nb::arg("rows"),
        nb::arg("cols"));
  m.def(
      "quantize_grouped_gemm_fp8",
      [](Array x, OptArray row_to_slot, int top_k, OptArray slot_to_row, Array b, Array b_scale, Array offsets,
         Array scratch, Array c, intptr_t stream, bool check_indices, OptArray workspace) {
        moe8::api::quantize_grouped_gemm_fp8(V(x), V(row_to_slot), top_k, V(slot_to_row), V(b), V(b_scale), V(offsets),
                                             V(scratch), V(c), stream, check_indices, V(workspace));
      },
      nb::arg("x"), nb::arg("row_to_slot").none(), nb::arg("top_k"), nb::arg("slot_to_row").none(), nb::arg("b"),
      nb::arg("b_scale"), nb::arg("offsets"), nb::arg("scratch"), nb::arg("c"), nb::arg("stream") = 0,
      nb::arg("check_indices") = true, nb::arg("workspace").none() = nb::none());
  m.def("grouped_gemm_fp8_wgrad_workspace_bytes", &moe8::api::grouped_gemm_fp8_wgrad_workspace_bytes,
        nb::arg("num_experts"), nb::arg("on_cuda"));
  m.def(
      "grouped_gemm_fp8_wgrad",
      [](Array dc_t, Array dc_scale, Array a_t, Array a_scale, Array offsets, Array db, intptr_t stream,
         bool check_indices, OptArray workspace) {
        moe8::api::grouped_gemm_fp8_wgrad(V(dc_t), V(dc_scale), V(a_t), V(a_scale), V(offsets), V(db), stream,
                                          check_indices, V(workspace));
      },
      nb::arg("dc_t"), nb::arg("dc_scale"), nb::arg("a_t"), nb::arg("a_scale"), nb::arg("offsets"), nb::arg("db"),
      nb::arg("stream") = 0, nb::arg("check_indices") = true, nb::arg("workspace").none() = nb::none());
}
