// params.h — compile-time-free descriptions of what an op should do, shared by the API and backends.
#pragma once
#include <cstdint>

namespace moe8 {

// How router logits become top-k expert ids and weights.
enum class RouteScheme : int {
  kSoftmaxTopK = 0,       // p = softmax(l); top-k of p; optional renormalise   [Mixtral, Qwen, OLMoE]
  kSigmoidGroupTopK = 1,  // s = sigmoid(l); choose on s + bias within the best groups; w = s[ids],
                          // optional renormalise, times scaling              [DeepSeek-V3]
  kTopKSoftmax = 2,       // top-k of l; w = softmax over the k chosen logits  [GPT-OSS]
};

struct RouteParams {
  RouteScheme scheme = RouteScheme::kSoftmaxTopK;
  int k = 1;
  bool renormalize = false;
  int n_group = 1;     // sigmoid scheme: experts split into n_group groups ...
  int topk_group = 1;  // ... of which the topk_group best (sum of each group's top-2) are eligible
  float scaling = 1.0f;
};
// Statistics for the auxiliary losses, written by route_forward:
//   prob_mean[e]  = mean over tokens of the router probability of e (softmax(l) for the softmax and
//                   topk-softmax schemes, s / sum(s) for the sigmoid scheme); differentiable.
//   token_frac[e] = (number of (token, slot) pairs routed to e) / (T * k); not differentiable.
//   lse[t]        = logsumexp(l[t]) — the router z-loss is mean(lse^2); differentiable.

enum class WeightLayout : int {
  kNK = 0,  // b[e] is [N, K] and c = a · b[e]^T   (HF gate_up_proj [E, 2I, H], down_proj [E, H, I])
  kKN = 1,  // b[e] is [K, N] and c = a · b[e]     (GPT-OSS gate_up_proj [E, H, 2I], down_proj [E, I, H])
};

enum class ActKind : int {
  kSwiGLU = 0,         // silu(gate) * up
  kSwiGLUClamped = 1,  // GPT-OSS: g = min(gate, limit), u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha g)
  kSiLU = 2,           // ungated
  kGELU = 3,           // ungated, exact (erf)
};

inline bool is_gated(ActKind k) { return k == ActKind::kSwiGLU || k == ActKind::kSwiGLUClamped; }

struct ActParams {
  ActKind kind = ActKind::kSwiGLU;
  bool interleaved = false;  // gated input as [g0, u0, g1, u1, ...] (GPT-OSS) instead of [gate | up]
  float alpha = 1.702f;
  float limit = 7.0f;
};

}  // namespace moe8
