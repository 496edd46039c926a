// error.h — the one exception type of the core. Bad input raises moe8::Error (a std::invalid_argument,
// so Python sees ValueError); a failed CUDA call raises moe8::CudaError (RuntimeError in Python).
#pragma once
#include <stdexcept>
#include <string>
#include <type_traits>

namespace moe8 {

class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& msg) : std::invalid_argument(msg) {}
};

class CudaError : public std::runtime_error {
 public:
  explicit CudaError(const std::string& msg) : std::runtime_error(msg) {}
};

// Messages are built with std::string and std::to_string, not iostreams: a C++ stream formats numbers
// through the locale machinery, which crashed inside the Python extension on one machine (an extension
// whose libstdc++ stream state was never initialised), and an error path must never crash.
namespace detail {
inline void append(std::string& out, const std::string& v) { out += v; }
inline void append(std::string& out, const char* v) { out += v; }
inline void append(std::string& out, char v) { out += v; }
inline void append(std::string& out, bool v) { out += v ? "true" : "false"; }
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
void append(std::string& out, T v) {
  out += std::to_string(v);
}
}  // namespace detail

// Concatenates strings and numbers into one message.
template <typename... A>
std::string str_cat(const A&... parts) {
  std::string out;
  (detail::append(out, parts), ...);
  return out;
}

template <typename... A>
[[noreturn]] void fail(const A&... parts) {
  throw Error(str_cat(parts...));
}

// What an op given CUDA tensors raises in a build without the CUDA backend (api/ and cuda_stub/ both).
[[noreturn]] inline void fail_without_cuda(const char* op) {
  fail(op, ": tensors are on a CUDA device but moe8 was built without CUDA (no nvcc at build time)");
}

}  // namespace moe8

#define MOE8_CHECK(cond, ...)               \
  do {                                      \
    if (!(cond)) ::moe8::fail(__VA_ARGS__); \
  } while (0)
