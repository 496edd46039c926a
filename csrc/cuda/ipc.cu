// ipc.cu — the `ipc` expert-parallel transport within one node: kernels that store token rows straight into
// peers' CUDA IPC buffers, bounded barriers between ranks, and the buffer's host side (allocation, export,
// opening the peers' handles). Layout of a buffer: core/ipc_layout.h.
//   nvcc -std=c++17 -arch=sm_90a -Icsrc -c csrc/cuda/ipc.cu
//
// Protocol of one direction (dispatch: sources -> owners; combine: owners -> sources), on each rank's stream:
//   barrier(ready)  every rank has finished reading what the previous op left in its buffer
//   send            a warp per row stores it (16-byte vectors) at its fixed place in the peer's buffer
//   barrier(done)   every row for this rank has landed
//   receive         read this rank's own buffer into caller-owned tensors
// A row's place is a pure function of (source rank, its row in the source's send order), so placement, and
// hence every result, is deterministic, and nothing but the barrier signals is exchanged.
//
// NOTES: a barrier signal is a st.release.sys of the epoch into the peer's slot for this rank and a wait is an
// ld.acquire.sys spin on this rank's slot for the peer. The senders fence (system scope) after their last
// store, before the kernel that signals, so rows are visible to a peer that has seen the signal. Waits read
// %globaltimer and give up after the timeout: the first failure is written, as a code naming the peer and
// the phase, into a host-mapped word (the host raises) and into the buffer's abort word (later waits on this
// rank return at once, so a dead peer costs one timeout, not one per barrier).
#include <cuda_runtime.h>

#include <cstring>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/ipc.h"
#include "cuda/ops.h"
#include "cuda/rowwise.cuh"

namespace moe8::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

struct Peers {  // by value as a kernel argument: every rank's buffer as mapped in this process
  uint8_t* base[kIpcMaxRanks];
};

__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t load_volatile(const uint64_t* p) {
  return *reinterpret_cast<const volatile uint64_t*>(p);
}

// The first failure wins the words (a later one leaves them); racing writers each store a valid code.
__device__ __forceinline__ void record_error(uint64_t* abort, uint64_t* host_error, uint64_t code) {
  if (load_volatile(abort) == 0) *reinterpret_cast<volatile uint64_t*>(abort) = code;
  if (load_volatile(host_error) == 0) *reinterpret_cast<volatile uint64_t*>(host_error) = code;
  __threadfence_system();
}

// A warp copies `bytes` (a multiple of kVec) from src to dst, kVec bytes a lane at a time.
template <int kVec>
__device__ __forceinline__ void warp_copy(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, int64_t bytes,
                                          int lane) {
  using V = std::conditional_t<kVec == 16, uint4, uint32_t>;
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
#pragma unroll 4
  for (int64_t p = lane; p < bytes / kVec; p += 32) d[p] = s[p];
}

// One block, a thread per peer p: signal p, then wait for p's signal.
__global__ void barrier_kernel(Peers peers, IpcLayout L, int me, uint64_t epoch, uint64_t timeout_ns, int phase,
                               uint64_t* host_error) {
  const int p = threadIdx.x;
  if (p >= L.world) return;
  uint8_t* mine = peers.base[me];
  uint64_t* abort = reinterpret_cast<uint64_t*>(mine + L.abort);
  if (load_volatile(abort) != 0) return;  // an earlier wait failed: the transport is unusable
  __threadfence_system();
  store_release_sys(reinterpret_cast<uint64_t*>(peers.base[p] + L.signal_at(me)), epoch);
  const uint64_t* flag = reinterpret_cast<const uint64_t*>(mine + L.signal_at(p));
  const uint64_t start = global_timer_ns();
  while (load_acquire_sys(flag) < epoch) {
    if (load_volatile(abort) != 0) return;  // another peer's wait gave up
    if (global_timer_ns() - start > timeout_ns) {
      record_error(abort, host_error, ipc_error_code(IpcFault::kTimeout, phase, p, epoch));
      return;
    }
    __nanosleep(128);
  }
  __threadfence_system();
}

