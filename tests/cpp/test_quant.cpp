// test_quant.cpp — the FP8 (e4m3) recipes on the CPU, through the API: the float -> e4m3 conversion
// (exact bit patterns for known values, saturation, subnormals, NaN; every code decoded; a million random
// floats against a search for the nearest e4m3 value), 1x128 row quantisation (with the fused gather),
// 128x128 weights, the transposed wgrad quantisation within expert groups, activation + quantisation, the
// rowwise / tensorwise variants, dequantisation, the blockwise FP8 grouped GEMM against float64, the error
// of the whole recipe against an unquantised GEMM, and validation messages. Outputs are poisoned first.
#include "core/fp8.h"
#include "test_fp8_ref.h"

namespace moe8::test {
namespace {

const DType kFloatTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ------------------------------------------------------------------------------------------- conversion

TEST(Fp8, KnownBitPatterns) {
  struct Case {
    float x;
    uint8_t code;
    const char* why;
  };
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const Case cases[] = {
      {0.0f, 0x00, "zero"},
      {-0.0f, 0x80, "negative zero keeps its sign"},
      {1.0f, 0x38, "one: exponent 7"},
      {-2.0f, 0xC0, "minus two"},
      {1.0625f, 0x38, "tie between 1 and 1.125 -> even (1)"},
      {1.1875f, 0x3A, "tie between 1.125 and 1.25 -> even (1.25)"},
      {1.0626f, 0x39, "just above a tie rounds up"},
      {240.0f, 0x77, "1.875 * 2^7"},
      {256.0f, 0x78, "2^8"},
      {448.0f, 0x7E, "largest finite"},
      {-448.0f, 0xFE, "largest finite, negative"},
      {464.0f, 0x7E, "448 + half ulp: tie -> even (448), not NaN"},
      {464.0001f, 0x7E, "above 464 saturates"},
      {1e30f, 0x7E, "far above saturates"},
      {inf, 0x7E, "+inf saturates"},
      {-inf, 0xFE, "-inf saturates"},
      {nan, 0x7F, "NaN"},
      {-nan, 0x7F, "negative NaN is the canonical NaN"},
      {std::ldexp(1.0f, -6), 0x08, "smallest normal"},
      {std::ldexp(1.0f, -9), 0x01, "smallest subnormal"},
      {std::ldexp(1.0f, -10), 0x00, "half the smallest subnormal: tie -> 0"},
      {std::ldexp(1.0001f, -10), 0x01, "just above half the smallest subnormal"},
      {-std::ldexp(1.0f, -11), 0x80, "underflow keeps the sign"},
      {std::ldexp(3.0f, -10), 0x02, "1.5 subnormal steps: tie -> even (2)"},
      {std::ldexp(5.0f, -10), 0x02, "2.5 subnormal steps: tie -> even (2)"},
      {std::ldexp(7.0f, -9), 0x07, "largest subnormal"},
      {std::ldexp(15.0f, -10), 0x08, "7.5 steps: tie -> 8, the smallest normal"},
      {from_bits(0x00000001u), 0x00, "float subnormal"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(int(float_to_e4m3(c.x)), int(c.code)) << c.why << " (x = " << c.x << ")";
    EXPECT_EQ(int(e4m3_ref_code(c.x)), int(c.code)) << "test reference: " << c.why;
  }
}

TEST(Fp8, DecodesEveryCode) {
  for (int code = 0; code < 256; ++code) {
    const double want = e4m3_ref_value(static_cast<uint8_t>(code));
    const float got = e4m3_to_float(static_cast<uint8_t>(code));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << code;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << "code " << code;
      EXPECT_EQ(std::signbit(got), (code & 0x80) != 0) << "code " << code;
      // Every finite value converts back to its own code.
      EXPECT_EQ(int(float_to_e4m3(got)), code) << "round trip of code " << code;
    }
  }
}

TEST(Fp8, RandomFloatsMatchNearestValueSearch) {
  Rng rng(7);
  std::vector<float> xs;
  for (int i = 0; i < 1000000; ++i) {
    // Uniform exponents over the interesting range (2^-14 .. 2^10) and random mantissa bits.
    const float m = static_cast<float>(rng.uniform(1.0, 2.0)) * (rng.randint(0, 2) ? 1.f : -1.f);
    xs.push_back(std::ldexp(m, rng.randint(-14, 11)));
  }
  // Every midpoint between neighbouring codes, and one float either side of it.
  for (int c = 0; c < 126; ++c) {
    const float mid = static_cast<float>((e4m3_ref_value(c) + e4m3_ref_value(c + 1)) / 2);
    for (float x : {mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e9f)}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  int64_t bad = 0;
  for (float x : xs) {
    const uint8_t got = float_to_e4m3(x), want = e4m3_ref_code(x);
    if (got != want && bad++ < 8)
      ADD_FAILURE() << "x = " << x << ": got 0x" << std::hex << int(got) << " want 0x" << int(want);
  }
  EXPECT_EQ(bad, 0);
}

// ---------------------------------------------------------------------------------------------- helpers

// Random values with a spread of magnitudes per row, zero blocks and single spikes mixed in.
HostTensor fp8_input(DType dt, const Shape& s, Rng& rng) {
  HostTensor t(dt, s);
  const int64_t K = s.back();
  for (int64_t i = 0; i < t.numel(); ++i) {
    const int64_t row = i / std::max<int64_t>(K, 1);
    const double mag = std::ldexp(1.0, static_cast<int>(row % 7) * 3 - 9);
    t.set(i, rng.normal() * mag);
  }
  if (K >= 200)  // an all-zero block (columns 128..255 of row 0) and a spike
    for (int64_t k = 128; k < std::min<int64_t>(K, 256); ++k) t.set(k, 0.0);
  if (t.numel() > 3) t.set(t.numel() / 2, 1000.0);
  return t;
}

HostTensor u8(const Shape& s) { return HostTensor(DType::kU8, s); }
HostTensor f32(const Shape& s) { return HostTensor(DType::kF32, s); }

int64_t kb(int64_t k) { return (k + 127) / 128; }

// ----------------------------------------------------------------------------------------- rows 1x128

struct RK {
  int64_t R, K;
};
const RK kRowShapes[] = {{1, 1}, {3, 128}, {5, 129}, {17, 300}, {0, 64}, {4, 1000}, {2, 7}};

TEST(Quant, Rows1x128MatchReference) {
  Rng rng(11);
  for (DType dt : kFloatTypes)
    for (RK s : kRowShapes) {
      HostTensor x = fp8_input(dt, {s.R, s.K}, rng);
      HostTensor q = u8({s.R, s.K}), sc = f32({s.R, kb(s.K)});
      q.poison();
      sc.poison();
      api::quantize_rows_1x128(x.view(), absent(), 1, q.view(), sc.view(), 0);
      const RefQuant want = ref_rows_1x128(rows_of(x), s.K);
      const std::string what = std::string(name_of(dt)) + " " + shape_str({s.R, s.K});
      EXPECT_TRUE(same_bytes(bytes(q), want.q, "q " + what));
      EXPECT_TRUE(same_floats(floats(sc), want.scale, "scale " + what));
      // Dequantised values lie within half an e4m3 step of x.
      for (int64_t i = 0; i < x.numel(); ++i) {
        const double s_i = floats(sc)[(i / s.K) * kb(s.K) + (i % s.K) / 128];
        const double d = e4m3_ref_value(bytes(q)[i]) * s_i;
        ASSERT_LE(std::fabs(d - x.get(i)), quant_tol(x.get(i), s_i)) << what << " element " << i;
      }
    }
}

TEST(Quant, ZeroBlockHasScaleOne) {
  HostTensor x(DType::kF32, {2, 130});
  for (int64_t i = 0; i < x.numel(); ++i) x.set(i, 0.0);
  x.set(130 + 129, -3.5);  // row 1, second block: one value
  HostTensor q = u8({2, 130}), sc = f32({2, 2});
  q.poison();
  sc.poison();
  api::quantize_rows_1x128(x.view(), absent(), 1, q.view(), sc.view(), 0);
  EXPECT_EQ(floats(sc)[0], 1.0f);
  EXPECT_EQ(floats(sc)[1], 1.0f);
  EXPECT_EQ(floats(sc)[2], 1.0f);
  EXPECT_EQ(floats(sc)[3], 3.5f / 448.0f);
  EXPECT_EQ(int(bytes(q)[130 + 129]), 0xFE);  // the block maximum maps to -448
  for (int64_t i = 0; i < 130 + 129; ++i) ASSERT_EQ(int(bytes(q)[i]), 0) << i;
}

TEST(Quant, NonFinitePolicy) {
  // NaN is left out of amax and becomes the NaN code; an inf makes the block's scale inf, so its finite
  // neighbours quantise to 0 and the inf itself to NaN (inf / inf): overflow upstream stays visible.
  HostTensor x(DType::kF32, {2, 4});
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  const double v[] = {1.0, nan, -2.0, 0.5, inf, 1.0, -1.0, 0.0};
  for (int i = 0; i < 8; ++i) x.set(i, v[i]);
  HostTensor q = u8({2, 4}), sc = f32({2, 1});
  api::quantize_rows_1x128(x.view(), absent(), 1, q.view(), sc.view(), 0);
  EXPECT_EQ(floats(sc)[0], 2.0f / 448.0f);
  EXPECT_EQ(int(bytes(q)[1]), 0x7F);
  EXPECT_EQ(int(bytes(q)[2]), 0xFE);
  EXPECT_TRUE(std::isinf(floats(sc)[1]));
  EXPECT_EQ(int(bytes(q)[4]), 0x7F);
  EXPECT_EQ(int(bytes(q)[5]), 0x00);
  EXPECT_EQ(int(bytes(q)[6]), 0x80);
}

TEST(Quant, GatherThenQuantizeInOnePass) {
  Rng rng(12);
  for (DType dt : kFloatTypes) {
    const int T = 9, k = 2;
    const int64_t H = 200;
    HostTensor src = fp8_input(dt, {T, H}, rng);
    // Rows in some expert order, padding (-1) in between, every slot once.
    std::vector<int> r2s = {3, 0, -1, 17, 5, -1, -1, 8, 1, 2, 4, 6, 7, 9, 10, 11, 12, 13, 14, 15, 16, -1};
    HostTensor rows_idx = ints({static_cast<int64_t>(r2s.size())}, r2s);
    const int64_t R = rows_idx.numel();
    HostTensor q = u8({R, H}), sc = f32({R, kb(H)});
    q.poison();
    sc.poison();
    api::quantize_rows_1x128(src.view(), rows_idx.view(), k, q.view(), sc.view(), 0);
    // Expected: the gathered rows (as gather_rows would build them), then row quantisation.
    std::vector<std::vector<float>> rows;
    for (int slot : r2s) {
      std::vector<float> row(H, 0.f);
      if (slot >= 0)
        for (int64_t h = 0; h < H; ++h) row[h] = static_cast<float>(src.get((slot / k) * H + h));
      rows.push_back(row);
    }
    const RefQuant want = ref_rows_1x128(rows, H);
    EXPECT_TRUE(same_bytes(bytes(q), want.q, std::string("gathered q ") + name_of(dt)));
    EXPECT_TRUE(same_floats(floats(sc), want.scale, std::string("gathered scale ") + name_of(dt)));
    EXPECT_EQ(floats(sc)[2 * kb(H)], 1.0f) << "a padding row has scale 1";
  }
}

// ------------------------------------------------------------------------------------- weight 128x128

TEST(Quant, Weight128x128MatchReference) {
  Rng rng(13);
  const Shape shapes[] = {{2, 130, 260}, {1, 128, 128}, {3, 1, 5}, {1, 257, 129}, {0, 4, 4}};
  for (DType dt : kFloatTypes)
    for (const Shape& s : shapes) {
      HostTensor w = fp8_input(dt, s, rng);
      HostTensor q = u8(s), sc = f32({s[0], kb(s[1]), kb(s[2])});
      q.poison();
      sc.poison();
      api::quantize_weight_128x128(w.view(), q.view(), sc.view(), 0);
      const RefQuant want = ref_weight_128x128(w);
      const std::string what = std::string(name_of(dt)) + " " + shape_str(s);
      EXPECT_TRUE(same_bytes(bytes(q), want.q, "q " + what));
      EXPECT_TRUE(same_floats(floats(sc), want.scale, "scale " + what));
      // With the other layout in the same pass: the same q and scale, and q_t / scale_t their transposes.
      HostTensor q2 = u8(s), sc2 = f32({s[0], kb(s[1]), kb(s[2])});
      HostTensor qt = u8({s[0], s[2], s[1]}), sct = f32({s[0], kb(s[2]), kb(s[1])});
      qt.poison();
      sct.poison();
      api::quantize_weight_128x128(w.view(), q2.view(), sc2.view(), 0, qt.view(), sct.view());
      EXPECT_TRUE(same_bytes(bytes(q2), want.q, "q (pair) " + what));
      std::vector<uint8_t> want_t(want.q.size());
      std::vector<float> want_st(want.scale.size());
      for (int64_t e = 0; e < s[0]; ++e) {
        for (int64_t n = 0; n < s[1]; ++n)
          for (int64_t k = 0; k < s[2]; ++k) want_t[(e * s[2] + k) * s[1] + n] = want.q[(e * s[1] + n) * s[2] + k];
        for (int64_t nb = 0; nb < kb(s[1]); ++nb)
          for (int64_t b = 0; b < kb(s[2]); ++b)
            want_st[(e * kb(s[2]) + b) * kb(s[1]) + nb] = want.scale[(e * kb(s[1]) + nb) * kb(s[2]) + b];
      }
      EXPECT_TRUE(same_bytes(bytes(qt), want_t, "q_t " + what));
      EXPECT_TRUE(same_floats(floats(sct), want_st, "scale_t " + what));
      // The other layout alone (q and scale left out): the same q_t and scale_t.
      HostTensor qt1 = u8({s[0], s[2], s[1]}), sct1 = f32({s[0], kb(s[2]), kb(s[1])});
      qt1.poison();
      sct1.poison();
      api::quantize_weight_128x128(w.view(), absent(), absent(), 0, qt1.view(), sct1.view());
      EXPECT_TRUE(same_bytes(bytes(qt1), want_t, "q_t alone " + what));
      EXPECT_TRUE(same_floats(floats(sct1), want_st, "scale_t alone " + what));
    }
}

// --------------------------------------------------------------------------------- cols 1x128 (wgrad)

struct ColCase {
  const char* name;
  std::vector<int> counts;
  int64_t extra_rows;  // rows past offsets[E]
  int64_t K;
};

std::vector<ColCase> col_cases() {
  return {
      {"ragged", {0, 1, 127, 128, 129, 300, 0}, 5, 70}, {"single_group", {200}, 0, 3}, {"all_empty", {0, 0, 0}, 9, 65},
      {"padded_to_128", {128, 0, 256, 128}, 0, 129},    {"tail_only", {0}, 300, 8},
  };
}

TEST(Quant, Cols1x128WithinGroups) {
  Rng rng(14);
  for (DType dt : kFloatTypes)
    for (const ColCase& c : col_cases()) {
      const std::vector<int> off = offsets_of(c.counts);
      const int64_t R = off.back() + c.extra_rows, K = c.K, E = static_cast<int64_t>(c.counts.size());
      const int64_t NB = api::col_scale_blocks(R, static_cast<int>(E));
      ASSERT_EQ(NB, (R + 127) / 128 + E);
      HostTensor x = fp8_input(dt, {R, K}, rng);
      HostTensor offs = ints({E + 1}, off);
      HostTensor qt = u8({K, R}), sc = f32({NB, K});
      qt.poison();
      sc.poison();
      api::quantize_cols_1x128(x.view(), offs.view(), qt.view(), sc.view(), 0);
      const RefQuant want = ref_cols_1x128(x, off, NB);
      const std::string what = std::string(c.name) + " " + name_of(dt);
      EXPECT_TRUE(same_bytes(bytes(qt), want.q, "q_t " + what));
      EXPECT_TRUE(same_floats(floats(sc), want.scale, "scale " + what));
      if (std::string(c.name) == "padded_to_128")  // block b is then rows 128 b .. 128 b + 127
        for (int64_t b = 0; b < R / 128; ++b)
          for (int64_t col = 0; col < K; ++col) {
            float amax = 0.f;
            for (int64_t r = 128 * b; r < 128 * b + 128; ++r)
              amax = std::max(amax, static_cast<float>(std::fabs(x.get(r * K + col))));
            ASSERT_EQ(floats(sc)[b * K + col], ref_scale(amax)) << "block " << b << " column " << col;
          }
    }
}

// ----------------------------------------------------------------------------------------- swiglu_quant

ActParams act(ActKind kind, bool interleaved = false) {
  ActParams p;
  p.kind = kind;
  p.interleaved = interleaved;
  return p;
}

TEST(Quant, SwigluQuantIsActivationThenQuantize) {
  Rng rng(15);
  const ActParams params[] = {act(ActKind::kSwiGLU), act(ActKind::kSwiGLU, true), act(ActKind::kSwiGLUClamped, true),
                              act(ActKind::kSiLU), act(ActKind::kGELU)};
  const RK shapes[] = {{7, 300}, {1, 1}, {3, 128}, {0, 5}};
  for (DType dt : kFloatTypes)
    for (const ActParams& p : params)
      for (RK s : shapes) {
        const int64_t W = is_gated(p.kind) ? 2 * s.K : s.K;
        HostTensor h = random_tensor(dt, {s.R, W}, rng, -8.0, 8.0);
        HostTensor q = u8({s.R, s.K}), sc = f32({s.R, kb(s.K)});
        q.poison();
        sc.poison();
        api::swiglu_quant(h.view(), p, q.view(), sc.view(), 0);
        // The definition: activation_forward, then 1x128 quantisation of the stored activation.
        HostTensor a(dt, {s.R, s.K});
        api::activation_forward(h.view(), p, a.view(), 0);
        const RefQuant want = ref_rows_1x128(rows_of(a), s.K);
        const std::string what =
            std::string(name_of(dt)) + " kind " + std::to_string(int(p.kind)) + " " + shape_str({s.R, s.K});
        EXPECT_TRUE(same_bytes(bytes(q), want.q, "q " + what));
        EXPECT_TRUE(same_floats(floats(sc), want.scale, "scale " + what));
        // And against the float64 activation: e4m3 rounding plus the activation's own rounding.
        const Expect ref = act_ref(h, p);
        for (int64_t i = 0; i < s.R * s.K; ++i) {
          const double s_i = floats(sc)[(i / s.K) * kb(s.K) + (i % s.K) / 128];
          const double d = e4m3_ref_value(bytes(q)[i]) * s_i, v = ref.want[i];
          const double tol = quant_tol(v, s_i) * 1.1 + out_rel(dt) * std::fabs(v) + ref.comp_rel * ref.mag[i] + 1e-30;
          ASSERT_LE(std::fabs(d - v), tol) << what << " element " << i;
        }
      }
}

// ------------------------------------------------------------------------------ rowwise / tensorwise

TEST(Quant, RowwiseAndTensorwise) {
  Rng rng(16);
  const Shape shapes[] = {{5, 300}, {2, 3, 7}, {1, 1}};
  for (DType dt : kFloatTypes)
    for (const Shape& s : shapes) {
      HostTensor x = fp8_input(dt, s, rng);
      const int64_t K = s.back(), M = x.numel() / K;
      Shape ss(s.begin(), s.end() - 1);
      HostTensor q = u8(s), sc = f32(ss);
      q.poison();
      sc.poison();
      api::quantize_rowwise(x.view(), q.view(), sc.view(), 0);
      RefQuant want;
      for (int64_t m = 0; m < M; ++m) {
        std::vector<float> row;
        for (int64_t k = 0; k < K; ++k) row.push_back(static_cast<float>(x.get(m * K + k)));
        RefBlock b = ref_quantize(row);
        want.scale.push_back(b.scale);
        want.q.insert(want.q.end(), b.q.begin(), b.q.end());
      }
      const std::string what = std::string(name_of(dt)) + " " + shape_str(s);
      EXPECT_TRUE(same_bytes(bytes(q), want.q, "rowwise q " + what));
      EXPECT_TRUE(same_floats(floats(sc), want.scale, "rowwise scale " + what));

      HostTensor qt = u8(s), st = f32({1});
      qt.poison();
      st.poison();
      api::quantize_tensorwise(x.view(), qt.view(), st.view(), 0);
      std::vector<float> all;
      for (int64_t i = 0; i < x.numel(); ++i) all.push_back(static_cast<float>(x.get(i)));
      RefBlock b = ref_quantize(all);
      EXPECT_TRUE(same_bytes(bytes(qt), b.q, "tensorwise q " + what));
      EXPECT_TRUE(same_floats(floats(st), {b.scale}, "tensorwise scale " + what));
    }
}

// --------------------------------------------------------------------------------------- dequantize

TEST(Quant, DequantizeEveryBlockShape) {
  Rng rng(17);
  struct Case {
    Shape q;
    int64_t bm, bk;
  };
  const Case cases[] = {{{5, 300}, 1, 128}, {{2, 130, 260}, 128, 128}, {{4, 9}, 1, 9}, {{4, 9}, 4, 9}, {{3, 1}, 2, 1}};
  for (DType dt : kFloatTypes)
    for (const Case& c : cases) {
      HostTensor q = u8(c.q);
      for (int64_t i = 0; i < q.numel(); ++i) {
        uint8_t code = static_cast<uint8_t>(rng.randint(0, 256));
        if ((code & 0x7F) == 0x7F) code = 0x12;  // keep NaN out (checked separately)
        static_cast<uint8_t*>(q.data())[i] = code;
      }
      const int64_t M = c.q[c.q.size() - 2], K = c.q.back(), SM = (M + c.bm - 1) / c.bm, SK = (K + c.bk - 1) / c.bk;
      Shape ss = c.q.size() == 3 ? Shape{c.q[0], SM, SK} : Shape{SM, SK};
      HostTensor sc = random_tensor(DType::kF32, ss, rng, 0.01, 2.0);
      HostTensor out(dt, c.q);
      out.poison();
      api::dequantize(q.view(), sc.view(), c.bm, c.bk, out.view(), 0);
      const int64_t B = c.q.size() == 3 ? c.q[0] : 1;
      for (int64_t i = 0; i < B * M * K; ++i) {
        const int64_t b = i / (M * K), m = (i / K) % M, k = i % K;
        const float want =
            static_cast<float>(e4m3_ref_value(bytes(q)[i])) * floats(sc)[(b * SM + m / c.bm) * SK + k / c.bk];
        HostTensor one(dt, {1});
        one.set(0, want);  // rounded to dt like the op's store
        ASSERT_EQ(out.get(i), one.get(0)) << name_of(dt) << " " << shape_str(c.q) << " element " << i;
      }
    }
}

// ---------------------------------------------------------------------------------- FP8 grouped GEMM

struct GemmCase {
  const char* name;
  std::vector<int> counts;
  int64_t extra_rows, N, K;
};

std::vector<GemmCase> gemm_cases() {
  return {
      {"ragged", {0, 1, 5, 130, 0, 17}, 3, 136, 272},
      {"one_expert", {33}, 0, 8, 16},
      {"k_not_multiple_of_128", {7, 9}, 1, 24, 200},
      {"all_empty", {0, 0}, 4, 16, 32},
  };
}

// Quantised operands for a GEMM case: a [R, K] with 1x128 scales, b [E, N, K] with 128x128 scales.
struct Fp8Operands {
  HostTensor x, w;  // unquantised (bf16)
  HostTensor a, sa, b, sb, offs;
  std::vector<int> off;
};

Fp8Operands fp8_operands(const GemmCase& c, Rng& rng) {
  Fp8Operands o;
  o.off = offsets_of(c.counts);
  const int64_t R = o.off.back() + c.extra_rows, E = static_cast<int64_t>(c.counts.size());
  o.x = random_tensor(DType::kBF16, {R, c.K}, rng);
  o.w = random_tensor(DType::kBF16, {E, c.N, c.K}, rng, -0.1, 0.1);
  o.a = u8({R, c.K});
  o.sa = f32({R, kb(c.K)});
  o.b = u8({E, c.N, c.K});
  o.sb = f32({E, kb(c.N), kb(c.K)});
  o.offs = ints({E + 1}, o.off);
  api::quantize_rows_1x128(o.x.view(), absent(), 1, o.a.view(), o.sa.view(), 0);
  api::quantize_weight_128x128(o.w.view(), o.b.view(), o.sb.view(), 0);
  return o;
}

TEST(Quant, GroupedGemmFp8MatchesFloat64) {
  Rng rng(18);
  for (const GemmCase& c : gemm_cases())
    for (DType dt : kFloatTypes) {
      Fp8Operands o = fp8_operands(c, rng);
      const int64_t R = o.a.shape()[0];
      HostTensor out(dt, {R, c.N});
      out.poison();
      api::grouped_gemm_fp8(o.a.view(), o.sa.view(), o.b.view(), o.sb.view(), o.offs.view(), out.view(), 0);
      Expect want = ref_gemm_fp8(o.a, o.sa, o.b, o.sb, o.off);
      want.comp_rel = fp32_rel(8);  // the reference accumulates in double; only scale products are fp32
      EXPECT_TRUE(close_to(out, want, std::string(c.name) + " " + name_of(dt)));
      for (int64_t i = o.off.back() * c.N; i < R * c.N; ++i) ASSERT_EQ(out.get(i), 0.0) << "row past offsets[E]";
    }
}

TEST(Quant, BlockwiseRecipeErrorAgainstUnquantizedGemm) {
  // The point of the recipe: a GEMM on e4m3 operands with 1x128 / 128x128 scales stays within a few
  // percent (normwise) of the unquantised GEMM, even with an outlier row. The floor is the format: 3
  // mantissa bits leave each operand with ~2.5% RMS rounding error, so a product of two carries ~3.5%
  // (torch's own float8_e4m3fn casts give 3.6% on this kind of data); 5% leaves room, a broken scale
  // or a misplaced block gives far more.
  Rng rng(19);
  GemmCase c{"model_like", {40, 0, 90, 126}, 0, 256, 512};
  Fp8Operands o = fp8_operands(c, rng);
  const int64_t R = o.a.shape()[0], N = c.N, K = c.K;
  for (int64_t k = 0; k < K; k += 97) o.x.set(5 * K + k, 30.0);  // an outlier row
  api::quantize_rows_1x128(o.x.view(), absent(), 1, o.a.view(), o.sa.view(), 0);
  HostTensor out(DType::kBF16, {R, N});
  api::grouped_gemm_fp8(o.a.view(), o.sa.view(), o.b.view(), o.sb.view(), o.offs.view(), out.view(), 0);
  double err = 0, norm = 0;
  for (size_t e = 0; e + 1 < o.off.size(); ++e)
    for (int64_t r = o.off[e]; r < o.off[e + 1]; ++r)
      for (int64_t n = 0; n < N; ++n) {
        double want = 0;
        for (int64_t k = 0; k < K; ++k) want += o.x.get(r * K + k) * o.w.get((e * N + n) * K + k);
        err += std::pow(out.get(r * N + n) - want, 2);
        norm += want * want;
      }
  const double rel = std::sqrt(err / norm);
  EXPECT_LT(rel, 5e-2);
  EXPECT_GT(rel, 1e-2) << "suspiciously exact: are the operands really quantised?";
}

// quantize_grouped_gemm_fp8: the two calls it replaces (quantize_rows_1x128, grouped_gemm_fp8), bit for bit, with
// the rows as given and gathered from tokens (padding rows of -1); c and the scratch poisoned first.
TEST(Quant, QuantizeGroupedGemmIsTheTwoCalls) {
  Rng rng(20);
  for (const GemmCase& c : gemm_cases())
    for (DType dt : kFloatTypes)
      for (bool gathered : {false, true}) {
        const std::vector<int> off = offsets_of(c.counts);
        const int64_t R = off.back() + c.extra_rows, E = static_cast<int64_t>(c.counts.size());
        const int k = 2, T = static_cast<int>((R + 1) / 2);
        HostTensor x = fp8_input(dt, {gathered ? T : R, c.K}, rng);
        std::vector<int> r2s(R);
        for (int64_t r = 0; r < R; ++r) r2s[r] = r % 5 == 3 ? -1 : static_cast<int>((r * 7) % (T * k));
        HostTensor rows = ints({R}, r2s), offs = ints({E + 1}, off);
        HostTensor w = random_tensor(DType::kBF16, {E, c.N, c.K}, rng, -0.1, 0.1);
        HostTensor b = u8({E, c.N, c.K}), sb = f32({E, kb(c.N), kb(c.K)});
        api::quantize_weight_128x128(w.view(), b.view(), sb.view(), 0);
        const TensorView r2s_view = gathered ? rows.view() : absent();
        HostTensor a = u8({R, c.K}), sa = f32({R, kb(c.K)}), want(DType::kBF16, {R, c.N});
        api::quantize_rows_1x128(x.view(), r2s_view, k, a.view(), sa.view(), 0);
        api::grouped_gemm_fp8(a.view(), sa.view(), b.view(), sb.view(), offs.view(), want.view(), 0);
        HostTensor got(DType::kBF16, {R, c.N}), scratch = u8({api::quantize_grouped_gemm_fp8_scratch_bytes(R, c.K)});
        got.poison();
        scratch.poison();
        api::quantize_grouped_gemm_fp8(x.view(), r2s_view, k, absent(), b.view(), sb.view(), offs.view(),
                                       scratch.view(), got.view(), 0);
        EXPECT_TRUE(got.bitwise_equal(want)) << c.name << " " << name_of(dt) << (gathered ? " gathered" : "");
      }
}

// --------------------------------------------------------------------------------------- validation

TEST(Validation, Quant) {
  HostTensor x(DType::kBF16, {4, 130}), q = u8({4, 130}), sc = f32({4, 2});
  HostTensor bad_q = f32({4, 130}), bad_sc = f32({4, 1}), sc_f16(DType::kF16, {4, 2});
  EXPECT_MOE8_ERROR("q", api::quantize_rows_1x128(x.view(), absent(), 1, bad_q.view(), sc.view(), 0));
  EXPECT_MOE8_ERROR("scale", api::quantize_rows_1x128(x.view(), absent(), 1, q.view(), bad_sc.view(), 0));
  EXPECT_MOE8_ERROR("scale", api::quantize_rows_1x128(x.view(), absent(), 1, q.view(), sc_f16.view(), 0));
  EXPECT_MOE8_ERROR("x", api::quantize_rows_1x128(q.view(), absent(), 1, q.view(), sc.view(), 0));
  HostTensor r2s = ints({4}, {0, 1, 2, 8});
  EXPECT_MOE8_ERROR("row_to_slot", api::quantize_rows_1x128(x.view(), r2s.view(), 2, q.view(), sc.view(), 0));
  EXPECT_MOE8_ERROR("k", api::quantize_rows_1x128(x.view(), r2s.view(), 0, q.view(), sc.view(), 0));
  // slot_to_row: only with row_to_slot, T*k slots, rows in [-1, R)
  HostTensor r2s_ok = ints({4}, {0, 1, 2, 7}), s2r = ints({8}, {0, 1, 2, -1, -1, -1, -1, 3});
  EXPECT_NO_THROW(api::quantize_rows_1x128(x.view(), r2s_ok.view(), 2, q.view(), sc.view(), 0, true, s2r.view()));
  EXPECT_MOE8_ERROR("slot_to_row",
                    api::quantize_rows_1x128(x.view(), absent(), 1, q.view(), sc.view(), 0, true, s2r.view()));
  HostTensor s2r_short = ints({7}, {0, 1, 2, -1, -1, -1, 3});
  EXPECT_MOE8_ERROR("slot_to_row", api::quantize_rows_1x128(x.view(), r2s_ok.view(), 2, q.view(), sc.view(), 0, true,
                                                            s2r_short.view()));
  HostTensor s2r_bad = ints({8}, {0, 1, 2, -1, -1, -1, -1, 4});
  EXPECT_MOE8_ERROR("slot_to_row",
                    api::quantize_rows_1x128(x.view(), r2s_ok.view(), 2, q.view(), sc.view(), 0, true, s2r_bad.view()));

  HostTensor w(DType::kF32, {2, 3, 4}), wq = u8({2, 3, 4}), ws = f32({2, 1, 1}), ws_bad = f32({2, 3, 1});
  EXPECT_MOE8_ERROR("scale", api::quantize_weight_128x128(w.view(), wq.view(), ws_bad.view(), 0));
  EXPECT_MOE8_ERROR("w", api::quantize_weight_128x128(x.view(), wq.view(), ws.view(), 0));
  HostTensor wqt = u8({2, 4, 3}), wst = f32({2, 1, 1});
  EXPECT_MOE8_ERROR("q_t and scale_t", api::quantize_weight_128x128(w.view(), wq.view(), ws.view(), 0, wqt.view()));
  EXPECT_MOE8_ERROR("q_t", api::quantize_weight_128x128(w.view(), wq.view(), ws.view(), 0, wq.view(), wst.view()));
  EXPECT_MOE8_ERROR("q and scale",
                    api::quantize_weight_128x128(w.view(), wq.view(), absent(), 0, wqt.view(), wst.view()));
  EXPECT_MOE8_ERROR("q and q_t", api::quantize_weight_128x128(w.view(), absent(), absent(), 0));
  EXPECT_NO_THROW(api::quantize_weight_128x128(w.view(), absent(), absent(), 0, wqt.view(), wst.view()));

  HostTensor offs = ints({3}, {0, 3, 2}), offs_ok = ints({3}, {0, 2, 4});
  HostTensor qt = u8({130, 4}), cs = f32({api::col_scale_blocks(4, 2), 130}), cs_bad = f32({1, 130});
  EXPECT_MOE8_ERROR("offsets", api::quantize_cols_1x128(x.view(), offs.view(), qt.view(), cs.view(), 0));
  EXPECT_MOE8_ERROR("scale", api::quantize_cols_1x128(x.view(), offs_ok.view(), qt.view(), cs_bad.view(), 0));
  EXPECT_MOE8_ERROR("q_t", api::quantize_cols_1x128(x.view(), offs_ok.view(), q.view(), cs.view(), 0));

  HostTensor h(DType::kBF16, {4, 10}), hq = u8({4, 4}), hs = f32({4, 1});
  EXPECT_MOE8_ERROR("h", api::swiglu_quant(h.view(), act(ActKind::kSwiGLU), hq.view(), hs.view(), 0));

  EXPECT_MOE8_ERROR("scale", api::quantize_rowwise(x.view(), q.view(), sc.view(), 0));
  EXPECT_MOE8_ERROR("scale", api::quantize_tensorwise(x.view(), q.view(), sc.view(), 0));
  EXPECT_MOE8_ERROR("block_rows", api::dequantize(q.view(), sc.view(), 0, 128, x.view(), 0));
  EXPECT_MOE8_ERROR("out", api::dequantize(q.view(), sc.view(), 1, 128, bad_sc.view(), 0));

  HostTensor b = u8({2, 8, 130}), bs = f32({2, 1, 2}), bs_bad = f32({2, 2, 2}), c(DType::kBF16, {4, 8});
  EXPECT_MOE8_ERROR("b_scale",
                    api::grouped_gemm_fp8(q.view(), sc.view(), b.view(), bs_bad.view(), offs_ok.view(), c.view(), 0));
  EXPECT_MOE8_ERROR("a", api::grouped_gemm_fp8(x.view(), sc.view(), b.view(), bs.view(), offs_ok.view(), c.view(), 0));
  EXPECT_MOE8_ERROR("a_scale",
                    api::grouped_gemm_fp8(q.view(), bad_sc.view(), b.view(), bs.view(), offs_ok.view(), c.view(), 0));
  EXPECT_MOE8_ERROR("offsets",
                    api::grouped_gemm_fp8(q.view(), sc.view(), b.view(), bs.view(), offs.view(), c.view(), 0));
  EXPECT_MOE8_ERROR("c", api::grouped_gemm_fp8(q.view(), sc.view(), b.view(), bs.view(), offs_ok.view(), q.view(), 0));

  // quantize_grouped_gemm_fp8: x as for quantize_rows_1x128, b .. c as for grouped_gemm_fp8, and the scratch
  const int64_t need = api::quantize_grouped_gemm_fp8_scratch_bytes(4, 130);
  EXPECT_EQ(need, 256 + 4 * 130);  // scales [4, 2] f32 first, codes from the next 256-byte boundary
  HostTensor scratch = u8({need + 16}), small = u8({need - 1}), wide = f32({need});
  const TensorView ok = scratch.view();
  TensorView shifted = ok;
  shifted.data = static_cast<uint8_t*>(ok.data) + 1;
  shifted.shape[0] = need;
  auto fused = [&](const TensorView& xv, const TensorView& r2sv, const TensorView& bsv, const TensorView& offsv,
                   const TensorView& sv, const TensorView& cv) {
    api::quantize_grouped_gemm_fp8(xv, r2sv, 2, absent(), b.view(), bsv, offsv, sv, cv, 0);
  };
  EXPECT_NO_THROW(fused(x.view(), absent(), bs.view(), offs_ok.view(), ok, c.view()));
  EXPECT_MOE8_ERROR("scratch", fused(x.view(), absent(), bs.view(), offs_ok.view(), small.view(), c.view()));
  EXPECT_MOE8_ERROR("scratch", fused(x.view(), absent(), bs.view(), offs_ok.view(), wide.view(), c.view()));
  EXPECT_MOE8_ERROR("scratch", fused(x.view(), absent(), bs.view(), offs_ok.view(), shifted, c.view()));
  EXPECT_MOE8_ERROR("x", fused(q.view(), absent(), bs.view(), offs_ok.view(), ok, c.view()));
  EXPECT_MOE8_ERROR("row_to_slot", fused(x.view(), r2s.view(), bs.view(), offs_ok.view(), ok, c.view()));
  EXPECT_MOE8_ERROR("b_scale", fused(x.view(), absent(), bs_bad.view(), offs_ok.view(), ok, c.view()));
  EXPECT_MOE8_ERROR("offsets", fused(x.view(), absent(), bs.view(), offs.view(), ok, c.view()));
  EXPECT_MOE8_ERROR("c", fused(x.view(), absent(), bs.view(), offs_ok.view(), ok, q.view()));
}

}  // namespace
}  // namespace moe8::test
