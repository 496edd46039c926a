// sm90_heuristics.h — the shape rules of the sm_90a grouped GEMMs (grouped_gemm_sm90.cu: bf16 / f16,
// grouped_gemm_fp8_sm90.cu: FP8 blockwise) as small pure functions, shape in, choice out: the tile
// configuration, its cluster, and the order in which the persistent scheduler hands out tiles; plus the
// MOE8_SM90_* environment overrides of those choices, parsed once per process (sm90_overrides()).
// Plain C++ (no CUDA, no CUTLASS): tests/cpp/test_sm90_heuristics.cpp checks the choices on the CPU.
// The measurements behind every threshold are in docs/kernels.md.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "core/error.h"

namespace moe8::cuda::sm90_heuristics {

// The bf16 / f16 tile configurations (grouped_gemm_sm90.cu defines them): CTA tile, cluster, kernel.
//   kLarge   128x256 cooperative, 1x2 cluster (CTAs paired along N: the A tile is multicast), CUTLASS's 128x32
//            epilogue subtiles
//   kSolo    kLarge without the cluster
//   kM2      kLarge with the CTAs paired along M (2x1: the weight tile is shared)        bf16 only
//   kPong128 128x128 ping-pong, 2x1 cluster                                               bf16 only
//   kTall    256x128 cooperative, 1x2 cluster                                             bf16 only
//   kEpi64   kLarge storing its tile in 128x64 epilogue subtiles (four, not eight 128x32): the bf16
//            default in kLarge's place (with_epilogue)                                    bf16 only
//   kEpi64Solo  kEpi64 without the cluster                                                bf16 only
//   kSmall   64x128 ping-pong, 1x2 cluster (forward and dgrad with few rows per expert)
//   kThin    128x32 cooperative, no cluster (an N of a LoRA rank)                         bf16 only
enum class Tile { kLarge, kSolo, kM2, kPong128, kTall, kEpi64, kEpi64Solo, kSmall, kThin };

// The FP8 configurations (grouped_gemm_fp8_sm90.cu): 128x128x128 cooperative with a 1x2 cluster (kLarge),
// without it (kSolo), with a 2x1 cluster (kM2); 64x128x128 ping-pong with a 1x2 cluster (kSmall).
enum class Fp8Tile { kLarge, kSolo, kM2, kSmall };

// How the FP8 blockwise consumers promote each K tile's partial sum (blockwise_promotion_sm90.cuh): after its
// wgmma and before the next tile's (kSerial, CUTLASS's), or while the next tile's wgmma runs (kOverlap: kLarge
// and kSmall only; the same bits).
enum class Fp8Promotion { kSerial, kOverlap };

// The FP8 column quantisation's kernel (quant_cols.cu): 16-byte packs, 128 columns a block (kPacked, for 2-byte
// inputs whose rows move as packs), or one element a load, 64 columns a block (kStaged, any input).
enum class QuantCols { kPacked, kStaged };

enum class Cluster { k1x2, k2x1, kAuto };
// How a grouped GEMM's TMA descriptors follow its groups: CUTLASS's rewrite of the CTA's at every group change, one
// a group made once per call (prepared_descriptors_sm90.cuh), or one for every group (ragged_tma_sm90.cuh).
enum class Descriptors { kRewrite, kPrepared, kRagged };
enum class Balance { kAuto, kBalanced, kSkewed };

// ------------------------------------------------------------------------------------ overrides

// One environment override: unset, a value, or the error a bad value raises. The error is raised where the
// override is consulted (get()), so a bad value fails exactly the calls that would have read the variable.
template <class E>
class Override {
 public:
  Override() = default;
  explicit Override(E value) : value_(value) {}
  static Override bad(std::string message) {
    Override o;
    o.error_ = std::move(message);
    return o;
  }
  std::optional<E> get() const {
    if (!error_.empty()) fail(error_);
    return value_;
  }

