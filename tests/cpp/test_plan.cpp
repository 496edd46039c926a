// test_plan.cpp — api::build_dispatch_plan on the CPU against a plain-loop plan (counts, padded offsets,
// row_to_slot in (expert, slot) order, slot_to_row), exactly; plus plan_max_rows / plan_workspace_elems.
#include "test_ref.h"

namespace moe8::test {
namespace {

struct PlanOut {
  HostTensor counts, offsets, row_to_slot, slot_to_row;
  PlanOut(int E, int64_t R, int64_t slots)
      : counts(DType::kI32, {E}),
        offsets(DType::kI32, {E + 1}),
        row_to_slot(DType::kI32, {R}),
        slot_to_row(DType::kI32, {slots}) {
    for (HostTensor* t : {&counts, &offsets, &row_to_slot, &slot_to_row}) t->poison();
  }
  bool bitwise_equal(const PlanOut& o) const {
    return counts.bitwise_equal(o.counts) && offsets.bitwise_equal(o.offsets) &&
           row_to_slot.bitwise_equal(o.row_to_slot) && slot_to_row.bitwise_equal(o.slot_to_row);
  }
};

PlanOut run_plan(const HostTensor& ids, int E, int pad, int64_t R) {
  PlanOut o(E, R, ids.numel());
  api::build_dispatch_plan(ids.view(), E, pad, o.counts.view(), o.offsets.view(), o.row_to_slot.view(),
                           o.slot_to_row.view(), absent(), 0);
  return o;
}

struct PlanCase {
  const char* name;
  int T, K, E;
  double skew;
  std::vector<int> unused;
};

std::vector<PlanCase> plan_cases() {
  return {
      {"small", 13, 2, 8, 0.0, {}},
      {"single_token", 1, 1, 4, 0.0, {}},
      {"single_token_k4", 1, 4, 6, 0.0, {}},
      {"one_expert", 9, 1, 1, 0.0, {}},
      {"empty_experts", 30, 2, 9, {}, {0, 4, 8}},
      {"skewed", 200, 4, 16, 0.95, {}},
      {"skewed_empty", 77, 3, 12, 0.9, {5, 11}},
      {"no_tokens", 0, 2, 5, 0.0, {}},
      {"wide", 129, 8, 64, 0.0, {}},
  };
}

void check_plan(const PlanCase& c, int pad, int64_t extra_rows, uint64_t seed) {
  Rng rng(seed);
  std::vector<int> ids = random_ids(c.T, c.K, c.E, rng, c.skew, c.unused);
  int64_t max_rows = api::plan_max_rows(static_cast<int64_t>(c.T) * c.K, c.E, pad);
  const int64_t bound = static_cast<int64_t>(c.T) * c.K + static_cast<int64_t>(c.E) * (pad - 1);
  EXPECT_EQ(max_rows, (bound + pad - 1) / pad * pad);  // rounded up to a multiple of the padding
  int64_t R = max_rows + extra_rows;
  HostTensor idt = ints({c.T, c.K}, ids);
  PlanRef ref = plan_ref(ids, c.E, pad, R);
  PlanOut o = run_plan(idt, c.E, pad, R);
  EXPECT_TRUE(equal_ints(o.counts, ref.counts, "counts"));
  EXPECT_TRUE(equal_ints(o.offsets, ref.offsets, "offsets"));
  EXPECT_TRUE(equal_ints(o.row_to_slot, ref.row_to_slot, "row_to_slot"));
  EXPECT_TRUE(equal_ints(o.slot_to_row, ref.slot_to_row, "slot_to_row"));
  EXPECT_TRUE(o.bitwise_equal(run_plan(idt, c.E, pad, R))) << "two calls differ";
}

TEST(Plan, MatchesReferencePad1) {
  uint64_t seed = 1;
  for (const PlanCase& c : plan_cases()) {
    SCOPED_TRACE(c.name);
    check_plan(c, 1, 0, ++seed);
  }
}

TEST(Plan, MatchesReferencePad16) {
  uint64_t seed = 100;
  for (const PlanCase& c : plan_cases()) {
    SCOPED_TRACE(c.name);
    check_plan(c, 16, 0, ++seed);
  }
}

TEST(Plan, MatchesReferenceOddPadAndSpareRows) {
  uint64_t seed = 200;
  for (const PlanCase& c : plan_cases())
    for (int pad : {3, 8, 128}) {
      SCOPED_TRACE(std::string(c.name) + " pad=" + std::to_string(pad));
      check_plan(c, pad, 5, ++seed);  // rows past offsets[E] must be -1
    }
}

// A hand-checked plan: ids [[2,0],[0,1],[2,2]] (a repeated expert within a token is still a slot), E=4.
TEST(Plan, HandWorkedExample) {
  HostTensor ids = ints({3, 2}, {2, 0, 0, 1, 2, 2});
  PlanOut o = run_plan(ids, 4, 1, 6);
  EXPECT_TRUE(equal_ints(o.counts, {2, 1, 3, 0}, "counts"));
  EXPECT_TRUE(equal_ints(o.offsets, {0, 2, 3, 6, 6}, "offsets"));
  EXPECT_TRUE(equal_ints(o.row_to_slot, {1, 2, 3, 0, 4, 5}, "row_to_slot"));
  EXPECT_TRUE(equal_ints(o.slot_to_row, {3, 0, 1, 2, 4, 5}, "slot_to_row"));

  PlanOut p = run_plan(ids, 4, 4, api::plan_max_rows(6, 4, 4));  // 6 + 4*3 = 18, rounded up to 20 rows
  EXPECT_TRUE(equal_ints(p.offsets, {0, 4, 8, 12, 12}, "offsets"));
  EXPECT_TRUE(equal_ints(p.row_to_slot, {1, 2, -1, -1, 3, -1, -1, -1, 0, 4, 5, -1, -1, -1, -1, -1, -1, -1, -1, -1},
                         "row_to_slot"));
  EXPECT_TRUE(equal_ints(p.slot_to_row, {8, 0, 1, 4, 9, 10}, "slot_to_row"));
}

TEST(Plan, WorkspaceAndMaxRows) {
  EXPECT_EQ(api::plan_workspace_elems(1000, 64, false), 0);
  EXPECT_EQ(api::plan_max_rows(0, 8, 1), 0);
  EXPECT_EQ(api::plan_max_rows(4096 * 8, 128, 128), 4096 * 8 + 128 * 127);
}

}  // namespace
}  // namespace moe8::test
