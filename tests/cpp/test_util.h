// test_util.h — what every C++ test shares: host tensors of any dtype read and written as double,
// poisoning, seeded random inputs, tolerance comparison against float64 references, and the matcher
// for moe8::Error messages. Built into moe8_tests (tests/cpp/*.cpp, GoogleTest).
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "api/ops.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"

namespace moe8::test {

using Shape = std::vector<int64_t>;
constexpr int32_t kIntPoison = -12345;

inline int64_t numel_of(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

inline std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? "," : "") << s[i];
  os << "]";
  return os.str();
}

inline const char* name_of(DType d) { return dtype_name(d); }

// A contiguous view through moe8::make_view for a runtime shape (make_view takes an initializer list).
inline TensorView view_of(void* data, DType dtype, const Shape& s, DeviceType dev = DeviceType::kCPU) {
  switch (s.size()) {
    case 0:
      return make_view(data, dtype, {}, dev);
    case 1:
      return make_view(data, dtype, {s[0]}, dev);
    case 2:
      return make_view(data, dtype, {s[0], s[1]}, dev);
    case 3:
      return make_view(data, dtype, {s[0], s[1], s[2]}, dev);
    default:
      return make_view(data, dtype, {s[0], s[1], s[2], s[3]}, dev);
  }
}

inline TensorView absent() { return TensorView{}; }

// Host-owned contiguous tensor; elements are read and written as double (written values are rounded
// to the dtype with round-to-nearest-even, which is what the test inputs really hold).
class HostTensor {
 public:
  HostTensor() = default;
  // extra_bytes: slack after the data, so a view mutated by a validation test cannot reach past it.
  HostTensor(DType dtype, Shape shape, size_t extra_bytes = 0)
      : dtype_(dtype), shape_(std::move(shape)), storage_((nbytes_for() + extra_bytes) / 8 + 2, 0) {}

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t numel() const { return numel_of(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  void* data() { return storage_.data(); }
  const void* data() const { return storage_.data(); }
  TensorView view() const { return view_of(const_cast<uint64_t*>(storage_.data()), dtype_, shape_); }
  int32_t* i32() { return reinterpret_cast<int32_t*>(storage_.data()); }
  const int32_t* i32() const { return reinterpret_cast<const int32_t*>(storage_.data()); }

  double get(int64_t i) const {
    const void* p = storage_.data();
    switch (dtype_) {
      case DType::kF32:
        return static_cast<const float*>(p)[i];
      case DType::kF16:
        return f16_to_float(static_cast<const f16_t*>(p)[i]);
      case DType::kBF16:
        return bf16_to_float(static_cast<const bf16_t*>(p)[i]);
      case DType::kF64:
        return static_cast<const double*>(p)[i];
      case DType::kI32:
        return static_cast<const int32_t*>(p)[i];
      case DType::kI64:
        return static_cast<double>(static_cast<const int64_t*>(p)[i]);
      default:
        return static_cast<const uint8_t*>(p)[i];
    }
  }
  void set(int64_t i, double v) {
    void* p = storage_.data();
    switch (dtype_) {
      case DType::kF32:
        static_cast<float*>(p)[i] = static_cast<float>(v);
        break;
      case DType::kF16:
        static_cast<f16_t*>(p)[i] = float_to_f16(static_cast<float>(v));
        break;
      case DType::kBF16:
        static_cast<bf16_t*>(p)[i] = float_to_bf16(static_cast<float>(v));
        break;
      case DType::kF64:
        static_cast<double*>(p)[i] = v;
        break;
      case DType::kI32:
        static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
        break;
      case DType::kI64:
        static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v);
        break;
      default:
        static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v);
        break;
    }
  }
  std::vector<double> values() const {
    std::vector<double> v(numel());
    for (int64_t i = 0; i < numel(); ++i) v[i] = get(i);
    return v;
  }
  // Floats: quiet NaN in every element (0x7fc0 for bf16); integers: kIntPoison; 8-bit (FP8 storage): 0xFF
  // (an e4m3 NaN no conversion produces).
  void poison() {
    for (int64_t i = 0; i < numel(); ++i) {
      if (dtype_ == DType::kI32 || dtype_ == DType::kI64)
        set(i, kIntPoison);
      else if (dtype_size(dtype_) == 1)
        reinterpret_cast<uint8_t*>(storage_.data())[i] = 0xFF;
      else if (dtype_ == DType::kBF16)
        reinterpret_cast<uint16_t*>(storage_.data())[i] = 0x7fc0;
      else
        set(i, std::numeric_limits<double>::quiet_NaN());
    }
  }
  bool bitwise_equal(const HostTensor& o) const {
    return dtype_ == o.dtype_ && shape_ == o.shape_ && std::memcmp(data(), o.data(), nbytes()) == 0;
  }

