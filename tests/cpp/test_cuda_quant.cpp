// test_cuda_quant.cpp — the FP8 kernels against the CPU reference on the same inputs: every quantisation
// op bit for bit (codes and scales) at awkward and at model shapes, outputs poisoned first (0xFF, an e4m3
// NaN no conversion produces); swiglu_quant bit for bit against the GPU's own activation + quantisation
// and within one e4m3 step of the CPU; the portable FP8 grouped GEMM and the Hopper CUTLASS one against a
// float64 reference (ragged groups, empty / 1-row / tile-edge experts, padding rows, widths that are not
// multiples of 128, both tile configurations), determinism, replay of a captured graph after the offsets
// change on the device, and TFLOP/s beside the bf16 kernel on MoE shapes (printed, not asserted).
// Skips, saying why, without a GPU; the sm90 tests also on a GPU other than cc 9.0 or without CUTLASS.
#include "test_fp8_ref.h"

#ifdef MOE8_WITH_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/fp8.h"
#include "cuda/grouped_gemm_fp8_sm90.h"
#include "cuda/grouped_gemm_sm90.h"
#include "cuda/ops.h"
#include "test_cuda_util.h"

namespace moe8::test {
namespace {

const DType kFloatTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

int64_t kb(int64_t k) { return (k + 127) / 128; }
HostTensor u8(const Shape& s) { return HostTensor(DType::kU8, s); }
HostTensor f32(const Shape& s) { return HostTensor(DType::kF32, s); }

// Values with magnitudes varying by row, so scales differ block to block.
HostTensor spread(DType dt, const Shape& s, Rng& rng) {
  HostTensor t(dt, s);
  const int64_t K = s.back();
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, rng.normal() * std::ldexp(1.0, static_cast<int>((i / K) % 9) - 4));
  return t;
}

::testing::AssertionResult same(const HostTensor& gpu, const HostTensor& cpu, const std::string& what) {
  if (gpu.bitwise_equal(cpu)) return ::testing::AssertionSuccess();
  int64_t bad = 0;
  std::ostringstream os;
  const size_t esz = dtype_size(gpu.dtype());
  for (int64_t i = 0; i < gpu.numel(); ++i)
    if (std::memcmp(static_cast<const char*>(gpu.data()) + i * esz, static_cast<const char*>(cpu.data()) + i * esz,
                    esz) != 0 &&
        bad++ < 8)
      os << "\n  [" << i << "] gpu " << gpu.get(i) << " cpu " << cpu.get(i);
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << gpu.numel() << " differ" << os.str();
}

// ------------------------------------------------------------------------------------ quantisation

TEST_F(CudaTest, QuantRowsMatchCpuBitExact) {
  struct RK {
    int64_t R, K;
  };
  // 2880: 16-byte loads with a half block at the end of each row (GPT-OSS widths)
  const RK shapes[] = {{1, 1}, {5, 129}, {17, 300}, {0, 64}, {3, 6}, {1024, 7168}, {257, 2048}, {9, 2880}};
  Rng rng(100);
  for (DType dt : kFloatTypes)
    for (RK s : shapes) {
      SCOPED_TRACE(std::string(name_of(dt)) + " " + shape_str({s.R, s.K}));
      HostTensor x = spread(dt, {s.R, s.K}, rng);
      auto run = [&](bool gpu, HostTensor& q, HostTensor& sc) {
        Runner r(gpu);
        api::quantize_rows_1x128(r.in(x), absent(), 1, r.out(q), r.out(sc), 0);
        r.finish();
      };
      HostTensor qg = u8({s.R, s.K}), sg = f32({s.R, kb(s.K)}), qc = qg, sc = sg;
      run(true, qg, sg);
      run(false, qc, sc);
      EXPECT_TRUE(same(qg, qc, "q"));
      EXPECT_TRUE(same(sg, sc, "scale"));
    }
}

// Rows gathered from src (row_to_slot), and token-major with slot_to_row given (the scatter kernel for
// k <= 8, the gather kernel past it): the CPU's gathered rows bit for bit, padding rows zero with scale 1,
// slots that no row takes (slot_to_row -1) left out.
TEST_F(CudaTest, PermuteQuantMatchesCpuBitExact) {
  Rng rng(101);
  for (DType dt : kFloatTypes)
    for (int64_t H : {200, 2048, 7168})
      for (int k : {1, 4, 8, 9}) {
        SCOPED_TRACE(std::string(name_of(dt)) + " H " + std::to_string(H) + " k " + std::to_string(k));
        const int T = 300;
        HostTensor src = spread(dt, {T, H}, rng);
        std::vector<int> r2s;
        for (int s = 0; s < T * k; ++s) {
          const int slot = (s * 7919) % (T * k);    // a permutation of the slots
          if (slot % 53 != 5) r2s.push_back(slot);  // some slots dropped
          if (s % 37 == 0) r2s.push_back(-1);       // padding rows
        }
        std::vector<int> s2r(T * k, -1);
        for (size_t r = 0; r < r2s.size(); ++r)
          if (r2s[r] >= 0) s2r[r2s[r]] = static_cast<int>(r);
        HostTensor idx = ints({static_cast<int64_t>(r2s.size())}, r2s), inv = ints({T * k}, s2r);
        const int64_t R = idx.numel();
        auto run = [&](bool gpu, bool token_major, HostTensor& q, HostTensor& sc) {
          Runner r(gpu);
          api::quantize_rows_1x128(r.in(src), r.in(idx), k, r.out(q), r.out(sc), 0, true,
                                   token_major ? r.in(inv) : absent());
          r.finish();
        };
        HostTensor qc = u8({R, H}), sc = f32({R, kb(H)});
        run(false, false, qc, sc);
        for (bool token_major : {false, true}) {
          HostTensor qg = u8({R, H}), sg = f32({R, kb(H)});
          run(true, token_major, qg, sg);
          const std::string how = token_major ? "token-major" : "gathered";
          EXPECT_TRUE(same(qg, qc, how + " q"));
          EXPECT_TRUE(same(sg, sc, how + " scale"));
        }
      }
}

TEST_F(CudaTest, QuantWeightMatchesCpuBitExact) {
  Rng rng(102);
  const Shape shapes[] = {{2, 130, 260}, {3, 1, 5}, {1, 257, 129}, {8, 512, 1024}, {2, 3, 6}};
  for (DType dt : kFloatTypes)
    for (const Shape& s : shapes) {
      SCOPED_TRACE(std::string(name_of(dt)) + " " + shape_str(s));
      HostTensor w = spread(dt, s, rng);
      auto run = [&](bool gpu, HostTensor& q, HostTensor& sc, HostTensor* qt, HostTensor* sct) {
        Runner r(gpu);
        if (qt)
          api::quantize_weight_128x128(r.in(w), r.out(q), r.out(sc), 0, r.out(*qt), r.out(*sct));
        else
          api::quantize_weight_128x128(r.in(w), r.out(q), r.out(sc), 0);
        r.finish();
      };
      HostTensor qg = u8(s), sg = f32({s[0], kb(s[1]), kb(s[2])}), qc = qg, sc = sg;
      run(true, qg, sg, nullptr, nullptr);
      run(false, qc, sc, nullptr, nullptr);
      EXPECT_TRUE(same(qg, qc, "q"));
      EXPECT_TRUE(same(sg, sc, "scale"));
      // With the other layout from the same pass (staged in shared memory, written transposed).
      HostTensor qtg = u8({s[0], s[2], s[1]}), stg = f32({s[0], kb(s[2]), kb(s[1])}), qtc = qtg, stc = stg;
      HostTensor qg2 = qg, sg2 = sg, qc2 = qc, sc2 = sc;
      run(true, qg2, sg2, &qtg, &stg);
      run(false, qc2, sc2, &qtc, &stc);
      EXPECT_TRUE(same(qg2, qc, "q (pair)"));
      EXPECT_TRUE(same(qtg, qtc, "q_t"));
      EXPECT_TRUE(same(stg, stc, "scale_t"));
      // The other layout alone (q and scale left out): the same codes and scales as the pair's.
      HostTensor qt1 = u8({s[0], s[2], s[1]}), st1 = f32({s[0], kb(s[2]), kb(s[1])});
      {
        Runner r(true);
        api::quantize_weight_128x128(r.in(w), absent(), absent(), 0, r.out(qt1), r.out(st1));
        r.finish();
      }
      EXPECT_TRUE(same(qt1, qtc, "q_t alone"));
      EXPECT_TRUE(same(st1, stc, "scale_t alone"));
    }
}

TEST_F(CudaTest, QuantColsMatchesCpuBitExact) {
  struct ColCase {
    const char* name;
    std::vector<int> counts;
    int64_t tail, K;
  };
  std::vector<int> many(64);
  for (int e = 0; e < 64; ++e) many[e] = (e * 37) % 300;
  const ColCase cases[] = {
      {"ragged", {0, 1, 127, 128, 129, 300, 0}, 5, 70},
      {"all_empty", {0, 0, 0}, 9, 65},
      {"padded_to_128", {128, 0, 256, 128}, 0, 2048},
      {"tail_only", {0}, 300, 8},
      {"many_groups_unaligned_rows", many, 3, 130},
      {"odd_rows", {3, 5}, 1, 1},
      // K a multiple of 8: the packed kernel for 2-byte x (a partial 128-column tile in the first two)
      {"ragged_packed", {0, 1, 127, 128, 129, 300, 0}, 5, 136},
      {"many_groups_packed", many, 3, 264},
      {"odd_rows_packed", {3, 5}, 1, 8},
      {"wide_packed", {128, 129}, 2, 1024},
  };
  Rng rng(103);
  // Both kernels where both apply (MOE8_QUANT_COLS), each against the CPU.
  for (const char* kernel : {"packed", "staged"})
    for (DType dt : kFloatTypes)
      for (const ColCase& c : cases) {
        SCOPED_TRACE(std::string(c.name) + " " + name_of(dt) + " MOE8_QUANT_COLS=" + kernel);
        set_override("MOE8_QUANT_COLS", kernel);
        const std::vector<int> off = offsets_of(c.counts);
        const int64_t R = off.back() + c.tail, E = static_cast<int64_t>(c.counts.size());
        const int64_t NB = api::col_scale_blocks(R, static_cast<int>(E));
        HostTensor x = spread(dt, {R, c.K}, rng), offs = ints({E + 1}, off);
        auto run = [&](bool gpu, HostTensor& q, HostTensor& sc) {
          Runner r(gpu);
          api::quantize_cols_1x128(r.in(x), r.in(offs), r.out(q), r.out(sc), 0);
          r.finish();
        };
        HostTensor qg = u8({c.K, R}), sg = f32({NB, c.K}), qc = qg, sc = sg;
        run(true, qg, sg);
        run(false, qc, sc);
        EXPECT_TRUE(same(qg, qc, "q_t"));
        EXPECT_TRUE(same(sg, sc, "scale"));
      }
  set_override("MOE8_QUANT_COLS", nullptr);
}

TEST_F(CudaTest, RowwiseTensorwiseDequantizeMatchCpuBitExact) {
  Rng rng(104);
  const Shape shapes[] = {{5, 300}, {2, 3, 7}, {1, 1}, {64, 100000}};
  for (DType dt : kFloatTypes)
    for (const Shape& s : shapes) {
      SCOPED_TRACE(std::string(name_of(dt)) + " " + shape_str(s));
      HostTensor x = spread(dt, s, rng);
      const Shape ss(s.begin(), s.end() - 1);
      auto rowwise = [&](bool gpu, HostTensor& q, HostTensor& sc) {
        Runner r(gpu);
        api::quantize_rowwise(r.in(x), r.out(q), r.out(sc), 0);
        r.finish();
      };
      auto tensorwise = [&](bool gpu, HostTensor& q, HostTensor& sc) {
        Runner r(gpu);
        api::quantize_tensorwise(r.in(x), r.out(q), r.out(sc), 0);
        r.finish();
      };
      HostTensor qg = u8(s), sg = f32(ss), qc = qg, sc = sg;
      rowwise(true, qg, sg);
      rowwise(false, qc, sc);
      EXPECT_TRUE(same(qg, qc, "rowwise q"));
      EXPECT_TRUE(same(sg, sc, "rowwise scale"));
      HostTensor tg = u8(s), tsg = f32({1}), tc = tg, tsc = tsg;
      tensorwise(true, tg, tsg);
      tensorwise(false, tc, tsc);
      EXPECT_TRUE(same(tg, tc, "tensorwise q"));
      EXPECT_TRUE(same(tsg, tsc, "tensorwise scale"));
      if (s.size() != 2) continue;
      // Dequantise the rowwise result as [M, K] blocks of 1 x K (scale viewed as [M, 1]).
      HostTensor scale2 = f32({s[0], 1});
      std::memcpy(scale2.data(), sc.data(), sc.nbytes());
      auto deq = [&](bool gpu, HostTensor& out) {
        Runner r(gpu);
        api::dequantize(r.in(qc), r.in(scale2), 1, s[1], r.out(out), 0);
        r.finish();
      };
      HostTensor og(dt, s), oc(dt, s);
      deq(true, og);
      deq(false, oc);
      EXPECT_TRUE(same(og, oc, "dequantize"));
    }
}

TEST_F(CudaTest, BlockwiseDequantizeMatchesCpuBitExact) {
  // Codes (every finite e4m3 pattern) times their block's scale: 128 x 128 blocks of [E, N, K] weights and 1 x K
  // rows. K a multiple of 16 takes the kernel's 16-codes-a-thread path (whole and partial last blocks, rows not
  // a multiple of 128), the other K the per-element one.
  Rng rng(106);
  struct Case {
    Shape s;
    int64_t bm, bk;
  };
  const Case cases[] = {{{2, 256, 384}, 128, 128}, {{3, 200, 144}, 128, 128}, {{1, 16}, 128, 128},
                        {{5, 130, 136}, 128, 128}, {{4, 7, 48}, 1, 48},       {{2, 100, 200}, 128, 128},
                        {{3, 5, 24}, 128, 128}};
  for (DType dt : kFloatTypes)
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(name_of(dt)) + " " + shape_str(c.s) + " blocks " + std::to_string(c.bm) + "x" +
                   std::to_string(c.bk));
      HostTensor q = u8(c.s);
      for (int64_t i = 0; i < q.numel(); ++i) {
        const int v = rng.randint(0, 256);
        q.set(i, (v & 0x7F) == 0x7F ? v ^ 1 : v);  // no NaN codes
      }
      const int64_t M = c.s[c.s.size() - 2], K = c.s.back();
      Shape ss(c.s.begin(), c.s.end() - 2);
      ss.push_back((M + c.bm - 1) / c.bm);
      ss.push_back((K + c.bk - 1) / c.bk);
      HostTensor scale = random_tensor(DType::kF32, ss, rng, 0.01, 4.0);
      auto deq = [&](bool gpu, HostTensor& out) {
        Runner r(gpu);
        api::dequantize(r.in(q), r.in(scale), c.bm, c.bk, r.out(out), 0);
        r.finish();
      };
      HostTensor og(dt, c.s), oc(dt, c.s);
      deq(true, og);
      deq(false, oc);
      EXPECT_TRUE(same(og, oc, "dequantize"));
    }
}

