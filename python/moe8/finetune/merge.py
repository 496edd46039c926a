"""moe8 merge — fold a LoRA adapter (attention and experts) into its base model and write a plain Hugging Face
checkpoint that transformers loads without moe8 or PEFT.

    moe8 merge ADAPTER --out DIR [--base MODEL_DIR] [--overwrite]

The base is --base, else the base_model/ folder `moe8 finetune` writes beside a built-in model's adapter, else
the adapter's base_model_name_or_path. The adapter is loaded with moe8.lora.load_adapter; each LoRA is folded
into its weight in float64 and cast back to the weight's dtype: a linear layer W [out, in] += s * B·A, each
expert W[e] += s * L[e]·R[e] in the stored layout (moe8.lora._factors: GPT-OSS's [E, in, out] included).
Writes save_pretrained (safetensors) and the tokenizer files (the adapter's, else the base's); nothing is written
on bad input. See docs/finetune.md, "Merging an adapter"."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

from .config import FinetuneError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="moe8 merge",
        usage="moe8 merge ADAPTER --out DIR [--base MODEL_DIR] [--overwrite]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "adapter", help="a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors)"
    )
    ap.add_argument("--out", required=True, help="the directory to write the merged checkpoint into")
    ap.add_argument(
        "--base",
        help="the base model directory (default: ADAPTER/base_model, else the adapter's "
        "base_model_name_or_path)",
    )
    ap.add_argument("--overwrite", action="store_true", help="replace DIR when it exists and is not empty")
    return ap


# ----------------------------------------------------------------------------------------------- folding
def fold_linear(m: nn.Module) -> nn.Linear:
    """A plain nn.Linear holding W + s * B·A of a moe8.lora.LoraLinear (W [out, in], B [out, r], A [r, in])."""
    with torch.no_grad():
        w = m.weight
        delta = m.scaling * (m.lora_B.double() @ m.lora_A.double())  # [out, in]
        w.copy_((w.double() + delta.to(w.device)).to(w.dtype))
    plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
    plain.weight, plain.bias = m.weight, m.bias
    return plain


def fold_experts(m: nn.Module) -> None:
    """Fold an experts module's moe8 LoRA into gate_up_proj and down_proj in place, then remove it (its
    parameters, scaling and the forward pre-hook that asks for moe8)."""
    from moe8 import lora

    s = m.lora_scaling
    with torch.no_grad():
        for param in ("gate_up_proj", "down_proj"):
            w = getattr(m, param)  # [E, d1, d2] as stored
            L, R = lora._factors(m, param)  # [E, d1, r], [E, r, d2]: W[e] + s * L[e]·R[e]
            for e in range(w.shape[0]):  # one expert at a time: float64 of one [d1, d2] matrix, not of all
                delta = s * (L[e].double() @ R[e].double())
                w[e].copy_((w[e].double() + delta.to(w.device)).to(w.dtype))
    for name in ("gate_up_lora_A", "gate_up_lora_B", "down_lora_A", "down_lora_B"):
        delattr(m, name)
    del m.lora_scaling, m.lora_dropout
    for key, hook in list(m._forward_pre_hooks.items()):
        if hook is lora._needs_moe8:
            del m._forward_pre_hooks[key]


def merge_lora(model: nn.Module) -> int:
    """Fold every moe8 LoRA of a model (apply_lora / load_adapter) into its base weights and remove the LoRA
    modules and parameters; returns how many LoRA modules were folded."""
    from moe8 import lora

    base = lora._base(model)
    lora._settings(base)  # a model without moe8 LoRA: ValueError
    n = 0
    for name, m in list(base.named_modules()):
        if isinstance(m, lora.LoraLinear):
            if lora.frozen_fp8(m.weight) is not None:
                raise ValueError(
                    f"moe8 merge: {name}: its base weight is stored in FP8 only (freeze_base_fp8)"
                )
            parent, _, child = name.rpartition(".")
            setattr(base.get_submodule(parent), child, fold_linear(m))
            n += 1
        elif lora._is_experts(m) and hasattr(m, "gate_up_lora_A"):
            fold_experts(m)
            n += 1
    del base._moe8_lora
    return n


# ------------------------------------------------------------------------------------------ the command
def _adapter(path: Path) -> dict:
    import json

    from moe8.lora import CONFIG, WEIGHTS

    if not path.is_dir():
        raise FinetuneError(f"adapter: {path} is not a directory")
    for f in (CONFIG, WEIGHTS):
        if not (path / f).is_file():
            raise FinetuneError(f"adapter: {path} has no {f}: not a PEFT adapter directory")
    try:
        return json.loads((path / CONFIG).read_text())
    except ValueError as e:
        raise FinetuneError(f"adapter: cannot read {path / CONFIG}: {e}") from None


def _find_base(adapter: Path, config: dict, base: str | None) -> str:
    """The base model's directory (or hub name), or FinetuneError saying every place looked at."""
    if base is not None:
        if not (Path(base) / "config.json").is_file():
            raise FinetuneError(f"--base: {base} has no config.json: not a Hugging Face model directory")
        return base
    looked = [str(adapter / "base_model")]
    if (adapter / "base_model" / "config.json").is_file():
        return str(adapter / "base_model")
    name = config.get("base_model_name_or_path")
    if name:
        looked.append(f"base_model_name_or_path {name!r}")
        if (Path(name) / "config.json").is_file():
            return name
        if not Path(name).exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not name.startswith("."):
            return name  # a Hub name (org/model): from_pretrained finds it in the cache or downloads it
    else:
        looked.append(f"base_model_name_or_path (empty in {adapter / 'adapter_config.json'})")
    raise FinetuneError(f"no base model found: looked at {', '.join(looked)}; give one with --base MODEL_DIR")


