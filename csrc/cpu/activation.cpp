// activation.cpp — CPU reference of the expert activations: SwiGLU, GPT-OSS clamped SwiGLU (gated, from
// [gate | up] or interleaved [g0, u0, g1, u1, ...]) and plain SiLU / GELU, forward and backward.
#include <algorithm>
#include <cmath>

#include "core/parallel.h"
#include "cpu/common.h"
#include "cpu/ops.h"

namespace moe8::cpu {
namespace {

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// Column of gate/up element i in a gated row of width 2I.
inline int64_t gate_col(int64_t i, int64_t /*I*/, bool interleaved) { return interleaved ? 2 * i : i; }
inline int64_t up_col(int64_t i, int64_t I, bool interleaved) { return interleaved ? 2 * i + 1 : I + i; }

// The activation of one output from its gate g and up u (u unused when ungated).
inline float act_value(const ActParams& p, float g, float u) {
  switch (p.kind) {
    case ActKind::kSiLU:
      return g * sigmoid(g);
    case ActKind::kGELU:
      return 0.5f * g * (1.f + std::erf(g * 0.70710678118654752f));
    case ActKind::kSwiGLU:
      return g * sigmoid(g) * u;
    default: {  // kSwiGLUClamped
      g = std::min(g, p.limit);
      u = std::clamp(u, -p.limit, p.limit);
      return (u + 1.f) * g * sigmoid(p.alpha * g);
    }
  }
}

// d: upstream gradient of the output -> dg, du (du unused when ungated).
inline void act_grad(const ActParams& p, float g, float u, float dy, float& dg, float& du) {
  switch (p.kind) {
    case ActKind::kSiLU: {
      const float s = sigmoid(g);
      dg = dy * s * (1.f + g * (1.f - s));
      du = 0.f;
      break;
    }
    case ActKind::kGELU: {
      const float cdf = 0.5f * (1.f + std::erf(g * 0.70710678118654752f));
      const float pdf = 0.39894228040143268f * std::exp(-0.5f * g * g);
      dg = dy * (cdf + g * pdf);
      du = 0.f;
      break;
    }
    case ActKind::kSwiGLU: {
      const float s = sigmoid(g);
      du = dy * g * s;
      dg = dy * u * s * (1.f + g * (1.f - s));
      break;
    }
    default: {  // kSwiGLUClamped: the clamps pass gradient inside their bounds, bounds included
      const bool g_in = g <= p.limit, u_in = u >= -p.limit && u <= p.limit;
      g = std::min(g, p.limit);
      u = std::clamp(u, -p.limit, p.limit);
      const float s = sigmoid(p.alpha * g), glu = g * s;
      du = u_in ? dy * glu : 0.f;
      dg = g_in ? dy * (u + 1.f) * s * (1.f + p.alpha * g * (1.f - s)) : 0.f;
      break;
    }
  }
}

// Reads output i's gate and up from row x of h (u = 0 when ungated).
template <typename T>
inline void load_gu(const T* x, const ActParams& p, int64_t i, int64_t I, float& g, float& u) {
  if (is_gated(p.kind)) {
    g = to_f(x[gate_col(i, I, p.interleaved)]);
    u = to_f(x[up_col(i, I, p.interleaved)]);
  } else {
    g = to_f(x[i]);
    u = 0.f;
  }
}

// Writes output i's dg, du into row d of dh (du dropped when ungated).
template <typename T>
inline void store_gu(T* d, const ActParams& p, int64_t i, int64_t I, float dg, float du) {
  if (is_gated(p.kind)) {
    d[gate_col(i, I, p.interleaved)] = from_f<T>(dg);
    d[up_col(i, I, p.interleaved)] = from_f<T>(du);
  } else {
    d[i] = from_f<T>(dg);
  }
}

}  // namespace

void activation_forward(const TensorView& h, const ActParams& p, const TensorView& out) {
  const int64_t R = out.size(0), I = out.size(1), W = h.size(1);
  MOE8_CPU_DISPATCH_FLOAT(h.dtype, "activation_forward", [&] {
    const scalar_t* X = h.ptr<scalar_t>();
    scalar_t* Y = out.ptr<scalar_t>();
    parallel_for(R, 64, [&](int64_t r) {
      const scalar_t* x = X + r * W;
      for (int64_t i = 0; i < I; ++i) {
        float g, u;
        load_gu(x, p, i, I, g, u);
        Y[r * I + i] = from_f<scalar_t>(act_value(p, g, u));
      }
    });
  });
}

void activation_backward(const TensorView& h, const TensorView& dout, const ActParams& p, const TensorView& dh) {
  const int64_t R = dout.size(0), I = dout.size(1), W = h.size(1);
  MOE8_CPU_DISPATCH_FLOAT(h.dtype, "activation_backward", [&] {
    const scalar_t* X = h.ptr<scalar_t>();
    const scalar_t* G = dout.ptr<scalar_t>();
    scalar_t* D = dh.ptr<scalar_t>();
    parallel_for(R, 64, [&](int64_t r) {
      const scalar_t* x = X + r * W;
      scalar_t* d = D + r * W;
      for (int64_t i = 0; i < I; ++i) {
        float g, u, dg, du;
        load_gu(x, p, i, I, g, u);
        act_grad(p, g, u, to_f(G[r * I + i]), dg, du);
        store_gu(d, p, i, I, dg, du);
      }
    });
  });
}

void activation_backward_routed(const TensorView& h, const TensorView& dout, const TensorView& weights,
                                const TensorView& row_to_slot, const ActParams& p, const TensorView& dh,
                                const TensorView& a_w, const TensorView& d_weights) {
  const int64_t R = dout.size(0), I = dout.size(1), W = h.size(1);
  const float* wts = weights.ptr<float>();
  const int32_t* slots = row_to_slot.ptr<int32_t>();
  float* dw = d_weights.ptr<float>();
  MOE8_CPU_DISPATCH_FLOAT(h.dtype, "activation_backward_routed", [&] {
    const scalar_t* X = h.ptr<scalar_t>();
    const scalar_t* G = dout.ptr<scalar_t>();
    scalar_t* D = dh.ptr<scalar_t>();
    scalar_t* A = a_w.ptr<scalar_t>();
    parallel_for(R, 16, [&](int64_t r) {
      const int32_t slot = slots[r];
      const float w = in_range(slot, weights.size(0)) ? wts[slot] : 0.f;
      const scalar_t* x = X + r * W;
      scalar_t* d = D + r * W;
      float dot = 0.f;
      for (int64_t i = 0; i < I; ++i) {  // dout[r, i] is read before a_w[r, i] (maybe the same element) is written
        float g, u, dg, du;
        load_gu(x, p, i, I, g, u);
        const float a = act_value(p, g, u), dy = to_f(G[r * I + i]);
        dot += a * dy;
        act_grad(p, g, u, w * dy, dg, du);
        A[r * I + i] = from_f<scalar_t>(w * a);
        store_gu(d, p, i, I, dg, du);
      }
      if (in_range(slot, weights.size(0))) dw[slot] = dot;
    });
  });
}

}  // namespace moe8::cpu