 private:
  size_t nbytes_for() const { return static_cast<size_t>(numel_of(shape_)) * dtype_size(dtype_); }
  DType dtype_ = DType::kF32;
  Shape shape_;
  std::vector<uint64_t> storage_;
};

inline HostTensor ints(const Shape& s, const std::vector<int>& v) {
  HostTensor t(DType::kI32, s);
  for (int64_t i = 0; i < t.numel(); ++i) t.i32()[i] = v[i];
  return t;
}

struct Rng {
  explicit Rng(uint64_t seed) : g(seed) {}
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(g); }
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(g); }
  int randint(int lo, int hi_excl) { return std::uniform_int_distribution<int>(lo, hi_excl - 1)(g); }
  std::mt19937_64 g;
};

inline HostTensor random_tensor(DType dtype, const Shape& s, Rng& rng, double lo = -1.0, double hi = 1.0) {
  HostTensor t(dtype, s);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, rng.uniform(lo, hi));
  return t;
}

// Relative error a correct result may carry from its final rounding to `d` (half an ulp, with margin
// for an fp32 value that sat on a rounding boundary), and the absolute floor for subnormals.
inline double out_rel(DType d) {
  switch (d) {
    case DType::kF16:
      return std::ldexp(1.0, -11) * 1.01;
    case DType::kBF16:
      return std::ldexp(1.0, -8) * 1.01;
    default:
      return std::ldexp(1.0, -23);
  }
}
inline double out_abs(DType d) {
  switch (d) {
    case DType::kF16:
      return std::ldexp(1.0, -24);
    default:
      return 1e-30;
  }
}
// Relative error of fp32 arithmetic over n terms (worst case, with a few ulps for libm functions).
inline double fp32_rel(int64_t n_terms) { return std::ldexp(1.0, -24) * static_cast<double>(n_terms + 8); }

// A float64 expectation: value and the magnitude scale its fp32 computation error is relative to.
struct Expect {
  std::vector<double> want;
  std::vector<double> mag;
  double comp_rel = 0.0;  // fp32 computation error, relative to mag
};

inline double tol_at(DType d, double base, const Expect& e, size_t i) {
  return out_rel(d) * std::fabs(base) + e.comp_rel * e.mag[i] + out_abs(d);
}