TEST_F(CudaTest, SwigluQuantFusedEqualsActivationThenQuantize) {
  Rng rng(105);
  ActParams ps[5];
  ps[1].interleaved = true;
  ps[2].kind = ActKind::kSwiGLUClamped;
  ps[2].interleaved = true;
  ps[3].kind = ActKind::kSiLU;
  ps[4].kind = ActKind::kGELU;
  struct RI {
    int64_t R, I;
  };
  const RI shapes[] = {{7, 300}, {1, 1}, {3, 6}, {512, 768}, {5, 2880}};  // 2880: vector loads, half last block
  for (DType dt : kFloatTypes)
    for (const ActParams& p : ps)
      for (RI s : shapes) {
        SCOPED_TRACE(std::string(name_of(dt)) + " kind " + std::to_string(int(p.kind)) + " " + shape_str({s.R, s.I}));
        HostTensor h = random_tensor(dt, {s.R, is_gated(p.kind) ? 2 * s.I : s.I}, rng, -8, 8);
        auto fused = [&](bool gpu, HostTensor& q, HostTensor& sc) {
          Runner r(gpu);
          api::swiglu_quant(r.in(h), p, r.out(q), r.out(sc), 0);
          r.finish();
        };
        HostTensor qg = u8({s.R, s.I}), sg = f32({s.R, kb(s.I)}), qc = qg, sc = sg;
        fused(true, qg, sg);
        fused(false, qc, sc);
        // GPU: fused == activation_forward then quantize_rows_1x128, both on the GPU, bit for bit.
        HostTensor act(dt, {s.R, s.I});
        {
          Runner r(true);
          api::activation_forward(r.in(h), p, r.out(act), 0);
          r.finish();
        }
        HostTensor q2 = qg, s2 = sg;
        {
          Runner r(true);
          api::quantize_rows_1x128(r.in(act), absent(), 1, r.out(q2), r.out(s2), 0);
          r.finish();
        }
        EXPECT_TRUE(same(qg, q2, "fused vs separate q"));
        EXPECT_TRUE(same(sg, s2, "fused vs separate scale"));
        // Against the CPU: expf / erff differ from the CPU's libm by ulps, so codes may differ by one step.
        int64_t off_by_one = 0;
        for (int64_t i = 0; i < qg.numel(); ++i) {
          const int a = bytes(qg)[i], b = bytes(qc)[i];
          const bool same_sign = (a & 0x80) == (b & 0x80) || (a & 0x7F) == 0 || (b & 0x7F) == 0;
          ASSERT_TRUE(same_sign && std::abs((a & 0x7F) - (b & 0x7F)) <= 1)
              << "element " << i << ": gpu 0x" << std::hex << a << " cpu 0x" << b;
          off_by_one += a != b;
        }
        EXPECT_LE(off_by_one, qg.numel() / 50 + 2) << "too many codes differ from the CPU";
        // Scales: the activations are rounded to dt before the amax, so a last-ulp difference can become one
        // ulp of dt.
        const double rel = std::max(2 * out_rel(dt), 1e-5);
        for (int64_t i = 0; i < sg.numel(); ++i)
          ASSERT_NEAR(floats(sg)[i], floats(sc)[i], rel * std::fabs(floats(sc)[i])) << "scale " << i;
      }
}

