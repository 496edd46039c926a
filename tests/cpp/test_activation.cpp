// test_activation.cpp — api::activation_forward / activation_backward on the CPU for SwiGLU, GPT-OSS
// clamped SwiGLU, SiLU and exact GELU, gated inputs split [gate | up] or interleaved, against float64.
#include "test_ref.h"

namespace moe8::test {
namespace {

const DType kFloatTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

struct ActCase {
  const char* name;
  ActParams p;
};

ActParams act(ActKind kind, bool interleaved = false, float alpha = 1.702f, float limit = 7.0f) {
  ActParams p;
  p.kind = kind;
  p.interleaved = interleaved;
  p.alpha = alpha;
  p.limit = limit;
  return p;
}

std::vector<ActCase> act_cases() {
  return {
      {"swiglu", act(ActKind::kSwiGLU)},
      {"swiglu_interleaved", act(ActKind::kSwiGLU, true)},
      {"clamped", act(ActKind::kSwiGLUClamped)},
      {"clamped_interleaved_gptoss", act(ActKind::kSwiGLUClamped, true)},
      {"clamped_alpha1_limit3", act(ActKind::kSwiGLUClamped, true, 1.0f, 3.0f)},
      {"silu", act(ActKind::kSiLU)},
      {"gelu", act(ActKind::kGELU)},
  };
}

struct Dims {
  int64_t R, I;
};
const Dims kDims[] = {{13, 7}, {1, 1}, {1, 20}, {0, 5}, {33, 131}, {4, 128}};

Shape h_shape(const ActParams& p, Dims d) { return {d.R, is_gated(p.kind) ? 2 * d.I : d.I}; }

// body(case, dtype, dims, rng) for every activation, dtype and shape, each with its own seed and trace.
template <typename Body>
void each_case(uint64_t seed, Body body) {
  for (const ActCase& c : act_cases())
    for (DType dt : kFloatTypes)
      for (Dims d : kDims) {
        SCOPED_TRACE(std::string(c.name) + " " + name_of(dt) + " R=" + std::to_string(d.R) +
                     " I=" + std::to_string(d.I));
        Rng rng(++seed);
        body(c, dt, d, rng);
      }
}

HostTensor run_fwd(const HostTensor& h, const ActParams& p, int64_t I) {
  HostTensor out(h.dtype(), {h.shape()[0], I});
  out.poison();
  api::activation_forward(h.view(), p, out.view(), 0);
  return out;
}

HostTensor run_bwd(const HostTensor& h, const HostTensor& dout, const ActParams& p) {
  HostTensor dh(h.dtype(), h.shape());
  dh.poison();
  api::activation_backward(h.view(), dout.view(), p, dh.view(), 0);
  return dh;
}

TEST(Activation, ForwardMatchesReference) {
  each_case(20, [](const ActCase& c, DType dt, Dims d, Rng& rng) {
    HostTensor h = act_input(dt, h_shape(c.p, d), c.p, rng);
    HostTensor out = run_fwd(h, c.p, d.I);
    EXPECT_TRUE(close_to(out, act_ref(h, c.p), "out"));
    EXPECT_TRUE(out.bitwise_equal(run_fwd(h, c.p, d.I))) << "two calls differ";
  });
}

TEST(Activation, BackwardMatchesReference) {
  each_case(400, [](const ActCase& c, DType dt, Dims d, Rng& rng) {
    HostTensor h = act_input(dt, h_shape(c.p, d), c.p, rng);
    HostTensor dout = random_tensor(dt, {d.R, d.I}, rng, -2, 2);
    HostTensor dh = run_bwd(h, dout, c.p);
    EXPECT_TRUE(close_to(dh, act_grad_ref(h, dout, c.p), "dh"));
    EXPECT_TRUE(dh.bitwise_equal(run_bwd(h, dout, c.p))) << "two calls differ";
  });
}

// The routed backward (routing weights applied in the pass, a_w and the weights' gradient written too)
// against float64, including padding rows (row_to_slot -1) and a slot no row maps to; written over h and
// dout, the same bits.
TEST(Activation, BackwardRoutedMatchesReference) {
  each_case(900, [](const ActCase& c, DType dt, Dims d, Rng& rng) {
    const int64_t slots = std::max<int64_t>(d.R - 2, 0) + 1;  // two padding rows, the last slot unmapped
    RoutedInputs in = routed_inputs(dt, c.p, d.R, d.I, slots - 1, rng);
    in.weights = random_tensor(DType::kF32, {slots}, rng, 0.05, 1.0);
    HostTensor dh(dt, in.h.shape()), a_w(dt, in.dout.shape()), dw(DType::kF32, {slots});
    dh.poison();
    a_w.poison();
    for (int64_t s = 0; s < slots; ++s) dw.set(s, 7.0);
    api::activation_backward_routed(in.h.view(), in.dout.view(), in.weights.view(), in.row_to_slot.view(), c.p,
                                    dh.view(), a_w.view(), dw.view(), 0);
    RoutedExpect e = routed_ref(in, c.p);
    EXPECT_TRUE(close_to(dh, e.dh, "dh"));
    EXPECT_TRUE(close_to(a_w, e.a_w, "a_w"));
    HostTensor mapped(DType::kF32, {slots - 1});
    for (int64_t s = 0; s + 1 < slots; ++s) mapped.set(s, dw.get(s));
    e.d_weights.want.pop_back();
    e.d_weights.mag.pop_back();
    EXPECT_TRUE(close_to(mapped, e.d_weights, "d_weights"));
    EXPECT_EQ(dw.get(slots - 1), 7.0) << "a slot no row maps to was written";
    HostTensor h2 = in.h, d2 = in.dout, dw2(DType::kF32, {slots});  // in place: dh over h, a_w over dout
    api::activation_backward_routed(h2.view(), d2.view(), in.weights.view(), in.row_to_slot.view(), c.p, h2.view(),
                                    d2.view(), dw2.view(), 0);
    EXPECT_TRUE(h2.bitwise_equal(dh)) << "dh written over h differs";
    EXPECT_TRUE(d2.bitwise_equal(a_w)) << "a_w written over dout differs";
  });
}

// The backward is the derivative of the forward: central differences of the CPU forward in f32 on
// inputs away from the clamp and in a smooth range.
TEST(Activation, BackwardIsDerivativeOfForward) {
  for (const ActCase& c : act_cases()) {
    SCOPED_TRACE(c.name);
    Rng rng(9);
    Dims d{3, 6};
    HostTensor h = act_input(DType::kF32, h_shape(c.p, d), c.p, rng, 2.5);
    HostTensor dout = random_tensor(DType::kF32, {d.R, d.I}, rng);
    HostTensor dh = run_bwd(h, dout, c.p);
    for (int64_t i = 0; i < h.numel(); ++i) {
      const double eps = 1e-2, x = h.get(i);
      auto loss = [&](double v) {
        HostTensor hp = h;
        hp.set(i, v);
        HostTensor o = run_fwd(hp, c.p, d.I);
        double s = 0;
        for (int64_t j = 0; j < o.numel(); ++j) s += o.get(j) * dout.get(j);
        return s;
      };
      double fd = (loss(x + eps) - loss(x - eps)) / (2 * eps);
      EXPECT_NEAR(dh.get(i), fd, 2e-3 * (1 + std::fabs(fd))) << "element " << i;
    }
  }
}

// Hand-checked values, so a shared misreading of the spec by test and reference would still show.
TEST(Activation, KnownValues) {
  HostTensor h(DType::kF32, {1, 4});
  const double v[4] = {1.0, 9.0, 2.0, -8.0};  // gates (1, 9), ups (2, -8) when split; interleaved pairs otherwise
  for (int i = 0; i < 4; ++i) h.set(i, v[i]);
  HostTensor out = run_fwd(h, act(ActKind::kSwiGLU), 2);
  EXPECT_NEAR(out.get(0), 1.0 / (1.0 + std::exp(-1.0)) * 2.0, 1e-6);
  EXPECT_NEAR(out.get(1), 9.0 / (1.0 + std::exp(-9.0)) * -8.0, 1e-5);
  out = run_fwd(h, act(ActKind::kSwiGLU, true), 2);  // pairs (g=1,u=9), (g=2,u=-8)
  EXPECT_NEAR(out.get(0), 1.0 / (1.0 + std::exp(-1.0)) * 9.0, 1e-5);
  EXPECT_NEAR(out.get(1), 2.0 / (1.0 + std::exp(-2.0)) * -8.0, 1e-5);
  out = run_fwd(h, act(ActKind::kSwiGLUClamped), 2);  // g=min(9,7)=7, u=clamp(-8)=-7
  EXPECT_NEAR(out.get(0), 3.0 * 1.0 / (1.0 + std::exp(-1.702)), 1e-5);
  EXPECT_NEAR(out.get(1), -6.0 * 7.0 / (1.0 + std::exp(-1.702 * 7.0)), 1e-5);
  HostTensor one(DType::kF32, {1, 1});
  one.set(0, 1.0);
  EXPECT_NEAR(run_fwd(one, act(ActKind::kGELU), 1).get(0), 0.8413447460685429, 1e-6);
  EXPECT_NEAR(run_fwd(one, act(ActKind::kSiLU), 1).get(0), 0.7310585786300049, 1e-6);
}

}  // namespace
}  // namespace moe8::test
