// cuda/ragged_tma_sm90.cuh — one TMA descriptor for every group's rows of a grouped GEMM's operand: the group's
// first row and row count go in the copy's coordinates, not in a descriptor of its own, so a grouped GEMM needs no
// descriptor per group and no rewrite or acquire at a group change (PreparedStoreEpilogue's ragged D).
//
// The operand is `rows x cols` elements, row stride ld, all groups' rows stacked (the forward's and dgrad's output
// [R, N], a weight gradient's [E * N, K]). Its descriptor has four dims (innermost first):
//   d0 = cols (stride 1), d1 = kRaggedBound (stride ld), d2 = d3 = kRaggedSpan (strides ld and 2^34 bytes - ld)
// and a box of the operand's box (cols x rows) by 1 x 1. Row r of a group of `rows` rows that starts at row0 is
// addressed as (c, kRaggedBound - rows + r, row0 + rows, kRaggedBound): its address is base + (row0 + r) * ld + c,
// because d3's coordinate times its stride is 2^64 - 2^30 * ld bytes, which wraps to -2^30 * ld; and rows r >= rows
// fall past d1's bound, so the TMA drops them on a store as it drops the rows past a per-group descriptor's end.
// The same trick as Triton's ragged tensor descriptors (triton/tools/ragged_tma.py), written for CuTe's copy atoms.
// Build: included by prepared_descriptors_sm90.cuh (CUTLASS headers, sm_90a).
#pragma once
#include <cuda.h>

#include <cstdint>
#include <string>

#include "core/error.h"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/atom/copy_traits_sm90_tma.hpp"
#include "cutlass/cuda_host_adapter.hpp"
#include "cutlass/epilogue/collective/collective_epilogue.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"