// ------------------------------------------------------------------------------------ FP8 grouped GEMM

// A quantised problem made directly from codes: a [R, K] and b [E, N, K] e4m3 with positive scales
// around 1/448 (values of order 1), offsets from counts.
struct Fp8Problem {
  std::vector<int> off;
  int64_t R, N, K, E;
  HostTensor a, sa, b, sb, offs;
  Fp8Problem(const std::vector<int>& counts, int64_t tail, int64_t n, int64_t k, uint64_t seed)
      : off(offsets_of(counts)), N(n), K(k), E(static_cast<int64_t>(counts.size())) {
    R = off.back() + tail;
    Rng rng(seed);
    a = codes({R, K}, seed * 3 + 1);
    b = codes({E, N, K}, seed * 3 + 2);
    sa = random_tensor(DType::kF32, {R, kb(K)}, rng, 0.5 / 448, 2.0 / 448);
    sb = random_tensor(DType::kF32, {E, kb(N), kb(K)}, rng, 0.5 / 448, 2.0 / 448);
    offs = ints({E + 1}, off);
  }
  // e4m3 codes of uniform values in [-448, 448) (xorshift: the model shapes hold ~1e8 codes).
  static HostTensor codes(const Shape& s, uint64_t seed) {
    HostTensor t(DType::kU8, s);
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
    uint8_t* p = static_cast<uint8_t*>(t.data());
    for (int64_t i = 0; i < t.numel(); ++i) {
      x ^= x >> 12;
      x ^= x << 25;
      x ^= x >> 27;
      const float f = static_cast<float>((x * 0x2545F4914F6CDD1Dull) >> 40) / 8388608.0f - 1.0f;
      p[i] = float_to_e4m3(448.0f * f);
    }
    return t;
  }
};

