// test_grouped_gemm.cpp — api::grouped_gemm (c[r] = a[r] op(b[e]) + bias[e] per group, rows past
// offsets[E] zeroed), api::grouped_gemm_wgrad (db[e], dbias[e] over each group's rows) and
// api::grouped_lowrank_add (h + t·op(b[e]) per group, h elsewhere) on the CPU, both weight layouts, against
// float64 loops on ragged groups: empty experts, one row, skew, padding, rows in no group.
#include "cpu/ops.h"
#include "test_ref.h"

namespace moe8::test {
namespace {

const DType kFloatTypes[] = {DType::kF32, DType::kF16, DType::kBF16};
const WeightLayout kLayouts[] = {WeightLayout::kNK, WeightLayout::kKN};

const char* layout_name(WeightLayout l) { return l == WeightLayout::kNK ? "NK" : "KN"; }

struct GemmCase {
  const char* name;
  std::vector<int> sizes;  // rows per expert (E = sizes.size())
  int pad;                 // groups padded to this many rows, as a dispatch plan does
  int64_t tail;            // rows past offsets[E]
  int64_t Kd, N;
};

std::vector<GemmCase> gemm_cases() {
  return {
      {"ragged_empty_expert", {5, 0, 13, 1}, 1, 3, 7, 13},
      {"h20", {4, 9, 0}, 1, 0, 20, 20},
      {"single_row", {1}, 1, 0, 8, 5},
      {"single_row_of_four", {0, 0, 1, 0}, 1, 2, 3, 1},
      {"padded16", {5, 0, 17, 2}, 16, 4, 12, 9},
      {"skewed", {90, 3, 0, 5, 1, 0, 1, 0}, 1, 0, 33, 24},
      {"all_empty", {0, 0, 0}, 1, 6, 7, 3},
      {"no_rows", {0, 0}, 1, 0, 5, 4},
      {"wide", {40, 23}, 8, 1, 130, 67},
  };
}

struct GemmInputs {
  std::vector<int> offsets;
  HostTensor a, b, bias;
  int64_t R, E;
};

// a [R,Kd] with zero padding rows (what gather_rows writes there) and garbage past offsets[E].
GemmInputs gemm_inputs(const GemmCase& c, DType dt, WeightLayout layout, Rng& rng) {
  GemmInputs in;
  in.offsets = offsets_from_sizes(c.sizes, c.pad);
  in.E = static_cast<int64_t>(c.sizes.size());
  in.R = in.offsets.back() + c.tail;
  in.a = random_tensor(dt, {in.R, c.Kd}, rng);
  for (int64_t e = 0; e < in.E; ++e)
    for (int64_t r = in.offsets[e] + c.sizes[e]; r < in.offsets[e + 1]; ++r)
      for (int64_t k = 0; k < c.Kd; ++k) in.a.set(r * c.Kd + k, 0.0);
  for (int64_t r = in.offsets.back(); r < in.R; ++r)
    for (int64_t k = 0; k < c.Kd; ++k) in.a.set(r * c.Kd + k, 777.0);
  Shape bs = layout == WeightLayout::kNK ? Shape{in.E, c.N, c.Kd} : Shape{in.E, c.Kd, c.N};
  in.b = random_tensor(dt, bs, rng);
  in.bias = random_tensor(dt, {in.E, c.N}, rng);
  return in;
}

HostTensor run_gemm(const GemmInputs& in, WeightLayout layout, bool with_bias, int64_t N) {
  HostTensor c(in.a.dtype(), {in.R, N});
  c.poison();
  HostTensor off = ints({in.E + 1}, in.offsets);
  api::grouped_gemm(in.a.view(), in.b.view(), off.view(), layout, with_bias ? in.bias.view() : absent(), c.view(), 0);
  return c;
}

TEST(GroupedGemm, MatchesReference) {
  uint64_t seed = 40;
  for (const GemmCase& gc : gemm_cases())
    for (DType dt : kFloatTypes)
      for (WeightLayout layout : kLayouts)
        for (bool with_bias : {false, true}) {
          SCOPED_TRACE(std::string(gc.name) + " " + name_of(dt) + " " + layout_name(layout) +
                       (with_bias ? " bias" : ""));
          Rng rng(++seed);
          GemmInputs in = gemm_inputs(gc, dt, layout, rng);
          HostTensor c = run_gemm(in, layout, with_bias, gc.N);
          EXPECT_TRUE(close_to(c, gemm_ref(in.a, in.b, in.offsets, layout, with_bias ? &in.bias : nullptr), "c"));
          EXPECT_TRUE(c.bitwise_equal(run_gemm(in, layout, with_bias, gc.N))) << "two calls differ";
        }
}

// api::gathered_grouped_gemm reads each row from x[row_to_slot[r] / k] (0 for slot -1): the same bits as
// grouped_gemm on those rows gathered into a buffer.
TEST(GroupedGemm, GatheredRowsAreThePermutedRows) {
  uint64_t seed = 70;
  for (const GemmCase& gc : gemm_cases())
    for (DType dt : kFloatTypes)
      for (WeightLayout layout : kLayouts) {
        SCOPED_TRACE(std::string(gc.name) + " " + name_of(dt) + " " + layout_name(layout));
        Rng rng(++seed);
        GemmInputs in = gemm_inputs(gc, dt, layout, rng);
        const int k = 3;
        const int64_t T = in.R / 2 + 1;
        HostTensor x = random_tensor(dt, {T, gc.Kd}, rng);
        std::vector<int> slots(static_cast<size_t>(in.R));
        for (int64_t r = 0; r < in.R; ++r)  // every fifth row unmapped (a padding row)
          slots[r] = r % 5 == 4 ? -1 : rng.randint(0, static_cast<int>(T * k));
        HostTensor a(dt, {in.R, gc.Kd});
        for (int64_t r = 0; r < in.R; ++r)
          for (int64_t c = 0; c < gc.Kd; ++c)
            a.set(r * gc.Kd + c, slots[r] < 0 ? 0.0 : x.get(slots[r] / k * gc.Kd + c));
        in.a = a;
        HostTensor c(dt, {in.R, gc.N});
        c.poison();
        HostTensor off = ints({in.E + 1}, in.offsets), r2s = ints({in.R}, slots);
        EXPECT_TRUE(api::gathered_grouped_gemm(x.view(), r2s.view(), k, in.b.view(), off.view(), layout, c.view(), 0));
        EXPECT_TRUE(c.bitwise_equal(run_gemm(in, layout, false, gc.N))) << "gathered rows differ from permuted rows";
      }
}

// api::gathered_grouped_gemm_wgrad runs no kernel on the CPU (false: the caller gathers and calls the wgrad),
// leaves db untouched, and checks its arguments by name first.
TEST(GroupedGemm, GatheredWgradIsTheCallersOnTheCpu) {
  Rng rng(71);
  const int64_t T = 9, Kd = 16, N = 24, E = 3, R = 18;
  const int k = 2;
  HostTensor x = random_tensor(DType::kF32, {T, Kd}, rng), dc = random_tensor(DType::kF32, {R, N}, rng);
  std::vector<int> slots(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) slots[r] = static_cast<int>(r);
  HostTensor off = ints({E + 1}, {0, 5, 5, static_cast<int>(R)}), r2s = ints({R}, slots);
  HostTensor db(DType::kF32, {E, N, Kd});
  db.poison();
  const HostTensor before = db;
  EXPECT_FALSE(api::gathered_grouped_gemm_wgrad(x.view(), r2s.view(), k, dc.view(), off.view(), WeightLayout::kNK,
                                                db.view(), 0));
  EXPECT_TRUE(db.bitwise_equal(before)) << "db written on the CPU";
  HostTensor bad_dc = random_tensor(DType::kF32, {R - 1, N}, rng);
  EXPECT_MOE8_ERROR("dc", api::gathered_grouped_gemm_wgrad(x.view(), r2s.view(), k, bad_dc.view(), off.view(),
                                                           WeightLayout::kNK, db.view(), 0));
  HostTensor bad_db(DType::kF32, {E, N, Kd + 8});
  EXPECT_MOE8_ERROR("db", api::gathered_grouped_gemm_wgrad(x.view(), r2s.view(), k, dc.view(), off.view(),
                                                           WeightLayout::kNK, bad_db.view(), 0));
  EXPECT_MOE8_ERROR("top_k", api::gathered_grouped_gemm_wgrad(x.view(), r2s.view(), 0, dc.view(), off.view(),
                                                              WeightLayout::kNK, db.view(), 0));
}

// The two layouts are the same product: with b_kn[e] = b_nk[e]^T both give the same c (up to rounding).
TEST(GroupedGemm, LayoutsAgree) {
  Rng rng(5);
  GemmCase gc{"t", {7, 0, 12}, 1, 2, 19, 11};
  GemmInputs nk = gemm_inputs(gc, DType::kF32, WeightLayout::kNK, rng);
  GemmInputs kn = nk;
  kn.b = HostTensor(DType::kF32, {nk.E, gc.Kd, gc.N});
  for (int64_t e = 0; e < nk.E; ++e)
    for (int64_t n = 0; n < gc.N; ++n)
      for (int64_t k = 0; k < gc.Kd; ++k) kn.b.set((e * gc.Kd + k) * gc.N + n, nk.b.get((e * gc.N + n) * gc.Kd + k));
  Expect e = gemm_ref(nk.a, nk.b, nk.offsets, WeightLayout::kNK, &nk.bias);
  EXPECT_TRUE(close_pair(run_gemm(kn, WeightLayout::kKN, true, gc.N), run_gemm(nk, WeightLayout::kNK, true, gc.N), e,
                         "c(KN) vs c(NK)"));
}

struct WgradOut {
  HostTensor db, dbias;
};

WgradOut run_wgrad(const HostTensor& a, const HostTensor& dc, const std::vector<int>& offsets, WeightLayout layout,
                   DType db_dtype, bool with_dbias) {
  int64_t E = static_cast<int64_t>(offsets.size()) - 1, Kd = a.shape()[1], N = dc.shape()[1];
  WgradOut o{HostTensor(db_dtype, layout == WeightLayout::kNK ? Shape{E, N, Kd} : Shape{E, Kd, N}),
             HostTensor(db_dtype, {E, N})};
  o.db.poison();
  o.dbias.poison();
  HostTensor off = ints({E + 1}, offsets);
  api::grouped_gemm_wgrad(a.view(), dc.view(), off.view(), layout, o.db.view(), with_dbias ? o.dbias.view() : absent(),
                          0);
  return o;
}

TEST(GroupedGemm, WgradMatchesReference) {
  uint64_t seed = 700;
  for (const GemmCase& gc : gemm_cases())
    for (DType dt : kFloatTypes)
      for (DType db_dt : dt == DType::kF32 ? std::vector<DType>{dt} : std::vector<DType>{DType::kF32, dt}) {
        for (WeightLayout layout : kLayouts)
          for (bool with_dbias : {false, true}) {
            SCOPED_TRACE(std::string(gc.name) + " a=" + name_of(dt) + " db=" + name_of(db_dt) + " " +
                         layout_name(layout) + (with_dbias ? " dbias" : ""));
            Rng rng(++seed);
            GemmInputs in = gemm_inputs(gc, dt, layout, rng);
            HostTensor dc = random_tensor(dt, {in.R, gc.N}, rng);
            for (int64_t i = in.offsets.back() * gc.N; i < dc.numel(); ++i) dc.set(i, -555.0);  // ignored rows
            WgradOut o = run_wgrad(in.a, dc, in.offsets, layout, db_dt, with_dbias);
            WgradRef ref = wgrad_ref(in.a, dc, in.offsets, layout);
            EXPECT_TRUE(close_to(o.db, ref.db, "db"));
            if (with_dbias) {
              EXPECT_TRUE(close_to(o.dbias, ref.dbias, "dbias"));
            }
            WgradOut again = run_wgrad(in.a, dc, in.offsets, layout, db_dt, with_dbias);
            EXPECT_TRUE(o.db.bitwise_equal(again.db)) << "two calls differ (db)";
            if (with_dbias) {
              EXPECT_TRUE(o.dbias.bitwise_equal(again.dbias)) << "two calls differ (dbias)";
            }
          }
      }
}

// Forward and wgrad are adjoint: <dc, grouped_gemm(a, b)> = <db, b> for the db that wgrad returns.
TEST(GroupedGemm, WgradIsAdjointOfForward) {
  Rng rng(11);
  GemmCase gc{"adj", {6, 0, 9, 1}, 1, 0, 10, 7};
  for (WeightLayout layout : kLayouts) {
    SCOPED_TRACE(layout_name(layout));
    GemmInputs in = gemm_inputs(gc, DType::kF32, layout, rng);
    HostTensor dc = random_tensor(DType::kF32, {in.R, gc.N}, rng);
    HostTensor c = run_gemm(in, layout, false, gc.N);
    WgradOut o = run_wgrad(in.a, dc, in.offsets, layout, DType::kF32, false);
    double lhs = 0, rhs = 0, scale = 0;
    for (int64_t i = 0; i < c.numel(); ++i) lhs += dc.get(i) * c.get(i), scale += std::fabs(dc.get(i) * c.get(i));
    for (int64_t i = 0; i < in.b.numel(); ++i) rhs += o.db.get(i) * in.b.get(i);
    EXPECT_NEAR(lhs, rhs, 1e-5 * scale + 1e-6);
  }
}

struct LowrankCase {
  const char* name;
  std::vector<int> sizes;  // rows per expert (E = sizes.size())
  int lead;                // rows before offsets[0], in no group
  int64_t tail;            // rows past offsets[E], in no group
  int64_t N;
  int rank;
};

std::vector<LowrankCase> lowrank_cases() {
  return {
      {"ragged_empty_expert", {5, 0, 13, 1}, 0, 3, 13, 7},
      {"single_row", {1}, 0, 0, 8, 1},
      {"single_row_in_no_group", {0, 0}, 1, 0, 8, 16},
      {"no_rows", {0, 0}, 0, 0, 5, 4},
      {"rows_before_and_after", {4, 9, 0}, 3, 2, 24, 16},
      {"all_in_no_group", {0, 0, 0}, 2, 6, 9, 3},
      {"rank17", {33, 0, 17, 2}, 1, 1, 40, 17},
      {"rank32", {40, 23}, 0, 5, 72, 32},
  };
}

LowrankInputs lowrank_inputs(const LowrankCase& c, DType dt, WeightLayout layout, Rng& rng) {
  LowrankInputs in;
  in.offsets = offsets_from_sizes(c.sizes);
  for (int& o : in.offsets) o += c.lead;
  const int64_t R = in.offsets.back() + c.tail, E = static_cast<int64_t>(c.sizes.size());
  in.h = random_tensor(dt, {R, c.N}, rng);
  in.t = random_tensor(dt, {R, c.rank}, rng);
  in.b = random_tensor(dt, layout == WeightLayout::kNK ? Shape{E, c.N, c.rank} : Shape{E, c.rank, c.N}, rng);
  return in;
}

HostTensor run_lowrank(const LowrankInputs& in, WeightLayout layout) {
  HostTensor out(in.h.dtype(), in.h.shape());
  out.poison();
  HostTensor off = ints({static_cast<int64_t>(in.offsets.size())}, in.offsets);
  // The API refuses offsets[0] > 0 on the CPU; the op it calls defines it: the rows before it are in no group.
  if (in.offsets[0] == 0)
    api::grouped_lowrank_add(in.h.view(), in.t.view(), in.b.view(), off.view(), layout, out.view(), 0);
  else
    cpu::grouped_lowrank_add(in.h.view(), in.t.view(), in.b.view(), off.view(), layout, out.view());
  return out;
}

TEST(GroupedGemm, LowrankAddMatchesReference) {
  uint64_t seed = 900;
  for (const LowrankCase& lc : lowrank_cases())
    for (DType dt : kFloatTypes)
      for (WeightLayout layout : kLayouts) {
        SCOPED_TRACE(std::string(lc.name) + " " + name_of(dt) + " " + layout_name(layout));
        Rng rng(++seed);
        LowrankInputs in = lowrank_inputs(lc, dt, layout, rng);
        HostTensor out = run_lowrank(in, layout);
        EXPECT_TRUE(close_to(out, lowrank_ref(in.h, in.t, in.b, in.offsets, layout), "out"));
        EXPECT_TRUE(rows_in_no_group_are_h(out, in));
        EXPECT_TRUE(out.bitwise_equal(run_lowrank(in, layout))) << "two calls differ";
      }
}

}  // namespace
}  // namespace moe8::test
