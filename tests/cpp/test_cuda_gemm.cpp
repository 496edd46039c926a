// test_cuda_gemm.cpp — CUDA grouped GEMM (both layouts, bias), its wgrad (f32 / 16-bit db, dbias) and
// the activations, against the CPU reference of the API on the same inputs: ragged awkward groups and
// realistic MoE shapes (skewed rows, Kd=256/N=384, Qwen3 / GPT-OSS sizes), plus GPU determinism.
#include "test_ref.h"

#ifdef MOE8_WITH_CUDA
#include <cuda_runtime.h>

#include "test_cuda_util.h"

namespace moe8::test {
namespace {

const WeightLayout kLayouts[] = {WeightLayout::kNK, WeightLayout::kKN};
const char* layout_name(WeightLayout l) { return l == WeightLayout::kNK ? "NK" : "KN"; }

struct GemmCase {
  const char* name;
  DType dtype;
  std::vector<int> sizes;  // rows per expert
  int pad;                 // groups padded to this many rows
  int64_t tail;            // rows past offsets[E]
  int64_t Kd, N;
};

std::vector<GemmCase> cuda_gemm_cases() {
  const DType f32 = DType::kF32, f16 = DType::kF16, bf16 = DType::kBF16;
  return {
      {"ragged_f32", f32, {5, 0, 13, 1}, 1, 3, 7, 13},
      {"ragged_f16", f16, {5, 0, 13, 1}, 1, 3, 20, 20},
      {"ragged_bf16", bf16, {5, 0, 13, 1}, 1, 3, 7, 13},
      {"single_row_bf16", bf16, {0, 1, 0}, 1, 0, 24, 8},
      {"all_empty_bf16", bf16, {0, 0, 0}, 1, 5, 16, 16},
      {"odd_sizes_bf16", bf16, {33, 65, 1, 129}, 1, 0, 72, 40},
      // realistic: ~1000 rows skewed over 8 experts, Kd=256, N=384
      {"skewed_1000_bf16", bf16, {700, 150, 0, 80, 40, 20, 9, 1}, 1, 0, 256, 384},
      {"skewed_1000_pad128_bf16", bf16, {700, 150, 0, 80, 40, 20, 9, 1}, 128, 7, 256, 384},
      {"skewed_1000_f16", f16, {700, 150, 0, 80, 40, 20, 9, 1}, 16, 0, 256, 384},
      {"skewed_1000_f32", f32, {700, 150, 0, 80, 40, 20, 9, 1}, 1, 0, 256, 384},
      // real model widths, few rows (the float64 reference is a single-threaded loop)
      {"qwen3_gate_up_bf16", bf16, {70, 50, 0, 9}, 16, 0, 2048, 1536},
      {"gptoss_down_bf16", bf16, {100, 0, 23}, 16, 0, 2880, 2880},
  };
}

struct GemmInputs {
  std::vector<int> offsets;
  HostTensor a, b, bias, dc;
  int64_t R, E;
};

GemmInputs gemm_inputs(const GemmCase& c, WeightLayout layout, Rng& rng) {
  GemmInputs in;
  in.offsets = offsets_from_sizes(c.sizes, c.pad);
  in.E = static_cast<int64_t>(c.sizes.size());
  in.R = in.offsets.back() + c.tail;
  in.a = random_tensor(c.dtype, {in.R, c.Kd}, rng);
  for (int64_t e = 0; e < in.E; ++e)  // padding rows are zero, as gather_rows writes them
    for (int64_t r = in.offsets[e] + c.sizes[e]; r < in.offsets[e + 1]; ++r)
      for (int64_t k = 0; k < c.Kd; ++k) in.a.set(r * c.Kd + k, 0.0);
  in.b = random_tensor(c.dtype, layout == WeightLayout::kNK ? Shape{in.E, c.N, c.Kd} : Shape{in.E, c.Kd, c.N}, rng);
  in.bias = random_tensor(c.dtype, {in.E, c.N}, rng);
  in.dc = random_tensor(c.dtype, {in.R, c.N}, rng);
  return in;
}

HostTensor gemm(bool gpu, const GemmInputs& in, WeightLayout layout, bool with_bias, int64_t N) {
  Runner run(gpu);
  HostTensor c(in.a.dtype(), {in.R, N}), off = ints({in.E + 1}, in.offsets);
  api::grouped_gemm(run.in(in.a), run.in(in.b), run.in(off), layout, run.opt(with_bias ? &in.bias : nullptr),
                    run.out(c), 0);
  run.finish();
  return c;
}

TEST_F(CudaTest, GroupedGemmMatchesCpu) {
  uint64_t seed = 5000;
  for (const GemmCase& gc : cuda_gemm_cases())
    for (WeightLayout layout : kLayouts)
      for (bool with_bias : {false, true}) {
        SCOPED_TRACE(std::string(gc.name) + " " + layout_name(layout) + (with_bias ? " bias" : ""));
        Rng rng(++seed);
        GemmInputs in = gemm_inputs(gc, layout, rng);
        Expect scale = gemm_ref(in.a, in.b, in.offsets, layout, with_bias ? &in.bias : nullptr);
        HostTensor gpu = gemm(true, in, layout, with_bias, gc.N);
        EXPECT_TRUE(close_pair(gpu, gemm(false, in, layout, with_bias, gc.N), scale, "c"));
        EXPECT_TRUE(close_to(gpu, scale, "c vs float64"));
        EXPECT_TRUE(gpu.bitwise_equal(gemm(true, in, layout, with_bias, gc.N))) << "two GPU runs differ";
      }
}

struct WgradOut {
  HostTensor db, dbias;
};

WgradOut wgrad(bool gpu, const GemmInputs& in, WeightLayout layout, DType db_dtype, bool with_dbias, int64_t Kd,
               int64_t N) {
  Runner run(gpu);
  WgradOut o{HostTensor(db_dtype, layout == WeightLayout::kNK ? Shape{in.E, N, Kd} : Shape{in.E, Kd, N}),
             HostTensor(db_dtype, {in.E, N})};
  HostTensor off = ints({in.E + 1}, in.offsets);
  api::grouped_gemm_wgrad(run.in(in.a), run.in(in.dc), run.in(off), layout, run.out(o.db),
                          with_dbias ? run.out(o.dbias) : absent(), 0);
  run.finish();
  return o;
}

TEST_F(CudaTest, GroupedGemmWgradMatchesCpu) {
  uint64_t seed = 6000;
  for (const GemmCase& gc : cuda_gemm_cases()) {
    if (gc.Kd * gc.N > 1 << 20) continue;  // the largest shapes are covered by the forward test
    std::vector<DType> db_types = {DType::kF32};
    if (gc.dtype != DType::kF32) db_types.push_back(gc.dtype);
    for (DType db_dt : db_types)
      for (WeightLayout layout : kLayouts)
        for (bool with_dbias : {false, true}) {
          SCOPED_TRACE(std::string(gc.name) + " db=" + name_of(db_dt) + " " + layout_name(layout) +
                       (with_dbias ? " dbias" : ""));
          Rng rng(++seed);
          GemmInputs in = gemm_inputs(gc, layout, rng);
          WgradRef ref = wgrad_ref(in.a, in.dc, in.offsets, layout);
          WgradOut gpu = wgrad(true, in, layout, db_dt, with_dbias, gc.Kd, gc.N);
          WgradOut cpu = wgrad(false, in, layout, db_dt, with_dbias, gc.Kd, gc.N);
          EXPECT_TRUE(close_pair(gpu.db, cpu.db, ref.db, "db"));
          WgradOut again = wgrad(true, in, layout, db_dt, with_dbias, gc.Kd, gc.N);
          EXPECT_TRUE(gpu.db.bitwise_equal(again.db)) << "two GPU runs differ (db)";
          if (with_dbias) {
            EXPECT_TRUE(close_pair(gpu.dbias, cpu.dbias, ref.dbias, "dbias"));
            EXPECT_TRUE(gpu.dbias.bitwise_equal(again.dbias)) << "two GPU runs differ (dbias)";
          }
        }
  }
}

ActParams act(ActKind kind, bool interleaved) {
  ActParams p;
  p.kind = kind;
  p.interleaved = interleaved;
  return p;
}

TEST_F(CudaTest, ActivationsMatchCpu) {
  struct Dims {
    int64_t R, I;
  };
  const Dims dims[] = {{13, 7}, {1, 1}, {0, 5}, {33, 131}, {4096, 768}, {1000, 2880}};
  const ActParams params[] = {act(ActKind::kSwiGLU, false),        act(ActKind::kSwiGLU, true),
                              act(ActKind::kSwiGLUClamped, false), act(ActKind::kSwiGLUClamped, true),
                              act(ActKind::kSiLU, false),          act(ActKind::kGELU, false)};
  uint64_t seed = 7000;
  for (const ActParams& p : params)
    for (DType dt : {DType::kF32, DType::kF16, DType::kBF16})
      for (Dims d : dims) {
        SCOPED_TRACE("kind=" + std::to_string(static_cast<int>(p.kind)) +
                     " interleaved=" + std::to_string(p.interleaved) + " " + name_of(dt) + " R=" + std::to_string(d.R) +
                     " I=" + std::to_string(d.I));
        Rng rng(++seed);
        HostTensor h = act_input(dt, {d.R, is_gated(p.kind) ? 2 * d.I : d.I}, p, rng);
        HostTensor dout = random_tensor(dt, {d.R, d.I}, rng, -2, 2);
        auto fwd = [&](bool gpu) {
          Runner run(gpu);
          HostTensor out(dt, {d.R, d.I});
          api::activation_forward(run.in(h), p, run.out(out), 0);
          run.finish();
          return out;
        };
        auto bwd = [&](bool gpu) {
          Runner run(gpu);
          HostTensor dh(dt, h.shape());
          api::activation_backward(run.in(h), run.in(dout), p, run.out(dh), 0);
          run.finish();
          return dh;
        };
        HostTensor out = fwd(true), dh = bwd(true);
        EXPECT_TRUE(close_pair(out, fwd(false), act_ref(h, p), "out"));
        EXPECT_TRUE(close_pair(dh, bwd(false), act_grad_ref(h, dout, p), "dh"));
        EXPECT_TRUE(out.bitwise_equal(fwd(true))) << "two GPU forwards differ";
        EXPECT_TRUE(dh.bitwise_equal(bwd(true))) << "two GPU backwards differ";
      }
}

TEST_F(CudaTest, ActivationBackwardRoutedMatchesCpu) {
  struct Dims {
    int64_t R, I;
  };
  const Dims dims[] = {{13, 7}, {1, 1}, {0, 5}, {33, 131}, {5, 301}, {4096, 768}, {1000, 2880}, {64, 14336}};
  const ActParams params[] = {act(ActKind::kSwiGLU, false), act(ActKind::kSwiGLU, true),
                              act(ActKind::kSwiGLUClamped, true), act(ActKind::kSiLU, false),
                              act(ActKind::kGELU, false)};
  uint64_t seed = 7500;
  for (const ActParams& p : params)
    for (DType dt : {DType::kF32, DType::kBF16})
      for (Dims d : dims) {
        SCOPED_TRACE("kind=" + std::to_string(static_cast<int>(p.kind)) +
                     " interleaved=" + std::to_string(p.interleaved) + " " + name_of(dt) + " R=" + std::to_string(d.R) +
                     " I=" + std::to_string(d.I));
        Rng rng(++seed);
        RoutedInputs in = routed_inputs(dt, p, d.R, d.I, std::max<int64_t>(d.R - 1, 0), rng);  // a padding row
        struct Out {
          HostTensor dh, a_w, dw;
        };
        auto run_on = [&](bool gpu) {
          Runner run(gpu);
          Out o{HostTensor(dt, in.h.shape()), HostTensor(dt, in.dout.shape()),
                HostTensor(DType::kF32, in.weights.shape())};
          api::activation_backward_routed(run.in(in.h), run.in(in.dout), run.in(in.weights), run.in(in.row_to_slot), p,
                                          run.out(o.dh), run.out(o.a_w), run.out(o.dw), 0);
          run.finish();
          return o;
        };
        const Out gpu = run_on(true), cpu = run_on(false), again = run_on(true);
        const RoutedExpect e = routed_ref(in, p);
        EXPECT_TRUE(close_pair(gpu.dh, cpu.dh, e.dh, "dh"));
        EXPECT_TRUE(close_pair(gpu.a_w, cpu.a_w, e.a_w, "a_w"));
        EXPECT_TRUE(close_pair(gpu.dw, cpu.dw, e.d_weights, "d_weights"));
        EXPECT_TRUE(gpu.dh.bitwise_equal(again.dh) && gpu.a_w.bitwise_equal(again.a_w) &&
                    gpu.dw.bitwise_equal(again.dw))
            << "two GPU runs differ";
      }
}

}  // namespace
}  // namespace moe8::test
#endif  // MOE8_WITH_CUDA
