// test_sm90_heuristics.cpp — the sm_90a grouped GEMMs' shape rules (cuda/sm90_heuristics.h) at the shapes
// of real MoE models, and the parsing of their environment overrides. Plain C++: runs in the CPU build too.
// Model widths: Qwen3-30B-A3B (E 128, H 2048, I 768), GPT-OSS-20B (E 32, H 2880, I 2880), DeepSeek-V3
// (E 256, H 7168, I 2048), Mixtral-8x7B (E 8, H 4096, I 14336).
#include <cstdlib>
#include <map>
#include <string>

#include "cuda/sm90_heuristics.h"
#include "test_util.h"

namespace moe8::test {
namespace {

namespace h = cuda::sm90_heuristics;
using h::Fp8Promotion;
using h::Fp8Tile;
using h::Tile;

// Overrides from a fixed environment (the process's own is not touched).
h::Sm90Overrides overrides(const std::map<std::string, std::string>& env) {
  return h::parse_sm90_overrides([&](const char* var) -> const char* {
    const auto it = env.find(var);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

const h::Sm90Overrides kNone = overrides({});

TEST(Sm90Heuristics, ForwardAndDgradTiles) {
  // Qwen3 at 4096 tokens, top-8: 256 rows per expert.
  // The 128x256 tiles of bf16 store 128x64 epilogue subtiles (kEpi64, kEpi64Solo); f16 keeps CUTLASS's.
  const int64_t rows = 4096 * 8;
  EXPECT_EQ(h::rows_tile(true, 1536, 2048, rows, 128, kNone), Tile::kEpi64);     // gate_up forward: 6 tiles of N
  EXPECT_EQ(h::rows_tile(true, 2048, 768, rows, 128, kNone), Tile::kEpi64);      // down forward: 8
  EXPECT_EQ(h::rows_tile(true, 768, 2048, rows, 128, kNone), Tile::kEpi64Solo);  // down dgrad: 3, odd
  EXPECT_EQ(h::rows_tile(false, 768, 2048, rows, 128, kNone), Tile::kSolo);      // f16 alike
  // 128 rows per expert or fewer: the small tile, bf16 or f16; a rank-sized N: the thin tile, bf16 only.
  EXPECT_EQ(h::rows_tile(true, 1536, 2048, 128 * 128, 128, kNone), Tile::kSmall);
  EXPECT_EQ(h::rows_tile(true, 1536, 2048, 128 * 128 + 1, 128, kNone), Tile::kEpi64);
  EXPECT_EQ(h::rows_tile(false, 1536, 2048, 64, 128, kNone), Tile::kSmall);
  EXPECT_EQ(h::rows_tile(true, 16, 2048, rows, 128, kNone), Tile::kThin);
  EXPECT_EQ(h::rows_tile(true, 32, 2048, 64, 128, kNone), Tile::kThin);
  EXPECT_EQ(h::rows_tile(false, 16, 2048, rows, 128, kNone), Tile::kSolo);  // f16: no thin tile; one 256-wide tile
  EXPECT_EQ(h::rows_tile(true, 1536, 2048, 0, 0, kNone), Tile::kEpi64);     // no groups: never small
}

TEST(Sm90Heuristics, ClusterAndForcedTiles) {
  const int64_t rows = 4096 * 8;
  const h::Sm90Overrides m2 = overrides({{"MOE8_SM90_CLUSTER", "2x1"}});
  const h::Sm90Overrides autom = overrides({{"MOE8_SM90_CLUSTER", "auto"}});
  const h::Sm90Overrides n2 = overrides({{"MOE8_SM90_CLUSTER", "1x2"}});
  EXPECT_EQ(h::rows_tile(true, 768, 2048, rows, 128, m2), Tile::kM2);
  EXPECT_EQ(h::rows_tile(true, 1536, 2048, rows, 128, autom), Tile::kM2);         // Qwen3: both sides <= 2048
  EXPECT_EQ(h::rows_tile(true, 5760, 2880, rows, 32, autom), Tile::kEpi64Solo);   // GPT-OSS: 23 tiles of N, odd
  EXPECT_EQ(h::rows_tile(true, 2048, 7168, 2 * rows, 256, autom), Tile::kEpi64);  // DeepSeek-V3 down
  EXPECT_EQ(h::rows_tile(true, 1536, 2048, 64, 128, m2), Tile::kSmall);           // small and thin come first
  EXPECT_EQ(h::rows_tile(true, 32, 2048, rows, 128, m2), Tile::kThin);
  EXPECT_EQ(h::rows_tile(false, 1536, 2048, rows, 128, m2), Tile::kLarge);  // f16 reads neither variable
  // MOE8_SM90_TILE wins over MOE8_SM90_CLUSTER.
  const h::Sm90Overrides tall = overrides({{"MOE8_SM90_TILE", "tall"}, {"MOE8_SM90_CLUSTER", "2x1"}});
  EXPECT_EQ(h::rows_tile(true, 1536, 2048, rows, 128, tall), Tile::kTall);
  EXPECT_EQ(h::rows_tile(true, 1536, 2048, rows, 128, overrides({{"MOE8_SM90_TILE", "solo"}})), Tile::kSolo);
  EXPECT_EQ(h::rows_tile(true, 1536, 2048, rows, 128, overrides({{"MOE8_SM90_TILE", "pong128"}})), Tile::kPong128);
  EXPECT_EQ(h::rows_tile(true, 1536, 2048, rows, 128, overrides({{"MOE8_SM90_TILE", "epi64"}})), Tile::kEpi64);
  EXPECT_EQ(h::wgrad_tile(true, 1536, 2048, true, overrides({{"MOE8_SM90_TILE", "epi64"}})), Tile::kEpi64);
  EXPECT_EQ(h::rows_tile(false, 1536, 2048, rows, 128, overrides({{"MOE8_SM90_TILE", "epi64"}})), Tile::kLarge);
  // A forced tile is kept as it is: MOE8_SM90_TILE=large gives CUTLASS's 128x32 epilogue subtiles.
  EXPECT_EQ(h::rows_tile(true, 1536, 2048, rows, 128, overrides({{"MOE8_SM90_TILE", "large"}})), Tile::kLarge);
  EXPECT_EQ(
      h::wgrad_tile(true, 768, 2048, false, overrides({{"MOE8_SM90_TILE", "large"}, {"MOE8_SM90_EPILOGUE", "64"}})),
      Tile::kLarge);
  // MOE8_SM90_EPILOGUE=64 (the default): the heuristics' 128x256 tile, paired or not, with 128x64 epilogue
  // subtiles; others kept. =32: CUTLASS's 128x32.
  const h::Sm90Overrides e64 = overrides({{"MOE8_SM90_EPILOGUE", "64"}});
  EXPECT_EQ(h::rows_tile(true, 1536, 2048, rows, 128, e64), Tile::kEpi64);
  EXPECT_EQ(h::rows_tile(true, 768, 2048, rows, 128, e64), Tile::kEpi64Solo);  // 3 tiles along N: no pair
  EXPECT_EQ(h::rows_tile(true, 1536, 2048, 64, 128, e64), Tile::kSmall);
  EXPECT_EQ(h::rows_tile(false, 1536, 2048, rows, 128, e64), Tile::kLarge);
  EXPECT_EQ(h::wgrad_tile(true, 1536, 2048, true, e64), Tile::kPong128);
  EXPECT_EQ(h::wgrad_tile(true, 1536, 2048, false, e64), Tile::kEpi64);
  const h::Sm90Overrides e32 = overrides({{"MOE8_SM90_EPILOGUE", "32"}});
  EXPECT_EQ(h::rows_tile(true, 1536, 2048, rows, 128, e32), Tile::kLarge);
  EXPECT_EQ(h::rows_tile(true, 768, 2048, rows, 128, e32), Tile::kSolo);
  EXPECT_EQ(h::wgrad_tile(true, 768, 2048, false, e32), Tile::kLarge);
  // Pinning the 1x2 cluster keeps the weight gradient off its ping-pong default.
  EXPECT_EQ(h::wgrad_tile(true, 1536, 2048, true, n2), Tile::kEpi64);
}

TEST(Sm90Heuristics, FusedActDgradTiles) {
  const int64_t rows = 4096 * 8;                                      // Qwen3 at 4096 tokens: 256 rows per expert
  EXPECT_EQ(h::act_dgrad_tile(768, rows, 128, kNone), Tile::kSolo);   // Qwen3: 3 tiles of 256
  EXPECT_EQ(h::act_dgrad_tile(1024, rows, 64, kNone), Tile::kLarge);  // OLMoE: 4
  EXPECT_EQ(h::act_dgrad_tile(768, rows, 128, overrides({{"MOE8_SM90_TILE", "large"}})), Tile::kSolo);  // 3 tiles
  EXPECT_EQ(h::act_dgrad_tile(1024, rows, 64, overrides({{"MOE8_SM90_TILE", "large"}})), Tile::kLarge);
  EXPECT_EQ(h::act_dgrad_tile(1024, rows, 64, overrides({{"MOE8_SM90_TILE", "solo"}})), Tile::kSolo);
  EXPECT_EQ(h::act_dgrad_tile(768, rows, 128, overrides({{"MOE8_SM90_TILE", "pong128"}})), Tile::kPong128);
  EXPECT_FALSE(h::act_dgrad_tile(768, rows, 128, overrides({{"MOE8_SM90_TILE", "tall"}})).has_value());
  EXPECT_FALSE(h::act_dgrad_tile(768, 128 * 128, 128, kNone).has_value());  // few rows per expert
  EXPECT_FALSE(h::act_dgrad_tile(32, rows, 128, kNone).has_value());        // thin
}

TEST(Sm90Heuristics, WgradTiles) {
  // Ping-pong by shape only for many experts of few rows (<= 128 on average) and at most 40,000 128x128 tiles:
  // not Qwen3-30B-A3B at 16,384 tokens (1,024 rows per expert) nor at 2,048 (128 experts of 128 rows: yes), not
  // OLMoE (2,048), GPT-OSS (2,048), DeepSeek-V3 (458k tiles) nor Mixtral (8 experts).
  const int64_t tokens = 16384;
  EXPECT_FALSE(h::wgrad_pong(128, tokens * 8, 1536, 2048));
  EXPECT_FALSE(h::wgrad_pong(128, tokens * 8, 2048, 768));
  EXPECT_FALSE(h::wgrad_pong(128, 4096 * 8, 1536, 2048));  // 256 rows per expert
  EXPECT_TRUE(h::wgrad_pong(128, 2048 * 8, 1536, 2048));
  EXPECT_TRUE(h::wgrad_pong(128, 2048 * 8, 2048, 768));
  EXPECT_FALSE(h::wgrad_pong(64, tokens * 8, 2048, 2048));
  EXPECT_TRUE(h::wgrad_pong(64, 1024 * 8, 2048, 2048));
  EXPECT_FALSE(h::wgrad_pong(32, tokens * 2, 2880, 2880));
  EXPECT_FALSE(h::wgrad_pong(8, 512 * 2, 28672, 4096));    // 8 experts
  EXPECT_FALSE(h::wgrad_pong(256, 4096 * 8, 4096, 7168));  // 128 rows per expert, but 458k tiles
  // The balance hint: only for large weights (past 40,000 tiles) of at most 1,536 rows per expert: DeepSeek-V3 at
  // 16,384 tokens (512 rows), not Qwen3-30B-A3B (small weights), OLMoE nor Mixtral.
  EXPECT_TRUE(h::wgrad_pong_if_balanced(256, tokens * 8, 4096, 7168));
  EXPECT_TRUE(h::wgrad_pong_if_balanced(256, tokens * 8, 7168, 2048));
  EXPECT_FALSE(h::wgrad_pong_if_balanced(256, tokens * 8 * 4, 4096, 7168));  // 2,048 rows per expert
  EXPECT_FALSE(h::wgrad_pong_if_balanced(128, tokens * 8, 1536, 2048));
  EXPECT_FALSE(h::wgrad_pong_if_balanced(64, tokens * 8, 2048, 2048));
  EXPECT_FALSE(h::wgrad_pong_if_balanced(8, tokens * 2, 28672, 4096));
  EXPECT_EQ(h::wgrad_tile(true, 1536, 2048, true, kNone), Tile::kPong128);
  EXPECT_EQ(h::wgrad_tile(true, 4096, 7168, false, kNone), Tile::kEpi64);     // 28 tiles of the GEMM's N (kd)
  EXPECT_EQ(h::wgrad_tile(true, 2048, 768, false, kNone), Tile::kEpi64Solo);  // kd 768: 3 tiles
  EXPECT_EQ(h::wgrad_tile(false, 1536, 2048, true, kNone), Tile::kLarge);     // f16: no ping-pong tile
  EXPECT_EQ(h::wgrad_tile(true, 1536, 16, false, kNone), Tile::kThin);        // the LoRA A gradient's kd = r
  // Descriptors made once per call or ragged: all three ragged by default on the 128x64-subtile 128x256 tiles only;
  // D's prepared or ragged with A's and B's left to CUTLASS's rewrite raises.
  auto is = [](h::Prepared p, bool store, bool loads, bool ragged, bool ragged_loads) {
    return p.store == store && p.loads == loads && p.ragged == ragged && p.ragged_loads == ragged_loads;
  };
  auto with = [&](const char* store, const char* loads) {
    return overrides({{"MOE8_SM90_PREPARED_STORE", store}, {"MOE8_SM90_PREPARED_LOADS", loads}});
  };
  EXPECT_TRUE(is(h::prepared(Tile::kEpi64, kNone), false, false, true, true));
  EXPECT_TRUE(is(h::prepared(Tile::kEpi64Solo, kNone), false, false, true, true));
  EXPECT_TRUE(is(h::prepared(Tile::kEpi64, with("1", "1")), true, true, false, false));
  EXPECT_TRUE(is(h::prepared(Tile::kEpi64, with("1", "ragged")), true, false, false, true));
  EXPECT_TRUE(is(h::prepared(Tile::kEpi64, with("0", "1")), false, true, false, false));
  EXPECT_TRUE(is(h::prepared(Tile::kEpi64Solo, with("ragged", "1")), false, true, true, false));
  EXPECT_TRUE(is(h::prepared(Tile::kEpi64, overrides({{"MOE8_SM90_PREPARED_STORE", "0"}})), false, false, false, true));
  EXPECT_FALSE(h::prepared(Tile::kEpi64, with("0", "0")).any());
  for (const char* store : {"1", "ragged"}) EXPECT_THROW(h::prepared(Tile::kEpi64, with(store, "0")), Error);
  EXPECT_THROW(h::prepared(Tile::kEpi64, overrides({{"MOE8_SM90_PREPARED_LOADS", "0"}})), Error);
  for (Tile t : {Tile::kLarge, Tile::kPong128, Tile::kSmall, Tile::kTall}) {
    EXPECT_FALSE(h::prepared(t, kNone).any());
    EXPECT_FALSE(h::prepared(t, with("1", "0")).any());  // not consulted: no error either
  }
  // The FP8 GEMMs' D (their loads are CUTLASS's): ragged by default, by the same variable.
  EXPECT_TRUE(is(h::fp8_prepared(kNone), false, false, true, false));
  EXPECT_TRUE(is(h::fp8_prepared(overrides({{"MOE8_SM90_PREPARED_STORE", "1"}})), true, false, false, false));
  EXPECT_TRUE(is(h::fp8_prepared(overrides({{"MOE8_SM90_PREPARED_STORE", "ragged"}})), false, false, true, false));
  EXPECT_FALSE(h::fp8_prepared(overrides({{"MOE8_SM90_PREPARED_STORE", "0"}})).any());
  // where D's prepared descriptor is acquired: before the mainloop unless MOE8_SM90_PREPARED_ACQUIRE=store
  const h::Sm90Overrides at_store = overrides({{"MOE8_SM90_PREPARED_ACQUIRE", "store"}});
  EXPECT_FALSE(h::prepared(Tile::kEpi64, kNone).acquire_at_store);
  EXPECT_TRUE(h::prepared(Tile::kEpi64, at_store).acquire_at_store);
  EXPECT_TRUE(h::fp8_prepared(at_store).acquire_at_store);
  EXPECT_FALSE(h::prepared(Tile::kEpi64, overrides({{"MOE8_SM90_PREPARED_ACQUIRE", "mainloop"}})).acquire_at_store);
  // MOE8_SM90_WGRAD replaces the rules' ping-pong answer for bf16; the tile forced by MOE8_SM90_TILE still wins.
  const h::Sm90Overrides large = overrides({{"MOE8_SM90_WGRAD", "large"}});
  const h::Sm90Overrides pong = overrides({{"MOE8_SM90_WGRAD", "pong"}});
  EXPECT_EQ(h::wgrad_tile(true, 1536, 2048, true, large), Tile::kEpi64);
  EXPECT_EQ(h::wgrad_tile(true, 2048, 768, true, large), Tile::kEpi64Solo);
  EXPECT_EQ(h::wgrad_tile(true, 4096, 7168, false, pong), Tile::kPong128);
  EXPECT_EQ(h::wgrad_tile(false, 1536, 2048, false, pong), Tile::kLarge);
  EXPECT_EQ(
      h::wgrad_tile(true, 1536, 2048, true, overrides({{"MOE8_SM90_WGRAD", "large"}, {"MOE8_SM90_TILE", "pong128"}})),
      Tile::kPong128);
  EXPECT_EQ(h::wgrad_tile(true, 1536, 16, false, pong), Tile::kThin);
}

TEST(Sm90Heuristics, Fp8Tiles) {
  const int64_t rows = 4096 * 8;
  EXPECT_EQ(h::fp8_forward_tile(1536, rows, 128, kNone), Fp8Tile::kLarge);  // 12 tiles of N
  EXPECT_EQ(h::fp8_forward_tile(5760, rows, 32, kNone), Fp8Tile::kSolo);    // 45, odd
  EXPECT_EQ(h::fp8_forward_tile(2880, rows, 32, kNone), Fp8Tile::kSolo);    // 23
  EXPECT_EQ(h::fp8_forward_tile(1536, 64 * 128, 128, kNone), Fp8Tile::kSmall);
  EXPECT_EQ(h::fp8_wgrad_tile(kNone), Fp8Tile::kLarge);
  const h::Sm90Overrides m2 = overrides({{"MOE8_SM90_FP8_TILE", "m2"}});
  EXPECT_EQ(h::fp8_forward_tile(1536, 64, 128, m2), Fp8Tile::kM2);
  EXPECT_EQ(h::fp8_wgrad_tile(m2), Fp8Tile::kM2);
  EXPECT_EQ(h::fp8_wgrad_tile(overrides({{"MOE8_SM90_FP8_TILE", "small"}})), Fp8Tile::kSmall);
  // The bf16 variables do not reach the FP8 GEMMs.
  EXPECT_EQ(h::fp8_forward_tile(1536, rows, 128, overrides({{"MOE8_SM90_TILE", "wide"}})), Fp8Tile::kLarge);
}

TEST(Sm90Heuristics, Fp8Promotion) {
  // The weight gradient overlapped and the forward / dgrad serial (CUTLASS's consumer) unless
  // MOE8_SM90_FP8_PROMOTION says otherwise; overlapped only where it is built.
  for (Fp8Tile t : {Fp8Tile::kLarge, Fp8Tile::kSolo, Fp8Tile::kM2, Fp8Tile::kSmall})
    EXPECT_EQ(h::fp8_promotion(t, false, kNone), Fp8Promotion::kSerial);
  EXPECT_EQ(h::fp8_promotion(h::fp8_wgrad_tile(kNone), true, kNone), Fp8Promotion::kOverlap);
  EXPECT_EQ(h::fp8_promotion(Fp8Tile::kSmall, true, kNone), Fp8Promotion::kOverlap);
  EXPECT_EQ(h::fp8_promotion(Fp8Tile::kSolo, true, kNone), Fp8Promotion::kSerial);
  const h::Sm90Overrides overlap = overrides({{"MOE8_SM90_FP8_PROMOTION", "overlap"}});
  EXPECT_EQ(h::fp8_promotion(Fp8Tile::kLarge, false, overlap), Fp8Promotion::kOverlap);
  EXPECT_EQ(h::fp8_promotion(Fp8Tile::kSmall, false, overlap), Fp8Promotion::kOverlap);
  EXPECT_EQ(h::fp8_promotion(Fp8Tile::kSolo, false, overlap), Fp8Promotion::kSerial);
  EXPECT_EQ(h::fp8_promotion(Fp8Tile::kM2, true, overlap), Fp8Promotion::kSerial);
  // Mixtral's gate_up forward at 16,384 tokens, top-2, takes the large tile and, asked, overlaps.
  EXPECT_EQ(h::fp8_promotion(h::fp8_forward_tile(28672, 2 * 16384, 8, overlap), false, overlap),
            Fp8Promotion::kOverlap);
  const h::Sm90Overrides serial = overrides({{"MOE8_SM90_FP8_PROMOTION", "serial"}});
  EXPECT_EQ(h::fp8_promotion(Fp8Tile::kLarge, true, serial), Fp8Promotion::kSerial);
}

TEST(Sm90Heuristics, GatherLoadWarps) {
  EXPECT_EQ(h::gather_load_warps(kNone), 1);
  EXPECT_EQ(h::gather_load_warps(overrides({{"MOE8_SM90_GATHER_WARPS", "2"}})), 2);
  EXPECT_EQ(h::gather_load_warps(overrides({{"MOE8_SM90_GATHER_WARPS", "1"}})), 1);
}

TEST(Sm90Heuristics, QuantColsKernel) {
  EXPECT_EQ(h::quant_cols_kernel(kNone), h::QuantCols::kPacked);
  EXPECT_EQ(h::quant_cols_kernel(overrides({{"MOE8_QUANT_COLS", "staged"}})), h::QuantCols::kStaged);
  EXPECT_EQ(h::quant_cols_kernel(overrides({{"MOE8_QUANT_COLS", "packed"}})), h::QuantCols::kPacked);
}

TEST(Sm90Heuristics, Schedules) {
  // Mixtral's gate_up forward (N 28672): bands of 8 clusters once an expert has >= 2048 rows on average.
  h::Schedule s = h::rows_schedule(28672, 8 * 4096, 8);
  EXPECT_FALSE(s.along_n);
  EXPECT_EQ(s.swizzle, 8);
  EXPECT_EQ(h::rows_schedule(28672, 8 * 1024, 8).swizzle, 1);
  EXPECT_EQ(h::rows_schedule(14336, 8 * 4096, 8).swizzle, 1);
  // The ping-pong weight gradient walks along N first where the weight's output side is >= 2560.
  EXPECT_TRUE(h::wgrad_schedule(Tile::kPong128, 5760).along_n);
  EXPECT_TRUE(h::wgrad_schedule(Tile::kPong128, 2880).along_n);
  EXPECT_FALSE(h::wgrad_schedule(Tile::kPong128, 2048).along_n);
  EXPECT_FALSE(h::wgrad_schedule(Tile::kLarge, 5760).along_n);
  EXPECT_EQ(h::wgrad_schedule(Tile::kPong128, 5760).swizzle, 1);
  // MOE8_SM90_RASTER / _SWIZZLE replace what they name.
  s = h::with_overrides(h::rows_schedule(28672, 8 * 4096, 8), overrides({{"MOE8_SM90_RASTER", "n"}}));
  EXPECT_TRUE(s.along_n);
  EXPECT_EQ(s.swizzle, 8);
  s = h::with_overrides(h::Schedule{true, 1}, overrides({{"MOE8_SM90_RASTER", "m"}, {"MOE8_SM90_SWIZZLE", "4"}}));
  EXPECT_FALSE(s.along_n);
  EXPECT_EQ(s.swizzle, 4);
}

TEST(Sm90Heuristics, BadOverridesRaiseWhereRead) {
  auto message = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "(nothing raised)";
  };
  const h::Sm90Overrides bad = overrides({{"MOE8_SM90_TILE", "wide"},
                                          {"MOE8_SM90_FP8_TILE", "huge"},
                                          {"MOE8_SM90_FP8_PROMOTION", "eager"},
                                          {"MOE8_SM90_GATHER_WARPS", "4"},
                                          {"MOE8_QUANT_COLS", "fast"},
                                          {"MOE8_SM90_RASTER", "k"},
                                          {"MOE8_SM90_SWIZZLE", "3"},
                                          {"MOE8_SM90_BALANCE", "maybe"}});
  EXPECT_EQ(message([&] { h::rows_tile(true, 1536, 2048, 1 << 15, 128, bad); }),
            "MOE8_SM90_TILE: expected one of large, solo, m2, pong128, tall, epi64, epi64solo, got 'wide'");
  EXPECT_EQ(message([&] { h::fp8_forward_tile(1536, 1 << 15, 128, bad); }),
            "MOE8_SM90_FP8_TILE: expected one of large, solo, m2, small, got 'huge'");
  EXPECT_EQ(message([&] { h::fp8_promotion(Fp8Tile::kLarge, true, bad); }),
            "MOE8_SM90_FP8_PROMOTION: expected one of serial, overlap, got 'eager'");
  EXPECT_EQ(message([&] { h::gather_load_warps(bad); }), "MOE8_SM90_GATHER_WARPS: expected one of 1, 2, got '4'");
  EXPECT_EQ(message([&] { h::quant_cols_kernel(bad); }), "MOE8_QUANT_COLS: expected one of packed, staged, got 'fast'");
  EXPECT_EQ(message([&] {
              h::rows_tile(true, 1536, 2048, 1 << 15, 128, overrides({{"MOE8_SM90_EPILOGUE", "48"}}));
            }),
            "MOE8_SM90_EPILOGUE: expected one of 32, 64, got '48'");
  EXPECT_EQ(message([&] {
              h::wgrad_tile(true, 1536, 2048, true, overrides({{"MOE8_SM90_WGRAD", "auto"}}));
            }),
            "MOE8_SM90_WGRAD: expected one of pong, large, got 'auto'");
  EXPECT_EQ(message([&] {
              h::prepared(Tile::kEpi64, overrides({{"MOE8_SM90_PREPARED_STORE", "yes"}}));
            }),
            "MOE8_SM90_PREPARED_STORE: expected one of 0, 1, ragged, got 'yes'");
  EXPECT_EQ(message([&] {
              h::prepared(Tile::kEpi64, overrides({{"MOE8_SM90_PREPARED_LOADS", "2"}}));
            }),
            "MOE8_SM90_PREPARED_LOADS: expected one of 0, 1, ragged, got '2'");
  EXPECT_EQ(message([&] {
              h::prepared(Tile::kEpi64, overrides({{"MOE8_SM90_PREPARED_ACQUIRE", "early"}}));
            }),
            "MOE8_SM90_PREPARED_ACQUIRE: expected one of mainloop, store, got 'early'");
  EXPECT_EQ(message([&] { h::with_overrides({}, bad); }), "MOE8_SM90_RASTER: expected one of m, n, got 'k'");
  EXPECT_EQ(message([&] {
              h::with_overrides({}, overrides({{"MOE8_SM90_SWIZZLE", "3"}}));
            }),
            "MOE8_SM90_SWIZZLE: expected one of 1, 2, 4, 8, got '3'");
  EXPECT_EQ(message([&] { bad.balance.get(); }),
            "MOE8_SM90_BALANCE: expected one of auto, balanced, skewed, got 'maybe'");
  EXPECT_EQ(message([&] {
              h::rows_tile(true, 1536, 2048, 1 << 15, 128, overrides({{"MOE8_SM90_CLUSTER", "3x3"}}));
            }),
            "MOE8_SM90_CLUSTER: expected one of 1x2, 2x1, auto, got '3x3'");
  // Not read, so not raised: f16 never reads the bf16 tile; a forced tile hides the cluster.
  EXPECT_EQ(h::rows_tile(false, 1536, 2048, 1 << 15, 128, bad), Tile::kLarge);
  EXPECT_EQ(
      h::rows_tile(true, 1536, 2048, 1 << 15, 128, overrides({{"MOE8_SM90_TILE", "m2"}, {"MOE8_SM90_CLUSTER", "3x3"}})),
      Tile::kM2);
}

// The process's overrides are read once; reload_sm90_overrides (for tests) reads the environment again.
TEST(Sm90Heuristics, ReadOncePerProcess) {
  const char* old = std::getenv("MOE8_SM90_FP8_TILE");
  const std::string saved = old ? old : "";
  unsetenv("MOE8_SM90_FP8_TILE");
  h::reload_sm90_overrides();
  const h::Sm90Overrides& before = h::sm90_overrides();
  EXPECT_FALSE(before.fp8_tile.get().has_value());
  setenv("MOE8_SM90_FP8_TILE", "solo", 1);
  EXPECT_FALSE(h::sm90_overrides().fp8_tile.get().has_value());  // not seen until reloaded
  h::reload_sm90_overrides();
  EXPECT_EQ(h::sm90_overrides().fp8_tile.get(), Fp8Tile::kSolo);
  EXPECT_FALSE(before.fp8_tile.get().has_value());  // an earlier reference stays valid
  if (old)
    setenv("MOE8_SM90_FP8_TILE", saved.c_str(), 1);
  else
    unsetenv("MOE8_SM90_FP8_TILE");
  h::reload_sm90_overrides();
}

}  // namespace
}  // namespace moe8::test
