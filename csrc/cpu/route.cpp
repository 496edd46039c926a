// route.cpp — CPU reference of the router: scores, top-k, weights, aux-loss statistics, and backward.
// One token at a time in fp32; statistics reduced in token order, so results are deterministic.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/parallel.h"
#include "cpu/common.h"
#include "cpu/ops.h"

namespace moe8::cpu {
namespace {

// Indices of the k largest values, descending; ties go to the lower index.
std::vector<int> topk_desc(const std::vector<float>& v, int k, const std::vector<char>* eligible = nullptr) {
  std::vector<int> idx;
  idx.reserve(v.size());
  for (int i = 0; i < static_cast<int>(v.size()); ++i)
    if (!eligible || (*eligible)[i]) idx.push_back(i);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return v[a] > v[b]; });
  idx.resize(std::min<size_t>(k, idx.size()));
  return idx;
}

// Per-token scores, in fp32: everything forward and backward need about token t.
struct TokenScores {
  std::vector<float> l;      // logits [E]
  std::vector<float> probs;  // softmax(l) [E]
  std::vector<float> s;      // sigmoid(l) [E] (sigmoid scheme only)
  float lse = 0.f;
};

template <typename T>
TokenScores token_scores(const T* row, int E, RouteScheme scheme) {
  TokenScores ts;
  ts.l.resize(E);
  for (int e = 0; e < E; ++e) ts.l[e] = to_f(row[e]);
  float m = -INFINITY;
  for (float x : ts.l) m = std::max(m, x);
  float sum = 0.f;
  ts.probs.resize(E);
  for (int e = 0; e < E; ++e) sum += (ts.probs[e] = std::exp(ts.l[e] - m));
  for (float& p : ts.probs) p /= sum;
  ts.lse = m + std::log(sum);
  if (scheme == RouteScheme::kSigmoidGroupTopK) {
    ts.s.resize(E);
    for (int e = 0; e < E; ++e) ts.s[e] = 1.f / (1.f + std::exp(-ts.l[e]));
  }
  return ts;
}

std::vector<int> choose(const TokenScores& ts, const float* bias, const RouteParams& p) {
  const int E = static_cast<int>(ts.l.size());
  switch (p.scheme) {
    case RouteScheme::kSoftmaxTopK:
      return topk_desc(ts.probs, p.k);
    case RouteScheme::kTopKSoftmax:
      return topk_desc(ts.l, p.k);
    case RouteScheme::kSigmoidGroupTopK: {
      std::vector<float> c(E);
      for (int e = 0; e < E; ++e) c[e] = ts.s[e] + (bias ? bias[e] : 0.f);
      const int gsize = E / p.n_group;
      std::vector<float> gscore(p.n_group);
      for (int g = 0; g < p.n_group; ++g) {
        std::vector<float> members(c.begin() + g * gsize, c.begin() + (g + 1) * gsize);
        std::vector<int> top2 = topk_desc(members, 2);
        gscore[g] = 0.f;
        for (int i : top2) gscore[g] += members[i];
      }
      std::vector<int> groups = topk_desc(gscore, p.topk_group);
      std::vector<char> eligible(E, 0);
      for (int g : groups) std::fill(eligible.begin() + g * gsize, eligible.begin() + (g + 1) * gsize, 1);
      return topk_desc(c, p.k, &eligible);
    }
  }
  return {};
}

// Probabilities the balance statistics use: softmax(l), or s / sum(s) for the sigmoid scheme.
std::vector<float> stat_probs(const TokenScores& ts, RouteScheme scheme) {
  if (scheme != RouteScheme::kSigmoidGroupTopK) return ts.probs;
  float sum = std::accumulate(ts.s.begin(), ts.s.end(), 0.f);
  std::vector<float> q(ts.s.size());
  for (size_t e = 0; e < q.size(); ++e) q[e] = ts.s[e] / sum;
  return q;
}

}  // namespace

void route_forward(const TensorView& logits, const TensorView& bias, const RouteParams& p, const TensorView& ids,
                   const TensorView& weights, const TensorView& prob_mean, const TensorView& token_frac,
                   const TensorView& lse) {
  const int64_t T = logits.size(0);
  const int E = static_cast<int>(logits.size(1));
  const int K = p.k;
  const float* b = bias.present ? bias.ptr<float>() : nullptr;
  std::vector<float> q_all(static_cast<size_t>(T) * E);  // statistics probabilities [T, E]
  MOE8_CPU_DISPATCH_FLOAT(logits.dtype, "route_forward", [&] {
    const scalar_t* L = logits.ptr<scalar_t>();
    parallel_for(T, 64, [&](int64_t t) {
      TokenScores ts = token_scores(L + t * E, E, p.scheme);
      std::vector<int> chosen = choose(ts, b, p);
      std::vector<float> w(K);
      if (p.scheme == RouteScheme::kTopKSoftmax) {
        float m = ts.l[chosen[0]], sum = 0.f;
        for (int k = 0; k < K; ++k) sum += (w[k] = std::exp(ts.l[chosen[k]] - m));
        for (float& x : w) x /= sum;
      } else {
        const std::vector<float>& score = p.scheme == RouteScheme::kSoftmaxTopK ? ts.probs : ts.s;
        float sum = 0.f;
        for (int k = 0; k < K; ++k) sum += (w[k] = score[chosen[k]]);
        if (p.renormalize) {
          float denom = p.scheme == RouteScheme::kSigmoidGroupTopK ? sum + 1e-20f : sum;
          for (float& x : w) x /= denom;
        }
        if (p.scheme == RouteScheme::kSigmoidGroupTopK)
          for (float& x : w) x *= p.scaling;
      }
      for (int k = 0; k < K; ++k) {
        ids.ptr<int32_t>()[t * K + k] = chosen[k];
        weights.ptr<float>()[t * K + k] = w[k];
      }
      lse.ptr<float>()[t] = ts.lse;
      std::vector<float> q = stat_probs(ts, p.scheme);
      std::copy(q.begin(), q.end(), q_all.begin() + t * E);
    });
  });
  // Statistics: sums in token order (deterministic), counts exact.
  std::vector<double> psum(E, 0.0);
  std::vector<int64_t> count(E, 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) psum[e] += q_all[t * E + e];
    for (int k = 0; k < K; ++k) ++count[ids.ptr<int32_t>()[t * K + k]];
  }
  for (int e = 0; e < E; ++e) {
    prob_mean.ptr<float>()[e] = T ? static_cast<float>(psum[e] / T) : 0.f;
    token_frac.ptr<float>()[e] = T ? static_cast<float>(static_cast<double>(count[e]) / (T * K)) : 0.f;
  }
}

