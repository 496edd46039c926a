// test_validation.cpp — every api:: op rejects bad arguments with a moe8::Error naming the argument:
// wrong dtype, shape, ndim, strides, device, missing tensors, bad scalars and out-of-range indices.
// Each case starts from a call that must succeed, then breaks one thing. Buffers carry slack so that a
// check the API forgets shows up as a missing exception, not a crash.
#include "test_ref.h"

namespace moe8::test {
namespace {

constexpr size_t kSlack = 4096;

HostTensor buf(DType d, const Shape& s) { return HostTensor(d, s, kSlack); }

TensorView reshaped(TensorView v, const Shape& s) {
  TensorView r = view_of(v.data, v.dtype, s, v.device);
  r.device_index = v.device_index;
  return r;
}
TensorView retyped(TensorView v, DType d) {
  v.dtype = d;
  return v;
}
TensorView strided(TensorView v) {  // padded rows (2-d+) or every other element (1-d)
  v.strides[0] *= 2;
  return v;
}
TensorView transposed(TensorView v) {  // a 2-d view with swapped strides (a .t() in torch)
  std::swap(v.strides[0], v.strides[1]);
  return v;
}
TensorView on_cuda(TensorView v) {  // validation must reject it before touching the (null) data
  v.device = DeviceType::kCUDA;
  v.data = nullptr;
  return v;
}

// ------------------------------------------------------------------------------------ route

struct RouteArgs {
  static constexpr int T = 6, E = 8, K = 2;
  HostTensor logits = buf(DType::kF32, {T, E}), bias = buf(DType::kF32, {E}), ids = buf(DType::kI32, {T, K}),
             weights = buf(DType::kF32, {T, K}), prob_mean = buf(DType::kF32, {E}), token_frac = buf(DType::kF32, {E}),
             lse = buf(DType::kF32, {T}), gw = buf(DType::kF32, {T, K}), gpm = buf(DType::kF32, {E}),
             glse = buf(DType::kF32, {T}), grad = buf(DType::kF32, {T, E});
  TensorView v_logits = logits.view(), v_bias = bias.view(), v_ids = ids.view(), v_weights = weights.view(),
             v_prob_mean = prob_mean.view(), v_token_frac = token_frac.view(), v_lse = lse.view(), v_gw = gw.view(),
             v_gpm = gpm.view(), v_glse = glse.view(), v_grad = grad.view();
  RouteParams p;
  explicit RouteArgs(RouteScheme s = RouteScheme::kSigmoidGroupTopK) {
    Rng rng(1);
    for (int64_t i = 0; i < logits.numel(); ++i) logits.set(i, rng.normal());
    for (int t = 0; t < T; ++t) ids.i32()[t * K] = t % E, ids.i32()[t * K + 1] = (t + 3) % E;
    p.scheme = s;
    p.k = K;
    p.n_group = 4;
    p.topk_group = 2;
    if (s != RouteScheme::kSigmoidGroupTopK) v_bias = absent();
  }
  void fwd() const { api::route_forward(v_logits, v_bias, p, v_ids, v_weights, v_prob_mean, v_token_frac, v_lse, 0); }
  void bwd() const { api::route_backward(v_logits, v_bias, p, v_ids, v_gw, v_gpm, v_glse, v_grad, 0); }
};

TEST(Validation, RouteForward) {
  using A = RouteArgs;
  for (RouteScheme s : {RouteScheme::kSoftmaxTopK, RouteScheme::kSigmoidGroupTopK, RouteScheme::kTopKSoftmax}) {
    SCOPED_TRACE(static_cast<int>(s));
    EXPECT_NO_THROW(A(s).fwd());  // the baseline is valid
    {
      A a(s);
      a.v_logits = retyped(a.v_logits, DType::kI32);
      EXPECT_MOE8_ERROR("logits", a.fwd());
    }
    {
      A a(s);
      a.v_logits = retyped(a.v_logits, DType::kF64);
      EXPECT_MOE8_ERROR("logits", a.fwd());
    }
    {
      A a(s);
      a.v_logits = reshaped(a.v_logits, {A::T, A::E, 1});
      EXPECT_MOE8_ERROR("logits", a.fwd());
    }
    {
      A a(s);
      a.v_logits = transposed(a.v_logits);
      EXPECT_MOE8_ERROR("logits", a.fwd());
    }
    {
      A a(s);
      a.v_logits = absent();
      EXPECT_MOE8_ERROR("logits", a.fwd());
    }
    {
      A a(s);
      a.v_ids = retyped(a.v_ids, DType::kI64);
      EXPECT_MOE8_ERROR("ids", a.fwd());
    }
    {
      A a(s);
      a.v_ids = reshaped(a.v_ids, {A::T, A::K + 1});
      EXPECT_MOE8_ERROR("ids", a.fwd());
    }
    {
      A a(s);
      a.v_ids = reshaped(a.v_ids, {A::T + 1, A::K});
      EXPECT_MOE8_ERROR("ids", a.fwd());
    }
    {
      A a(s);
      a.v_ids = absent();
      EXPECT_MOE8_ERROR("ids", a.fwd());
    }
    {
      A a(s);
      a.v_ids = on_cuda(a.v_ids);
      EXPECT_MOE8_ERROR("ids", a.fwd());
    }
    {
      A a(s);
      a.v_ids = strided(a.v_ids);
      EXPECT_MOE8_ERROR("ids", a.fwd());
    }
    {
      A a(s);
      a.v_weights = retyped(a.v_weights, DType::kBF16);
      EXPECT_MOE8_ERROR("weights", a.fwd());
    }
    {
      A a(s);
      a.v_weights = reshaped(a.v_weights, {A::T * A::K});
      EXPECT_MOE8_ERROR("weights", a.fwd());
    }
    {
      A a(s);
      a.v_weights = on_cuda(a.v_weights);
      EXPECT_MOE8_ERROR("weights", a.fwd());
    }
    {
      A a(s);
      a.v_prob_mean = reshaped(a.v_prob_mean, {A::E + 1});
      EXPECT_MOE8_ERROR("prob_mean", a.fwd());
    }
    {
      A a(s);
      a.v_token_frac = retyped(a.v_token_frac, DType::kI32);
      EXPECT_MOE8_ERROR("token_frac", a.fwd());
    }
    {
      A a(s);
      a.v_token_frac = strided(a.v_token_frac);
      EXPECT_MOE8_ERROR("token_frac", a.fwd());
    }
    {
      A a(s);
      a.v_lse = reshaped(a.v_lse, {A::T - 1});
      EXPECT_MOE8_ERROR("lse", a.fwd());
    }
    {
      A a(s);
      a.v_lse = on_cuda(a.v_lse);
      EXPECT_MOE8_ERROR("lse", a.fwd());
    }
    {
      A a(s);
      a.p.k = 0;
      a.v_ids = reshaped(a.v_ids, {A::T, 0});
      a.v_weights = reshaped(a.v_weights, {A::T, 0});
      EXPECT_MOE8_ERROR("k", a.fwd());
    }
    {
      A a(s);
      a.p.k = A::E + 1;
      a.v_ids = reshaped(a.v_ids, {A::T, A::E + 1});
      a.v_weights = reshaped(a.v_weights, {A::T, A::E + 1});
      EXPECT_MOE8_ERROR("k", a.fwd());
    }
  }
  using S = RouteScheme;
  {
    A a(S::kSigmoidGroupTopK);
    a.v_bias = reshaped(a.v_bias, {A::E + 1});
    EXPECT_MOE8_ERROR("bias", a.fwd());
  }
  {
    A a(S::kSigmoidGroupTopK);
    a.v_bias = retyped(a.v_bias, DType::kF16);
    EXPECT_MOE8_ERROR("bias", a.fwd());
  }
  {
    A a(S::kSigmoidGroupTopK);
    a.v_bias = on_cuda(a.v_bias);
    EXPECT_MOE8_ERROR("bias", a.fwd());
  }
  {
    A a(S::kSigmoidGroupTopK);
    a.p.n_group = 3;
    EXPECT_MOE8_ERROR("n_group", a.fwd());
  }
  {
    A a(S::kSigmoidGroupTopK);
    a.p.n_group = 0;
    EXPECT_MOE8_ERROR("n_group", a.fwd());
  }
  {
    A a(S::kSigmoidGroupTopK);
    a.p.topk_group = 5;
    EXPECT_MOE8_ERROR("topk_group", a.fwd());
  }
  {
    A a(S::kSigmoidGroupTopK);
    a.p.topk_group = 0;
    EXPECT_MOE8_ERROR("topk_group", a.fwd());
  }
}

TEST(Validation, RouteBackward) {
  using A = RouteArgs;
  for (RouteScheme s : {RouteScheme::kSoftmaxTopK, RouteScheme::kSigmoidGroupTopK, RouteScheme::kTopKSoftmax}) {
    SCOPED_TRACE(static_cast<int>(s));
    EXPECT_NO_THROW(A(s).bwd());
    {
      A a(s);
      a.v_gpm = absent();
      a.v_glse = absent();
      EXPECT_NO_THROW(a.bwd());
    }  // both optional
    {
      A a(s);
      a.v_logits = retyped(a.v_logits, DType::kU8);
      EXPECT_MOE8_ERROR("logits", a.bwd());
    }
    {
      A a(s);
      a.v_logits = absent();
      EXPECT_MOE8_ERROR("logits", a.bwd());
    }
    {
      A a(s);
      a.ids.i32()[5] = A::E;
      EXPECT_MOE8_ERROR("ids", a.bwd());
    }
    {
      A a(s);
      a.ids.i32()[0] = -1;
      EXPECT_MOE8_ERROR("ids", a.bwd());
    }
    {
      A a(s);
      a.v_ids = retyped(a.v_ids, DType::kF32);
      EXPECT_MOE8_ERROR("ids", a.bwd());
    }
    {
      A a(s);
      a.v_ids = reshaped(a.v_ids, {A::T * A::K});
      EXPECT_MOE8_ERROR("ids", a.bwd());
    }
    {
      A a(s);
      a.v_gw = reshaped(a.v_gw, {A::T, A::K + 1});
      EXPECT_MOE8_ERROR("grad_weights", a.bwd());
    }
    {
      A a(s);
      a.v_gw = retyped(a.v_gw, DType::kBF16);
      EXPECT_MOE8_ERROR("grad_weights", a.bwd());
    }
    {
      A a(s);
      a.v_gw = absent();
      EXPECT_MOE8_ERROR("grad_weights", a.bwd());
    }
    {
      A a(s);
      a.v_gpm = reshaped(a.v_gpm, {A::E - 1});
      EXPECT_MOE8_ERROR("grad_prob_mean", a.bwd());
    }
    {
      A a(s);
      a.v_gpm = on_cuda(a.v_gpm);
      EXPECT_MOE8_ERROR("grad_prob_mean", a.bwd());
    }
    {
      A a(s);
      a.v_glse = reshaped(a.v_glse, {A::T, 1});
      EXPECT_MOE8_ERROR("grad_lse", a.bwd());
    }
    {
      A a(s);
      a.v_glse = retyped(a.v_glse, DType::kF16);
      EXPECT_MOE8_ERROR("grad_lse", a.bwd());
    }
    {
      A a(s);
      a.v_grad = retyped(a.v_grad, DType::kF16);
      EXPECT_MOE8_ERROR("grad_logits", a.bwd());
    }
    {
      A a(s);
      a.v_grad = reshaped(a.v_grad, {A::T, A::E + 1});
      EXPECT_MOE8_ERROR("grad_logits", a.bwd());
    }
    {
      A a(s);
      a.v_grad = transposed(a.v_grad);
      EXPECT_MOE8_ERROR("grad_logits", a.bwd());
    }
    {
      A a(s);
      a.v_grad = on_cuda(a.v_grad);
      EXPECT_MOE8_ERROR("grad_logits", a.bwd());
    }
    {
      A a(s);
      a.v_grad = absent();
      EXPECT_MOE8_ERROR("grad_logits", a.bwd());
    }
    {
      A a(s);
      a.p.k = A::E + 1;
      a.v_ids = reshaped(a.v_ids, {A::T, A::E + 1});
      a.v_gw = reshaped(a.v_gw, {A::T, A::E + 1});
      EXPECT_MOE8_ERROR("k", a.bwd());
    }
  }
  {
    A a(RouteScheme::kSigmoidGroupTopK);
    a.p.n_group = 3;
    EXPECT_MOE8_ERROR("n_group", a.bwd());
  }
}

// ------------------------------------------------------------------------------------ plan

struct PlanArgs {
  static constexpr int T = 6, K = 2, E = 4, pad = 16;
  int64_t R = api::plan_max_rows(T * K, E, pad);
  int num_experts = E, pad_multiple = pad;
  HostTensor ids = buf(DType::kI32, {T, K}), counts = buf(DType::kI32, {E}), offsets = buf(DType::kI32, {E + 1}),
             r2s = buf(DType::kI32, {R}), s2r = buf(DType::kI32, {T * K});
  TensorView v_ids = ids.view(), v_counts = counts.view(), v_offsets = offsets.view(), v_r2s = r2s.view(),
             v_s2r = s2r.view();
  PlanArgs() {
    for (int i = 0; i < T * K; ++i) ids.i32()[i] = (i * 3) % E;
  }
  void call() const {
    api::build_dispatch_plan(v_ids, num_experts, pad_multiple, v_counts, v_offsets, v_r2s, v_s2r, absent(), 0);
  }
};

TEST(Validation, BuildDispatchPlan) {
  using A = PlanArgs;
  EXPECT_NO_THROW(A().call());
  {
    A a;
    a.v_ids = retyped(a.v_ids, DType::kI64);
    EXPECT_MOE8_ERROR("ids", a.call());
  }
  {
    A a;
    a.v_ids = reshaped(a.v_ids, {A::T * A::K});
    EXPECT_MOE8_ERROR("ids", a.call());
  }
  {
    A a;
    a.v_ids = transposed(a.v_ids);
    EXPECT_MOE8_ERROR("ids", a.call());
  }
  {
    A a;
    a.v_ids = absent();
    EXPECT_MOE8_ERROR("ids", a.call());
  }
  {
    A a;
    a.ids.i32()[7] = A::E;
    EXPECT_MOE8_ERROR("ids", a.call());
  }
  {
    A a;
    a.ids.i32()[0] = -1;
    EXPECT_MOE8_ERROR("ids", a.call());
  }
  {
    A a;
    a.num_experts = 0;
    a.v_counts = reshaped(a.v_counts, {0});
    a.v_offsets = reshaped(a.v_offsets, {1});
    EXPECT_MOE8_ERROR("num_experts", a.call());
  }
  {
    A a;
    a.pad_multiple = 0;
    EXPECT_MOE8_ERROR("pad_multiple", a.call());
  }
  {
    A a;
    a.pad_multiple = -4;
    EXPECT_MOE8_ERROR("pad_multiple", a.call());
  }
  {
    A a;
    a.v_counts = reshaped(a.v_counts, {A::E + 1});
    EXPECT_MOE8_ERROR("counts", a.call());
  }
  {
    A a;
    a.v_counts = retyped(a.v_counts, DType::kF32);
    EXPECT_MOE8_ERROR("counts", a.call());
  }
  {
    A a;
    a.v_counts = on_cuda(a.v_counts);
    EXPECT_MOE8_ERROR("counts", a.call());
  }
  {
    A a;
    a.v_offsets = reshaped(a.v_offsets, {A::E});
    EXPECT_MOE8_ERROR("offsets", a.call());
  }
  {
    A a;
    a.v_offsets = absent();
    EXPECT_MOE8_ERROR("offsets", a.call());
  }
  {
    A a;
    a.v_r2s = reshaped(a.v_r2s, {a.R - 1});
    EXPECT_MOE8_ERROR("row_to_slot", a.call());
  }
  {
    A a;
    a.v_r2s = strided(a.v_r2s);
    EXPECT_MOE8_ERROR("row_to_slot", a.call());
  }
  {
    A a;
    a.v_r2s = retyped(a.v_r2s, DType::kI64);
    EXPECT_MOE8_ERROR("row_to_slot", a.call());
  }
  {
    A a;
    a.v_s2r = reshaped(a.v_s2r, {A::T * A::K + 1});
    EXPECT_MOE8_ERROR("slot_to_row", a.call());
  }
  {
    A a;
    a.v_s2r = on_cuda(a.v_s2r);
    EXPECT_MOE8_ERROR("slot_to_row", a.call());
  }
  {
    A a;
    a.v_s2r = absent();
    EXPECT_MOE8_ERROR("slot_to_row", a.call());
  }
}

// ------------------------------------------------------------------------------------ gather / combine

struct PermArgs {
  static constexpr int T = 5, K = 2, H = 6, R = 12;
  int k = K;
  HostTensor src = buf(DType::kBF16, {T, H}), r2s = buf(DType::kI32, {R}), scale = buf(DType::kF32, {T * K}),
             dst = buf(DType::kBF16, {R, H}), rows = buf(DType::kBF16, {R, H}), s2r = buf(DType::kI32, {T, K}),
             w = buf(DType::kF32, {T, K}), out = buf(DType::kBF16, {T, H}), dy = buf(DType::kBF16, {T, H}),
             dw = buf(DType::kF32, {T, K});
  TensorView v_src = src.view(), v_r2s = r2s.view(), v_scale = scale.view(), v_dst = dst.view(), v_rows = rows.view(),
             v_s2r = s2r.view(), v_w = w.view(), v_out = out.view(), v_dy = dy.view(), v_dw = dw.view();
  PermArgs() {
    for (int r = 0; r < R; ++r) r2s.i32()[r] = r < T * K ? (r * 7) % (T * K) : -1;
    for (int s = 0; s < T * K; ++s) s2r.i32()[s] = (s * 3) % R;
  }
  void gather(const TensorView& s2r_flat = {}) const {
    api::gather_rows(v_src, v_r2s, k, v_scale, v_dst, 0, true, s2r_flat);
  }
  void combine() const { api::combine_rows(v_rows, v_s2r, v_w, v_out, 0); }
  void wgrad() const { api::combine_weights_grad(v_dy, v_rows, v_s2r, v_dw, 0); }
};

TEST(Validation, GatherRows) {
  using A = PermArgs;
  EXPECT_NO_THROW(A().gather());
  {  // slot_to_row (optional): i32 [T*k], values in [-1, R)
    A a;
    HostTensor flat = ints({A::T * A::K}, std::vector<int>(a.s2r.i32(), a.s2r.i32() + A::T * A::K));
    EXPECT_NO_THROW(a.gather(flat.view()));
    EXPECT_MOE8_ERROR("slot_to_row", a.gather(a.v_s2r));  // [T, K]: not 1-D
    EXPECT_MOE8_ERROR("slot_to_row", a.gather(reshaped(flat.view(), {A::T * A::K - 1})));
    flat.i32()[3] = A::R;
    EXPECT_MOE8_ERROR("slot_to_row", a.gather(flat.view()));
  }
  {
    A a;
    a.v_scale = absent();
    EXPECT_NO_THROW(a.gather());
  }  // scale is optional
  {
    A a;
    a.v_src = retyped(a.v_src, DType::kI32);
    a.v_dst = retyped(a.v_dst, DType::kI32);
    EXPECT_MOE8_ERROR("src", a.gather());
  }
  {
    A a;
    a.v_src = reshaped(a.v_src, {A::T * A::H});
    EXPECT_MOE8_ERROR("src", a.gather());
  }
  {
    A a;
    a.v_src = transposed(a.v_src);
    EXPECT_MOE8_ERROR("src", a.gather());
  }
  {
    A a;
    a.v_src = absent();
    EXPECT_MOE8_ERROR("src", a.gather());
  }
  {
    A a;
    a.v_dst = retyped(a.v_dst, DType::kF16);
    EXPECT_MOE8_ERROR("dst", a.gather());
  }
  {
    A a;
    a.v_dst = reshaped(a.v_dst, {A::R, A::H + 1});
    EXPECT_MOE8_ERROR("dst", a.gather());
  }
  {
    A a;
    a.v_dst = reshaped(a.v_dst, {A::R + 1, A::H});
    EXPECT_MOE8_ERROR("dst|row_to_slot", a.gather());
  }
  {
    A a;
    a.v_dst = on_cuda(a.v_dst);
    EXPECT_MOE8_ERROR("dst", a.gather());
  }
  {
    A a;
    a.v_dst = absent();
    EXPECT_MOE8_ERROR("dst", a.gather());
  }
  {
    A a;
    a.v_r2s = retyped(a.v_r2s, DType::kI64);
    EXPECT_MOE8_ERROR("row_to_slot", a.gather());
  }
  {
    A a;
    a.v_r2s = reshaped(a.v_r2s, {A::R, 1});
    EXPECT_MOE8_ERROR("row_to_slot", a.gather());
  }
  {
    A a;
    a.r2s.i32()[3] = A::T * A::K;
    EXPECT_MOE8_ERROR("row_to_slot", a.gather());
  }
  {
    A a;
    a.v_scale = reshaped(a.v_scale, {A::T * A::K + 1});
    EXPECT_MOE8_ERROR("scale", a.gather());
  }
  {
    A a;
    a.v_scale = retyped(a.v_scale, DType::kBF16);
    EXPECT_MOE8_ERROR("scale", a.gather());
  }
  {
    A a;
    a.v_scale = on_cuda(a.v_scale);
    EXPECT_MOE8_ERROR("scale", a.gather());
  }
  {
    A a;
    a.k = 0;
    EXPECT_MOE8_ERROR("k", a.gather());
  }
}

TEST(Validation, CombineRows) {
  using A = PermArgs;
  EXPECT_NO_THROW(A().combine());
  {
    A a;
    a.v_w = absent();
    EXPECT_NO_THROW(a.combine());
  }  // weights are optional
  {
    A a;
    a.v_rows = retyped(a.v_rows, DType::kI32);
    a.v_out = retyped(a.v_out, DType::kI32);
    EXPECT_MOE8_ERROR("rows", a.combine());
  }
  {
    A a;
    a.v_rows = reshaped(a.v_rows, {A::R, A::H, 1});
    EXPECT_MOE8_ERROR("rows", a.combine());
  }
  {
    A a;
    a.v_rows = strided(a.v_rows);
    EXPECT_MOE8_ERROR("rows", a.combine());
  }
  {
    A a;
    a.v_rows = absent();
    EXPECT_MOE8_ERROR("rows", a.combine());
  }
  {
    A a;
    a.v_out = retyped(a.v_out, DType::kF32);
    EXPECT_MOE8_ERROR("out", a.combine());
  }
  {
    A a;
    a.v_out = reshaped(a.v_out, {A::T, A::H + 1});
    EXPECT_MOE8_ERROR("out", a.combine());
  }
  {
    A a;
    a.v_out = on_cuda(a.v_out);
    EXPECT_MOE8_ERROR("out", a.combine());
  }
  {
    A a;
    a.v_s2r = reshaped(a.v_s2r, {A::T * A::K});
    EXPECT_MOE8_ERROR("slot_to_row", a.combine());
  }
  {
    A a;
    a.v_s2r = retyped(a.v_s2r, DType::kF32);
    EXPECT_MOE8_ERROR("slot_to_row", a.combine());
  }
  {
    A a;
    a.s2r.i32()[4] = A::R;
    EXPECT_MOE8_ERROR("slot_to_row", a.combine());
  }
  {
    A a;
    a.s2r.i32()[0] = -2;
    EXPECT_MOE8_ERROR("slot_to_row", a.combine());
  }
  {
    A a;
    a.v_w = reshaped(a.v_w, {A::T, A::K + 1});
    EXPECT_MOE8_ERROR("weights", a.combine());
  }
  {
    A a;
    a.v_w = retyped(a.v_w, DType::kF16);
    EXPECT_MOE8_ERROR("weights", a.combine());
  }
  {
    A a;
    a.v_w = on_cuda(a.v_w);
    EXPECT_MOE8_ERROR("weights", a.combine());
  }
}

TEST(Validation, CombineWeightsGrad) {
  using A = PermArgs;
  EXPECT_NO_THROW(A().wgrad());
  {
    A a;
    a.v_dy = retyped(a.v_dy, DType::kI32);
    EXPECT_MOE8_ERROR("dy", a.wgrad());
  }
  {
    A a;
    a.v_dy = retyped(a.v_dy, DType::kF32);
    EXPECT_MOE8_ERROR("dy|rows", a.wgrad());
  }
  {
    A a;
    a.v_dy = reshaped(a.v_dy, {A::T, A::H + 1});
    EXPECT_MOE8_ERROR("dy|rows", a.wgrad());
  }
  {
    A a;
    a.v_dy = absent();
    EXPECT_MOE8_ERROR("dy", a.wgrad());
  }
  {
    A a;
    a.v_rows = transposed(a.v_rows);
    EXPECT_MOE8_ERROR("rows", a.wgrad());
  }
  {
    A a;
    a.v_dw = retyped(a.v_dw, DType::kBF16);
    EXPECT_MOE8_ERROR("d_weights", a.wgrad());
  }
  {
    A a;
    a.v_dw = reshaped(a.v_dw, {A::T, A::K + 1});
    EXPECT_MOE8_ERROR("d_weights|slot_to_row", a.wgrad());
  }
  {
    A a;
    a.v_dw = on_cuda(a.v_dw);
    EXPECT_MOE8_ERROR("d_weights", a.wgrad());
  }
  {
    A a;
    a.v_dw = absent();
    EXPECT_MOE8_ERROR("d_weights", a.wgrad());
  }
  {
    A a;
    a.s2r.i32()[9] = A::R + 3;
    EXPECT_MOE8_ERROR("slot_to_row", a.wgrad());
  }
  {
    A a;
    a.v_s2r = absent();
    EXPECT_MOE8_ERROR("slot_to_row", a.wgrad());
  }
}

// ------------------------------------------------------------------------------------ grouped GEMM

struct GemmArgs {
  static constexpr int E = 3, R = 10, Kd = 5, N = 4;
  WeightLayout layout = WeightLayout::kNK;
  HostTensor a = buf(DType::kBF16, {R, Kd}), b = buf(DType::kBF16, {E, N, Kd}), off = buf(DType::kI32, {E + 1}),
             bias = buf(DType::kBF16, {E, N}), c = buf(DType::kBF16, {R, N}), dc = buf(DType::kBF16, {R, N}),
             db = buf(DType::kF32, {E, N, Kd}), dbias = buf(DType::kF32, {E, N});
  TensorView v_a = a.view(), v_b = b.view(), v_off = off.view(), v_bias = bias.view(), v_c = c.view(), v_dc = dc.view(),
             v_db = db.view(), v_dbias = dbias.view();
  GemmArgs() {
    const int o[E + 1] = {0, 4, 4, 9};
    for (int e = 0; e <= E; ++e) off.i32()[e] = o[e];
  }
  void fwd() const { api::grouped_gemm(v_a, v_b, v_off, layout, v_bias, v_c, 0); }
  void wgrad() const { api::grouped_gemm_wgrad(v_a, v_dc, v_off, layout, v_db, v_dbias, 0); }
};

TEST(Validation, GroupedGemm) {
  using A = GemmArgs;
  EXPECT_NO_THROW(A().fwd());
  {
    A a;
    a.v_bias = absent();
    EXPECT_NO_THROW(a.fwd());
  }
  {
    A a;
    a.layout = WeightLayout::kKN;
    a.v_b = reshaped(a.v_b, {A::E, A::Kd, A::N});
    EXPECT_NO_THROW(a.fwd());
  }
  {
    A a;
    a.v_a = retyped(a.v_a, DType::kI32);
    EXPECT_MOE8_ERROR("a", a.fwd());
  }
  {
    A a;
    a.v_a = reshaped(a.v_a, {A::R * A::Kd});
    EXPECT_MOE8_ERROR("a", a.fwd());
  }
  {
    A a;
    a.v_a = transposed(a.v_a);
    EXPECT_MOE8_ERROR("a", a.fwd());
  }
  {
    A a;
    a.v_a = absent();
    EXPECT_MOE8_ERROR("a", a.fwd());
  }
  {
    A a;
    a.v_b = retyped(a.v_b, DType::kF16);
    EXPECT_MOE8_ERROR("b", a.fwd());
  }
  {
    A a;
    a.v_b = reshaped(a.v_b, {A::E, A::N, A::Kd + 1});
    EXPECT_MOE8_ERROR("b", a.fwd());
  }
  {
    A a;
    a.v_b = reshaped(a.v_b, {A::E * A::N, A::Kd});
    EXPECT_MOE8_ERROR("b", a.fwd());
  }
  {
    A a;
    a.layout = WeightLayout::kKN;
    EXPECT_MOE8_ERROR("b", a.fwd());
  }  // [E,N,Kd] given for [E,Kd,N]
  {
    A a;
    a.v_b = on_cuda(a.v_b);
    EXPECT_MOE8_ERROR("b", a.fwd());
  }
  {
    A a;
    a.v_b = strided(a.v_b);
    EXPECT_MOE8_ERROR("b", a.fwd());
  }
  {
    A a;
    a.v_c = retyped(a.v_c, DType::kF32);
    EXPECT_MOE8_ERROR("c", a.fwd());
  }
  {
    A a;
    a.v_c = reshaped(a.v_c, {A::R, A::N + 1});
    EXPECT_MOE8_ERROR("c", a.fwd());
  }
  {
    A a;
    a.v_c = reshaped(a.v_c, {A::R + 1, A::N});
    EXPECT_MOE8_ERROR("c", a.fwd());
  }
  {
    A a;
    a.v_c = absent();
    EXPECT_MOE8_ERROR("c", a.fwd());
  }
  {
    A a;
    a.v_bias = reshaped(a.v_bias, {A::E, A::N + 1});
    EXPECT_MOE8_ERROR("bias", a.fwd());
  }
  {
    A a;
    a.v_bias = retyped(a.v_bias, DType::kI32);
    EXPECT_MOE8_ERROR("bias", a.fwd());
  }
  {
    A a;
    a.v_bias = on_cuda(a.v_bias);
    EXPECT_MOE8_ERROR("bias", a.fwd());
  }
  {
    A a;
    a.v_off = retyped(a.v_off, DType::kI64);
    EXPECT_MOE8_ERROR("offsets", a.fwd());
  }
  {
    A a;
    a.v_off = reshaped(a.v_off, {A::E + 2});
    EXPECT_MOE8_ERROR("offsets|b", a.fwd());
  }
  {
    A a;
    a.v_off = absent();
    EXPECT_MOE8_ERROR("offsets", a.fwd());
  }
  {
    A a;
    a.off.i32()[2] = 2;
    EXPECT_MOE8_ERROR("offsets", a.fwd());
  }  // 0 4 2 9: decreasing
  {
    A a;
    a.off.i32()[3] = A::R + 1;
    EXPECT_MOE8_ERROR("offsets", a.fwd());
  }  // past the rows of a
  {
    A a;
    a.off.i32()[0] = -2;
    EXPECT_MOE8_ERROR("offsets", a.fwd());
  }
}

TEST(Validation, GroupedGemmWgrad) {
  using A = GemmArgs;
  EXPECT_NO_THROW(A().wgrad());
  {
    A a;
    a.v_dbias = absent();
    EXPECT_NO_THROW(a.wgrad());
  }
  {
    A a;
    a.v_a = retyped(a.v_a, DType::kI32);
    EXPECT_MOE8_ERROR("a|dc", a.wgrad());
  }
  {
    A a;
    a.v_a = absent();
    EXPECT_MOE8_ERROR("a", a.wgrad());
  }
  {
    A a;
    a.v_dc = retyped(a.v_dc, DType::kF16);
    EXPECT_MOE8_ERROR("dc|a", a.wgrad());
  }
  {
    A a;
    a.v_dc = reshaped(a.v_dc, {A::R + 1, A::N});
    EXPECT_MOE8_ERROR("dc|a", a.wgrad());
  }
  {
    A a;
    a.v_dc = on_cuda(a.v_dc);
    EXPECT_MOE8_ERROR("dc", a.wgrad());
  }
  {
    A a;
    a.v_dc = transposed(a.v_dc);
    EXPECT_MOE8_ERROR("dc", a.wgrad());
  }
  {
    A a;
    a.v_db = retyped(a.v_db, DType::kI32);
    EXPECT_MOE8_ERROR("db", a.wgrad());
  }
  {
    A a;
    a.v_db = reshaped(a.v_db, {A::E, A::N, A::Kd + 1});
    EXPECT_MOE8_ERROR("db", a.wgrad());
  }
  {
    A a;
    a.layout = WeightLayout::kKN;
    EXPECT_MOE8_ERROR("db", a.wgrad());
  }  // [E,N,Kd] given for [E,Kd,N]
  {
    A a;
    a.v_db = absent();
    EXPECT_MOE8_ERROR("db", a.wgrad());
  }
  {
    A a;
    a.v_db = strided(a.v_db);
    EXPECT_MOE8_ERROR("db", a.wgrad());
  }
  {
    A a;
    a.v_dbias = reshaped(a.v_dbias, {A::E, A::N + 1});
    EXPECT_MOE8_ERROR("dbias", a.wgrad());
  }
  {
    A a;
    a.v_dbias = on_cuda(a.v_dbias);
    EXPECT_MOE8_ERROR("dbias", a.wgrad());
  }
  {
    A a;
    a.off.i32()[1] = 10;
    a.off.i32()[2] = 5;
    EXPECT_MOE8_ERROR("offsets", a.wgrad());
  }
  {
    A a;
    a.off.i32()[3] = A::R + 5;
    EXPECT_MOE8_ERROR("offsets", a.wgrad());
  }
  {
    A a;
    a.v_off = retyped(a.v_off, DType::kF32);
    EXPECT_MOE8_ERROR("offsets", a.wgrad());
  }
}

// ------------------------------------------------------------------------------------ activations

struct ActArgs {
  static constexpr int R = 7, I = 5;
  ActParams p;
  HostTensor h = buf(DType::kBF16, {R, 2 * I}), out = buf(DType::kBF16, {R, I}), dout = buf(DType::kBF16, {R, I}),
             dh = buf(DType::kBF16, {R, 2 * I});
  TensorView v_h = h.view(), v_out = out.view(), v_dout = dout.view(), v_dh = dh.view();
  void fwd() const { api::activation_forward(v_h, p, v_out, 0); }
  void bwd() const { api::activation_backward(v_h, v_dout, p, v_dh, 0); }
};

TEST(Validation, Activation) {
  using A = ActArgs;
  EXPECT_NO_THROW(A().fwd());
  EXPECT_NO_THROW(A().bwd());
  {
    A a;
    a.v_h = retyped(a.v_h, DType::kI32);
    a.v_out = retyped(a.v_out, DType::kI32);
    EXPECT_MOE8_ERROR("h", a.fwd());
  }
  {
    A a;
    a.v_h = reshaped(a.v_h, {A::R, 2 * A::I, 1});
    EXPECT_MOE8_ERROR("h", a.fwd());
  }
  {
    A a;
    a.v_h = reshaped(a.v_h, {A::R, 2 * A::I - 1});
    EXPECT_MOE8_ERROR("h|out", a.fwd());
  }  // odd gated
  {
    A a;
    a.v_h = strided(a.v_h);
    EXPECT_MOE8_ERROR("h", a.fwd());
  }
  {
    A a;
    a.v_h = absent();
    EXPECT_MOE8_ERROR("h", a.fwd());
  }
  {
    A a;
    a.v_out = retyped(a.v_out, DType::kF32);
    EXPECT_MOE8_ERROR("out", a.fwd());
  }
  {
    A a;
    a.v_out = reshaped(a.v_out, {A::R, A::I + 1});
    EXPECT_MOE8_ERROR("out", a.fwd());
  }
  {
    A a;
    a.v_out = reshaped(a.v_out, {A::R - 1, A::I});
    EXPECT_MOE8_ERROR("out", a.fwd());
  }
  {
    A a;
    a.v_out = on_cuda(a.v_out);
    EXPECT_MOE8_ERROR("out", a.fwd());
  }
  {
    A a;
    a.v_out = absent();
    EXPECT_MOE8_ERROR("out", a.fwd());
  }
  {
    A a;
    a.p.kind = ActKind::kSiLU;
    EXPECT_MOE8_ERROR("out|h", a.fwd());
  }  // ungated: out must be [R, 2I]
  {
    A a;
    a.v_dout = reshaped(a.v_dout, {A::R, A::I + 1});
    EXPECT_MOE8_ERROR("dout", a.bwd());
  }
  {
    A a;
    a.v_dout = retyped(a.v_dout, DType::kF16);
    EXPECT_MOE8_ERROR("dout", a.bwd());
  }
  {
    A a;
    a.v_dout = absent();
    EXPECT_MOE8_ERROR("dout", a.bwd());
  }
  {
    A a;
    a.v_dout = on_cuda(a.v_dout);
    EXPECT_MOE8_ERROR("dout", a.bwd());
  }
  {
    A a;
    a.v_dh = reshaped(a.v_dh, {A::R, A::I});
    EXPECT_MOE8_ERROR("dh", a.bwd());
  }
  {
    A a;
    a.v_dh = retyped(a.v_dh, DType::kF32);
    EXPECT_MOE8_ERROR("dh", a.bwd());
  }
  {
    A a;
    a.v_dh = transposed(a.v_dh);
    EXPECT_MOE8_ERROR("dh", a.bwd());
  }
  {
    A a;
    a.v_dh = absent();
    EXPECT_MOE8_ERROR("dh", a.bwd());
  }
  {
    A a;
    a.v_h = on_cuda(a.v_h);
    EXPECT_MOE8_ERROR("dout|dh|h", a.bwd());
  }
}

#ifndef MOE8_WITH_CUDA
// Built without CUDA: tensors that all claim to live on a GPU are refused, not dereferenced.
TEST(Validation, CudaTensorsWithoutCudaBuild) {
  PermArgs a;
  a.v_src = on_cuda(a.v_src), a.v_r2s = on_cuda(a.v_r2s), a.v_scale = on_cuda(a.v_scale), a.v_dst = on_cuda(a.v_dst);
  EXPECT_THROW(a.gather(), std::exception);
  EXPECT_FALSE(api::cuda_available());
}
#endif

}  // namespace
}  // namespace moe8::test
