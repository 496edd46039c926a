// api/ipc.h — the `ipc` expert-parallel transport's entry points: one rank's CUDA IPC receive buffer and the
// two directions of row movement (dispatch: sources -> expert owners; combine: owners -> sources). Every call
// validates its arguments (naming them, expected vs actual) and raises moe8::CudaError (RuntimeError) when an
// earlier wait of this buffer timed out. Layout and protocol: core/ipc_layout.h, cuda/ipc.cu. Built without
// CUDA, constructing a buffer raises the "built without CUDA" error.
//
// A buffer serves one group of `world` ranks on one node (ranks may share a GPU), each rank owning
// `num_local_experts` consecutive experts. Every rank must make the same sequence of calls (collectively);
// `stream` is a cudaStream_t as an integer; outputs are caller-owned.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/ipc_layout.h"
#include "core/tensor.h"

namespace moe8::cuda {
class IpcBuffer;
}

namespace moe8::api {

// Validates a buffer's configuration and returns its layout (no allocation; also for sizing it up front).
// capacity: rows one source may send per call (T_max * K); hidden: elements of a row (H); dtype: the rows'
// (float32, float16, bfloat16, uint8 / float8_e4m3fn); scale_cols: float32 scales per row (H / 128 for FP8
// rows, else 0).
IpcLayout ipc_layout(int rank, int world, int num_local_experts, int64_t capacity, int64_t hidden, DType dtype,
                     int64_t scale_cols);

class IpcBuffer {
 public:
  IpcBuffer(int rank, int world, int num_local_experts, int64_t capacity, int64_t hidden, DType dtype,
            int64_t scale_cols, int device);
  ~IpcBuffer();
  IpcBuffer(const IpcBuffer&) = delete;
  IpcBuffer& operator=(const IpcBuffer&) = delete;

  std::string handle() const;                          // this rank's CUDA IPC handle, to send to the peers
  void open(const std::vector<std::string>& handles);  // every rank's handle, by rank (its own included)
  // Unmaps the peers' buffers (after the device is idle); call on every rank, then a group barrier, before
  // any rank drops its buffer.
  void close_peers();
  const IpcLayout& layout() const { return layout_; }
  int rank() const { return rank_; }
  int64_t bytes() const { return layout_.total; }

  // Raises moe8::CudaError naming the peer and the phase when a wait of this buffer timed out (now or in
  // an earlier call; the buffer is then unusable on every rank). sync: wait for `stream` first.
  void check(bool sync, intptr_t stream) const;

  // Dispatch, source side: barrier, then every row of the send order into its owner's buffer, then barrier.
  //   tokens (by_token): src [T, H] the tokens, row i is src[row_to_slot[i] / k]; counts [E] int32 and bad
  //     (int32 [1], optional: out-of-range ids this rank found) travel with the rows' metadata;
  //   gradients (not by_token): src [T*K, H] in send order, row i is src[i]; row_to_slot / counts unused.
  // row_to_slot [T*K], offsets [E+1]: the source plan (moe8 plan of the global ids, no padding), E = world *
  // num_local_experts; src_scale [rows of src, scale_cols] float32 with FP8 rows.
  void dispatch_send(const TensorView& src, const TensorView& src_scale, const TensorView& row_to_slot,
                     const TensorView& offsets, const TensorView& counts, const TensorView& bad, int k, bool by_token,
                     double timeout_s, intptr_t stream, bool check_indices = false);
  // Owner side, after a tokens dispatch_send: recv_counts [world, num_local_experts + 1] (what each source
  // sent per local expert, + its bad-id count), recv_offsets [world * num_local_experts + 1] and recv_base
  // [world * num_local_experts] int32 (the blocks of received rows: source-major, (source, expert) order, or
  // expert-major). The rows received: recv_offsets[-1].
  void dispatch_plan(const TensorView& recv_counts, const TensorView& recv_offsets, const TensorView& recv_base,
                     bool expert_major, intptr_t stream);
  // rows [R, H] (+ rows_scale [R, scale_cols]) <- the received rows in block order; local_ids [R] int32
  // (in [0, num_local_experts)) and ret [R] int32 (where each row's result goes back), each optional.
  void dispatch_recv(const TensorView& recv_offsets, const TensorView& recv_base, bool expert_major,
                     const TensorView& rows, const TensorView& rows_scale, const TensorView& local_ids,
                     const TensorView& ret, intptr_t stream);

  // Combine, owner side: barrier, rows[i] (+ scales) back to the source named by ret[i], barrier.
  void combine_send(const TensorView& rows, const TensorView& rows_scale, const TensorView& ret, double timeout_s,
                    intptr_t stream, bool check_indices = false);
  // Source side: out [T*K, H] (+ out_scale) <- the results of this rank's send rows, in send order.
  void combine_recv(const TensorView& out, const TensorView& out_scale, intptr_t stream);

 private:
  void check_rows(const char* name, const TensorView& t, int64_t rows) const;
  void check_scales(const char* name, const TensorView& t, int64_t rows) const;

  int rank_ = 0, device_ = 0;
  int64_t hidden_ = 0, scale_cols_ = 0;
  DType dtype_ = DType::kBF16;
  IpcLayout layout_;
  std::unique_ptr<cuda::IpcBuffer> impl_;
};

}  // namespace moe8::api
