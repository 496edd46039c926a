// cuda/ipc.h — the CUDA side of the `ipc` expert-parallel transport: one rank's receive buffer (cudaMalloc'd
// once, exported by CUDA IPC, its peers' buffers opened from their handles) and the kernels that move rows
// into peers' buffers and wait for peers. Arguments are validated by api/ipc.cpp; nothing here synchronises.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/ipc_layout.h"
#include "core/tensor.h"

namespace moe8::cuda {

class IpcBuffer {
 public:
  // Allocates and zeroes layout.total bytes on `device` (the current device), and a host-mapped error word.
  IpcBuffer(int rank, const IpcLayout& layout, int device);
  ~IpcBuffer();
  IpcBuffer(const IpcBuffer&) = delete;
  IpcBuffer& operator=(const IpcBuffer&) = delete;

  std::string handle() const;  // the cudaIpcMemHandle_t of this rank's buffer, as bytes
  // handles[p]: rank p's handle (this rank's own is skipped: cudaIpcOpenMemHandle fails in the exporter).
  void open(const std::vector<std::string>& handles);
  bool is_open() const { return open_; }
  void close_peers();  // waits for the device, then unmaps the peers' buffers (this rank's own stays)
  int device() const { return device_; }
  uint64_t error_code() const;
  void synchronize(void* stream) const;  // waits for the stream; a failed stream raises CudaError  // the host-mapped
                                         // error word: 0, or ipc_error_code(...) of the first failure

  // Every rank signals every peer's slot for this rank with a new epoch, then waits (bounded by timeout_s)
  // until every peer has signalled its slot here. A wait that times out writes the error word and exits.
  void barrier(IpcPhase phase, double timeout_s, void* stream);

  // Dispatch direction: send row i of the send order (offsets: the source plan's [E+1], E = world *
  // E_local) into the owner's region for this rank at place i - offsets[owner * E_local]. by_token: the row
  // is src[row_to_slot[i] / k] (tokens [T, H]) and its metadata and the per-expert counts (+ bad, an int32
  // scalar, optional) travel too; otherwise the row is src[i] (gradients [T*K, H] in send order).
  void send_rows(const TensorView& src, const TensorView& src_scale, const TensorView& row_to_slot,
                 const TensorView& offsets, const TensorView& counts, const TensorView& bad, int k, bool by_token,
                 void* stream);
  // From the counts in this rank's buffer: recv_counts [world, E_local + 1] (a copy), recv_offsets
  // [world * E_local + 1] and recv_base [world * E_local] over blocks of (source, expert) rows, blocks in
  // source-major order (expert-major when expert_major); recv_base[b]: the block's first place in its region.
  void recv_plan(const TensorView& recv_counts, const TensorView& recv_offsets, const TensorView& recv_base,
                 bool expert_major, void* stream);
  // rows [R, H] (+ rows_scale [R, S]) <- this rank's regions in block order; local_ids [R] and ret [R]
  // (source * capacity + send row, where the result goes back) from the metadata, each optional.
  void recv_rows(const TensorView& recv_offsets, const TensorView& recv_base, bool expert_major, const TensorView& rows,
                 const TensorView& rows_scale, const TensorView& local_ids, const TensorView& ret, void* stream);

  // Combine direction: rows[i] (+ scales) into the return region of source ret[i] / capacity at place
  // ret[i] % capacity.
  void send_back(const TensorView& rows, const TensorView& rows_scale, const TensorView& ret, void* stream);
  // out [n, H] (+ out_scale [n, S]) <- this rank's return region, places [0, n).
  void recv_back(const TensorView& out, const TensorView& out_scale, void* stream);

 private:
  int rank_ = 0, device_ = 0;
  IpcLayout layout_;
  uint8_t* base_ = nullptr;
  std::vector<uint8_t*> peers_;   // peers_[p]: rank p's buffer as mapped here (peers_[rank_] == base_)
  std::vector<uint8_t*> opened_;  // what open() mapped, closed by the destructor
  uint64_t* host_error_ = nullptr;
  uint64_t* device_error_ = nullptr;  // host_error_ as the device sees it
  uint64_t epoch_ = 0;
  bool open_ = false;
  std::string handle_;
};

}  // namespace moe8::cuda
