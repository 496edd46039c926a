// quant.cpp — CPU reference of the FP8 (e4m3) recipes: 1x128 row quantisation (optionally gathering rows
// into expert order on the way), 128x128 weight quantisation, the transposed 1x128 quantisation the weight
// gradient needs (blocks within expert groups), activation + quantisation, the per-row and per-tensor
// variants, dequantisation, and the blockwise-scaled grouped GEMM. Conversion and scale rule: core/fp8.h.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/fp8.h"
#include "core/parallel.h"
#include "cpu/common.h"
#include "cpu/ops.h"

namespace moe8::cpu {
namespace {

// amax ignores NaN (a comparison with NaN is false), as fmaxf does on the GPU.
inline float amax_of(const float* v, int64_t n) {
  float m = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(v[i]);
    if (a > m) m = a;
  }
  return m;
}

inline void quantize_span(const float* v, int64_t n, float scale, uint8_t* q) {
  const float inv = e4m3_inv_scale(scale);
  for (int64_t i = 0; i < n; ++i) q[i] = float_to_e4m3(v[i] * inv);
}

// One row of K values as floats (zeros where src is null), quantised in 128-column blocks.
void quantize_row(const float* x, int64_t K, uint8_t* q, float* scale) {
  for (int64_t b = 0; b * kQuantBlock < K; ++b) {
    const int64_t k0 = b * kQuantBlock, n = std::min<int64_t>(kQuantBlock, K - k0);
    const float s = e4m3_scale(amax_of(x + k0, n));
    scale[b] = s;
    quantize_span(x + k0, n, s, q + k0);
  }
}

}  // namespace

void quantize_rows_1x128(const TensorView& x, const TensorView& row_to_slot, int k, const TensorView& q,
                         const TensorView& scale) {
  const int64_t R = q.size(0), K = q.size(1), KB = quant_blocks(K);
  const int32_t* r2s = row_to_slot.present ? row_to_slot.ptr<int32_t>() : nullptr;
  MOE8_CPU_DISPATCH_FLOAT(x.dtype, "quantize_rows_1x128", [&] {
    const scalar_t* X = x.ptr<scalar_t>();
    parallel_for(R, 64, [&](int64_t r) {
      std::vector<float> row(K, 0.f);
      const int64_t src = r2s ? (in_range(r2s[r], x.size(0) * k) ? r2s[r] / k : -1) : r;
      if (src >= 0)
        for (int64_t i = 0; i < K; ++i) row[i] = to_f(X[src * K + i]);
      quantize_row(row.data(), K, q.ptr<uint8_t>() + r * K, scale.ptr<float>() + r * KB);
    });
  });
}

void quantize_weight_128x128(const TensorView& w, const TensorView& q, const TensorView& scale, const TensorView& q_t,
                             const TensorView& scale_t) {
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  const int64_t NB = quant_blocks(N), KB = quant_blocks(K);
  MOE8_CPU_DISPATCH_FLOAT(w.dtype, "quantize_weight_128x128", [&] {
    const scalar_t* W = w.ptr<scalar_t>();
    uint8_t* Q = q.present ? q.ptr<uint8_t>() : nullptr;  // either layout may be left out (not both)
    uint8_t* QT = q_t.present ? q_t.ptr<uint8_t>() : nullptr;
    parallel_for(E * NB * KB, 4, [&](int64_t t) {
      const int64_t e = t / (NB * KB), nb = (t / KB) % NB, kb = t % KB;
      const int64_t n0 = nb * kQuantBlock, n1 = std::min(N, n0 + kQuantBlock);
      const int64_t k0 = kb * kQuantBlock, k1 = std::min(K, k0 + kQuantBlock);
      float amax = 0.f;
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t i = k0; i < k1; ++i) amax = std::max(amax, std::fabs(to_f(W[(e * N + n) * K + i])));
      const float s = e4m3_scale(amax);  // std::max(amax, NaN) keeps amax
      if (Q != nullptr) scale.ptr<float>()[t] = s;
      if (QT != nullptr) scale_t.ptr<float>()[(e * KB + kb) * NB + nb] = s;
      const float inv = e4m3_inv_scale(s);
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t i = k0; i < k1; ++i) {
          const uint8_t code = float_to_e4m3(to_f(W[(e * N + n) * K + i]) * inv);
          if (Q != nullptr) Q[(e * N + n) * K + i] = code;
          if (QT != nullptr) QT[(e * K + i) * N + n] = code;
        }
    });
  });
}

