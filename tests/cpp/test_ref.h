// test_ref.h — independent float64 references of every moe8 op, written from the specs in
// core/params.h and cpu/ops.h as plain loops (nothing shared with csrc/), and the input generators
// the tests feed them. Each reference returns an Expect: values, plus the magnitude its fp32
// computation error scales with.
#pragma once
#include <algorithm>
#include <numeric>

#include "test_util.h"

namespace moe8::test {

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double silu(double x) { return x * sigmoid(x); }
inline double silu_grad(double x) { return sigmoid(x) * (1.0 + x * (1.0 - sigmoid(x))); }

// ---------------------------------------------------------------- routing

// The k best of `cand` by `score`, best first. *gap shrinks to the smallest score distance a choice
// depended on (between neighbours when `ordered`, else only across the k-th/(k+1)-th boundary).
inline std::vector<int> topk_desc(const std::vector<double>& score, std::vector<int> cand, int k, bool ordered,
                                  double* gap) {
  std::stable_sort(cand.begin(), cand.end(), [&](int a, int b) { return score[a] > score[b]; });
  for (int i = 0; i + 1 < static_cast<int>(cand.size()) && i < k; ++i)
    if (ordered || i == k - 1) *gap = std::min(*gap, score[cand[i]] - score[cand[i + 1]]);
  cand.resize(k);
  return cand;
}

struct RouteRow {
  std::vector<int> ids;      // [K], best first
  std::vector<double> w;     // [K]
  std::vector<double> prob;  // [E] router probability used by prob_mean
  double lse = 0;
  double gap = 1e300;  // smallest margin of any selection decision
};

inline double logsumexp(const double* l, int n) {
  double m = *std::max_element(l, l + n), s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(l[i] - m);
  return m + std::log(s);
}

// Weights and probabilities of one token for given ids (selection is not differentiated).
inline void route_weights(const double* l, int E, const RouteParams& p, const std::vector<int>& ids,
                          std::vector<double>* w, std::vector<double>* prob) {
  int K = static_cast<int>(ids.size());
  double lse = logsumexp(l, E);
  prob->assign(E, 0.0);
  w->assign(K, 0.0);
  if (p.scheme == RouteScheme::kSigmoidGroupTopK) {
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += ((*prob)[e] = sigmoid(l[e]));
    for (int e = 0; e < E; ++e) (*prob)[e] /= sum;
    double wsum = 0;
    for (int k = 0; k < K; ++k) wsum += ((*w)[k] = sigmoid(l[ids[k]]));
    for (int k = 0; k < K; ++k) (*w)[k] = (p.renormalize ? (*w)[k] / wsum : (*w)[k]) * p.scaling;
    return;
  }
  for (int e = 0; e < E; ++e) (*prob)[e] = std::exp(l[e] - lse);
  if (p.scheme == RouteScheme::kSoftmaxTopK) {
    double wsum = 0;
    for (int k = 0; k < K; ++k) wsum += ((*w)[k] = (*prob)[ids[k]]);
    if (p.renormalize)
      for (int k = 0; k < K; ++k) (*w)[k] /= wsum;
  } else {  // kTopKSoftmax: softmax over the chosen logits
    std::vector<double> chosen(K);
    for (int k = 0; k < K; ++k) chosen[k] = l[ids[k]];
    double cl = logsumexp(chosen.data(), K);
    for (int k = 0; k < K; ++k) (*w)[k] = std::exp(chosen[k] - cl);
  }
}

inline RouteRow route_row(const double* l, int E, const double* bias, const RouteParams& p) {
  RouteRow r;
  r.lse = logsumexp(l, E);
  std::vector<int> all(E);
  std::iota(all.begin(), all.end(), 0);
  if (p.scheme == RouteScheme::kSigmoidGroupTopK) {
    std::vector<double> choice(E);
    for (int e = 0; e < E; ++e) choice[e] = sigmoid(l[e]) + (bias ? bias[e] : 0.0);
    int gsz = E / p.n_group;
    std::vector<double> gscore(p.n_group);
    for (int g = 0; g < p.n_group; ++g) {
      std::vector<double> c(choice.begin() + g * gsz, choice.begin() + (g + 1) * gsz);
      std::sort(c.rbegin(), c.rend());
      gscore[g] = c[0] + (gsz > 1 ? c[1] : 0.0);
    }
    std::vector<int> groups(p.n_group);
    std::iota(groups.begin(), groups.end(), 0);
    groups = topk_desc(gscore, groups, p.topk_group, false, &r.gap);
    std::vector<int> eligible;
    for (int g : groups)
      for (int e = g * gsz; e < (g + 1) * gsz; ++e) eligible.push_back(e);
    r.ids = topk_desc(choice, eligible, p.k, true, &r.gap);
  } else {
    r.ids = topk_desc(std::vector<double>(l, l + E), all, p.k, true, &r.gap);
  }
  route_weights(l, E, p, r.ids, &r.w, &r.prob);
  return r;
}

struct RouteRef {
  std::vector<int> ids;
  Expect weights, prob_mean, token_frac, lse;
};

inline RouteRef route_ref(const HostTensor& logits, const HostTensor* bias, const RouteParams& p) {
  int T = static_cast<int>(logits.shape()[0]), E = static_cast<int>(logits.shape()[1]), K = p.k;
  std::vector<double> l = logits.values(), b = bias ? bias->values() : std::vector<double>();
  RouteRef r;
  r.weights.comp_rel = fp32_rel(E);
  r.prob_mean.comp_rel = fp32_rel(E + T);
  r.token_frac.comp_rel = fp32_rel(2);
  r.lse.comp_rel = fp32_rel(E);
  r.prob_mean.want.assign(E, 0.0);
  r.token_frac.want.assign(E, 0.0);
  for (int t = 0; t < T; ++t) {
    RouteRow row = route_row(&l[t * E], E, bias ? b.data() : nullptr, p);
    for (int k = 0; k < K; ++k) {
      r.ids.push_back(row.ids[k]);
      r.weights.want.push_back(row.w[k]);
      r.weights.mag.push_back(std::fabs(row.w[k]));
      r.token_frac.want[row.ids[k]] += 1.0 / (static_cast<double>(T) * K);
    }
    for (int e = 0; e < E; ++e) r.prob_mean.want[e] += row.prob[e] / T;
    double mx = *std::max_element(&l[t * E], &l[t * E] + E);
    r.lse.want.push_back(row.lse);
    r.lse.mag.push_back(std::fabs(mx) + std::log(E) + 1.0);
  }
  r.prob_mean.mag = r.prob_mean.want;
  r.token_frac.mag = r.token_frac.want;
  return r;
}

// Logits [T,E] with no selection decision closer than min_gap (rows are redrawn until so), so that any
// correct fp32 implementation picks exactly the float64 ids. skew: probability that a token strongly
// prefers expert 0.
inline HostTensor route_logits(int T, int E, DType dtype, const HostTensor* bias, const RouteParams& p, Rng& rng,
                               double skew = 0.0, double min_gap = 1e-4) {
  HostTensor l(dtype, {T, E});
  std::vector<double> b = bias ? bias->values() : std::vector<double>();
  for (int t = 0; t < T; ++t) {
    for (int attempt = 0;; ++attempt) {
      bool favour = rng.uniform(0, 1) < skew;
      for (int e = 0; e < E; ++e) l.set(t * E + e, 2.0 * rng.normal() + (favour && e == 0 ? 6.0 : 0.0));
      std::vector<double> row(E);
      for (int e = 0; e < E; ++e) row[e] = l.get(t * E + e);
      if (route_row(row.data(), E, bias ? b.data() : nullptr, p).gap > min_gap) break;
      if (attempt > 1000) throw std::runtime_error("route_logits: cannot draw a row without near-ties");
    }
  }
  return l;
}

// d/dlogits of sum gw*weights + sum gpm*prob_mean + sum glse*lse with ids fixed, by central differences
// in float64. mag: the scale of a row's gradient (what fp32 error is relative to).
inline Expect route_grad_ref(const HostTensor& logits, const RouteParams& p, const std::vector<int>& ids,
                             const HostTensor& gw, const HostTensor* gpm, const HostTensor* glse, bool values = true) {
  int T = static_cast<int>(logits.shape()[0]), E = static_cast<int>(logits.shape()[1]), K = p.k;
  std::vector<double> l = logits.values();
  Expect g;
  g.comp_rel = fp32_rel(E) + 1e-8;
  g.want.assign(static_cast<size_t>(T) * E, 0.0);
  g.mag.assign(static_cast<size_t>(T) * E, 0.0);
  for (int t = 0; t < T; ++t) {
    std::vector<int> row_ids(ids.begin() + t * K, ids.begin() + (t + 1) * K);
    double scale = (glse ? std::fabs(glse->get(t)) : 0.0) + 1e-30;
    for (int k = 0; k < K; ++k)
      scale += std::fabs(gw.get(t * K + k)) * std::max(1.0, std::fabs(static_cast<double>(p.scaling)));
    for (int e = 0; e < E && gpm; ++e) scale += std::fabs(gpm->get(e)) / T;
    auto loss = [&](const std::vector<double>& row) {
      std::vector<double> w, prob;
      route_weights(row.data(), E, p, row_ids, &w, &prob);
      double L = glse ? glse->get(t) * logsumexp(row.data(), E) : 0.0;
      for (int k = 0; k < K; ++k) L += gw.get(t * K + k) * w[k];
      for (int e = 0; e < E && gpm; ++e) L += gpm->get(e) * prob[e] / T;
      return L;
    };
    std::vector<double> row(l.begin() + t * E, l.begin() + (t + 1) * E);
    for (int e = 0; e < E; ++e) {
      g.mag[t * E + e] = scale;
      if (!values) continue;
      const double h = 1e-5, x = row[e];
      row[e] = x + h;
      double up = loss(row);
      row[e] = x - h;
      double down = loss(row);
      row[e] = x;
      g.want[t * E + e] = (up - down) / (2 * h);
    }
  }
  return g;
}

// ---------------------------------------------------------------- dispatch plan

// Routing ids [T,K]: K distinct experts per token, never one of `unused`; with probability `skew` a
// token's first choice is expert 0.
inline std::vector<int> random_ids(int T, int K, int E, Rng& rng, double skew = 0.0, std::vector<int> unused = {}) {
  std::vector<int> ids;
  for (int t = 0; t < T; ++t) {
    std::vector<int> pool;
    for (int e = 0; e < E; ++e)
      if (std::find(unused.begin(), unused.end(), e) == unused.end()) pool.push_back(e);
    std::shuffle(pool.begin(), pool.end(), rng.g);
    if (rng.uniform(0, 1) < skew) {
      auto it = std::find(pool.begin(), pool.end(), 0);
      if (it != pool.end()) std::iter_swap(pool.begin(), it);
    }
    ids.insert(ids.end(), pool.begin(), pool.begin() + K);
  }
  return ids;
}

struct PlanRef {
  std::vector<int> counts, offsets, row_to_slot, slot_to_row;
};

inline PlanRef plan_ref(const std::vector<int>& ids, int E, int pad, int64_t R) {
  PlanRef r;
  r.counts.assign(E, 0);
  for (int id : ids) r.counts[id]++;
  r.offsets.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) r.offsets[e + 1] = r.offsets[e] + (r.counts[e] + pad - 1) / pad * pad;
  r.row_to_slot.assign(R, -1);
  r.slot_to_row.assign(ids.size(), -1);
  for (int e = 0; e < E; ++e) {
    int row = r.offsets[e];
    for (size_t s = 0; s < ids.size(); ++s)
      if (ids[s] == e) {
        r.row_to_slot[row] = static_cast<int>(s);
        r.slot_to_row[s] = row++;
      }
  }
  return r;
}

