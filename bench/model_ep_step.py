"""A MODEL, not a measurement: the predicted per-GPU training step of Qwen3-30B-A3B full fine-tuning under
expert parallelism over 8 H200s (EP 8, FSDP2 over the 8 ranks for the dense parameters, bf16, AdamW), built
from parts measured on one H200 (the result files in bench/results/) and from named assumptions where nothing
was measured (the NVLink rate moe8's transports reach on 8 GPUs, the NCCL rate of FSDP's collectives).

Method, per rank (T = batch x seq tokens, uniform routing):
- per-layer compute from the step profile of the 2-layer Qwen3-30B-A3B slice at 8 x 2048 tokens
  (step_profile_vocab_8x2048_h200.json): experts, dense GEMMs and norms/rope/elementwise scale linearly in
  tokens; attention (SDPA's kernels) in tokens x sequence length (causal: per-token work grows with S); the
  expert GEMMs inside the experts' time are recomputed at the rank's rows (T x k received) from the grouped
  GEMM TFLOP/s of gemm_h200.json. x 48 layers.
- per step: the LM head + loss linear in tokens; the optimizer linear in the parameters the rank holds
  (experts / ep + dense / ep), times a bytes ratio for fp32 master weights and moments; the host gaps (idle).
- GEMM-bound parts derated by the sustained / first-call TFLOP/s of clocks_h200.json (a 48-layer step keeps
  the GPU at its power cap; the measured slices ran in short bursts).
- dispatch + combine: T x k rows x H x 2 bytes, the (ep - 1) / ep that leave the rank, 4 passes a layer
  (forward dispatch + combine, and their mirrors in the backward), at an assumed GB/s per GPU; with
  ep_chunks the forward passes overlap the forward expert GEMMs (as built on nccl), optionally the backward too.
- FSDP2: bf16 all-gathers of the dense parameters (forward; the decoder layers again in the backward), fp32
  reduce-scatter of their gradients, (n - 1) / n of each leaving the rank.
- memory: held parameters x bytes per parameter, activations from the MoE block's measured held memory plus
  the attention's saved tensors, the loss's buffers, 5 % overhead (moe8.finetune.memory's accounting).

    python bench/model_ep_step.py                        # the table, from bench/results/
    python bench/model_ep_step.py --json bench/results/ep_step_model_h200.json
    python bench/model_ep_step.py --ep-gbs 300 --no-checkpointing --batch 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
GiB = 2**30

# NVLink 4: 18 links x 25 GB/s per direction per H100 / H200; DeepEP V1 intranode on H800 (EP 8, 4096 tokens,
# H 7168, top-8): 153 GB/s dispatch, 158 GB/s combine.
NVLINK4_GBS = 450.0
DEEPEP_H800_GBS = (153.0, 158.0)
# Published Qwen3-30B-A3B full fine-tuning figures on 8 x H100, and the target on 8 x H200.
PEERS = [
    ("NeMo AutoModel, 8 x H100 (published)", "11,340-12,040", "48"),
    ("transformers v5, 8 x H100 (published)", "3,075", "68"),
    ("target, 8 x H200", ">= 14,000", "<= 45"),
]


@dataclass(frozen=True)
class Arch:
    layers: int = 48
    hidden: int = 2048
    moe_inter: int = 768
    experts: int = 128
    top_k: int = 8
    q_heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 151936
    tied: bool = False  # Qwen3-30B-A3B: tie_word_embeddings false


@dataclass(frozen=True)
class Inputs:
    """What the model is asked about, and the assumptions that no measurement here grounds (defaults named)."""

    ep: int = 8
    batch: int = 4  # sequences per rank per micro-batch
    seq: int = 4096
    ep_gbs: float = 150.0  # ASSUMED: dispatch / combine GB/s per GPU that leave it (one direction)
    fsdp_gbs: float = 300.0  # ASSUMED: NCCL all-gather / reduce-scatter GB/s per GPU
    ep_chunks: int = 2  # parts per layer when overlapping (Config.ep_chunks)
    checkpointing: bool = True  # activation checkpointing (each layer's forward recomputed)
    master: bool = True  # fp32 master weights beside the bf16 ones (moe8 finetune's full fine-tuning)
    forward_share: float = 1.0 / 3.0  # ASSUMED: forward's share of a layer's compute (GEMM FLOPs: 1 of 3)
    sync_ms: float = 0.1  # ASSUMED: host gap per dispatch (the counts' device-to-host read), per layer
    clock_derate: bool = True  # GEMM-bound parts at sustained, not first-call, TFLOP/s


@dataclass(frozen=True)
class Value:
    """A number with where it comes from: a result file and field, or a formula / an assumption."""

    value: float
    source: str

    def __float__(self) -> float:
        return float(self.value)


# ---------------------------------------------------------------- shapes, parameters, bytes


def dense_params(a: Arch) -> dict:
    """The parameters outside the experts, from the architecture (FSDP2 shards these)."""
    q, kv = a.q_heads * a.head_dim, a.kv_heads * a.head_dim
    attn = a.hidden * q + 2 * a.hidden * kv + q * a.hidden  # q, k, v, o projections (no biases)
    norms = 2 * a.hidden + 2 * a.head_dim  # input / post-attention RMSNorm, q_norm, k_norm
    router = a.hidden * a.experts
    layer = attn + norms + router
    embed = a.vocab * a.hidden
    head = 0 if a.tied else a.vocab * a.hidden
    root = embed + head + a.hidden  # + the final norm
    return dict(
        attention=attn,
        norms=norms,
        router=router,
        layer=layer,
        blocks=a.layers * layer,
        root=root,
        total=a.layers * layer + root,
    )


def expert_params(a: Arch) -> int:
    return a.layers * a.experts * 3 * a.hidden * a.moe_inter  # gate_up [E, 2I, H] + down [E, H, I]


def ep_pass_bytes(tokens: int, top_k: int, hidden: int, ep: int, elem_bytes: float = 2.0) -> float:
    """Bytes one dispatch (or combine) sends off the rank: T x k rows of H elements, (ep - 1) / ep of them
    to other ranks under uniform routing (moe8 sends a row per (token, slot), not per destination rank)."""
    return tokens * top_k * hidden * elem_bytes * (ep - 1) / ep


def fsdp_bytes(a: Arch, n: int) -> dict:
    """Bytes each rank sends per step in FSDP2's ring collectives ((n - 1) / n of the full size each):
    forward all-gather of every dense parameter in bf16, the decoder layers' again in the backward
    (reshard_after_forward; the root stays gathered), reduce-scatter of the gradients in fp32."""
    p, f = dense_params(a), (n - 1) / n
    ag_fwd, ag_bwd, rs = f * p["total"] * 2, f * p["blocks"] * 2, f * p["total"] * 4
    root = f * p["root"] * (2 + 4)  # the root's all-gather (first) and reduce-scatter (last)
    return dict(
        all_gather_forward=ag_fwd,
        all_gather_backward=ag_bwd,
        reduce_scatter=rs,
        total=ag_fwd + ag_bwd + rs,
        root=root,
    )


def state_bytes(master: bool) -> tuple:
    """Bytes per held parameter at the backward's peak and at the optimizer step (moe8.finetune.memory):
    bf16 weight 2, fp32 master 4, AdamW's exp_avg and exp_avg_sq 8, gradient bf16 2 (fp32 4 at the step with
    a master)."""
    m = 4 if master else 0
    return 2 + m + 8 + 2, 2 + m + 8 + (4 if master else 2)


def adamw_bytes(master: bool) -> int:
    """Bytes fused AdamW reads and writes per parameter (memory-bound: its time goes with these): with a
    master, fp32 weight, exp_avg, exp_avg_sq read and written (24), the bf16 gradient read and the bf16 weight
    written (4); without, the bf16 weight read and written instead of the fp32 one (22). The measured slice
    keeps weight, gradient and both moments in bf16: 14 (ADAMW_MEASURED_BYTES)."""
    return 28 if master else 22


ADAMW_MEASURED_BYTES = 14


def expert_gemm_flops(tokens: int, a: Arch) -> dict:
    """FLOPs of each expert GEMM of one layer's forward at T x k rows (dgrad and wgrad: the same each)."""
    rows = tokens * a.top_k
    return dict(gate_up=2 * rows * a.hidden * 2 * a.moe_inter, down=2 * rows * a.moe_inter * a.hidden)


