// test_rope.cpp — api::rope (rotary position embedding, rotate_half form) on the CPU against a float64
// formula written here, forward and backward, for x and out in transformers' strided layout (a [B,S,H,D]
// buffer seen as [B,H,S,D]) or contiguous, cos / sin per batch row or broadcast; argument errors; and,
// with the CUDA backend, the kernel against the CPU reference (skips without a GPU).
#include <string>
#include <utility>
#include <vector>

#include "test_ref.h"

#ifdef MOE8_WITH_CUDA
#include "test_cuda_util.h"
#endif

namespace moe8::test {
namespace {

const DType kFloatTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

struct RopeDims {
  int64_t B, S, H, D, Bc;  // Bc: batch of cos / sin, B or 1
};

// Where x / out live in their flat buffer: transformers' q (bshd) or a contiguous [B,H,S,D], starting
// `offset` elements in (an offset of 1 misaligns every vector width).
struct Placement {
  bool bshd;
  int64_t offset;
};

int64_t flat_elems(const RopeDims& d, const Placement& p) { return p.offset + d.B * d.S * d.H * d.D; }

int64_t at(const RopeDims& d, const Placement& p, int64_t b, int64_t h, int64_t s, int64_t i) {
  return p.offset + (p.bshd ? ((b * d.S + s) * d.H + h) * d.D : ((b * d.H + h) * d.S + s) * d.D) + i;
}

// The [B,H,S,D] view of a flat buffer (host or device).
TensorView place(TensorView flat, const RopeDims& d, const Placement& p) {
  TensorView v = flat;
  v.data = static_cast<char*>(flat.data) + p.offset * dtype_size(flat.dtype);
  v.ndim = 4;
  const int64_t shape[4] = {d.B, d.H, d.S, d.D};
  for (int k = 0; k < 4; ++k) v.shape[k] = shape[k];
  v.strides[0] = d.S * d.H * d.D;
  v.strides[1] = p.bshd ? d.D : d.S * d.D;
  v.strides[2] = p.bshd ? d.H * d.D : d.D;
  v.strides[3] = 1;
  return v;
}

// The [B,H,S,D] elements of a placed buffer, gathered contiguously (values unchanged).
HostTensor gather(const HostTensor& flat, const RopeDims& d, const Placement& p) {
  HostTensor t(flat.dtype(), {d.B, d.H, d.S, d.D});
  int64_t n = 0;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.H; ++h)
      for (int64_t s = 0; s < d.S; ++s)
        for (int64_t i = 0; i < d.D; ++i) t.set(n++, flat.get(at(d, p, b, h, s, i)));
  return t;
}

// float64 result in [B,H,S,D] order; backward: x is dy. Written from the definitions
//   forward  y = x cos + rotate_half(x) sin,     rotate_half(v)   = [-v[half:], v[:half]]
//   backward dx = g cos + rotate_half^T(g sin),  rotate_half^T(u) = [u[half:], -u[:half]]
Expect rope_ref(const HostTensor& xflat, const HostTensor& cos, const HostTensor& sin, const RopeDims& d,
                const Placement& p, bool backward) {
  Expect e;
  e.comp_rel = fp32_rel(2);
  const int64_t half = d.D / 2;
  std::vector<double> v(d.D), u(d.D), term(d.D);  // term: rotate_half(x) sin, or rotate_half^T(g sin)
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.H; ++h)
      for (int64_t s = 0; s < d.S; ++s) {
        const int64_t row = ((d.Bc == 1 ? 0 : b) * d.S + s) * d.D;
        for (int64_t i = 0; i < d.D; ++i) v[i] = xflat.get(at(d, p, b, h, s, i));
        for (int64_t i = 0; i < d.D; ++i) u[i] = v[i] * sin.get(row + i);
        for (int64_t i = 0; i < d.D; ++i)
          term[i] = !backward ? (i < half ? -v[i + half] : v[i - half]) * sin.get(row + i)
                              : (i < half ? u[i + half] : -u[i - half]);
        for (int64_t i = 0; i < d.D; ++i) {
          const double a = v[i] * cos.get(row + i);
          e.want.push_back(a + term[i]);
          e.mag.push_back(std::fabs(a) + std::fabs(term[i]));
        }
      }
  return e;
}

struct RopeCase {
  const char* name;
  RopeDims d;
};

const RopeCase kCases[] = {
    {"B2_S5_H3_D8", {2, 5, 3, 8, 2}},    {"broadcast_B3_S4_H2_D64", {3, 4, 2, 64, 1}},
    {"one_of_each_D2", {1, 1, 1, 2, 1}}, {"half_5_D10", {2, 3, 2, 10, 2}},
    {"no_positions", {2, 0, 3, 8, 1}},   {"qwen3_D128", {1, 6, 4, 128, 1}},
};

