// test_cuda_sm90.cpp — the Hopper CUTLASS grouped GEMMs (cuda/grouped_gemm_sm90.h) against a host
// reference on the same bf16 inputs (products summed in double): forward (kNK), dgrad (kKN), wgrad and
// the kKN wgrad by swapping operands; ragged groups with empty / 1-row / tile-edge experts and rows past
// offsets[E], a balanced 128-expert model shape (sampled rows), outputs poisoned first (0xFF bytes),
// exact zeros where nothing is computed, determinism, replay of a captured CUDA graph after the offsets
// change on the device, and TFLOP/s on real MoE shapes (printed, not asserted).
// Skips, saying why, without a GPU, on a GPU other than compute capability 9.0, or when moe8 was built
// without CUTLASS (grouped_gemm_sm90_supported() is false).
#include "test_util.h"

#ifdef MOE8_WITH_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "cuda/grouped_gemm_sm90.h"
#include "cuda/ops.h"
#include "test_cuda_util.h"

namespace moe8::test {
namespace {

using Bits = std::vector<uint16_t>;  // bf16 or f16 storage

inline float to_float(DType t, uint16_t b) {
  return t == DType::kF16 ? f16_to_float(f16_t{b}) : bf16_to_float(bf16_t{b});
}

// Uniform values in [-1, 1) rounded to t; xorshift, since the model shapes hold ~4e8 weights.
Bits random_bits(DType t, int64_t n, uint64_t seed) {
  Bits v(static_cast<size_t>(n));
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
  for (auto& b : v) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    const float f = static_cast<float>((x * 0x2545F4914F6CDD1Dull) >> 40) / 8388608.0f - 1.0f;
    b = t == DType::kF16 ? float_to_f16(f).bits : float_to_bf16(f).bits;
  }
  return v;
}

std::vector<int> prefix(const std::vector<int>& counts) {
  std::vector<int> off(1, 0);
  for (int c : counts) off.push_back(off.back() + c);
  return off;
}

// A device copy of host data, or a poisoned (0xFF bytes: bf16 NaN) device output.
struct Dev {
  explicit Dev(size_t bytes) : buf(bytes) {}
  DeviceBuffer buf;
  void* get() const { return buf.get(); }
};
std::unique_ptr<Dev> upload(const void* data, size_t bytes) {
  auto d = std::make_unique<Dev>(bytes);
  cuda_ok(cudaMemcpy(d->get(), data, bytes, cudaMemcpyHostToDevice), "upload");
  return d;
}
std::unique_ptr<Dev> poisoned(size_t bytes) {
  auto d = std::make_unique<Dev>(bytes);
  cuda_ok(cudaMemset(d->get(), 0xFF, bytes), "poison");
  return d;
}
Bits download(const Dev& d, int64_t n) {
  Bits v(static_cast<size_t>(n));
  cuda_ok(cudaDeviceSynchronize(), "synchronize after the op");
  cuda_ok(cudaMemcpy(v.data(), d.get(), v.size() * 2, cudaMemcpyDeviceToHost), "download");
  return v;
}
TensorView dview(const Dev& d, DType t, std::initializer_list<int64_t> shape) {
  return make_view(d.get(), t, shape, DeviceType::kCUDA);
}

// |got - want| within the rounding of the output to t plus fp32 summation error over k terms.
bool close(DType t, uint16_t got_bits, double want, double mag, int64_t k) {
  const double got = to_float(t, got_bits);
  const double tol = out_rel(t) * std::fabs(want) + fp32_rel(k) * mag + 1e-6;
  return std::isfinite(got) && std::fabs(got - want) <= tol;
}

// One MoE GEMM problem: a [R, Kd], b [E, N, Kd] or [E, Kd, N] (same values, read per layout),
// dc [R, N]; rows past offsets[E] are padding.
struct Problem {
  DType dt;
  int E;
  int64_t R, N, Kd;
  std::vector<int> offsets;
  Bits a, b, dc;