def model_flops_per_token(a: Arch, seq: int) -> float:
    """6 x the matmul parameters one token uses (attention projections, router, k experts, LM head) plus
    causal attention's 6 x S x (heads x head_dim) per layer: the usual model-FLOPs count, no recompute."""
    p = dense_params(a)
    active = (
        a.layers * (p["attention"] + p["router"] + a.top_k * 3 * a.hidden * a.moe_inter) + a.vocab * a.hidden
    )
    return 6 * active + 6 * a.layers * seq * a.q_heads * a.head_dim


# ---------------------------------------------------------------- the measured parts


def _pick(rows: list, **match) -> dict:
    hits = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if len(hits) != 1:
        raise KeyError(f"expected one row with {match}, found {len(hits)}")
    return hits[0]


def load_measured(results: Path) -> dict:
    """Every measured number the model uses, each with its file and field."""
    m = {}
    name = "step_profile_vocab_8x2048_h200.json"
    run = json.loads((results / name).read_text())["runs"]["vocab_151936"]
    row = _pick(run["rows"], family="qwen3", impl="moe8")
    at = f"{name}: runs.vocab_151936.rows[impl=moe8]"
    m["profile_tokens"] = Value(
        run["meta"]["batch"] * run["meta"]["seq"], f"{name}: runs.vocab_151936.meta batch x seq"
    )
    m["profile_seq"] = Value(run["meta"]["seq"], f"{name}: runs.vocab_151936.meta.seq")
    m["profile_layers"] = Value(row["layers"], f"{at}.layers")
    m["profile_params"] = Value(row["params"], f"{at}.params")
    m["profile_tokens_per_s"] = Value(row["tokens_per_s"], f"{at}.tokens_per_s")
    for key in (
        "experts",
        "dense GEMMs",
        "attention",
        "LM head + loss",
        "optimizer",
        "norms/rope/elementwise",
    ):
        m[key] = Value(row["profile_ms"][key], f"{at}.profile_ms['{key}']")
    m["idle"] = Value(row["profile_ms"]["idle"], f"{at}.profile_ms['idle']")

    name = "gemm_h200.json"
    gemms = json.loads((results / name).read_text())["gemms"]
    for g in ("gate_up", "down"):
        for kind in ("fwd", "dgrad", "wgrad"):
            r = _pick(gemms, shape="qwen3", routing="balanced", gemm=g, kind=kind)
            m[f"tflops_{g}_{kind}"] = Value(
                r["moe8_tflops"],
                f"{name}: gemms[qwen3, balanced, {g}, {kind}].moe8_tflops ({r['rows']} rows)",
            )

    name = "block_peers_h200.json"
    block = _pick(json.loads((results / name).read_text())["blocks"], shape="qwen3", routing="balanced")
    at = f"{name}: blocks[qwen3, balanced].rows"
    m["block_tokens"] = Value(block["tokens"], f"{name}: blocks[qwen3, balanced].tokens")
    m["block_ms"] = Value(_pick(block["rows"], impl="moe8")["ms"], f"{at}[impl=moe8].ms")
    kept = _pick(block["rows"], impl="moe8 (keep_permuted=1)")
    m["block_held_rows_gib"] = Value(kept["held_gib"], f"{at}[impl=moe8 (keep_permuted=1)].held_gib")

    name = "clocks_h200.json"
    case = _pick(json.loads((results / name).read_text())["cases"], case="bf16")
    m["sustained_tflops"] = Value(case["tflops"], f"{name}: cases[bf16].tflops")
    m["first_call_tflops"] = Value(case["first_call_tflops"], f"{name}: cases[bf16].first_call_tflops")

    name = "fp8_step_h200.json"
    r = _pick(json.loads((results / name).read_text())["rows"], model="qwen3", row="moe8")
    m["check_layers"] = Value(r["layers"], f"{name}: rows[qwen3, moe8].layers")
    m["check_tokens_per_s"] = Value(r["tokens_per_s"], f"{name}: rows[qwen3, moe8].tokens_per_s")
    return m