// c (bf16 or f32) against float64 over the rows of `rows` (all rows when empty); padding rows exactly 0.
// Per element: output rounding plus 2^-8 of the sum of |products| (the tensor cores accumulate FP8
// products with ~14 bits inside each 128-block, which bounds what a correct kernel can be off by); and
// normwise within 1% (systematic errors: a wrong scale block, a shifted row).
::testing::AssertionResult check_fp8_gemm(const Fp8Problem& p, const HostTensor& c, int per_group) {
  int64_t bad = 0, checked = 0;
  double err2 = 0, norm2 = 0;
  std::ostringstream os;
  const int64_t KB = kb(p.K), NB = kb(p.N);
  std::vector<double> x(p.K);
  for (int64_t e = 0; e < p.E; ++e) {
    const int64_t r0 = p.off[e], n_rows = p.off[e + 1] - r0;
    std::vector<int64_t> rows;
    if (per_group <= 0 || n_rows <= per_group)
      for (int64_t r = r0; r < r0 + n_rows; ++r) rows.push_back(r);
    else
      for (int i = 0; i < per_group; ++i) rows.push_back(r0 + (n_rows - 1) * i / (per_group - 1));
    for (int64_t r : rows) {
      for (int64_t k = 0; k < p.K; ++k) x[k] = e4m3_ref_value(bytes(p.a)[r * p.K + k]) * floats(p.sa)[r * KB + k / 128];
      for (int64_t n = 0; n < p.N; ++n, ++checked) {
        const uint8_t* w = bytes(p.b) + (e * p.N + n) * p.K;
        const float* ws = floats(p.sb) + (e * NB + n / 128) * KB;
        double acc = 0, mag = 0;
        for (int64_t k = 0; k < p.K; ++k) {
          const double t = x[k] * e4m3_ref_value(w[k]) * ws[k / 128];
          acc += t;
          mag += std::fabs(t);
        }
        const double got = c.get(r * p.N + n);
        const double tol = out_rel(c.dtype()) * std::fabs(acc) + std::ldexp(mag, -8) + 1e-6;
        err2 += (got - acc) * (got - acc);
        norm2 += acc * acc;
        if (!(std::fabs(got - acc) <= tol) && bad++ < 8)
          os << "\n  row " << r << " (expert " << e << ") col " << n << ": got " << got << " want " << acc;
      }
    }
  }
  for (int64_t i = p.off.back() * p.N; i < p.R * p.N; ++i, ++checked)
    if (c.get(i) != 0.0 && bad++ < 8) os << "\n  padding element " << i << " not zero: " << c.get(i);
  if (norm2 > 0 && std::sqrt(err2 / norm2) > 1e-2 && bad++ < 8)
    os << "\n  normwise relative error " << std::sqrt(err2 / norm2) << " > 1e-2";
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << checked << " checked elements off" << os.str();
}

struct GemmCase {
  const char* name;
  std::vector<int> counts;
  int64_t tail, N, K;
  int rows_per_group;  // rows checked per group (0: all)
};

std::vector<GemmCase> gemm_cases() {
  return {
      // R / E > 128: the 128x128 cooperative tile; empty, 1-row and tile-edge experts, padding rows; N = 384
      // is 3 tiles wide (odd: the unclustered tile), N = 256 two (the 1x2 cluster)
      {"ragged_large_tile", {0, 1, 127, 128, 129, 300, 0, 1000}, 5, 384, 256, 0},
      {"ragged_large_tile_clustered", {0, 1, 127, 128, 129, 300, 0, 1000}, 5, 256, 256, 0},
      // few rows per expert: the 64x128 ping-pong tile
      {"ragged_small_tile", {0, 1, 63, 64, 65, 100, 0, 7}, 3, 384, 256, 0},
      // N, K not multiples of 128 (N % 8 == 0, K % 16 == 0 for the TMA rows)
      {"odd_widths", {33, 0, 250, 17}, 0, 136, 208, 0},
      // balanced 128 experts x 64 rows, Qwen3-MoE gate_up widths
      {"balanced_128x64_qwen3", std::vector<int>(128, 64), 0, 1536, 2048, 3},
  };
}

TEST_F(CudaTest, GroupedGemmFp8PortableMatchesReference) {
  uint64_t seed = 200;
  for (const GemmCase& gc : gemm_cases()) {
    if (gc.rows_per_group > 0) continue;  // the portable kernel is slow; small cases only
    Fp8Problem p(gc.counts, gc.tail, gc.N, gc.K, ++seed);
    for (DType dt : kFloatTypes) {
      SCOPED_TRACE(std::string(gc.name) + " " + name_of(dt));
      HostTensor c(dt, {p.R, p.N});
      Runner r(true);
      api::grouped_gemm_fp8(r.in(p.a), r.in(p.sa), r.in(p.b), r.in(p.sb), r.in(p.offs), r.out(c), 0);
      r.finish();
      EXPECT_TRUE(check_fp8_gemm(p, c, 0));
    }
  }
}

// Skips unless the sm90 FP8 path can run here: a GPU, compute capability 9.0, moe8 built with CUTLASS.
class Sm90Fp8Test : public CudaTest {
 protected:
  void SetUp() override {
    CudaTest::SetUp();
    if (IsSkipped()) return;
    DeviceBuffer probe(256);
    TensorView a = make_view(probe.get(), DType::kU8, {16, 16}, DeviceType::kCUDA);
    TensorView b = make_view(probe.get(), DType::kU8, {1, 16, 16}, DeviceType::kCUDA);
    TensorView c = make_view(probe.get(), DType::kBF16, {16, 16}, DeviceType::kCUDA);
    if (!cuda::grouped_gemm_fp8_sm90_supported(a, b, c)) {
      cudaDeviceProp prop{};
      cudaGetDeviceProperties(&prop, 0);
      GTEST_SKIP() << "sm90 FP8 grouped GEMM unsupported here (device " << prop.name << ", cc " << prop.major << "."
                   << prop.minor << "; needs cc 9.0 and moe8 built with CUTLASS, see cmake/cutlass.cmake)";
    }
  }
};