void quantize_cols_1x128(const TensorView& x, const TensorView& offsets, const TensorView& q_t,
                         const TensorView& scale) {
  const int64_t R = x.size(0), K = x.size(1), E = offsets.size(0) - 1, NBLK = scale.size(0);
  const std::vector<int64_t> off = clamped_offsets(offsets, R);
  uint8_t* QT = q_t.ptr<uint8_t>();
  float* S = scale.ptr<float>();
  // Blocks in order: those of group 0, then group 1, ...; block j of group e covers rows
  // off[e] + 128 j .. min(off[e] + 128 (j + 1), off[e+1]) - 1.
  struct Block {
    int64_t r0, r1;
  };
  std::vector<Block> blocks;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = off[e]; r < off[e + 1]; r += kQuantBlock)
      blocks.push_back({r, std::min<int64_t>(off[e + 1], r + kQuantBlock)});
  const int64_t used = off[E];
  MOE8_CPU_DISPATCH_FLOAT(x.dtype, "quantize_cols_1x128", [&] {
    const scalar_t* X = x.ptr<scalar_t>();
    parallel_for(K, 16, [&](int64_t c) {
      std::vector<float> col(kQuantBlock);
      for (int64_t b = 0; b < NBLK; ++b) {
        if (b >= static_cast<int64_t>(blocks.size())) {
          S[b * K + c] = 1.f;
          continue;
        }
        const int64_t r0 = blocks[b].r0, n = blocks[b].r1 - r0;
        for (int64_t i = 0; i < n; ++i) col[i] = to_f(X[(r0 + i) * K + c]);
        const float s = e4m3_scale(amax_of(col.data(), n));
        S[b * K + c] = s;
        quantize_span(col.data(), n, s, QT + c * R + r0);
      }
      for (int64_t r = used; r < R; ++r) QT[c * R + r] = 0;
    });
  });
}

void swiglu_quant(const TensorView& h, const ActParams& p, const TensorView& q, const TensorView& scale) {
  // Defined as quantize_rows_1x128(activation_forward(h)): the activation is rounded to h's dtype first,
  // so the fused CUDA kernel can be checked bit for bit against the two separate ops.
  const int64_t R = q.size(0), I = q.size(1);
  std::vector<uint64_t> buf((R * I * dtype_size(h.dtype) + 7) / 8 + 1);
  TensorView act = make_view(buf.data(), h.dtype, {R, I});
  activation_forward(h, p, act);
  quantize_rows_1x128(act, TensorView{}, 1, q, scale);
}

void quantize_rowwise(const TensorView& x, const TensorView& q, const TensorView& scale) {
  const int64_t K = x.size(-1), M = K > 0 ? x.numel() / K : scale.numel();
  MOE8_CPU_DISPATCH_FLOAT(x.dtype, "quantize_rowwise", [&] {
    const scalar_t* X = x.ptr<scalar_t>();
    parallel_for(M, 16, [&](int64_t m) {
      std::vector<float> row(K);
      for (int64_t i = 0; i < K; ++i) row[i] = to_f(X[m * K + i]);
      const float s = e4m3_scale(amax_of(row.data(), K));
      scale.ptr<float>()[m] = s;
      quantize_span(row.data(), K, s, q.ptr<uint8_t>() + m * K);
    });
  });
}

void quantize_tensorwise(const TensorView& x, const TensorView& q, const TensorView& scale) {
  const int64_t n = x.numel();
  MOE8_CPU_DISPATCH_FLOAT(x.dtype, "quantize_tensorwise", [&] {
    const scalar_t* X = x.ptr<scalar_t>();
    float amax = 0.f;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(to_f(X[i])));
    const float s = e4m3_scale(amax);
    scale.ptr<float>()[0] = s;
    const float inv = e4m3_inv_scale(s);
    parallel_for(n, 4096, [&](int64_t i) { q.ptr<uint8_t>()[i] = float_to_e4m3(to_f(X[i]) * inv); });
  });
}

void dequantize(const TensorView& q, const TensorView& scale, int64_t block_rows, int64_t block_cols,
                const TensorView& out) {
  const int64_t M = q.size(-2), K = q.size(-1), B = q.ndim == 3 ? q.size(0) : 1;
  const int64_t SM = scale.size(-2), SK = scale.size(-1);
  MOE8_CPU_DISPATCH_FLOAT(out.dtype, "dequantize", [&] {
    scalar_t* O = out.ptr<scalar_t>();
    parallel_for(B * M, 64, [&](int64_t bm) {
      const int64_t b = bm / M, m = bm % M;
      const float* s = scale.ptr<float>() + (b * SM + m / block_rows) * SK;
      const uint8_t* in = q.ptr<uint8_t>() + bm * K;
      for (int64_t i = 0; i < K; ++i) O[bm * K + i] = from_f<scalar_t>(e4m3_to_float(in[i]) * s[i / block_cols]);
    });
  });
}

