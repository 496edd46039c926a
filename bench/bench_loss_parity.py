"""Does moe8 train to the same loss as plain transformers? Per family, the same model trained twice on the same
real text in the same order: once through transformers (its default experts implementation, `grouped_mm`),
once through `moe8.accelerate(model)` with the default Config (every fusion on, the fused loss: outputs.logits
is None there, the loss is outputs.loss). Target: the means of the last 10 steps within 1 % (bf16 noise).

The models are bench_step_profile.py's slices (its `build()`: 2 decoder layers at the real widths of
Qwen3-30B-A3B, Mixtral-8x7B, Qwen1.5-MoE-A2.7B, OLMoE-1B-7B, GPT-OSS-20B and DeepSeek-V3 with 32 routed
experts), each built with Qwen3-30B-A3B's vocabulary of 151,936 rows, which hold every id of its tokenizer
(151,669): the text needs no remapping and both sides train the identical model, whose LM head is then not the
family's own width (--vocab changes it; 151,669 itself puts transformers' LM head on an unaligned GEMM, ~2x
slower: bench/results/step_profile_vocab151669_h200.json).

Per family: built with seed 0, its initial state dict copied to the CPU, trained through transformers; then a
fresh model is built, the same initial weights loaded (checked equal), moe8 switched on, the same steps
trained, and `moe8.disable()` undoes every patch (RoPE's is process-wide) before the next family's
transformers side (checked to run transformers' experts). Training: bf16 (fp32 with --tiny), AdamW (fused on
CUDA, betas 0.9 / 0.95, weight decay 0.1), lr 3e-4 with 10 warm-up steps then cosine to 10 %, gradient clip
1.0, the family's aux loss on both sides (output_router_logits on: outputs.loss is the cross-entropy plus
router_aux_loss_coef x outputs.aux_loss; DeepSeek-V3 has none). The cross-entropy is recorded as outputs.loss
minus coef x outputs.aux_loss; both it and the total are compared.

    python bench/bench_loss_parity.py --out bench/results     # 6 families x 2 sides x 50 steps of 8 x 2048 tokens
    python bench/bench_loss_parity.py --batch 4 --out /tmp/lp   # 4 x 2048 tokens a step
    python bench/bench_loss_parity.py --families qwen3,gpt_oss --steps 100 --out /tmp/lp
    python bench/bench_loss_parity.py --tiny --out /tmp/lp       # CPU: toy configs, fp32, 8 steps of 2 x 32
    python bench/bench_loss_parity.py --families mixtral --control --out /tmp/lp   # with the noise floor

H200 time at the defaults, estimated from bench/results/step_profile_peers_h200.json (tokens/s at 4 x 2048, the
LM heads of Mixtral and OLMoE grown to 151,936 rows): ~200 us a token for the 12 runs, so 50 x 16,384 tokens
take ~160 s, plus ~45 s of imports, tokenising, building and copying weights: ~3.5 min (--batch 4: ~2 min).

Data: the shared corpus (text/sentences.txt) and Qwen3 tokenizer (tokenizers/qwen3) under $MOE8_SHARED_DATA
(or ../shared/data beside the checkout; --data-dir overrides), tokenised and batched by
bench_fp8_convergence.py's token_batches; without them the script says where it looked and exits with status
2. --tiny folds the ids into the toy vocabulary (ids % 1001, stated in the JSON).

Writes loss_parity_<device>.json (run_info stamp; per family both curves, cross-entropy and total, the means
of the last 10 steps and their relative gap, the largest per-step gap, the first step's gap, tokens/s and peak
memory of each side, PASS / FAIL against --target) after every family; prints a table last. A FAIL is
reported, not raised: the exit status is 0 whenever both sides ran.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8_convergence import corpus_meta, lr_at, require_data, token_batches  # noqa: E402
from bench_step_profile import FAMILIES, TINY, build  # noqa: E402

import moe8  # noqa: E402
from moe8 import hf  # noqa: E402
from moe8.config import fields  # noqa: E402

LAST = 10  # the steps averaged at the end
VOCAB = 151936  # Qwen3-30B-A3B's config.vocab_size: its tokenizer's 151,669 ids padded to a multiple of 128
MAX_POSITIONS = 4096  # build()'s max_position_embeddings


def train(model, batches, a, device) -> dict:
    """Train `model` on batches[step] for every step; the losses (total and cross-entropy), aux losses,
    whether outputs.logits came back, tokens/s from step `timed_from` on, peak GiB."""
    coef = float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)
    if not getattr(model.config, "output_router_logits", False):
        coef = 0.0  # no router logits, no aux loss in outputs.loss
    opt = torch.optim.AdamW(
        model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda"
    )
    model.train()
    steps = batches.shape[0]
    timed_from = min(5, steps // 2)  # the first steps warm up allocators and kernels
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, auxes, logits_none, t0 = [], [], [], time.perf_counter()
    for step in range(steps):
        if step == timed_from:
            sync()
            t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, a.lr, a.warmup)
        ids = batches[step].to(device, non_blocking=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.detach().float())  # kept on the device: no host sync per step
        aux = getattr(out, "aux_loss", None)
        auxes.append(aux.detach().float() if aux is not None and coef else torch.zeros((), device=device))
        logits_none.append(out.logits is None)
    sync()
    secs = time.perf_counter() - t0
    total = torch.stack(losses).tolist()
    aux = torch.stack(auxes).tolist()
    return dict(
        loss=total,
        aux_loss=aux,
        ce=[t - coef * x for t, x in zip(total, aux)],
        aux_coef=coef,
        logits_none=all(logits_none),
        finite=all(map(math.isfinite, total)),
        tokens_per_s=(steps - timed_from) * batches[0].numel() / secs if secs > 0 else None,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    )


def rel(x: float, ref: float) -> float:
    return abs(x - ref) / abs(ref) if ref else math.inf


def compare(ref: dict, m8: dict, target: float) -> dict:
    """The two sides' curves against each other: last-10 means and their gap, largest per-step gap, first step."""
    out = {}
    for key in ("ce", "loss"):
        a, b = ref[key], m8[key]
        n = min(LAST, len(a))
        mean_a, mean_b = sum(a[-n:]) / n, sum(b[-n:]) / n
        out[key] = dict(
            last_mean_transformers=mean_a,
            last_mean_moe8=mean_b,
            last_rel_gap=rel(mean_b, mean_a),
            max_step_rel_gap=max(rel(y, x) for x, y in zip(a, b)),
            first_step_rel_gap=rel(b[0], a[0]),
        )
    worst = max(out["ce"]["last_rel_gap"], out["loss"]["last_rel_gap"])
    ok = worst < target and ref["finite"] and m8["finite"]
    return dict(out, last_steps=min(LAST, len(ref["ce"])), verdict="PASS" if ok else "FAIL")