// Runs the sm90 kernel directly (no API checks) on device copies; returns c [R, N] bf16.
struct DeviceFp8 {
  explicit DeviceFp8(const Fp8Problem& p)
      : p(p),
        a(p.a.nbytes()),
        sa(p.sa.nbytes()),
        b(p.b.nbytes()),
        sb(p.sb.nbytes()),
        offs(p.offs.nbytes()),
        ws_bytes(cuda::grouped_gemm_fp8_sm90_workspace_bytes(static_cast<int>(p.E))),
        ws(ws_bytes),
        c(p.R * p.N * 2) {
    for (auto [dst, src] : {std::make_pair(&a, &p.a), std::make_pair(&sa, &p.sa), std::make_pair(&b, &p.b),
                            std::make_pair(&sb, &p.sb), std::make_pair(&offs, &p.offs)})
      cuda_ok(cudaMemcpy(dst->get(), src->data(), src->nbytes(), cudaMemcpyHostToDevice), "upload");
  }
  const Fp8Problem& p;
  DeviceBuffer a, sa, b, sb, offs;
  size_t ws_bytes;
  DeviceBuffer ws, c;

  void launch(cudaStream_t s) {
    auto v = [](const DeviceBuffer& d, DType t, std::initializer_list<int64_t> shape) {
      return make_view(d.get(), t, shape, DeviceType::kCUDA);
    };
    cuda::grouped_gemm_fp8_sm90(v(a, DType::kU8, {p.R, p.K}), v(sa, DType::kF32, {p.R, kb(p.K)}),
                                v(b, DType::kU8, {p.E, p.N, p.K}), v(sb, DType::kF32, {p.E, kb(p.N), kb(p.K)}),
                                v(offs, DType::kI32, {p.E + 1}), v(c, DType::kBF16, {p.R, p.N}), ws.get(), ws_bytes, s);
  }
  HostTensor run() {
    cuda_ok(cudaMemset(c.get(), 0xFF, p.R * p.N * 2), "poison");
    launch(nullptr);
    return download();
  }
  HostTensor download() {
    HostTensor out(DType::kBF16, {p.R, p.N});
    cuda_ok(cudaDeviceSynchronize(), "synchronize after the op");
    cuda_ok(cudaMemcpy(out.data(), c.get(), out.nbytes(), cudaMemcpyDeviceToHost), "download");
    return out;
  }
};

void fp8_forward_matches_reference(uint64_t seed) {
  for (const GemmCase& gc : gemm_cases()) {
    SCOPED_TRACE(gc.name);
    Fp8Problem p(gc.counts, gc.tail, gc.N, gc.K, ++seed);
    DeviceFp8 d(p);
    HostTensor c = d.run();
    EXPECT_TRUE(check_fp8_gemm(p, c, gc.rows_per_group));
    EXPECT_TRUE(c.bitwise_equal(d.run())) << "two runs differ";
  }
}

TEST_F(Sm90Fp8Test, MatchesReference) { fp8_forward_matches_reference(300); }

TEST_F(Sm90Fp8Test, ApiPicksTheHopperPath) {
  // Through the API with a workspace (the sm90 kernel) and without (the portable one): both within the
  // reference's bounds of each other's reference.
  Fp8Problem p({0, 40, 200, 3}, 2, 256, 384, 400);
  const int64_t ws = api::grouped_gemm_fp8_workspace_bytes(static_cast<int>(p.E), true);
  ASSERT_GT(ws, 0);
  HostTensor wsh(DType::kU8, {ws});
  for (bool with_ws : {true, false}) {
    HostTensor c(DType::kBF16, {p.R, p.N});
    Runner r(true);
    api::grouped_gemm_fp8(r.in(p.a), r.in(p.sa), r.in(p.b), r.in(p.sb), r.in(p.offs), r.out(c), 0, true,
                          with_ws ? r.in(wsh) : absent());
    r.finish();
    EXPECT_TRUE(check_fp8_gemm(p, c, 0)) << (with_ws ? "sm90" : "portable");
  }
}

// quantize_grouped_gemm_fp8 on the GPU: the two calls it replaces on the GPU (quantize_rows_1x128, then
// grouped_gemm_fp8), bit for bit, through the sm90 kernel (a workspace given, where this GPU has the path) and
// the portable one (none); rows as given and gathered from tokens with padding rows; c and the scratch poisoned.
TEST_F(CudaTest, QuantizeGroupedGemmIsTheTwoCallsBitExact) {
  struct QCase {
    const char* name;
    std::vector<int> counts;
    int64_t tail, N, K;
  };
  const QCase cases[] = {
      {"ragged_sm90_shapes", {0, 40, 200, 3}, 2, 256, 384},
      {"k_not_multiple_of_16", {7, 9}, 1, 24, 200},
      {"one_group", {1}, 0, 64, 128},
  };
  Rng rng(900);
  for (const QCase& qc : cases)
    for (bool gathered : {false, true}) {
      const std::vector<int> off = offsets_of(qc.counts);
      const int64_t R = off.back() + qc.tail, E = static_cast<int64_t>(qc.counts.size());
      const int k = 2;
      const int64_t T = (R + 1) / 2;
      HostTensor x = spread(DType::kBF16, {gathered ? T : R, qc.K}, rng);
      std::vector<int> r2s(R);
      for (int64_t r = 0; r < R; ++r) r2s[r] = r % 5 == 3 ? -1 : static_cast<int>((r * 7) % (T * k));
      HostTensor rows = ints({R}, r2s), offs = ints({E + 1}, off);
      HostTensor w = spread(DType::kBF16, {E, qc.N, qc.K}, rng);
      HostTensor b = u8({E, qc.N, qc.K}), sb = f32({E, kb(qc.N), kb(qc.K)});
      api::quantize_weight_128x128(w.view(), b.view(), sb.view(), 0);
      const int64_t ws = api::grouped_gemm_fp8_workspace_bytes(static_cast<int>(E), true);
      HostTensor wsh(DType::kU8, {std::max<int64_t>(ws, 1)});
      for (bool with_ws : {true, false}) {
        if (with_ws && ws == 0) continue;  // no sm90 path on this GPU or build
        SCOPED_TRACE(std::string(qc.name) + (gathered ? " gathered" : "") + (with_ws ? " sm90" : " portable"));
        HostTensor a = u8({R, qc.K}), sa = f32({R, kb(qc.K)}), want(DType::kBF16, {R, qc.N});
        HostTensor got(DType::kBF16, {R, qc.N}), scratch = u8({api::quantize_grouped_gemm_fp8_scratch_bytes(R, qc.K)});
        Runner r(true);
        const TensorView xv = r.in(x), r2sv = gathered ? r.in(rows) : absent(), bv = r.in(b), sbv = r.in(sb);
        const TensorView offv = r.in(offs), wsv = with_ws ? r.in(wsh) : absent();
        const TensorView av = r.out(a), sav = r.out(sa);
        api::quantize_rows_1x128(xv, r2sv, k, av, sav, 0);
        api::grouped_gemm_fp8(av, sav, bv, sbv, offv, r.out(want), 0, true, wsv);
        api::quantize_grouped_gemm_fp8(xv, r2sv, k, absent(), bv, sbv, offv, r.out(scratch), r.out(got), 0, true, wsv);
        r.finish();
        EXPECT_TRUE(same(got, want, "fused against the two calls"));
        for (int64_t i = 0; i < got.numel(); ++i) ASSERT_FALSE(std::isnan(got.get(i))) << "c[" << i << "] not written";
      }
    }
}

