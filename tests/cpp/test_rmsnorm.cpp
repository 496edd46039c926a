// test_rmsnorm.cpp — api::rms_norm_forward / rms_norm_backward on the CPU against a float64 formula written
// here (y, rstd, dx, dweight), at awkward shapes (no rows, one row, widths 1, 3, 100, 4100) and real ones; values
// checked by hand; argument errors; the launch shapes of cuda/rmsnorm_heuristics.h; and, with the CUDA backend,
// the kernels against the CPU reference, outputs poisoned first, pointers misaligned, dweight the same bits on
// every run (skips without a GPU).
#include <string>
#include <vector>

#include "cuda/rmsnorm_heuristics.h"
#include "test_ref.h"

#ifdef MOE8_WITH_CUDA
#include "test_cuda_util.h"
#endif

namespace moe8::test {
namespace {

const DType kFloatTypes[] = {DType::kF32, DType::kF16, DType::kBF16};
constexpr double kEps = 1e-6;

struct NormInputs {
  HostTensor x, w, dy;  // x, dy [R,H]; w [H]
  int64_t rows() const { return x.shape()[0]; }
  int64_t cols() const { return x.shape()[1]; }
};

NormInputs random_inputs(DType dt, int64_t R, int64_t H, uint64_t seed) {
  Rng rng(seed);
  return {random_tensor(dt, {R, H}, rng, -2, 2), random_tensor(dt, {H}, rng, -1.5, 1.5),
          random_tensor(dt, {R, H}, rng, -1, 1)};
}

struct NormRef {
  Expect y, rstd, dx, dw;
};

// float64 from the definitions: rstd = 1 / sqrt(mean(x^2) + eps), y = x rstd w; with g = dy w, xhat = x rstd:
// dx = rstd (g - xhat mean(g xhat)), dw = sum over rows of dy xhat. mag: what fp32 rounding scales with.
NormRef norm_ref(const NormInputs& in, double eps) {
  const int64_t R = in.rows(), H = in.cols();
  NormRef e;
  e.dw.want.assign(H, 0.0);
  e.dw.mag.assign(H, 0.0);
  std::vector<double> g(H), xhat(H);
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < H; ++j) ss += in.x.get(r * H + j) * in.x.get(r * H + j);
    const double rs = 1.0 / std::sqrt(ss / H + eps);
    e.rstd.want.push_back(rs);
    e.rstd.mag.push_back(rs);
    double dot = 0, dot_abs = 0;
    for (int64_t j = 0; j < H; ++j) {
      xhat[j] = in.x.get(r * H + j) * rs;
      g[j] = in.dy.get(r * H + j) * in.w.get(j);
      dot += g[j] * xhat[j];
      dot_abs += std::fabs(g[j] * xhat[j]);
      const double y = xhat[j] * in.w.get(j);
      e.y.want.push_back(y);
      e.y.mag.push_back(std::fabs(y));
      e.dw.want[j] += in.dy.get(r * H + j) * xhat[j];
      e.dw.mag[j] += std::fabs(in.dy.get(r * H + j) * xhat[j]);
    }
    for (int64_t j = 0; j < H; ++j) {
      e.dx.want.push_back(rs * (g[j] - xhat[j] * dot / H));
      e.dx.mag.push_back(rs * (std::fabs(g[j]) + std::fabs(xhat[j]) * dot_abs / H));
    }
  }
  for (Expect* x : {&e.y, &e.rstd, &e.dx, &e.dw}) x->comp_rel = fp32_rel(8);
  return e;
}

struct NormRun {
  HostTensor y, rstd, dx, dw;
};

// The [R,H] view `offset` elements into a flat buffer (an offset of 1 misaligns every 16-byte pack).
TensorView at_offset(TensorView flat, int64_t R, int64_t H, int64_t offset) {
  TensorView v =
      make_view(static_cast<char*>(flat.data) + offset * dtype_size(flat.dtype), flat.dtype, {R, H}, flat.device);
  v.device_index = flat.device_index;
  return v;
}

HostTensor shifted(const HostTensor& t, int64_t offset) {  // t's elements `offset` into a longer buffer
  HostTensor f(t.dtype(), {offset + t.numel()});
  for (int64_t i = 0; i < t.numel(); ++i) f.set(offset + i, t.get(i));
  return f;
}