// ---------------------------------------------------------------- permute / combine

inline Expect gather_ref(const HostTensor& src, const std::vector<int>& row_to_slot, int K, const HostTensor* scale) {
  int64_t H = src.shape()[1];
  Expect e;
  e.comp_rel = fp32_rel(1);
  for (int slot : row_to_slot)
    for (int64_t h = 0; h < H; ++h) {
      double v = slot < 0 ? 0.0 : (scale ? scale->get(slot) : 1.0) * src.get((slot / K) * H + h);
      e.want.push_back(v);
      e.mag.push_back(std::fabs(v));
    }
  return e;
}

inline Expect combine_ref(const HostTensor& rows, const std::vector<int>& slot_to_row, int K, const HostTensor* w) {
  int64_t H = rows.shape()[1], T = static_cast<int64_t>(slot_to_row.size()) / K;
  Expect e;
  e.comp_rel = fp32_rel(K);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      double s = 0, m = 0;
      for (int k = 0; k < K; ++k) {
        double term = (w ? w->get(t * K + k) : 1.0) * rows.get(slot_to_row[t * K + k] * H + h);
        s += term;
        m += std::fabs(term);
      }
      e.want.push_back(s);
      e.mag.push_back(m);
    }
  return e;
}

inline Expect combine_wgrad_ref(const HostTensor& dy, const HostTensor& rows, const std::vector<int>& slot_to_row) {
  int64_t H = rows.shape()[1];
  Expect e;
  e.comp_rel = fp32_rel(H);
  for (size_t s = 0; s < slot_to_row.size(); ++s) {
    int64_t t = static_cast<int64_t>(s) / (static_cast<int64_t>(slot_to_row.size()) / dy.shape()[0]);
    double acc = 0, m = 0;
    for (int64_t h = 0; h < H; ++h) {
      double term = dy.get(t * H + h) * rows.get(slot_to_row[s] * H + h);
      acc += term;
      m += std::fabs(term);
    }
    e.want.push_back(acc);
    e.mag.push_back(m);
  }
  return e;
}