# ---------------------------------------------------------------- the model


def exposed(comm: float, compute: float, chunks: int) -> float:
    """Communication time left on the critical path when it runs in `chunks` parts beside `compute`
    (part c + 1's rows move while part c computes; the first part's rows and the last part's combine, or
    the last part's compute, cannot hide)."""
    if chunks <= 1:
        return comm
    return max(comm + compute / chunks, compute + comm / chunks) - compute


def clock_derate(m: dict, inp: Inputs) -> float:
    """Sustained / first-call bf16 grouped-GEMM TFLOP/s (clocks_h200): what a step held at the power cap keeps."""
    return float(m["sustained_tflops"]) / float(m["first_call_tflops"]) if inp.clock_derate else 1.0


def layer_compute(m: dict, inp: Inputs, a: Arch) -> dict:
    """ms per layer per rank of each compute part, at the rank's tokens and sequence length."""
    layers, t0, s0 = float(m["profile_layers"]), float(m["profile_tokens"]), float(m["profile_seq"])
    tokens = inp.batch * inp.seq
    lin, derate = tokens / t0, clock_derate(m, inp)  # linear in tokens

    def gemms_ms(t: float) -> float:
        f = expert_gemm_flops(t, a)
        return sum(
            f[g] / (float(m[f"tflops_{g}_{k}"]) * 1e12) * 1e3 for g in f for k in ("fwd", "dgrad", "wgrad")
        )

    gemm_profile = gemms_ms(t0)  # the slice's expert GEMMs at 128 experts x T k / E rows each
    other = max(0.0, float(m["experts"]) / layers - gemm_profile)  # router, gathers, SwiGLU, sums
    return dict(
        expert_gemms=gemms_ms(tokens) / derate,
        experts_other=other * lin,
        attention=float(m["attention"]) / layers * lin * inp.seq / s0 / derate,
        dense_gemms=float(m["dense GEMMs"]) / layers * lin / derate,
        elementwise=float(m["norms/rope/elementwise"]) / layers * lin,
    )


