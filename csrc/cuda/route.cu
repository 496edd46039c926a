// route.cu — router kernels: logits [T,E] -> top-k expert ids and weights, aux-loss statistics, and the
// backward to the logits.
//
// Design. One warp per token; lane l holds experts l, l+32, ... (kVPT values, E <= 32 * kVPT) in registers,
// so row loads are coalesced and every reduction over experts is a warp shuffle. Top-k is k rounds of a
// warp argmax on order-preserving integer images of the floats (__reduce_max_sync, then __reduce_min_sync
// of the expert among the lanes holding the max): ties go to the lower expert and every lane agrees on the
// winner. Lane r keeps the r-th choice; sums over the k choices run in slot order (sequential shuffles),
// as the CPU reference sums them. The sigmoid scheme's group scores go through a per-warp shared-memory
// copy of the row, one lane per group.
//
// Statistics without float atomics and without workspace, in three launches:
//   1. route_stats: each block routes a fixed chunk of tokens and sums q[t,e] and the expert counts over
//      it in a fixed order; the per-chunk partials go to the ids/weights outputs, not yet written.
//   2. route_stats_reduce: sums the partials in chunk order into prob_mean and token_frac.
//   3. route_topk: routes every token again and writes ids, weights and lse over the partials.
// With one chunk (few tokens), route_stats writes the statistics itself and step 2 is skipped.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace moe8::cuda {
namespace {

// NOTES: the per-token kernels declare __launch_bounds__(kThreads, 1): under the default heuristic ptxas
// caps them near 48-128 registers and spills the kVPT = 8 and 16 instances.
constexpr int kWarps = 4;  // tokens in flight per block; 4 keeps the sigmoid scheme's smem under 48 KiB
constexpr int kThreads = kWarps * 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kTokensPerChunk = 32;  // statistics chunk target: 8 tokens per warp
constexpr int kMaxVPT = 16;          // experts per lane: E <= 512

__device__ __forceinline__ float warp_sum(float v) {
  // Butterfly: every lane ends with the bitwise-same sum (addition is commutative at each step).
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// Sum of v over lanes 0..n-1 in lane order, on every lane.
__device__ __forceinline__ float lanes_sum(float v, int n) {
  float s = 0.f;
  for (int j = 0; j < n; ++j) s += __shfl_sync(kFull, v, j);
  return s;
}

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }

// Order-preserving 32-bit image of a float: larger value, larger key; -0 and +0 share one key, as they
// compare equal. 0 is the key of no ordinary float (only of the negative NaN with every payload bit set),
// so it marks "not a candidate".
__device__ __forceinline__ uint32_t order_key(float v) {
  uint32_t u = __float_as_uint(v);
  if ((u << 1) == 0u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// v[e >> 5] on the lane that holds expert e, on every lane; e must be the same on all lanes.
template <int kVPT>
__device__ __forceinline__ float warp_gather(const float (&v)[kVPT], int e) {
  const int j = e >> 5;
  float local = 0.f;
#pragma unroll
  for (int i = 0; i < kVPT; ++i)
    if (i == j) local = v[i];
  return __shfl_sync(kFull, local, e & 31);
}

// Adds x to v at expert e (if this lane holds it); e must be the same on all lanes.
template <int kVPT>
__device__ __forceinline__ void lane_scatter_add(float (&v)[kVPT], int e, float x, int lane) {
#pragma unroll
  for (int j = 0; j < kVPT; ++j)
    if (lane + 32 * j == e) v[j] += x;
}

template <typename T, int kVPT>
__device__ __forceinline__ void load_row(const T* __restrict__ row, int E, int lane, float (&l)[kVPT]) {
#pragma unroll
  for (int j = 0; j < kVPT; ++j) {
    const int e = lane + 32 * j;
    l[j] = e < E ? to_float(row[e]) : -INFINITY;
  }
}

// Softmax max and denominator over the E valid logits, on every lane; ex[j] = exp(l[j] - m) (0 past E).
template <int kVPT>
__device__ __forceinline__ void softmax_stats(const float (&l)[kVPT], int E, int lane, float& m, float& sum,
                                              float (&ex)[kVPT]) {
  float mm = -INFINITY;
#pragma unroll
  for (int j = 0; j < kVPT; ++j)
    if (lane + 32 * j < E) mm = fmaxf(mm, l[j]);
  m = warp_max(mm);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < kVPT; ++j) {
    ex[j] = lane + 32 * j < E ? expf(l[j] - m) : 0.f;
    s += ex[j];
  }
  sum = warp_sum(s);
}

__host__ __device__ inline bool grouped(const RouteParams& p) {
  return p.scheme == RouteScheme::kSigmoidGroupTopK && p.n_group > 1 && p.topk_group < p.n_group;
}

// Bits set for the experts (of this lane) outside the topk_group best groups. ws: this warp's
// E + 2 * n_group floats of shared memory. Group g's experts sit at ws[g * (gs + 1) ...] (one float of
// skew per group so that lanes scanning different groups hit different banks); group scores follow.
template <int kVPT>
__device__ __forceinline__ uint32_t excluded_groups(const float (&c)[kVPT], const RouteParams& p, int E, int lane,
                                                    float* ws) {
  const int ng = p.n_group, gs = E / ng;
  float* score = ws + E + ng;
#pragma unroll
  for (int j = 0; j < kVPT; ++j) {
    const int e = lane + 32 * j;
    if (e < E && e / gs < ng) ws[e + e / gs] = c[j];
  }
  __syncwarp();
  for (int g = lane; g < ng; g += 32) {
    const float* x = ws + g * (gs + 1);
    float a = -INFINITY, b = -INFINITY;  // the two largest
    for (int i = 0; i < gs; ++i) {
      const float v = x[i];
      if (v > a) {
        b = a;
        a = v;
      } else if (v > b) {
        b = v;
      }
    }
    score[g] = gs == 1 ? a : a + b;
  }
  __syncwarp();
  bool keep[kVPT];  // groups lane + 32 * i (n_group <= E <= 32 * kVPT)
#pragma unroll
  for (int i = 0; i < kVPT; ++i) {
    const int g = lane + 32 * i;
    keep[i] = false;
    if (g < ng) {
      const float sg = score[g];
      int rank = 0;  // groups ahead of g: larger score, or equal score and lower index
      for (int h = 0; h < ng; ++h) {
        const float sh = score[h];
        rank += (sh > sg || (sh == sg && h < g)) ? 1 : 0;
      }
      keep[i] = rank < p.topk_group;
    }
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < kVPT; ++i) {
    const int g = lane + 32 * i;
    if (g < ng) score[g] = keep[i] ? 1.f : 0.f;
  }
  __syncwarp();
  uint32_t excluded = 0;
#pragma unroll
  for (int j = 0; j < kVPT; ++j) {
    const int e = lane + 32 * j;
    if (e < E && (e / gs >= ng || score[e / gs] == 0.f)) excluded |= 1u << j;
  }
  __syncwarp();  // ws is reused by the next token of this warp
  return excluded;
}

// The k largest keys of the row, descending, ties to the lower expert: k rounds of a warp argmax over
// order keys (a max of keys, then a min of expert among the lanes that hold it). On lane r < k: the r-th
// choice and the val carried with it; -1 and 0 where nothing eligible is left.
template <int kVPT>
__device__ __forceinline__ void warp_topk(const float (&key)[kVPT], const float (&val)[kVPT], uint32_t excluded, int E,
                                          int k, int lane, int& my_id, float& my_val) {
  uint32_t ok[kVPT];
#pragma unroll
  for (int j = 0; j < kVPT; ++j) ok[j] = (lane + 32 * j < E && !((excluded >> j) & 1u)) ? order_key(key[j]) : 0u;
  my_id = -1;
  my_val = 0.f;
  for (int r = 0; r < k; ++r) {
    uint32_t bk = 0u;  // this lane's best: strict > keeps the lower j, i.e. the lower expert
    int bj = 0;
    float bv = 0.f;
#pragma unroll
    for (int j = 0; j < kVPT; ++j) {
      if (ok[j] > bk) {
        bk = ok[j];
        bj = j;
        bv = val[j];
      }
    }
    const uint32_t top = __reduce_max_sync(kFull, bk);
    if (top == 0u) break;  // the same on every lane
    const int e = __reduce_min_sync(kFull, bk == top ? lane + 32 * bj : 0x7fffffff);
    const float v = __shfl_sync(kFull, bv, e & 31);
    if (lane == (e & 31)) {
#pragma unroll
      for (int j = 0; j < kVPT; ++j)
        if (j == bj) ok[j] = 0u;
    }
    if (lane == r) {
      my_id = e;
      my_val = v;
    }
  }
}

// Chooses the experts of one token. Softmax schemes select on the logits (softmax is monotone: the same
// experts as selecting on p) and carry l; the sigmoid scheme selects on s + bias within the best groups and
// carries s, which it also leaves in s[] for the statistics.
template <int kVPT>
__device__ __forceinline__ void choose_experts(const float (&l)[kVPT], const float* __restrict__ bias,
                                               const RouteParams& p, int E, int lane, float* ws, float (&s)[kVPT],
                                               int& my_id, float& my_val) {
  if (p.scheme != RouteScheme::kSigmoidGroupTopK) {
    warp_topk(l, l, 0u, E, p.k, lane, my_id, my_val);
    return;
  }
  float c[kVPT];
#pragma unroll
  for (int j = 0; j < kVPT; ++j) {
    const int e = lane + 32 * j;
    s[j] = e < E ? sigmoidf(l[j]) : 0.f;
    c[j] = s[j] + ((bias != nullptr && e < E) ? bias[e] : 0.f);
  }
  const uint32_t excluded = grouped(p) ? excluded_groups(c, p, E, lane, ws) : 0u;
  warp_topk(c, s, excluded, E, p.k, lane, my_id, my_val);
}

// Per-chunk partials live in weights (T*K floats) then ids (T*K ints), as raw 32-bit words.
struct Scratch {
  float* a;
  int32_t* b;
  int64_t na;
  __device__ __forceinline__ void put(int64_t i, uint32_t bits) const {
    if (i < na)
      a[i] = __uint_as_float(bits);
    else
      b[i - na] = static_cast<int32_t>(bits);
  }
  __device__ __forceinline__ uint32_t get(int64_t i) const {
    return i < na ? __float_as_uint(a[i]) : static_cast<uint32_t>(b[i - na]);
  }
};

inline size_t route_smem_bytes(const RouteParams& p, int E, bool stats) {
  size_t floats = grouped(p) ? static_cast<size_t>(kWarps) * (E + 2 * p.n_group) : 0;
  if (stats) floats += static_cast<size_t>(E) + static_cast<size_t>(kWarps) * E;  // counts, q per warp
  return floats * 4;
}

// One block per chunk of `chunk` tokens: partial sums of q[t,e] and counts of e over the chunk.
template <typename T, int kVPT>
__global__ void __launch_bounds__(kThreads, 1)
    route_stats_kernel(const T* __restrict__ logits, const float* __restrict__ bias, RouteParams p, int num_tokens,
                       int E, int chunk, Scratch scratch, int nchunks, float* __restrict__ prob_mean,
                       float* __restrict__ token_frac) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* ws = smem + (grouped(p) ? static_cast<size_t>(warp) * (E + 2 * p.n_group) : 0);
  int* hist = reinterpret_cast<int*>(smem + (grouped(p) ? static_cast<size_t>(kWarps) * (E + 2 * p.n_group) : 0));
  float* qsum = reinterpret_cast<float*>(hist + E);  // [kWarps][E]
  for (int e = threadIdx.x; e < E; e += kThreads) hist[e] = 0;
  __syncthreads();

  float acc[kVPT];
#pragma unroll
  for (int j = 0; j < kVPT; ++j) acc[j] = 0.f;
  const int t_begin = static_cast<int>(blockIdx.x) * chunk, t_end = min(num_tokens, t_begin + chunk);
  for (int t = t_begin + warp; t < t_end; t += kWarps) {
    float l[kVPT], ex[kVPT], s[kVPT], m, sum, my_val;
    int my_id;
    load_row(logits + static_cast<int64_t>(t) * E, E, lane, l);
    softmax_stats(l, E, lane, m, sum, ex);
    choose_experts(l, bias, p, E, lane, ws, s, my_id, my_val);
    if (lane < p.k && my_id >= 0) atomicAdd(&hist[my_id], 1);  // integer: order-independent
    if (p.scheme == RouteScheme::kSigmoidGroupTopK) {
      float ss = 0.f;
#pragma unroll
      for (int j = 0; j < kVPT; ++j) ss += s[j];
      const float inv = 1.f / warp_sum(ss);
#pragma unroll
      for (int j = 0; j < kVPT; ++j) acc[j] += s[j] * inv;
    } else {
      const float inv = 1.f / sum;
#pragma unroll
      for (int j = 0; j < kVPT; ++j) acc[j] += ex[j] * inv;
    }
  }
#pragma unroll
  for (int j = 0; j < kVPT; ++j) {
    const int e = lane + 32 * j;
    if (e < E) qsum[warp * E + e] = acc[j];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kThreads) {
    float q = 0.f;
    for (int w = 0; w < kWarps; ++w) q += qsum[w * E + e];  // warps in a fixed order
    if (nchunks == 1) {                                     // the same arithmetic as route_stats_reduce_kernel
      prob_mean[e] = static_cast<float>(static_cast<double>(q) / num_tokens);
      token_frac[e] = static_cast<float>(static_cast<double>(hist[e]) / (static_cast<double>(num_tokens) * p.k));
    } else {
      const int64_t base = static_cast<int64_t>(blockIdx.x) * E + e;
      scratch.put(base, __float_as_uint(q));
      scratch.put(static_cast<int64_t>(nchunks) * E + base, static_cast<uint32_t>(hist[e]));
    }
  }
}

// Block of 32 experts x 32 warps; warp w sums chunks w, w+32, ...; then the 32 warp sums in order.
__global__ void __launch_bounds__(1024)
    route_stats_reduce_kernel(Scratch scratch, int nchunks, int E, int num_tokens, int k, float* __restrict__ prob_mean,
                              float* __restrict__ token_frac) {
  __shared__ double sq[32][33];
  __shared__ int sc[32][33];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, e = blockIdx.x * 32 + lane;
  double q = 0.0;  // double: the chunk partials are fp32, their sum need not lose more
  int c = 0;
  if (e < E) {
    for (int b = warp; b < nchunks; b += 32) {
      const int64_t i = static_cast<int64_t>(b) * E + e;
      q += static_cast<double>(__uint_as_float(scratch.get(i)));
      c += static_cast<int>(scratch.get(static_cast<int64_t>(nchunks) * E + i));
    }
  }
  sq[warp][lane] = q;
  sc[warp][lane] = c;
  __syncthreads();
  if (warp == 0 && e < E) {
    double tq = 0.0;
    int tc = 0;
    for (int w = 0; w < 32; ++w) {
      tq += sq[w][lane];
      tc += sc[w][lane];
    }
    prob_mean[e] = static_cast<float>(tq / num_tokens);
    token_frac[e] = static_cast<float>(static_cast<double>(tc) / (static_cast<double>(num_tokens) * k));
  }
}

// One warp per token: ids, weights, lse.
template <typename T, int kVPT>
__global__ void __launch_bounds__(kThreads, 1)
    route_topk_kernel(const T* __restrict__ logits, const float* __restrict__ bias, RouteParams p, int num_tokens,
                      int E, int32_t* __restrict__ ids, float* __restrict__ weights, float* __restrict__ lse) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = blockIdx.x * kWarps + warp;
  if (t >= num_tokens) return;  // whole warp leaves together
  float* ws = smem + (grouped(p) ? static_cast<size_t>(warp) * (E + 2 * p.n_group) : 0);
  float l[kVPT], ex[kVPT], s[kVPT], m, sum, my_val;
  int my_id;
  load_row(logits + static_cast<int64_t>(t) * E, E, lane, l);
  softmax_stats(l, E, lane, m, sum, ex);
  choose_experts(l, bias, p, E, lane, ws, s, my_id, my_val);