// ---------------------------------------------------------------- grouped GEMM

// Element (n, kd) of expert e's weight in either layout.
inline double weight_at(const HostTensor& b, WeightLayout layout, int64_t e, int64_t n, int64_t kd) {
  int64_t d1 = b.shape()[1], d2 = b.shape()[2];
  return layout == WeightLayout::kNK ? b.get((e * d1 + n) * d2 + kd) : b.get((e * d1 + kd) * d2 + n);
}

inline int expert_of_row(const std::vector<int>& offsets, int64_t r) {
  for (size_t e = 0; e + 1 < offsets.size(); ++e)
    if (r >= offsets[e] && r < offsets[e + 1]) return static_cast<int>(e);
  return -1;  // past offsets[E]
}

// The inputs of a grouped_lowrank_add case: offsets (rows before offsets[0] and past offsets[E] are in no group),
// h [R, N], t [R, rank], b (either layout).
struct LowrankInputs {
  std::vector<int> offsets;
  HostTensor h, t, b;
};

// Rows in no group are h's values, not h plus a rounded zero sum.
inline ::testing::AssertionResult rows_in_no_group_are_h(const HostTensor& out, const LowrankInputs& in) {
  const int64_t R = in.h.shape()[0], N = in.h.shape()[1];
  for (int64_t r = 0; r < R; ++r) {
    if (expert_of_row(in.offsets, r) >= 0) continue;
    for (int64_t n = 0; n < N; ++n)
      if (out.get(r * N + n) != in.h.get(r * N + n))
        return ::testing::AssertionFailure() << "row " << r << " (in no group), column " << n << ": "
                                             << out.get(r * N + n) << " != h " << in.h.get(r * N + n);
  }
  return ::testing::AssertionSuccess();
}

