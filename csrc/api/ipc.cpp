// api/ipc.cpp — validation of the `ipc` transport's calls, and the order of a direction's steps (barrier,
// send, barrier). Kernels and the buffer's host side: cuda/ipc.cu.
#include "api/ipc.h"

#include "api/common.h"
#include "core/check.h"
#include "cuda/ipc.h"

namespace moe8::api {
namespace {

constexpr int64_t kMaxBufferRows = int64_t(1) << 31;  // ret packs source * capacity + row into an int32

int64_t elem_bytes(DType d) { return dtype_size(d); }

std::string error_message(uint64_t code, int rank, int world) {
  const IpcErrorInfo e = ipc_decode_error(code);
  if (e.kind == IpcFault::kBadCounts)
    return str_cat("ipc transport: rank ", rank, " received corrupt row counts from rank ", e.peer,
                   " (negative, or more rows than a region holds); the transport is unusable: recreate it on every "
                   "rank");
  return str_cat("ipc transport: rank ", rank, " timed out in the ", ipc_phase_name(e.phase), " barrier (epoch ",
                 e.epoch, "): peer rank ", e.peer, " of ", world,
                 " never arrived (it exited, hung, or is not making the same sequence of dispatch/combine calls); "
                 "the transport is unusable: recreate it on every rank");
}

}  // namespace

IpcLayout ipc_layout(int rank, int world, int num_local_experts, int64_t capacity, int64_t hidden, DType dtype,
                     int64_t scale_cols) {
  MOE8_CHECK(world >= 1 && world <= kIpcMaxRanks, "world: expected 1..", kIpcMaxRanks, " ranks, got ", world);
  MOE8_CHECK(rank >= 0 && rank < world, "rank: expected 0..", world - 1, ", got ", rank);
  MOE8_CHECK(num_local_experts >= 1, "num_local_experts: expected >= 1, got ", num_local_experts);
  MOE8_CHECK(capacity >= 1, "capacity: expected >= 1 rows per source (max tokens x K), got ", capacity);
  MOE8_CHECK(capacity * world < kMaxBufferRows, "capacity: ", capacity, " rows per source x ", world,
             " sources exceeds the 2^31 rows one buffer can address");
  MOE8_CHECK(hidden >= 1, "hidden: expected >= 1, got ", hidden);
  const bool fp8 = dtype == DType::kU8 || dtype == DType::kF8E4M3;
  MOE8_CHECK(is_float(dtype) || fp8, "dtype: expected float32, float16, bfloat16, uint8 or float8_e4m3fn rows, got ",
             dtype_name(dtype));
  const int64_t row_bytes = hidden * elem_bytes(dtype);
  MOE8_CHECK(row_bytes % 16 == 0, "hidden: a row of ", hidden, " ", dtype_name(dtype), " is ", row_bytes,
             " bytes; expected a multiple of 16 (hidden a multiple of ", 16 / elem_bytes(dtype), ")");
  MOE8_CHECK(scale_cols >= 0, "scale_cols: expected >= 0, got ", scale_cols);
  return make_ipc_layout(world, num_local_experts, capacity, row_bytes, 4 * scale_cols);
}

IpcBuffer::IpcBuffer(int rank, int world, int num_local_experts, int64_t capacity, int64_t hidden, DType dtype,
                     int64_t scale_cols, int device)
    : rank_(rank),
      device_(device),
      hidden_(hidden),
      scale_cols_(scale_cols),
      dtype_(dtype),
      layout_(ipc_layout(rank, world, num_local_experts, capacity, hidden, dtype, scale_cols)) {
  if (!cuda::backend_built()) fail_without_cuda("IpcBuffer");
  MOE8_CHECK(device >= 0, "device: expected a CUDA device index, got ", device);
  impl_ = std::make_unique<cuda::IpcBuffer>(rank, layout_, device);
}

IpcBuffer::~IpcBuffer() = default;

std::string IpcBuffer::handle() const { return impl_->handle(); }

void IpcBuffer::open(const std::vector<std::string>& handles) {
  MOE8_CHECK(static_cast<int>(handles.size()) == layout_.world, "handles: expected one per rank (", layout_.world,
             "), got ", handles.size());
  for (size_t p = 0; p < handles.size(); ++p)
    MOE8_CHECK(handles[p].size() == impl_->handle().size(), "handles[", p, "]: expected a ", impl_->handle().size(),
               "-byte CUDA IPC handle, got ", handles[p].size(), " bytes");
  MOE8_CHECK(!impl_->is_open(), "handles: the peers' buffers are already open");
  impl_->open(handles);
}

void IpcBuffer::close_peers() { impl_->close_peers(); }

void IpcBuffer::check(bool sync, intptr_t stream) const {
  if (sync) impl_->synchronize(as_ptr(stream));
  const uint64_t code = impl_->error_code();
  if (code != 0) throw CudaError(error_message(code, rank_, layout_.world));
}

// A present, contiguous [rows, hidden] tensor of the buffer's dtype on its device.
void IpcBuffer::check_rows(const char* name, const TensorView& t, int64_t rows) const {
  check_present(name, t);
  MOE8_CHECK(t.is_cuda() && t.device_index == device_, name, ": expected a tensor on cuda:", device_,
             " (the buffer's device), got ", device_name(t.device), ":", t.device_index);
  MOE8_CHECK(t.dtype == dtype_, name, ": expected dtype ", dtype_name(dtype_), " (the buffer's), got ",
             dtype_name(t.dtype));
  check_contiguous(name, t);
  check_shape(name, t, {rows, hidden_});
}

void IpcBuffer::check_scales(const char* name, const TensorView& t, int64_t rows) const {
  if (scale_cols_ == 0) {
    MOE8_CHECK(!t.present, name, ": the buffer carries no scales (scale_cols 0), got a tensor");
    return;
  }
  check_present(name, t);
  MOE8_CHECK(t.is_cuda() && t.device_index == device_, name, ": expected a tensor on cuda:", device_,
             " (the buffer's device), got ", device_name(t.device), ":", t.device_index);
  check_dtype(name, t, {DType::kF32});
  check_contiguous(name, t);
  check_shape(name, t, {rows, scale_cols_});
}

namespace {

void check_ints(const char* name, const TensorView& t, const char* ref_name, const TensorView& ref,
                std::initializer_list<int64_t> shape) {
  check_tensor(name, t, ref_name, ref);
  check_dtype(name, t, {DType::kI32});
  check_shape(name, t, shape);
}

}  // namespace

void IpcBuffer::dispatch_send(const TensorView& src, const TensorView& src_scale, const TensorView& row_to_slot,
                              const TensorView& offsets, const TensorView& counts, const TensorView& bad, int k,
                              bool by_token, double timeout_s, intptr_t stream, bool check_indices) {
  check(false, stream);
  MOE8_CHECK(k >= 1, "k: expected >= 1, got ", k);
  MOE8_CHECK(timeout_s > 0, "timeout_s: expected > 0 seconds, got ", timeout_s);
  check_present("src", src);
  check_ndim("src", src, 2);
  const int64_t slots = by_token ? src.size(0) * k : src.size(0);
  MOE8_CHECK(slots <= layout_.capacity, "capacity exceeded: rank ", rank_, " sends ", slots, " rows (",
             by_token ? str_cat(src.size(0), " tokens x k ", k) : std::string("gradient rows"), "), a region holds ",
             layout_.capacity, " (max tokens x K); create the transport with a larger max_tokens");
  check_rows("src", src, src.size(0));
  check_scales("src_scale", src_scale, src.size(0));
  const int64_t E = int64_t(layout_.world) * layout_.num_local_experts;
  check_ints("offsets", offsets, "src", src, {E + 1});
  if (by_token) {
    check_ints("row_to_slot", row_to_slot, "src", src, {slots});
    check_ints("counts", counts, "src", src, {E});
    if (bad.present) check_ints("bad", bad, "src", src, {1});
  }
  if (check_indices) {
    check_offsets(offsets, slots, stream);
    const std::vector<int32_t> off = host_offsets(offsets, stream);
    MOE8_CHECK(off.back() == slots, "offsets: expected offsets[E] == ", slots, " rows (no padding), got ", off.back());
    if (by_token) check_range("row_to_slot", row_to_slot, 0, slots, stream);
  }
  MOE8_CHECK(impl_->is_open(), "IpcBuffer: open() the peers' handles before the first dispatch");
  impl_->barrier(IpcPhase::kDispatchReady, timeout_s, as_ptr(stream));
  impl_->send_rows(src, src_scale, row_to_slot, offsets, counts, bad, k, by_token, as_ptr(stream));
  impl_->barrier(IpcPhase::kDispatchDone, timeout_s, as_ptr(stream));
}

void IpcBuffer::dispatch_plan(const TensorView& recv_counts, const TensorView& recv_offsets,
                              const TensorView& recv_base, bool expert_major, intptr_t stream) {
  check(false, stream);
  const int64_t W = layout_.world, El = layout_.num_local_experts;
  check_present("recv_counts", recv_counts);
  MOE8_CHECK(recv_counts.is_cuda() && recv_counts.device_index == device_,
             "recv_counts: expected a tensor on cuda:", device_, " (the buffer's device), got ",
             device_name(recv_counts.device), ":", recv_counts.device_index);
  check_ints("recv_counts", recv_counts, "recv_counts", recv_counts, {W, El + 1});
  check_ints("recv_offsets", recv_offsets, "recv_counts", recv_counts, {W * El + 1});
  check_ints("recv_base", recv_base, "recv_counts", recv_counts, {W * El});
  impl_->recv_plan(recv_counts, recv_offsets, recv_base, expert_major, as_ptr(stream));
}

void IpcBuffer::dispatch_recv(const TensorView& recv_offsets, const TensorView& recv_base, bool expert_major,
                              const TensorView& rows, const TensorView& rows_scale, const TensorView& local_ids,
                              const TensorView& ret, intptr_t stream) {
  check(false, stream);
  const int64_t W = layout_.world, El = layout_.num_local_experts;
  check_present("rows", rows);
  check_ndim("rows", rows, 2);
  const int64_t R = rows.size(0);
  MOE8_CHECK(R <= W * layout_.capacity, "rows: expected at most ", W * layout_.capacity, " rows (", W,
             " sources x capacity ", layout_.capacity, "), got ", R);
  check_rows("rows", rows, R);
  check_scales("rows_scale", rows_scale, R);
  check_ints("recv_offsets", recv_offsets, "rows", rows, {W * El + 1});
  check_ints("recv_base", recv_base, "rows", rows, {W * El});
  if (local_ids.present) check_ints("local_ids", local_ids, "rows", rows, {R});
  if (ret.present) check_ints("ret", ret, "rows", rows, {R});
  impl_->recv_rows(recv_offsets, recv_base, expert_major, rows, rows_scale, local_ids, ret, as_ptr(stream));
}

void IpcBuffer::combine_send(const TensorView& rows, const TensorView& rows_scale, const TensorView& ret,
                             double timeout_s, intptr_t stream, bool check_indices) {
  check(false, stream);
  MOE8_CHECK(timeout_s > 0, "timeout_s: expected > 0 seconds, got ", timeout_s);
  check_present("rows", rows);
  check_ndim("rows", rows, 2);
  const int64_t R = rows.size(0);
  check_rows("rows", rows, R);
  check_scales("rows_scale", rows_scale, R);
  check_ints("ret", ret, "rows", rows, {R});
  if (check_indices) check_range("ret", ret, 0, int64_t(layout_.world) * layout_.capacity, stream);
  MOE8_CHECK(impl_->is_open(), "IpcBuffer: open() the peers' handles before the first combine");
  impl_->barrier(IpcPhase::kCombineReady, timeout_s, as_ptr(stream));
  impl_->send_back(rows, rows_scale, ret, as_ptr(stream));
  impl_->barrier(IpcPhase::kCombineDone, timeout_s, as_ptr(stream));
}

void IpcBuffer::combine_recv(const TensorView& out, const TensorView& out_scale, intptr_t stream) {
  check(false, stream);
  check_present("out", out);
  check_ndim("out", out, 2);
  const int64_t n = out.size(0);
  MOE8_CHECK(n <= layout_.capacity, "out: expected at most ", layout_.capacity, " rows (the capacity), got ", n);
  check_rows("out", out, n);
  check_scales("out_scale", out_scale, n);
  impl_->recv_back(out, out_scale, as_ptr(stream));
}

}  // namespace moe8::api