  const int K = p.k;
  float w;
  if (p.scheme == RouteScheme::kSoftmaxTopK) {
    const float prob = lane < K ? expf(my_val - m) / sum : 0.f;  // my_val: the chosen logit
    w = p.renormalize ? prob / lanes_sum(prob, K) : prob;
  } else if (p.scheme == RouteScheme::kSigmoidGroupTopK) {
    w = my_val;
    if (p.renormalize) w = my_val / (lanes_sum(my_val, K) + 1e-20f);
    w *= p.scaling;
  } else {
    const float top = __shfl_sync(kFull, my_val, 0);  // the first choice is the largest logit
    const float ex = lane < K ? expf(my_val - top) : 0.f;
    w = ex / lanes_sum(ex, K);
  }
  if (lane < K) {
    ids[static_cast<int64_t>(t) * K + lane] = my_id;
    weights[static_cast<int64_t>(t) * K + lane] = my_id >= 0 ? w : 0.f;
  }
  if (lane == 0) lse[t] = m + logf(sum);
}

template <typename T, int kVPT>
__global__ void __launch_bounds__(kThreads, 1)
    route_backward_kernel(const T* __restrict__ logits, RouteParams p, int num_tokens, int E,
                          const int32_t* __restrict__ ids, const float* __restrict__ grad_weights,
                          const float* __restrict__ grad_prob_mean, const float* __restrict__ grad_lse,
                          T* __restrict__ grad_logits) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = blockIdx.x * kWarps + warp;
  if (t >= num_tokens) return;
  const int K = p.k;
  float l[kVPT], prob[kVPT], dl[kVPT], m, sum;
  load_row(logits + static_cast<int64_t>(t) * E, E, lane, l);
  softmax_stats(l, E, lane, m, sum, prob);