  Problem(const std::vector<int>& counts, int64_t tail, int64_t n, int64_t kd, uint64_t seed, DType t = DType::kBF16)
      : dt(t), E(static_cast<int>(counts.size())), N(n), Kd(kd), offsets(prefix(counts)) {
    R = offsets.back() + tail;
    a = random_bits(dt, R * Kd, seed);
    b = random_bits(dt, int64_t(E) * N * Kd, seed + 1);
    dc = random_bits(dt, R * N, seed + 2);
  }
  float val(uint16_t bits) const { return to_float(dt, bits); }
  int expert_of(int64_t r) const {
    for (int e = 0; e < E; ++e)
      if (r >= offsets[e] && r < offsets[e + 1]) return e;
    return -1;
  }
};

// Device side of a Problem plus a workspace sized by the API.
struct DeviceProblem {
  explicit DeviceProblem(const Problem& p)
      : a(upload(p.a.data(), p.a.size() * 2)),
        b(upload(p.b.data(), p.b.size() * 2)),
        dc(upload(p.dc.data(), p.dc.size() * 2)),
        offsets(upload(p.offsets.data(), p.offsets.size() * 4)),
        ws_bytes(cuda::grouped_gemm_sm90_workspace_bytes(p.E, p.R, p.N, p.Kd)),
        ws(std::make_unique<Dev>(ws_bytes)),
        p(p) {}
  std::unique_ptr<Dev> a, b, dc, offsets;
  size_t ws_bytes;
  std::unique_ptr<Dev> ws;
  const Problem& p;

  TensorView av() const { return dview(*a, p.dt, {p.R, p.Kd}); }
  TensorView dcv() const { return dview(*dc, p.dt, {p.R, p.N}); }
  TensorView bv(WeightLayout l) const {
    return l == WeightLayout::kNK ? dview(*b, p.dt, {p.E, p.N, p.Kd}) : dview(*b, p.dt, {p.E, p.Kd, p.N});
  }
  TensorView offv() const { return dview(*offsets, DType::kI32, {p.E + 1}); }