def nudged(state: dict, seed: int) -> dict:
    """The state dict with every floating-point value moved by one unit in the last place, up or down at
    random (its bit pattern +-1): a perturbation at the size of one rounding, for the noise-floor run."""
    gen = torch.Generator().manual_seed(seed)
    ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    out = {}
    for k, v in state.items():
        if v.dtype not in ints or v.numel() == 0:
            out[k] = v
            continue
        step = torch.randint(0, 2, v.shape, generator=gen, dtype=ints[v.dtype]) * 2 - 1  # -1 or +1
        bits = v.contiguous().view(ints[v.dtype])
        moved = (bits + step).view(v.dtype)
        out[k] = torch.where(v == 0, v, moved)  # zeros (and what they stand for: masks, biases) stay
    return out


def run_family(name, batches, vocab, a, device, dtype) -> dict:
    """Both sides of one family: transformers first, then moe8 on the same initial weights; with --control a
    third run, transformers from the initial weights nudged by one ulp (nudged), whose gap to the first is
    the noise floor of the comparison (what bf16 rounding alone does to this run)."""
    model = build(name, a.tiny, device, dtype, vocab)
    if hf.is_accelerated(model) or hf.config_of(model) is not None:
        raise RuntimeError(f"bench_loss_parity: {name}'s transformers model runs on moe8")
    init = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    params = sum(p.numel() for p in model.parameters())
    print(f"[parity] {name}: transformers, {batches.shape[0]} steps", flush=True)
    ref = dict(train(model, batches, a, device), experts=model.config._experts_implementation)
    del model
    free(device)

    control = None
    if a.control:
        model = build(name, a.tiny, device, dtype, vocab)
        model.load_state_dict(nudged(init, a.seed), strict=True)
        print(
            f"[parity] {name}: transformers from weights nudged by one ulp, {batches.shape[0]} steps",
            flush=True,
        )
        control = train(model, batches, a, device)
        del model
        free(device)

    model = build(name, a.tiny, device, dtype, vocab)
    model.load_state_dict(init, strict=True)
    same = all(torch.equal(v, init[k].to(v.device)) for k, v in model.state_dict().items())
    del init
    moe8.accelerate(model)
    cfg = hf.config_of(model)
    if not hf.is_accelerated(model) or cfg is None:
        raise RuntimeError(f"bench_loss_parity: moe8.accelerate left {name} on transformers' experts")
    print(f"[parity] {name}: moe8, {batches.shape[0]} steps", flush=True)
    try:
        m8 = dict(train(model, batches, a, device), experts=model.config._experts_implementation)
    finally:
        moe8.disable()  # RoPE's fusion is process-wide: the next family's transformers side must not get it
    del model
    free(device)
    return dict(
        family=name,
        model_type=FAMILIES[name][0],
        params=params,
        vocab=vocab,
        same_initial_weights=same,
        moe8_config={k: str(getattr(cfg, k)) for k in fields()},
        transformers=ref,
        moe8=m8,
        **compare(ref, m8, a.target),
        **({} if control is None else dict(control=dict(run=control, **compare(ref, control, a.target)))),
    )


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def pct(x: float) -> str:
    return f"{100 * x:.3f}%" if x >= 1e-5 else f"{100 * x:.0e}%"


