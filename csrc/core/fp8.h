// fp8.h — FP8 e4m3 ("e4m3fn": no infinities, one NaN code per sign, max 448) as uint8 storage, and the
// block geometry of the quantisation recipes. Shared by the CPU reference, the API and the tests; the CUDA
// kernels convert with the hardware instruction (cvt.rn.satfinite.e4m3x2.f32) and must match these
// functions bit for bit.
//
// Conversion policy (float -> e4m3), identical to __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3):
//   - round to nearest, ties to even, subnormals included (smallest subnormal 2^-9, |x| <= 2^-10 -> +-0);
//   - saturating: |x| > 464 (448 + half an ulp) and +-inf become +-448 (0x7E / 0xFE);
//   - NaN (either sign) becomes 0x7F; the sign of zero is kept (-0.0 -> 0x80).
// torch's x.to(torch.float8_e4m3fn) agrees everywhere except overflow: it is not saturating (|x| > 464,
// inf -> NaN) and keeps the sign of NaN (0xFF). Quantised values never overflow (|x * (1 / scale)| <= 448 + 1 ulp,
// saturated to 448).
#pragma once
#include <cstdint>
#include <cstring>

#include "core/dtype.h"

namespace moe8 {

constexpr float kE4M3Max = 448.0f;  // largest finite e4m3 value
constexpr int kQuantBlock = 128;    // block edge of the 1x128 / 128x128 recipes

inline uint8_t float_to_e4m3(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return 0x7f;                                 // NaN
  if (au > 0x43e80000u) return sign | 0x7e;                          // > 464 (and inf): saturate to 448
  if (au >= 0x3c800000u) {                                           // >= 2^-6: normal
    uint32_t r = (((au >> 23) - 127 + 7) << 3) | ((au >> 20) & 7u);  // exponent and 3 mantissa bits
    const uint32_t rest = au & 0xfffffu, half = 0x80000u;
    if (rest > half || (rest == half && (r & 1u))) ++r;  // a carry into the exponent is still right
    return sign | static_cast<uint8_t>(r);
  }
  // Subnormal: the code is round_half_even(|x| * 2^9) (0..8; 8 is the smallest normal, code 0x08).
  float ax;
  std::memcpy(&ax, &au, 4);
  const float v = ax * 512.0f;  // exact: a power-of-two scaling of a value below 8
  uint32_t m = static_cast<uint32_t>(v);
  const float frac = v - static_cast<float>(m);
  if (frac > 0.5f || (frac == 0.5f && (m & 1u))) ++m;
  return sign | static_cast<uint8_t>(m);
}

inline float e4m3_to_float(uint8_t b) {
  const uint32_t exp = (b >> 3) & 0xfu, man = b & 7u;
  float v;
  if (exp == 15 && man == 7) {
    uint32_t nan = 0x7fc00000u;
    std::memcpy(&v, &nan, 4);
  } else if (exp == 0) {
    v = static_cast<float>(man) * (1.0f / 512.0f);
  } else {
    uint32_t u = ((exp - 7 + 127) << 23) | (man << 20);
    std::memcpy(&v, &u, 4);
  }
  return (b & 0x80) ? -v : v;
}

// Scale of a block whose largest magnitude is amax (NaN-free): amax / 448, or 1 for an all-zero block.
inline float e4m3_scale(float amax) { return amax > 0.0f ? amax / kE4M3Max : 1.0f; }

// What values are multiplied by before the cast: 1 / scale, rounded once (IEEE), so q = e4m3(x * (1 / scale))
// (one multiplication per value instead of a division: the quantisation kernels were bound by the divisions).
inline float e4m3_inv_scale(float scale) { return 1.0f / scale; }

MOE8_HD int64_t quant_blocks(int64_t n) { return (n + kQuantBlock - 1) / kQuantBlock; }

// Rows of the scale tensor of quantize_cols_1x128 for R rows in E groups: every group's rows are cut
// into 128-row blocks starting at the group's first row, so at most ceil(R/128) + E blocks exist.
MOE8_HD int64_t col_scale_blocks(int64_t rows, int64_t num_groups) { return quant_blocks(rows) + num_groups; }

}  // namespace moe8