#pragma unroll
  for (int j = 0; j < kVPT; ++j) {
    prob[j] = prob[j] / sum;
    dl[j] = 0.f;
  }
  // clamped into [0, E): ids the API did not check (check_indices false) never index past a token's E scores
  const int my_id = lane < K ? min(max(ids[static_cast<int64_t>(t) * K + lane], 0), E - 1) : 0;
  const float g = lane < K ? grad_weights[static_cast<int64_t>(t) * K + lane] : 0.f;
  // dp[e] = grad_prob_mean[e] / T: the statistics' upstream gradient.
  float dp[kVPT];
#pragma unroll
  for (int j = 0; j < kVPT; ++j) {
    const int e = lane + 32 * j;
    dp[j] = (grad_prob_mean != nullptr && e < E) ? grad_prob_mean[e] / static_cast<float>(num_tokens) : 0.f;
  }

  if (p.scheme == RouteScheme::kSoftmaxTopK) {
    float q = 0.f;
    for (int k = 0; k < K; ++k) {
      const float v = warp_gather(prob, __shfl_sync(kFull, my_id, k));
      if (lane == k) q = v;
    }
    float dq = g;
    if (p.renormalize) {
      const float S = lanes_sum(q, K), G = lanes_sum(g * q, K);
      dq = (g - G / S) / S;
    }
    for (int k = 0; k < K; ++k) lane_scatter_add(dp, __shfl_sync(kFull, my_id, k), __shfl_sync(kFull, dq, k), lane);
    float d = 0.f;
#pragma unroll
    for (int j = 0; j < kVPT; ++j) d += prob[j] * dp[j];
    const float dot = warp_sum(d);
#pragma unroll
    for (int j = 0; j < kVPT; ++j) dl[j] = prob[j] * (dp[j] - dot);
  } else if (p.scheme == RouteScheme::kSigmoidGroupTopK) {
    float s[kVPT], ssum_l = 0.f;
#pragma unroll
    for (int j = 0; j < kVPT; ++j) {
      s[j] = lane + 32 * j < E ? sigmoidf(l[j]) : 0.f;
      ssum_l += s[j];
    }
    float q = 0.f;
    for (int k = 0; k < K; ++k) {
      const float v = warp_gather(s, __shfl_sync(kFull, my_id, k));
      if (lane == k) q = v;
    }
    float dq = p.scaling * g;
    if (p.renormalize) {
      const float D = lanes_sum(q, K) + 1e-20f, G = lanes_sum(g * q, K);
      dq = p.scaling * (g - G / D) / D;
    }
    float ds[kVPT];
#pragma unroll
    for (int j = 0; j < kVPT; ++j) ds[j] = 0.f;
    if (grad_prob_mean != nullptr) {  // q = s / Ssum
      const float ssum = warp_sum(ssum_l);
      float a = 0.f;
#pragma unroll
      for (int j = 0; j < kVPT; ++j) a += dp[j] * s[j];
      const float A = warp_sum(a);
#pragma unroll
      for (int j = 0; j < kVPT; ++j) ds[j] = (dp[j] - A / ssum) / ssum;
    }
    for (int k = 0; k < K; ++k) lane_scatter_add(ds, __shfl_sync(kFull, my_id, k), __shfl_sync(kFull, dq, k), lane);
#pragma unroll
    for (int j = 0; j < kVPT; ++j) dl[j] = ds[j] * s[j] * (1.f - s[j]);
  } else {
    float lk = 0.f;
    for (int k = 0; k < K; ++k) {
      const float v = warp_gather(l, __shfl_sync(kFull, my_id, k));
      if (lane == k) lk = v;
    }
    float top = -INFINITY;
    for (int k = 0; k < K; ++k) top = fmaxf(top, __shfl_sync(kFull, lk, k));
    const float ex = lane < K ? expf(lk - top) : 0.f;
    const float w = ex / lanes_sum(ex, K);
    const float gw = lanes_sum(g * w, K);
    const float dlk = w * (g - gw);
    for (int k = 0; k < K; ++k) lane_scatter_add(dl, __shfl_sync(kFull, my_id, k), __shfl_sync(kFull, dlk, k), lane);
    if (grad_prob_mean != nullptr) {
      float d = 0.f;
#pragma unroll
      for (int j = 0; j < kVPT; ++j) d += prob[j] * dp[j];
      const float dot = warp_sum(d);
#pragma unroll
      for (int j = 0; j < kVPT; ++j) dl[j] += prob[j] * (dp[j] - dot);
    }
  }
  if (grad_lse != nullptr) {
    const float gl = grad_lse[t];
#pragma unroll
    for (int j = 0; j < kVPT; ++j) dl[j] += gl * prob[j];
  }
  T* out = grad_logits + static_cast<int64_t>(t) * E;
