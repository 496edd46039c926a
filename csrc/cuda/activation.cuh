// activation.cuh — the forward and backward formulas of every expert activation, shared by the activation
// kernels (activation.cu), the fused activation + FP8 quantisation (swiglu_quant.cu) and the down projection's
// input gradient with the routed activation backward in its epilogue (act_backward_epilogue_sm90.cuh), so that
// all compute the same float for the same input. Written in the CPU reference's order of operations.
#pragma once
#include <cuda_runtime.h>

#include "core/params.h"

namespace moe8::cuda {

constexpr float kSqrtHalf = 0.70710678118654752f;

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }

// Clamps as torch.clamp does: NaN passes through.
__device__ __forceinline__ float clamp_max(float x, float hi) { return x > hi ? hi : x; }
__device__ __forceinline__ float clamp_both(float x, float lo, float hi) { return x > hi ? hi : (x < lo ? lo : x); }

// g: gate (or the input of an ungated kind), u: up (unused when ungated).
__device__ __forceinline__ float act_forward(const ActParams& p, float g, float u) {
  switch (p.kind) {
    case ActKind::kSwiGLU:
      return g * sigmoidf(g) * u;
    case ActKind::kSwiGLUClamped: {
      const float gc = clamp_max(g, p.limit), uc = clamp_both(u, -p.limit, p.limit);
      return (uc + 1.f) * gc * sigmoidf(p.alpha * gc);
    }
    case ActKind::kSiLU:
      return g * sigmoidf(g);
    default:  // kGELU, exact
      return 0.5f * g * (1.f + erff(g * kSqrtHalf));
  }
}

// d: upstream gradient of the output -> dg, du (du is 0 when ungated).
__device__ __forceinline__ void act_backward(const ActParams& p, float g, float u, float d, float& dg, float& du) {
  switch (p.kind) {
    case ActKind::kSwiGLU: {
      const float s = sigmoidf(g);
      dg = d * u * s * (1.f + g * (1.f - s));
      du = d * g * s;
      break;
    }
    case ActKind::kSwiGLUClamped: {
      // The clamps pass gradient where the input lay inside the bounds, bounds included (torch.clamp).
      const float gc = clamp_max(g, p.limit), uc = clamp_both(u, -p.limit, p.limit);
      const float s = sigmoidf(p.alpha * gc);
      dg = g <= p.limit ? d * (uc + 1.f) * s * (1.f + p.alpha * gc * (1.f - s)) : 0.f;
      du = (u >= -p.limit && u <= p.limit) ? d * (gc * s) : 0.f;
      break;
    }
    case ActKind::kSiLU: {
      const float s = sigmoidf(g);
      dg = d * s * (1.f + g * (1.f - s));
      du = 0.f;
      break;
    }
    default: {  // kGELU: d/dg [g Phi(g)] = Phi(g) + g phi(g)
      const float cdf = 0.5f * (1.f + erff(g * kSqrtHalf));
      const float pdf = 0.39894228040143268f * expf(-0.5f * g * g);  // 1 / sqrt(2 pi)
      dg = d * (cdf + g * pdf);
      du = 0.f;
      break;
    }
  }
}

// SwiGLU's act_forward and act_backward at once, its sigmoid computed once: the same floats as the two calls.
__device__ __forceinline__ float swiglu_value_and_grad(float g, float u, float d, float& dg, float& du) {
  const float s = sigmoidf(g);
  dg = d * u * s * (1.f + g * (1.f - s));
  du = d * g * s;
  return g * s * u;
}

// act_forward and act_backward at once (the routed backward needs both).
__device__ __forceinline__ float act_value_and_grad(const ActParams& p, float g, float u, float d, float& dg,
                                                    float& du) {
  if (p.kind == ActKind::kSwiGLU) return swiglu_value_and_grad(g, u, d, dg, du);
  act_backward(p, g, u, d, dg, du);
  return act_forward(p, g, u);
}

}  // namespace moe8::cuda