inline Expect gemm_ref(const HostTensor& a, const HostTensor& b, const std::vector<int>& offsets, WeightLayout layout,
                       const HostTensor* bias) {
  int64_t R = a.shape()[0], Kd = a.shape()[1];
  int64_t N = layout == WeightLayout::kNK ? b.shape()[1] : b.shape()[2];
  Expect c;
  c.comp_rel = fp32_rel(Kd + 1);
  std::vector<double> av = a.values(), bv = b.values();
  for (int64_t r = 0; r < R; ++r) {
    int e = expert_of_row(offsets, r);
    for (int64_t n = 0; n < N; ++n) {
      double s = 0, m = 0;
      if (e >= 0) {
        for (int64_t kd = 0; kd < Kd; ++kd) {
          int64_t bi = layout == WeightLayout::kNK ? (e * N + n) * Kd + kd : (e * Kd + kd) * N + n;
          double term = av[r * Kd + kd] * bv[bi];
          s += term;
          m += std::fabs(term);
        }
        if (bias) {
          s += bias->get(e * N + n);
          m += std::fabs(bias->get(e * N + n));
        }
      }
      c.want.push_back(s);
      c.mag.push_back(m);
    }
  }
  return c;
}

// out[r] = h[r] + t[r] · op(b[e]) for the rows of group e, h[r] for rows in no group (before offsets[0] or at and
// after offsets[E]); mag: |h| plus the sum of |terms|, what the fp32 sum's error scales with.
inline Expect lowrank_ref(const HostTensor& h, const HostTensor& t, const HostTensor& b,
                          const std::vector<int>& offsets, WeightLayout layout) {
  const int64_t R = h.shape()[0], N = h.shape()[1], rank = t.shape()[1];
  Expect o;
  o.comp_rel = fp32_rel(rank + 1);
  const std::vector<double> hv = h.values(), tv = t.values(), bv = b.values();
  o.want.reserve(hv.size());
  o.mag.reserve(hv.size());
  for (int64_t r = 0; r < R; ++r) {
    const int e = expert_of_row(offsets, r);
    for (int64_t n = 0; n < N; ++n) {
      double s = hv[r * N + n], m = std::fabs(s);
      for (int64_t k = 0; e >= 0 && k < rank; ++k) {
        const int64_t bi = layout == WeightLayout::kNK ? (e * N + n) * rank + k : (e * rank + k) * N + n;
        const double term = tv[r * rank + k] * bv[bi];
        s += term;
        m += std::fabs(term);
      }
      o.want.push_back(s);
      o.mag.push_back(m);
    }
  }
  return o;
}

