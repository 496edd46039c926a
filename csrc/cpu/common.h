// cpu/common.h — dtype dispatch for the CPU references (storage types from core/dtype.h).
#pragma once
#include "core/dtype.h"
#include "core/error.h"

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