const Placement kPlacements[][2] = {
    // {x, out}
    {{true, 0}, {true, 0}},    // transformers' q, output in the same layout (what ops.rope does)
    {{false, 0}, {false, 0}},  // contiguous
    {{true, 1}, {false, 0}},   // misaligned strided x, contiguous out
    {{false, 0}, {true, 1}},   // contiguous x, misaligned strided out
};

struct RopeRun {
  HostTensor out_flat;
  HostTensor out;  // gathered [B,H,S,D]
};

RopeRun run_cpu(const HostTensor& xflat, const HostTensor& cos, const HostTensor& sin, const RopeDims& d,
                const Placement& px, const Placement& po, bool backward) {
  RopeRun r{HostTensor(xflat.dtype(), {flat_elems(d, po)}), {}};
  r.out_flat.poison();
  api::rope(place(xflat.view(), d, px), cos.view(), sin.view(), place(r.out_flat.view(), d, po), backward, 0);
  r.out = gather(r.out_flat, d, po);
  return r;
}

// The elements before the view (the misaligned offset) are never written.
::testing::AssertionResult slack_untouched(const HostTensor& flat, const Placement& p) {
  for (int64_t i = 0; i < p.offset; ++i)
    if (!std::isnan(flat.get(i))) return ::testing::AssertionFailure() << "element " << i << " before out written";
  return ::testing::AssertionSuccess();
}

// One variant of a case: its inputs (fresh random data) and what the trace says about it.
struct RopeVariant {
  const RopeDims& d;
  const Placement* pl;  // [2]: x, out
  bool backward;
  HostTensor x, cos, sin;
};

// Calls check(v) for every case x dtype x placement x direction, each under a SCOPED_TRACE naming it.
template <typename Check>
void for_each_variant(const std::vector<RopeCase>& cases, uint64_t seed, Check check) {
  for (const RopeCase& c : cases)
    for (DType dt : kFloatTypes)
      for (const auto& pl : kPlacements)
        for (bool backward : {false, true}) {
          SCOPED_TRACE(std::string(c.name) + " " + name_of(dt) + (pl[0].bshd ? " x:bshd" : " x:bhsd") + "+" +
                       std::to_string(pl[0].offset) + (pl[1].bshd ? " out:bshd" : " out:bhsd") + "+" +
                       std::to_string(pl[1].offset) + (backward ? " backward" : " forward"));
          const RopeDims& d = c.d;
          Rng rng(++seed);
          HostTensor x = random_tensor(dt, {flat_elems(d, pl[0])}, rng, -2, 2);
          HostTensor cos = random_tensor(dt, {d.Bc, d.S, d.D}, rng), sin = random_tensor(dt, {d.Bc, d.S, d.D}, rng);
          check(RopeVariant{d, pl, backward, std::move(x), std::move(cos), std::move(sin)});
        }
}

TEST(Rope, MatchesReference) {
  for_each_variant({std::begin(kCases), std::end(kCases)}, 70, [](const RopeVariant& v) {
    RopeRun r = run_cpu(v.x, v.cos, v.sin, v.d, v.pl[0], v.pl[1], v.backward);
    EXPECT_TRUE(close_to(r.out, rope_ref(v.x, v.cos, v.sin, v.d, v.pl[0], v.backward), "out"));
    EXPECT_TRUE(slack_untouched(r.out_flat, v.pl[1]));
  });
}

// Hand-checked values, so a shared misreading of the spec by test and reference would still show.
TEST(Rope, KnownValues) {
  const RopeDims d{1, 1, 1, 4, 1};
  const Placement p{false, 0};
  HostTensor x(DType::kF32, {4}), cos(DType::kF32, {1, 1, 4}), sin(DType::kF32, {1, 1, 4});
  const double xv[4] = {1, 2, 3, 4}, cv[4] = {0.5, 0.25, 2, 4}, sv[4] = {1, -1, 0.5, 3};
  for (int i = 0; i < 4; ++i) {
    x.set(i, xv[i]);
    cos.set(i, cv[i]);
    sin.set(i, sv[i]);
  }
  // rotate_half(x) = [-3, -4, 1, 2]
  RopeRun f = run_cpu(x, cos, sin, d, p, p, false);
  const double fwd[4] = {1 * 0.5 - 3 * 1, 2 * 0.25 + 4 * 1, 3 * 2 + 1 * 0.5, 4 * 4 + 2 * 3};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(f.out.get(i), fwd[i]) << "forward " << i;
  // g sin = [1, -2, 1.5, 12]; rotate_half^T of it = [1.5, 12, -1, 2]
  RopeRun b = run_cpu(x, cos, sin, d, p, p, true);
  const double bwd[4] = {1 * 0.5 + 1.5, 2 * 0.25 + 12, 3 * 2 - 1, 4 * 4 + 2};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(b.out.get(i), bwd[i]) << "backward " << i;
}

