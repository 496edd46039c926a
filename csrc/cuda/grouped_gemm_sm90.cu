// grouped_gemm_sm90.cu — the MoE expert GEMMs on Hopper: CUTLASS 3.x ptr-array grouped GEMM kernels
// (TMA loads, wgmma, warp-specialised persistent CTAs) with the group offsets read on the device.
//   forward  (rows ragged): c[rows of e] = a[rows of e] · b[e]^T      b [E, N, Kd]  (B K-major, "TN")
//   dgrad    (rows ragged): c[rows of e] = a[rows of e] · b[e]        b [E, Kd, N]  (B N-major)
//   wgrad    (K ragged):    db[e] = dc[rows of e]^T · a[rows of e]    db [E, N, Kd]
// A prep kernel (one thread per group) writes each group's problem shape, A/B/D pointers and strides
// into the caller's workspace and zeroes what CUTLASS will not write (forward: rows past offsets[E];
// wgrad: db of empty groups). CUTLASS then reads the shapes on the device (host_problem_shapes = nullptr,
// so its persistent grid is sized by the device, not the problem), which keeps every launch sync-free and
// graph-capturable.
//
// The tile configurations, GEMM types, prep kernels and launch are in grouped_gemm_sm90_impl.cuh.
//
// Build: nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DNDEBUG
//        -DMOE8_WITH_CUTLASS=1 -I<cutlass>/include (cmake/cutlass.cmake does this). Without
//        MOE8_WITH_CUTLASS the file compiles to stubs that report the path unsupported.
#include <cuda_runtime.h>

#include <string>

#include "core/error.h"
#include "cuda/grouped_gemm_sm90.h"

#if defined(MOE8_WITH_CUTLASS)
#include "cuda/grouped_gemm_sm90_impl.cuh"
#endif

namespace moe8::cuda {

#if defined(MOE8_WITH_CUTLASS)

size_t grouped_gemm_sm90_workspace_bytes(int num_experts, int64_t, int64_t, int64_t) {
  using namespace sm90;
  const DeviceFacts f = device_facts(current_device());
  const int sms = f.sms > 0 ? f.sms : 1;
  // every configuration a launch below can pick: (the GEMMs of) its kinds x tiles, per element type
  auto of = [&](auto t) {
    using T = decltype(t);
    auto rows_and_wgrad = [&](auto... tiles) {
      return sm90_util::max_workspace_bytes<typename FwdGemm<T, decltype(tiles)>::Gemm...,
                                            typename DgradGemm<T, decltype(tiles)>::Gemm...,
                                            typename WgradGemm<T, decltype(tiles)>::Gemm...>(num_experts, sms);
    };
    size_t bytes = std::max(
        rows_and_wgrad(TileLarge{}, TileLargeSolo{}),
        sm90_util::max_workspace_bytes<typename FwdGemm<T, TileSmall>::Gemm, typename DgradGemm<T, TileSmall>::Gemm>(
            num_experts, sms));
    if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
      bytes = std::max(bytes, rows_and_wgrad(TileLargeM2{}, TileThin{}, TilePong128{}, TileTall{}, TileLargeEpi64{},
                                             TileLargeSoloEpi64{}));
      bytes = std::max(
          bytes, sm90_util::max_workspace_bytes<typename FwdSwiGLUGemm<T, TileLargeEpi64>::Gemm,
                                                typename FwdSwiGLUGemm<T, TileLargeSoloEpi64>::Gemm>(num_experts, sms));
      bytes = std::max(
          bytes,
          sm90_util::max_workspace_bytes<typename GatheredFwdGemm<T>::Gemm, typename GatheredFwdGemmTwoWarps<T>::Gemm,
                                         typename GatheredWgradGemm<T>::Gemm>(num_experts, sms));
    }
    return bytes;
  };
  const size_t cut = std::max(of(cutlass::bfloat16_t{}), of(cutlass::half_t{}));
  return kAlignWs /* base alignment slack */ + group_arrays_bytes(num_experts) + align_up(cut, kAlignWs);
}