// The FP8 weight gradient: codes and scales as quantize_cols_1x128 lays them out (q_t [N, R], [K, R];
// scale [NBLK, N], [NBLK, K], blocks expert by expert), the sm90 kernel (bf16) against the CPU reference
// (float32 from a float64 sum): per element within bf16 rounding plus 2^-8 of the sum of |products| (FP8
// accumulation inside a block, as check_fp8_gemm allows), normwise within 1e-2; an expert without rows gets
// zeros.
void fp8_wgrad_matches_cpu_reference(uint64_t seed) {
  struct WCase {
    const char* name;
    std::vector<int> counts;  // multiples of 16, as the kernel needs
    int64_t tail, N, K;
  };
  const WCase wcases[] = {
      {"ragged_with_empty", {0, 16, 128, 272, 0, 48, 160}, 16, 136, 264},
      {"qwen3_down_like", {256, 256, 256, 256}, 0, 512, 384},
  };
  for (const WCase& wc : wcases) {
    SCOPED_TRACE(wc.name);
    const std::vector<int> off = offsets_of(wc.counts);
    const int64_t R = off.back() + wc.tail, E = static_cast<int64_t>(wc.counts.size());
    const int64_t NBLK = col_scale_blocks(R, E);
    Rng rng(++seed);
    HostTensor dc_t = Fp8Problem::codes({wc.N, R}, seed * 5 + 1), a_t = Fp8Problem::codes({wc.K, R}, seed * 5 + 2);
    HostTensor sd = random_tensor(DType::kF32, {NBLK, wc.N}, rng, 0.5 / 448, 2.0 / 448);
    HostTensor sa = random_tensor(DType::kF32, {NBLK, wc.K}, rng, 0.5 / 448, 2.0 / 448);
    HostTensor offs = ints({E + 1}, off);
    HostTensor want(DType::kF32, {E, wc.N, wc.K});
    Runner cpu(false);
    api::grouped_gemm_fp8_wgrad(cpu.in(dc_t), cpu.in(sd), cpu.in(a_t), cpu.in(sa), cpu.in(offs), cpu.out(want), 0);
    // sum over the rows of |products| per element: what FP8 accumulation inside a block can be off by
    std::vector<double> mag(static_cast<size_t>(E * wc.N * wc.K), 0.0);
    for (int64_t e = 0, block0 = 0; e < E; block0 += kb(off[e + 1] - off[e]), ++e)
      for (int64_t n = 0; n < wc.N; ++n)
        for (int64_t k = 0; k < wc.K; ++k) {
          double m = 0;
          for (int64_t r = off[e]; r < off[e + 1]; ++r)
            m += std::fabs(e4m3_ref_value(bytes(dc_t)[n * R + r]) * e4m3_ref_value(bytes(a_t)[k * R + r]) *
                           floats(sd)[(block0 + (r - off[e]) / 128) * wc.N + n] *
                           floats(sa)[(block0 + (r - off[e]) / 128) * wc.K + k]);
          mag[(e * wc.N + n) * wc.K + k] = m;
        }
    const int64_t ws = api::grouped_gemm_fp8_wgrad_workspace_bytes(static_cast<int>(E), true);
    ASSERT_GT(ws, 0);
    HostTensor wsh(DType::kU8, {ws});
    HostTensor got(DType::kBF16, {E, wc.N, wc.K});
    Runner gpu(true);
    api::grouped_gemm_fp8_wgrad(gpu.in(dc_t), gpu.in(sd), gpu.in(a_t), gpu.in(sa), gpu.in(offs), gpu.out(got), 0, true,
                                gpu.in(wsh));
    gpu.finish();
    int64_t bad = 0;
    double err2 = 0, norm2 = 0;
    for (int64_t i = 0; i < want.numel(); ++i) {
      const double w = want.get(i), g = got.get(i);
      err2 += (g - w) * (g - w);
      norm2 += w * w;
      if (!(std::fabs(g - w) <= std::ldexp(std::fabs(w), -8) + std::ldexp(mag[i], -8) + 1e-6) && bad++ < 8)
        ADD_FAILURE() << "db[" << i << "]: got " << g << " want " << w;
    }
    EXPECT_EQ(bad, 0);
    EXPECT_LT(std::sqrt(err2 / std::max(norm2, 1e-30)), 1e-2);
    for (int64_t e = 0; e < E; ++e)
      if (wc.counts[e] == 0)
        for (int64_t i = 0; i < wc.N * wc.K; ++i) ASSERT_EQ(got.get(e * wc.N * wc.K + i), 0.0) << "empty expert " << e;
  }
}

TEST_F(Sm90Fp8Test, WgradMatchesCpuReference) { fp8_wgrad_matches_cpu_reference(800); }

// Every configuration MOE8_SM90_FP8_TILE can force (the FP8 tile sweep's candidates), forward and wgrad.
TEST_F(Sm90Fp8Test, ForcedTilesMatchReference) {
  for_each_forced("MOE8_SM90_FP8_TILE", {"large", "solo", "m2", "small"}, 900, [](uint64_t seed) {
    fp8_forward_matches_reference(seed);
    fp8_wgrad_matches_cpu_reference(seed + 50);
  });
  set_override("MOE8_SM90_FP8_TILE", "wide");
  Fp8Problem p({64, 200}, 0, 256, 256, 1);
  DeviceFp8 d(p);
  EXPECT_THROW(d.run(), Error);
  set_override("MOE8_SM90_FP8_TILE", nullptr);
}

