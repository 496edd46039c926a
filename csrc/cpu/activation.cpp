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

}  // namespace

void activation_forward(const TensorView& h, const ActParams& p, const TensorView& out) {
  const int64_t R = out.size(0), I = out.size(1), W = h.size(1);
  MOE8_CPU_DISPATCH_FLOAT(h.dtype, "activation_forward", [&] {
    const scalar_t* X = h.ptr<scalar_t>();
    scalar_t* Y = out.ptr<scalar_t>();
    parallel_for(R, 64, [&](int64_t r) {
      const scalar_t* x = X + r * W;
      for (int64_t i = 0; i < I; ++i) {
        float y;
        if (p.kind == ActKind::kSiLU) {
          float v = to_f(x[i]);
          y = v * sigmoid(v);
        } else if (p.kind == ActKind::kGELU) {
          float v = to_f(x[i]);
          y = 0.5f * v * (1.f + std::erf(v * 0.70710678118654752f));
        } else {
          float g = to_f(x[gate_col(i, I, p.interleaved)]), u = to_f(x[up_col(i, I, p.interleaved)]);
          if (p.kind == ActKind::kSwiGLU) {
            y = g * sigmoid(g) * u;
          } else {
            g = std::min(g, p.limit);
            u = std::clamp(u, -p.limit, p.limit);
            y = (u + 1.f) * g * sigmoid(p.alpha * g);
          }
        }
        Y[r * I + i] = from_f<scalar_t>(y);
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
        float dy = to_f(G[r * I + i]);
        if (p.kind == ActKind::kSiLU) {
          float v = to_f(x[i]), s = sigmoid(v);
          d[i] = from_f<scalar_t>(dy * s * (1.f + v * (1.f - s)));
        } else if (p.kind == ActKind::kGELU) {
          float v = to_f(x[i]);
          float cdf = 0.5f * (1.f + std::erf(v * 0.70710678118654752f));
          float pdf = 0.39894228040143268f * std::exp(-0.5f * v * v);
          d[i] = from_f<scalar_t>(dy * (cdf + v * pdf));
        } else {
          const int64_t gc = gate_col(i, I, p.interleaved), uc = up_col(i, I, p.interleaved);
          float g = to_f(x[gc]), u = to_f(x[uc]), dg, du;
          if (p.kind == ActKind::kSwiGLU) {
            float s = sigmoid(g);
            du = dy * g * s;
            dg = dy * u * s * (1.f + g * (1.f - s));
          } else {
            const bool g_in = g <= p.limit, u_in = u >= -p.limit && u <= p.limit;
            g = std::min(g, p.limit);
            u = std::clamp(u, -p.limit, p.limit);
            float s = sigmoid(p.alpha * g), glu = g * s;
            du = u_in ? dy * glu : 0.f;
            dg = g_in ? dy * (u + 1.f) * s * (1.f + p.alpha * g * (1.f - s)) : 0.f;
          }
          d[gc] = from_f<scalar_t>(dg);
          d[uc] = from_f<scalar_t>(du);
        }
      }
    });
  });
}

}  // namespace moe8::cpu
