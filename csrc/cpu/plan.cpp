// plan.cpp — CPU reference of the dispatch plan: a stable counting sort of (token, slot) pairs by expert.
#include <vector>

#include "cpu/common.h"
#include "cpu/ops.h"

namespace moe8::cpu {

void build_dispatch_plan(const TensorView& ids, int num_experts, int pad_multiple, const TensorView& counts,
                         const TensorView& offsets, const TensorView& row_to_slot, const TensorView& slot_to_row) {
  const int64_t slots = ids.numel();
  const int32_t* id = ids.ptr<int32_t>();
  int32_t* cnt = counts.ptr<int32_t>();
  int32_t* off = offsets.ptr<int32_t>();
  for (int e = 0; e < num_experts; ++e) cnt[e] = 0;
  for (int64_t s = 0; s < slots; ++s)  // an id out of range (never past the API) joins no expert
    if (in_range(id[s], num_experts)) ++cnt[id[s]];
  off[0] = 0;
  for (int e = 0; e < num_experts; ++e) off[e + 1] = off[e] + (cnt[e] + pad_multiple - 1) / pad_multiple * pad_multiple;
  int32_t* r2s = row_to_slot.ptr<int32_t>();
  for (int64_t r = 0; r < row_to_slot.numel(); ++r) r2s[r] = -1;
  std::vector<int32_t> next(off, off + num_experts);
  for (int64_t s = 0; s < slots; ++s) {  // ascending slot order makes the sort stable
    if (!in_range(id[s], num_experts)) {
      slot_to_row.ptr<int32_t>()[s] = -1;
      continue;
    }
    int32_t row = next[id[s]]++;
    r2s[row] = static_cast<int32_t>(s);
    slot_to_row.ptr<int32_t>()[s] = row;
  }
}

}  // namespace moe8::cpu
