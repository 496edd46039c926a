// activation.cuh — the forward formula of every expert activation, shared by the activation kernels
// (activation.cu) and the fused activation + FP8 quantisation (swiglu_quant.cu), so that both compute the same
// float for the same input. Written in the CPU reference's order of operations.
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

}  // namespace moe8::cuda