bool grouped_gemm_sm90_supported(const TensorView& a, const TensorView& b, WeightLayout layout, int64_t n) {
  using namespace sm90;
  if (!a.present || !b.present || !a.is_cuda() || !b.is_cuda() || a.device_index != b.device_index) return false;
  if (!dtype_built(a.dtype) || b.dtype != a.dtype) return false;
  if (a.ndim != 2 || b.ndim != 3 || !a.is_contiguous() || !b.is_contiguous()) return false;
  const int64_t rows = a.shape[0], kd = a.shape[1], experts = b.shape[0];
  const int64_t bn = layout == WeightLayout::kNK ? b.shape[1] : b.shape[2];
  const int64_t bk = layout == WeightLayout::kNK ? b.shape[2] : b.shape[1];
  if (bn != n || bk != kd || n <= 0 || kd <= 0 || n % 8 != 0 || kd % 8 != 0) return false;
  constexpr int64_t kMaxInt = 2147483647;
  if (rows > kMaxInt || n > kMaxInt || kd > kMaxInt || experts > kMaxInt || experts < 1) return false;
  if (reinterpret_cast<uintptr_t>(a.data) % 16 != 0 || reinterpret_cast<uintptr_t>(b.data) % 16 != 0) return false;
  const DeviceFacts f = device_facts(a.device_index);
  return f.major == 9 && f.minor == 0;
}

void grouped_gemm_sm90(const TensorView& a, const TensorView& b, const TensorView& offsets, WeightLayout layout,
                       const TensorView& c, void* workspace, size_t workspace_bytes, void* stream) {
  using namespace sm90;
  const char* what = "grouped_gemm_sm90";
  const int groups = static_cast<int>(offsets.shape[0] - 1);
  const int64_t rows = a.shape[0], kd = a.shape[1], n = c.shape[1];
  MOE8_CHECK(reinterpret_cast<uintptr_t>(c.data) % 16 == 0, what, ": c must be 16-byte aligned");
  const Checked ck = check_call(what, a, groups, workspace, workspace_bytes);
  cudaStream_t s = as_stream(stream);
  const int64_t ldb = layout == WeightLayout::kNK ? kd : n;
  dispatch_dtype(a.dtype, what, [&](auto t) {
    using T = decltype(t);
    constexpr bool bf16 = std::is_same_v<T, cutlass::bfloat16_t>;
    const heuristics::Sm90Overrides& env = heuristics::sm90_overrides();
    const heuristics::Tile tile = heuristics::rows_tile(bf16, n, kd, rows, groups, env);
    const heuristics::Prepared prepared = heuristics::prepared(tile, env);
    // each operand's rows, all groups' (ragged descriptors): b's are its experts' N (forward) or Kd (dgrad) rows
    const int64_t b_rows = groups * (layout == WeightLayout::kNK ? n : kd);
    const RaggedViews ragged{{a.data, rows, kd, kd}, {b.data, b_rows, ldb, ldb}, {c.data, rows, n, n}};
    auto launch = [&](auto g) {
      using G = decltype(g);
      prep_rows_kernel<G><<<prep_blocks(groups, rows * n / 8, ck.sms), kPrepThreads, 0, s>>>(
          offsets.ptr<int32_t>(), groups, rows, n, kd, ldb, a.data, b.data, c.data, ck.w);
      check_launch("grouped_gemm_sm90: prep_rows_kernel");
      if constexpr (G::kPreparedDescriptors) prepare_descriptors<G>(ck.w, groups, prepared, s);
      if (groups > 0 && rows > 0)
        run_cutlass<G>(ck.w, groups, ck.device, ck.sms, heuristics::rows_schedule(n, rows, groups), s, nullptr, nullptr,
                       prepared, ragged);
    };
    if (layout == WeightLayout::kNK)
      launch_tile<FwdGemm, T>(tile, prepared.any(), launch);
    else
      launch_tile<DgradGemm, T>(tile, prepared.any(), launch);
  });
}

