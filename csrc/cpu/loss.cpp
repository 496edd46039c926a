// loss.cpp — CPU reference of the cross-entropy rows (semantics: cpu/ops.h), float32 math.
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/parallel.h"
#include "cpu/common.h"
#include "cpu/ops.h"

namespace moe8::cpu {

void cross_entropy_rows(const TensorView& logits, const TensorView& target, int64_t ignore_index,
                        const TensorView& loss) {
  const int64_t n = logits.size(0), V = logits.size(1);
  const int64_t* T = target.ptr<int64_t>();
  float* L = loss.ptr<float>();
  MOE8_CPU_DISPATCH_FLOAT(logits.dtype, "cross_entropy_rows", [&] {
    scalar_t* X = logits.ptr<scalar_t>();
    parallel_for(n, 1, [&](int64_t r) {
      scalar_t* x = X + r * V;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < V; ++j) m = std::fmax(m, to_f(x[j]));  // fmax drops NaN; the sum keeps it
      float s = 0.f;
      for (int64_t j = 0; j < V; ++j) s += std::exp(to_f(x[j]) - m);
      const float lse = m + std::log(s);
      const int64_t t = T[r];
      const bool ignored = t == ignore_index, in_range = t >= 0 && t < V;
      const float nan = std::numeric_limits<float>::quiet_NaN();
      L[r] = ignored ? 0.f : in_range ? lse - to_f(x[t]) : nan;
      for (int64_t j = 0; j < V; ++j) {
        const float g = ignored ? 0.f : in_range ? std::exp(to_f(x[j]) - lse) - (j == t ? 1.f : 0.f) : nan;
        x[j] = from_f<scalar_t>(g);
      }
    });
  });
}

}  // namespace moe8::cpu
