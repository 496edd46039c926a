// bindings/view.h — DLPack arrays (any framework) as the core's TensorViews, for every binding file.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <optional>

#include "core/error.h"
#include "core/tensor.h"

namespace moe8::bindings {

namespace nb = nanobind;
using moe8::TensorView;

using Array = nb::ndarray<nb::ro>;  // any dtype, device, shape; outputs are written through data()
using OptArray = std::optional<Array>;

inline moe8::DType to_dtype(nb::dlpack::dtype t, const char* name) {
  using C = nb::dlpack::dtype_code;
  const auto code = static_cast<C>(t.code);
  if (t.lanes == 1) {
    if (code == C::Float && t.bits == 32) return moe8::DType::kF32;
    if (code == C::Float && t.bits == 16) return moe8::DType::kF16;
    if (code == C::Bfloat && t.bits == 16) return moe8::DType::kBF16;
    if (code == C::Float && t.bits == 64) return moe8::DType::kF64;
    if (code == C::Int && t.bits == 32) return moe8::DType::kI32;
    if (code == C::Int && t.bits == 64) return moe8::DType::kI64;
    if (code == C::UInt && t.bits == 8) return moe8::DType::kU8;
    // DLPack 1.1 float8 codes (nanobind 2.9 has no names for them): torch exports float8_e4m3fn as 10 and
    // float8_e5m2 as 12.
    if (static_cast<int>(t.code) == 10 && t.bits == 8) return moe8::DType::kF8E4M3;
    if (static_cast<int>(t.code) == 12 && t.bits == 8) return moe8::DType::kF8E5M2;
  }
  moe8::fail(name, ": unsupported dtype (DLPack code ", int(t.code), ", bits ", int(t.bits), ")");
}

inline TensorView view(const Array& a, const char* name) {
  TensorView v;
  MOE8_CHECK(a.ndim() <= static_cast<size_t>(moe8::kMaxDims), name, ": expected at most ", moe8::kMaxDims,
             " dimensions, got ", a.ndim());
  v.data = const_cast<void*>(a.data());
  v.dtype = to_dtype(a.dtype(), name);
  const int dev = a.device_type();
  MOE8_CHECK(dev == nb::device::cpu::value || dev == nb::device::cuda::value, name,
             ": expected a CPU or CUDA tensor, got DLPack device type ", dev);
  v.device = dev == nb::device::cuda::value ? moe8::DeviceType::kCUDA : moe8::DeviceType::kCPU;
  v.device_index = a.device_id();
  v.ndim = static_cast<int>(a.ndim());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = a.shape(i);
    v.strides[i] = a.stride(i);
  }
  v.present = true;
  return v;
}

inline TensorView view(const OptArray& a, const char* name) { return a ? view(*a, name) : TensorView{}; }

}  // namespace moe8::bindings