  Bits forward(WeightLayout l, cudaStream_t s = nullptr) const {
    auto c = poisoned(p.R * p.N * 2);
    cuda::grouped_gemm_sm90(av(), bv(l), offv(), l, dview(*c, p.dt, {p.R, p.N}), ws->get(), ws_bytes, s);
    return download(*c, p.R * p.N);
  }
  // kNK: db [E, N, Kd] = dc^T a;  swapped: db [E, Kd, N] = a^T dc.
  Bits wgrad(bool swapped) const {
    auto db = poisoned(p.E * p.N * p.Kd * 2);
    if (!swapped)
      cuda::grouped_gemm_wgrad_sm90(av(), dcv(), offv(), dview(*db, p.dt, {p.E, p.N, p.Kd}), ws->get(), ws_bytes,
                                    nullptr);
    else
      cuda::grouped_gemm_wgrad_sm90(dcv(), av(), offv(), dview(*db, p.dt, {p.E, p.Kd, p.N}), ws->get(), ws_bytes,
                                    nullptr);
    return download(*db, p.E * p.N * p.Kd);
  }
};

// Rows to check: all, or (per_group > 0) the first, last and evenly spaced rows of every group, plus
// every padding row.
std::vector<int64_t> rows_to_check(const Problem& p, int per_group) {
  std::vector<int64_t> rows;
  for (int e = 0; e < p.E; ++e) {
    const int64_t b = p.offsets[e], n = p.offsets[e + 1] - b;
    if (per_group <= 0 || n <= per_group) {
      for (int64_t r = b; r < b + n; ++r) rows.push_back(r);
    } else {
      for (int i = 0; i < per_group; ++i) rows.push_back(b + (n - 1) * i / (per_group - 1));
    }
  }
  for (int64_t r = p.offsets.back(); r < p.R; ++r) rows.push_back(r);
  return rows;
}

::testing::AssertionResult check_forward(const Problem& p, WeightLayout l, const Bits& c, int per_group) {
  int64_t bad = 0, checked = 0;
  std::ostringstream os;
  std::vector<double> acc(p.N), mag(p.N), x(p.Kd);
  for (int64_t r : rows_to_check(p, per_group)) {
    const int e = p.expert_of(r);
    if (e < 0) {  // padding: exact zeros
      for (int64_t n = 0; n < p.N; ++n, ++checked)
        if (c[r * p.N + n] != 0 && bad++ < 8) os << "\n  padding row " << r << " col " << n << " not zero";
      continue;
    }
    std::fill(acc.begin(), acc.end(), 0.0);
    std::fill(mag.begin(), mag.end(), 0.0);
    for (int64_t k = 0; k < p.Kd; ++k) x[k] = p.val(p.a[r * p.Kd + k]);
    if (l == WeightLayout::kNK) {  // walk each weight row contiguously
      for (int64_t n = 0; n < p.N; ++n) {
        const uint16_t* wr = &p.b[(int64_t(e) * p.N + n) * p.Kd];
        for (int64_t k = 0; k < p.Kd; ++k) {
          const double t = x[k] * p.val(wr[k]);
          acc[n] += t;
          mag[n] += std::fabs(t);
        }
      }
    } else {
      for (int64_t k = 0; k < p.Kd; ++k) {
        const uint16_t* wr = &p.b[(int64_t(e) * p.Kd + k) * p.N];
        for (int64_t n = 0; n < p.N; ++n) {
          const double t = x[k] * p.val(wr[n]);
          acc[n] += t;
          mag[n] += std::fabs(t);
        }
      }
    }
    for (int64_t n = 0; n < p.N; ++n, ++checked)
      if (!close(p.dt, c[r * p.N + n], acc[n], mag[n], p.Kd) && bad++ < 8)
        os << "\n  row " << r << " (expert " << e << ") col " << n << ": got " << p.val(c[r * p.N + n]) << " want "
           << acc[n];
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << checked << " checked elements off" << os.str();
}

// db [E, N, Kd] (or [E, Kd, N] when swapped): every element of empty groups must be exactly zero; of the
// others all elements (samples <= 0) or `samples` random ones per group are checked.
::testing::AssertionResult check_wgrad(const Problem& p, const Bits& db, bool swapped, int samples) {
  int64_t bad = 0, checked = 0;
  std::ostringstream os;
  Rng rng(99);
  const int64_t per = p.N * p.Kd;
  for (int e = 0; e < p.E; ++e) {
    const int64_t r0 = p.offsets[e], r1 = p.offsets[e + 1];
    if (r0 == r1) {
      for (int64_t i = 0; i < per; ++i, ++checked)
        if (db[e * per + i] != 0 && bad++ < 8) os << "\n  empty expert " << e << " element " << i << " not zero";
      continue;
    }
    const int64_t count = samples <= 0 ? per : samples;
    for (int64_t s = 0; s < count; ++s, ++checked) {
      const int64_t i = samples <= 0 ? s : rng.randint(0, static_cast<int>(per));
      const int64_t n = i / p.Kd, k = i % p.Kd;  // element (n, k) of the kNK gradient
      double acc = 0, mag = 0;
      for (int64_t r = r0; r < r1; ++r) {
        const double t = double(p.val(p.dc[r * p.N + n])) * p.val(p.a[r * p.Kd + k]);
        acc += t;
        mag += std::fabs(t);
      }
      const uint16_t got = db[e * per + (swapped ? k * p.N + n : n * p.Kd + k)];
      if (!close(p.dt, got, acc, mag, r1 - r0) && bad++ < 8)
        os << "\n  expert " << e << " (n " << n << ", k " << k << "): got " << p.val(got) << " want " << acc;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << checked << " checked elements off" << os.str();
}

// Skips unless the sm90 path can run here: a GPU, compute capability 9.0, moe8 built with CUTLASS.
class Sm90Test : public CudaTest {
 protected:
  void SetUp() override {
    CudaTest::SetUp();
    if (IsSkipped()) return;
    DeviceBuffer probe(64);
    TensorView a = make_view(probe.get(), DType::kBF16, {8, 8}, DeviceType::kCUDA);
    TensorView b = make_view(probe.get(), DType::kBF16, {1, 8, 8}, DeviceType::kCUDA);
    if (!cuda::grouped_gemm_sm90_supported(a, b, WeightLayout::kNK, 8)) {
      cudaDeviceProp prop{};
      cudaGetDeviceProperties(&prop, 0);
      GTEST_SKIP() << "sm90 grouped GEMM unsupported here (device " << prop.name << ", cc " << prop.major << "."
                   << prop.minor << "; needs cc 9.0 and moe8 built with CUTLASS, see cmake/cutlass.cmake)";
    }
  }
};

const WeightLayout kLayouts[] = {WeightLayout::kNK, WeightLayout::kKN};
const char* layout_name(WeightLayout l) { return l == WeightLayout::kNK ? "kNK (forward)" : "kKN (dgrad)"; }

struct Case {
  const char* name;
  std::vector<int> counts;
  int64_t tail, N, Kd;
  int rows_per_group;  // rows checked per group (0: all)
  int wgrad_samples;   // db elements checked per group (0: all)
};

std::vector<Case> cases() {
  return {
      // ragged, empty / 1-row / tile-edge experts, padding rows; R/E > 128: the 128x256 cooperative tile
      {"ragged_large_tile", {0, 1, 127, 128, 129, 300, 0, 1000}, 5, 384, 256, 0, 0},
      // few rows per expert: the 64x128 ping-pong tile
      {"ragged_small_tile", {0, 1, 63, 64, 65, 100, 0, 7}, 3, 384, 256, 0, 0},
      // Kd, N not multiples of the tile
      {"odd_widths", {33, 0, 250, 17}, 0, 136, 200, 0, 0},
      // an odd number of 256-wide tiles along N (forward, dgrad) and along Kd (wgrad): the unclustered tile
      {"odd_256_tiles", {200, 0, 300, 129, 513}, 4, 768, 768, 0, 0},
      // balanced 128 experts x 64 rows, Qwen3-MoE gate_up widths
      {"balanced_128x64_qwen3", std::vector<int>(128, 64), 0, 1536, 2048, 3, 256},
  };
}

void forward_and_dgrad_match_reference(uint64_t seed) {
  for (const Case& tc : cases()) {
    Problem p(tc.counts, tc.tail, tc.N, tc.Kd, ++seed);
    DeviceProblem d(p);
    for (WeightLayout l : kLayouts) {
      SCOPED_TRACE(std::string(tc.name) + " " + layout_name(l));
      Bits c = d.forward(l);
      EXPECT_TRUE(check_forward(p, l, c, tc.rows_per_group));
      EXPECT_TRUE(c == d.forward(l)) << "two runs differ";
    }
  }
}

void wgrad_matches_reference(uint64_t seed) {
  for (const Case& tc : cases()) {
    Problem p(tc.counts, tc.tail, tc.N, tc.Kd, ++seed);
    DeviceProblem d(p);
    for (bool swapped : {false, true}) {
      SCOPED_TRACE(std::string(tc.name) + (swapped ? " kKN (a, dc swapped)" : " kNK"));
      Bits db = d.wgrad(swapped);
      EXPECT_TRUE(check_wgrad(p, db, swapped, tc.wgrad_samples));
      EXPECT_TRUE(db == d.wgrad(swapped)) << "two runs differ";
    }
  }
}

TEST_F(Sm90Test, ForwardAndDgradMatchReference) { forward_and_dgrad_match_reference(90000); }

TEST_F(Sm90Test, WgradMatchesReference) { wgrad_matches_reference(91000); }

// MOE8_SM90_CLUSTER=2x1 (and =auto: 2x1 where the weight's sides are <= 2048, 1x2 elsewhere): the bf16
// large tile with CTAs paired along M, every case again.
TEST_F(Sm90Test, ClusterAlongMMatchesReference) {
  set_override("MOE8_SM90_CLUSTER", "2x1");
  forward_and_dgrad_match_reference(92000);
  wgrad_matches_reference(93000);
  set_override("MOE8_SM90_CLUSTER", "auto");
  forward_and_dgrad_match_reference(94000);
  wgrad_matches_reference(95000);
  set_override("MOE8_SM90_CLUSTER", nullptr);
}

// Every configuration MOE8_SM90_TILE can force on the bf16 GEMMs (the per-shape tile sweep's candidates).
TEST_F(Sm90Test, ForcedTilesMatchReference) {
  for_each_forced("MOE8_SM90_TILE", {"large", "solo", "m2", "pong128", "tall", "epi64", "epi64solo"}, 97000,
                  [](uint64_t seed) {
                    forward_and_dgrad_match_reference(seed);
                    wgrad_matches_reference(seed + 50);
                  });
  set_override("MOE8_SM90_TILE", "wide");
  Problem p({64, 200}, 0, 256, 256, 1);
  DeviceProblem d(p);
  EXPECT_THROW(d.forward(WeightLayout::kNK), Error);
  set_override("MOE8_SM90_TILE", nullptr);
}

TEST_F(Sm90Test, Float16MatchesReference) {
  DeviceBuffer probe(64);
  ASSERT_TRUE(cuda::grouped_gemm_sm90_supported(make_view(probe.get(), DType::kF16, {8, 8}, DeviceType::kCUDA),
                                                make_view(probe.get(), DType::kF16, {1, 8, 8}, DeviceType::kCUDA),
                                                WeightLayout::kNK, 8));
  uint64_t seed = 96000;
  for (const Case& tc : cases()) {
    if (tc.rows_per_group > 0) continue;  // the small, fully checked cases
    Problem p(tc.counts, tc.tail, tc.N, tc.Kd, ++seed, DType::kF16);
    DeviceProblem d(p);
    for (WeightLayout l : kLayouts) {
      SCOPED_TRACE(std::string(tc.name) + " f16 " + layout_name(l));
      EXPECT_TRUE(check_forward(p, l, d.forward(l), 0));
    }
    for (bool swapped : {false, true}) {
      SCOPED_TRACE(std::string(tc.name) + " f16 wgrad" + (swapped ? " swapped" : ""));
      EXPECT_TRUE(check_wgrad(p, d.wgrad(swapped), swapped, 0));
    }
  }
}

TEST_F(Sm90Test, AllGroupsEmpty) {
  Problem p({0, 0, 0}, 9, 64, 32, 92000);
  DeviceProblem d(p);
  for (WeightLayout l : kLayouts) EXPECT_TRUE(check_forward(p, l, d.forward(l), 0)) << layout_name(l);
  EXPECT_TRUE(check_wgrad(p, d.wgrad(false), false, 0));
}

// The launches hold no host copy of the offsets: a captured graph replays correctly after the offsets
// (same E, same R) are rewritten on the device.
TEST_F(Sm90Test, CapturedGraphFollowsDeviceOffsets) {
  Problem p({0, 1, 127, 128, 129, 300, 0, 1000}, 5, 384, 256, 93000);
  DeviceProblem d(p);
  cudaStream_t s;
  cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  auto c = poisoned(p.R * p.N * 2);
  auto db = poisoned(p.E * p.N * p.Kd * 2);
  cudaGraph_t graph;
  cuda_ok(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "begin capture");
  cuda::grouped_gemm_sm90(d.av(), d.bv(WeightLayout::kNK), d.offv(), WeightLayout::kNK, dview(*c, p.dt, {p.R, p.N}),
                          d.ws->get(), d.ws_bytes, s);
  cuda::grouped_gemm_wgrad_sm90(d.av(), d.dcv(), d.offv(), dview(*db, p.dt, {p.E, p.N, p.Kd}), d.ws->get(), d.ws_bytes,
                                s);
  cuda_ok(cudaStreamEndCapture(s, &graph), "end capture");
  cudaGraphExec_t exec;
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  for (const std::vector<int>& counts :
       {std::vector<int>{500, 0, 3, 200, 1, 0, 700, 281}, std::vector<int>{0, 1, 127, 128, 129, 300, 0, 1000}}) {
    Problem q = p;  // same data, new offsets
    q.offsets = prefix(counts);
    ASSERT_EQ(q.offsets.back(), p.offsets.back());
    cuda_ok(cudaMemcpyAsync(d.offsets->get(), q.offsets.data(), q.offsets.size() * 4, cudaMemcpyHostToDevice, s),
            "offsets");
    cuda_ok(cudaMemsetAsync(c->get(), 0xFF, p.R * p.N * 2, s), "poison");
    cuda_ok(cudaMemsetAsync(db->get(), 0xFF, p.E * p.N * p.Kd * 2, s), "poison");
    cuda_ok(cudaGraphLaunch(exec, s), "graph launch");
    cuda_ok(cudaStreamSynchronize(s), "graph sync");
    EXPECT_TRUE(check_forward(q, WeightLayout::kNK, download(*c, p.R * p.N), 0));
    EXPECT_TRUE(check_wgrad(q, download(*db, p.E * p.N * p.Kd), false, 2000));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

// The tiles the routing-balance hint switches between (1x2 cooperative 128x256, 2x1, 128x128 ping-pong)
// give the same bits: the same K order per element, so a timing-dependent hint (sm90_util::routing_balanced)
// can't make results differ between runs. So do the weight gradient's tiles MOE8_SM90_WGRAD picks.
TEST_F(Sm90Test, HintTilesGiveTheSameBits) {
  Problem p({200, 0, 300, 129, 513, 160}, 4, 512, 384, 98000);
  DeviceProblem d(p);
  std::vector<Bits> runs;
  for_each_forced("MOE8_SM90_TILE", {"large", "m2", "pong128"}, 0, [&](uint64_t) {
    runs.push_back(d.forward(WeightLayout::kNK));
    runs.push_back(d.forward(WeightLayout::kKN));
    runs.push_back(d.wgrad(false));
  });
  for (size_t i = 3; i < runs.size(); ++i) EXPECT_TRUE(runs[i] == runs[i % 3]) << "result " << i << " differs";
  for (const char* w : {"pong", "large"}) {
    set_override("MOE8_SM90_WGRAD", w);
    EXPECT_TRUE(d.wgrad(false) == runs[2]) << "MOE8_SM90_WGRAD=" << w;
  }
  set_override("MOE8_SM90_WGRAD", nullptr);
}

// Prepared descriptors (prepared_descriptors_sm90.cuh): the forward, dgrad and weight gradients with D's, A's and
// B's descriptors made before the launch, or one ragged descriptor each (ragged_tma_sm90.cuh), each mix of
// MOE8_SM90_PREPARED_STORE / _LOADS / _ACQUIRE the rules take, give CUTLASS's rewritten descriptors' bits and the
// reference's values, with an empty group, groups of fewer rows than a tile, partial tiles and rows past the last
// group, on both 128x64-subtile tiles (N 512: CTAs paired; N 768: three 256-wide tiles, unpaired), forced so that the
// test runs them whatever the rules pick.
TEST_F(Sm90Test, PreparedDescriptorsGiveTheSameBits) {
  for (const char* tile : {"epi64", "epi64solo"}) {
    set_override("MOE8_SM90_TILE", tile);
    for (int64_t n : {512, 768}) {
      SCOPED_TRACE(std::string(tile) + ", N " + std::to_string(n));
      Problem p({200, 0, 300, 129, 5, 513, 160, 1}, 7, n, 384, 99000 + n);
      DeviceProblem d(p);
      auto all = [&](const char* store, const char* loads) {
        set_override("MOE8_SM90_PREPARED_STORE", store);
        set_override("MOE8_SM90_PREPARED_LOADS", loads);
        return std::vector<Bits>{d.forward(WeightLayout::kNK), d.forward(WeightLayout::kKN), d.wgrad(false),
                                 d.wgrad(true)};
      };
      const std::vector<Bits> plain = all("0", "0");
      const std::pair<const char*, const char*> mixes[] = {{"0", "1"},      {"1", "1"},      {"ragged", "1"},
                                                           {"0", "ragged"}, {"1", "ragged"}, {"ragged", "ragged"}};
      for (const char* acquire : {"mainloop", "store"}) {
        set_override("MOE8_SM90_PREPARED_ACQUIRE", acquire);
        for (const auto& [store, loads] : mixes) {
          const std::vector<Bits> prepared = all(store, loads);
          for (size_t i = 0; i < plain.size(); ++i)
            EXPECT_TRUE(prepared[i] == plain[i])
                << "store " << store << ", loads " << loads << ", D acquired at the " << acquire << ", GEMM " << i;
          EXPECT_TRUE(check_forward(p, WeightLayout::kNK, prepared[0], 0));
        }
      }
      set_override("MOE8_SM90_PREPARED_ACQUIRE", nullptr);
      // D's prepared or ragged with A's and B's left to CUTLASS's rewrite: refused (sm90_heuristics::prepared)
      for (const char* store : {"1", "ragged"}) EXPECT_THROW(all(store, "0"), Error);
      set_override("MOE8_SM90_PREPARED_STORE", nullptr);
      set_override("MOE8_SM90_PREPARED_LOADS", nullptr);
    }
  }
  set_override("MOE8_SM90_TILE", nullptr);
}

// The up projection's forward with SwiGLU in its epilogue (grouped_gemm_swiglu_sm90): h is the plain forward's bits
// and act activation_forward's of that h, with three 256-wide tiles along 2I (no cluster) and four (CTAs paired),
// ragged groups with empty ones and rows past offsets[E] (zeros in both).
TEST_F(Sm90Test, SwiGLUEpilogueGivesTheSameBits) {
  auto first_difference = [](const Bits& got, const Bits& want) {
    for (size_t i = 0; i < want.size(); ++i)
      if (got[i] != want[i]) return static_cast<int64_t>(i);
    return int64_t{-1};
  };
  for (int64_t n : {768, 1024}) {
    SCOPED_TRACE("2I " + std::to_string(n));
    Problem p({200, 0, 300, 129, 5, 513, 160, 1}, 7, n, 384, 97700 + n);
    DeviceProblem d(p);
    const int64_t I = n / 2;
    const Bits h_ref = d.forward(WeightLayout::kNK);
    auto h_ref_dev = upload(h_ref.data(), h_ref.size() * 2);
    auto act_ref_dev = poisoned(p.R * I * 2);
    cuda::activation_forward(dview(*h_ref_dev, p.dt, {p.R, n}), ActParams{}, dview(*act_ref_dev, p.dt, {p.R, I}),
                             nullptr);
    const Bits act_ref = download(*act_ref_dev, p.R * I);
    ASSERT_TRUE(cuda::grouped_gemm_swiglu_sm90_supported(d.av(), d.bv(WeightLayout::kNK), n));
    auto h = poisoned(p.R * n * 2);
    auto act = poisoned(p.R * I * 2);
    cuda::grouped_gemm_swiglu_sm90(d.av(), d.bv(WeightLayout::kNK), d.offv(), dview(*h, p.dt, {p.R, n}),
                                   dview(*act, p.dt, {p.R, I}), d.ws->get(), d.ws_bytes, nullptr);
    const Bits h_got = download(*h, p.R * n), act_got = download(*act, p.R * I);
    const int64_t bad_h = first_difference(h_got, h_ref), bad_act = first_difference(act_got, act_ref);
    EXPECT_EQ(bad_h, -1) << "h differs first at row " << bad_h / n << " col " << bad_h % n;
    EXPECT_EQ(bad_act, -1) << "act differs first at row " << bad_act / I << " col " << bad_act % I;
  }
}

// The scheduler's tile order (MOE8_SM90_RASTER, MOE8_SM90_SWIZZLE; sm90_util::apply_schedule) moves only
// which tiles run together, so every order gives the default's bits, on the cooperative and the ping-pong
// kernel; a bad value of either, or of MOE8_SM90_CLUSTER, raises.
TEST_F(Sm90Test, SchedulesGiveTheSameBits) {
  Problem p({200, 0, 300, 129, 513, 160, 1000}, 4, 512, 384, 98500);
  DeviceProblem d(p);
  const std::pair<const char*, const char*> orders[] = {{"m", "1"}, {"n", "1"}, {"m", "8"}, {"n", "4"}, {"m", "2"}};
  for_each_forced("MOE8_SM90_TILE", {"large", "pong128"}, 0, [&](uint64_t) {
    std::vector<Bits> runs;
    for (const auto& [raster, swizzle] : orders) {
      set_override("MOE8_SM90_RASTER", raster);
      set_override("MOE8_SM90_SWIZZLE", swizzle);
      runs.push_back(d.forward(WeightLayout::kNK));
      runs.push_back(d.forward(WeightLayout::kKN));
      runs.push_back(d.wgrad(false));
    }
    set_override("MOE8_SM90_RASTER", nullptr);
    set_override("MOE8_SM90_SWIZZLE", nullptr);
    EXPECT_TRUE(check_forward(p, WeightLayout::kNK, runs[0], 0));
    for (size_t i = 3; i < runs.size(); ++i) EXPECT_TRUE(runs[i] == runs[i % 3]) << "result " << i << " differs";
  });
  for (const auto& [var, bad] : {std::pair<const char*, const char*>{"MOE8_SM90_RASTER", "k"},
                                 {"MOE8_SM90_SWIZZLE", "3"},
                                 {"MOE8_SM90_CLUSTER", "3x3"}}) {
    SCOPED_TRACE(std::string(var) + "=" + bad);
    set_override(var, bad);
    EXPECT_THROW(d.forward(WeightLayout::kNK), Error);
    set_override(var, nullptr);
  }
}

// The routing-balance hint (grouped_gemm_sm90_routing_balanced): MOE8_SM90_BALANCE=balanced|skewed fixes
// it and a bad name raises; unset, it follows the offsets it was handed once their asynchronous copies
// land (balanced: the largest group <= 1.25x the mean), and inside a CUDA graph capture it adds nothing
// to the graph.
TEST_F(Sm90Test, RoutingBalanceHint) {
  auto hint_after = [](const std::vector<int>& counts, bool want) {
    const std::vector<int> off = prefix(counts);
    auto d = upload(off.data(), off.size() * 4);
    const TensorView v = dview(*d, DType::kI32, {static_cast<int64_t>(off.size())});
    for (int i = 0; i < 40; ++i) {  // a copy lands within a few calls (one every 8 after the first)
      if (cuda::grouped_gemm_sm90_routing_balanced(v, nullptr) == want) return true;
      cuda_ok(cudaDeviceSynchronize(), "sync");
    }
    return false;
  };
  std::vector<int> skewed(16, 100);
  skewed[3] = 1000;
  EXPECT_TRUE(hint_after(std::vector<int>(16, 144), true));
  EXPECT_TRUE(hint_after(skewed, false));
  EXPECT_TRUE(hint_after(std::vector<int>(16, 144), true));
  set_override("MOE8_SM90_BALANCE", "skewed");
  EXPECT_TRUE(hint_after(std::vector<int>(16, 144), false));
  set_override("MOE8_SM90_BALANCE", "balanced");
  EXPECT_TRUE(hint_after(skewed, true));
  set_override("MOE8_SM90_BALANCE", "maybe");
  EXPECT_THROW(hint_after(skewed, true), Error);
  set_override("MOE8_SM90_BALANCE", nullptr);

  const std::vector<int> off = prefix(skewed);
  auto d = upload(off.data(), off.size() * 4);
  cudaStream_t s;
  cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  cudaGraph_t graph;
  cuda_ok(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "begin capture");
  bool during = false;
  for (int i = 0; i < 20; ++i) during = cuda::grouped_gemm_sm90_routing_balanced(dview(*d, DType::kI32, {17}), s);
  cuda_ok(cudaStreamEndCapture(s, &graph), "end capture");
  size_t nodes = 99;
  cuda_ok(cudaGraphGetNodes(graph, nullptr, &nodes), "nodes");
  EXPECT_EQ(nodes, 0u);
  EXPECT_TRUE(during);  // the last answer (balanced) stands while capturing
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

TEST_F(Sm90Test, SmallWorkspaceIsRejected) {
  Problem p({4, 4}, 0, 64, 32, 94000);
  DeviceProblem d(p);
  auto c = poisoned(p.R * p.N * 2);
  EXPECT_THROW(cuda::grouped_gemm_sm90(d.av(), d.bv(WeightLayout::kNK), d.offv(), WeightLayout::kNK,
                                       dview(*c, p.dt, {p.R, p.N}), d.ws->get(), d.ws_bytes - 1, nullptr),
               Error);
}

// TFLOP/s on real MoE layer shapes (useful FLOPs: 2 * rows * N * Kd), median of timed runs.
TEST_F(Sm90Test, Speed) {
  struct Shape {
    const char* name;
    int E;
    int rows_per_expert;
    int64_t N, Kd;
  };
  const Shape shapes[] = {
      {"qwen3-30b gate_up 32k rows", 128, 256, 1536, 2048},   {"qwen3-30b down 32k rows", 128, 256, 2048, 768},
      {"qwen3-30b 16k tok gate_up", 128, 1024, 1536, 2048},   {"qwen3-30b 16k tok down", 128, 1024, 2048, 768},
      {"qwen3-30b 16k tok down dgrad", 128, 1024, 768, 2048}, {"qwen3-30b gate_up 8k rows", 128, 64, 1536, 2048},
      {"mixtral gate_up 8k rows", 8, 1024, 28672, 4096},      {"mixtral down 8k rows", 8, 1024, 4096, 14336},
  };
  std::printf("\n%-30s %10s %10s %10s   (TFLOP/s, bf16, sm90 CUTLASS grouped GEMM)\n", "shape", "fwd", "dgrad",
              "wgrad");
  for (const Shape& sh : shapes) {
    Problem p(std::vector<int>(sh.E, sh.rows_per_expert), 0, sh.N, sh.Kd, 95000);
    DeviceProblem d(p);
    auto c = poisoned(p.R * p.N * 2);
    auto db = poisoned(int64_t(p.E) * p.N * p.Kd * 2);
    auto time = [&](auto&& fn) { return 2.0 * p.R * p.N * p.Kd / (median_ms(fn) * 1e-3) / 1e12; };  // TFLOP/s
    auto cv = dview(*c, p.dt, {p.R, p.N});
    const double fwd = time([&] {
      cuda::grouped_gemm_sm90(d.av(), d.bv(WeightLayout::kNK), d.offv(), WeightLayout::kNK, cv, d.ws->get(), d.ws_bytes,
                              nullptr);
    });
    const double dgrad = time([&] {
      cuda::grouped_gemm_sm90(d.av(), d.bv(WeightLayout::kKN), d.offv(), WeightLayout::kKN, cv, d.ws->get(), d.ws_bytes,
                              nullptr);
    });
    const double wgrad = time([&] {
      cuda::grouped_gemm_wgrad_sm90(d.av(), d.dcv(), d.offv(), dview(*db, p.dt, {p.E, p.N, p.Kd}), d.ws->get(),
                                    d.ws_bytes, nullptr);
    });
    cuda_ok(cudaDeviceSynchronize(), "speed");
    std::printf("%-30s %10.1f %10.1f %10.1f\n", sh.name, fwd, dgrad, wgrad);
  }
}

}  // namespace
}  // namespace moe8::test
#endif  // MOE8_WITH_CUDA