def _check_out(out: Path, overwrite: bool, keep: list[Path]) -> None:
    if out.exists() and not out.is_dir():
        raise FinetuneError(f"--out: {out} exists and is not a directory")
    here = out.resolve()
    for p in keep:
        p = p.resolve()
        if here == p or here in p.parents or p in here.parents:
            raise FinetuneError(f"--out: {out} would overlap {p}, which the merge reads")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FinetuneError(f"--out: {out} exists and is not empty (--overwrite to replace it)")


def merge(adapter, out, base=None, overwrite: bool = False, log=print) -> Path:
    """Merge the adapter into its base and write the checkpoint into out; returns out. FinetuneError for bad
    input, before anything is written."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from moe8 import hf
    from moe8.lora import load_adapter

    adapter, out = Path(adapter), Path(out)
    config = _adapter(adapter)
    where = _find_base(adapter, config, base)
    _check_out(out, overwrite, [adapter] + ([Path(where)] if Path(where).exists() else []))
    log(f"moe8 merge: base {where}, adapter {adapter}")
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype="auto")
    except (OSError, ValueError) as e:
        raise FinetuneError(f"base: cannot load {where}: {e}") from None
    original = model.config._experts_implementation
    try:
        load_adapter(model, adapter)
    except (ValueError, KeyError) as e:  # shapes, missing or extra tensors, modules the base lacks
        msg = e.args[0] if e.args else str(e)
        raise FinetuneError(f"the base {where} does not fit the adapter {adapter}: {msg}") from None
    n = merge_lora(model)
    if hf.is_accelerated(model):  # load_adapter put the experts on moe8: the checkpoint is transformers'
        model.set_experts_implementation(original)
    tmp = out.parent / f".{out.name}.merging-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        bars = logging.is_progress_bar_enabled()
        logging.disable_progress_bar()
        try:
            model.save_pretrained(tmp)
        finally:
            if bars:
                logging.enable_progress_bar()
        src = adapter if any((adapter / f).is_file() for f in TOKENIZER_FILES) else Path(where)
        for f in TOKENIZER_FILES:
            if (src / f).is_file():
                shutil.copy2(src / f, tmp / f)
        if out.is_dir():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"moe8 merge: folded {n} LoRA modules; wrote {out}")
    return out


def main(argv=None) -> int:
    """The `moe8 merge` command; returns the exit status (2: bad input, nothing written)."""
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        merge(args.adapter, args.out, args.base, args.overwrite)
    except FinetuneError as e:
        print(f"moe8 merge: error: {e}", file=sys.stderr)
        return 2
    return 0


__all__ = ["fold_experts", "fold_linear", "main", "merge", "merge_lora"]