void route_backward(const TensorView& logits, const TensorView& bias, const RouteParams& p, const TensorView& ids,
                    const TensorView& grad_weights, const TensorView& grad_prob_mean, const TensorView& grad_lse,
                    const TensorView& grad_logits) {
  (void)bias;  // selection gets no gradient
  const int64_t T = logits.size(0);
  const int E = static_cast<int>(logits.size(1));
  const int K = p.k;
  const float* gpm = grad_prob_mean.present ? grad_prob_mean.ptr<float>() : nullptr;
  const float* glse = grad_lse.present ? grad_lse.ptr<float>() : nullptr;
  MOE8_CPU_DISPATCH_FLOAT(logits.dtype, "route_backward", [&] {
    const scalar_t* L = logits.ptr<scalar_t>();
    scalar_t* G = grad_logits.ptr<scalar_t>();
    parallel_for(T, 64, [&](int64_t t) {
      TokenScores ts = token_scores(L + t * E, E, p.scheme);
      std::vector<int32_t> id(ids.ptr<int32_t>() + t * K, ids.ptr<int32_t>() + (t + 1) * K);
      for (int32_t& i : id) i = std::clamp<int32_t>(i, 0, static_cast<int32_t>(E) - 1);  // never read past E
      const float* g = grad_weights.ptr<float>() + t * K;
      std::vector<float> dl(E, 0.f);
      // d(statistics probs) -> d(softmax input) helper: dl += p * (dp - <p, dp>)
      auto softmax_back = [&](const std::vector<float>& dp) {
        float dot = 0.f;
        for (int e = 0; e < E; ++e) dot += ts.probs[e] * dp[e];
        for (int e = 0; e < E; ++e) dl[e] += ts.probs[e] * (dp[e] - dot);
      };
      if (p.scheme == RouteScheme::kSoftmaxTopK) {
        std::vector<float> dp(E, 0.f);
        float S = 0.f, gq = 0.f;
        for (int k = 0; k < K; ++k) {
          S += ts.probs[id[k]];
          gq += g[k] * ts.probs[id[k]];
        }
        for (int k = 0; k < K; ++k) dp[id[k]] = p.renormalize ? (g[k] - gq / S) / S : g[k];
        if (gpm)
          for (int e = 0; e < E; ++e) dp[e] += gpm[e] / T;
        softmax_back(dp);
      } else if (p.scheme == RouteScheme::kTopKSoftmax) {
        float m = ts.l[id[0]], sum = 0.f, gw = 0.f;
        std::vector<float> w(K);
        for (int k = 0; k < K; ++k) sum += (w[k] = std::exp(ts.l[id[k]] - m));
        for (int k = 0; k < K; ++k) gw += g[k] * (w[k] /= sum);
        for (int k = 0; k < K; ++k) dl[id[k]] += w[k] * (g[k] - gw);
        if (gpm) {
          std::vector<float> dp(E);
          for (int e = 0; e < E; ++e) dp[e] = gpm[e] / T;
          softmax_back(dp);
        }
      } else {
        std::vector<float> ds(E, 0.f);
        float S = 0.f, gq = 0.f;
        for (int k = 0; k < K; ++k) {
          S += ts.s[id[k]];
          gq += g[k] * ts.s[id[k]];
        }
        const float D = S + 1e-20f;
        for (int k = 0; k < K; ++k) ds[id[k]] = p.renormalize ? p.scaling * (g[k] - gq / D) / D : p.scaling * g[k];
        if (gpm) {
          float ssum = std::accumulate(ts.s.begin(), ts.s.end(), 0.f), dot = 0.f;
          for (int e = 0; e < E; ++e) dot += gpm[e] / T * ts.s[e] / ssum;
          for (int e = 0; e < E; ++e) ds[e] += (gpm[e] / T - dot) / ssum;
        }
        for (int e = 0; e < E; ++e) dl[e] += ds[e] * ts.s[e] * (1.f - ts.s[e]);
      }
      if (glse)
        for (int e = 0; e < E; ++e) dl[e] += glse[t] * ts.probs[e];
      for (int e = 0; e < E; ++e) G[t * E + e] = from_f<scalar_t>(dl[e]);
    });
  });
}

}  // namespace moe8::cpu
