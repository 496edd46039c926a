// test_loss.cpp — api::cross_entropy_rows (the chunked LM loss's rows): the CPU reference against a float64
// formula written here (loss and the gradient written over the logits, ignored rows, widths that are not a
// multiple of the kernel's pack, NaN for an id out of range or a NaN logit), argument errors; and, with the
// CUDA backend, the kernel against the CPU reference (skips without a GPU).
#include <cmath>
#include <string>
#include <vector>

#include "test_ref.h"

#ifdef MOE8_WITH_CUDA
#include "test_cuda_util.h"
#endif

namespace moe8::test {
namespace {

const DType kFloatTypes[] = {DType::kF32, DType::kF16, DType::kBF16};
constexpr int64_t kIgnore = -100;

struct XentCase {
  const char* name;
  int64_t n, V;
  double spread;  // logits uniform in [-spread, spread]
};
const XentCase kCases[] = {
    {"tiny", 3, 5, 2.0}, {"odd_width", 7, 37, 4.0}, {"wide", 4, 1000, 8.0}, {"peaked", 5, 264, 30.0}};

struct XentInput {
  HostTensor logits, target;
};

// Targets cycle through ids across the row (first, last, middle), every third row ignored.
XentInput make_input(DType dt, const XentCase& c, Rng& rng) {
  XentInput in{random_tensor(dt, {c.n, c.V}, rng, -c.spread, c.spread), HostTensor(DType::kI64, {c.n})};
  for (int64_t r = 0; r < c.n; ++r) in.target.set(r, r % 3 == 2 ? kIgnore : (r * 7919) % c.V);
  return in;
}

// Float64 loss [n] and gradient [n, V] of the logits as stored (already rounded to their dtype).
void expect_xent(const XentInput& in, Expect& loss, Expect& grad) {
  const int64_t n = in.logits.shape()[0], V = in.logits.shape()[1];
  for (int64_t r = 0; r < n; ++r) {
    double m = -INFINITY, s = 0.0;
    for (int64_t j = 0; j < V; ++j) m = std::max(m, in.logits.get(r * V + j));
    for (int64_t j = 0; j < V; ++j) s += std::exp(in.logits.get(r * V + j) - m);
    const double lse = m + std::log(s);
    const auto t = static_cast<int64_t>(in.target.get(r));
    const bool ignored = t == kIgnore;
    loss.want.push_back(ignored ? 0.0 : lse - in.logits.get(r * V + t));
    loss.mag.push_back(std::fabs(lse) + std::fabs(m) + 1.0);
    for (int64_t j = 0; j < V; ++j) {
      const double x = in.logits.get(r * V + j), p = std::exp(x - lse);
      grad.want.push_back(ignored ? 0.0 : p - (j == t ? 1.0 : 0.0));
      grad.mag.push_back(p * (std::fabs(x) + std::fabs(lse) + 1.0));
    }
  }
  loss.comp_rel = grad.comp_rel = fp32_rel(V);
}

struct XentRun {
  HostTensor grad, loss;
};

XentRun run_xent(const XentInput& in, bool gpu) {
#ifdef MOE8_WITH_CUDA
  Runner run(gpu);
#else
  (void)gpu;
#endif
  XentRun r{in.logits, HostTensor(DType::kF32, {in.logits.shape()[0]})};
#ifdef MOE8_WITH_CUDA
  api::cross_entropy_rows(run.inout(r.grad), run.in(in.target), kIgnore, run.out(r.loss), 0);
  run.finish();
#else
  r.loss.poison();
  api::cross_entropy_rows(r.grad.view(), in.target.view(), kIgnore, r.loss.view(), 0);
#endif
  return r;
}

TEST(Loss, CrossEntropyRowsMatchReference) {
  Rng rng(31);
  for (DType dt : kFloatTypes)
    for (const XentCase& c : kCases) {
      SCOPED_TRACE(std::string(name_of(dt)) + " " + c.name);
      const XentInput in = make_input(dt, c, rng);
      Expect loss, grad;
      expect_xent(in, loss, grad);
      const XentRun got = run_xent(in, false);
      EXPECT_TRUE(close_to(got.loss, loss, "loss"));
      EXPECT_TRUE(close_to(got.grad, grad, "grad"));
    }
}

// A target out of [0, V) makes the row's loss and gradient NaN, as does a NaN logit; an ignored row is 0.
void expect_nan_policy(bool gpu) {
  HostTensor x(DType::kBF16, {3, 20}), t(DType::kI64, {3});
  for (int64_t i = 0; i < x.numel(); ++i) x.set(i, 0.25 * static_cast<double>(i % 7));
  x.set(20 + 4, NAN);
  t.set(0, 20);
  t.set(1, 3);
  t.set(2, kIgnore);
  const XentRun got = run_xent({x, t}, gpu);
  EXPECT_TRUE(std::isnan(got.loss.get(0)) && std::isnan(got.loss.get(1)));
  EXPECT_EQ(got.loss.get(2), 0.0);
  for (int64_t j = 0; j < 20; ++j) {
    EXPECT_TRUE(std::isnan(got.grad.get(j)) && std::isnan(got.grad.get(20 + j))) << j;
    EXPECT_EQ(got.grad.get(40 + j), 0.0) << j;
  }
}

TEST(Loss, CrossEntropyRowsNanPolicy) { expect_nan_policy(false); }

TEST(Loss, CrossEntropyRowsRejectBadArguments) {
  HostTensor x(DType::kF32, {2, 5}), t(DType::kI64, {2}), loss(DType::kF32, {2});
  HostTensor t32(DType::kI32, {2}), t_short(DType::kI64, {1}), loss16(DType::kF16, {2}), x3(DType::kF32, {2, 5, 1});
  EXPECT_MOE8_ERROR("logits", api::cross_entropy_rows(x3.view(), t.view(), kIgnore, loss.view(), 0));
  EXPECT_MOE8_ERROR("target", api::cross_entropy_rows(x.view(), t32.view(), kIgnore, loss.view(), 0));
  EXPECT_MOE8_ERROR("target", api::cross_entropy_rows(x.view(), t_short.view(), kIgnore, loss.view(), 0));
  EXPECT_MOE8_ERROR("loss", api::cross_entropy_rows(x.view(), t.view(), kIgnore, loss16.view(), 0));
}

#ifdef MOE8_WITH_CUDA
TEST_F(CudaTest, CrossEntropyRowsMatchCpu) {
  Rng rng(32);
  std::vector<XentCase> cases(std::begin(kCases), std::end(kCases));
  cases.push_back({"qwen3_vocab", 3, 151936, 10.0});
  cases.push_back({"mixtral_vocab", 2, 32000, 10.0});
  for (DType dt : kFloatTypes)
    for (const XentCase& c : cases) {
      SCOPED_TRACE(std::string(name_of(dt)) + " " + c.name);
      const XentInput in = make_input(dt, c, rng);
      Expect loss, grad;
      expect_xent(in, loss, grad);
      const XentRun cpu = run_xent(in, false), gpu = run_xent(in, true);
      EXPECT_TRUE(close_to(gpu.loss, loss, "loss"));
      EXPECT_TRUE(close_to(gpu.grad, grad, "grad"));
      EXPECT_TRUE(close_pair(gpu.loss, cpu.loss, loss, "loss vs CPU"));
    }
  expect_nan_policy(true);
}
#endif

}  // namespace
}  // namespace moe8::test
