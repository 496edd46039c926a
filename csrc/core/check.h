// check.h — argument validation used once, at the API boundary. Every failure names the argument and
// states expected vs actual.
#pragma once
#include <initializer_list>
#include <string>

#include "core/error.h"
#include "core/tensor.h"

namespace moe8 {

inline const char* device_name(DeviceType d) { return d == DeviceType::kCUDA ? "cuda" : "cpu"; }

inline void check_present(const char* name, const TensorView& t) {
  MOE8_CHECK(t.present, name, ": expected a tensor, got None");
}

inline void check_dtype(const char* name, const TensorView& t, std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype == d) return;
  std::string names;
  for (DType d : allowed) names += (names.empty() ? "" : " or ") + std::string(dtype_name(d));
  fail(name, ": expected dtype ", names, ", got ", dtype_name(t.dtype));
}

inline void check_same_dtype(const char* name, const TensorView& t, const char* ref_name, const TensorView& ref) {
  MOE8_CHECK(t.dtype == ref.dtype, name, ": expected dtype ", dtype_name(ref.dtype), " (same as ", ref_name, "), got ",
             dtype_name(t.dtype));
}

// -1 in `expected` matches any extent.
inline void check_shape(const char* name, const TensorView& t, std::initializer_list<int64_t> expected) {
  bool ok = t.ndim == static_cast<int>(expected.size());
  int i = 0;
  for (int64_t e : expected) {
    if (ok && e >= 0 && t.shape[i] != e) ok = false;
    ++i;
  }
  if (ok) return;
  std::string want = "[";
  i = 0;
  for (int64_t e : expected) want += (i++ ? ", " : "") + (e >= 0 ? std::to_string(e) : std::string("*"));
  fail(name, ": expected shape ", want, "], got ", t.shape_str());
}

inline void check_ndim(const char* name, const TensorView& t, int ndim) {
  MOE8_CHECK(t.ndim == ndim, name, ": expected a ", ndim, "-d tensor, got ", t.ndim, "-d with shape ", t.shape_str());
}

inline void check_contiguous(const char* name, const TensorView& t) {
  MOE8_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor (shape ", t.shape_str(),
             "); call .contiguous() first");
}

inline void check_device(const char* name, const TensorView& t, const char* ref_name, const TensorView& ref) {
  MOE8_CHECK(t.device == ref.device && t.device_index == ref.device_index, name, ": expected device ",
             device_name(ref.device), ":", ref.device_index, " (same as ", ref_name, "), got ", device_name(t.device),
             ":", t.device_index);
}

// present + contiguous + same device as ref: what every tensor argument needs.
inline void check_tensor(const char* name, const TensorView& t, const char* ref_name, const TensorView& ref) {
  check_present(name, t);
  check_device(name, t, ref_name, ref);
  check_contiguous(name, t);
}

inline bool is_float(DType d) { return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16; }

inline void check_float(const char* name, const TensorView& t) {
  check_dtype(name, t, {DType::kF32, DType::kF16, DType::kBF16});
}

// The first argument of most ops: a present, contiguous, 2-d float tensor.
inline void check_float_matrix(const char* name, const TensorView& t) {
  check_present(name, t);
  check_ndim(name, t, 2);
  check_float(name, t);
  check_contiguous(name, t);
}

}  // namespace moe8