// The consumers that promote each K tile while the next one's wgmma runs (MOE8_SM90_FP8_PROMOTION=overlap,
// blockwise_promotion_sm90.cuh) give the serial consumers' bits on both tiles that have them, at 1 to 5 K tiles
// (odd and even counts, a partial last tile) and at the ragged shapes of gemm_cases().
TEST_F(Sm90Fp8Test, OverlappedPromotionGivesTheSameBits) {
  uint64_t seed = 1000;
  std::vector<GemmCase> cases = gemm_cases();
  for (int64_t k : {128, 256, 384, 512, 640, 208})
    cases.push_back({"k_tiles", {0, 1, 127, 128, 129, 300, 0, 1000}, 5, 256, k, 0});
  for (const char* tile : {"large", "small"}) {
    set_override("MOE8_SM90_FP8_TILE", tile);
    for (const GemmCase& gc : cases) {
      SCOPED_TRACE(std::string(tile) + " " + gc.name + " K " + std::to_string(gc.K));
      Fp8Problem p(gc.counts, gc.tail, gc.N, gc.K, ++seed);
      DeviceFp8 d(p);
      set_override("MOE8_SM90_FP8_PROMOTION", "serial");
      const HostTensor serial = d.run();
      set_override("MOE8_SM90_FP8_PROMOTION", "overlap");
      const HostTensor overlap = d.run();
      EXPECT_TRUE(check_fp8_gemm(p, overlap, gc.rows_per_group));
      EXPECT_TRUE(serial.bitwise_equal(overlap)) << "overlapped promotion changed the bits";
      EXPECT_TRUE(overlap.bitwise_equal(d.run())) << "two runs differ";
    }
  }
  set_override("MOE8_SM90_FP8_PROMOTION", "eager");
  Fp8Problem p({64, 200}, 0, 256, 256, 1);
  DeviceFp8 d(p);
  EXPECT_THROW(d.run(), Error);
  set_override("MOE8_SM90_FP8_PROMOTION", nullptr);
  set_override("MOE8_SM90_FP8_TILE", nullptr);
}

// An FP8 weight gradient on the GPU: 5 groups of 256, 0, 128, 384 and 512 rows (one empty), N 384, K 256, random
// codes and scales from `seed`; run() under the overrides set at the time.
struct Fp8WgradCase {
  const std::vector<int> off = offsets_of({256, 0, 128, 384, 512});
  const int64_t R = off.back(), E = 5, N = 384, K = 256, NBLK = col_scale_blocks(R, E);
  HostTensor dc_t, a_t, sd, sa, offs = ints({E + 1}, off);
  HostTensor wsh{DType::kU8, {api::grouped_gemm_fp8_wgrad_workspace_bytes(static_cast<int>(E), true)}};
  explicit Fp8WgradCase(uint64_t seed)
      : dc_t(Fp8Problem::codes({N, R}, seed + 1)), a_t(Fp8Problem::codes({K, R}, seed + 2)) {
    Rng rng(seed);
    sd = random_tensor(DType::kF32, {NBLK, N}, rng, 0.5 / 448, 2.0 / 448);
    sa = random_tensor(DType::kF32, {NBLK, K}, rng, 0.5 / 448, 2.0 / 448);
  }
  HostTensor run() const {
    HostTensor got(DType::kBF16, {E, N, K});
    Runner gpu(true);
    api::grouped_gemm_fp8_wgrad(gpu.in(dc_t), gpu.in(sd), gpu.in(a_t), gpu.in(sa), gpu.in(offs), gpu.out(got), 0, true,
                                gpu.in(wsh));
    gpu.finish();
    return got;
  }
};

// The scheduler's tile order (MOE8_SM90_RASTER, MOE8_SM90_SWIZZLE) gives the default's bits, forward and
// weight gradient.
TEST_F(Sm90Fp8Test, SchedulesGiveTheSameBits) {
  Fp8Problem p({0, 40, 200, 3, 700, 129}, 2, 512, 384, 950);
  DeviceFp8 d(p);
  const Fp8WgradCase wg(951);
  auto wgrad = [&] { return wg.run(); };
  const HostTensor fwd0 = d.run(), wgrad0 = wgrad();
  EXPECT_TRUE(check_fp8_gemm(p, fwd0, 0));
  for (const auto& [raster, swizzle] :
       {std::pair<const char*, const char*>{"n", "1"}, {"m", "8"}, {"n", "4"}, {"m", "2"}}) {
    SCOPED_TRACE(std::string("raster ") + raster + ", swizzle " + swizzle);
    set_override("MOE8_SM90_RASTER", raster);
    set_override("MOE8_SM90_SWIZZLE", swizzle);
    EXPECT_TRUE(fwd0.bitwise_equal(d.run()));
    EXPECT_TRUE(wgrad0.bitwise_equal(wgrad()));
  }
  set_override("MOE8_SM90_SWIZZLE", "16");
  EXPECT_THROW(d.run(), Error);
  set_override("MOE8_SM90_RASTER", nullptr);
  set_override("MOE8_SM90_SWIZZLE", nullptr);
}

// D stored through per-group descriptors made before the launch (MOE8_SM90_PREPARED_STORE=1,
// prepared_descriptors_sm90.cuh) or through one ragged descriptor (=ragged, ragged_tma_sm90.cuh) gives CUTLASS's
// rewritten descriptor's bits: the forward on the cooperative and the ping-pong tile at the ragged shapes of
// gemm_cases() but the largest (MatchesReference checks the values), and the weight gradient, with D's descriptor
// acquired before the mainloop or before the store (MOE8_SM90_PREPARED_ACQUIRE).
TEST_F(Sm90Fp8Test, PreparedStoreGivesTheSameBits) {
  uint64_t seed = 1200;
  for (const char* tile : {"large", "small"}) {
    set_override("MOE8_SM90_FP8_TILE", tile);
    for (const GemmCase& gc : gemm_cases()) {
      if (gc.N * gc.K > 1024 * 1024) continue;
      SCOPED_TRACE(std::string(tile) + " " + gc.name);
      Fp8Problem p(gc.counts, gc.tail, gc.N, gc.K, ++seed);
      DeviceFp8 d(p);
      set_override("MOE8_SM90_PREPARED_STORE", "0");
      const HostTensor rewritten = d.run();
      set_override("MOE8_SM90_PREPARED_STORE", "1");
      for (const char* acquire : {"mainloop", "store"}) {
        set_override("MOE8_SM90_PREPARED_ACQUIRE", acquire);
        EXPECT_TRUE(rewritten.bitwise_equal(d.run()))
            << "the prepared store (acquired at the " << acquire << ") changed the bits";
      }
      set_override("MOE8_SM90_PREPARED_ACQUIRE", nullptr);
      set_override("MOE8_SM90_PREPARED_STORE", "ragged");
      EXPECT_TRUE(rewritten.bitwise_equal(d.run())) << "the ragged store changed the bits";
    }
  }
  set_override("MOE8_SM90_FP8_TILE", nullptr);
  const Fp8WgradCase wg(1251);
  auto wgrad = [&](const char* prepared) {
    set_override("MOE8_SM90_PREPARED_STORE", prepared);
    return wg.run();
  };
  const HostTensor rewritten = wgrad("0");
  EXPECT_TRUE(rewritten.bitwise_equal(wgrad("1"))) << "the prepared store changed the weight gradient's bits";
  set_override("MOE8_SM90_PREPARED_ACQUIRE", "store");
  EXPECT_TRUE(rewritten.bitwise_equal(wgrad("1"))) << "acquired at the store: the weight gradient's bits changed";
  set_override("MOE8_SM90_PREPARED_ACQUIRE", nullptr);
  EXPECT_TRUE(rewritten.bitwise_equal(wgrad("ragged"))) << "the ragged store changed the weight gradient's bits";
  set_override("MOE8_SM90_PREPARED_STORE", nullptr);
}