struct WgradRef {
  Expect db, dbias;
};

inline WgradRef wgrad_ref(const HostTensor& a, const HostTensor& dc, const std::vector<int>& offsets,
                          WeightLayout layout) {
  int64_t Kd = a.shape()[1], N = dc.shape()[1], E = static_cast<int64_t>(offsets.size()) - 1;
  std::vector<double> av = a.values(), dv = dc.values();
  WgradRef w;
  int64_t longest = 1;
  for (int64_t e = 0; e < E; ++e) longest = std::max<int64_t>(longest, offsets[e + 1] - offsets[e]);
  w.db.comp_rel = w.dbias.comp_rel = fp32_rel(longest);
  w.db.want.assign(E * N * Kd, 0.0);
  w.db.mag.assign(E * N * Kd, 0.0);
  w.dbias.want.assign(E * N, 0.0);
  w.dbias.mag.assign(E * N, 0.0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r)
      for (int64_t n = 0; n < N; ++n) {
        double g = dv[r * N + n];
        w.dbias.want[e * N + n] += g;
        w.dbias.mag[e * N + n] += std::fabs(g);
        for (int64_t kd = 0; kd < Kd; ++kd) {
          int64_t i = layout == WeightLayout::kNK ? (e * N + n) * Kd + kd : (e * Kd + kd) * N + n;
          w.db.want[i] += g * av[r * Kd + kd];
          w.db.mag[i] += std::fabs(g * av[r * Kd + kd]);
        }
      }
  return w;
}