HostTensor unshifted(const HostTensor& f, int64_t R, int64_t H, int64_t offset) {
  HostTensor t(f.dtype(), {R, H});
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, f.get(offset + i));
  return t;
}

// The CPU side of test_cuda_util.h's Runner: inputs as they are, outputs poisoned first.
struct HostRunner {
  bool gpu() const { return false; }
  TensorView in(const HostTensor& t) { return t.view(); }
  TensorView out(HostTensor& t) {
    t.poison();
    return t.view();
  }
  void finish() {}
};

// Forward then backward (from the forward's rstd) through the same code on either device; every output and the
// GPU workspace poisoned first (NaN), [R,H] tensors placed `offset` elements into their buffers.
template <class Run>
NormRun run_norm(Run&& run, const NormInputs& in, double eps, int64_t offset = 0) {
  const int64_t R = in.rows(), H = in.cols();
  HostTensor x = shifted(in.x, offset), dy = shifted(in.dy, offset);
  HostTensor y(in.x.dtype(), {offset + R * H}), dx(in.x.dtype(), {offset + R * H});
  NormRun o{{}, HostTensor(DType::kF32, {R}), {}, HostTensor(in.w.dtype(), {H})};
  HostTensor ws(DType::kF32, {std::max<int64_t>(1, api::rms_norm_workspace_elems(R, H, true))});
  const TensorView xv = at_offset(run.in(x), R, H, offset), dyv = at_offset(run.in(dy), R, H, offset);
  const TensorView yv = at_offset(run.out(y), R, H, offset), dxv = at_offset(run.out(dx), R, H, offset);
  const TensorView wv = run.in(in.w), rv = run.out(o.rstd), dwv = run.out(o.dw);
  const TensorView wsv = run.gpu() ? run.out(ws) : absent();
  api::rms_norm_forward(xv, wv, eps, yv, rv, 0);
  api::rms_norm_backward(dyv, xv, wv, rv, dxv, dwv, wsv, 0);
  run.finish();
  o.y = unshifted(y, R, H, offset);
  o.dx = unshifted(dx, R, H, offset);
  return o;
}

NormRun run_cpu(const NormInputs& in, double eps, int64_t offset = 0) {
  return run_norm(HostRunner{}, in, eps, offset);
}

struct NormCase {
  int64_t rows, cols;
};

// No rows, one row, a few; widths of one element, odd ones, a head dim, a hidden size, one past a pack multiple.
std::vector<NormCase> awkward_cases() {
  std::vector<NormCase> cases;
  for (int64_t R : {0, 1, 5, 33})
    for (int64_t H : {1, 3, 100, 128, 2048, 4100}) cases.push_back({R, H});
  return cases;
}

std::string case_name(const NormCase& c, DType dt) {
  return "[" + std::to_string(c.rows) + ", " + std::to_string(c.cols) + "] " + name_of(dt);
}

TEST(RmsNorm, MatchesReference) {
  uint64_t seed = 300;
  for (const NormCase& c : awkward_cases())
    for (DType dt : kFloatTypes) {
      SCOPED_TRACE(case_name(c, dt));
      const NormInputs in = random_inputs(dt, c.rows, c.cols, ++seed);
      const NormRun got = run_cpu(in, kEps);
      const NormRef want = norm_ref(in, kEps);
      EXPECT_TRUE(close_to(got.y, want.y, "y"));
      EXPECT_TRUE(close_to(got.rstd, want.rstd, "rstd"));
      EXPECT_TRUE(close_to(got.dx, want.dx, "dx"));
      EXPECT_TRUE(close_to(got.dw, want.dw, "dweight"));
    }
}