namespace moe8::cuda::sm90 {

constexpr int32_t kRaggedBound = 1 << 30;      // d1: a group's rows end here; also d3's coordinate
constexpr uint64_t kRaggedSpan = 0x7fff0000u;  // d2, d3: larger than any coordinate put there
constexpr uint64_t kRaggedWrap = 1ull << 34;   // d3's stride in bytes is this minus ld: 2^30 * 2^34 = 2^64

// What a TMA copy goes to: a group's rows through a ragged descriptor (rows >= 0), or through a descriptor of the
// group's own (rows < 0: the copy's coordinates are used as they are). half > 0 (stores only): the 256-wide tiles
// along the columns hold gate and up halves (paired_col).
struct RaggedRows {
  const cute::TmaDescriptor* desc;
  int32_t row0;
  int32_t rows;
  int32_t half = 0;
};

// The columns of a [gate | up] output (2 x half wide) whose 256-wide tile n holds gate columns [128 n, 128 n + 128)
// and then up columns [half + 128 n, ...): where the tile's column c goes (a store's box lies within one half).
constexpr int32_t kPairedCols = 128;
CUTE_HOST_DEVICE constexpr int32_t paired_col(int32_t c, int32_t half) {
  const int32_t n = c / (2 * kPairedCols), j = c % (2 * kPairedCols);
  return j < kPairedCols ? n * kPairedCols + j : half + n * kPairedCols + j - kPairedCols;
}

// An operand's rows (all groups' stacked, each `cols` elements, ld apart) for a ragged descriptor; base null: none.
struct RaggedView {
  const void* base = nullptr;
  int64_t rows = 0, cols = 0, ld = 0;
};

// A grouped GEMM's three operands' rows.
struct RaggedViews {
  RaggedView a, b, d;
};

// A group's first row in each operand's RaggedView, written by the GEMM's prep kernel, one a group: a group change
// reads these 16 bytes and computes nothing from the group's pointers.
struct alignas(16) RaggedStarts {
  int32_t a, b, d, unused;
};

// The ragged descriptor of an operand whose CuTe TMA atom is Traits (CUTLASS's own, for one group's operand of stride
// type Stride: (rows, cols, 1) or (cols, rows, 1), the contiguous mode static 1), loaded by `multicast` CTAs of a
// cluster (each a slice of the box's rows, as CuTe divides it): its element, box and swizzle, with the four dims
// above. Throws a moe8::Error naming `what` where the atom is not a rows x cols box with cols contiguous, the rows
// are more than kRaggedBound or not 16-byte aligned, or the driver refuses the descriptor.
template <class Element, class Traits, class Stride>
cute::TmaDescriptor ragged_rows_descriptor(const RaggedView& v, int multicast, const char* what) {
  using namespace cute;
  using Aux = typename Traits::AuxParams;
  using Basis = typename Aux::TmaGmemBasis;
  static_assert(decltype(rank(Basis{}))::value >= 2, "a TMA box of rows x cols");
  // CUTLASS's dims for a probe of 3 rows: cols must be d0 and rows d1 (what the coordinates' mapping assumes)
  constexpr bool kColsFirst = is_static<std::remove_reference_t<decltype(get<0>(Stride{}))>>::value;
  const auto shape3 = [&] {
    if constexpr (kColsFirst)
      return make_shape(v.cols, int64_t(3), Int<1>{});
    else
      return make_shape(int64_t(3), v.cols, Int<1>{});
  }();
  Stride stride_v{};
  get<kColsFirst ? 1 : 0>(stride_v) = v.ld;
  Tensor probe = make_tensor(static_cast<const Element*>(nullptr), make_layout(shape3, stride_v));
  cute::array<uint64_t, 5> shape = {1, 1, 1, 1, 1};
  cute::array<uint64_t, 5> stride = {0, 0, 0, 0, 0};
  cute::detail::fill_tma_gmem_shape_stride(Traits{}, probe, shape, stride);
  MOE8_CHECK(shape[0] == static_cast<uint64_t>(v.cols) && stride[0] == 1 && shape[1] == 3 &&
                 stride[1] == static_cast<uint64_t>(v.ld),
             what,
             ": the ragged descriptor expects a TMA with the operand's contiguous cols as dim 0 and rows as dim 1");
  MOE8_CHECK(v.rows <= kRaggedBound, what, ": a ragged operand takes at most 2^30 rows, got ", v.rows);
  const uint64_t ld_bytes = static_cast<uint64_t>(v.ld) * sizeof_bits_v<Element> / 8;
  MOE8_CHECK(ld_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(v.base) % 16 == 0, what,
             ": the ragged descriptor needs 16-byte aligned rows, got a row stride of ", ld_bytes, " bytes");
  const uint32_t box_rows = static_cast<uint32_t>(size<1>(Basis{}));
  MOE8_CHECK(multicast >= 1 && box_rows % multicast == 0, what, ": a box of ", box_rows, " rows over ", multicast,
             " CTAs");
  cuuint64_t dims[4] = {static_cast<cuuint64_t>(v.cols), static_cast<cuuint64_t>(kRaggedBound), kRaggedSpan,
                        kRaggedSpan};
  cuuint64_t strides[3] = {ld_bytes, ld_bytes, kRaggedWrap - ld_bytes};
  cuuint32_t box[4] = {static_cast<cuuint32_t>(size<0>(Basis{})), box_rows / multicast, 1, 1};
  cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUtensorMapSwizzle swizzle =
      TMA::to_CUtensorMapSwizzle(cute::detail::get_tma_swizzle_bits(typename Aux::TmaSwizzle{}),
                                 cute::detail::get_tma_swizzle_base(typename Aux::TmaSwizzle{}));
  TmaDescriptor desc{};
  const CUresult r = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
      &desc, TMA::to_CUtensorMapDataType<Element>(), 4, const_cast<void*>(v.base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOE8_CHECK(r == CUDA_SUCCESS, what, ": cuTensorMapEncodeTiled refused the ragged descriptor (CUresult ",
             static_cast<int>(r), ")");
  return desc;
}

// The four coordinates of a ragged copy from the two a group's own descriptor would take (cols, group row).
struct RaggedCoords {
  int32_t col, row, end, bound;
  CUTLASS_DEVICE RaggedCoords(const RaggedRows& t, int32_t c0, int32_t c1)
      : col(c0), row(kRaggedBound - t.rows + c1), end(t.row0 + t.rows), bound(kRaggedBound) {}
};

}  // namespace moe8::cuda::sm90

namespace cute {

// A TMA store whose target is a RaggedRows (with(RaggedRows)), or a descriptor pointer as SM90_TMA_STORE's. An
// epilogue built with it (WithRaggedStore) keeps one store instantiation for both.
struct Moe8RaggedTmaStore : SM90_TMA_STORE {};
struct Moe8RaggedTmaStoreTo : SM90_TMA_STORE {};

// SM90_TMA_STORE's traits (the descriptor CUTLASS makes, its coordinate tensor), with with(RaggedRows).
template <class NumBitsPerTMA, class AuxParams_>
struct Copy_Traits<Moe8RaggedTmaStore, NumBitsPerTMA, AuxParams_> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using DstLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using RefLayout = SrcLayout;

