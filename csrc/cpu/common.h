// cpu/common.h — dtype dispatch for the CPU references (storage types from core/dtype.h).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"

// Runs the lambda body with scalar_t bound to the storage type of a float dtype.
#define MOE8_CPU_DISPATCH_FLOAT(dtype, NAME, ...)                              \
  [&] {                                                                        \
    switch (dtype) {                                                           \
      case ::moe8::DType::kF32: {                                              \
        using scalar_t = float;                                                \
        return __VA_ARGS__();                                                  \
      }                                                                        \
      case ::moe8::DType::kF16: {                                              \
        using scalar_t = ::moe8::f16_t;                                        \
        return __VA_ARGS__();                                                  \
      }                                                                        \
      case ::moe8::DType::kBF16: {                                             \
        using scalar_t = ::moe8::bf16_t;                                       \
        return __VA_ARGS__();                                                  \
      }                                                                        \
      default:                                                                 \
        ::moe8::fail(NAME, ": unsupported dtype ", ::moe8::dtype_name(dtype)); \
    }                                                                          \
  }()

namespace moe8::cpu {

// Group offsets [E+1] as the references read them: each clamped to [previous, rows], so that an array the
// API did not check can never move a kernel outside rows 0..rows-1 (the API checks them on the CPU anyway).
inline std::vector<int64_t> clamped_offsets(const TensorView& offsets, int64_t rows) {
  const int32_t* o = offsets.ptr<int32_t>();
  std::vector<int64_t> off(offsets.numel());
  int64_t prev = 0;
  for (size_t e = 0; e < off.size(); ++e) prev = off[e] = std::clamp<int64_t>(o[e], prev, rows);
  return off;
}

// Whether an index lies in [0, n): out-of-range entries are skipped (their row reads as none).
inline bool in_range(int64_t i, int64_t n) { return i >= 0 && i < n; }

}  // namespace moe8::cpu
