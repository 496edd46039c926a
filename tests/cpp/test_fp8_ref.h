// test_fp8_ref.h — independent references for the FP8 tests, written from the spec in core/fp8.h and
// cpu/ops.h, sharing no code with csrc/: e4m3 decoding by the format's definition, encoding as "the
// nearest finite e4m3 value, ties to the even code" found by search (which is what round-to-nearest-even
// with saturation to 448 means), and the quantisation recipes as plain loops over those.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "test_ref.h"

namespace moe8::test {

// Value of an e4m3fn code by definition: s eeee mmm, bias 7, subnormals at e = 0, NaN at eeee mmm = 1111 111.
inline double e4m3_ref_value(uint8_t code) {
  const int e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::nan("");
  const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (code & 0x80) ? -mag : mag;
}

// Nearest of the 127 non-negative finite codes to |x| (ties: the even code); NaN -> 0x7F; sign kept.
inline uint8_t e4m3_ref_code(float xf) {
  if (std::isnan(xf)) return 0x7F;
  const double ax = std::fabs(static_cast<double>(xf));
  // Codes 0..126 are increasing in value: binary search for the first code with value >= ax.
  int lo = 0, hi = 126;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (e4m3_ref_value(static_cast<uint8_t>(mid)) >= ax)
      hi = mid;
    else
      lo = mid + 1;
  }
  int best = lo;
  if (lo > 0) {
    const double up = e4m3_ref_value(static_cast<uint8_t>(lo)) - ax,
                 down = ax - e4m3_ref_value(static_cast<uint8_t>(lo - 1));
    if (up < 0)
      best = 126;  // above 448: saturate
    else if (down < up || (down == up && ((lo - 1) % 2 == 0)))
      best = lo - 1;
  }
  return static_cast<uint8_t>(best | (std::signbit(xf) ? 0x80 : 0));
}

// The scale rule, in float as the spec states it.
inline float ref_scale(float amax) { return amax > 0.f ? amax / 448.0f : 1.0f; }

inline const uint8_t* bytes(const HostTensor& t) { return static_cast<const uint8_t*>(t.data()); }
inline const float* floats(const HostTensor& t) { return static_cast<const float*>(t.data()); }

// Quantisation of n values (already floats) with their own block scale.
struct RefBlock {
  float scale;
  std::vector<uint8_t> q;
};
inline RefBlock ref_quantize(const std::vector<float>& v) {
  float amax = 0.f;
  for (float x : v)
    if (!std::isnan(x)) amax = std::max(amax, std::fabs(x));
  RefBlock b{ref_scale(amax), {}};
  const float inv = 1.0f / b.scale;  // q = e4m3(x * (1 / scale)), each step rounded to float
  for (float x : v) b.q.push_back(e4m3_ref_code(x * inv));
  return b;
}

// Expected 1x128 row quantisation of a [R, K] float matrix given as rows of floats.
struct RefQuant {
  std::vector<uint8_t> q;
  std::vector<float> scale;
};
inline RefQuant ref_rows_1x128(const std::vector<std::vector<float>>& rows, int64_t K) {
  const int64_t KB = (K + 127) / 128;
  RefQuant out;
  for (const auto& row : rows) {
    std::vector<uint8_t> qrow(K);
    for (int64_t b = 0; b < KB; ++b) {
      const int64_t k0 = b * 128, k1 = std::min<int64_t>(K, k0 + 128);
      RefBlock blk = ref_quantize(std::vector<float>(row.begin() + k0, row.begin() + k1));
      out.scale.push_back(blk.scale);
      std::copy(blk.q.begin(), blk.q.end(), qrow.begin() + k0);
    }
    out.q.insert(out.q.end(), qrow.begin(), qrow.end());
  }
  return out;
}

inline std::vector<std::vector<float>> rows_of(const HostTensor& x) {
  const int64_t R = x.shape()[0], K = x.shape()[1];
  std::vector<std::vector<float>> rows(R, std::vector<float>(K));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < K; ++k) rows[r][k] = static_cast<float>(x.get(r * K + k));
  return rows;
}

// Where two byte arrays differ (first few), for messages.
inline ::testing::AssertionResult same_bytes(const uint8_t* got, const std::vector<uint8_t>& want,
                                             const std::string& what) {
  int64_t bad = 0;
  std::ostringstream os;
  for (size_t i = 0; i < want.size(); ++i)
    if (got[i] != want[i] && bad++ < 8)
      os << "\n  [" << i << "] got 0x" << std::hex << int(got[i]) << " want 0x" << int(want[i]) << std::dec
         << (got[i] == 0xFF ? " (unwritten?)" : "");
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << want.size() << " bytes differ" << os.str();
}