// Offsets [E+1] from group sizes, each padded up to `pad`.
inline std::vector<int> offsets_from_sizes(const std::vector<int>& sizes, int pad = 1) {
  std::vector<int> off(1, 0);
  for (int s : sizes) off.push_back(off.back() + (s + pad - 1) / pad * pad);
  return off;
}

// ---------------------------------------------------------------- activations

inline int64_t act_width(const HostTensor& h, const ActParams& p) {
  return is_gated(p.kind) ? h.shape()[1] / 2 : h.shape()[1];
}
inline int64_t gate_index(const ActParams& p, int64_t r, int64_t i, int64_t I) {
  return is_gated(p.kind) ? r * 2 * I + (p.interleaved ? 2 * i : i) : r * I + i;
}
inline int64_t up_index(const ActParams& p, int64_t r, int64_t i, int64_t I) {
  return r * 2 * I + (p.interleaved ? 2 * i + 1 : I + i);
}

inline double gelu(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }
inline double gelu_grad(double x) {
  return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) + x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI);
}

inline Expect act_ref(const HostTensor& h, const ActParams& p) {
  int64_t R = h.shape()[0], I = act_width(h, p);
  Expect o;
  o.comp_rel = fp32_rel(24);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < I; ++i) {
      double x = h.get(gate_index(p, r, i, I)), v, m;
      if (p.kind == ActKind::kSiLU) {
        v = silu(x), m = std::fabs(x);
      } else if (p.kind == ActKind::kGELU) {
        v = gelu(x), m = std::fabs(x);
      } else {
        double u = h.get(up_index(p, r, i, I));
        if (p.kind == ActKind::kSwiGLU) {
          v = silu(x) * u, m = std::fabs(x * u);
        } else {
          double g = std::min(x, static_cast<double>(p.limit));
          double uc = std::clamp(u, -static_cast<double>(p.limit), static_cast<double>(p.limit));
          v = (uc + 1.0) * g * sigmoid(p.alpha * g), m = (std::fabs(uc) + 1.0) * std::fabs(g);
        }
      }
      o.want.push_back(v);
      o.mag.push_back(m);
    }
  return o;
}

inline Expect act_grad_ref(const HostTensor& h, const HostTensor& dout, const ActParams& p) {
  int64_t R = h.shape()[0], I = act_width(h, p);
  Expect d;
  d.comp_rel = fp32_rel(24);
  d.want.assign(h.numel(), 0.0);
  d.mag.assign(h.numel(), 0.0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < I; ++i) {
      double dy = dout.get(r * I + i), x = h.get(gate_index(p, r, i, I));
      int64_t gi = gate_index(p, r, i, I);
      if (p.kind == ActKind::kSiLU || p.kind == ActKind::kGELU) {
        d.want[gi] = dy * (p.kind == ActKind::kSiLU ? silu_grad(x) : gelu_grad(x));
        d.mag[gi] = std::fabs(dy) * (1.0 + std::fabs(x));
        continue;
      }
      int64_t ui = up_index(p, r, i, I);
      double u = h.get(ui);
      if (p.kind == ActKind::kSwiGLU) {
        d.want[gi] = dy * u * silu_grad(x);
        d.mag[gi] = std::fabs(dy * u) * (1.0 + std::fabs(x));
        d.want[ui] = dy * silu(x);
        d.mag[ui] = std::fabs(dy * x);
      } else {
        double lim = p.limit, g = std::min(x, lim), uc = std::clamp(u, -lim, lim), sg = sigmoid(p.alpha * g);
        d.want[gi] = x < lim ? dy * (uc + 1.0) * (sg + p.alpha * g * sg * (1.0 - sg)) : 0.0;
        d.mag[gi] = std::fabs(dy) * (std::fabs(uc) + 1.0) * (1.0 + p.alpha * std::fabs(g));
        d.want[ui] = std::fabs(u) < lim ? dy * g * sg : 0.0;
        d.mag[ui] = std::fabs(dy * g);
      }
    }
  return d;
}

