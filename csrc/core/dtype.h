// dtype.h — element types moe8 understands, and scalar conversions usable on host and device.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MOE8_HD __host__ __device__ __forceinline__
#else
#define MOE8_HD inline
#endif

namespace moe8 {

enum class DType : int { kF32 = 0, kF16, kBF16, kF64, kI32, kI64, kU8, kF8E4M3, kF8E5M2 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "float32";
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF64:
      return "float64";
    case DType::kI32:
      return "int32";
    case DType::kI64:
      return "int64";
    case DType::kU8:
      return "uint8";
    case DType::kF8E4M3:
      return "float8_e4m3fn";
    case DType::kF8E5M2:
      return "float8_e5m2";
  }
  return "unknown";
}

inline int dtype_size(DType t) {
  switch (t) {
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    default:
      return 1;
  }
}

// Host-side 16-bit float storage types for the CPU backend (the CUDA backend uses cuda_bf16.h).
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

inline float bf16_to_float(bf16_t v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16_t float_to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{static_cast<uint16_t>(u >> 16)};
}

inline float f16_to_float(f16_t v) {
  uint32_t sign = (v.bits & 0x8000u) << 16, exp = (v.bits >> 10) & 0x1fu, man = v.bits & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        man <<= 1;
        ++e;
      } while ((man & 0x400u) == 0);
      u = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline f16_t float_to_f16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return f16_t{static_cast<uint16_t>(sign | 0x7e00u)};
  if (au >= 0x477ff000u) return f16_t{static_cast<uint16_t>(sign | 0x7c00u)};  // overflow -> inf
  if (au < 0x38800000u) {                                                      // subnormal or zero in half
    float af;
    std::memcpy(&af, &au, 4);
    // 2^-24 is the smallest half subnormal; scale and round to nearest even via float arithmetic.
    float scaled = af * 16777216.0f;  // af / 2^-24
    uint32_t m = static_cast<uint32_t>(scaled);
    float rem = scaled - static_cast<float>(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return f16_t{static_cast<uint16_t>(sign | m)};
  }
  uint32_t exp = ((au >> 23) - 127 + 15), man = au & 0x7fffffu;
  uint32_t h = exp << 10 | man >> 13;
  uint32_t rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return f16_t{static_cast<uint16_t>(sign | h)};
}

// Load/store of any floating storage type as float (CPU backend).
template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}
template <>
inline float to_f<bf16_t>(bf16_t v) {
  return bf16_to_float(v);
}
template <>
inline float to_f<f16_t>(f16_t v) {
  return f16_to_float(v);
}

template <typename T>
inline T from_f(float v) {
  return static_cast<T>(v);
}
template <>
inline bf16_t from_f<bf16_t>(float v) {
  return float_to_bf16(v);
}
template <>
inline f16_t from_f<f16_t>(float v) {
  return float_to_f16(v);
}

}  // namespace moe8