// Hand-checked values, so a shared misreading of the definitions by test and reference would still show.
TEST(RmsNorm, KnownValues) {
  // x = [2, 2, 2, 2]: mean(x^2) = 4, rstd = 1/2, xhat = 1; a zero row: rstd = 1 / sqrt(eps) = 2 for eps = 1/4.
  NormInputs in{HostTensor(DType::kF32, {2, 4}), HostTensor(DType::kF32, {4}), HostTensor(DType::kF32, {2, 4})};
  for (int j = 0; j < 4; ++j) {
    in.x.set(j, 2);
    in.x.set(4 + j, 0);
    in.w.set(j, j + 1);
    in.dy.set(j, j == 0 ? 1 : 0);
    in.dy.set(4 + j, 1);
  }
  const NormRun o = run_cpu(in, 0.25);
  // eps shifts the first row's mean square to 4.25 too: rstd = 1 / sqrt(4.25)
  const double r0 = 1 / std::sqrt(4.25);
  EXPECT_FLOAT_EQ(o.rstd.get(0), r0);
  EXPECT_FLOAT_EQ(o.rstd.get(1), 2);
  for (int j = 0; j < 4; ++j) {
    EXPECT_FLOAT_EQ(o.y.get(j), 2 * r0 * (j + 1)) << j;
    EXPECT_EQ(o.y.get(4 + j), 0) << j;
    EXPECT_EQ(o.dx.get(4 + j), 2 * (j + 1)) << j;  // x = 0: dx = rstd * g
    EXPECT_FLOAT_EQ(o.dw.get(j), (j == 0 ? 2 * r0 : 0)) << j;
  }
  // first row: g = [1, 0, 0, 0], xhat = 2 r0, mean(g xhat) = 2 r0 / 4, dx = r0 (g - xhat mean(g xhat))
  const double xh = 2 * r0, mean = xh / 4;
  for (int j = 0; j < 4; ++j) EXPECT_FLOAT_EQ(o.dx.get(j), r0 * ((j == 0 ? 1 : 0) - xh * mean)) << j;
}

TEST(RmsNorm, RejectsBadArguments) {
  HostTensor x(DType::kBF16, {4, 8}, 4096), w(DType::kBF16, {8}, 4096), y(DType::kBF16, {4, 8}, 4096);
  HostTensor rstd(DType::kF32, {4}, 4096), dx(DType::kBF16, {4, 8}, 4096), dw(DType::kBF16, {8}, 4096);
  const TensorView xv = x.view(), wv = w.view(), yv = y.view(), rv = rstd.view(), dxv = dx.view(), dwv = dw.view();
  api::rms_norm_forward(xv, wv, kEps, yv, rv, 0);  // the valid calls pass
  api::rms_norm_backward(xv, xv, wv, rv, dxv, dwv, absent(), 0);

  TensorView x3 = xv;
  x3.ndim = 3;
  x3.shape[2] = 1;
  EXPECT_MOE8_ERROR("x", api::rms_norm_forward(x3, wv, kEps, yv, rv, 0));
  TensorView xi = xv;
  xi.dtype = DType::kI32;
  EXPECT_MOE8_ERROR("x", api::rms_norm_forward(xi, wv, kEps, yv, rv, 0));
  TensorView xt = xv;
  xt.strides[0] = 1;
  xt.strides[1] = 4;
  EXPECT_MOE8_ERROR("x", api::rms_norm_forward(xt, wv, kEps, yv, rv, 0));
  TensorView w7 = wv;
  w7.shape[0] = 7;
  EXPECT_MOE8_ERROR("weight", api::rms_norm_forward(xv, w7, kEps, yv, rv, 0));
  TensorView wf = wv;
  wf.dtype = DType::kF32;
  EXPECT_MOE8_ERROR("weight", api::rms_norm_forward(xv, wf, kEps, yv, rv, 0));
  EXPECT_MOE8_ERROR("weight", api::rms_norm_forward(xv, absent(), kEps, yv, rv, 0));
  EXPECT_MOE8_ERROR("eps", api::rms_norm_forward(xv, wv, -1.0, yv, rv, 0));
  EXPECT_MOE8_ERROR("eps", api::rms_norm_forward(xv, wv, std::nan(""), yv, rv, 0));
  TensorView y5 = yv;
  y5.shape[0] = 5;
  EXPECT_MOE8_ERROR("y", api::rms_norm_forward(xv, wv, kEps, y5, rv, 0));
  TensorView r16 = rv;
  r16.dtype = DType::kBF16;
  EXPECT_MOE8_ERROR("rstd", api::rms_norm_forward(xv, wv, kEps, yv, r16, 0));
  TensorView r3 = rv;
  r3.shape[0] = 3;
  EXPECT_MOE8_ERROR("rstd", api::rms_norm_backward(xv, xv, wv, r3, dxv, dwv, absent(), 0));
  TensorView dyf = xv;
  dyf.dtype = DType::kF16;
  EXPECT_MOE8_ERROR("dy", api::rms_norm_backward(dyf, xv, wv, rv, dxv, dwv, absent(), 0));
  TensorView dy3 = xv;
  dy3.shape[0] = 3;
  EXPECT_MOE8_ERROR("dy", api::rms_norm_backward(dy3, xv, wv, rv, dxv, dwv, absent(), 0));
  TensorView dx9 = dxv;
  dx9.shape[1] = 9;
  EXPECT_MOE8_ERROR("dx", api::rms_norm_backward(xv, xv, wv, rv, dx9, dwv, absent(), 0));
  TensorView dwf = dwv;
  dwf.dtype = DType::kF32;
  EXPECT_MOE8_ERROR("dweight", api::rms_norm_backward(xv, xv, wv, rv, dxv, dwf, absent(), 0));
  TensorView xg = xv;
  xg.device = DeviceType::kCUDA;  // a GPU x beside CPU tensors: named before anything is launched
  EXPECT_MOE8_ERROR("weight", api::rms_norm_forward(xg, wv, kEps, yv, rv, 0));
}