// |got - base| <= factor * tol_at(i) for every element; NaN or inf in got means unwritten/wrong.
inline ::testing::AssertionResult within(const HostTensor& got, const std::vector<double>& base, const Expect& e,
                                         double factor, const std::string& what) {
  if (got.numel() != static_cast<int64_t>(base.size()) || base.size() != e.mag.size())
    return ::testing::AssertionFailure() << what << ": numel " << got.numel() << " vs " << base.size();
  int64_t bad = 0;
  std::ostringstream os;
  for (int64_t i = 0; i < got.numel(); ++i) {
    double g = got.get(i), w = base[i], tol = factor * tol_at(got.dtype(), w, e, i);
    bool ok = std::isfinite(g) && std::fabs(g - w) <= tol;
    if (!ok && bad++ < 8)
      os << "\n  [" << i << "] got " << (std::isnan(g) ? "NaN (unwritten?)" : std::to_string(g)) << " want " << w
         << " tol " << tol;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << " (" << name_of(got.dtype()) << " " << shape_str(got.shape())
                                       << "): " << bad << " of " << got.numel() << " elements off" << os.str();
}

// got against the float64 reference: output rounding plus fp32 computation error.
inline ::testing::AssertionResult close_to(const HostTensor& got, const Expect& e, const std::string& what) {
  return within(got, e.want, e, 1.0, what);
}

// Two results that should each be within tolerance of the float64 result (GPU vs CPU): they may differ
// by both errors. Only e.mag and e.comp_rel are used, so e.want may be left empty.
inline ::testing::AssertionResult close_pair(const HostTensor& got, const HostTensor& ref, const Expect& e,
                                             const std::string& what) {
  return within(got, ref.values(), e, 2.0, what);
}

inline ::testing::AssertionResult equal_ints(const HostTensor& got, const std::vector<int>& want,
                                             const std::string& what) {
  if (got.numel() != static_cast<int64_t>(want.size()))
    return ::testing::AssertionFailure() << what << ": numel " << got.numel() << " vs " << want.size();
  int64_t bad = 0;
  std::ostringstream os;
  for (int64_t i = 0; i < got.numel(); ++i) {
    if (got.i32()[i] != want[i] && bad++ < 8)
      os << "\n  [" << i << "] got " << got.i32()[i] << (got.i32()[i] == kIntPoison ? " (unwritten)" : "") << " want "
         << want[i];
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << got.numel() << " differ" << os.str();
}

inline std::vector<int> int_values(const HostTensor& t) { return std::vector<int>(t.i32(), t.i32() + t.numel()); }

// True when `name` occurs in `msg` as a whole word (single-letter names must be followed by ':', '=',
// '[' or '(' so that "expected a tensor" does not count as naming argument "a").
inline bool names_arg(const std::string& msg, const std::string& name) {
  auto ident = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (size_t pos = msg.find(name); pos != std::string::npos; pos = msg.find(name, pos + 1)) {
    size_t end = pos + name.size();
    if (pos > 0 && ident(msg[pos - 1])) continue;
    if (end < msg.size() && ident(msg[end])) continue;
    if (name.size() == 1) {
      size_t k = end;
      while (k < msg.size() && msg[k] == ' ') ++k;
      if (k >= msg.size() || std::string(":=[(").find(msg[k]) == std::string::npos) continue;
    }
    return true;
  }
  return false;
}

// `args` is one name, or alternatives separated by '|' where the spec leaves the culprit open.
inline bool names_any(const std::string& msg, const std::string& args) {
  size_t start = 0;
  while (true) {
    size_t bar = args.find('|', start);
    if (names_arg(msg, args.substr(start, bar == std::string::npos ? std::string::npos : bar - start))) return true;
    if (bar == std::string::npos) return false;
    start = bar + 1;
  }
}

inline void expect_error_naming(const std::function<void()>& f, const std::string& arg, const char* file, int line) {
  try {
    f();
    ADD_FAILURE_AT(file, line) << "no moe8::Error thrown; expected one naming '" << arg << "'";
  } catch (const moe8::Error& e) {
    if (!names_any(e.what(), arg))
      ADD_FAILURE_AT(file, line) << "moe8::Error does not name '" << arg << "': " << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE_AT(file, line) << "expected moe8::Error naming '" << arg << "', got another exception: " << e.what();
  }
}

}  // namespace moe8::test

// EXPECT_MOE8_ERROR("ids", api::route_forward(...)): the statement throws moe8::Error naming "ids".
#define EXPECT_MOE8_ERROR(arg, ...) ::moe8::test::expect_error_naming([&] { __VA_ARGS__; }, arg, __FILE__, __LINE__)