void grouped_gemm_fp8(const TensorView& a, const TensorView& a_scale, const TensorView& b, const TensorView& b_scale,
                      const TensorView& offsets, const TensorView& c) {
  const int64_t R = a.size(0), K = a.size(1), N = b.size(1), E = b.size(0);
  const int64_t KB = quant_blocks(K), NB = quant_blocks(N);
  const std::vector<int64_t> off = clamped_offsets(offsets, R);
  const uint8_t* A = a.ptr<uint8_t>();
  const uint8_t* Bq = b.ptr<uint8_t>();
  const float* SA = a_scale.ptr<float>();
  const float* SB = b_scale.ptr<float>();
  std::vector<float> lut(256);  // e4m3 code -> value
  for (int i = 0; i < 256; ++i) lut[i] = e4m3_to_float(static_cast<uint8_t>(i));
  MOE8_CPU_DISPATCH_FLOAT(c.dtype, "grouped_gemm_fp8", [&] {
    scalar_t* C = c.ptr<scalar_t>();
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = off[e], r1 = off[e + 1];
      parallel_for(r1 - r0, 4, [&](int64_t i) {
        const int64_t r = r0 + i;
        for (int64_t n = 0; n < N; ++n) {
          const uint8_t* x = A + r * K;
          const uint8_t* w = Bq + (e * N + n) * K;
          double acc = 0;
          for (int64_t kb = 0; kb < KB; ++kb) {
            double part = 0;  // products of two e4m3 values are exact in double, and so are these sums
            for (int64_t k = kb * kQuantBlock; k < std::min(K, (kb + 1) * kQuantBlock); ++k)
              part += static_cast<double>(lut[x[k]]) * lut[w[k]];
            acc += part * SA[r * KB + kb] * SB[(e * NB + n / kQuantBlock) * KB + kb];
          }
          C[r * N + n] = from_f<scalar_t>(static_cast<float>(acc));
        }
      });
    }
    for (int64_t r = off[E]; r < R; ++r)
      for (int64_t n = 0; n < N; ++n) C[r * N + n] = from_f<scalar_t>(0.f);
  });
}

void quantize_grouped_gemm_fp8(const TensorView& x, const TensorView& row_to_slot, int k, const TensorView& b,
                               const TensorView& b_scale, const TensorView& offsets, const TensorView& q,
                               const TensorView& scale, const TensorView& c) {
  quantize_rows_1x128(x, row_to_slot, k, q, scale);
  grouped_gemm_fp8(q, scale, b, b_scale, offsets, c);
}

void grouped_gemm_fp8_wgrad(const TensorView& dc_t, const TensorView& dc_scale, const TensorView& a_t,
                            const TensorView& a_scale, const TensorView& offsets, const TensorView& db) {
  const int64_t N = dc_t.size(0), R = dc_t.size(1), K = a_t.size(0), E = offsets.size(0) - 1;
  const std::vector<int64_t> off = clamped_offsets(offsets, R);
  const uint8_t* DC = dc_t.ptr<uint8_t>();
  const uint8_t* A = a_t.ptr<uint8_t>();
  const float* SD = dc_scale.ptr<float>();
  const float* SA = a_scale.ptr<float>();
  std::vector<float> lut(256);  // e4m3 code -> value
  for (int i = 0; i < 256; ++i) lut[i] = e4m3_to_float(static_cast<uint8_t>(i));
  MOE8_CPU_DISPATCH_FLOAT(db.dtype, "grouped_gemm_fp8_wgrad", [&] {
    scalar_t* D = db.ptr<scalar_t>();
    int64_t block0 = 0;  // the first scale block of expert e
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = off[e], r1 = off[e + 1], nblk = quant_blocks(r1 - r0);
      parallel_for(N, 4, [&](int64_t n) {
        for (int64_t k = 0; k < K; ++k) {
          double acc = 0;
          for (int64_t j = 0; j < nblk; ++j) {
            double part = 0;  // products of two e4m3 values are exact in double, and so are these sums
            const int64_t b0 = r0 + j * kQuantBlock, b1 = std::min(r1, b0 + kQuantBlock);
            for (int64_t r = b0; r < b1; ++r) part += static_cast<double>(lut[DC[n * R + r]]) * lut[A[k * R + r]];
            acc += part * SD[(block0 + j) * N + n] * SA[(block0 + j) * K + k];
          }
          D[(e * N + n) * K + k] = from_f<scalar_t>(static_cast<float>(acc));
        }
      });
      block0 += nblk;
    }
  });
}

}  // namespace moe8::cpu
