// adamw.h — one AdamW update of one element (decoupled weight decay, Loshchilov & Hutter), shared by the CPU
// reference and the CUDA kernel so that both give the same bits: float32 arithmetic in a fixed order, each rounding
// explicit (nvcc would otherwise fuse some products into FMAs where a host compiler does not).
#pragma once
#include <cmath>

#include "core/dtype.h"

namespace moe8 {

// What one optimizer step needs besides the tensors, made once per step on the host (in double, then rounded).
struct AdamWScalars {
  float decay;  // 1 - lr * weight_decay
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float step_size;   // lr / (1 - beta1^step)
  float bias2_sqrt;  // sqrt(1 - beta2^step)
  float eps;
  bool maximize;
};

inline AdamWScalars adamw_scalars(double lr, double beta1, double beta2, double eps, double weight_decay, double step,
                                  bool maximize) {
  AdamWScalars s;
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, step)));
  s.bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, step)));
  s.eps = static_cast<float>(eps);
  s.maximize = maximize;
  return s;
}

MOE8_HD float adamw_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MOE8_HD float adamw_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
MOE8_HD float adamw_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
MOE8_HD float adamw_sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
MOE8_HD float adamw_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// p, m (exp_avg), v (exp_avg_sq) updated in place from the gradient g:
//   p *= 1 - lr wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
//   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
MOE8_HD void adamw_update(const AdamWScalars& s, float g, float& p, float& m, float& v) {
  if (s.maximize) g = -g;
  p = adamw_mul(p, s.decay);
  m = adamw_fma(s.one_minus_beta1, g, adamw_mul(s.beta1, m));
  v = adamw_fma(adamw_mul(s.one_minus_beta2, g), g, adamw_mul(s.beta2, v));
  const float denom = adamw_add(adamw_div(adamw_sqrt(v), s.bias2_sqrt), s.eps);
  p = adamw_fma(-s.step_size, adamw_div(m, denom), p);
}

}  // namespace moe8
