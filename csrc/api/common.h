// api/common.h — what the API's translation units share (internal, not part of the public API): the
// stream cast, the "built without CUDA" error, backend choice, and the checks of index arrays that need
// their values (on a CUDA tensor these synchronise the stream). Without the CUDA backend, cuda/ops.h is
// answered by csrc/cuda_stub/, so nothing here depends on how moe8 was built.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/check.h"
#include "core/error.h"
#include "core/tensor.h"
#include "cuda/ops.h"

namespace moe8::api {

inline void* as_ptr(intptr_t s) { return reinterpret_cast<void*>(s); }

// Whether the values of t's index arrays are checked: always on the CPU (a pass over host memory, no sync),
// on a GPU only when the caller asks (check_indices: a synchronising read), since its kernels skip or clamp
// what is out of range rather than read outside their tensors.
inline bool checks_values(bool check_indices, const TensorView& t) { return check_indices || !t.is_cuda(); }

// True for a CUDA tensor, which a build without the CUDA backend refuses, naming op.
inline bool on_cuda(const TensorView& t, const char* op) {
  if (t.is_cuda() && !cuda::backend_built()) fail_without_cuda(op);
  return t.is_cuda();
}

// Values of an int32 index array must lie in [lo, hi).
inline void check_range(const char* name, const TensorView& t, int64_t lo, int64_t hi, intptr_t stream) {
  int64_t bad = 0;
  if (on_cuda(t, name)) {
    bad = cuda::count_out_of_range(t.ptr<int32_t>(), t.numel(), lo, hi, as_ptr(stream));
  } else {
    const int32_t* p = t.ptr<int32_t>();
    for (int64_t i = 0; i < t.numel(); ++i) bad += (p[i] < lo || p[i] >= hi);
  }
  MOE8_CHECK(bad == 0, name, ": expected values in [", lo, ", ", hi, "), found ", bad, " out of range");
}

// An optional slot_to_row given beside row_to_slot (its inverse: slot -> row, -1 none; lets the CUDA kernels
// read each token once): int32 [T*k] on ref's device, values in [-1, R) (checked when check_indices).
inline void check_slot_to_row(const TensorView& slot_to_row, const TensorView& row_to_slot, const char* ref_name,
                              const TensorView& ref, int64_t T, int k, int64_t R, intptr_t stream, bool check_indices) {
  if (!slot_to_row.present) return;
  MOE8_CHECK(row_to_slot.present, "slot_to_row: given without row_to_slot (it is row_to_slot's inverse)");
  check_tensor("slot_to_row", slot_to_row, ref_name, ref);
  check_dtype("slot_to_row", slot_to_row, {DType::kI32});
  check_ndim("slot_to_row", slot_to_row, 1);
  MOE8_CHECK(slot_to_row.size(0) == T * k, "slot_to_row: expected ", T * k, " slots (", ref_name, "'s ", T,
             " rows x k ", k, "), got ", slot_to_row.size(0));
  if (check_indices) check_range("slot_to_row", slot_to_row, -1, R, stream);
}

// The int32 offsets on the host (a synchronising copy when they live on a GPU).
inline std::vector<int32_t> host_offsets(const TensorView& offsets, intptr_t stream) {
  std::vector<int32_t> off(offsets.numel());
  if (on_cuda(offsets, "offsets")) {
    if (!cuda::copy_to_host(off.data(), offsets.data, off.size() * 4, as_ptr(stream)))
      throw CudaError("offsets: copy to host failed");
  } else {
    std::copy(offsets.ptr<int32_t>(), offsets.ptr<int32_t>() + off.size(), off.begin());
  }
  return off;
}

// offsets[0] == 0, nondecreasing, offsets[E] <= rows.
inline void check_offsets(const TensorView& offsets, int64_t rows, intptr_t stream) {
  const std::vector<int32_t> off = host_offsets(offsets, stream);
  MOE8_CHECK(off[0] == 0, "offsets: expected offsets[0] == 0, got ", off[0]);
  for (size_t e = 1; e < off.size(); ++e)
    MOE8_CHECK(off[e] >= off[e - 1], "offsets: expected nondecreasing values, got offsets[", e, "] = ", off[e],
               " < offsets[", e - 1, "] = ", off[e - 1]);
  MOE8_CHECK(off.back() <= rows, "offsets: expected offsets[E] <= ", rows, " rows, got ", off.back());
}

inline void check_optional(const char* name, const TensorView& t, const char* ref_name, const TensorView& ref) {
  if (t.present) check_tensor(name, t, ref_name, ref);
}

}  // namespace moe8::api
