// grouped_gemm_act_sm90.cu — the down projection's input gradient on Hopper with the routed SwiGLU
// backward in the GEMM's epilogue (act_backward_epilogue_sm90.cuh): d act = rows [R, H] · down[e] [H, I] never
// reaches memory; the epilogue writes w * act(h) (the weight gradient's operand), d h, and per-tile sums of the
// routing weights' gradient, which finish_kernel adds up per row. bfloat16, the 128x128 ping-pong tile and the
// 128x256 cooperative ones (with and without the 1x2 cluster), as sm90_heuristics::act_dgrad_tile picks; the
// caller runs the plain dgrad and the separate pass elsewhere. docs/kernels.md has the measurements.
#include <cuda_runtime.h>

#include <optional>

#include "core/error.h"
#include "cuda/grouped_gemm_sm90.h"

#if defined(MOE8_WITH_CUTLASS)
#include "cuda/act_backward_epilogue_sm90.cuh"
#include "cuda/grouped_gemm_sm90_impl.cuh"
#endif

namespace moe8::cuda {

#if defined(MOE8_WITH_CUTLASS)
namespace sm90 {

template <class T, class Config>
using DgradActGemm =
    GroupedGemm<T, cutlass::layout::RowMajor, cutlass::layout::RowMajor, Config, Sm90RoutedSwiGLUBackward>;

// One thread a row: the row's tile sums added in order into d_weights at its slot (rows of the groups), or
// the row of dh zeroed (rows past offsets[E], which no tile covers).
__global__ void finish_kernel(const int32_t* __restrict__ offsets, int groups, int64_t rows,
                              const int32_t* __restrict__ row_to_slot, int64_t num_slots,
                              const float* __restrict__ partials, int parts, float* __restrict__ d_weights,
                              __nv_bfloat16* dh, int64_t cols) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  int64_t begin, end;
  group_range(offsets, groups - 1, rows, begin, end);
  if (r < end) {
    const int32_t slot = row_to_slot[r];
    if (slot < 0 || slot >= num_slots) return;
    float v = 0.f;
    for (int t = 0; t < parts; ++t) v += partials[r * parts + t];
    d_weights[slot] = v;
  } else {
    for (int64_t j = 0; j < cols; ++j) dh[r * cols + j] = __float2bfloat16(0.f);
  }
}

}  // namespace sm90

bool grouped_gemm_act_backward_sm90_supported(const TensorView& a, const TensorView& b, const TensorView& h,
                                              const ActParams& p) {
  using namespace sm90;
  if (p.kind != ActKind::kSwiGLU || p.interleaved) return false;
  if (a.dtype != DType::kBF16 || !h.present || h.dtype != DType::kBF16 || !h.is_contiguous()) return false;
  const int64_t n = b.ndim == 3 ? b.shape[2] : 0;
  if (!grouped_gemm_sm90_supported(a, b, WeightLayout::kKN, n)) return false;
  return heuristics::act_dgrad_tile(n, a.shape[0], static_cast<int>(b.shape[0]), heuristics::sm90_overrides())
      .has_value();
}

void grouped_gemm_act_backward_sm90(const TensorView& a, const TensorView& b, const TensorView& offsets,
                                    const TensorView& h, const TensorView& weights, const TensorView& row_to_slot,
                                    const ActParams& p, const TensorView& dh, const TensorView& a_w,
                                    const TensorView& partials, const TensorView& d_weights, void* workspace,
                                    size_t workspace_bytes, void* stream) {
  using namespace sm90;
  const char* what = "grouped_gemm_act_backward_sm90";
  const int groups = static_cast<int>(offsets.shape[0] - 1);
  const int64_t rows = a.shape[0], kd = a.shape[1], n = a_w.shape[1];
  MOE8_CHECK(reinterpret_cast<uintptr_t>(a_w.data) % 16 == 0, what, ": a_w must be 16-byte aligned");
  const Checked ck = check_call(what, a, groups, workspace, workspace_bytes);
  cudaStream_t s = as_stream(stream);
  using T = cutlass::bfloat16_t;
  MOE8_CHECK(p.kind == ActKind::kSwiGLU && !p.interleaved, what,
             ": the fused epilogue is SwiGLU with h as [gate | up]");
  ActBackwardArgs args;
  args.h = h.ptr<__nv_bfloat16>();
  args.dh = dh.ptr<__nv_bfloat16>();
  args.weights = weights.ptr<float>();
  args.row_to_slot = row_to_slot.ptr<int32_t>();
  args.offsets = offsets.ptr<int32_t>();
  args.partials = partials.ptr<float>();
  args.rows = rows;
  args.num_slots = weights.shape[0];
  args.I = n;
  args.parts = grouped_gemm_act_backward_sm90_parts(n);
  auto launch = [&](auto g) {
    using G = decltype(g);
    MOE8_CHECK(group_arrays_bytes(groups) + cutlass_workspace_bytes<G>(groups, ck.sms) + kAlignWs <= workspace_bytes,
               what, ": the workspace is too small for this kernel");
    prep_rows_kernel<G><<<prep_blocks(groups, rows * n / 8, ck.sms), kPrepThreads, 0, s>>>(
        offsets.ptr<int32_t>(), groups, rows, n, kd, n, a.data, b.data, a_w.data, ck.w);
    check_launch("grouped_gemm_act_backward_sm90: prep_rows_kernel");
    if (groups > 0 && rows > 0)
      run_cutlass<G>(ck.w, groups, ck.device, ck.sms, heuristics::rows_schedule(n, rows, groups), s, nullptr, args);
  };
  const std::optional<heuristics::Tile> tile =
      heuristics::act_dgrad_tile(n, rows, groups, heuristics::sm90_overrides());
  MOE8_CHECK(tile.has_value(), what, ": no tile of this kernel serves the shape (see _supported)");
  if (*tile == heuristics::Tile::kPong128)
    launch(DgradActGemm<T, TilePong128>{});
  else if (*tile == heuristics::Tile::kSolo)
    launch(DgradActGemm<T, TileLargeSolo>{});
  else
    launch(DgradActGemm<T, TileLarge>{});
  if (rows == 0 || groups == 0) return;
  constexpr int kThreads = 256;
  finish_kernel<<<static_cast<unsigned>(ceil_div(rows, kThreads)), kThreads, 0, s>>>(
      offsets.ptr<int32_t>(), groups, rows, row_to_slot.ptr<int32_t>(), weights.shape[0], partials.ptr<float>(),
      args.parts, d_weights.ptr<float>(), dh.ptr<__nv_bfloat16>(), 2 * n);
  check_launch("grouped_gemm_act_backward_sm90: finish_kernel");
}

#else  // !MOE8_WITH_CUTLASS: stubs

bool grouped_gemm_act_backward_sm90_supported(const TensorView&, const TensorView&, const TensorView&,
                                              const ActParams&) {
  return false;
}

void grouped_gemm_act_backward_sm90(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                    const TensorView&, const TensorView&, const ActParams&, const TensorView&,
                                    const TensorView&, const TensorView&, const TensorView&, void*, size_t, void*) {
  fail("grouped_gemm_act_backward_sm90: moe8 was built without CUTLASS (MOE8_WITH_CUTLASS)");
}

#endif  // MOE8_WITH_CUTLASS

}  // namespace moe8::cuda
