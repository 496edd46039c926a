// error.h — the one exception type of the core. Bad input raises moe8::Error (a std::invalid_argument,
// so Python sees ValueError); a failed CUDA call raises moe8::CudaError (RuntimeError in Python).
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace moe8 {

class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& msg) : std::invalid_argument(msg) {}
};

class CudaError : public std::runtime_error {
 public:
  explicit CudaError(const std::string& msg) : std::runtime_error(msg) {}
};

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... R>
void append(std::ostringstream& os, const T& v, const R&... rest) {
  os << v;
  append(os, rest...);
}
}  // namespace detail

template <typename... A>
[[noreturn]] void fail(const A&... parts) {
  std::ostringstream os;
  detail::append(os, parts...);
  throw Error(os.str());
}

}  // namespace moe8

#define MOE8_CHECK(cond, ...)               \
  do {                                      \
    if (!(cond)) ::moe8::fail(__VA_ARGS__); \
  } while (0)
