// test_bounds.cpp — index values out of range never move the CPU core outside its tensors. The API checks
// them on the CPU even when the caller passes check_indices = false (a pass over host memory, no sync), and
// the CPU references, called directly, skip or clamp what is out of range: ids join no expert, slots and
// rows out of range read as none, offsets are clamped into [previous, rows]. Every buffer is poisoned and
// sized exactly, so a write or read outside would show as a changed value or a sanitizer report.
#include "cpu/ops.h"
#include "test_ref.h"

namespace moe8::test {
namespace {

constexpr bool kNoCheck = false;

HostTensor floats(const Shape& s, double start = 1.0) {
  HostTensor t(DType::kF32, s);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, start + static_cast<double>(i));
  return t;
}

TEST(Bounds, ApiChecksValuesOnTheCpuWithoutBeingAsked) {
  {  // plan: an id past E
    HostTensor ids = ints({2, 2}, {0, 1, 2, 7});
    HostTensor counts(DType::kI32, {4}), off(DType::kI32, {5}), r2s(DType::kI32, {4}), s2r(DType::kI32, {4});
    EXPECT_MOE8_ERROR("ids", api::build_dispatch_plan(ids.view(), 4, 1, counts.view(), off.view(), r2s.view(),
                                                      s2r.view(), absent(), 0, kNoCheck));
  }
  {  // gather_rows: a slot past T*k, and one below -1
    HostTensor src = floats({2, 3}), dst(DType::kF32, {3, 3});
    for (int bad : {4, -2, 1 << 30}) {
      HostTensor r2s = ints({3}, {0, bad, -1});
      EXPECT_MOE8_ERROR("row_to_slot",
                        api::gather_rows(src.view(), r2s.view(), 2, absent(), dst.view(), 0, kNoCheck, absent()));
    }
  }
  {  // combine_rows / combine_weights_grad: a row past R
    HostTensor rows = floats({3, 2}), out(DType::kF32, {2, 2}), dw(DType::kF32, {2, 2}), dy = floats({2, 2});
    HostTensor s2r = ints({2, 2}, {0, 1, 2, 3});
    EXPECT_MOE8_ERROR("slot_to_row", api::combine_rows(rows.view(), s2r.view(), absent(), out.view(), 0, kNoCheck));
    EXPECT_MOE8_ERROR("slot_to_row",
                      api::combine_weights_grad(dy.view(), rows.view(), s2r.view(), dw.view(), 0, kNoCheck));
  }
  {  // grouped GEMM: offsets past the rows, decreasing, not starting at 0
    HostTensor a = floats({4, 2}), b = floats({2, 3, 2}), c(DType::kF32, {4, 3});
    for (const std::vector<int>& bad : {std::vector<int>{0, 2, 9}, {0, 3, 1}, {1, 2, 4}}) {
      HostTensor off = ints({3}, bad);
      EXPECT_MOE8_ERROR("offsets", api::grouped_gemm(a.view(), b.view(), off.view(), WeightLayout::kNK, absent(),
                                                     c.view(), 0, kNoCheck));
      HostTensor db(DType::kF32, {2, 3, 2}), dc = floats({4, 3});
      EXPECT_MOE8_ERROR("offsets", api::grouped_gemm_wgrad(a.view(), dc.view(), off.view(), WeightLayout::kNK,
                                                           db.view(), absent(), 0, kNoCheck));
    }
  }
  {  // FP8 row quantisation with the permute: a slot past T*k; slot_to_row naming a row past R
    HostTensor x = floats({2, 3}), q(DType::kU8, {3, 3}), sc(DType::kF32, {3, 1});
    HostTensor r2s = ints({3}, {0, 2, -1});
    EXPECT_MOE8_ERROR("row_to_slot",
                      api::quantize_rows_1x128(x.view(), r2s.view(), 1, q.view(), sc.view(), 0, kNoCheck, absent()));
    HostTensor good = ints({3}, {0, 1, -1}), s2r = ints({2, 1}, {0, 3});
    EXPECT_MOE8_ERROR("slot_to_row",
                      api::quantize_rows_1x128(x.view(), good.view(), 1, q.view(), sc.view(), 0, kNoCheck, s2r.view()));
  }
  {  // routed activation backward: a slot past the weights
    HostTensor h = floats({2, 2}), dout = floats({2, 1}), w = floats({2}), r2s = ints({2}, {0, 2});
    HostTensor dh(DType::kF32, {2, 2}), aw(DType::kF32, {2, 1}), dw(DType::kF32, {2});
    EXPECT_MOE8_ERROR("row_to_slot",
                      api::activation_backward_routed(h.view(), dout.view(), w.view(), r2s.view(), ActParams{},
                                                      dh.view(), aw.view(), dw.view(), 0, kNoCheck));
  }
  {  // expert low-rank add: offsets past the rows, decreasing
    HostTensor h = floats({3, 2}), t = floats({3, 1}), b = floats({2, 2, 1}), out(DType::kF32, {3, 2});
    for (const std::vector<int>& bad : {std::vector<int>{0, 2, 9}, {0, 3, 1}}) {
      HostTensor off = ints({3}, bad);
      EXPECT_MOE8_ERROR("offsets", api::grouped_lowrank_add(h.view(), t.view(), b.view(), off.view(), WeightLayout::kNK,
                                                            out.view(), 0, kNoCheck));
    }
  }
  {  // route backward: an id past E
    HostTensor logits = floats({2, 4}, -1.0), ids = ints({2, 1}, {0, 4}), gw = floats({2, 1});
    HostTensor grad(DType::kF32, {2, 4});
    RouteParams p;
    p.k = 1;
    EXPECT_MOE8_ERROR("ids", api::route_backward(logits.view(), absent(), p, ids.view(), gw.view(), absent(), absent(),
                                                 grad.view(), 0, kNoCheck));
  }
}

TEST(Bounds, CpuPlanSkipsIdsOutOfRange) {
  HostTensor ids = ints({3, 1}, {1, 9, -4});  // only slot 0 names an expert
  HostTensor counts(DType::kI32, {2}), off(DType::kI32, {3}), r2s(DType::kI32, {3}), s2r(DType::kI32, {3});
  for (HostTensor* t : {&counts, &off, &r2s, &s2r}) t->poison();
  cpu::build_dispatch_plan(ids.view(), 2, 1, counts.view(), off.view(), r2s.view(), s2r.view());
  EXPECT_EQ(counts.i32()[0], 0);
  EXPECT_EQ(counts.i32()[1], 1);
  EXPECT_EQ(off.i32()[2], 1);
  EXPECT_EQ(r2s.i32()[0], 0);
  EXPECT_EQ(r2s.i32()[1], -1);
  EXPECT_EQ(s2r.i32()[0], 0);
  EXPECT_EQ(s2r.i32()[1], -1);
  EXPECT_EQ(s2r.i32()[2], -1);
}

TEST(Bounds, CpuRowMovementReadsOutOfRangeIndicesAsNone) {
  HostTensor src = floats({2, 3});  // T 2, k 1
  HostTensor r2s = ints({3}, {1, 2, -7}), dst(DType::kF32, {3, 3});
  dst.poison();
  cpu::gather_rows(src.view(), r2s.view(), 1, absent(), dst.view());
  for (int h = 0; h < 3; ++h) {
    EXPECT_EQ(dst.get(h), src.get(3 + h));
    EXPECT_EQ(dst.get(3 + h), 0.0);  // slot 2 >= T*k: zeros, like padding
    EXPECT_EQ(dst.get(6 + h), 0.0);
  }
  HostTensor rows = floats({2, 2}), s2r = ints({1, 3}, {1, 5, -3}), out(DType::kF32, {1, 2});
  out.poison();
  cpu::combine_rows(rows.view(), s2r.view(), absent(), out.view());
  EXPECT_EQ(out.get(0), rows.get(2));
  EXPECT_EQ(out.get(1), rows.get(3));
  HostTensor dy = floats({1, 2}), dw(DType::kF32, {1, 3});
  dw.poison();
  cpu::combine_weights_grad(dy.view(), rows.view(), s2r.view(), dw.view());
  EXPECT_EQ(dw.get(0), dy.get(0) * rows.get(2) + dy.get(1) * rows.get(3));
  EXPECT_EQ(dw.get(1), 0.0);
  EXPECT_EQ(dw.get(2), 0.0);
}

TEST(Bounds, CpuRowQuantisationReadsOutOfRangeSlotsAsPadding) {
  // T 2, k 1: row 0 gathers token 1; rows 1 (slot 2 >= T k) and 2 (slot -7) are padding: zero codes, scale 1.
  HostTensor x = floats({2, 130}, -60.0), r2s = ints({3}, {1, 2, -7});
  HostTensor q(DType::kU8, {3, 130}), sc(DType::kF32, {3, 2});
  q.poison();
  sc.poison();
  cpu::quantize_rows_1x128(x.view(), r2s.view(), 1, q.view(), sc.view());
  HostTensor q_ref(DType::kU8, {2, 130}), sc_ref(DType::kF32, {2, 2});  // the rows quantised in place
  cpu::quantize_rows_1x128(x.view(), absent(), 1, q_ref.view(), sc_ref.view());
  for (int i = 0; i < 130; ++i) {
    EXPECT_EQ(q.get(i), q_ref.get(130 + i)) << i;
    EXPECT_EQ(q.get(130 + i), 0.0) << i;
    EXPECT_EQ(q.get(260 + i), 0.0) << i;
  }
  for (int b = 0; b < 2; ++b) {
    EXPECT_EQ(sc.get(b), sc_ref.get(2 + b));
    EXPECT_EQ(sc.get(2 + b), 1.0);
    EXPECT_EQ(sc.get(4 + b), 1.0);
  }
}

TEST(Bounds, CpuRoutedActivationBackwardReadsOutOfRangeSlotsAsPadding) {
  // SwiGLU, I 1: row 0 is slot 0; rows 1 (slot 5 >= 2 weights) and 2 (slot -3) weigh 0 and write no d_weights.
  HostTensor h = floats({3, 2}, 0.5), dout = floats({3, 1}, 2.0), w = floats({2}, 0.25);
  HostTensor r2s = ints({3}, {0, 5, -3}), only0 = ints({3}, {0, -1, -1});
  const auto run = [&](const HostTensor& slots, HostTensor& dh, HostTensor& aw, HostTensor& dw) {
    dh.poison();
    aw.poison();
    dw.poison();
    cpu::activation_backward_routed(h.view(), dout.view(), w.view(), slots.view(), ActParams{}, dh.view(), aw.view(),
                                    dw.view());
  };
  HostTensor dh(DType::kF32, {3, 2}), aw(DType::kF32, {3, 1}), dw(DType::kF32, {2});
  HostTensor dh_ref(DType::kF32, {3, 2}), aw_ref(DType::kF32, {3, 1}), dw_ref(DType::kF32, {2});
  run(r2s, dh, aw, dw);
  run(only0, dh_ref, aw_ref, dw_ref);
  EXPECT_NE(dh.get(0), 0.0);  // row 0 carries a real gradient
  for (int i = 0; i < 6; ++i) EXPECT_EQ(dh.get(i), dh_ref.get(i)) << i;
  for (int i = 0; i < 3; ++i) EXPECT_EQ(aw.get(i), aw_ref.get(i)) << i;
  for (int i = 2; i < 6; ++i) EXPECT_EQ(dh.get(i), 0.0) << i;
  EXPECT_EQ(aw.get(1), 0.0);
  EXPECT_EQ(aw.get(2), 0.0);
  EXPECT_EQ(dw.get(0), dw_ref.get(0));
  EXPECT_TRUE(std::isnan(dw.get(1)));  // no row names slot 1: left as it was
}

TEST(Bounds, CpuGroupedGemmClampsOffsets) {
  // a [3, 1] = 1, 2, 3; b[e] [1, 1] = e + 1. offsets {0, 2, 99}: group 1 is clamped to rows [2, 3).
  HostTensor a = floats({3, 1}), b = floats({2, 1, 1}), off = ints({3}, {0, 2, 99}), c(DType::kF32, {3, 1});
  c.poison();
  cpu::grouped_gemm(a.view(), b.view(), off.view(), WeightLayout::kNK, absent(), c.view());
  EXPECT_EQ(c.get(0), 1.0);
  EXPECT_EQ(c.get(1), 2.0);
  EXPECT_EQ(c.get(2), 6.0);
  // decreasing {0, 3, 1}: group 1 is read as empty, every row belongs to group 0
  HostTensor dec = ints({3}, {0, 3, 1});
  c.poison();
  cpu::grouped_gemm(a.view(), b.view(), dec.view(), WeightLayout::kNK, absent(), c.view());
  for (int r = 0; r < 3; ++r) EXPECT_EQ(c.get(r), a.get(r));
  HostTensor dc = floats({3, 1}), db(DType::kF32, {2, 1, 1});
  db.poison();
  cpu::grouped_gemm_wgrad(a.view(), dc.view(), off.view(), WeightLayout::kNK, db.view(), absent());
  EXPECT_EQ(db.get(0), 1.0 * 1.0 + 2.0 * 2.0);
  EXPECT_EQ(db.get(1), 3.0 * 3.0);
  HostTensor h = floats({3, 1}), t = floats({3, 1}), out(DType::kF32, {3, 1}), neg = ints({3}, {-5, 1, 99});
  out.poison();
  cpu::grouped_lowrank_add(h.view(), t.view(), b.view(), neg.view(), WeightLayout::kNK, out.view());
  EXPECT_EQ(out.get(0), 1.0 + 1.0);  // row 0: group 0 (offsets[0] clamped to 0)
  EXPECT_EQ(out.get(2), 3.0 + 3.0 * 2.0);
}

}  // namespace
}  // namespace moe8::test