// A warp per send row i; block 0 also stores the per-expert counts (and the bad-id count) into every owner.
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    send_rows_kernel(Peers peers, IpcLayout L, int me, const uint8_t* __restrict__ src,
                     const uint8_t* __restrict__ src_scale, const int32_t* __restrict__ row_to_slot,
                     const int32_t* __restrict__ offsets, const int32_t* __restrict__ counts,
                     const int32_t* __restrict__ bad, int k, bool by_token, int64_t num_rows) {
  const int El = L.num_local_experts, E = L.world * El;
  if (counts != nullptr && blockIdx.x == 0) {
    for (int j = threadIdx.x; j < E + L.world; j += blockDim.x) {
      const bool expert = j < E;
      const int owner = expert ? j / El : j - E;
      const int32_t v = expert ? counts[j] : (bad != nullptr ? *bad : 0);
      *reinterpret_cast<int32_t*>(peers.base[owner] + L.count_at(me, expert ? j % El : El)) = v;
    }
  }
  const int lane = threadIdx.x & 31;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (i < num_rows) {
    const int e = group_of_row(offsets, E, i);  // i < offsets[E] = num_rows: a nonempty expert
    const int owner = e / El;
    const int64_t place = i - offsets[owner * El];
    const int slot = by_token ? row_to_slot[i] : 0;
    const int64_t r = by_token ? slot / k : i;
    uint8_t* dst = peers.base[owner];
    warp_copy<kVec>(dst + L.row_at(me, place), src + r * L.row_bytes, L.row_bytes, lane);
    if (src_scale != nullptr)
      warp_copy<4>(dst + L.scale_at(me, place), src_scale + r * L.scale_bytes, L.scale_bytes, lane);
    if (by_token && lane == 0) {
      const int4 m = make_int4(e % El, slot / k, slot % k, static_cast<int>(i));
      *reinterpret_cast<int4*>(dst + L.meta_at(me, place)) = m;
    }
  }
  __threadfence_system();
}

