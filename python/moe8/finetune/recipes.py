"""The recipes that ship with moe8 (moe8/recipes/NAME.toml, in the wheel): configs of `moe8 finetune` for real
checkpoints, found by name (`moe8 finetune --recipe NAME`) and listed with what was measured of them
(`moe8 recipes`). A recipe names its model by Hugging Face id; --model DIR runs it on a local copy."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

from .config import FinetuneError, load_toml

DIR = Path(__file__).resolve().parents[1] / "recipes"
# measured at full depth on one H200, random weights, 50 steps of one micro-batch of the recipe's shape
# (bench/bench_recipes.py --full): moe8's peak GiB and tokens/s, then transformers + PEFT's
MEASURED_ON = (
    "one H200, full depth, random weights, one micro-batch a step (bench/results/recipes_full_h200.md)"
)
MEASURED = {
    "qwen3_30b_a3b_lora": (36.5, 15225, 78.3, 4566),
    "gpt_oss_20b_lora": (47.4, 6196, 86.8, 2439),
    "mixtral_8x7b_lora": (92.4, 4688, 96.1, 2414),
    "olmoe_1b_7b_full": (116.3, 23696, 117.0, 15205),
    "deepseek_v3_reduced_lora": (11.5, 40521, 36.8, 23218),
}


def names() -> list[str]:
    return sorted(p.stem for p in DIR.glob("*.toml"))


def path(name: str) -> Path:
    """recipes/NAME.toml; FinetuneError listing the recipes (and the closest name) for an unknown one."""
    p = DIR / f"{name.removesuffix('.toml')}.toml"
    if not p.is_file():
        close = difflib.get_close_matches(name, names(), 1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise FinetuneError(
            f"recipe: no recipe {name!r}{hint}; the recipes: {', '.join(names())} (`moe8 recipes` lists them)"
        )
    return p


def summary(name: str) -> dict:
    """What `moe8 recipes` shows of a recipe: its model, method, GPUs and the measured figures."""
    table = load_toml(str(path(name)))
    ep = table.get("ep", 1)
    measured = MEASURED.get(name)
    return dict(
        name=name,
        model=table.get("model", "none: --model DIR or --model-config"),
        method=table.get("method", "full"),
        gpus=f"{ep} (torchrun, ep {ep})" if ep > 1 else "1",
        tokens=f"{table.get('micro_batch', 8)} x {table.get('seq_len', 128)}",
        peak=f"{measured[0]:.1f} GiB" if measured else "not measured",
        tokens_per_s=f"{measured[1]:,}" if measured else "not measured",
        peer=f"{measured[2]:.1f} GiB, {measured[3]:,}" if measured else "",
    )


def listing() -> str:
    rows = [summary(n) for n in names()]
    cols = [
        ("recipe", "name"),
        ("model", "model"),
        ("method", "method"),
        ("GPUs", "gpus"),
        ("micro-batch", "tokens"),
        ("peak", "peak"),
        ("tokens/s", "tokens_per_s"),
        ("transformers + PEFT", "peer"),
    ]
    width = {k: max(len(h), *(len(r[k]) for r in rows)) for h, k in cols}
    lines = ["  ".join(h.ljust(width[k]) for h, k in cols).rstrip()]
    lines += ["  ".join(r[k].ljust(width[k]) for _, k in cols).rstrip() for r in rows]
    return (
        "\n".join(lines)
        + f"\n\nmeasured: {MEASURED_ON}; the ep > 1 recipes need several GPUs and were not measured."
        + f"\nrun one: moe8 finetune --recipe NAME [--model DIR] [--data FILE]; the files: {DIR}"
        + "\nprint one: moe8 recipes NAME"
    )


USAGE = """usage: moe8 recipes [NAME]

Lists the fine-tuning recipes that ship with moe8: each one's model (a Hugging Face id), method, GPUs, tokens
per micro-batch, and its measured peak memory and tokens/s (moe8, then transformers + PEFT) where measured.
With NAME, prints that recipe's TOML (a starting point for your own config).
Run one with `moe8 finetune --recipe NAME`; --model DIR runs it on a local copy of the model."""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if len(argv) > 1:
        print(
            f"moe8 recipes: error: expected at most one recipe name, got {argv}\n\n{USAGE}", file=sys.stderr
        )
        return 2
    try:
        print(path(argv[0]).read_text() if argv else listing(), end="" if argv else "\n")
    except FinetuneError as e:
        print(f"moe8 recipes: error: {e}", file=sys.stderr)
        return 2
    return 0
