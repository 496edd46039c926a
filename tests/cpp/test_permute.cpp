// test_permute.cpp — api::gather_rows (permute into expert order, optional per-slot scale),
// api::combine_rows (weighted unpermute) and api::combine_weights_grad on the CPU, against float64
// loops, on plans built by the test's own plan reference (padding rows included).
#include "test_ref.h"

namespace moe8::test {
namespace {

const DType kFloatTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

struct PermCase {
  const char* name;
  int T, K, E, H, pad;
  double skew;
  std::vector<int> unused;
};

std::vector<PermCase> perm_cases() {
  return {
      {"small", 13, 2, 8, 20, 1, 0.0, {}},      {"small_padded", 13, 2, 8, 20, 16, 0.0, {}},
      {"single_token", 1, 1, 3, 7, 1, 0.0, {}}, {"single_token_k4_padded", 1, 4, 4, 5, 8, 0.0, {}},
      {"h1", 6, 3, 5, 1, 1, 0.0, {}},           {"empty_experts", 25, 2, 8, 33, 4, 0.0, {1, 6}},
      {"skewed", 150, 4, 16, 131, 16, 0.9, {}}, {"no_tokens", 0, 2, 4, 9, 16, 0.0, {}},
  };
}

struct Routed {
  int T, K;
  std::vector<int> ids;
  PlanRef plan;
  int64_t R;
};

Routed route(const PermCase& c, Rng& rng) {
  Routed r{c.T, c.K, random_ids(c.T, c.K, c.E, rng, c.skew, c.unused), {}, 0};
  r.R = api::plan_max_rows(static_cast<int64_t>(c.T) * c.K, c.E, c.pad);
  r.plan = plan_ref(r.ids, c.E, c.pad, r.R);
  return r;
}

HostTensor run_gather(const HostTensor& src, const HostTensor& r2s, int K, const HostTensor* scale) {
  HostTensor dst(src.dtype(), {r2s.numel(), src.shape()[1]});
  dst.poison();
  api::gather_rows(src.view(), r2s.view(), K, scale ? scale->view() : absent(), dst.view(), 0);
  return dst;
}

TEST(Permute, GatherRowsMatchesReference) {
  uint64_t seed = 10;
  for (const PermCase& c : perm_cases())
    for (DType dt : kFloatTypes)
      for (bool with_scale : {false, true}) {
        SCOPED_TRACE(std::string(c.name) + " " + name_of(dt) + (with_scale ? " scaled" : ""));
        Rng rng(++seed);
        Routed rt = route(c, rng);
        HostTensor src = random_tensor(dt, {c.T, c.H}, rng, -4, 4);
        HostTensor scale = random_tensor(DType::kF32, {static_cast<int64_t>(c.T) * c.K}, rng, -2, 2);
        HostTensor r2s = ints({rt.R}, rt.plan.row_to_slot);
        const HostTensor* sp = with_scale ? &scale : nullptr;
        HostTensor dst = run_gather(src, r2s, c.K, sp);
        EXPECT_TRUE(close_to(dst, gather_ref(src, rt.plan.row_to_slot, c.K, sp), "dst"));
        EXPECT_TRUE(dst.bitwise_equal(run_gather(src, r2s, c.K, sp))) << "two calls differ";
      }
}

// Without a scale, gathering is a copy: bit-exact, including -0.0 and values that would not survive a
// round trip through a lower precision.
TEST(Permute, GatherRowsUnscaledIsBitExact) {
  for (DType dt : kFloatTypes) {
    SCOPED_TRACE(name_of(dt));
    Rng rng(3);
    HostTensor src = random_tensor(dt, {4, 9}, rng, -1e3, 1e3);
    src.set(5, -0.0);
    HostTensor r2s = ints({6}, {7, -1, 0, 3, 5, 2});  // K = 2: slot s reads token s / 2
    HostTensor dst = run_gather(src, r2s, 2, nullptr);
    for (int r = 0; r < 6; ++r)
      for (int h = 0; h < 9; ++h) {
        int slot = r2s.i32()[r];
        size_t es = dtype_size(dt);
        const char* d = static_cast<const char*>(dst.data()) + (r * 9 + h) * es;
        if (slot < 0) {
          EXPECT_EQ(dst.get(r * 9 + h), 0.0) << "padding row " << r;
        } else {
          const char* s = static_cast<const char*>(src.data()) + ((slot / 2) * 9 + h) * es;
          EXPECT_EQ(std::memcmp(d, s, es), 0) << "row " << r << " col " << h;
        }
      }
  }
}

HostTensor run_combine(const HostTensor& rows, const HostTensor& s2r, const HostTensor* w, int64_t T) {
  HostTensor out(rows.dtype(), {T, rows.shape()[1]});
  out.poison();
  api::combine_rows(rows.view(), s2r.view(), w ? w->view() : absent(), out.view(), 0);
  return out;
}

TEST(Permute, CombineRowsMatchesReference) {
  uint64_t seed = 300;
  for (const PermCase& c : perm_cases())
    for (DType dt : kFloatTypes)
      for (bool with_w : {false, true}) {
        SCOPED_TRACE(std::string(c.name) + " " + name_of(dt) + (with_w ? " weighted" : ""));
        Rng rng(++seed);
        Routed rt = route(c, rng);
        HostTensor rows = random_tensor(dt, {rt.R, c.H}, rng, -4, 4);
        HostTensor w = random_tensor(DType::kF32, {c.T, c.K}, rng, 0, 1);
        HostTensor s2r = ints({c.T, c.K}, rt.plan.slot_to_row);
        const HostTensor* wp = with_w ? &w : nullptr;
        HostTensor out = run_combine(rows, s2r, wp, c.T);
        EXPECT_TRUE(close_to(out, combine_ref(rows, rt.plan.slot_to_row, c.K, wp), "out"));
        EXPECT_TRUE(out.bitwise_equal(run_combine(rows, s2r, wp, c.T))) << "two calls differ";
      }
}

HostTensor run_combine_wgrad(const HostTensor& dy, const HostTensor& rows, const HostTensor& s2r) {
  HostTensor dw(DType::kF32, s2r.shape());
  dw.poison();
  api::combine_weights_grad(dy.view(), rows.view(), s2r.view(), dw.view(), 0);
  return dw;
}

TEST(Permute, CombineWeightsGradMatchesReference) {
  uint64_t seed = 600;
  for (const PermCase& c : perm_cases())
    for (DType dt : kFloatTypes) {
      SCOPED_TRACE(std::string(c.name) + " " + name_of(dt));
      Rng rng(++seed);
      Routed rt = route(c, rng);
      HostTensor rows = random_tensor(dt, {rt.R, c.H}, rng, -2, 2);
      HostTensor dy = random_tensor(dt, {c.T, c.H}, rng, -2, 2);
      HostTensor s2r = ints({c.T, c.K}, rt.plan.slot_to_row);
      HostTensor dw = run_combine_wgrad(dy, rows, s2r);
      EXPECT_TRUE(close_to(dw, combine_wgrad_ref(dy, rows, rt.plan.slot_to_row), "d_weights"));
      EXPECT_TRUE(dw.bitwise_equal(run_combine_wgrad(dy, rows, s2r))) << "two calls differ";
    }
}

// gather then combine with weights w is the MoE identity y[t] = sum_k w[t,k] x[t] when experts are
// identities; with gather's scale instead of combine's weights the result is the same up to rounding.
TEST(Permute, GatherCombineRoundTrip) {
  Rng rng(77);
  PermCase c{"rt", 37, 3, 6, 24, 8, 0.5, {2}};
  Routed rt = route(c, rng);
  HostTensor x = random_tensor(DType::kF32, {c.T, c.H}, rng);
  HostTensor w = random_tensor(DType::kF32, {c.T, c.K}, rng, 0, 1);
  HostTensor r2s = ints({rt.R}, rt.plan.row_to_slot), s2r = ints({c.T, c.K}, rt.plan.slot_to_row);
  HostTensor y1 = run_combine(run_gather(x, r2s, c.K, nullptr), s2r, &w, c.T);
  HostTensor scale(DType::kF32, {static_cast<int64_t>(c.T) * c.K});  // w flattened to [T*K]
  for (int64_t i = 0; i < scale.numel(); ++i) scale.set(i, w.get(i));
  HostTensor y2 = run_combine(run_gather(x, r2s, c.K, &scale), s2r, nullptr, c.T);
  for (int t = 0; t < c.T; ++t)
    for (int h = 0; h < c.H; ++h) {
      double want = 0;
      for (int k = 0; k < c.K; ++k) want += w.get(t * c.K + k) * x.get(t * c.H + h);
      EXPECT_NEAR(y1.get(t * c.H + h), want, 1e-5);
      EXPECT_NEAR(y2.get(t * c.H + h), want, 1e-5);
    }
}

}  // namespace
}  // namespace moe8::test