TEST(Rope, RejectsBadArguments) {
  const RopeDims d{2, 3, 2, 8, 1};
  const Placement p{true, 0};
  HostTensor x(DType::kBF16, {flat_elems(d, p)}, 4096), out(DType::kBF16, {flat_elems(d, p)}, 4096);
  HostTensor cos(DType::kBF16, {1, 3, 8}, 4096), sin(DType::kBF16, {1, 3, 8}, 4096);
  const TensorView xv = place(x.view(), d, p), ov = place(out.view(), d, p);
  api::rope(xv, cos.view(), sin.view(), ov, false, 0);  // the valid call passes

  TensorView odd = xv, odd_out = ov, odd_cos = cos.view(), odd_sin = sin.view();
  odd.shape[3] = odd_out.shape[3] = odd_cos.shape[2] = odd_sin.shape[2] = 7;
  EXPECT_MOE8_ERROR("x", api::rope(odd, odd_cos, odd_sin, odd_out, false, 0));
  TensorView x3 = xv;
  x3.ndim = 3;
  EXPECT_MOE8_ERROR("x", api::rope(x3, cos.view(), sin.view(), ov, false, 0));
  TensorView xs = xv;
  xs.strides[3] = 2;
  EXPECT_MOE8_ERROR("x", api::rope(xs, cos.view(), sin.view(), ov, false, 0));
  TensorView c2 = cos.view();
  c2.shape[0] = 3;  // neither B = 2 nor 1
  EXPECT_MOE8_ERROR("cos", api::rope(xv, c2, sin.view(), ov, false, 0));
  TensorView s2 = sin.view();
  s2.shape[1] = 4;
  EXPECT_MOE8_ERROR("sin", api::rope(xv, cos.view(), s2, ov, false, 0));
  TensorView cf = cos.view();
  cf.dtype = DType::kF32;
  EXPECT_MOE8_ERROR("cos", api::rope(xv, cf, sin.view(), ov, false, 0));
  TensorView ct = cos.view();
  ct.strides[1] = 1;  // [1,3,8] seen through a transpose
  ct.strides[2] = 3;
  EXPECT_MOE8_ERROR("cos", api::rope(xv, ct, sin.view(), ov, false, 0));
  TensorView o1 = ov;
  o1.strides[1] = 0;  // heads written over each other
  EXPECT_MOE8_ERROR("out", api::rope(xv, cos.view(), sin.view(), o1, false, 0));
  TensorView o2 = ov;
  o2.strides[2] = 4;  // positions overlapping within a row
  EXPECT_MOE8_ERROR("out", api::rope(xv, cos.view(), sin.view(), o2, false, 0));
  TensorView of = ov;
  of.dtype = DType::kF16;
  EXPECT_MOE8_ERROR("out", api::rope(xv, cos.view(), sin.view(), of, false, 0));
  TensorView osh = ov;
  osh.shape[1] = 3;
  EXPECT_MOE8_ERROR("out", api::rope(xv, cos.view(), sin.view(), osh, false, 0));
}

}  // namespace

#ifdef MOE8_WITH_CUDA
namespace {

RopeRun run_gpu(const HostTensor& xflat, const HostTensor& cos, const HostTensor& sin, const RopeDims& d,
                const Placement& px, const Placement& po, bool backward) {
  Runner run(true);
  RopeRun r{HostTensor(xflat.dtype(), {flat_elems(d, po)}), {}};
  const TensorView xv = place(run.in(xflat), d, px), ov = place(run.out(r.out_flat), d, po);
  api::rope(xv, run.in(cos), run.in(sin), ov, backward, 0);
  run.finish();
  r.out = gather(r.out_flat, d, po);
  return r;
}

TEST_F(CudaTest, RopeMatchesCpu) {
  std::vector<RopeCase> cases(std::begin(kCases), std::end(kCases));
  cases.push_back({"qwen3_30b_S2048_H32", {2, 2048, 32, 128, 1}});
  cases.push_back({"qwen3_30b_kv_S2048_H4", {2, 2048, 4, 128, 2}});
  cases.push_back({"olmoe_S4096_H16", {1, 4096, 16, 128, 1}});
  for_each_variant(cases, 900, [](const RopeVariant& v) {
    RopeRun cpu = run_cpu(v.x, v.cos, v.sin, v.d, v.pl[0], v.pl[1], v.backward);
    RopeRun gpu = run_gpu(v.x, v.cos, v.sin, v.d, v.pl[0], v.pl[1], v.backward);
    EXPECT_TRUE(close_pair(gpu.out, cpu.out, rope_ref(v.x, v.cos, v.sin, v.d, v.pl[0], v.backward), "out"));
    EXPECT_TRUE(slack_untouched(gpu.out_flat, v.pl[1]));
    EXPECT_TRUE(gpu.out.bitwise_equal(run_gpu(v.x, v.cos, v.sin, v.d, v.pl[0], v.pl[1], v.backward).out))
        << "two GPU runs differ";
  });
}

}  // namespace
#endif  // MOE8_WITH_CUDA

}  // namespace moe8::test
