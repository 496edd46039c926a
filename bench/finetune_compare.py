"""Side by side: the `moe8 finetune` runs of scripts/gpu_finetune.sh (DIR/{lora,full}-{moe8,no-moe8}/metrics.jsonl),
as JSON and a markdown table: tokens/s (median over the logged steps after the first 10%), peak memory, first
and last loss, last eval loss, and moe8's speed-up over transformers for each method.

    python bench/finetune_compare.py OUT --json OUT/finetune_1b_h200.json --md OUT/finetune_1b_h200.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from run_info import run_info  # this folder is on sys.path


def summarize(path: Path) -> dict | None:
    if not path.is_file():
        return None
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    steps = [x for x in lines if x.get("step", 0) > 0]
    if not steps:
        return None
    rates = [x["tokens_per_s"] for x in steps if x.get("tokens_per_s")]
    rates = rates[len(rates) // 10 :] or rates
    evals = [x["eval_loss"] for x in lines if x.get("eval_loss") is not None]
    mfu = [x["mfu"] for x in steps if x.get("mfu") is not None]
    return dict(
        steps=steps[-1]["step"],
        tokens_per_s=statistics.median(rates) if rates else None,
        mfu=statistics.median(mfu) if mfu else None,
        peak_gib=max(x.get("memory_gib") or 0 for x in steps),
        first_loss=steps[0]["loss"],
        last_loss=steps[-1]["loss"],
        first_eval_loss=evals[0] if evals else None,
        last_eval_loss=evals[-1] if evals else None,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="the folder holding {lora,full}-{moe8,no-moe8}/metrics.jsonl")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    root = Path(args.dir)
    runs = {
        f"{m}-{i}": summarize(root / f"{m}-{i}" / "metrics.jsonl")
        for m in ("lora", "full")
        for i in ("moe8", "no-moe8")
    }
    rows = [
        "| run | steps | tokens/s | MFU | peak GiB | loss first -> last | eval loss first -> last |",
        "|---|---|---|---|---|---|---|",
    ]
    speedup = {}
    for name, r in runs.items():
        if r is None:
            rows.append(f"| {name} | - | - | - | - | missing | - |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        ev = (
            f"{r['first_eval_loss']:.3f} -> {r['last_eval_loss']:.3f}"
            if r["last_eval_loss"] is not None
            else "-"
        )
        rows.append(
            f"| {name} | {r['steps']} | {r['tokens_per_s']:,.0f} | {mfu} | {r['peak_gib']:.1f} | "
            f"{r['first_loss']:.3f} -> {r['last_loss']:.3f} | {ev} |"
        )
    for m in ("lora", "full"):
        a, b = runs.get(f"{m}-moe8"), runs.get(f"{m}-no-moe8")
        if a and b and a["tokens_per_s"] and b["tokens_per_s"]:
            speedup[m] = dict(
                tokens_per_s=a["tokens_per_s"] / b["tokens_per_s"], peak_memory=a["peak_gib"] / b["peak_gib"]
            )
            rows.append(
                f"\n{m}: moe8 / transformers tokens/s {speedup[m]['tokens_per_s']:.2f}x, peak memory {speedup[m]['peak_memory']:.2f}x"
            )
    text = "\n".join(rows)
    print(text)
    # the versions of this process: scripts/gpu_finetune.sh compares right after the runs, on their machine
    meta = run_info()
    if args.json:
        out = dict(meta=meta, runs=runs, moe8_over_transformers=speedup)
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.md:
        facts = "\n".join(f"| {k} | {v} |" for k, v in meta.items())
        Path(args.md).write_text(f"| | |\n| --- | --- |\n{facts}\n\n{text}\n")
    return 0 if all(runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