// One block: per source, the prefix of its counts (recv_base); then, serially in block order, the offsets.
// A source claiming more rows than a region holds (or negative counts) is recorded as an error and read
// as sending nothing, so the host never sizes a tensor from corrupt counts.
__global__ void recv_plan_kernel(const uint8_t* __restrict__ mine, IpcLayout L, bool expert_major,
                                 int32_t* __restrict__ recv_counts, int32_t* __restrict__ recv_offsets,
                                 int32_t* __restrict__ recv_base, uint64_t* host_error, uint64_t epoch) {
  const int W = L.world, El = L.num_local_experts, C = static_cast<int>(L.counts_per_source());
  const int32_t* counts = reinterpret_cast<const int32_t*>(mine + L.counts);
  uint64_t* abort = reinterpret_cast<uint64_t*>(const_cast<uint8_t*>(mine) + L.abort);
  for (int j = threadIdx.x; j < W * C; j += blockDim.x) recv_counts[j] = counts[j];
  __shared__ int32_t ok[kIpcMaxRanks];
  for (int s = threadIdx.x; s < W; s += blockDim.x) {
    int64_t at = 0;
    bool good = true;
    for (int e = 0; e < El; ++e) {
      const int32_t n = counts[s * C + e];
      good = good && n >= 0;
      recv_base[ipc_block(s, e, W, El, expert_major)] = static_cast<int32_t>(at);
      at += n;
    }
    good = good && at <= L.capacity;
    ok[s] = good;
    if (!good) record_error(abort, host_error, ipc_error_code(IpcFault::kBadCounts, 0, s, epoch));
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  int32_t at = 0;
  for (int b = 0; b < W * El; ++b) {
    int s, e;
    ipc_block_source_expert(b, W, El, expert_major, s, e);
    recv_offsets[b] = at;
    if (ok[s]) at += counts[s * C + e];
  }
  recv_offsets[W * El] = at;
}

template <int kVec>
__global__ void __launch_bounds__(kThreads)
    recv_rows_kernel(const uint8_t* __restrict__ mine, IpcLayout L, const int32_t* __restrict__ recv_offsets,
                     const int32_t* __restrict__ recv_base, bool expert_major, uint8_t* __restrict__ rows,
                     uint8_t* __restrict__ rows_scale, int32_t* __restrict__ local_ids, int32_t* __restrict__ ret,
                     int64_t num_rows) {
  const int lane = threadIdx.x & 31;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (i >= num_rows) return;
  const int W = L.world, El = L.num_local_experts;
  const int b = group_of_row(recv_offsets, W * El, i);
  int s, e;
  ipc_block_source_expert(b, W, El, expert_major, s, e);
  const int64_t place = recv_base[b] + (i - recv_offsets[b]);
  warp_copy<kVec>(rows + i * L.row_bytes, mine + L.row_at(s, place), L.row_bytes, lane);
  if (rows_scale != nullptr)
    warp_copy<4>(rows_scale + i * L.scale_bytes, mine + L.scale_at(s, place), L.scale_bytes, lane);
  if (lane == 0 && (local_ids != nullptr || ret != nullptr)) {
    const int4 m = *reinterpret_cast<const int4*>(mine + L.meta_at(s, place));
    if (local_ids != nullptr) local_ids[i] = m.x;
    if (ret != nullptr) ret[i] = static_cast<int32_t>(s * L.capacity + m.w);
  }
}

template <int kVec>
__global__ void __launch_bounds__(kThreads)
    send_back_kernel(Peers peers, IpcLayout L, const uint8_t* __restrict__ rows, const uint8_t* __restrict__ rows_scale,
                     const int32_t* __restrict__ ret, int64_t num_rows) {
  const int lane = threadIdx.x & 31;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (i < num_rows) {
    const int64_t r = ret[i], s = r / L.capacity, place = r % L.capacity;
    uint8_t* dst = peers.base[s];
    warp_copy<kVec>(dst + L.ret_at(place), rows + i * L.row_bytes, L.row_bytes, lane);
    if (rows_scale != nullptr)
      warp_copy<4>(dst + L.ret_scale_at(place), rows_scale + i * L.scale_bytes, L.scale_bytes, lane);
  }
  __threadfence_system();
}

unsigned warps_grid(int64_t n) { return static_cast<unsigned>(std::max<int64_t>(1, ceil_div(n, kWarps))); }

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

const uint8_t* bytes_of(const TensorView& t) { return t.present ? static_cast<const uint8_t*>(t.data) : nullptr; }
uint8_t* mutable_bytes_of(const TensorView& t) { return t.present ? static_cast<uint8_t*>(t.data) : nullptr; }
const int32_t* ints_of(const TensorView& t) { return t.present ? t.ptr<int32_t>() : nullptr; }
int32_t* mutable_ints_of(const TensorView& t) { return t.present ? t.ptr<int32_t>() : nullptr; }

// Calls f(std::integral_constant<int, 16 or 4>) by whether the tensor rows allow 16-byte vectors (the
// buffer's rows always do: row_bytes is a multiple of 16 and the sections are aligned).
template <typename F>
void with_vec(const void* p, const F& f) {
  if (aligned16(p))
    f(std::integral_constant<int, 16>{});
  else
    f(std::integral_constant<int, 4>{});
}

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cuda_check(cudaGetDevice(&prev_), "ipc: cudaGetDevice");
    if (prev_ != device) cuda_check(cudaSetDevice(device), "ipc: cudaSetDevice");
  }
  ~DeviceGuard() { (void)cudaSetDevice(prev_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

}  // namespace

IpcBuffer::IpcBuffer(int rank, const IpcLayout& layout, int device) : rank_(rank), device_(device), layout_(layout) {
  DeviceGuard guard(device);
  const std::string what =
      str_cat("ipc: cudaMalloc of the receive buffer (", layout_.total, " bytes: ", layout_.world, " sources x ",
              layout_.capacity, " rows x ", layout_.stride, " bytes, and the return region)");
  cuda_check(cudaMalloc(&base_, layout_.total), what.c_str());
  try {
    cuda_check(cudaMemset(base_, 0, layout_.total), "ipc: zeroing the receive buffer");
    cuda_check(cudaHostAlloc(&host_error_, sizeof(uint64_t), cudaHostAllocMapped), "ipc: cudaHostAlloc");
    *reinterpret_cast<volatile uint64_t*>(host_error_) = 0;
    cuda_check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_error_), host_error_, 0),
               "ipc: cudaHostGetDevicePointer");
    cudaIpcMemHandle_t h;
    cuda_check(cudaIpcGetMemHandle(&h, base_), "ipc: cudaIpcGetMemHandle");
    handle_.assign(reinterpret_cast<const char*>(&h), sizeof(h));
    cuda_check(cudaDeviceSynchronize(), "ipc: zeroing the receive buffer");  // zeroed before peers see it
  } catch (...) {
    if (host_error_ != nullptr) (void)cudaFreeHost(host_error_);
    (void)cudaFree(base_);
    throw;
  }
  peers_.assign(layout_.world, nullptr);
  peers_[rank_] = base_;
}

