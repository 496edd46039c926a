"""moe8 finetune — fine-tune a Hugging Face MoE model (full or LoRA) with its experts on moe8.

    moe8 finetune                          a quick run on a built-in tiny model (2 CPU cores: 45-80 s, ~12 s
                                           of it start-up and data, then 200 steps, slower on busy cores)
    moe8 finetune CONFIG.toml [--KEY VALUE ...]    keys from the file, flags override them
    moe8 finetune CONFIG.toml --resume     continue after a kill, from the last checkpoint
    moe8 finetune --recipe NAME --data FILE    a recipe that ships with moe8 (`moe8 recipes` lists them)
    moe8 finetune --model ORG/NAME         a Hugging Face model by id (the local cache first); --data ORG/NAME too

Data: .txt, JSONL / JSON, csv / parquet / arrow (with datasets) files of text, messages, alpaca or ShareGPT
records, .txt / .jsonl / .json / .csv also gzip, bz2, xz or zstd compressed; chats have loss on the assistant
turns only; each document or conversation is packed whole into one sequence (--packing stream: end to end),
with per-document position_ids. --resume checks the data against the checkpoint's (--allow-data-change). The
peak GPU memory is estimated before loading (--no-memory-check to skip the refusal).
Progress: a bar on a terminal; in a log file or pipe (or with --no-progress) one line per logged step.
Writes into output_dir: the model (save_pretrained + tokenizer, or the PEFT adapter for LoRA),
metrics.jsonl (one line per logged step: loss, eval_loss, lr, tokens/s, MFU, memory, grad norm, router losses,
per-expert token fraction of every MoE layer; also to report_to = tensorboard / wandb / mlflow), report.html (charts and expert-load heatmaps), checkpoints for --resume.
Every key below can be set in CONFIG.toml (`micro_batch = 4`) or as a flag (`--micro_batch 4`; no abbreviations).
Exit status: 2 bad input (nothing written), 1 out of memory, 3 the loss diverged (the last checkpoint kept),
130 interrupted. See docs/finetune.md."""

from __future__ import annotations

import argparse
import difflib
import sys

from .config import Config, DivergedError, FinetuneError, add_flags, make_config, snake_flags, to_toml
from .memory import MemoryCheckError


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="moe8 finetune",
        usage="moe8 finetune [CONFIG.toml | --recipe NAME] [--KEY VALUE ...]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --ste is not --steps: a typo must not silently pick a key
    )
    ap.add_argument("config", nargs="?", help="a TOML file of config keys (optional)")
    ap.add_argument("--print_config", action="store_true", help="print the config as TOML, exit")
    ap.add_argument(
        "--recipe",
        metavar="NAME",
        help="a recipe that ships with moe8 instead of CONFIG.toml (flags override its keys; --model DIR: a "
        "local copy of its model)",
    )
    ap.add_argument("--list_recipes", action="store_true", help="list the recipes (as `moe8 recipes`), exit")
    add_flags(ap.add_argument_group("config keys (TOML key = flag name)"))
    return ap


def main(argv=None, on_step=None) -> int:
    """The `moe8 finetune` command; returns the exit status (2: bad input, 1: out of memory or an
    estimated peak over the GPU's memory, 3: the loss diverged to NaN / inf, 130: interrupted)."""
    ap = parser()
    known, unknown = ap.parse_known_args(snake_flags(list(sys.argv[1:] if argv is None else argv)))
    if unknown:
        ap.error(f"unrecognized arguments: {' '.join(unknown)}{_suggest(ap, unknown)}")
    args = vars(known)
    path, show = args.pop("config"), args.pop("print_config")
    recipe, list_recipes = args.pop("recipe"), args.pop("list_recipes")
    import torch

    from . import hub, recipes

    if list_recipes:
        print(recipes.listing())
        return 0
    try:
        if recipe is not None:
            path = _recipe(recipe, path, args)
        cfg = make_config(path, args)
        if show:
            print(to_toml(cfg), end="")
            return 0
        cfg = hub.local_data(cfg)  # a missing file named by its key; a Hub dataset id: its cached file
        from .train import run

        trainer = run(cfg, on_step=on_step)
    except MemoryCheckError as e:  # before anything is loaded or written
        print(f"moe8 finetune: error: {e}", file=sys.stderr)
        return 1
    except FinetuneError as e:
        print(f"moe8 finetune: error: {e}", file=sys.stderr)
        return 2
    except DivergedError as e:
        print(f"moe8 finetune: error: {e}", file=sys.stderr)
        return 3
    except torch.OutOfMemoryError as e:
        first = str(e).splitlines()[0] if str(e) else "out of memory"
        print(
            f"moe8 finetune: error: {first}\n  The model, its optimizer state and the activations of one micro-batch "
            "must fit on the GPU. Try:\n  --micro_batch smaller (with --grad_accum larger, the same batch)\n"
            "  --activation_checkpointing (recompute activations in the backward)\n  --method lora (no gradients "
            "or optimizer state for the base weights)\n  --seq_len shorter",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print(
            "\nmoe8 finetune: interrupted; --resume continues from the last checkpoint, if one was written",
            file=sys.stderr,
        )
        return 130
    out, last = trainer.out, trainer.last
    if not trainer.dist.main:  # rank 0 reports
        return 0
    if last.get("step") == trainer.steps:
        what = "adapter" if cfg.method == "lora" else "model"
        ev = f", eval loss {last['eval_loss']:.3f}" if last.get("eval_loss") is not None else ""
        print(f"done: {trainer.steps} steps, loss {last.get('loss', float('nan')):.3f}{ev}; {what}: {out}")
    print(f"report: {out / 'report.html'}")
    return 0


def _recipe(name: str, path: str | None, args: dict) -> str:
    """The file of recipe `name`; a recipe that names no model needs --model or --model-config (which then
    runs under the recipe's name)."""
    from .config import load_toml
    from .recipes import path as recipe_path

    if path:
        raise FinetuneError(f"--recipe {name} and the config file {path}: give one of them")
    found = str(recipe_path(name))
    if "model" not in load_toml(found) and "model" not in args:
        if "model_config" not in args:
            raise FinetuneError(
                f"recipe {name} names no model (no published checkpoint has its shape): pass --model DIR (a "
                f"checkpoint of that shape), or --model-config {name.rsplit('_', 1)[0]} for random weights"
            )
        args["model"] = name
    return found


def _suggest(ap: argparse.ArgumentParser, unknown: list[str]) -> str:
    """'; did you mean --steps?' for the unknown flags close to a known one ('' if none is)."""
    from .config import suggest

    flags = [f for a in ap._actions for f in a.option_strings if f.startswith("--")]
    hints = []
    for u in unknown:
        flag = u.partition("=")[0]
        if not flag.startswith("--"):
            continue
        no = flag.startswith("--no-")  # --no-KEY of a boolean key
        key = suggest(flag[5:] if no else flag[2:])  # another trainer's name (--learning_rate: --lr), a typo
        m = [f"--no-{key}" if no else f"--{key}"] if key else []
        m = [f for f in m + difflib.get_close_matches(flag, flags, 1, 0.6) if f in flags]
        if m:
            hints.append(f"{m[0]} for {flag}" if len(unknown) > 1 else m[0])
    return f"; did you mean {', '.join(hints)}?" if hints else ""


def __getattr__(name):  # the Trainer callback imports transformers: only when asked for
    if name == "RoutingStatsCallback":
        from .callback import RoutingStatsCallback

        return RoutingStatsCallback
    raise AttributeError(name)


__all__ = ["Config", "DivergedError", "FinetuneError", "RoutingStatsCallback", "main", "make_config"]