namespace {
// Rows [offsets[E], R) of act [R, I] zeroed (what activation_forward makes of h's zeroed rows there).
__global__ void __launch_bounds__(sm90_util::kPrepThreads)
    zero_act_tail_kernel(const int32_t* __restrict__ offsets, int groups, int64_t rows, void* act,
                         int64_t row_vectors) {
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  sm90_util::zero_rows_past_groups(offsets, groups, rows, act, row_vectors, tid,
                                   static_cast<int64_t>(gridDim.x) * blockDim.x);
}
}  // namespace

bool grouped_gemm_swiglu_sm90_supported(const TensorView& a, const TensorView& b, int64_t n) {
  return a.present && a.dtype == DType::kBF16 && n % (2 * sm90::kPairedCols) == 0 &&
         grouped_gemm_sm90_supported(a, b, WeightLayout::kNK, n);
}

void grouped_gemm_swiglu_sm90(const TensorView& a, const TensorView& b, const TensorView& offsets, const TensorView& h,
                              const TensorView& act, void* workspace, size_t workspace_bytes, void* stream) {
  using namespace sm90;
  const char* what = "grouped_gemm_swiglu_sm90";
  const int groups = static_cast<int>(offsets.shape[0] - 1);
  const int64_t rows = a.shape[0], kd = a.shape[1], n = h.shape[1];
  MOE8_CHECK(h.dtype == DType::kBF16 && act.dtype == DType::kBF16 && h.shape[0] == rows && act.shape[0] == rows &&
                 2 * act.shape[1] == n && n % (2 * kPairedCols) == 0,
             what, ": expected bfloat16 h [R, 2I] and act [R, I] with I a multiple of ", kPairedCols, ", got h [",
             h.shape[0], ", ", n, "] and act [", act.shape[0], ", ", act.shape[1], "] for ", rows, " rows");
  MOE8_CHECK(reinterpret_cast<uintptr_t>(h.data) % 16 == 0 && reinterpret_cast<uintptr_t>(act.data) % 16 == 0, what,
             ": h and act must be 16-byte aligned");
  const Checked ck = check_call(what, a, groups, workspace, workspace_bytes);
  cudaStream_t s = as_stream(stream);
  using T = cutlass::bfloat16_t;
  // h = the forward's c; b's rows [E * 2I, Kd]
  const RaggedViews ragged{{a.data, rows, kd, kd}, {b.data, groups * n, kd, kd}, {h.data, rows, n, n}};
  heuristics::Prepared prepared;
  prepared.ragged = prepared.ragged_loads = true;
  auto launch = [&](auto g) {
    using G = decltype(g);
    prep_rows_kernel<G><<<prep_blocks(groups, rows * n / 8, ck.sms), kPrepThreads, 0, s>>>(
        offsets.ptr<int32_t>(), groups, rows, n, kd, kd, a.data, b.data, h.data, ck.w);
    check_launch("grouped_gemm_swiglu_sm90: prep_rows_kernel");
    zero_act_tail_kernel<<<prep_blocks(groups, rows * n / 16, ck.sms), kPrepThreads, 0, s>>>(
        offsets.ptr<int32_t>(), groups, rows, act.data, n / 16 /* I bf16 in 16-byte vectors */);
    check_launch("grouped_gemm_swiglu_sm90: zero_act_tail_kernel");
    if (groups > 0 && rows > 0)
      run_cutlass<G>(ck.w, groups, ck.device, ck.sms, heuristics::rows_schedule(n, rows, groups), s, nullptr, nullptr,
                     prepared, ragged, act.data);
  };
  if (heuristics::odd_large_tiles(n))
    launch(FwdSwiGLUGemm<T, TileLargeSoloEpi64>{});
  else
    launch(FwdSwiGLUGemm<T, TileLargeEpi64>{});
}

