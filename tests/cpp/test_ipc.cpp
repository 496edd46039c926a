// test_ipc.cpp — the host-side logic of the `ipc` transport that needs no GPU: the buffer layout (sections
// in order, aligned, disjoint; every row, scale, metadata and count place inside its section and distinct;
// the total exact), the (source, expert) block orders, the error codes, and the validation of a buffer's
// configuration (named arguments and sizes); with a GPU, one rank's whole data path (both directions, both
// vector widths, FP8 scales) against the plan. Several ranks: tests/python/test_parallel_ipc.py.
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "api/ipc.h"
#include "core/error.h"
#include "core/ipc_layout.h"
#include "test_ref.h"
#ifdef MOE8_WITH_CUDA
#include "test_cuda_util.h"
#endif

namespace moe8::test {
namespace {

struct LayoutCase {
  int world, el;
  int64_t capacity, row_bytes, scale_bytes;
};

std::vector<LayoutCase> layout_cases() {
  return {
      {1, 1, 1, 16, 0},         // the smallest
      {2, 4, 13, 272, 0},       // bf16 H 136, capacity not a multiple of anything
      {4, 4, 256, 512, 0},      // bf16 H 256
      {3, 5, 7, 256, 8},        // FP8 H 256: 2 scales, padded to 16 bytes
      {8, 32, 4096, 14336, 0},  // DeepSeek-V3-like: H 7168 bf16, 512 tokens x top-8
      {8, 2, 33, 7168, 224},    // FP8 H 7168: 56 scales
      {64, 1, 2, 16, 4},        // the most ranks
  };
}

TEST(IpcLayout, SectionsAreOrderedAlignedAndDisjoint) {
  for (const LayoutCase& c : layout_cases()) {
    SCOPED_TRACE("world " + std::to_string(c.world) + " capacity " + std::to_string(c.capacity));
    const IpcLayout L = make_ipc_layout(c.world, c.el, c.capacity, c.row_bytes, c.scale_bytes);
    EXPECT_EQ(L.stride % 16, 0);
    EXPECT_GE(L.stride, c.row_bytes + c.scale_bytes);
    EXPECT_LT(L.stride, c.row_bytes + c.scale_bytes + 16);
    const std::vector<std::pair<int64_t, int64_t>> sections = {
        {L.signals, 8 * c.world},
        {L.abort, 8},
        {L.counts, 4 * c.world * (c.el + 1)},
        {L.meta, 16 * c.world * c.capacity},
        {L.rows, L.stride * c.world * c.capacity},
        {L.ret, L.stride * c.capacity},
    };
    int64_t end = 0;
    for (const auto& [start, bytes] : sections) {
      EXPECT_EQ(start % kIpcAlign, 0);
      EXPECT_GE(start, end);              // after the previous section
      EXPECT_LT(start - end, kIpcAlign);  // with no more than the alignment's padding
      end = start + bytes;
    }
    EXPECT_GE(L.total, end);
    EXPECT_LT(L.total - end, kIpcAlign);
  }
}

TEST(IpcLayout, EveryPlaceIsInsideItsSectionAndDistinct) {
  for (const LayoutCase& c : layout_cases()) {
    if (c.world * c.capacity > 20000) continue;  // the enumeration below is exhaustive
    SCOPED_TRACE("world " + std::to_string(c.world) + " capacity " + std::to_string(c.capacity));
    const IpcLayout L = make_ipc_layout(c.world, c.el, c.capacity, c.row_bytes, c.scale_bytes);
    std::set<int64_t> rows, metas, counts, signals;
    for (int s = 0; s < c.world; ++s) {
      EXPECT_TRUE(signals.insert(L.signal_at(s)).second);
      EXPECT_GE(L.signal_at(s), L.signals);
      EXPECT_LE(L.signal_at(s) + 8, L.abort);
      for (int e = 0; e <= c.el; ++e) {
        EXPECT_TRUE(counts.insert(L.count_at(s, e)).second);
        EXPECT_GE(L.count_at(s, e), L.counts);
        EXPECT_LE(L.count_at(s, e) + 4, L.meta);
      }
      for (int64_t i = 0; i < c.capacity; ++i) {
        const int64_t r = L.row_at(s, i), m = L.meta_at(s, i);
        EXPECT_TRUE(rows.insert(r).second);
        EXPECT_TRUE(metas.insert(m).second);
        EXPECT_EQ(r % 16, 0);
        EXPECT_EQ(m % 16, 0);
        EXPECT_GE(r, L.rows);
        EXPECT_LE(r + L.stride, L.ret);  // the row and its scales
        EXPECT_EQ(L.scale_at(s, i), r + c.row_bytes);
        EXPECT_GE(m, L.meta);
        EXPECT_LE(m + 16, L.rows);
      }
    }
    // rows of one region are consecutive, regions follow each other
    EXPECT_EQ(L.row_at(0, 1) - L.row_at(0, 0), L.stride);
    if (c.world > 1) {
      EXPECT_EQ(L.row_at(1, 0), L.row_at(0, c.capacity - 1) + L.stride);
    }
    for (int64_t i = 0; i < c.capacity; ++i) {
      EXPECT_GE(L.ret_at(i), L.ret);
      EXPECT_LE(L.ret_at(i) + L.stride, L.total);
      EXPECT_EQ(L.ret_scale_at(i), L.ret_at(i) + c.row_bytes);
    }
  }
}

TEST(IpcLayout, BlockOrdersAreBijections) {
  for (int W : {1, 2, 3, 8}) {
    for (int El : {1, 4, 5}) {
      for (bool expert_major : {false, true}) {
        std::vector<int> seen(W * El, 0);
        for (int s = 0; s < W; ++s) {
          for (int e = 0; e < El; ++e) {
            const int b = ipc_block(s, e, W, El, expert_major);
            ASSERT_GE(b, 0);
            ASSERT_LT(b, W * El);
            ++seen[b];
            int s2 = -1, e2 = -1;
            ipc_block_source_expert(b, W, El, expert_major, s2, e2);
            EXPECT_EQ(s2, s);
            EXPECT_EQ(e2, e);
          }
        }
        for (int n : seen) EXPECT_EQ(n, 1);
        // source-major: the blocks of one source are consecutive; expert-major: those of one expert
        if (W > 1 && El > 1) {
          EXPECT_EQ(ipc_block(0, 1, W, El, expert_major) - ipc_block(0, 0, W, El, expert_major), expert_major ? W : 1);
        }
      }
    }
  }
}

TEST(IpcLayout, ErrorCodesRoundTrip) {
  for (IpcFault kind : {IpcFault::kTimeout, IpcFault::kBadCounts}) {
    for (int phase = 0; phase < 4; ++phase) {
      for (int peer : {0, 1, 63}) {
        for (uint64_t epoch : {uint64_t(1), uint64_t(123456789), (uint64_t(1) << 40) + 7}) {
          const uint64_t code = ipc_error_code(kind, phase, peer, epoch);
          EXPECT_NE(code, 0u);  // 0 means "no error"
          const IpcErrorInfo e = ipc_decode_error(code);
          EXPECT_EQ(e.kind, kind);
          EXPECT_EQ(e.phase, phase);
          EXPECT_EQ(e.peer, peer);
          EXPECT_EQ(e.epoch, static_cast<uint32_t>(epoch));
        }
      }
    }
  }
  EXPECT_NE(std::string(ipc_phase_name(0)).find("dispatch"), std::string::npos);
  EXPECT_NE(std::string(ipc_phase_name(3)).find("combine"), std::string::npos);
}

void expect_error(const std::string& want, int rank, int world, int el, int64_t capacity, int64_t hidden, DType dtype,
                  int64_t scale_cols) {
  try {
    api::ipc_layout(rank, world, el, capacity, hidden, dtype, scale_cols);
    ADD_FAILURE() << "no error, expected: " << want;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
}

TEST(IpcLayout, ConfigurationIsValidated) {
  expect_error("world: expected 1..64 ranks, got 0", 0, 0, 4, 8, 64, DType::kBF16, 0);
  expect_error("world: expected 1..64 ranks, got 65", 0, 65, 4, 8, 64, DType::kBF16, 0);
  expect_error("rank: expected 0..1, got 2", 2, 2, 4, 8, 64, DType::kBF16, 0);
  expect_error("num_local_experts: expected >= 1, got 0", 0, 2, 0, 8, 64, DType::kBF16, 0);
  expect_error("capacity: expected >= 1 rows per source", 0, 2, 4, 0, 64, DType::kBF16, 0);
  expect_error("capacity: 1073741824 rows per source x 2 sources", 0, 2, 4, int64_t(1) << 30, 64, DType::kBF16, 0);
  expect_error("hidden: a row of 60 bfloat16 is 120 bytes; expected a multiple of 16 (hidden a multiple of 8)", 0, 2, 4,
               8, 60, DType::kBF16, 0);
  expect_error("hidden: a row of 6 float32 is 24 bytes", 0, 2, 4, 8, 6, DType::kF32, 0);
  expect_error("dtype: expected float32, float16, bfloat16, uint8 or float8_e4m3fn rows, got int32", 0, 2, 4, 8, 64,
               DType::kI32, 0);
  expect_error("scale_cols: expected >= 0, got -1", 0, 2, 4, 8, 256, DType::kU8, -1);
  const IpcLayout L = api::ipc_layout(1, 2, 4, 8, 256, DType::kF8E4M3, 2);
  EXPECT_EQ(L.row_bytes, 256);
  EXPECT_EQ(L.scale_bytes, 8);
  EXPECT_EQ(L.stride, 272);
}

#ifdef MOE8_WITH_CUDA
struct RoundTripCase {
  const char* name;
  int T, K, E;
  int64_t H;
  DType dtype;
  int64_t scale_cols;
  bool misaligned;  // tensors 4 bytes past a 16-byte boundary: the 4-byte copy path
};

class IpcCudaTest : public CudaTest {};

bool rows_equal(const HostTensor& a, int64_t ra, const HostTensor& b, int64_t rb, int64_t row_bytes) {
  return std::memcmp(static_cast<const uint8_t*>(a.data()) + ra * row_bytes,
                     static_cast<const uint8_t*>(b.data()) + rb * row_bytes, row_bytes) == 0;
}

// A device copy of t placed `shift` bytes past a 16-byte boundary.
TensorView upload_at(std::vector<std::unique_ptr<DeviceBuffer>>& keep, const HostTensor& t, size_t shift) {
  keep.push_back(std::make_unique<DeviceBuffer>(t.nbytes() + 16));
  uint8_t* p = static_cast<uint8_t*>(keep.back()->get()) + shift;
  cuda_ok(cudaMemcpy(p, t.data(), t.nbytes(), cudaMemcpyHostToDevice), "upload");
  return view_of(p, t.dtype(), t.shape(), DeviceType::kCUDA);
}

void download(HostTensor& t, const TensorView& v) {
  cuda_ok(cudaDeviceSynchronize(), "synchronize");
  cuda_ok(cudaMemcpy(t.data(), v.data, t.nbytes(), cudaMemcpyDeviceToHost), "download");
}

TEST_F(IpcCudaTest, OneRankRoundTripMatchesThePlan) {
  const std::vector<RoundTripCase> cases = {
      {"bf16", 37, 2, 8, 136, DType::kBF16, 0, false},     {"bf16_one_token", 1, 4, 6, 64, DType::kBF16, 0, false},
      {"no_tokens", 0, 2, 4, 64, DType::kBF16, 0, false},  {"f32_misaligned", 23, 3, 5, 36, DType::kF32, 0, true},
      {"fp8_scales", 19, 2, 4, 256, DType::kU8, 2, false},
  };
  Rng rng(7);
  for (const RoundTripCase& c : cases) {
    SCOPED_TRACE(c.name);
    const int64_t slots = int64_t(c.T) * c.K, row_bytes = c.H * dtype_size(c.dtype), S = c.scale_cols;
    const std::vector<int> ids = random_ids(c.T, c.K, c.E, rng);
    const PlanRef plan = plan_ref(ids, c.E, 1, slots);
    const auto random_rows = [&](int64_t n) {
      if (c.dtype != DType::kU8) return random_tensor(c.dtype, {n, c.H}, rng, -4, 4);
      HostTensor q(DType::kU8, {n, c.H});
      for (int64_t i = 0; i < q.numel(); ++i) q.set(i, rng.randint(0, 256));
      return q;
    };
    HostTensor x = random_rows(c.T), g = random_rows(slots), xs = random_tensor(DType::kF32, {c.T, S}, rng),
               gs = random_tensor(DType::kF32, {slots, S}, rng);
    HostTensor counts = ints({c.E}, plan.counts), offsets = ints({c.E + 1}, plan.offsets),
               r2s = ints({slots}, plan.row_to_slot);
    HostTensor rows(x.dtype(), {slots, c.H}), rows_s(DType::kF32, {slots, S}), lids(DType::kI32, {slots}),
        ret(DType::kI32, {slots}), rc(DType::kI32, {1, c.E + 1}), ro(DType::kI32, {c.E + 1}), rb(DType::kI32, {c.E}),
        back(x.dtype(), {slots, c.H}), back_s(DType::kF32, {slots, S}), grows(x.dtype(), {slots, c.H}),
        grows_s(DType::kF32, {slots, S});
    std::vector<std::unique_ptr<DeviceBuffer>> keep;
    const size_t shift = c.misaligned ? 4 : 0;
    const auto dev = [&](HostTensor& t) {
      t.poison();
      return upload_at(keep, t, shift);
    };
    const auto opt_dev = [&](HostTensor& t) { return S > 0 ? dev(t) : absent(); };
    TensorView dx = upload_at(keep, x, shift), dxs = S > 0 ? upload_at(keep, xs, shift) : absent(),
               dg = upload_at(keep, g, shift), dgs = S > 0 ? upload_at(keep, gs, shift) : absent(),
               dcounts = upload_at(keep, counts, 0), doff = upload_at(keep, offsets, 0), dr2s = upload_at(keep, r2s, 0);
    TensorView drows = dev(rows), drows_s = opt_dev(rows_s), dlids = dev(lids), dret = dev(ret), drc = dev(rc),
               dro = dev(ro), drb = dev(rb), dback = dev(back), dback_s = opt_dev(back_s), dgrows = dev(grows),
               dgrows_s = opt_dev(grows_s);

    api::IpcBuffer buf(0, 1, c.E, slots + 3, c.H, c.dtype, S, 0);
    buf.open({buf.handle()});
    buf.dispatch_send(dx, dxs, dr2s, doff, dcounts, absent(), c.K, true, 10.0, 0, true);
    buf.dispatch_plan(drc, dro, drb, false, 0);
    buf.dispatch_recv(dro, drb, false, drows, drows_s, dlids, dret, 0);
    buf.combine_send(drows, drows_s, dret, 10.0, 0, true);  // results = the rows themselves, back
    buf.combine_recv(dback, dback_s, 0);
    // gradients in send order (FP8 rows travel with their scales)
    buf.dispatch_send(dg, dgs, absent(), doff, absent(), absent(), 1, false, 10.0, 0);
    buf.dispatch_recv(dro, drb, false, dgrows, dgrows_s, absent(), absent(), 0);
    buf.check(true, 0);
    for (auto [t, v] : {std::pair<HostTensor*, TensorView>{&rows, drows},
                        {&lids, dlids},
                        {&ret, dret},
                        {&rc, drc},
                        {&ro, dro},
                        {&rb, drb},
                        {&back, dback},
                        {&grows, dgrows}})
      download(*t, v);
    if (S > 0) {
      download(rows_s, drows_s);
      download(back_s, dback_s);
      download(grows_s, dgrows_s);
    }
    for (int e = 0; e < c.E; ++e) {
      EXPECT_EQ(rc.i32()[e], plan.counts[e]);
      EXPECT_EQ(ro.i32()[e], plan.offsets[e]);
      EXPECT_EQ(rb.i32()[e], plan.offsets[e]);  // one source: its region is the send order
    }
    EXPECT_EQ(rc.i32()[c.E], 0);  // bad ids
    EXPECT_EQ(ro.i32()[c.E], slots);
    for (int64_t i = 0; i < slots; ++i) {
      const int slot = plan.row_to_slot[i], t = slot / c.K;
      EXPECT_TRUE(rows_equal(rows, i, x, t, row_bytes)) << "row " << i;
      if (S > 0) {
        EXPECT_TRUE(rows_equal(rows_s, i, xs, t, 4 * S)) << "scales of row " << i;
      }
      EXPECT_EQ(lids.i32()[i], ids[slot]);
      EXPECT_EQ(ret.i32()[i], i);
      EXPECT_TRUE(rows_equal(back, i, rows, i, row_bytes)) << "returned row " << i;
      if (S > 0) {
        EXPECT_TRUE(rows_equal(back_s, i, rows_s, i, 4 * S)) << "returned scales of row " << i;
      }
      EXPECT_TRUE(rows_equal(grows, i, g, i, row_bytes)) << "gradient row " << i;
      if (S > 0) {
        EXPECT_TRUE(rows_equal(grows_s, i, gs, i, 4 * S)) << "scales of gradient row " << i;
      }
    }
  }
}
#endif

#ifndef MOE8_WITH_CUDA
TEST(IpcBuffer, RaisesWithoutCuda) {
  try {
    api::IpcBuffer buf(0, 2, 4, 8, 64, DType::kBF16, 0, 0);
    ADD_FAILURE() << "constructed without CUDA";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("built without CUDA"), std::string::npos) << e.what();
  }
}
#endif

}  // namespace
}  // namespace moe8::test