 private:
  std::optional<E> value_;
  std::string error_;
};

// For tile sweeps (bench/bench_gemm.py --tiles, --fp8-tiles, --schedules) and tests.
struct Sm90Overrides {
  Override<Tile> tile;  // MOE8_SM90_TILE=large|solo|m2|pong128|tall|epi64|epi64solo: every bf16 GEMM's large tile
  Override<Fp8Tile> fp8_tile;            // MOE8_SM90_FP8_TILE=large|solo|m2|small: every FP8 forward and wgrad
  Override<Fp8Promotion> fp8_promotion;  // MOE8_SM90_FP8_PROMOTION=serial|overlap: every FP8 forward and wgrad
  Override<Cluster> cluster;             // MOE8_SM90_CLUSTER=1x2|2x1|auto: the bf16 large tile's cluster (TILE wins)
  Override<bool> along_n;                // MOE8_SM90_RASTER=m|n: tile order down M (false) or along N first
  Override<int> swizzle;                 // MOE8_SM90_SWIZZLE=1|2|4|8: cluster columns per band of that order
  Override<Balance> balance;             // MOE8_SM90_BALANCE=auto|balanced|skewed: the routing-balance hint
  Override<int> gather_warps;      // MOE8_SM90_GATHER_WARPS=1|2: the producer warps copying a gathered forward's rows
  Override<QuantCols> quant_cols;  // MOE8_QUANT_COLS=packed|staged: the FP8 column quantisation's kernel
  Override<int> epilogue;     // MOE8_SM90_EPILOGUE=32|64: the bf16 128x256 tiles' epilogue subtile width (default 64)
  Override<bool> wgrad_pong;  // MOE8_SM90_WGRAD=pong|large: every bf16 weight gradient on ping-pong or not (wgrad_tile)
  // MOE8_SM90_PREPARED_STORE=0|1|ragged: D's descriptors rewritten per group change, made once per call, or one for
  // every group (prepared)
  Override<Descriptors> prepared_store;
  Override<Descriptors> prepared_loads;  // MOE8_SM90_PREPARED_LOADS=0|1|ragged: A's and B's (prepared)
  Override<bool> acquire_at_store;       // MOE8_SM90_PREPARED_ACQUIRE=mainloop|store: where D's is acquired (prepared)
};

// The value `v` of environment variable `var` among `names` (unset when v is null); any other value gives
// the error naming the variable and the expected names.
template <class E, size_t N>
Override<E> parse_choice(const char* var, const char* v, const std::pair<const char*, E> (&names)[N]) {
  if (v == nullptr) return {};
  std::string expected;
  for (const auto& [name, value] : names) {
    if (std::strcmp(v, name) == 0) return Override<E>(value);
    expected += (expected.empty() ? "" : ", ") + std::string(name);
  }
  return Override<E>::bad(str_cat(var, ": expected one of ", expected, ", got '", v, "'"));
}

// getenv: const char* (const char* name), null when unset.
template <class Getenv>
Sm90Overrides parse_sm90_overrides(Getenv&& getenv) {
  constexpr std::pair<const char*, Tile> kTiles[] = {
      {"large", Tile::kLarge},        {"solo", Tile::kSolo}, {"m2", Tile::kM2},
      {"pong128", Tile::kPong128},    {"tall", Tile::kTall}, {"epi64", Tile::kEpi64},
      {"epi64solo", Tile::kEpi64Solo}};
  constexpr std::pair<const char*, Fp8Tile> kFp8Tiles[] = {
      {"large", Fp8Tile::kLarge}, {"solo", Fp8Tile::kSolo}, {"m2", Fp8Tile::kM2}, {"small", Fp8Tile::kSmall}};
  constexpr std::pair<const char*, Fp8Promotion> kFp8Promotions[] = {{"serial", Fp8Promotion::kSerial},
                                                                     {"overlap", Fp8Promotion::kOverlap}};
  constexpr std::pair<const char*, Cluster> kClusters[] = {
      {"1x2", Cluster::k1x2}, {"2x1", Cluster::k2x1}, {"auto", Cluster::kAuto}};
  constexpr std::pair<const char*, bool> kRaster[] = {{"m", false}, {"n", true}};
  constexpr std::pair<const char*, int> kSwizzle[] = {{"1", 1}, {"2", 2}, {"4", 4}, {"8", 8}};
  constexpr std::pair<const char*, Balance> kBalance[] = {
      {"auto", Balance::kAuto}, {"balanced", Balance::kBalanced}, {"skewed", Balance::kSkewed}};
  constexpr std::pair<const char*, int> kGatherWarps[] = {{"1", 1}, {"2", 2}};
  constexpr std::pair<const char*, int> kEpilogue[] = {{"32", 32}, {"64", 64}};
  constexpr std::pair<const char*, QuantCols> kQuantCols[] = {{"packed", QuantCols::kPacked},
                                                              {"staged", QuantCols::kStaged}};
  constexpr std::pair<const char*, bool> kWgrad[] = {{"pong", true}, {"large", false}};
  constexpr std::pair<const char*, Descriptors> kDescriptors[] = {
      {"0", Descriptors::kRewrite}, {"1", Descriptors::kPrepared}, {"ragged", Descriptors::kRagged}};
  constexpr std::pair<const char*, bool> kAcquire[] = {{"mainloop", false}, {"store", true}};
  auto read = [&](const char* var, const auto& names) { return parse_choice(var, getenv(var), names); };
  Sm90Overrides o;
  o.tile = read("MOE8_SM90_TILE", kTiles);
  o.fp8_tile = read("MOE8_SM90_FP8_TILE", kFp8Tiles);
  o.fp8_promotion = read("MOE8_SM90_FP8_PROMOTION", kFp8Promotions);
  o.cluster = read("MOE8_SM90_CLUSTER", kClusters);
  o.along_n = read("MOE8_SM90_RASTER", kRaster);
  o.swizzle = read("MOE8_SM90_SWIZZLE", kSwizzle);
  o.balance = read("MOE8_SM90_BALANCE", kBalance);
  o.gather_warps = read("MOE8_SM90_GATHER_WARPS", kGatherWarps);
  o.quant_cols = read("MOE8_QUANT_COLS", kQuantCols);
  o.epilogue = read("MOE8_SM90_EPILOGUE", kEpilogue);
  o.wgrad_pong = read("MOE8_SM90_WGRAD", kWgrad);
  o.prepared_store = read("MOE8_SM90_PREPARED_STORE", kDescriptors);
  o.prepared_loads = read("MOE8_SM90_PREPARED_LOADS", kDescriptors);
  o.acquire_at_store = read("MOE8_SM90_PREPARED_ACQUIRE", kAcquire);
  return o;
}

namespace detail {
struct OverrideStore {
  std::mutex mu;
  std::deque<Sm90Overrides> parsed;  // every parse is kept, so a reference handed out stays valid
  std::atomic<const Sm90Overrides*> current{nullptr};
  OverrideStore() { reload(); }
  void reload() {
    std::lock_guard<std::mutex> lock(mu);
    parsed.push_back(parse_sm90_overrides([](const char* var) { return std::getenv(var); }));
    current.store(&parsed.back(), std::memory_order_release);
  }
};
inline OverrideStore& override_store() {
  static OverrideStore store;  // parsed on first use; thread-safe initialisation
  return store;
}
}  // namespace detail

// The process's overrides, read from the environment once, on first use.
inline const Sm90Overrides& sm90_overrides() {
  return *detail::override_store().current.load(std::memory_order_acquire);
}

// Reads the environment again. For tests that change the overrides between calls; nothing else calls it.
inline void reload_sm90_overrides() { detail::override_store().reload(); }

// ------------------------------------------------------------------------------- bf16 / f16 tiles

// Average rows per expert up to which the forward and dgrad take the 64x128 ping-pong tile.
constexpr int64_t kSmallRowsPerGroup = 128;
// The GEMM's N up to which bf16 takes the 128x32 tile: a 256-wide tile would compute 16 columns per one kept.
constexpr int64_t kThinN = 32;
// MOE8_SM90_CLUSTER=auto pairs along M where both sides of the weight are at most this wide.
constexpr int64_t kAutoM2Width = 2048;
// The weight gradient's ping-pong default by shape: at least this many experts, at most this many 128x128 tiles, at
// most this many rows per expert on average (the GEMM's K). From 256 rows up (measured 256-2,048) the 128x256 tiles
// with 128x64 epilogue subtiles won in 20 of 24 weight gradients at Qwen3-30B-A3B's and OLMoE's widths, and the
// Qwen3-30B-A3B block was 4-5% faster on them on three H100s (docs/kernels.md); fewer rows were not measured again.
constexpr int kPongWgradMinGroups = 16;
constexpr int64_t kPongWgradMaxRowsPerGroup = 128;
constexpr int64_t kPongWgradMaxTiles = 40000;
// Past kPongWgradMaxTiles (large weights: DeepSeek-V3's 458k tiles) ping-pong wins with balanced routing up to this
// many rows per expert: 12-14% at 512 rows against the 128x64-subtile tiles (H200), while skewed it loses 6-9%.
constexpr int64_t kPongWgradBalancedMaxRowsPerGroup = 1536;

inline bool small_rows(int64_t rows, int groups) { return groups > 0 && rows <= kSmallRowsPerGroup * groups; }

// An odd number of 256-wide tiles along N: a 1x2 cluster would leave a tile of each group's grid idle.
inline bool odd_large_tiles(int64_t n) { return ((n + 255) / 256) % 2 == 1; }

// The tile of a GEMM that takes neither the small nor the thin tile. n: the GEMM's N; k: the weight's other
// side; pong: the ping-pong default of the weight gradient (wgrad_pong).
inline Tile large_tile(bool bf16, int64_t n, int64_t k, bool pong, const Sm90Overrides& env) {
  const Tile plain = odd_large_tiles(n) ? Tile::kSolo : Tile::kLarge;
  if (!bf16) return plain;
  if (const std::optional<Tile> forced = env.tile.get()) return *forced;
  const std::optional<Cluster> cluster = env.cluster.get();
  if (!cluster) return pong ? Tile::kPong128 : plain;
  switch (*cluster) {
    case Cluster::k1x2:
      return plain;
    case Cluster::k2x1:
      return Tile::kM2;
    case Cluster::kAuto:
      break;
  }
  return n <= kAutoM2Width && k <= kAutoM2Width ? Tile::kM2 : plain;
}

// The tile a GEMM of N = n launches, given whether it has few rows per expert (small) and large_tile's choice.
inline Tile pick_tile(bool bf16, int64_t n, bool small, Tile large) {
  if (bf16) {
    if (n <= kThinN) return Tile::kThin;
    if (!small && (large == Tile::kM2 || large == Tile::kPong128 || large == Tile::kTall || large == Tile::kEpi64 ||
                   large == Tile::kEpi64Solo))
      return large;
  }
  if (small) return Tile::kSmall;
  return large == Tile::kSolo ? Tile::kSolo : Tile::kLarge;
}

// The epilogue subtile width of the bf16 128x256 tiles: 128x64, half the barriers and store waits of CUTLASS's
// 128x32 for 16 KB more shared memory (still four mainloop stages). On H100s it was faster in 27 of 28 GEMMs at the
// Qwen3-30B-A3B, OLMoE and Mixtral-8x7B widths (1-5%; level in one) and the Qwen3-30B-A3B and OLMoE blocks 0.2-1.8%
// faster (docs/kernels.md). The same bits: only the stores differ.
constexpr int kEpilogueWidth = 64;

// tile with 128x64 epilogue subtiles where it is a bf16 128x256 tile the rules picked, unless MOE8_SM90_EPILOGUE=32
// asks for CUTLASS's; a tile forced by MOE8_SM90_TILE is kept as it is.
inline Tile with_epilogue(Tile tile, bool bf16, const Sm90Overrides& env) {
  if (!bf16 || env.tile.get() || env.epilogue.get().value_or(kEpilogueWidth) != 64) return tile;
  if (tile == Tile::kLarge) return Tile::kEpi64;
  return tile == Tile::kSolo ? Tile::kEpi64Solo : tile;
}

// Forward (c = a · b^T) and dgrad (c = a · b): rows ragged, c [rows, n], kd the reduction.
inline Tile rows_tile(bool bf16, int64_t n, int64_t kd, int64_t rows, int groups, const Sm90Overrides& env) {
  return with_epilogue(pick_tile(bf16, n, small_rows(rows, groups), large_tile(bf16, n, kd, false, env)), bf16, env);
}

// The down projection's dgrad with the routed SwiGLU backward in its epilogue (grouped_gemm_act_sm90.cu), which
// has the 128x256 cooperative tiles and the 128x128 ping-pong one: cooperative (without the cluster for an odd
// number of 256-wide tiles) unless MOE8_SM90_TILE says pong128 (1.91 against 1.34 ms at Qwen3-30B-A3B's shape:
// one warpgroup's epilogue keeps too few of h's bytes in flight to hide behind the other's mainloop,
// docs/kernels.md); none (the plain dgrad and the separate pass) for few rows per expert, a thin N, or another
// forced tile.
inline std::optional<Tile> act_dgrad_tile(int64_t n, int64_t rows, int groups, const Sm90Overrides& env) {
  if (small_rows(rows, groups) || n <= kThinN) return std::nullopt;
  const Tile plain = odd_large_tiles(n) ? Tile::kSolo : Tile::kLarge;
  const std::optional<Tile> forced = env.tile.get();
  if (!forced || *forced == Tile::kLarge) return plain;
  if (*forced == Tile::kSolo || *forced == Tile::kPong128) return *forced;
  return std::nullopt;
}

// The 128x128 output tiles of the weight gradient db [groups, n, kd].
inline int64_t wgrad_pong_tiles(int groups, int64_t n, int64_t kd) {
  return groups * ((n + 127) / 128) * ((kd + 127) / 128);
}
// Whether the weight gradient db [groups, n, kd] over `rows` rows takes the 128x128 ping-pong tile by its shape
// alone: enough experts of few rows each, at most kPongWgradMaxTiles 128x128 output tiles.
inline bool wgrad_pong(int groups, int64_t rows, int64_t n, int64_t kd) {
  return groups >= kPongWgradMinGroups && rows <= kPongWgradMaxRowsPerGroup * groups &&
         wgrad_pong_tiles(groups, n, kd) <= kPongWgradMaxTiles;
}
// Whether the routing-balance hint is worth consulting for it (then a balanced answer means ping-pong): large
// weights (past kPongWgradMaxTiles) of enough experts, at most kPongWgradBalancedMaxRowsPerGroup rows each.
inline bool wgrad_pong_if_balanced(int groups, int64_t rows, int64_t n, int64_t kd) {
  return groups >= kPongWgradMinGroups && rows <= kPongWgradBalancedMaxRowsPerGroup * groups &&
         wgrad_pong_tiles(groups, n, kd) > kPongWgradMaxTiles;
}

// The weight gradient db [groups, n, kd]: the GEMM's N is kd and its M the weight's other side n. pong: the
// rules' ping-pong answer (wgrad_pong, or the balance hint), which MOE8_SM90_WGRAD replaces for bf16.
inline Tile wgrad_tile(bool bf16, int64_t n, int64_t kd, bool pong, const Sm90Overrides& env) {
  if (bf16) pong = env.wgrad_pong.get().value_or(pong);
  return with_epilogue(pick_tile(bf16, kd, false, large_tile(bf16, kd, n, pong, env)), bf16, env);
}

// ------------------------------------------------------------------------------------- FP8 tiles

// Average rows per expert up to which the FP8 forward takes the small tile (the bf16 rule, carried over).
constexpr int64_t kFp8SmallRowsPerGroup = 128;

inline Fp8Tile fp8_forward_tile(int64_t n, int64_t rows, int groups, const Sm90Overrides& env) {
  if (const std::optional<Fp8Tile> forced = env.fp8_tile.get()) return *forced;
  if (groups > 0 && rows <= kFp8SmallRowsPerGroup * groups) return Fp8Tile::kSmall;
  return ((n + 127) / 128) % 2 == 1 ? Fp8Tile::kSolo : Fp8Tile::kLarge;  // odd 128-wide tiles: no cluster
}

// The FP8 GEMMs' promotion on `tile` (the one fp8_forward_tile or fp8_wgrad_tile chose): overlapped for the weight
// gradient (whose operands both carry scales, twice the forward's promotion work: 6-12% faster on an H100 at
// Mixtral-8x7B's and Qwen3-30B-A3B's shapes), serial for the forward and dgrad (level there), unless overridden;
// tiles without an overlapped build stay serial.
inline Fp8Promotion fp8_promotion(Fp8Tile tile, bool wgrad, const Sm90Overrides& env) {
  const Fp8Promotion p = env.fp8_promotion.get().value_or(wgrad ? Fp8Promotion::kOverlap : Fp8Promotion::kSerial);
  return tile == Fp8Tile::kLarge || tile == Fp8Tile::kSmall ? p : Fp8Promotion::kSerial;
}

// The FP8 weight gradient keeps the 1x2 cluster at every shape (robust under skewed routing).
inline Fp8Tile fp8_wgrad_tile(const Sm90Overrides& env) { return env.fp8_tile.get().value_or(Fp8Tile::kLarge); }

// ------------------------------------------------------------------------------------ prepared descriptors

// Which of a bf16 GEMM's (forward, dgrad, weight gradient) TMA descriptors are made once per call, one a group
// (prepared_descriptors_sm90.cuh), instead of CUTLASS's rewrite of one descriptor per CTA at every group change.
struct Prepared {
  bool store = false;  // D's: CUTLASS's rewrite stalls the consumers before the next tile's first wgmma
  bool loads = false;  // A's and B's: rewritten by the producer warp, ahead of the consumers
  // D's acquired right before the tile's first store (where CUTLASS acquires its rewritten one), prefetched before
  // the tile's mainloop, instead of both before the mainloop (opt-in until timed)
  bool acquire_at_store = false;
  // D stored through one descriptor for every group, the group's rows in the stores' coordinates
  // (ragged_tma_sm90.cuh): no descriptor per group at all (in place of store)
  bool ragged = false;
  bool ragged_loads = false;  // A and B read the same way, one descriptor each (in place of loads)
  bool any() const { return store || loads || ragged || ragged_loads; }
};

// The 128x64-subtile 128x256 tiles only. All three ragged by default: on an H100 1-5% off 39 of 40 bf16 GEMMs
// against CUTLASS's rewrite of all three, level in one (bench/results/ragged_descriptors_h100.md). The mixes whose
// kernel takes prepared or ragged descriptors for D but leaves A's and B's to CUTLASS's rewrite (D set, A and B 0)
// stopped with an illegal instruction in the producer warp on an H100: CUTLASS's rewrite writes through an asm input
// operand the compiler had shared with the mainloop wrapper's null ragged pointer (the same file). They raise.
inline Prepared prepared(Tile tile, const Sm90Overrides& env) {
  if (tile != Tile::kEpi64 && tile != Tile::kEpi64Solo) return {};
  const Descriptors d = env.prepared_store.get().value_or(Descriptors::kRagged);
  const Descriptors ab = env.prepared_loads.get().value_or(Descriptors::kRagged);
  MOE8_CHECK(d == Descriptors::kRewrite || ab != Descriptors::kRewrite,
             "MOE8_SM90_PREPARED_LOADS=0 (CUTLASS's rewrite of A's and B's descriptors) needs "
             "MOE8_SM90_PREPARED_STORE=0: with D's descriptors prepared or ragged, A's and B's are too (1 or ragged)");
  return {d == Descriptors::kPrepared, ab == Descriptors::kPrepared, env.acquire_at_store.get().value_or(false),
          d == Descriptors::kRagged, ab == Descriptors::kRagged};
}

// How the FP8 forward and weight-gradient GEMMs (every tile) store D: through one ragged descriptor by default, 1-7%
// faster than CUTLASS's rewrite in all 20 FP8 GEMMs on an H100 (bench/results/ragged_descriptors_h100.md); through
// per-group descriptors made once per call (MOE8_SM90_PREPARED_STORE=1) Qwen3-30B-A3B's down projection lost
// 10-16% (bench/results/prepared_descriptors_h100.md). Their loads are CUTLASS's.
inline Prepared fp8_prepared(const Sm90Overrides& env) {
  const Descriptors d = env.prepared_store.get().value_or(Descriptors::kRagged);
  return {d == Descriptors::kPrepared, false, env.acquire_at_store.get().value_or(false), d == Descriptors::kRagged};
}

// ------------------------------------------------------------------------------------ gathered rows

// The producer warps that copy the rows of the forward GEMM gathered inside its load (gathered_rows_sm90.cuh):
// one (the mainloop warp) unless overridden, as the second warp's copies have not been timed yet.
inline int gather_load_warps(const Sm90Overrides& env) { return env.gather_warps.get().value_or(1); }

// ------------------------------------------------------------------------------------ column quantisation

// The packed kernel wherever it applies (quant_cols.cu decides that), unless overridden for a comparison.
inline QuantCols quant_cols_kernel(const Sm90Overrides& env) {
  return env.quant_cols.get().value_or(QuantCols::kPacked);
}

// ------------------------------------------------------------------------------------ tile order

// The order in which the persistent group scheduler hands out each group's output tiles (CUTLASS's
// PersistentTileSchedulerSm90Group): along_n false walks down a band of `swizzle` cluster columns along M
// first (CUTLASS's grouped default, AlongM with swizzle 1), true walks along N first. Only which tiles are in
// flight together changes (what shares L2), never any element's arithmetic.
struct Schedule {
  bool along_n = false;
  int swizzle = 1;
};

// Forward and dgrad: bands of kWideSwizzle clusters down M for a very wide N with many rows per expert
// (the scheduler pads each group's grid to whole bands, so few rows would lose it again).
constexpr int64_t kSwizzleMinN = 16384;
constexpr int64_t kSwizzleMinRowsPerGroup = 2048;
constexpr int kWideSwizzle = 8;
// Weight gradient on the ping-pong tile: along N first where the weight's output side is this wide.
constexpr int64_t kPongAlongNMinM = 2560;

inline Schedule rows_schedule(int64_t n, int64_t rows, int groups) {
  const bool wide = n >= kSwizzleMinN && rows >= kSwizzleMinRowsPerGroup * groups;
  return {false, wide ? kWideSwizzle : 1};
}

// tile: the one wgrad_tile chose; n: the weight's output side (the GEMM's M).
inline Schedule wgrad_schedule(Tile tile, int64_t n) { return {tile == Tile::kPong128 && n >= kPongAlongNMinM, 1}; }

// The FP8 GEMMs keep CUTLASS's order: Schedule{}.

// s after MOE8_SM90_RASTER and MOE8_SM90_SWIZZLE.
inline Schedule with_overrides(Schedule s, const Sm90Overrides& env) {
  if (const std::optional<bool> along_n = env.along_n.get()) s.along_n = *along_n;
  if (const std::optional<int> swizzle = env.swizzle.get()) s.swizzle = *swizzle;
  return s;
}

}  // namespace moe8::cuda::sm90_heuristics