namespace {
// Where a gathered mainloop reads its rows: x [T, Kd], the plan's row_to_slot and offsets, R rows.
sm90::GatherSource gather_source(const TensorView& x, const TensorView& row_to_slot, int top_k,
                                 const TensorView& offsets, int64_t rows) {
  sm90::GatherSource src;
  src.x = x.data;
  src.tokens = x.shape[0];
  src.kd = x.shape[1];
  src.row_to_slot = row_to_slot.ptr<int32_t>();
  src.offsets = offsets.ptr<int32_t>();
  src.rows = rows;
  src.top_k = top_k;
  return src;
}

// x's elements fewer than 2^32 - 1: the gathered mainloops keep each row as a 32-bit offset, the last one not kNoRow.
bool offsets_fit(const TensorView& x) { return x.ndim == 2 && x.shape[0] * x.shape[1] < 4294967295LL; }
}  // namespace

bool grouped_gemm_gathered_sm90_supported(const TensorView& x, const TensorView& b, WeightLayout layout, int64_t n) {
  using namespace sm90;
  if (!x.present || !x.is_cuda() || x.dtype != DType::kBF16 || layout != WeightLayout::kNK) return false;
  return offsets_fit(x) && grouped_gemm_sm90_supported(x, b, layout, n);
}

void grouped_gemm_gathered_sm90(const TensorView& x, const TensorView& row_to_slot, int top_k, const TensorView& b,
                                const TensorView& offsets, const TensorView& c, void* workspace, size_t workspace_bytes,
                                void* stream) {
  using namespace sm90;
  const char* what = "grouped_gemm_gathered_sm90";
  const int groups = static_cast<int>(offsets.shape[0] - 1);
  const int64_t rows = c.shape[0], kd = x.shape[1], n = c.shape[1];
  MOE8_CHECK(x.dtype == DType::kBF16 && c.dtype == DType::kBF16, what, ": expected bfloat16 x and c");
  MOE8_CHECK(reinterpret_cast<uintptr_t>(c.data) % 16 == 0, what, ": c must be 16-byte aligned");
  const Checked ck = check_call(what, x, groups, workspace, workspace_bytes);
  cudaStream_t s = as_stream(stream);
  auto launch = [&](auto g) {
    using G = decltype(g);
    prep_rows_kernel<G><<<prep_blocks(groups, rows * n / 8, ck.sms), kPrepThreads, 0, s>>>(
        offsets.ptr<int32_t>(), groups, rows, n, kd, kd, x.data, b.data, c.data, ck.w, true);
    check_launch("grouped_gemm_gathered_sm90: prep_rows_kernel");
    if (groups == 0 || rows == 0) return;
    const GatherSource src = gather_source(x, row_to_slot, top_k, offsets, rows);
    run_cutlass<G>(ck.w, groups, ck.device, ck.sms, heuristics::rows_schedule(n, rows, groups), s, &src);
  };
  if (heuristics::gather_load_warps(heuristics::sm90_overrides()) == 2)
    launch(GatheredFwdGemmTwoWarps<cutlass::bfloat16_t>{});
  else
    launch(GatheredFwdGemm<cutlass::bfloat16_t>{});
}

bool grouped_gemm_wgrad_gathered_sm90_supported(const TensorView& x, const TensorView& dc, const TensorView& db) {
  using namespace sm90;
  if (!x.present || !dc.present || !x.is_cuda() || x.dtype != DType::kBF16 || dc.dtype != DType::kBF16) return false;
  if (x.ndim != 2 || dc.ndim != 2 || !dc.is_contiguous() || dc.device_index != x.device_index) return false;
  if (reinterpret_cast<uintptr_t>(dc.data) % 16 != 0 || reinterpret_cast<uintptr_t>(db.data) % 16 != 0) return false;
  return offsets_fit(x) && grouped_gemm_sm90_supported(x, db, WeightLayout::kNK, dc.shape[1]);
}

