// test_cuda_lowrank.cpp — CUDA grouped_lowrank_add (h + t·op(b[e]) per group, h in no group) against the CPU
// reference of the API and the float64 loop on the same inputs: every kernel it dispatches to (the ring kernel
// for 16-bit [E, N, rank] with rank <= 32, the register kernel for f32 or an unaligned t, the row kernels
// otherwise) at awkward shapes (0 and 1 rows, rows not a multiple of a tile, groups inside one tile, rows before
// offsets[0] and past offsets[E], empty experts, N = 8 .. 2056, rank 1 .. 33) and at the Qwen3-30B widths with
// enough rows that each warp's ring wraps and its expert changes, plus poisoned outputs and GPU determinism.
#include "test_ref.h"

#ifdef MOE8_WITH_CUDA
#include <cuda_runtime.h>

#include "cpu/ops.h"
#include "test_cuda_util.h"

namespace moe8::test {
namespace {

struct LowrankCase {
  const char* name;
  DType dtype;
  std::vector<int> sizes;  // rows per expert (E = sizes.size())
  int lead;                // rows before offsets[0], in no group
  int64_t tail;            // rows past offsets[E], in no group
  int64_t N;
  int rank;
};

// Rows per expert for E experts, 0 .. span - 1 in a fixed scatter (the first empty).
std::vector<int> scattered_sizes(int E, int step, int span) {
  std::vector<int> s(E);
  for (int e = 0; e < E; ++e) s[e] = e * step % span;
  return s;
}

std::vector<LowrankCase> cuda_lowrank_cases() {
  const DType f32 = DType::kF32, f16 = DType::kF16, bf16 = DType::kBF16;
  return {
      {"no_rows", bf16, {0, 0}, 0, 0, 64, 16},
      {"one_row", bf16, {0, 1, 0}, 0, 0, 8, 16},
      {"one_row_in_no_group", f16, {0, 0}, 1, 0, 64, 8},
      {"all_rows_in_no_group", bf16, {0, 0, 0}, 7, 9, 64, 32},
      {"rank1_N8", bf16, {5, 0, 13, 1}, 2, 3, 8, 1},
      {"rank8_N64_f16", f16, {33, 0, 1, 70}, 0, 7, 64, 8},
      {"groups_inside_a_tile", bf16, {1, 2, 3, 1, 0, 5, 4, 17}, 1, 2, 200, 16},
      {"rank16_N1536_f16", f16, {700, 150, 0, 80, 40, 20, 9, 1}, 3, 5, 1536, 16},
      {"rank17_N2056", bf16, {100, 0, 37, 300, 1}, 5, 3, 2056, 17},
      {"rank32_N2048", bf16, {513, 2, 0, 211}, 0, 9, 2048, 32},
      {"rank33_row_kernel", bf16, {40, 0, 9}, 0, 2, 64, 33},
      {"N13_row_kernel", bf16, {5, 9}, 0, 3, 13, 7},
      {"rank16_f32", f32, {100, 0, 37, 300, 1}, 0, 3, 96, 16},
      {"rank32_f32", f32, {1000, 24, 0, 700}, 0, 3, 200, 32},
      // many tiles per warp (the ring wraps, the expert changes along a warp's rows), real widths
      {"qwen3_down_r16", bf16, scattered_sizes(128, 37, 251), 0, 5, 2048, 16},
      {"qwen3_gate_up_r32", bf16, scattered_sizes(64, 53, 301), 2, 11, 1536, 32},
  };
}

LowrankInputs lowrank_inputs(const LowrankCase& c, Rng& rng) {
  LowrankInputs in;
  in.offsets = offsets_from_sizes(c.sizes);
  for (int& o : in.offsets) o += c.lead;
  const int64_t R = in.offsets.back() + c.tail, E = static_cast<int64_t>(c.sizes.size());
  in.h = random_tensor(c.dtype, {R, c.N}, rng);
  in.t = random_tensor(c.dtype, {R, c.rank}, rng);
  in.b = random_tensor(c.dtype, {E, c.N, c.rank}, rng);  // [E, N, rank]: layout kNK
  return in;
}

// x uploaded one element past a 16-byte boundary: what the fast paths cannot take as packs.
TensorView unaligned(Runner& run, const HostTensor& x) {
  HostTensor padded(x.dtype(), {x.numel() + 1});
  for (int64_t i = 0; i < x.numel(); ++i) padded.set(i + 1, x.get(i));
  const TensorView v = run.in(padded);
  return view_of(static_cast<char*>(v.data) + dtype_size(x.dtype()), x.dtype(), x.shape(), DeviceType::kCUDA);
}

enum class Misalign { kNone, kT, kB };

HostTensor lowrank(bool gpu, const LowrankInputs& in, Misalign mis = Misalign::kNone) {
  Runner run(gpu);
  HostTensor out(in.h.dtype(), in.h.shape());
  HostTensor off = ints({static_cast<int64_t>(in.offsets.size())}, in.offsets);
  const TensorView t = gpu && mis == Misalign::kT ? unaligned(run, in.t) : run.in(in.t);
  const TensorView b = gpu && mis == Misalign::kB ? unaligned(run, in.b) : run.in(in.b);
  // Device offsets are not checked when check_indices is false: offsets[0] > 0 puts the rows before it in no
  // group. The CPU always checks, so there the op the API calls is called directly.
  if (gpu)
    api::grouped_lowrank_add(run.in(in.h), t, b, run.in(off), WeightLayout::kNK, run.out(out), 0, false);
  else
    cpu::grouped_lowrank_add(in.h.view(), in.t.view(), in.b.view(), off.view(), WeightLayout::kNK, run.out(out));
  run.finish();
  return out;
}

TEST_F(CudaTest, GroupedLowrankAddMatchesCpu) {
  uint64_t seed = 8000;
  for (const LowrankCase& lc : cuda_lowrank_cases()) {
    SCOPED_TRACE(std::string(lc.name) + " " + name_of(lc.dtype));
    Rng rng(++seed);
    const LowrankInputs in = lowrank_inputs(lc, rng);
    Expect e = lowrank_ref(in.h, in.t, in.b, in.offsets, WeightLayout::kNK);
    // The tensor cores' fp32 sum may truncate where fp32 arithmetic rounds: twice the terms' error.
    e.comp_rel = fp32_rel(2 * (lc.rank + 1));
    const HostTensor gpu = lowrank(true, in), cpu = lowrank(false, in);
    EXPECT_TRUE(close_pair(gpu, cpu, e, "out vs CPU"));
    EXPECT_TRUE(close_to(gpu, e, "out vs float64"));
    EXPECT_TRUE(rows_in_no_group_are_h(gpu, in));
    EXPECT_TRUE(gpu.bitwise_equal(lowrank(true, in))) << "two GPU runs differ";
  }
}

// A fast path never narrows what works: a t off its 16-byte alignment takes the register kernel, a b off it the
// ring kernel still (it reads b in pairs), and both agree with the CPU.
TEST_F(CudaTest, GroupedLowrankAddUnalignedOperands) {
  uint64_t seed = 8100;
  for (const LowrankCase& lc : cuda_lowrank_cases()) {
    if (lc.dtype == DType::kF32 || lc.rank > 32 || lc.N % 8 != 0 || lc.sizes.size() > 8) continue;  // the ring
    for (Misalign mis : {Misalign::kT, Misalign::kB}) {
      SCOPED_TRACE(std::string(lc.name) + (mis == Misalign::kT ? " t" : " b") + " unaligned");
      Rng rng(++seed);
      const LowrankInputs in = lowrank_inputs(lc, rng);
      Expect e = lowrank_ref(in.h, in.t, in.b, in.offsets, WeightLayout::kNK);
      e.comp_rel = fp32_rel(2 * (lc.rank + 1));
      const HostTensor gpu = lowrank(true, in, mis);
      EXPECT_TRUE(close_pair(gpu, lowrank(false, in), e, "out vs CPU"));
      EXPECT_TRUE(gpu.bitwise_equal(lowrank(true, in, mis))) << "two GPU runs differ";
    }
  }
}

}  // namespace
}  // namespace moe8::test
#endif  // MOE8_WITH_CUDA
