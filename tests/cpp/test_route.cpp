// test_route.cpp — api::route_forward / route_backward on the CPU against the float64 references of
// test_ref.h, for the three routing schemes (softmax top-k, DeepSeek-V3 sigmoid group-limited top-k
// with bias and scaling, GPT-OSS top-k softmax), with and without renormalisation.
#include "test_ref.h"

namespace moe8::test {
namespace {

struct RouteCase {
  const char* name;
  int T, E;
  RouteParams p;
  bool bias = false;
  double skew = 0.0;
};

RouteParams softmax_p(int k, bool renorm) {
  RouteParams p;
  p.scheme = RouteScheme::kSoftmaxTopK;
  p.k = k;
  p.renormalize = renorm;
  return p;
}
RouteParams sigmoid_p(int k, bool renorm, int n_group, int topk_group, float scaling) {
  RouteParams p;
  p.scheme = RouteScheme::kSigmoidGroupTopK;
  p.k = k;
  p.renormalize = renorm;
  p.n_group = n_group;
  p.topk_group = topk_group;
  p.scaling = scaling;
  return p;
}
RouteParams topk_softmax_p(int k) {
  RouteParams p;
  p.scheme = RouteScheme::kTopKSoftmax;
  p.k = k;
  return p;
}

std::vector<RouteCase> route_cases() {
  return {
      {"softmax_k2", 13, 8, softmax_p(2, false)},
      {"softmax_k2_renorm", 13, 8, softmax_p(2, true)},
      {"softmax_single_token", 1, 20, softmax_p(3, true)},
      {"softmax_k1", 7, 5, softmax_p(1, false)},
      {"softmax_k_eq_E", 6, 4, softmax_p(4, false)},
      {"softmax_skewed_olmoe", 64, 64, softmax_p(8, false), false, 0.9},
      {"softmax_qwen_renorm", 40, 60, softmax_p(4, true)},
      {"sigmoid_deepseek_v3", 16, 256, sigmoid_p(8, true, 8, 4, 2.5f), true},
      {"sigmoid_groups_no_bias", 21, 16, sigmoid_p(3, false, 4, 2, 1.0f), false},
      {"sigmoid_groups_bias_norenorm", 21, 16, sigmoid_p(3, false, 4, 2, 1.5f), true},
      {"sigmoid_one_group", 9, 20, sigmoid_p(4, true, 1, 1, 1.0f), true},
      {"sigmoid_all_groups", 10, 12, sigmoid_p(2, true, 3, 3, 2.0f), true, 0.8},
      {"sigmoid_single_token", 1, 64, sigmoid_p(6, true, 8, 3, 2.5f), true},
      {"topk_softmax_gptoss", 33, 32, topk_softmax_p(4)},
      {"topk_softmax_k1", 5, 7, topk_softmax_p(1)},
      {"topk_softmax_single_token", 1, 128, topk_softmax_p(4), false, 1.0},
  };
}

const DType kFloatTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

HostTensor route_bias(int E, Rng& rng) { return random_tensor(DType::kF32, {E}, rng, -0.3, 0.3); }

struct RouteOut {
  HostTensor ids, weights, prob_mean, token_frac, lse;
  RouteOut(int T, int E, int K)
      : ids(DType::kI32, {T, K}),
        weights(DType::kF32, {T, K}),
        prob_mean(DType::kF32, {E}),
        token_frac(DType::kF32, {E}),
        lse(DType::kF32, {T}) {
    for (HostTensor* t : {&ids, &weights, &prob_mean, &token_frac, &lse}) t->poison();
  }
  bool bitwise_equal(const RouteOut& o) const {
    return ids.bitwise_equal(o.ids) && weights.bitwise_equal(o.weights) && prob_mean.bitwise_equal(o.prob_mean) &&
           token_frac.bitwise_equal(o.token_frac) && lse.bitwise_equal(o.lse);
  }
};

RouteOut run_forward(const HostTensor& logits, const HostTensor* bias, const RouteParams& p) {
  int T = static_cast<int>(logits.shape()[0]), E = static_cast<int>(logits.shape()[1]);
  RouteOut o(T, E, p.k);
  api::route_forward(logits.view(), bias ? bias->view() : absent(), p, o.ids.view(), o.weights.view(),
                     o.prob_mean.view(), o.token_frac.view(), o.lse.view(), 0);
  return o;
}

TEST(Route, ForwardMatchesFloat64Reference) {
  uint64_t seed = 100;
  for (const RouteCase& c : route_cases())
    for (DType dt : kFloatTypes) {
      SCOPED_TRACE(std::string(c.name) + " " + name_of(dt));
      Rng rng(++seed);
      HostTensor bias = route_bias(c.E, rng);
      const HostTensor* bp = c.bias ? &bias : nullptr;
      HostTensor logits = route_logits(c.T, c.E, dt, bp, c.p, rng, c.skew);
      RouteRef ref = route_ref(logits, bp, c.p);
      RouteOut o = run_forward(logits, bp, c.p);
      EXPECT_TRUE(equal_ints(o.ids, ref.ids, "ids"));
      EXPECT_TRUE(close_to(o.weights, ref.weights, "weights"));
      EXPECT_TRUE(close_to(o.prob_mean, ref.prob_mean, "prob_mean"));
      EXPECT_TRUE(close_to(o.token_frac, ref.token_frac, "token_frac"));
      EXPECT_TRUE(close_to(o.lse, ref.lse, "lse"));
      EXPECT_TRUE(o.bitwise_equal(run_forward(logits, bp, c.p))) << "two calls differ";
    }
}

// Properties that hold whatever the reference: weights sum to 1 (x scaling) when renormalised, the
// top-k softmax weights always sum to 1, and token_frac sums to 1.
TEST(Route, ForwardInvariants) {
  Rng rng(7);
  for (const RouteCase& c : route_cases()) {
    SCOPED_TRACE(c.name);
    HostTensor bias = route_bias(c.E, rng);
    const HostTensor* bp = c.bias ? &bias : nullptr;
    HostTensor logits = route_logits(c.T, c.E, DType::kF32, bp, c.p, rng, c.skew);
    RouteOut o = run_forward(logits, bp, c.p);
    double frac = 0;
    for (int e = 0; e < c.E; ++e) frac += o.token_frac.get(e);
    EXPECT_NEAR(frac, 1.0, 1e-5);
    bool sums_to_one = c.p.renormalize || c.p.scheme == RouteScheme::kTopKSoftmax;
    for (int t = 0; t < c.T && sums_to_one; ++t) {
      double s = 0;
      for (int k = 0; k < c.p.k; ++k) s += o.weights.get(t * c.p.k + k);
      double want = c.p.scheme == RouteScheme::kSigmoidGroupTopK ? c.p.scaling : 1.0;
      EXPECT_NEAR(s, want, 1e-5 * want) << "token " << t;
    }
    for (int t = 0; t < c.T; ++t)  // distinct experts per token
      for (int i = 0; i < c.p.k; ++i)
        for (int j = i + 1; j < c.p.k; ++j) EXPECT_NE(o.ids.i32()[t * c.p.k + i], o.ids.i32()[t * c.p.k + j]);
  }
}

// The sigmoid scheme chooses on s + bias but weights with s: a bias that moves the choice must not
// appear in the weights.
TEST(Route, SigmoidBiasChoosesButDoesNotWeigh) {
  const int T = 1, E = 8;
  RouteParams p = sigmoid_p(2, false, 1, 1, 1.0f);
  HostTensor logits(DType::kF32, {T, E}), bias(DType::kF32, {E});
  for (int e = 0; e < E; ++e) {
    logits.set(e, 0.25 * e);  // best by s: experts 7 and 6
    bias.set(e, e == 1 || e == 2 ? 10.0 : 0.0);
  }
  RouteOut o = run_forward(logits, &bias, p);
  EXPECT_EQ(o.ids.i32()[0], 2);
  EXPECT_EQ(o.ids.i32()[1], 1);
  EXPECT_NEAR(o.weights.get(0), sigmoid(0.5), 1e-6);
  EXPECT_NEAR(o.weights.get(1), sigmoid(0.25), 1e-6);
}

// Group-limited choice: the best single expert sits in a group whose top-2 sum loses, so it is skipped.
TEST(Route, SigmoidGroupLimitSkipsLosingGroup) {
  const int E = 8;
  RouteParams p = sigmoid_p(2, true, 4, 1, 3.0f);  // groups {0,1} {2,3} {4,5} {6,7}, one eligible
  HostTensor logits(DType::kF32, {1, E});
  const double l[E] = {4.0, -4.0, 2.0, 1.9, -1, -2, -3, -3.5};  // group 1 has the best top-2 sum
  for (int e = 0; e < E; ++e) logits.set(e, l[e]);
  RouteOut o = run_forward(logits, nullptr, p);
  EXPECT_EQ(o.ids.i32()[0], 2);
  EXPECT_EQ(o.ids.i32()[1], 3);
  double s2 = sigmoid(2.0), s3 = sigmoid(1.9);
  EXPECT_NEAR(o.weights.get(0), 3.0 * s2 / (s2 + s3), 1e-5);
  EXPECT_NEAR(o.weights.get(1), 3.0 * s3 / (s2 + s3), 1e-5);
}

struct GradInputs {
  HostTensor gw, gpm, glse;
};

GradInputs grad_inputs(int T, int E, int K, Rng& rng) {
  return {random_tensor(DType::kF32, {T, K}, rng), random_tensor(DType::kF32, {E}, rng),
          random_tensor(DType::kF32, {T}, rng)};
}

HostTensor run_backward(const HostTensor& logits, const HostTensor* bias, const RouteParams& p, const HostTensor& ids,
                        const GradInputs& g, bool with_gpm, bool with_glse) {
  HostTensor grad(logits.dtype(), logits.shape());
  grad.poison();
  api::route_backward(logits.view(), bias ? bias->view() : absent(), p, ids.view(), g.gw.view(),
                      with_gpm ? g.gpm.view() : absent(), with_glse ? g.glse.view() : absent(), grad.view(), 0);
  return grad;
}

TEST(Route, BackwardMatchesFiniteDifferences) {
  uint64_t seed = 500;
  for (const RouteCase& c : route_cases()) {
    if (c.E > 128) continue;  // float64 finite differences are O(T E^2)
    for (DType dt : kFloatTypes)
      for (int opt = 0; opt < 3; ++opt) {  // 0: all grads, 1: weights only, 2: weights + lse
        bool gpm = opt == 0, glse = opt != 1;
        SCOPED_TRACE(std::string(c.name) + " " + name_of(dt) + " gpm=" + std::to_string(gpm) +
                     " glse=" + std::to_string(glse));
        Rng rng(++seed);
        HostTensor bias = route_bias(c.E, rng);
        const HostTensor* bp = c.bias ? &bias : nullptr;
        HostTensor logits = route_logits(c.T, c.E, dt, bp, c.p, rng, c.skew);
        RouteRef fwd = route_ref(logits, bp, c.p);
        HostTensor ids = ints({c.T, c.p.k}, fwd.ids);
        GradInputs g = grad_inputs(c.T, c.E, c.p.k, rng);
        Expect want = route_grad_ref(logits, c.p, fwd.ids, g.gw, gpm ? &g.gpm : nullptr, glse ? &g.glse : nullptr);
        HostTensor got = run_backward(logits, bp, c.p, ids, g, gpm, glse);
        EXPECT_TRUE(close_to(got, want, "grad_logits"));
        EXPECT_TRUE(got.bitwise_equal(run_backward(logits, bp, c.p, ids, g, gpm, glse))) << "two calls differ";
      }
  }
}

// Backward differentiates the weights of the ids it is given, whatever they are (not a re-selection).
TEST(Route, BackwardUsesGivenIds) {
  uint64_t seed = 900;
  for (const RouteCase& c : route_cases()) {
    if (c.E > 128) continue;
    SCOPED_TRACE(c.name);
    Rng rng(++seed);
    HostTensor bias = route_bias(c.E, rng);
    const HostTensor* bp = c.bias ? &bias : nullptr;
    HostTensor logits = route_logits(c.T, c.E, DType::kF32, bp, c.p, rng);
    std::vector<int> ids = random_ids(c.T, c.p.k, c.E, rng);
    GradInputs g = grad_inputs(c.T, c.E, c.p.k, rng);
    Expect want = route_grad_ref(logits, c.p, ids, g.gw, &g.gpm, &g.glse);
    EXPECT_TRUE(close_to(run_backward(logits, bp, c.p, ints({c.T, c.p.k}, ids), g, true, true), want, "grad_logits"));
  }
}

}  // namespace
}  // namespace moe8::test