void grouped_gemm_wgrad_gathered_sm90(const TensorView& x, const TensorView& row_to_slot, int top_k,
                                      const TensorView& dc, const TensorView& offsets, const TensorView& db,
                                      void* workspace, size_t workspace_bytes, void* stream) {
  using namespace sm90;
  const char* what = "grouped_gemm_wgrad_gathered_sm90";
  const int groups = static_cast<int>(offsets.shape[0] - 1);
  const int64_t rows = dc.shape[0], kd = x.shape[1], n = dc.shape[1];
  MOE8_CHECK(x.dtype == DType::kBF16 && dc.dtype == DType::kBF16 && db.dtype == DType::kBF16, what,
             ": expected bfloat16 x, dc and db");
  MOE8_CHECK(reinterpret_cast<uintptr_t>(db.data) % 16 == 0, what, ": db must be 16-byte aligned");
  const Checked ck = check_call(what, x, groups, workspace, workspace_bytes);
  cudaStream_t s = as_stream(stream);
  using G = GatheredWgradGemm<cutlass::bfloat16_t>;
  prep_wgrad_kernel<G><<<prep_blocks(groups, n * kd / 8, ck.sms), kPrepThreads, 0, s>>>(
      offsets.ptr<int32_t>(), groups, rows, n, kd, x.data, dc.data, db.data, ck.w, true);
  check_launch("grouped_gemm_wgrad_gathered_sm90: prep_wgrad_kernel");
  if (groups == 0 || rows == 0) return;
  const GatherSource src = gather_source(x, row_to_slot, top_k, offsets, rows);
  run_cutlass<G>(ck.w, groups, ck.device, ck.sms, heuristics::wgrad_schedule(Tile::kLarge, n), s, &src);
}

bool grouped_gemm_sm90_routing_balanced(const TensorView& offsets, void* stream) {
  MOE8_CHECK(offsets.dtype == DType::kI32 && offsets.ndim == 1 && offsets.shape[0] >= 1 && offsets.is_cuda(),
             "grouped_gemm_sm90_routing_balanced: expected offsets int32 [E + 1] on a CUDA device");
  return sm90_util::routing_balanced(offsets.ptr<int32_t>(), static_cast<int>(offsets.shape[0] - 1),
                                     offsets.device_index, as_stream(stream));
}