def predict(m: dict, inp: Inputs | None = None, a: Arch | None = None, overlap: str = "forward") -> dict:
    """The predicted step: per-part ms, bytes, tokens/s/GPU, memory. overlap: "none" (every transfer on the
    critical path), "forward" (ep_chunks on the forward's dispatch / combine, as built on nccl; FSDP2's
    prefetch hides all but the root's collectives), "both" (the backward's passes chunked too: not built)."""
    if overlap not in ("none", "forward", "both"):
        raise ValueError(f"overlap: expected none, forward or both, got {overlap!r}")
    inp, a = inp or Inputs(), a or Arch()
    tokens, L, derate = inp.batch * inp.seq, a.layers, clock_derate(m, inp)
    per = layer_compute(m, inp, a)
    layer_ms = sum(per.values())
    experts_ms = per["expert_gemms"] + per["experts_other"]

    # dispatch + combine: 2 passes forward, 2 backward (and 2 more in a recompute)
    pass_bytes = ep_pass_bytes(tokens, a.top_k, a.hidden, inp.ep)
    pass_ms = pass_bytes / (inp.ep_gbs * 1e9) * 1e3
    fwd_chunks = inp.ep_chunks if overlap in ("forward", "both") else 1
    bwd_chunks = inp.ep_chunks if overlap == "both" else 1
    ep_fwd = exposed(2 * pass_ms, experts_ms * inp.forward_share, fwd_chunks)
    ep_bwd = exposed(2 * pass_ms, experts_ms * (1 - inp.forward_share), bwd_chunks)
    recompute = 1 if inp.checkpointing else 0
    ep_exposed = L * (ep_fwd * (1 + recompute) + ep_bwd)

    fsdp = fsdp_bytes(a, inp.ep)
    fsdp_ms = fsdp["total"] / (inp.fsdp_gbs * 1e9) * 1e3
    fsdp_exposed = fsdp_ms if overlap == "none" else fsdp["root"] / (inp.fsdp_gbs * 1e9) * 1e3

    dense, experts_total = dense_params(a), expert_params(a)
    held = experts_total / inp.ep + dense["total"] / inp.ep  # FSDP2 shards the dense ones over all ranks
    lin = tokens / float(m["profile_tokens"])
    adamw = held / float(m["profile_params"]) * adamw_bytes(inp.master) / ADAMW_MEASURED_BYTES
    step = dict(
        **{k: L * v for k, v in per.items()},
        recompute=L * layer_ms * inp.forward_share * recompute,
        lm_head_loss=float(m["LM head + loss"]) * lin / derate,
        optimizer=float(m["optimizer"]) * adamw,
        host_gaps=float(m["idle"]) + L * inp.sync_ms * (1 + recompute),
        dispatch_combine_exposed=ep_exposed,
        fsdp_exposed=fsdp_exposed,
    )
    step_ms = sum(step.values())
    tps = tokens / (step_ms / 1e3)
    return dict(
        overlap=overlap,
        tokens_per_rank=tokens,
        per_layer_ms=per,
        step_ms=step,
        total_ms=step_ms,
        tokens_per_s_per_gpu=tps,
        model_tflops_per_gpu=tps * model_flops_per_token(a, inp.seq) / 1e12,
        dispatch_combine=dict(
            bytes_per_pass=pass_bytes,
            passes_per_layer=4 + 2 * recompute,
            bytes_per_step=pass_bytes * (4 + 2 * recompute) * L,
            ms_per_pass=pass_ms,
            ms_per_step_unhidden=pass_ms * (4 + 2 * recompute) * L,
        ),
        fsdp=dict(bytes=fsdp, ms_unhidden=fsdp_ms),
        params=dict(dense=dense["total"], experts=experts_total, held_per_rank=held),
        memory=memory(m, inp, a, held),
    )