def report(rows, target):
    print(
        f"\n{'family':<12} {'params':>9} {'HF tok/s':>9} {'moe8 tok/s':>10} {'step 0 gap':>10} "
        f"{'HF last CE':>10} {'moe8 last CE':>12} {'CE gap':>8} {'loss gap':>8} {'max step':>8}  verdict"
    )
    controls = [r for r in rows if "control" in r]
    for r in rows:
        ce, hf_side, m8 = r["ce"], r["transformers"], r["moe8"]
        tps = [f"{s['tokens_per_s']:,.0f}" if s["tokens_per_s"] else "-" for s in (hf_side, m8)]
        print(
            f"{r['family']:<12} {r['params'] / 1e6:>8,.1f}M {tps[0]:>9} {tps[1]:>10} "
            f"{pct(ce['first_step_rel_gap']):>10} {ce['last_mean_transformers']:>10.4f} "
            f"{ce['last_mean_moe8']:>12.4f} {pct(ce['last_rel_gap']):>8} "
            f"{pct(r['loss']['last_rel_gap']):>8} {pct(ce['max_step_rel_gap']):>8}  {r['verdict']}"
        )
    if controls:
        print("\nnoise floor (--control): transformers against itself from weights nudged by one ulp")
        for r in controls:
            c, ce = r["control"]["ce"], r["ce"]
            print(
                f"{r['family']:<12} control CE gap {pct(c['last_rel_gap']):>8} (largest step "
                f"{pct(c['max_step_rel_gap'])}), moe8's {pct(ce['last_rel_gap'])}"
            )
    n = sum(r["verdict"] == "PASS" for r in rows)
    print(
        f"{n} of {len(rows)} families within {100 * target:g} % (mean of the last {LAST} steps, cross-entropy "
        "and total loss)"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for loss_parity_<device>.json")
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, from {list(FAMILIES)}")
    ap.add_argument("--steps", type=int, default=None, help="steps per side (default 50; --tiny: 8)")
    ap.add_argument("--batch", type=int, default=8, help="sequences a step (default 8)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens a sequence (default 2048)")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-4; --tiny: 1e-2)")
    ap.add_argument("--warmup", type=int, default=10, help="linear warm-up steps, then cosine to 10 %%")
    ap.add_argument(
        "--seed", type=int, default=0, help="the data order's seed (the weights' is build()'s: 0)"
    )
    ap.add_argument("--lines", type=int, default=100000, help="corpus lines read")
    ap.add_argument(
        "--vocab",
        type=int,
        default=VOCAB,
        help=f"every slice's vocabulary size, >= the tokenizer's (default {VOCAB})",
    )
    ap.add_argument(
        "--target", type=float, default=0.01, help="largest relative gap that passes (default 0.01)"
    )
    ap.add_argument(
        "--data-dir", default=None, help="folder with text/ and tokenizers/qwen3 (default: shared)"
    )
    ap.add_argument(
        "--control",
        action="store_true",
        help="per family a third run: transformers from the initial weights nudged by one ulp, the "
        "comparison's noise floor (its gap to transformers beside moe8's)",
    )
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="CPU: toy configs, fp32, 2 x 32 tokens, ids %% 1001, lr 1e-2, at most 3 warm-up steps",
    )
    a = ap.parse_args(argv)
    names = a.families.split(",")
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        ap.error(f"--families: unknown {unknown}, expected from {list(FAMILIES)}")
    if len(set(names)) != len(names):
        ap.error(f"--families: each family once, got {names}")
    if a.tiny:
        a.batch, a.seq, a.lines = 2, 32, 400
        a.warmup = min(a.warmup, 3)
    a.steps = a.steps if a.steps is not None else 8 if a.tiny else 50
    a.lr = a.lr if a.lr is not None else 1e-2 if a.tiny else 3e-4  # the toy models move visibly in 8 steps
    for flag in ("steps", "batch", "seq", "lines", "lr"):
        if getattr(a, flag) <= 0:
            ap.error(f"--{flag}: expected > 0, got {getattr(a, flag)}")
    if a.seq > MAX_POSITIONS:
        ap.error(f"--seq: expected <= {MAX_POSITIONS} (the slices' max_position_embeddings), got {a.seq}")
    if a.warmup < 0 or not 0 < a.target < 1:
        ap.error(f"--warmup: expected >= 0, got {a.warmup}; --target: expected in (0, 1), got {a.target}")
    found = require_data(a.data_dir, "bench_loss_parity")
    if found is None:
        return 2
    if a.tiny:
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not moe8.cuda_available():
            print("bench_loss_parity: needs a CUDA GPU and moe8 built with CUDA (or --tiny)", file=sys.stderr)
            return 1
        device, dtype = torch.device("cuda"), torch.bfloat16
    moe8.disable()  # nothing of an earlier enable() in this process: transformers' side runs transformers
    print(f"data: {found[0]}, tokenizer {found[1]}", flush=True)
    batches, len_tok, n_seqs = token_batches(*found, a.lines, a.seq, a.batch, a.steps, a.seed)
    mapping = f"none: every slice has {a.vocab} rows, the tokenizer {len_tok} ids"
    if not a.tiny and a.vocab < len_tok:
        ap.error(f"--vocab: expected >= the tokenizer's {len_tok} ids, got {a.vocab}")
    if a.tiny:  # a 151k-row embedding and LM head would dominate the toy models on a CPU
        vocab = TINY["vocab_size"]
        batches = batches % vocab
        mapping = f"ids % {vocab}"
    else:
        vocab = a.vocab
    meta = dict(
        corpus_meta(device, "bench_loss_parity.py", argv, found, n_seqs),
        vocab_size=vocab,
        tokenizer_ids=len_tok,
        id_mapping=mapping,
        tiny=a.tiny,
        dtype=str(dtype).replace("torch.", ""),
        steps=a.steps,
        batch=a.batch,
        seq=a.seq,
        optimizer="AdamW"
        + (" fused" if device.type == "cuda" else "")
        + ", betas (0.9, 0.95), weight decay 0.1",
        lr=f"{a.lr:g}, {a.warmup} linear warm-up steps, then cosine to 10 %",
        clip_grad_norm=1.0,
        seed=a.seed,
        target=a.target,
        moe8="moe8.accelerate(model): moe8.Config() defaults",
        transformers_experts="grouped_mm",
        ce="outputs.loss - router_aux_loss_coef * outputs.aux_loss (outputs.loss includes the aux loss)",
    )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = "cpu" if device.type == "cpu" else re.sub(r"[^a-z0-9]+", "_", meta["gpu"].lower()).strip("_")
    path = out / f"loss_parity_{gpu}.json"
    rows = []
    for name in names:  # the JSON rewritten after each family: a time limit keeps the finished ones
        rows.append(run_family(name, batches, vocab, a, device, dtype))
        path.write_text(json.dumps(dict(meta, families=rows), indent=1) + "\n")
    print(f"\nwrote {path}")
    report(rows, a.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
