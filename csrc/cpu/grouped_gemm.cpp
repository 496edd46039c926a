// grouped_gemm.cpp — CPU reference of the ragged grouped GEMM (forward/dgrad), of the same GEMM on rows gathered
// from the tokens, and of the ragged-K wgrad.
// Rows of expert e are offsets[e] .. offsets[e+1]-1; every product accumulates in fp32.
#include <vector>

#include "core/parallel.h"
#include "cpu/common.h"
#include "cpu/ops.h"

namespace moe8::cpu {
namespace {

template <typename T>
float load(const TensorView& t, int64_t i) {
  return to_f(t.ptr<T>()[i]);
}

// c[r] = A(r) . op(b[e]) (+ bias[e]) for the rows r of expert e, where row_of(r) points at the row's Kd values
// (nullptr: a row of zeros); rows past the last group are 0.
template <typename scalar_t, typename RowOf>
void rows_times_experts(RowOf row_of, int64_t R, int64_t Kd, const TensorView& b, const TensorView& offsets,
                        WeightLayout layout, const TensorView& bias, const TensorView& c) {
  const int64_t N = c.size(1);
  const int E = static_cast<int>(b.size(0));
  const std::vector<int64_t> off = clamped_offsets(offsets, R);
  const scalar_t* B = b.ptr<scalar_t>();
  scalar_t* C = c.ptr<scalar_t>();
  std::vector<float> w(Kd * N);  // b[e] as fp32 [Kd, N]: the inner loop becomes a vectorisable axpy over N
  for (int e = 0; e < E; ++e) {
    const int64_t r0 = off[e], r1 = off[e + 1];
    if (r0 == r1) continue;
    const scalar_t* W = B + static_cast<int64_t>(e) * N * Kd;
    parallel_for(Kd, 64, [&](int64_t k) {
      for (int64_t n = 0; n < N; ++n) w[k * N + n] = to_f(layout == WeightLayout::kNK ? W[n * Kd + k] : W[k * N + n]);
    });
    parallel_for(r1 - r0, 8, [&](int64_t i) {
      const int64_t r = r0 + i;
      std::vector<float> acc(N, 0.f);
      if (const scalar_t* A = row_of(r)) {
        for (int64_t k = 0; k < Kd; ++k) {
          const float x = to_f(A[k]);
          const float* wk = w.data() + k * N;
          for (int64_t n = 0; n < N; ++n) acc[n] += x * wk[n];
        }
      }
      if (bias.present)
        for (int64_t n = 0; n < N; ++n)
          acc[n] += bias.dtype == DType::kF32 ? load<float>(bias, e * N + n) : load<scalar_t>(bias, e * N + n);
      for (int64_t n = 0; n < N; ++n) C[r * N + n] = from_f<scalar_t>(acc[n]);
    });
  }
  for (int64_t r = off[E]; r < R; ++r)  // rows past the last group
    for (int64_t n = 0; n < N; ++n) C[r * N + n] = from_f<scalar_t>(0.f);
}

}  // namespace

void grouped_gemm(const TensorView& a, const TensorView& b, const TensorView& offsets, WeightLayout layout,
                  const TensorView& bias, const TensorView& c) {
  const int64_t R = a.size(0), Kd = a.size(1);
  MOE8_CPU_DISPATCH_FLOAT(a.dtype, "grouped_gemm", [&] {
    const scalar_t* A = a.ptr<scalar_t>();
    rows_times_experts<scalar_t>([&](int64_t r) { return A + r * Kd; }, R, Kd, b, offsets, layout, bias, c);
  });
}

void gathered_grouped_gemm(const TensorView& x, const TensorView& row_to_slot, int top_k, const TensorView& b,
                           const TensorView& offsets, WeightLayout layout, const TensorView& c) {
  const int64_t R = c.size(0), T = x.size(0), Kd = x.size(1);
  const int32_t* slots = row_to_slot.ptr<int32_t>();
  MOE8_CPU_DISPATCH_FLOAT(x.dtype, "gathered_grouped_gemm", [&] {
    const scalar_t* X = x.ptr<scalar_t>();
    auto row_of = [&](int64_t r) -> const scalar_t* {
      const int64_t t = slots[r] < 0 ? -1 : slots[r] / top_k;
      return t >= 0 && t < T ? X + t * Kd : nullptr;
    };
    rows_times_experts<scalar_t>(row_of, R, Kd, b, offsets, layout, TensorView{}, c);
  });
}

void grouped_gemm_wgrad(const TensorView& a, const TensorView& dc, const TensorView& offsets, WeightLayout layout,
                        const TensorView& db, const TensorView& dbias) {
  const int64_t Kd = a.size(1), N = dc.size(1);
  const int E = static_cast<int>(db.size(0));
  const std::vector<int64_t> off = clamped_offsets(offsets, a.size(0));
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

void grouped_lowrank_add(const TensorView& h, const TensorView& t, const TensorView& b, const TensorView& offsets,
                         WeightLayout layout, const TensorView& out) {
  const int64_t R = h.size(0), N = h.size(1), rank = t.size(1);
  const int E = static_cast<int>(b.size(0));
  const std::vector<int64_t> off = clamped_offsets(offsets, R);
  MOE8_CPU_DISPATCH_FLOAT(h.dtype, "grouped_lowrank_add", [&] {
    const scalar_t* H = h.ptr<scalar_t>();
    const scalar_t* Tm = t.ptr<scalar_t>();
    const scalar_t* B = b.ptr<scalar_t>();
    scalar_t* O = out.ptr<scalar_t>();
    parallel_for(R, 16, [&](int64_t r) {
      int e = -1;  // the group holding row r
      for (int g = 0; g < E && e < 0; ++g)
        if (off[g] <= r && r < off[g + 1]) e = g;
      const scalar_t* W = B + static_cast<int64_t>(e < 0 ? 0 : e) * N * rank;
      for (int64_t n = 0; n < N; ++n) {
        float s = 0.f;
        for (int64_t k = 0; e >= 0 && k < rank; ++k)
          s += to_f(Tm[r * rank + k]) * to_f(layout == WeightLayout::kNK ? W[n * rank + k] : W[k * N + n]);
        O[r * N + n] = from_f<scalar_t>(to_f(H[r * N + n]) + s);
      }
    });
  });
}

}  // namespace moe8::cpu
