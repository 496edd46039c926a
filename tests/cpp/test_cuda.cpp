// test_cuda.cpp — CUDA kernels of routing, dispatch plan, gather/combine against the CPU reference of
// the API on the same inputs (ids and plans exactly, floats within both roundings), at awkward and at
// realistic shapes, plus GPU determinism and GPU-side validation. Skips, saying why, without a GPU.
#include "test_ref.h"

#ifdef MOE8_WITH_CUDA
#include <cuda_runtime.h>

#include "test_cuda_util.h"

namespace moe8::test {
namespace {

using S = RouteScheme;

RouteParams rp(S scheme, int k, bool renorm = false, int n_group = 1, int topk_group = 1, float scaling = 1.0f) {
  RouteParams p;
  p.scheme = scheme;
  p.k = k;
  p.renormalize = renorm;
  p.n_group = n_group;
  p.topk_group = topk_group;
  p.scaling = scaling;
  return p;
}

struct RouteCase {
  const char* name;
  int T, E;
  RouteParams p;
  DType dtype;
  bool bias;
  double skew;
};

std::vector<RouteCase> cuda_route_cases() {
  return {
      {"softmax_small", 13, 8, rp(S::kSoftmaxTopK, 2), DType::kF32, false, 0.0},
      {"softmax_renorm_f16", 37, 20, rp(S::kSoftmaxTopK, 3, true), DType::kF16, false, 0.3},
      {"softmax_single_token", 1, 60, rp(S::kSoftmaxTopK, 4, true), DType::kBF16, false, 0.0},
      {"softmax_k_eq_E", 9, 6, rp(S::kSoftmaxTopK, 6), DType::kF32, false, 0.0},
      {"sigmoid_groups", 21, 16, rp(S::kSigmoidGroupTopK, 3, false, 4, 2, 1.5f), DType::kF32, true, 0.0},
      {"sigmoid_no_bias", 17, 24, rp(S::kSigmoidGroupTopK, 5, true, 1, 1, 1.0f), DType::kBF16, false, 0.0},
      {"topk_softmax_small", 29, 7, rp(S::kTopKSoftmax, 2), DType::kF16, false, 0.0},
      // realistic
      {"olmoe_T4096_E64_k8", 4096, 64, rp(S::kSoftmaxTopK, 8), DType::kBF16, false, 0.2},
      {"qwen3_T4096_E128_k8", 4096, 128, rp(S::kSoftmaxTopK, 8, true), DType::kBF16, false, 0.0},
      {"qwen3_T4096_E128_k8_f32", 4096, 128, rp(S::kSoftmaxTopK, 8, true), DType::kF32, false, 0.5},
      {"deepseek_v3_T2048_E256", 2048, 256, rp(S::kSigmoidGroupTopK, 8, true, 8, 4, 2.5f), DType::kBF16, true, 0.0},
      {"gptoss_T4096_E128_k4", 4096, 128, rp(S::kTopKSoftmax, 4), DType::kBF16, false, 0.0},
  };
}

struct RouteOut {
  HostTensor ids, w, pm, tf, lse;
  RouteOut(int T, int E, int K)
      : ids(DType::kI32, {T, K}),
        w(DType::kF32, {T, K}),
        pm(DType::kF32, {E}),
        tf(DType::kF32, {E}),
        lse(DType::kF32, {T}) {}
  bool bitwise_equal(const RouteOut& o) const {
    return ids.bitwise_equal(o.ids) && w.bitwise_equal(o.w) && pm.bitwise_equal(o.pm) && tf.bitwise_equal(o.tf) &&
           lse.bitwise_equal(o.lse);
  }
};

RouteOut route_fwd(bool gpu, const HostTensor& logits, const HostTensor* bias, const RouteParams& p) {
  Runner run(gpu);
  RouteOut o(static_cast<int>(logits.shape()[0]), static_cast<int>(logits.shape()[1]), p.k);
  api::route_forward(run.in(logits), run.opt(bias), p, run.out(o.ids), run.out(o.w), run.out(o.pm), run.out(o.tf),
                     run.out(o.lse), 0);
  run.finish();
  return o;
}

HostTensor route_bwd(bool gpu, const HostTensor& logits, const HostTensor* bias, const RouteParams& p,
                     const HostTensor& ids, const HostTensor& gw, const HostTensor* gpm, const HostTensor* glse) {
  Runner run(gpu);
  HostTensor grad(logits.dtype(), logits.shape());
  api::route_backward(run.in(logits), run.opt(bias), p, run.in(ids), run.in(gw), run.opt(gpm), run.opt(glse),
                      run.out(grad), 0);
  run.finish();
  return grad;
}

TEST_F(CudaTest, RouteForwardMatchesCpu) {
  uint64_t seed = 1000;
  for (const RouteCase& c : cuda_route_cases()) {
    SCOPED_TRACE(c.name);
    Rng rng(++seed);
    HostTensor bias = random_tensor(DType::kF32, {c.E}, rng, -0.3, 0.3);
    const HostTensor* bp = c.bias ? &bias : nullptr;
    HostTensor logits = route_logits(c.T, c.E, c.dtype, bp, c.p, rng, c.skew);
    RouteRef ref = route_ref(logits, bp, c.p);
    RouteOut cpu = route_fwd(false, logits, bp, c.p), gpu = route_fwd(true, logits, bp, c.p);
    EXPECT_TRUE(equal_ints(gpu.ids, int_values(cpu.ids), "ids"));
    EXPECT_TRUE(close_pair(gpu.w, cpu.w, ref.weights, "weights"));
    EXPECT_TRUE(close_pair(gpu.pm, cpu.pm, ref.prob_mean, "prob_mean"));
    EXPECT_TRUE(close_pair(gpu.tf, cpu.tf, ref.token_frac, "token_frac"));
    EXPECT_TRUE(close_pair(gpu.lse, cpu.lse, ref.lse, "lse"));
    EXPECT_TRUE(gpu.bitwise_equal(route_fwd(true, logits, bp, c.p))) << "two GPU runs differ";
  }
}

TEST_F(CudaTest, RouteBackwardMatchesCpu) {
  uint64_t seed = 2000;
  for (const RouteCase& c : cuda_route_cases())
    for (int opt = 0; opt < 2; ++opt) {  // 0: all three gradients, 1: grad_weights only
      SCOPED_TRACE(std::string(c.name) + (opt ? " weights-only" : " all"));
      Rng rng(++seed);
      HostTensor bias = random_tensor(DType::kF32, {c.E}, rng, -0.3, 0.3);
      const HostTensor* bp = c.bias ? &bias : nullptr;
      HostTensor logits = route_logits(c.T, c.E, c.dtype, bp, c.p, rng, c.skew);
      std::vector<int> idv = route_ref(logits, bp, c.p).ids;
      HostTensor ids = ints({c.T, c.p.k}, idv);
      HostTensor gw = random_tensor(DType::kF32, {c.T, c.p.k}, rng), gpm = random_tensor(DType::kF32, {c.E}, rng),
                 glse = random_tensor(DType::kF32, {c.T}, rng);
      const HostTensor *gp = opt ? nullptr : &gpm, *gl = opt ? nullptr : &glse;
      Expect scale = route_grad_ref(logits, c.p, idv, gw, gp, gl, /*values=*/false);
      HostTensor cpu = route_bwd(false, logits, bp, c.p, ids, gw, gp, gl);
      HostTensor gpu = route_bwd(true, logits, bp, c.p, ids, gw, gp, gl);
      EXPECT_TRUE(close_pair(gpu, cpu, scale, "grad_logits"));
      EXPECT_TRUE(gpu.bitwise_equal(route_bwd(true, logits, bp, c.p, ids, gw, gp, gl))) << "two GPU runs differ";
    }
}

struct PlanOut {
  HostTensor counts, offsets, r2s, s2r;
  bool bitwise_equal(const PlanOut& o) const {
    return counts.bitwise_equal(o.counts) && offsets.bitwise_equal(o.offsets) && r2s.bitwise_equal(o.r2s) &&
           s2r.bitwise_equal(o.s2r);
  }
};

PlanOut plan(bool gpu, const HostTensor& ids, int E, int pad, int64_t R) {
  Runner run(gpu);
  PlanOut o{HostTensor(DType::kI32, {E}), HostTensor(DType::kI32, {E + 1}), HostTensor(DType::kI32, {R}),
            HostTensor(DType::kI32, {ids.numel()})};
  api::build_dispatch_plan(run.in(ids), E, pad, run.out(o.counts), run.out(o.offsets), run.out(o.r2s), run.out(o.s2r),
                           run.workspace(api::plan_workspace_elems(ids.numel(), E, gpu)), 0);
  run.finish();
  return o;
}

struct PlanCase {
  const char* name;
  int T, K, E;
  double skew;
  std::vector<int> unused;
};

std::vector<PlanCase> cuda_plan_cases() {
  return {
      {"small", 13, 2, 8, 0.0, {}},
      {"single_token", 1, 4, 6, 0.0, {}},
      {"no_tokens", 0, 2, 5, 0.0, {}},
      {"empty_experts", 30, 2, 9, 0.0, {0, 4, 8}},
      {"one_expert", 100, 1, 1, 0.0, {}},
      {"skewed", 500, 4, 16, 0.95, {3}},
      {"T4096_E128_k8", 4096, 8, 128, 0.0, {}},
      {"T4096_E128_k8_skewed", 4096, 8, 128, 0.9, {1, 2, 77}},
      {"T16384_E256_k8", 16384, 8, 256, 0.3, {}},
  };
}

TEST_F(CudaTest, PlanMatchesCpuExactly) {
  uint64_t seed = 3000;
  for (const PlanCase& c : cuda_plan_cases())
    for (int pad : {1, 16, 128}) {
      SCOPED_TRACE(std::string(c.name) + " pad=" + std::to_string(pad));
      Rng rng(++seed);
      HostTensor ids = ints({c.T, c.K}, random_ids(c.T, c.K, c.E, rng, c.skew, c.unused));
      int64_t R = api::plan_max_rows(static_cast<int64_t>(c.T) * c.K, c.E, pad) + 3;
      PlanOut cpu = plan(false, ids, c.E, pad, R), gpu = plan(true, ids, c.E, pad, R);
      EXPECT_TRUE(equal_ints(gpu.counts, int_values(cpu.counts), "counts"));
      EXPECT_TRUE(equal_ints(gpu.offsets, int_values(cpu.offsets), "offsets"));
      EXPECT_TRUE(equal_ints(gpu.r2s, int_values(cpu.r2s), "row_to_slot"));
      EXPECT_TRUE(equal_ints(gpu.s2r, int_values(cpu.s2r), "slot_to_row"));
      EXPECT_TRUE(gpu.bitwise_equal(plan(true, ids, c.E, pad, R))) << "two GPU runs differ";
    }
}

struct PermCase {
  const char* name;
  int T, K, E, H, pad;
  double skew;
};

std::vector<PermCase> cuda_perm_cases() {
  return {
      {"small", 13, 2, 8, 20, 1, 0.0},
      {"padded", 13, 2, 8, 20, 16, 0.0},
      {"single_token", 1, 1, 3, 7, 1, 0.0},
      {"h1", 6, 3, 5, 1, 8, 0.0},
      {"no_tokens", 0, 2, 4, 9, 16, 0.0},
      {"odd_h", 77, 3, 12, 131, 4, 0.9},
      {"T4096_k8_E128_H1024", 4096, 8, 128, 1024, 128, 0.3},
      {"T2048_k4_E32_H2880", 2048, 4, 32, 2880, 16, 0.0},  // GPT-OSS hidden size
      {"k10", 50, 10, 16, 64, 1, 0.0},                     // past the token-major gather's k
  };
}

struct Permuted {
  std::vector<int> ids;
  PlanRef plan;
  int64_t R;
};

Permuted permuted(const PermCase& c, Rng& rng) {
  Permuted p{random_ids(c.T, c.K, c.E, rng, c.skew), {}, 0};
  p.R = api::plan_max_rows(static_cast<int64_t>(c.T) * c.K, c.E, c.pad);
  p.plan = plan_ref(p.ids, c.E, c.pad, p.R);
  return p;
}

const DType kFloatTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

TEST_F(CudaTest, GatherCombineMatchCpu) {
  uint64_t seed = 4000;
  for (const PermCase& c : cuda_perm_cases())
    for (DType dt : kFloatTypes) {
      SCOPED_TRACE(std::string(c.name) + " " + name_of(dt));
      Rng rng(++seed);
      Permuted pm = permuted(c, rng);
      int64_t slots = static_cast<int64_t>(c.T) * c.K;
      HostTensor x = random_tensor(dt, {c.T, c.H}, rng, -3, 3), r2s = ints({pm.R}, pm.plan.row_to_slot),
                 s2r = ints({c.T, c.K}, pm.plan.slot_to_row), scale = random_tensor(DType::kF32, {slots}, rng),
                 w = random_tensor(DType::kF32, {c.T, c.K}, rng, 0, 1),
                 rows = random_tensor(dt, {pm.R, c.H}, rng, -3, 3), dy = random_tensor(dt, {c.T, c.H}, rng),
                 s2r_flat = ints({slots}, pm.plan.slot_to_row);
      for (int with_opt = 0; with_opt < 2; ++with_opt) {  // with / without scale and weights
        const HostTensor *sp = with_opt ? &scale : nullptr, *wp = with_opt ? &w : nullptr;
        // token_major: slot_to_row given (the scatter kernel for k <= 8): the same bits
        auto gather = [&](bool gpu, bool token_major = false) {
          Runner run(gpu);
          HostTensor dst(dt, {pm.R, c.H});
          api::gather_rows(run.in(x), run.in(r2s), c.K, run.opt(sp), run.out(dst), 0, true,
                           token_major ? run.in(s2r_flat) : absent());
          run.finish();
          return dst;
        };
        auto combine = [&](bool gpu) {
          Runner run(gpu);
          HostTensor out(dt, {c.T, c.H});
          api::combine_rows(run.in(rows), run.in(s2r), run.opt(wp), run.out(out), 0);
          run.finish();
          return out;
        };
        HostTensor g = gather(true), o = combine(true);
        EXPECT_TRUE(close_pair(g, gather(false), gather_ref(x, pm.plan.row_to_slot, c.K, sp), "gather dst"));
        EXPECT_TRUE(close_pair(o, combine(false), combine_ref(rows, pm.plan.slot_to_row, c.K, wp), "combine out"));
        EXPECT_TRUE(g.bitwise_equal(gather(true))) << "two GPU gathers differ";
        EXPECT_TRUE(g.bitwise_equal(gather(true, true))) << "token-major gather differs";
        EXPECT_TRUE(o.bitwise_equal(combine(true))) << "two GPU combines differ";
      }
      auto dweights = [&](bool gpu) {
        Runner run(gpu);
        HostTensor dw(DType::kF32, {c.T, c.K});
        api::combine_weights_grad(run.in(dy), run.in(rows), run.in(s2r), run.out(dw), 0);
        run.finish();
        return dw;
      };
      HostTensor dw = dweights(true);
      EXPECT_TRUE(close_pair(dw, dweights(false), combine_wgrad_ref(dy, rows, pm.plan.slot_to_row), "d_weights"));
      EXPECT_TRUE(dw.bitwise_equal(dweights(true))) << "two GPU d_weights differ";
    }
}

// Index checks run on device data too, and mixed devices are refused before any launch.
TEST_F(CudaTest, ValidationOfDeviceTensors) {
  const int T = 6, K = 2, E = 4;
  Rng rng(1);
  HostTensor ids = ints({T, K}, {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 4});  // last id out of range
  EXPECT_MOE8_ERROR("ids", plan(true, ids, E, 1, T * K));
  HostTensor src = random_tensor(DType::kBF16, {T, 8}, rng);
  HostTensor bad_r2s = ints({T * K}, std::vector<int>(T * K, T * K));  // every slot out of range
  HostTensor ok_r2s = ints({T * K}, std::vector<int>(T * K, 0));
  HostTensor dst(DType::kBF16, {T * K, 8});
  {
    Runner run(true);
    EXPECT_MOE8_ERROR("row_to_slot", api::gather_rows(run.in(src), run.in(bad_r2s), K, absent(), run.out(dst), 0));
  }
  {
    Runner run(true);  // a CPU index tensor among GPU tensors
    EXPECT_MOE8_ERROR("row_to_slot", api::gather_rows(run.in(src), ok_r2s.view(), K, absent(), run.out(dst), 0));
  }
  HostTensor a = random_tensor(DType::kBF16, {10, 8}, rng), b = random_tensor(DType::kBF16, {3, 5, 8}, rng);
  HostTensor c(DType::kBF16, {10, 5});
  for (const std::vector<int>& off : {std::vector<int>{0, 6, 3, 10}, std::vector<int>{0, 3, 6, 11}}) {
    Runner run(true);  // decreasing; past the 10 rows of a
    HostTensor bad_off = ints({4}, off);
    EXPECT_MOE8_ERROR("offsets", api::grouped_gemm(run.in(a), run.in(b), run.in(bad_off), WeightLayout::kNK, absent(),
                                                   run.out(c), 0));
  }
  EXPECT_TRUE(api::cuda_available());
}

}  // namespace
}  // namespace moe8::test

#else  // built without the CUDA backend: say so instead of silently running nothing
TEST(CudaTest, Backend) {
  GTEST_SKIP() << "no CUDA device: moe8 was built without the CUDA backend (MOE8_CUDA=OFF or no nvcc)";
}
#endif