IpcBuffer::~IpcBuffer() {
  if (cudaSetDevice(device_) != cudaSuccess) return;
  close_peers();
  (void)cudaFree(base_);
  (void)cudaFreeHost(host_error_);
  (void)cudaGetLastError();
}

std::string IpcBuffer::handle() const { return handle_; }

void IpcBuffer::close_peers() {
  DeviceGuard guard(device_);
  (void)cudaDeviceSynchronize();  // waits are bounded: this returns within a timeout
  for (uint8_t* p : opened_) (void)cudaIpcCloseMemHandle(p);
  opened_.clear();
  for (int p = 0; p < layout_.world; ++p)
    if (p != rank_) peers_[p] = nullptr;
  open_ = false;
  (void)cudaGetLastError();
}

void IpcBuffer::open(const std::vector<std::string>& handles) {
  DeviceGuard guard(device_);
  for (int p = 0; p < layout_.world; ++p) {
    if (p == rank_) continue;
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handles[p].data(), sizeof(h));
    void* ptr = nullptr;
    const cudaError_t e = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      throw CudaError(str_cat("ipc: rank ", rank_, " could not open rank ", p,
                              "'s buffer (cudaIpcOpenMemHandle: ", cudaGetErrorString(e),
                              "); the ranks of an ipc group must be processes of one node, one per rank"));
    }
    opened_.push_back(static_cast<uint8_t*>(ptr));
    peers_[p] = static_cast<uint8_t*>(ptr);
  }
  open_ = true;
}

void IpcBuffer::synchronize(void* stream) const {
  const cudaError_t e = cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess)
    throw CudaError(str_cat("ipc transport: rank ", rank_, ": the stream failed: ", cudaGetErrorString(e)));
}

uint64_t IpcBuffer::error_code() const { return *reinterpret_cast<const volatile uint64_t*>(host_error_); }

namespace {
Peers peers_of(const std::vector<uint8_t*>& v) {
  Peers p{};
  for (size_t i = 0; i < v.size(); ++i) p.base[i] = v[i];
  return p;
}
}  // namespace

void IpcBuffer::barrier(IpcPhase phase, double timeout_s, void* stream) {
  DeviceGuard guard(device_);
  const uint64_t timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
  const unsigned threads = static_cast<unsigned>(ceil_div(layout_.world, 32) * 32);
  barrier_kernel<<<1, threads, 0, as_stream(stream)>>>(peers_of(peers_), layout_, rank_, ++epoch_, timeout_ns,
                                                       static_cast<int>(phase), device_error_);
  check_launch("ipc barrier_kernel");
}