void grouped_gemm_wgrad_sm90(const TensorView& a, const TensorView& dc, const TensorView& offsets, const TensorView& db,
                             void* workspace, size_t workspace_bytes, void* stream) {
  using namespace sm90;
  const char* what = "grouped_gemm_wgrad_sm90";
  const int groups = static_cast<int>(offsets.shape[0] - 1);
  const int64_t rows = a.shape[0], kd = a.shape[1], n = dc.shape[1];
  MOE8_CHECK(dc.dtype == a.dtype && db.dtype == a.dtype, what, ": expected dc and db of dtype ", dtype_name(a.dtype),
             " (same as a), got ", dtype_name(dc.dtype), " and ", dtype_name(db.dtype));
  MOE8_CHECK(reinterpret_cast<uintptr_t>(dc.data) % 16 == 0 && reinterpret_cast<uintptr_t>(db.data) % 16 == 0, what,
             ": dc and db must be 16-byte aligned");
  const Checked ck = check_call(what, a, groups, workspace, workspace_bytes);
  cudaStream_t s = as_stream(stream);
  dispatch_dtype(a.dtype, what, [&](auto t) {
    using T = decltype(t);
    constexpr bool bf16 = std::is_same_v<T, cutlass::bfloat16_t>;
    // only bf16 reads pong: f16 hands no offsets to the balance hint
    const bool pong = bf16 && (heuristics::wgrad_pong(groups, rows, n, kd) ||
                               (heuristics::wgrad_pong_if_balanced(groups, rows, n, kd) &&
                                sm90_util::routing_balanced(offsets.ptr<int32_t>(), groups, ck.device, s)));
    const heuristics::Sm90Overrides& env = heuristics::sm90_overrides();
    const heuristics::Tile tile = heuristics::wgrad_tile(bf16, n, kd, pong, env);
    const heuristics::Prepared prepared = heuristics::prepared(tile, env);
    // A = dc's rows, B = a's rows (both ragged along K), D = db's E x N rows
    const RaggedViews ragged{{dc.data, rows, n, n}, {a.data, rows, kd, kd}, {db.data, groups * n, kd, kd}};
    auto launch = [&](auto g) {
      using G = decltype(g);
      prep_wgrad_kernel<G><<<prep_blocks(groups, n * kd / 8, ck.sms), kPrepThreads, 0, s>>>(
          offsets.ptr<int32_t>(), groups, rows, n, kd, a.data, dc.data, db.data, ck.w);
      check_launch("grouped_gemm_wgrad_sm90: prep_wgrad_kernel");
      if constexpr (G::kPreparedDescriptors) prepare_descriptors<G>(ck.w, groups, prepared, s);
      if (groups > 0 && rows > 0)
        run_cutlass<G>(ck.w, groups, ck.device, ck.sms, heuristics::wgrad_schedule(tile, n), s, nullptr, nullptr,
                       prepared, ragged);
    };
    launch_tile<WgradGemm, T>(tile, prepared.any(), launch);
  });
}

#else  // !MOE8_WITH_CUTLASS: stubs

size_t grouped_gemm_sm90_workspace_bytes(int, int64_t, int64_t, int64_t) { return 0; }

bool grouped_gemm_sm90_routing_balanced(const TensorView&, void*) { return false; }

bool grouped_gemm_sm90_supported(const TensorView&, const TensorView&, WeightLayout, int64_t) { return false; }

bool grouped_gemm_gathered_sm90_supported(const TensorView&, const TensorView&, WeightLayout, int64_t) { return false; }

bool grouped_gemm_swiglu_sm90_supported(const TensorView&, const TensorView&, int64_t) { return false; }

void grouped_gemm_swiglu_sm90(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                              const TensorView&, void*, size_t, void*) {
  fail("grouped_gemm_swiglu_sm90: moe8 was built without CUTLASS (MOE8_WITH_CUTLASS)");
}

void grouped_gemm_gathered_sm90(const TensorView&, const TensorView&, int, const TensorView&, const TensorView&,
                                const TensorView&, void*, size_t, void*) {
  fail("grouped_gemm_gathered_sm90: moe8 was built without CUTLASS (MOE8_WITH_CUTLASS)");
}

bool grouped_gemm_wgrad_gathered_sm90_supported(const TensorView&, const TensorView&, const TensorView&) {
  return false;
}

void grouped_gemm_wgrad_gathered_sm90(const TensorView&, const TensorView&, int, const TensorView&, const TensorView&,
                                      const TensorView&, void*, size_t, void*) {
  fail("grouped_gemm_wgrad_gathered_sm90: moe8 was built without CUTLASS (MOE8_WITH_CUTLASS)");
}

void grouped_gemm_sm90(const TensorView&, const TensorView&, const TensorView&, WeightLayout, const TensorView&, void*,
                       size_t, void*) {
  fail("grouped_gemm_sm90: moe8 was built without CUTLASS (MOE8_WITH_CUTLASS); use grouped_gemm");
}

void grouped_gemm_wgrad_sm90(const TensorView&, const TensorView&, const TensorView&, const TensorView&, void*, size_t,
                             void*) {
  fail("grouped_gemm_wgrad_sm90: moe8 was built without CUTLASS (MOE8_WITH_CUTLASS); use grouped_gemm_wgrad");
}

#endif  // MOE8_WITH_CUTLASS

}  // namespace moe8::cuda
