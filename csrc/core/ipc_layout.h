// ipc_layout.h — where everything lives in one rank's CUDA IPC buffer (the `ipc` expert-parallel transport):
// byte offsets as pure functions of (world, local experts, capacity, row size), usable on host and device.
//
// One buffer per rank, allocated once and opened by every peer. Sources write into it, so every place is a
// function of (source rank, that source's send row), and no offsets need to be exchanged before rows move:
//
//   signals  uint64 [world]                     signals[p]: the last barrier epoch rank p reached
//   abort    uint64                             nonzero once a wait on this rank timed out (its error code)
//   counts   int32  [world][E_local + 1]        rows each source sends per local expert, + its bad-id count
//   meta     IpcRowMeta [world][capacity]       per received row: local expert, source token, slot, send row
//   rows     [world][capacity] x stride bytes   received rows (dispatch direction)
//   ret      [capacity] x stride bytes          this rank's own send rows coming back (combine direction)
//
// capacity is the most rows one source can send (T_max * k), so a region never overflows and no token is
// dropped. A row is `row_bytes` of data (H elements, a multiple of 16 bytes) followed, for FP8 rows, by
// `scale_bytes` of float32 scales, padded to 16 bytes. Sections start on 256-byte boundaries.
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace moe8 {

struct IpcRowMeta {
  int32_t local_expert;  // the owner's expert of this row, in [0, E_local)
  int32_t token;         // the source token it came from
  int32_t k;             // the slot of that token, in [0, K)
  int32_t send_row;      // its row in the source's send order (where its result goes back)
};
static_assert(sizeof(IpcRowMeta) == 16, "IpcRowMeta is one 16-byte store");

constexpr int kIpcMaxRanks = 64;    // a barrier is one block with a thread per peer
constexpr int64_t kIpcAlign = 256;  // section alignment in bytes

MOE8_HD int64_t ipc_align(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

struct IpcLayout {
  int world = 0;
  int num_local_experts = 0;
  int64_t capacity = 0;     // rows per source region
  int64_t row_bytes = 0;    // data bytes of a row
  int64_t scale_bytes = 0;  // float32 scale bytes of a row (0: no scales)
  int64_t stride = 0;       // bytes from one row to the next
  int64_t signals = 0, abort = 0, counts = 0, meta = 0, rows = 0, ret = 0, total = 0;  // byte offsets, size

  MOE8_HD int64_t counts_per_source() const { return num_local_experts + 1; }
  MOE8_HD int64_t signal_at(int src) const { return signals + 8 * static_cast<int64_t>(src); }
  MOE8_HD int64_t count_at(int src, int e) const { return counts + 4 * (src * counts_per_source() + e); }
  MOE8_HD int64_t meta_at(int src, int64_t i) const { return meta + 16 * (src * capacity + i); }
  MOE8_HD int64_t row_at(int src, int64_t i) const { return rows + stride * (src * capacity + i); }
  MOE8_HD int64_t scale_at(int src, int64_t i) const { return row_at(src, i) + row_bytes; }
  MOE8_HD int64_t ret_at(int64_t i) const { return ret + stride * i; }
  MOE8_HD int64_t ret_scale_at(int64_t i) const { return ret_at(i) + row_bytes; }
};

// The layout for `world` ranks of `num_local_experts` experts each, `capacity` rows per source. The caller
// validates the arguments (api/ipc.cpp); sizes are exact, so the buffer is cudaMalloc(layout.total).
inline IpcLayout make_ipc_layout(int world, int num_local_experts, int64_t capacity, int64_t row_bytes,
                                 int64_t scale_bytes) {
  IpcLayout L;
  L.world = world;
  L.num_local_experts = num_local_experts;
  L.capacity = capacity;
  L.row_bytes = row_bytes;
  L.scale_bytes = scale_bytes;
  L.stride = row_bytes + ipc_align(scale_bytes, 16);
  int64_t at = 0;
  const auto section = [&at](int64_t bytes) {
    const int64_t start = at;
    at = ipc_align(at + bytes, kIpcAlign);
    return start;
  };
  L.signals = section(8 * static_cast<int64_t>(world));
  L.abort = section(8);
  L.counts = section(4 * static_cast<int64_t>(world) * L.counts_per_source());
  L.meta = section(16 * static_cast<int64_t>(world) * capacity);
  L.rows = section(L.stride * world * capacity);
  L.ret = section(L.stride * capacity);
  L.total = at;
  return L;
}

// The owner reads its received rows as blocks b of (source s, local expert e) rows, in source-major order
// (b = s * E_local + e: the interface's (source, expert, token, slot) order) or expert-major (b = e * world +
// s: each expert's rows contiguous). Both orders are bijections of [0, world * E_local).
MOE8_HD int ipc_block(int s, int e, int world, int num_local_experts, bool expert_major) {
  return expert_major ? e * world + s : s * num_local_experts + e;
}
MOE8_HD void ipc_block_source_expert(int b, int world, int num_local_experts, bool expert_major, int& s, int& e) {
  s = expert_major ? b % world : b / num_local_experts;
  e = expert_major ? b / world : b % num_local_experts;
}

// Barrier phases (what a timeout error names) and the error word a failed wait leaves for the host:
// bits 56..63 kind, 48..55 phase, 32..47 peer rank, 0..31 the epoch's low bits.
enum class IpcPhase : int { kDispatchReady = 0, kDispatchDone = 1, kCombineReady = 2, kCombineDone = 3 };
enum class IpcFault : int { kNone = 0, kTimeout = 1, kBadCounts = 2 };

MOE8_HD uint64_t ipc_error_code(IpcFault kind, int phase, int peer, uint64_t epoch) {
  return static_cast<uint64_t>(kind) << 56 | static_cast<uint64_t>(phase & 0xff) << 48 |
         static_cast<uint64_t>(peer & 0xffff) << 32 | (epoch & 0xffffffffull);
}

struct IpcErrorInfo {
  IpcFault kind;
  int phase, peer;
  uint32_t epoch;
};

inline IpcErrorInfo ipc_decode_error(uint64_t code) {
  return {static_cast<IpcFault>(code >> 56), static_cast<int>((code >> 48) & 0xff),
          static_cast<int>((code >> 32) & 0xffff), static_cast<uint32_t>(code & 0xffffffffull)};
}

inline const char* ipc_phase_name(int phase) {
  switch (static_cast<IpcPhase>(phase)) {
    case IpcPhase::kDispatchReady:
      return "dispatch (ready: before rows are sent)";
    case IpcPhase::kDispatchDone:
      return "dispatch (done: after rows are sent)";
    case IpcPhase::kCombineReady:
      return "combine (ready: before results are sent back)";
    case IpcPhase::kCombineDone:
      return "combine (done: after results are sent back)";
  }
  return "unknown";
}

}  // namespace moe8