namespace h = cuda::rmsnorm_heuristics;

// The launch shapes at the widths of real models (bf16, 16-byte packs of 8): Qwen3's per-head q / k norms
// (head_dim 128), hidden norms of Qwen3-30B-A3B (2048), GPT-OSS (2880), Mixtral (4096), DeepSeek-V3 (7168).
TEST(RmsNormHeuristics, RowShapes) {
  const auto shape = [](int64_t packs) { return h::row_shape(packs); };
  EXPECT_EQ(shape(128 / 8).lanes, 4);  // 4 lanes a row, 64 rows a block
  EXPECT_EQ(shape(128 / 8).rows_per_block(), 64);
  EXPECT_EQ(shape(2048 / 8).lanes, 64);  // two warps a row, 4 rows a block
  EXPECT_EQ(shape(2048 / 8).rows_per_block(), 4);
  EXPECT_EQ(shape(2880 / 8).lanes, 128);
  EXPECT_EQ(shape(4096 / 8).lanes, 128);
  EXPECT_EQ(shape(7168 / 8).lanes, 256);
  EXPECT_EQ(shape(8192 / 8).lanes, 256);
  EXPECT_EQ(shape(16384 / 8).lanes, 512);  // a block of 512 threads on one row
  EXPECT_EQ(shape(16384 / 8).threads, 512);
  EXPECT_FALSE(shape(16384 / 8 + 1).cached);  // past the registers: the row read twice
  EXPECT_EQ(shape(16384 / 8 + 1).threads, h::kBlockThreads);
  EXPECT_EQ(shape(1).lanes, 1);  // width 1 or 3 (single elements): a thread a row
  EXPECT_EQ(shape(3).lanes, 1);
  EXPECT_EQ(shape(100).lanes, 32);  // width 100 bf16 is no multiple of 8: 100 single elements
  EXPECT_EQ(shape(0).lanes, 1);
  for (int64_t packs = 0; packs <= 3 * h::kMaxLanes * h::kCachePacks; ++packs) {
    const h::RowShape s = h::row_shape(packs);
    ASSERT_EQ(s.threads % s.lanes, 0) << packs;
    ASSERT_EQ(s.lanes & (s.lanes - 1), 0) << packs;  // a power of two: groups never straddle a warp
    if (s.cached) {                                  // the fewest lanes that hold the row
      ASSERT_GE(int64_t{s.lanes} * h::kCachePacks, packs) << packs;
      ASSERT_TRUE(s.lanes == 1 || int64_t{s.lanes / 2} * h::kCachePacks < packs) << packs;
    } else {
      ASSERT_GT(packs, int64_t{h::kMaxLanes} * h::kCachePacks);
    }
  }
}