TEST_F(Sm90Fp8Test, AllGroupsEmpty) {
  Fp8Problem p({0, 0, 0}, 9, 64, 32, 500);
  DeviceFp8 d(p);
  EXPECT_TRUE(check_fp8_gemm(p, d.run(), 0));
}

TEST_F(Sm90Fp8Test, CapturedGraphFollowsDeviceOffsets) {
  Fp8Problem p({0, 1, 127, 128, 129, 300, 0, 1000}, 5, 384, 256, 600);
  DeviceFp8 d(p);
  cudaStream_t s;
  cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  cudaGraph_t graph;
  cuda_ok(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "begin capture");
  d.launch(s);
  cuda_ok(cudaStreamEndCapture(s, &graph), "end capture");
  cudaGraphExec_t exec;
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  for (const std::vector<int>& counts :
       {std::vector<int>{500, 0, 3, 200, 1, 0, 700, 281}, std::vector<int>{0, 1, 127, 128, 129, 300, 0, 1000}}) {
    Fp8Problem q = p;  // same data, new offsets
    q.off = offsets_of(counts);
    ASSERT_EQ(q.off.back(), p.off.back());
    cuda_ok(cudaMemcpyAsync(d.offs.get(), q.off.data(), q.off.size() * 4, cudaMemcpyHostToDevice, s), "offsets");
    cuda_ok(cudaMemsetAsync(d.c.get(), 0xFF, p.R * p.N * 2, s), "poison");
    cuda_ok(cudaGraphLaunch(exec, s), "graph launch");
    cuda_ok(cudaStreamSynchronize(s), "graph sync");
    EXPECT_TRUE(check_fp8_gemm(q, d.download(), 0));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

TEST_F(Sm90Fp8Test, SmallWorkspaceIsRejected) {
  Fp8Problem p({4, 4}, 0, 64, 32, 700);
  DeviceFp8 d(p);
  d.ws_bytes -= 1;
  EXPECT_THROW(d.launch(nullptr), Error);
}

// TFLOP/s on MoE forward shapes (useful FLOPs 2 * rows * N * K), median of timed runs, beside the bf16
// sm90 kernel on the same shapes and the 1x128 quantisation of the activations (GB/s).
TEST_F(Sm90Fp8Test, Speed) {
  struct Shape {
    const char* name;
    int E, rows_per_expert;
    int64_t N, K;
  };
  const Shape shapes[] = {
      {"qwen3-30b gate_up 32k rows", 128, 256, 1536, 2048},
      {"qwen3-30b down 32k rows", 128, 256, 2048, 768},
      {"qwen3-30b gate_up 8k rows", 128, 64, 1536, 2048},
      {"mixtral gate_up 8k rows", 8, 1024, 28672, 4096},
      {"mixtral down 8k rows", 8, 1024, 4096, 14336},
      {"deepseek-v3 gate_up, 32 local experts", 32, 256, 4096, 7168},
  };
  std::printf(
      "\n%-28s %9s %9s %9s %7s %12s   (TFLOP/s; fp8 ovl: MOE8_SM90_FP8_PROMOTION=overlap; quantize: 1x128 "
      "of the activation, GB/s)\n",
      "shape", "bf16", "fp8", "fp8 ovl", "ratio", "quantize");
  for (const Shape& sh : shapes) {
    Fp8Problem p(std::vector<int>(sh.E, sh.rows_per_expert), 0, sh.N, sh.K, 800);
    DeviceFp8 d(p);
    const double flops = 2.0 * p.R * p.N * p.K;
    const double fp8 = flops / (median_ms([&] { d.launch(nullptr); }) * 1e-3) / 1e12;
    set_override("MOE8_SM90_FP8_PROMOTION", "overlap");
    const double fp8_overlap = flops / (median_ms([&] { d.launch(nullptr); }) * 1e-3) / 1e12;
    set_override("MOE8_SM90_FP8_PROMOTION", nullptr);
    // bf16 reference kernel on the same shape (values irrelevant for timing).
    DeviceBuffer a16(p.R * p.K * 2), b16(p.E * p.N * p.K * 2), c16(p.R * p.N * 2);
    cuda_ok(cudaMemset(a16.get(), 0, p.R * p.K * 2), "zero");
    cuda_ok(cudaMemset(b16.get(), 0, p.E * p.N * p.K * 2), "zero");
    const size_t ws16 = cuda::grouped_gemm_sm90_workspace_bytes(static_cast<int>(p.E), p.R, p.N, p.K);
    DeviceBuffer w16(ws16);
    const TensorView av = make_view(a16.get(), DType::kBF16, {p.R, p.K}, DeviceType::kCUDA);
    const TensorView bv = make_view(b16.get(), DType::kBF16, {p.E, p.N, p.K}, DeviceType::kCUDA);
    const TensorView cv = make_view(c16.get(), DType::kBF16, {p.R, p.N}, DeviceType::kCUDA);
    const TensorView ov = make_view(d.offs.get(), DType::kI32, {p.E + 1}, DeviceType::kCUDA);
    const double bf16 =
        flops /
        (median_ms([&] { cuda::grouped_gemm_sm90(av, bv, ov, WeightLayout::kNK, cv, w16.get(), ws16, nullptr); }) *
         1e-3) /
        1e12;
    // Quantisation of the bf16 activation [R, K] (reads 2 bytes, writes 1 + 4/128 per element).
    const TensorView qv = make_view(d.a.get(), DType::kU8, {p.R, p.K}, DeviceType::kCUDA);
    const TensorView sv = make_view(d.sa.get(), DType::kF32, {p.R, kb(p.K)}, DeviceType::kCUDA);
    const double qms = median_ms([&] { cuda::quantize_rows_1x128(av, absent(), absent(), 1, qv, sv, nullptr); });
    const double gbs = p.R * p.K * (3.0 + 4.0 / 128) / (qms * 1e-3) / 1e9;
    cuda_ok(cudaDeviceSynchronize(), "speed");
    std::printf("%-28s %9.1f %9.1f %9.1f %7.2f %12.0f\n", sh.name, bf16, fp8, fp8_overlap, fp8 / bf16, gbs);
  }
}

}  // namespace
}  // namespace moe8::test

#else   // built without the CUDA backend: say so instead of silently running nothing
TEST(CudaQuantTest, Backend) {
  GTEST_SKIP() << "no CUDA device: moe8 was built without the CUDA backend (MOE8_CUDA=OFF or no nvcc)";
}
#endif  // MOE8_WITH_CUDA
