// grouped_gemm.cpp — CPU reference of the ragged grouped GEMM (forward/dgrad) and its ragged-K wgrad.
// Rows of expert e are offsets[e] .. offsets[e+1]-1; every product accumulates in fp32.
#include <vector>

#include "core/parallel.h"
#include "cpu/common.h"
#include "cpu/ops.h"

namespace moe8::cpu {
namespace {

// Expert owning row r, or -1 past offsets[E].
int expert_of_row(const int32_t* off, int E, int64_t r) {
  if (r >= off[E]) return -1;
  int lo = 0, hi = E;  // find the last e with off[e] <= r
  while (hi - lo > 1) {
    int mid = (lo + hi) / 2;
    if (off[mid] <= r)
      lo = mid;
    else
      hi = mid;
  }
  while (off[lo + 1] <= r) ++lo;  // skip empty groups sharing the start
  return lo;
}

template <typename T>
float load(const TensorView& t, int64_t i) {
  return to_f(t.ptr<T>()[i]);
}

}  // namespace

void grouped_gemm(const TensorView& a, const TensorView& b, const TensorView& offsets, WeightLayout layout,
                  const TensorView& bias, const TensorView& c) {
  const int64_t R = a.size(0), Kd = a.size(1), N = c.size(1);
  const int E = static_cast<int>(b.size(0));
  const int32_t* off = offsets.ptr<int32_t>();
  MOE8_CPU_DISPATCH_FLOAT(a.dtype, "grouped_gemm", [&] {
    const scalar_t* A = a.ptr<scalar_t>();
    const scalar_t* B = b.ptr<scalar_t>();
    scalar_t* C = c.ptr<scalar_t>();
    parallel_for(R, 16, [&](int64_t r) {
      int e = expert_of_row(off, E, r);
      std::vector<float> acc(N, 0.f);
      if (e >= 0) {
        std::vector<float> x(Kd);
        for (int64_t k = 0; k < Kd; ++k) x[k] = to_f(A[r * Kd + k]);
        const scalar_t* W = B + static_cast<int64_t>(e) * N * Kd;
        if (layout == WeightLayout::kNK) {
          for (int64_t n = 0; n < N; ++n) {
            float s = 0.f;
            for (int64_t k = 0; k < Kd; ++k) s += x[k] * to_f(W[n * Kd + k]);
            acc[n] = s;
          }
        } else {
          for (int64_t k = 0; k < Kd; ++k)
            for (int64_t n = 0; n < N; ++n) acc[n] += x[k] * to_f(W[k * N + n]);
        }
        if (bias.present)
          for (int64_t n = 0; n < N; ++n)
            acc[n] += bias.dtype == DType::kF32 ? load<float>(bias, e * N + n) : load<scalar_t>(bias, e * N + n);
      }
      for (int64_t n = 0; n < N; ++n) C[r * N + n] = from_f<scalar_t>(acc[n]);
    });
  });
}

void grouped_gemm_wgrad(const TensorView& a, const TensorView& dc, const TensorView& offsets, WeightLayout layout,
                        const TensorView& db, const TensorView& dbias) {
  const int64_t Kd = a.size(1), N = dc.size(1);
  const int E = static_cast<int>(db.size(0));
  const int32_t* off = offsets.ptr<int32_t>();
  // One task per (expert, output row of db): [N] rows of length Kd (kNK) or [Kd] rows of length N (kKN).
  const int64_t outer = layout == WeightLayout::kNK ? N : Kd, inner = layout == WeightLayout::kNK ? Kd : N;
  MOE8_CPU_DISPATCH_FLOAT(a.dtype, "grouped_gemm_wgrad", [&] {
    const scalar_t* A = a.ptr<scalar_t>();
    const scalar_t* G = dc.ptr<scalar_t>();
    auto store = [&](const TensorView& t, int64_t i, float v) {
      if (t.dtype == DType::kF32)
        t.ptr<float>()[i] = v;
      else
        t.ptr<scalar_t>()[i] = from_f<scalar_t>(v);
    };
    parallel_for(static_cast<int64_t>(E) * outer, 4, [&](int64_t task) {
      const int64_t e = task / outer, o = task % outer;
      std::vector<float> acc(inner, 0.f);
      for (int64_t r = off[e]; r < off[e + 1]; ++r) {
        // kNK: db[n, k] += dc[r, n] * a[r, k];  kKN: db[k, n] += a[r, k] * dc[r, n]
        const scalar_t* row = layout == WeightLayout::kNK ? A + r * Kd : G + r * N;
        float f = layout == WeightLayout::kNK ? to_f(G[r * N + o]) : to_f(A[r * Kd + o]);
        if (f == 0.f) continue;
        for (int64_t i = 0; i < inner; ++i) acc[i] += f * to_f(row[i]);
      }
      for (int64_t i = 0; i < inner; ++i) store(db, (e * outer + o) * inner + i, acc[i]);
    });
    if (dbias.present) {
      parallel_for(E, 1, [&](int64_t e) {
        std::vector<float> acc(N, 0.f);
        for (int64_t r = off[e]; r < off[e + 1]; ++r)
          for (int64_t n = 0; n < N; ++n) acc[n] += to_f(G[r * N + n]);
        for (int64_t n = 0; n < N; ++n) store(dbias, e * N + n, acc[n]);
      });
    }
  });
}

}  // namespace moe8::cpu
