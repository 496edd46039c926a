// rmsnorm_heuristics.h — the launch shapes of the RMSNorm kernels (cuda/rmsnorm.cu) as small pure functions,
// shape in, choice out: how many threads share a row, whether the row stays in registers, how many blocks run,
// and how many rows of weight-gradient partials the backward's workspace holds. Plain C++ (no CUDA): the API
// sizes the workspace with it, and tests/cpp/test_rmsnorm.cpp checks the choices on the CPU.
#pragma once
#include <algorithm>
#include <cstdint>

namespace moe8::cuda::rmsnorm_heuristics {

// Packs (16-byte vectors, or single elements where the width or a pointer is not 16-byte aligned) of a row
// that each thread keeps in registers: four 16-byte loads in flight per tensor and thread, and the backward's
// x, dy, weight and dw sums for them within 128 registers.
constexpr int kCachePacks = 4;
// The widest group of threads on one row; a wider row is read twice instead of kept in registers.
constexpr int kMaxLanes = 512;
// Threads of a block: narrower groups stack kBlockThreads / lanes rows to a block, a group of kMaxLanes takes a
// block of its own.
constexpr int kBlockThreads = 256;
// Rows of fp32 weight-gradient partials the backward writes at most (one per block): a wave of blocks on a GPU
// of up to 512 SMs, and a workspace whose size depends on the shape alone.
constexpr int64_t kMaxPartialRows = 1024;
// Forward grids stop growing here (the kernels walk their rows in a grid-stride loop).
constexpr int64_t kMaxForwardBlocks = int64_t{1} << 16;

struct RowShape {
  int lanes;    // threads on one row: a power of two, 1 .. kMaxLanes
  bool cached;  // the row's packs held in registers (lanes * kCachePacks >= packs); otherwise read twice
  int threads;  // threads of a block
  int rows_per_block() const { return threads / lanes; }
};

// The fewest lanes whose registers hold the row: several rows to a warp for head_dim-wide norms (128 bf16
// elements: 16 packs, 4 lanes), a warp or more per row for hidden norms (2048: 256 packs, 64 lanes).
inline RowShape row_shape(int64_t packs) {
  int lanes = 1;
  while (lanes < kMaxLanes && int64_t{lanes} * kCachePacks < packs) lanes *= 2;
  if (int64_t{lanes} * kCachePacks < packs) return {kBlockThreads, false, kBlockThreads};
  return {lanes, true, std::max(kBlockThreads, lanes)};
}

inline int64_t row_blocks(int64_t rows, const RowShape& s) {
  const int64_t per = s.rows_per_block();
  return (rows + per - 1) / per;
}

// The forward: a block per rows_per_block rows, up to kMaxForwardBlocks.
inline int64_t forward_blocks(int64_t rows, const RowShape& s) {
  return std::min(row_blocks(rows, s), kMaxForwardBlocks);
}

// Rows of partials the backward's workspace holds for x [rows, cols]: one per block, whatever the device.
inline int64_t workspace_rows(int64_t rows) { return std::min(rows, kMaxPartialRows); }

// The backward: one wave of blocks (two of kBlockThreads threads per SM: 128 registers a thread fill an SM's
// 64K), so that each block sums the weight gradient over many rows in registers and writes one row of partials;
// at most workspace_rows(rows), and no more than the rows need.
inline int64_t backward_blocks(int64_t rows, const RowShape& s, int sms) {
  const int64_t per_sm = std::max(1, 2 * kBlockThreads / s.threads);
  const int64_t wave = std::max<int64_t>(1, int64_t{sms} * per_sm);
  return std::min({row_blocks(rows, s), wave, workspace_rows(rows)});
}

}  // namespace moe8::cuda::rmsnorm_heuristics