#pragma unroll
  for (int j = 0; j < kVPT; ++j) {
    const int e = lane + 32 * j;
    if (e < E) out[e] = from_float<T>(dl[j]);
  }
}

// What the kernels assume beyond the API's checks: a warp holds a row (E <= 512) and the k choices (one
// per lane).
void check_limits(const RouteParams& p, int64_t E, const char* op) {
  MOE8_CHECK(E >= 1 && E <= 32 * kMaxVPT, op, ": at most ", 32 * kMaxVPT, " experts on CUDA, got ", E);
  MOE8_CHECK(p.k >= 1 && p.k <= 32, op, ": k must be in [1, 32] on CUDA, got ", p.k);
  if (grouped(p)) MOE8_CHECK(E % p.n_group == 0, op, ": n_group (", p.n_group, ") must divide E (", E, ")");
}

// Calls f.template operator()<kVPT>() with the smallest kVPT such that E <= 32 * kVPT (E <= 512).
template <typename F>
void dispatch_vpt(int E, F&& f) {
  if (E <= 32)
    f.template operator()<1>();
  else if (E <= 64)
    f.template operator()<2>();
  else if (E <= 128)
    f.template operator()<4>();
  else if (E <= 256)
    f.template operator()<8>();
  else
    f.template operator()<kMaxVPT>();
}

