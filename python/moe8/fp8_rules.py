"""moe8.fp8_rules — where FP8 pays, as small pure functions of a GEMM's shape (no tensors, no device queries):

    fp8_pays(M, N, K, recipe, dense=False)     whether c [M, N] = a [M, K] . w [N, K]^T is faster in FP8 than in
                                               bf16, its quantisation passes included (Float8Recipe.auto);
                                               dense=True: a dense layer's GEMM (moe8.fp8_linear)
    dense_backend(recipe, device, capability)  which FP8 GEMM a dense layer runs: moe8's grouped GEMM with one
                                               group, or torch._scaled_mm

An FP8 GEMM saves tensor-core time in proportion to M·N·K and pays, per call, for quantising its activation
(M·K values) and, in the backward's FP8 dgrad, the output gradient (M·N); the weights' copies are refreshed
once per optimizer step, not per call. The saving over the cost grows with N·K / (N + K) (half the harmonic
mean of N and K), independent of M once M fills the tensor cores. The thresholds below are placeholders
taken from whole-layer measurements (bench/results/layer_h200.md, blockwise + FP8 dgrad against moe8 bf16,
16,384 tokens; rows per expert = tokens x top-k / experts): Qwen3-30B-A3B (M 1024; gate_up N·K/(N+K) 878,
down 558) 1.05-1.07x, i.e. level once the per-step weight refresh is counted (bench/results/hf_train_h200.md:
the Qwen3 slice 1.21x against bf16's 1.21x); DeepSeek-V3 (M 512; 2606 and 1593) 1.28x; Mixtral-8x7B
(M 4096; 3584 and 3186) 1.21x. So the cut lies between 878 and 1593: MIN_HARMONIC 1024. M below the smallest
measured (512) has no measurement: MIN_ROWS 256 is a guess. bench/bench_fp8_dense.py measures single GEMMs
per shape and recipe to set these; docs/fp8.md says how.

Dense layers (fp8_pays(..., dense=True), Float8Linear's `auto`) have their own, measured cut:
bench/results/fp8_dense_h200.md (single GEMMs forward + backward with FP8 dgrad against F.linear, one H200)
found FP8 slower everywhere (0.1-0.96x) but at DeepSeek-V3's o_proj, M 16,384 x N 7,168 x K 16,384
(N·K/(N+K) 4986; 1.08-1.29x): DENSE_MIN_ROWS 16384 and DENSE_MIN_HARMONIC 4986, the sweep's cut. That
measurement predates the removal of the FP8 dense path's per-call weight copy and trips through the dispatcher;
rerun bench/bench_fp8_dense.py before lowering them.
"""

from __future__ import annotations

from types import MappingProxyType

# read-only: thresholds are measured constants, not switches
MIN_ROWS = MappingProxyType({"blockwise": 256, "rowwise": 256, "tensorwise": 256})  # rows per GEMM (group)
MIN_HARMONIC = MappingProxyType({"blockwise": 1024, "rowwise": 1024, "tensorwise": 1024})  # N·K / (N + K)
DENSE_MIN_ROWS = 16384  # a dense layer's GEMM (bench/results/fp8_dense_h200.md): rows per GEMM
DENSE_MIN_HARMONIC = 4986  # and N·K / (N + K), every recipe and backend
ALIGN = 16  # N and K multiples of 16: the Hopper FP8 kernels' TMA loads and torch._scaled_mm need it

MOE8, SCALED_MM = "moe8", "scaled_mm"
DENSE_KINDS = ("attention", "shared_expert", "mlp")  # the dense layers FP8 can take (moe8.fp8_linear)


def dense_kinds(fp8_dense) -> tuple:
    """The dense module kinds a Config's fp8_dense names: False (or ()) -> (), True -> all of DENSE_KINDS, a
    kind or a sequence of kinds -> those (ValueError naming fp8_dense otherwise)."""
    if fp8_dense is False or fp8_dense is None or fp8_dense == ():
        return ()
    if fp8_dense is True:
        return DENSE_KINDS
    kinds = (fp8_dense,) if isinstance(fp8_dense, str) else tuple(fp8_dense)
    if not kinds or any(k not in DENSE_KINDS for k in kinds):
        raise ValueError(
            f"fp8_dense: expected True, False or a non-empty subset of {list(DENSE_KINDS)}, got {fp8_dense!r}"
        )
    return kinds


def fp8_pays(M: int, N: int, K: int, recipe: str = "blockwise", dense: bool = False) -> bool:
    """True when c [M, N] = a [M, K] . w^T (w [N, K]) is expected faster in FP8 with `recipe` (a recipe name)
    than in bf16, quantisation included. M: rows of one GEMM (of one expert group for grouped GEMMs).
    dense: a dense layer's single GEMM (moe8.fp8_linear), whose measured cut is DENSE_MIN_ROWS and
    DENSE_MIN_HARMONIC for every recipe; else an expert GEMM (MIN_ROWS / MIN_HARMONIC of the recipe)."""
    if recipe not in MIN_ROWS:
        raise ValueError(f"recipe: expected one of {sorted(MIN_ROWS)}, got {recipe!r}")
    if M <= 0 or N % ALIGN or K % ALIGN:
        return False
    rows, harmonic = (
        (DENSE_MIN_ROWS, DENSE_MIN_HARMONIC) if dense else (MIN_ROWS[recipe], MIN_HARMONIC[recipe])
    )
    return M >= rows and N * K / (N + K) >= harmonic


def dense_backend(
    recipe: str, device: str, capability: tuple = (0, 0), n: int = ALIGN, k: int = ALIGN
) -> str:
    """The FP8 GEMM of a dense layer: "scaled_mm" (torch._scaled_mm, cuBLAS) for rowwise / tensorwise
    scales on an sm_89+ GPU, where torch's rowwise kernel with fast accumulation sustains more than moe8's
    blockwise one (1202 against 1009 TFLOP/s at Mixtral's gate_up, docs/fp8.md) and moe8 applies row scales
    in an extra pass; "moe8" (the grouped GEMM with one group) for blockwise scales, which _scaled_mm has no
    sm_90 kernel for in the torch moe8 pins, and on the CPU (moe8's reference kernels). n, k: the weight's
    [N, K]; cuBLAS FP8 needs both multiples of 16 (the forward's K and the dgrad's N), else "moe8"."""
    aligned = n % ALIGN == 0 and k % ALIGN == 0
    if device == "cuda" and aligned and tuple(capability) >= (8, 9) and recipe in ("rowwise", "tensorwise"):
        return SCALED_MM
    return MOE8