  TmaDescriptor tma_desc_;
  using AuxParams = AuxParams_;
  AuxParams aux_params_;

  CUTE_HOST_DEVICE constexpr TmaDescriptor const* get_tma_descriptor() const { return &tma_desc_; }

  template <class GShape>
  CUTE_HOST_DEVICE constexpr auto get_tma_tensor(GShape const& g_shape) const {
    static_assert(is_congruent<decltype(g_shape), decltype(aux_params_.g_stride_)>::value);
    return make_coord_tensor(make_layout(g_shape, aux_params_.g_stride_));
  }

  CUTE_HOST_DEVICE constexpr Copy_Traits<Moe8RaggedTmaStoreTo, NumBitsPerTMA> with(
      moe8::cuda::sm90::RaggedRows target) const {
    return {target};
  }
  CUTE_HOST_DEVICE constexpr Copy_Traits<Moe8RaggedTmaStoreTo, NumBitsPerTMA> with(
      TmaDescriptor const* new_tma_desc) const {
    return {{new_tma_desc, 0, -1}};
  }
};

template <class NumBitsPerTMA>
struct Copy_Traits<Moe8RaggedTmaStoreTo, NumBitsPerTMA> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using DstLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using RefLayout = SrcLayout;

  moe8::cuda::sm90::RaggedRows target_;

  template <class TS, class SLayout, class TD, class DLayout>
  CUTE_HOST_DEVICE friend constexpr void copy_unpack(Copy_Traits const& traits, Tensor<TS, SLayout> const& src,
                                                     Tensor<TD, DLayout>& dst) {
    static_assert(is_smem<TS>::value, "Expected smem src for a TMA store");
    const moe8::cuda::sm90::RaggedRows& t = traits.target_;
    void const* const src_ptr = cute::raw_pointer_cast(src.data());
    auto coord = dst.data().coord_;
    if (t.rows >= 0) {
      const int32_t col = static_cast<int32_t>(get<0>(coord));
      const moe8::cuda::sm90::RaggedCoords c(t, t.half > 0 ? moe8::cuda::sm90::paired_col(col, t.half) : col,
                                             static_cast<int32_t>(get<1>(coord)));
      SM90_TMA_STORE_4D::copy(t.desc, src_ptr, c.col, c.row, c.end, c.bound);
    } else {
      detail::explode_tuple(detail::CallCOPY<SM90_TMA_STORE>{}, make_tuple(static_cast<void const*>(t.desc), src_ptr),
                            seq<0, 1>{}, coord, tuple_seq<decltype(coord)>{});
    }
  }
};

// A TMA load through a ragged descriptor at a group's rows (always ragged: the mainloop takes this atom only when
// both operands are; ragged_load_atom makes it), multicast to the CTAs of `mask` where kMulticast.
template <bool kMulticast>
struct Moe8RaggedTmaLoad {};