template <typename T>
struct RouteForward {
  const TensorView &logits, &bias, &ids, &weights, &prob_mean, &token_frac, &lse;
  const RouteParams& p;
  cudaStream_t s;

  template <int kVPT>
  void operator()() const {
    const int num_tokens = static_cast<int>(logits.shape[0]), E = static_cast<int>(logits.shape[1]);
    const T* x = logits.ptr<T>();
    const float* b = bias.present ? bias.ptr<float>() : nullptr;
    // Chunks for the statistics: about kTokensPerChunk tokens each, and no more partials (2 words per
    // expert per chunk) than the ids and weights outputs hold (2 * T * K words).
    const int64_t cap = static_cast<int64_t>(num_tokens) * p.k / E;
    int64_t nchunks = std::max<int64_t>(1, std::min<int64_t>(ceil_div(num_tokens, kTokensPerChunk), cap));
    const int64_t chunk = ceil_div(num_tokens, nchunks);
    nchunks = ceil_div(num_tokens, chunk);
    const Scratch scratch{weights.ptr<float>(), ids.ptr<int32_t>(), static_cast<int64_t>(num_tokens) * p.k};

    const size_t stats_smem = route_smem_bytes(p, E, true);
    route_stats_kernel<T, kVPT><<<static_cast<unsigned>(nchunks), kThreads, stats_smem, s>>>(
        x, b, p, num_tokens, E, static_cast<int>(chunk), scratch, static_cast<int>(nchunks), prob_mean.ptr<float>(),
        token_frac.ptr<float>());
    check_launch("route_forward: route_stats_kernel");
    if (nchunks > 1) {
      route_stats_reduce_kernel<<<static_cast<unsigned>(ceil_div(E, 32)), 1024, 0, s>>>(
          scratch, static_cast<int>(nchunks), E, num_tokens, p.k, prob_mean.ptr<float>(), token_frac.ptr<float>());
      check_launch("route_forward: route_stats_reduce_kernel");
    }
    route_topk_kernel<T, kVPT>
        <<<static_cast<unsigned>(ceil_div(num_tokens, kWarps)), kThreads, route_smem_bytes(p, E, false), s>>>(
            x, b, p, num_tokens, E, ids.ptr<int32_t>(), weights.ptr<float>(), lse.ptr<float>());
    check_launch("route_forward: route_topk_kernel");
  }
};