// Float arrays equal bit for bit (NaN in got: unwritten).
inline ::testing::AssertionResult same_floats(const float* got, const std::vector<float>& want,
                                              const std::string& what) {
  int64_t bad = 0;
  std::ostringstream os;
  for (size_t i = 0; i < want.size(); ++i)
    if (std::memcmp(&got[i], &want[i], 4) != 0 && bad++ < 8)
      os << "\n  [" << i << "] got " << got[i] << " want " << want[i];
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << want.size() << " differ" << os.str();
}

// Rounding bound of one quantised value: half an e4m3 ulp (2^-4 relative) in the normal range, half the
// smallest subnormal step (2^-10 * scale) below it.
inline double quant_tol(double x, double scale) {
  return std::max(std::fabs(x) * 0.0625, scale * std::ldexp(1.0, -10)) * 1.0001;
}

// Row-major offsets from group sizes.
inline std::vector<int> offsets_of(const std::vector<int>& counts) {
  std::vector<int> off(1, 0);
  for (int c : counts) off.push_back(off.back() + c);
  return off;
}

// quantize_cols_1x128 expectation: q_t [K, R], scale [nblocks, K].
inline RefQuant ref_cols_1x128(const HostTensor& x, const std::vector<int>& off, int64_t nblocks) {
  const int64_t R = x.shape()[0], K = x.shape()[1];
  const int E = static_cast<int>(off.size()) - 1;
  RefQuant out;
  out.q.assign(K * R, 0);
  out.scale.assign(nblocks * K, 1.0f);
  int64_t b = 0;
  for (int e = 0; e < E; ++e)
    for (int64_t r0 = off[e]; r0 < off[e + 1]; r0 += 128, ++b) {
      const int64_t r1 = std::min<int64_t>(off[e + 1], r0 + 128);
      for (int64_t c = 0; c < K; ++c) {
        std::vector<float> col;
        for (int64_t r = r0; r < r1; ++r) col.push_back(static_cast<float>(x.get(r * K + c)));
        RefBlock blk = ref_quantize(col);
        out.scale[b * K + c] = blk.scale;
        for (int64_t r = r0; r < r1; ++r) out.q[c * R + r] = blk.q[r - r0];
      }
    }
  return out;
}

// quantize_weight_128x128 expectation for w [E, N, K].
inline RefQuant ref_weight_128x128(const HostTensor& w) {
  const int64_t E = w.shape()[0], N = w.shape()[1], K = w.shape()[2];
  const int64_t NB = (N + 127) / 128, KB = (K + 127) / 128;
  RefQuant out;
  out.q.assign(E * N * K, 0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t nb = 0; nb < NB; ++nb)
      for (int64_t kb = 0; kb < KB; ++kb) {
        std::vector<float> v;
        std::vector<int64_t> idx;
        for (int64_t n = nb * 128; n < std::min(N, nb * 128 + 128); ++n)
          for (int64_t k = kb * 128; k < std::min(K, kb * 128 + 128); ++k) {
            idx.push_back((e * N + n) * K + k);
            v.push_back(static_cast<float>(w.get(idx.back())));
          }
        RefBlock blk = ref_quantize(v);
        out.scale.push_back(blk.scale);
        for (size_t i = 0; i < idx.size(); ++i) out.q[idx[i]] = blk.q[i];
      }
  return out;
}

// Blockwise FP8 GEMM in float64 from codes and scales: c[r, n] = sum_k deq(a)[r,k] * deq(b)[e,n,k]; mag is
// the same sum of absolute values (what accumulation errors scale with). Rows past off[E] are 0.
inline Expect ref_gemm_fp8(const HostTensor& a, const HostTensor& sa, const HostTensor& b, const HostTensor& sb,
                           const std::vector<int>& off) {
  const int64_t R = a.shape()[0], K = a.shape()[1], E = b.shape()[0], N = b.shape()[1];
  const int64_t KB = (K + 127) / 128, NB = (N + 127) / 128;
  Expect c;
  c.want.assign(R * N, 0.0);
  c.mag.assign(R * N, 0.0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = off[e]; r < off[e + 1]; ++r)
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0, mag = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double x = e4m3_ref_value(bytes(a)[r * K + k]) * floats(sa)[r * KB + k / 128];
          const double w =
              e4m3_ref_value(bytes(b)[(e * N + n) * K + k]) * floats(sb)[(e * NB + n / 128) * KB + k / 128];
          acc += x * w;
          mag += std::fabs(x * w);
        }
        c.want[r * N + n] = acc;
        c.mag[r * N + n] = mag;
      }
  return c;
}

}  // namespace moe8::test
