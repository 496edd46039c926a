// test_optim.cpp — api::adamw_step on the CPU against the AdamW update written here in float64, over three steps,
// for float32 / float16 / bfloat16 tensors of awkward sizes (0, 1, 7, 1000) in one call; argument errors.
// (The CUDA kernel against this reference, bit for bit: tests/python/test_optim.py.)
#include <cmath>
#include <vector>

#include "api/ops.h"
#include "test_util.h"

namespace moe8::test {
namespace {

struct Hyper {
  double lr = 1e-2, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.1;
};

// One step in float64 of p, m, v (from their current values) with gradient g.
void reference_step(const Hyper& h, int64_t step, double g, double& p, double& m, double& v) {
  p *= 1 - h.lr * h.weight_decay;
  m = h.beta1 * m + (1 - h.beta1) * g;
  v = h.beta2 * v + (1 - h.beta2) * g * g;
  const double denom = std::sqrt(v) / std::sqrt(1 - std::pow(h.beta2, step)) + h.eps;
  p -= h.lr / (1 - std::pow(h.beta1, step)) * m / denom;
}

TEST(Optim, AdamWMatchesFloat64) {
  const Hyper h;
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(dt));
    Rng rng(11);
    std::vector<HostTensor> p, g, m, v;
    for (int64_t n : {0, 1, 7, 1000}) {
      p.push_back(random_tensor(dt, {n}, rng, -1, 1));
      g.push_back(random_tensor(dt, {n}, rng, -0.01, 0.01));
      m.push_back(random_tensor(dt, {n}, rng, -1e-3, 1e-3));
      v.push_back(random_tensor(dt, {n}, rng, 0, 1e-4));
    }
    auto views = [](std::vector<HostTensor>& ts) {
      std::vector<TensorView> out;
      for (auto& t : ts) out.push_back(t.view());
      return out;
    };
    // what each element should hold: its float64 update from the values the tensors held (already rounded)
    const double rel = dt == DType::kF32 ? 1e-6 : (dt == DType::kF16 ? 2e-3 : 1.6e-2);
    for (int64_t step = 1; step <= 3; ++step) {
      std::vector<std::vector<double>> want_p, want_m, want_v;
      for (size_t i = 0; i < p.size(); ++i) {
        std::vector<double> wp = p[i].values(), wm = m[i].values(), wv = v[i].values();
        for (int64_t j = 0; j < p[i].numel(); ++j) reference_step(h, step, g[i].get(j), wp[j], wm[j], wv[j]);
        want_p.push_back(wp);
        want_m.push_back(wm);
        want_v.push_back(wv);
      }
      api::adamw_step(views(p), views(g), views(m), views(v), h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, step,
                      false, 0);
      for (size_t i = 0; i < p.size(); ++i)
        for (int64_t j = 0; j < p[i].numel(); ++j) {
          // float32 arithmetic, then one rounding to the dtype (float16's subnormals: an absolute step)
          const double tiny = dt == DType::kF16 ? 1.2e-7 : 1e-9;
          EXPECT_NEAR(p[i].get(j), want_p[i][j], rel * std::fabs(want_p[i][j]) + tiny) << "p " << i << "," << j;
          EXPECT_NEAR(m[i].get(j), want_m[i][j], rel * std::fabs(want_m[i][j]) + tiny) << "m " << i << "," << j;
          EXPECT_NEAR(v[i].get(j), want_v[i][j], rel * std::fabs(want_v[i][j]) + tiny) << "v " << i << "," << j;
        }
    }
  }
}

TEST(Optim, AdamWArgumentErrors) {
  HostTensor p(DType::kF32, {4}), g(DType::kF32, {4}), m(DType::kF32, {4}), v(DType::kF32, {4});
  HostTensor short_m(DType::kF32, {3}), half(DType::kBF16, {4});
  const std::vector<TensorView> P{p.view()}, G{g.view()}, M{m.view()}, V{v.view()};
  EXPECT_MOE8_ERROR("grads", api::adamw_step(P, {}, M, V, 1e-3, 0.9, 0.999, 1e-8, 0, 1, false, 0));
  EXPECT_MOE8_ERROR("exp_avgs[0]", api::adamw_step(P, G, {short_m.view()}, V, 1e-3, 0.9, 0.999, 1e-8, 0, 1, false, 0));
  EXPECT_MOE8_ERROR("exp_avg_sqs[0]", api::adamw_step(P, G, M, {half.view()}, 1e-3, 0.9, 0.999, 1e-8, 0, 1, false, 0));
  EXPECT_MOE8_ERROR("beta1", api::adamw_step(P, G, M, V, 1e-3, 1.0, 0.999, 1e-8, 0, 1, false, 0));
  EXPECT_MOE8_ERROR("lr", api::adamw_step(P, G, M, V, -1.0, 0.9, 0.999, 1e-8, 0, 1, false, 0));
  EXPECT_MOE8_ERROR("step", api::adamw_step(P, G, M, V, 1e-3, 0.9, 0.999, 1e-8, 0, 0, false, 0));
  EXPECT_MOE8_ERROR("params[0]", api::adamw_step(P, G, P, V, 1e-3, 0.9, 0.999, 1e-8, 0, 1, false, 0));
}

}  // namespace
}  // namespace moe8::test