template <bool kMulticast, class NumBitsPerTMA>
struct Copy_Traits<Moe8RaggedTmaLoad<kMulticast>, NumBitsPerTMA> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using DstLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using RefLayout = SrcLayout;

  moe8::cuda::sm90::RaggedRows target_;
  uint64_t* mbar_;
  uint16_t mask_;

  template <class TS, class SLayout, class TD, class DLayout>
  CUTE_HOST_DEVICE friend constexpr void copy_unpack(Copy_Traits const& traits, Tensor<TS, SLayout> const& src,
                                                     Tensor<TD, DLayout>& dst) {
    static_assert(is_smem<TD>::value, "Expected smem dst for a TMA load");
    auto coord = src.data().coord_;
    void* const dst_ptr = cute::raw_pointer_cast(dst.data());
    const moe8::cuda::sm90::RaggedCoords c(traits.target_, static_cast<int32_t>(get<0>(coord)),
                                           static_cast<int32_t>(get<1>(coord)));
    constexpr uint64_t kHint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
    if constexpr (kMulticast)
      SM90_TMA_LOAD_MULTICAST_4D::copy(traits.target_.desc, traits.mbar_, traits.mask_, kHint, dst_ptr, c.col, c.row,
                                       c.end, c.bound);
    else
      SM90_TMA_LOAD_4D::copy(traits.target_.desc, traits.mbar_, kHint, dst_ptr, c.col, c.row, c.end, c.bound);
  }
};

}  // namespace cute

namespace moe8::cuda::sm90 {

// The executable ragged load for CUTLASS's TMA atom Tma (a TiledCopy of SM90_TMA_LOAD or SM90_TMA_LOAD_MULTICAST):
// the same bits per copy and element type, to `target`, arriving on `mbar`.
template <class Tma>
struct RaggedLoadOf;
template <class Op, class NumBits, class Aux, class T, class... Rest>
struct RaggedLoadOf<cute::TiledCopy<cute::Copy_Atom<cute::Copy_Traits<Op, NumBits, Aux>, T>, Rest...>> {
  static constexpr bool kMulticast = std::is_same_v<Op, cute::SM90_TMA_LOAD_MULTICAST>;
  using Traits = cute::Copy_Traits<cute::Moe8RaggedTmaLoad<kMulticast>, NumBits>;
  using Atom = cute::Copy_Atom<Traits, T>;
  CUTLASS_DEVICE static Atom make(RaggedRows target, uint64_t& mbar, uint16_t mask) {
    return Atom{Traits{target, &mbar, mask}};
  }
};

}  // namespace moe8::cuda::sm90

namespace moe8::cuda::sm90 {

// CUTLASS's ptr-array TMA epilogue Epi with its D stored by Moe8RaggedTmaStore (store() then takes a RaggedRows).
template <class Epi>
struct WithRaggedStoreOf;
template <int StagesC, int StagesD, int Fragment, bool ReuseSmemC, bool DelayTmaStore, int EpiWarpGroups, class CtaTile,
          class EpiTile, class ElementC, class StrideC, class ElementD, class StrideD, class Fusion, class CopyOpG2S,
          class SmemLayoutAtomC, class CopyOpS2R, class CopyOpS2G, class SmemLayoutAtomD, class CopyOpR2S,
          class CopyAtomC, class CopyOpR2R>
struct WithRaggedStoreOf<cutlass::epilogue::collective::CollectiveEpilogue<
    cutlass::epilogue::Sm90PtrArrayTmaWarpSpecialized<StagesC, StagesD, Fragment, ReuseSmemC, DelayTmaStore,
                                                      EpiWarpGroups>,
    CtaTile, EpiTile, ElementC, StrideC, ElementD, StrideD, Fusion, CopyOpG2S, SmemLayoutAtomC, CopyOpS2R, CopyOpS2G,
    SmemLayoutAtomD, CopyOpR2S, CopyAtomC, CopyOpR2R>> {
  static_assert(std::is_same_v<CopyOpS2G, cute::SM90_TMA_STORE>, "CUTLASS's TMA store");
  using type = cutlass::epilogue::collective::CollectiveEpilogue<
      cutlass::epilogue::Sm90PtrArrayTmaWarpSpecialized<StagesC, StagesD, Fragment, ReuseSmemC, DelayTmaStore,
                                                        EpiWarpGroups>,
      CtaTile, EpiTile, ElementC, StrideC, ElementD, StrideD, Fusion, CopyOpG2S, SmemLayoutAtomC, CopyOpS2R,
      cute::Moe8RaggedTmaStore, SmemLayoutAtomD, CopyOpR2S, CopyAtomC, CopyOpR2R>;
};
template <class Epi>
using WithRaggedStore = typename WithRaggedStoreOf<Epi>::type;

}  // namespace moe8::cuda::sm90