// Pre-activations in [-range, range], never exactly at +-limit (where the clamp has no derivative).
inline HostTensor act_input(DType dtype, const Shape& s, const ActParams& p, Rng& rng, double range = 9.0) {
  HostTensor h(dtype, s);
  for (int64_t i = 0; i < h.numel(); ++i) {
    do h.set(i, rng.uniform(-range, range));
    while (std::fabs(std::fabs(h.get(i)) - p.limit) < 1e-3);
  }
  return h;
}

// Inputs of activation_backward_routed: h, dout [R, I], rows mapped to a shuffle of `slots` slots (the rows
// beyond them, padding, to -1), routing weights [slots] f32.
struct RoutedInputs {
  HostTensor h, dout, weights, row_to_slot;
};

inline RoutedInputs routed_inputs(DType dtype, const ActParams& p, int64_t R, int64_t I, int64_t slots, Rng& rng) {
  RoutedInputs in{act_input(dtype, {R, is_gated(p.kind) ? 2 * I : I}, p, rng), random_tensor(dtype, {R, I}, rng, -2, 2),
                  random_tensor(DType::kF32, {slots}, rng, 0.05, 1.0), HostTensor(DType::kI32, {R})};
  std::vector<int> order(static_cast<size_t>(R), -1);
  for (int64_t s = 0; s < std::min(R, slots); ++s) order[static_cast<size_t>(s)] = static_cast<int>(s);
  std::shuffle(order.begin(), order.end(), rng.g);
  for (int64_t r = 0; r < R; ++r) in.row_to_slot.i32()[r] = order[static_cast<size_t>(r)];
  return in;
}

// float64 expectations of activation_backward_routed: d h = act'(h) (w dout), a_w = w act(h), and
// d_weights[slot] = <act(h), dout> (slots no row maps to: want 0, never compared for being unwritten).
struct RoutedExpect {
  Expect dh, a_w, d_weights;
};

inline RoutedExpect routed_ref(const RoutedInputs& in, const ActParams& p) {
  const int64_t R = in.dout.shape()[0], I = in.dout.shape()[1];
  HostTensor dout_w(DType::kF32, {R, I});
  std::vector<double> w(static_cast<size_t>(R), 0.0);
  for (int64_t r = 0; r < R; ++r) {
    const int slot = in.row_to_slot.i32()[r];
    w[static_cast<size_t>(r)] = slot >= 0 ? in.weights.get(slot) : 0.0;
    for (int64_t i = 0; i < I; ++i)
      dout_w.set(r * I + i, static_cast<float>(w[static_cast<size_t>(r)]) * static_cast<float>(in.dout.get(r * I + i)));
  }
  RoutedExpect e{act_grad_ref(in.h, dout_w, p), act_ref(in.h, p), {}};
  e.d_weights.want.assign(static_cast<size_t>(in.weights.numel()), 0.0);
  e.d_weights.mag.assign(static_cast<size_t>(in.weights.numel()), 0.0);
  e.d_weights.comp_rel = fp32_rel(I + 24);
  for (int64_t r = 0; r < R; ++r) {
    const int slot = in.row_to_slot.i32()[r];
    for (int64_t i = 0; i < I; ++i) {
      const size_t k = static_cast<size_t>(r * I + i);
      const double d = in.dout.get(r * I + i);
      if (slot >= 0) {
        e.d_weights.want[static_cast<size_t>(slot)] += e.a_w.want[k] * d;
        e.d_weights.mag[static_cast<size_t>(slot)] += (std::fabs(e.a_w.want[k]) + e.a_w.mag[k]) * std::fabs(d);
      }
      e.a_w.want[k] *= w[static_cast<size_t>(r)];
      e.a_w.mag[k] *= w[static_cast<size_t>(r)];
    }
  }
  return e;
}

}  // namespace moe8::test