def memory(m: dict, inp: Inputs, a: Arch, held: float) -> dict:
    """Peak GiB per GPU: the larger of the backward's and the optimizer step's, + 5 % (moe8.finetune.memory)."""
    tokens, H = inp.batch * inp.seq, a.hidden
    q, kv = a.q_heads * a.head_dim, a.kv_heads * a.head_dim
    # the attention's saved tensors per token (moe8.finetune.memory.per_token_layer's attention term)
    attn_token = 2 * (2 * H + 2 * (q + 2 * kv) + q) + 4 * a.q_heads
    # the MoE block keeping its [T k, H] rows (measured, keep_permuted=1: an EP owner keeps the rows it
    # received), + the source's [T k, H] returned rows, which its weighted sum keeps for the weights' gradient
    moe = float(m["block_held_rows_gib"]) * GiB * tokens / float(m["block_tokens"]) + tokens * a.top_k * H * 2
    layer = attn_token * tokens + moe
    acts = (a.layers * tokens * H * 2 + layer) if inp.checkpointing else a.layers * layer
    padded = -(-a.vocab // 128) * 128
    loss = (
        min(1024, tokens) * a.vocab * 4 * 2 + tokens * H * 2 + padded * H * 4
    )  # chunk logits, d hidden, d head
    p = dense_params(a)
    gathered = p["root"] * 2 + 2 * p["layer"] * 2  # FSDP2: the root in bf16 all step, two layers in flight
    at_backward, at_step = state_bytes(inp.master)
    backward = dict(states=held * at_backward, activations=acts, loss=loss, fsdp_gathered=gathered)
    step = dict(states=held * at_step)
    peak = max(sum(backward.values()), sum(step.values())) * 1.05
    return dict(
        backward_gib={k: v / GiB for k, v in backward.items()},
        step_gib={k: v / GiB for k, v in step.items()},
        activations_per_layer_gib=layer / GiB,
        peak_gib=peak / GiB,
    )


def check_one_gpu(m: dict) -> dict:
    """The same scaling, on one GPU without EP, predicting the 4-layer slice fp8_step_h200.json measured
    (8 x 2048 tokens, burst clocks): how far the per-layer / per-step split is from a measurement."""
    a = Arch(layers=int(float(m["check_layers"])))
    inp = Inputs(ep=1, batch=8, seq=2048, checkpointing=False, sync_ms=0.0, clock_derate=False)
    per = layer_compute(m, inp, a)
    params = dense_params(a)["total"] + expert_params(a)
    ms = (
        a.layers * sum(per.values())
        + float(m["LM head + loss"])
        + float(m["optimizer"]) * params / float(m["profile_params"])
        + float(m["idle"])
    )
    pred = inp.batch * inp.seq / (ms / 1e3)
    return dict(
        predicted=pred, measured=float(m["check_tokens_per_s"]), ratio=pred / float(m["check_tokens_per_s"])
    )


# ---------------------------------------------------------------- output


def sweep(m: dict, inp: Inputs, gbs: list) -> list:
    rows = []
    for g in gbs:
        for ov in ("none", "forward", "both"):
            r = predict(m, dataclasses.replace(inp, ep_gbs=g), overlap=ov)
            rows.append(
                dict(
                    ep_gbs=g,
                    overlap=ov,
                    tokens_per_s_per_gpu=r["tokens_per_s_per_gpu"],
                    step_ms=r["total_ms"],
                    exposed_dispatch_combine_ms=r["step_ms"]["dispatch_combine_exposed"],
                )
            )
    return rows


def configs(m: dict, inp: Inputs) -> list:
    rows = []
    for batch, ckpt in ((4, True), (4, False), (2, False), (1, False), (2, True)):
        for master in (True, False):
            i = dataclasses.replace(inp, batch=batch, checkpointing=ckpt, master=master)
            r = predict(m, i, overlap="forward")
            rows.append(
                dict(
                    batch=batch,
                    seq=inp.seq,
                    checkpointing=ckpt,
                    master=master,
                    tokens_per_s_per_gpu=r["tokens_per_s_per_gpu"],
                    peak_gib=r["memory"]["peak_gib"],
                )
            )
    return rows


def _commit() -> str:
    try:
        p = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        return p.stdout.strip() or "not recorded"
    except OSError:
        return "not recorded"


def report(m: dict, inp: Inputs, gbs: list) -> dict:
    main = predict(m, inp, overlap="forward")
    burst = predict(m, dataclasses.replace(inp, clock_derate=False), overlap="forward")
    return dict(
        what="A MODEL (a prediction, not a measurement) of the Qwen3-30B-A3B full fine-tuning step per GPU under "
        "EP over 8 H200s with FSDP2 for the dense parameters; no multi-GPU figure in it was measured",
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        commit=_commit(),
        arch=dataclasses.asdict(Arch()),
        inputs=dataclasses.asdict(inp),
        assumptions={
            "ep_gbs": f"{inp.ep_gbs:g} GB/s per GPU leaving it, moe8's nccl / ipc transports on 8 GPUs: never "
            f"measured. Anchors: NVLink 4 {NVLINK4_GBS:g} GB/s per GPU per direction; DeepEP "
            f"{DEEPEP_H800_GBS[0]:g} / {DEEPEP_H800_GBS[1]:g} GB/s dispatch / combine on H800 (EP 8, 4096 tokens, "
            "H 7168, top-8)",
            "fsdp_gbs": f"{inp.fsdp_gbs:g} GB/s per GPU for NCCL all-gather / reduce-scatter: never measured here",
            "routing": "uniform: each rank receives T x k rows, (ep - 1) / ep of the sent rows leave the rank",
            "expert_gemms": "the rank's 16 experts x T k / 16 rows each run at the TFLOP/s measured for 128 "
            "experts x T k / 128 rows (same FLOPs, larger groups)",
            "optimizer": f"fused AdamW is memory-bound: its time scales with the parameters held and the bytes it "
            f"touches per parameter ({adamw_bytes(inp.master)} here, {ADAMW_MEASURED_BYTES} in the measured all-bf16 step)",
            "forward_share": f"{inp.forward_share:.3f} of a layer's compute is its forward (GEMM FLOPs)",
            "sync_ms": f"{inp.sync_ms:g} ms of host gap per layer's dispatch (the counts' device-to-host read)",
            "overlap": "overlapped transfers slow no kernel (NCCL's and the transport's SMs, shared NVLink with "
            "FSDP: not modelled)",
        },
        measured={k: dataclasses.asdict(v) for k, v in m.items()},
        prediction=main,
        prediction_burst_clocks=burst["tokens_per_s_per_gpu"],
        sweep=sweep(m, inp, gbs),
        configs=configs(m, inp),
        check_one_gpu=check_one_gpu(m),
        peers=[dict(name=n, tokens_per_s_per_gpu=t, gib=g) for n, t, g in PEERS],
    )


def print_report(r: dict) -> None:
    inp, p = r["inputs"], r["prediction"]
    print("A MODEL, NOT A MEASUREMENT: Qwen3-30B-A3B full fine-tuning, EP 8 + FSDP2, 8 x H200, per GPU")
    print(
        f"date {r['date']}, commit {r['commit']}; per rank {inp['batch']} x {inp['seq']} = {p['tokens_per_rank']:,} "
        f"tokens, activation checkpointing {'on' if inp['checkpointing'] else 'off'}"
    )
    print("\nmeasured inputs (one H200):")
    for k, v in r["measured"].items():
        x = float(v["value"])
        print(f"  {k:22s} {f'{x:,.0f}' if x.is_integer() or x >= 1e4 else f'{x:,.4g}':>16s}   {v['source']}")
    print("\nassumed (never measured):")
    for k, v in r["assumptions"].items():
        print(f"  {k}: {v}")
    print("\nper layer per rank, ms: " + ", ".join(f"{k} {v:.2f}" for k, v in p["per_layer_ms"].items()))
    dc, fs = p["dispatch_combine"], p["fsdp"]
    print(
        f"dispatch / combine: {dc['bytes_per_pass'] / 1e6:,.1f} MB a pass (T k H 2 (ep-1)/ep), "
        f"{dc['passes_per_layer']} passes a layer, {dc['bytes_per_step'] / 1e9:,.1f} GB a step, "
        f"{dc['ms_per_pass']:.2f} ms a pass at {inp['ep_gbs']:g} GB/s, {dc['ms_per_step_unhidden']:,.0f} ms a step unhidden"
    )
    b = fs["bytes"]
    print(
        f"FSDP2: dense parameters {p['params']['dense'] / 1e9:.3f} B (experts {p['params']['experts'] / 1e9:.2f} B, "
        f"held per rank {p['params']['held_per_rank'] / 1e9:.3f} B); per step all-gather {b['all_gather_forward'] / 1e9:.2f} + "
        f"{b['all_gather_backward'] / 1e9:.2f} GB, reduce-scatter {b['reduce_scatter'] / 1e9:.2f} GB: "
        f"{fs['ms_unhidden']:.1f} ms at {inp['fsdp_gbs']:g} GB/s"
    )
    print("\nstep per rank, ms (overlap: forward dispatch / combine in ep_chunks parts, FSDP2 prefetch):")
    for k, v in p["step_ms"].items():
        print(f"  {k:26s} {v:9.1f}")
    print(f"  {'total':26s} {p['total_ms']:9.1f}")
    mem = p["memory"]
    print(
        "memory per GPU, GiB: backward "
        + ", ".join(f"{k} {v:.1f}" for k, v in mem["backward_gib"].items())
        + f"; step states {mem['step_gib']['states']:.1f}; peak (+5 %) {mem['peak_gib']:.1f}"
    )
    c = r["check_one_gpu"]
    print(
        f"check on one GPU: the 4-layer slice predicted {c['predicted']:,.0f} tokens/s, measured {c['measured']:,.0f} "
        f"({c['ratio']:.2f}x); the MoE block alone {float(r['measured']['block_ms']['value']):.2f} ms a layer at "
        f"{float(r['measured']['block_tokens']['value']):,.0f} tokens (block_peers), in the step's profile "
        f"{float(r['measured']['experts']['value']) / float(r['measured']['profile_layers']['value']):.2f} ms"
    )

    print("\nconfigurations (overlap forward, GB/s as assumed):")
    print("| batch x seq | checkpointing | fp32 master | tokens/s/GPU | peak GiB |")
    print("| --- | --- | --- | --- | --- |")
    for c in r["configs"]:
        print(
            f"| {c['batch']} x {c['seq']} | {'on' if c['checkpointing'] else 'off'} | {'yes' if c['master'] else 'no'} | "
            f"{c['tokens_per_s_per_gpu']:,.0f} | {c['peak_gib']:.1f} |"
        )
    print("\nthe predicted step (MODEL) beside the published figures:")
    print(
        "| dispatch / combine GB/s (assumed) | overlap | step ms | exposed dispatch + combine ms | tokens/s/GPU |"
    )
    print("| --- | --- | --- | --- | --- |")
    for s in r["sweep"]:
        print(
            f"| {s['ep_gbs']:g} | {s['overlap']} | {s['step_ms']:,.0f} | {s['exposed_dispatch_combine_ms']:,.0f} | "
            f"{s['tokens_per_s_per_gpu']:,.0f} |"
        )
    print(
        f"\nmoe8 (MODEL), {inp['ep_gbs']:g} GB/s, forward overlap: {p['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU "
        f"({r['prediction_burst_clocks']:,.0f} at burst clocks), {p['model_tflops_per_gpu']:.0f} model TFLOP/s, "
        f"{mem['peak_gib']:.1f} GiB"
    )
    for n, t, g in PEERS:
        print(f"{n}: {t} tokens/s/GPU, {g} GiB")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of the measured result files")
    ap.add_argument("--json", type=Path, help="write the prediction here")
    ap.add_argument("--batch", type=int, default=Inputs.batch)
    ap.add_argument("--seq", type=int, default=Inputs.seq)
    ap.add_argument(
        "--ep-gbs", type=float, default=Inputs.ep_gbs, help="ASSUMED dispatch / combine GB/s per GPU"
    )
    ap.add_argument(
        "--fsdp-gbs", type=float, default=Inputs.fsdp_gbs, help="ASSUMED FSDP collectives GB/s per GPU"
    )
    ap.add_argument("--ep-chunks", type=int, default=Inputs.ep_chunks)
    ap.add_argument("--sweep-gbs", default="100,150,300,450", help="dispatch / combine GB/s of the table")
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--no-clock-derate", action="store_true")
    ap.add_argument(
        "--no-master", action="store_true", help="no fp32 master weights (bf16 weights, fp32 moments)"
    )
    args = ap.parse_args(argv)
    for name in ("batch", "seq", "ep_chunks"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if args.ep_gbs <= 0 or args.fsdp_gbs <= 0:
        ap.error("--ep-gbs / --fsdp-gbs: expected > 0")
    inp = Inputs(
        batch=args.batch,
        seq=args.seq,
        ep_gbs=args.ep_gbs,
        fsdp_gbs=args.fsdp_gbs,
        ep_chunks=args.ep_chunks,
        checkpointing=not args.no_checkpointing,
        clock_derate=not args.no_clock_derate,
        master=not args.no_master,
    )
    r = report(load_measured(args.results), inp, [float(g) for g in args.sweep_gbs.split(",")])
    if args.json:
        args.json.write_text(json.dumps(r, indent=1) + "\n")
    print_report(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