TEST(RmsNormHeuristics, BlocksAndWorkspace) {
  const int kH200Sms = 132;
  const h::RowShape hidden = h::row_shape(2048 / 8), head = h::row_shape(128 / 8);
  EXPECT_EQ(h::backward_blocks(8192, hidden, kH200Sms), 2 * kH200Sms);  // a wave of two blocks per SM
  EXPECT_EQ(h::backward_blocks(8192 * 32, head, kH200Sms), 2 * kH200Sms);
  EXPECT_EQ(h::backward_blocks(3, hidden, kH200Sms), 1);                           // no more blocks than the rows fill
  EXPECT_EQ(h::backward_blocks(1 << 20, h::row_shape(2048), kH200Sms), kH200Sms);  // 512-thread blocks: one an SM
  EXPECT_EQ(h::backward_blocks(1 << 20, hidden, 4096), h::kMaxPartialRows);        // never past the workspace's rows
  EXPECT_EQ(h::forward_blocks(8192 * 32, head), 8192 * 32 / 64);
  EXPECT_EQ(h::forward_blocks(int64_t{1} << 40, head), h::kMaxForwardBlocks);
  EXPECT_EQ(api::rms_norm_workspace_elems(8192, 2048, true), h::kMaxPartialRows * 2048);
  EXPECT_EQ(api::rms_norm_workspace_elems(5, 100, true), 5 * 100);
  EXPECT_EQ(api::rms_norm_workspace_elems(8192, 2048, false), 0);
  for (int64_t rows : {1, 7, 300, 5000, 1 << 20})
    for (int64_t packs : {1, 16, 256, 2048, 5000})
      for (int sms : {1, 132, 1000})
        EXPECT_LE(h::backward_blocks(rows, h::row_shape(packs), sms), h::workspace_rows(rows));
}

}  // namespace

#ifdef MOE8_WITH_CUDA
namespace {

// The GPU sums in fp32 (over a row, and dweight over the rows): its error grows with the terms added.
NormRef gpu_tolerance(NormRef e, int64_t R, int64_t H) {
  for (Expect* x : {&e.y, &e.rstd, &e.dx, &e.dw}) x->comp_rel = fp32_rel(std::max(R, H) + 8);
  return e;
}

TEST_F(CudaTest, RmsNormMatchesCpu) {
  struct GpuCase {
    NormCase c;
    int64_t offset;  // 1: every [R,H] pointer misaligned (single-element path)
  };
  std::vector<GpuCase> cases;
  for (int64_t R : {0, 1, 7, 300})
    for (int64_t H : {1, 3, 100, 128, 2048, 4100}) cases.push_back({{R, H}, 0});
  cases.push_back({{8192 * 2, 128}, 0});  // Qwen3's q norm rows: many rows per group and block
  cases.push_back({{2048, 2048}, 0});     // the hidden norms
  cases.push_back({{64, 7168}, 0});
  cases.push_back({{16, 8192}, 0});
  cases.push_back({{6, 16384}, 0});  // a block of 512 threads a row
  cases.push_back({{5, 20000}, 0});  // past the registers: the row read twice
  cases.push_back({{300, 128}, 1});
  cases.push_back({{33, 2048}, 1});
  cases.push_back({{3, 4101}, 1});  // single elements past the registers
  uint64_t seed = 700;
  for (const GpuCase& gc : cases)
    for (DType dt : kFloatTypes) {
      SCOPED_TRACE(case_name(gc.c, dt) + (gc.offset ? " misaligned" : ""));
      const NormInputs in = random_inputs(dt, gc.c.rows, gc.c.cols, ++seed);
      const NormRun cpu = run_cpu(in, kEps, gc.offset);
      const NormRun gpu = run_norm(Runner(true), in, kEps, gc.offset);
      const NormRef e = gpu_tolerance(norm_ref(in, kEps), gc.c.rows, gc.c.cols);
      EXPECT_TRUE(close_pair(gpu.y, cpu.y, e.y, "y"));
      EXPECT_TRUE(close_pair(gpu.rstd, cpu.rstd, e.rstd, "rstd"));
      EXPECT_TRUE(close_pair(gpu.dx, cpu.dx, e.dx, "dx"));
      EXPECT_TRUE(close_pair(gpu.dw, cpu.dw, e.dw, "dweight"));
      const NormRun again = run_norm(Runner(true), in, kEps, gc.offset);
      EXPECT_TRUE(gpu.dw.bitwise_equal(again.dw)) << "two GPU runs give different dweight bits";
      EXPECT_TRUE(gpu.dx.bitwise_equal(again.dx) && gpu.y.bitwise_equal(again.y)) << "two GPU runs differ";
    }
}

}  // namespace
#endif  // MOE8_WITH_CUDA

}  // namespace moe8::test