template <typename T>
struct RouteBackward {
  const TensorView &logits, &ids, &grad_weights, &grad_prob_mean, &grad_lse, &grad_logits;
  const RouteParams& p;
  cudaStream_t s;

  template <int kVPT>
  void operator()() const {
    const int num_tokens = static_cast<int>(logits.shape[0]), E = static_cast<int>(logits.shape[1]);
    route_backward_kernel<T, kVPT><<<static_cast<unsigned>(ceil_div(num_tokens, kWarps)), kThreads, 0, s>>>(
        logits.ptr<T>(), p, num_tokens, E, ids.ptr<int32_t>(), grad_weights.ptr<float>(),
        grad_prob_mean.present ? grad_prob_mean.ptr<float>() : nullptr,
        grad_lse.present ? grad_lse.ptr<float>() : nullptr, grad_logits.ptr<T>());
    check_launch("route_backward_kernel");
  }
};

}  // namespace

void route_forward(const TensorView& logits, const TensorView& bias, const RouteParams& p, const TensorView& ids,
                   const TensorView& weights, const TensorView& prob_mean, const TensorView& token_frac,
                   const TensorView& lse, void* stream) {
  cudaStream_t s = as_stream(stream);
  const int64_t num_tokens = logits.shape[0], E = logits.shape[1];
  check_limits(p, E, "route_forward");
  if (num_tokens == 0) {
    cuda_check(cudaMemsetAsync(prob_mean.data, 0, E * sizeof(float), s), "route_forward: memset prob_mean");
    cuda_check(cudaMemsetAsync(token_frac.data, 0, E * sizeof(float), s), "route_forward: memset token_frac");
    return;
  }
  MOE8_DISPATCH_FLOAT(logits.dtype, "route_forward: logits", [&] {
    dispatch_vpt(static_cast<int>(E),
                 RouteForward<scalar_t>{logits, bias, ids, weights, prob_mean, token_frac, lse, p, s});
  });
}

void route_backward(const TensorView& logits, const TensorView& bias, const RouteParams& p, const TensorView& ids,
                    const TensorView& grad_weights, const TensorView& grad_prob_mean, const TensorView& grad_lse,
                    const TensorView& grad_logits, void* stream) {
  (void)bias;  // the selection gets no gradient
  check_limits(p, logits.shape[1], "route_backward");
  if (logits.shape[0] == 0) return;
  cudaStream_t s = as_stream(stream);
  MOE8_DISPATCH_FLOAT(logits.dtype, "route_backward: logits", [&] {
    dispatch_vpt(static_cast<int>(logits.shape[1]),
                 RouteBackward<scalar_t>{logits, ids, grad_weights, grad_prob_mean, grad_lse, grad_logits, p, s});
  });
}

}  // namespace moe8::cuda