void IpcBuffer::send_rows(const TensorView& src, const TensorView& src_scale, const TensorView& row_to_slot,
                          const TensorView& offsets, const TensorView& counts, const TensorView& bad, int k,
                          bool by_token, void* stream) {
  DeviceGuard guard(device_);
  const int64_t num_rows = by_token ? row_to_slot.numel() : src.shape[0];
  with_vec(src.data, [&](auto v) {
    constexpr int kVec = decltype(v)::value;
    send_rows_kernel<kVec><<<warps_grid(num_rows), kThreads, 0, as_stream(stream)>>>(
        peers_of(peers_), layout_, rank_, bytes_of(src), bytes_of(src_scale), ints_of(row_to_slot), ints_of(offsets),
        by_token ? ints_of(counts) : nullptr, by_token ? ints_of(bad) : nullptr, k, by_token, num_rows);
    check_launch("ipc send_rows_kernel");
  });
}

void IpcBuffer::recv_plan(const TensorView& recv_counts, const TensorView& recv_offsets, const TensorView& recv_base,
                          bool expert_major, void* stream) {
  DeviceGuard guard(device_);
  recv_plan_kernel<<<1, 128, 0, as_stream(stream)>>>(base_, layout_, expert_major, recv_counts.ptr<int32_t>(),
                                                     recv_offsets.ptr<int32_t>(), recv_base.ptr<int32_t>(),
                                                     device_error_, epoch_);
  check_launch("ipc recv_plan_kernel");
}

void IpcBuffer::recv_rows(const TensorView& recv_offsets, const TensorView& recv_base, bool expert_major,
                          const TensorView& rows, const TensorView& rows_scale, const TensorView& local_ids,
                          const TensorView& ret, void* stream) {
  const int64_t num_rows = rows.shape[0];
  if (num_rows == 0) return;
  DeviceGuard guard(device_);
  with_vec(rows.data, [&](auto v) {
    constexpr int kVec = decltype(v)::value;
    recv_rows_kernel<kVec><<<warps_grid(num_rows), kThreads, 0, as_stream(stream)>>>(
        base_, layout_, recv_offsets.ptr<int32_t>(), recv_base.ptr<int32_t>(), expert_major, mutable_bytes_of(rows),
        mutable_bytes_of(rows_scale), mutable_ints_of(local_ids), mutable_ints_of(ret), num_rows);
    check_launch("ipc recv_rows_kernel");
  });
}

void IpcBuffer::send_back(const TensorView& rows, const TensorView& rows_scale, const TensorView& ret, void* stream) {
  const int64_t num_rows = rows.shape[0];
  if (num_rows == 0) return;
  DeviceGuard guard(device_);
  with_vec(rows.data, [&](auto v) {
    constexpr int kVec = decltype(v)::value;
    send_back_kernel<kVec><<<warps_grid(num_rows), kThreads, 0, as_stream(stream)>>>(
        peers_of(peers_), layout_, bytes_of(rows), bytes_of(rows_scale), ret.ptr<int32_t>(), num_rows);
    check_launch("ipc send_back_kernel");
  });
}

void IpcBuffer::recv_back(const TensorView& out, const TensorView& out_scale, void* stream) {
  const int64_t n = out.shape[0];
  if (n == 0) return;
  DeviceGuard guard(device_);
  cudaStream_t s = as_stream(stream);
  cuda_check(cudaMemcpy2DAsync(out.data, layout_.row_bytes, base_ + layout_.ret_at(0), layout_.stride,
                               layout_.row_bytes, n, cudaMemcpyDeviceToDevice, s),
             "ipc: copying the returned rows");
  if (out_scale.present && layout_.scale_bytes > 0)
    cuda_check(cudaMemcpy2DAsync(out_scale.data, layout_.scale_bytes, base_ + layout_.ret_scale_at(0), layout_.stride,
                                 layout_.scale_bytes, n, cudaMemcpyDeviceToDevice, s),
               "ipc: copying the returned scales");
}

}  // namespace moe8::cuda
