// tensor.h — a non-owning view of a strided n-d array (what DLPack describes), the currency of the core.
// The caller owns the memory; a view is cheap to copy. An absent optional argument is a view with
// present == false.
#pragma once
#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace moe8 {

enum class DeviceType : int { kCPU = 0, kCUDA = 1 };

constexpr int kMaxDims = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  DeviceType device = DeviceType::kCPU;
  int device_index = 0;
  int ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int64_t strides[kMaxDims] = {0, 0, 0, 0};  // in elements
  bool present = false;

  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }
  bool is_cuda() const { return device == DeviceType::kCUDA; }
  bool is_contiguous() const {  // as torch: a tensor without elements is contiguous whatever its strides
    if (numel() == 0) return true;
    int64_t expect = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      if (shape[i] != 1 && strides[i] != expect) return false;
      expect *= shape[i];
    }
    return true;
  }
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
  std::string shape_str() const {
    std::string s = "[";
    for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
  }
};

// Builds a contiguous view; used by C++ tests and internal callers.
inline TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                            DeviceType device = DeviceType::kCPU) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) v.shape[i++] = s;
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.strides[d] = stride;
    stride *= v.shape[d];
  }
  v.present = true;
  return v;
}

}  // namespace moe8
