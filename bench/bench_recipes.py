"""The recipes/ of `moe8 finetune` measured: for each recipe, N steps through moe8 finetune's trainer and the same
model, data and training settings through plain transformers (+ PEFT for LoRA), one side after the other in one
process; per side the loss of every step, tokens/s, peak GiB (its own: the other side freed first) and moe8's
memory estimate, into OUT/recipes.json, rewritten after every recipe (a run cut short keeps the finished ones).

There are no real checkpoints here: each model is built with random weights from its real config
(recipes/configs/*.json) at a reduced layer count (--layers), with 1024-token sequences and ep 1 on one GPU (the
full fine-tuning recipes for 4 or 8 GPUs included: fewer layers make them fit), 50 steps per side of which the
first 2 are not timed:

    python bench/bench_recipes.py --out bench/results/recipes
    python bench/bench_recipes.py --full --out DIR     # the one-GPU recipes as written: full depth, 4096 tokens
    python bench/bench_recipes.py --full --baseline-steps 20 --out DIR   # the transformers side's first 20 steps

--tiny: every model at toy width (hidden 64, 8 experts, 2 layers) on the CPU in fp32, 4 steps: the test suite's
check that each recipe runs through both paths and that the two compute the same losses.

Both sides train the same way, and each records what it used (`settings`) so that a difference shows:
- the same random init (the seed, transformers' from_config on the device) and the same packed micro-batches
  (moe8 finetune's data, per-document position_ids), in the same order;
- the recipe's optimizer: its peak lr (--lr to override), linear warmup and cosine decay (moe8 finetune's
  schedule), AdamW with weight decay on matrices only, gradient clipping at max_grad_norm, bf16 weights with
  fp32 master copies (LoRA adapters in an explicit lora_dtype train in it: PEFT's autocast_adapter_dtype=False);
- the objective: next-token cross-entropy + aux_loss_coef x the router load-balancing loss (the model's
  router_aux_loss_coef; transformers adds it to its labels= loss, which the baseline trains on). The loss
  recorded on both sides is the cross-entropy alone, the aux loss beside it;
- the recipe's activation checkpointing, micro_batch and, for LoRA, rank, alpha and targets (moe8.lora against
  PEFT: target_modules for attention, target_parameters for the fused experts). LoRA's A factors are drawn
  differently by the two, so LoRA losses agree at step 0 and stay close after, not equal.

Peak memory: a full fine-tune peaks in the optimizer step, over the weights, fp32 master copies, fp32
gradients and AdamW states (18 bytes per parameter with torch's fused AdamW, which both sides use on a GPU as
moe8 finetune and transformers' Trainer do; the default foreach AdamW adds an fp32 temporary per parameter, 22):
the two sides hold the same there, so their peaks differ by a few MiB at most. Each side's peak is split into
`peak_backward_gib` (forward / backward) and `peak_step_gib` (the optimizer step) to show where it is. On the CPU
the figures are the resident set's growth, which the allocator's reuse of the first side's memory blurs."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
try:  # the installed moe8, else this checkout's
    import moe8  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "python"))

# recipe -> (real config, decoder layers for the one-GPU measurement)
RECIPES = {
    "qwen3_30b_a3b_lora": ("qwen3_30b_a3b.json", 6),
    "gpt_oss_20b_lora": ("gpt_oss_20b.json", 4),
    "gpt_oss_20b_full": ("gpt_oss_20b.json", 4),
    "mixtral_8x7b_lora": ("mixtral_8x7b.json", 2),
    "olmoe_1b_7b_full": ("olmoe_1b_7b.json", 4),
    "qwen2_moe_a2_7b_full": ("qwen2_moe_a2_7b.json", 4),
    "deepseek_v3_reduced_lora": ("deepseek_v3_reduced.json", 4),
}
WARMUP = 2  # steps per side not timed (the first steps pay for allocations and kernels' first launches)
# --tiny: these keys, where a config has them
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_local_experts=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_group=2,
    topk_group=1,
    vocab_size=300,
)


def model_config_json(recipe: str, tiny: bool) -> str:
    spec = json.loads((ROOT / "recipes" / "configs" / RECIPES[recipe][0]).read_text())
    if tiny:
        spec.update({k: v for k, v in TINY.items() if k in spec})
        if spec["model_type"] == "deepseek_v3":  # MLA: as many key / value heads as query heads
            spec["num_key_value_heads"] = spec["num_attention_heads"]
    return json.dumps(spec)


# ------------------------------------------------------------------------------------------------ memory
def _free(device) -> None:
    """Whatever the previous side left: moe8's patches of transformers (process-wide), unreferenced models,
    optimizers and trainers (their reference cycles included) and the allocator's cached blocks."""
    from moe8 import hf

    hf.disable()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _status_kib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return float(line.split()[1])
    raise KeyError(key)


class Peaks:
    """The peak memory of one side, measured from its own start: GPU max_memory_allocated (on the CPU the
    resident set's high-water mark, VmHWM, which Linux resets through /proc/self/clear_refs), reset at the start
    and around every optimizer step, so the forward / backward peak and the step peak are told apart. What the
    process held at the start (a previous side's leftovers, e.g. cached workspaces) is subtracted and recorded."""

    def __init__(self, device):
        self.device = device
        _free(device)
        self.start = self._now()
        self._reset()
        self.backward = self.step = 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / 2**30
        return _status_kib("VmRSS") / 2**20

    def _reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current resident set

    def _take(self) -> float:
        """The peak since the last reset, less the start; resets."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30
        else:
            peak = _status_kib("VmHWM") / 2**20
        self._reset()
        return peak - self.start

    def around(self, opt) -> None:
        """Record the peaks before and during every opt.step() (the optimizer's step hooks)."""

        def before(*_):
            self.backward = max(self.backward, self._take())

        def after(*_):
            self.step = max(self.step, self._take())

        opt.register_step_pre_hook(before)
        opt.register_step_post_hook(after)

    def result(self) -> dict:
        self.backward = max(self.backward, self._take())
        return dict(
            peak_gib=max(self.backward, self.step),
            peak_backward_gib=self.backward,
            peak_step_gib=self.step,
            start_gib=self.start,
            memory="max_memory_allocated" if self.device.type == "cuda" else "VmHWM (resident set)",
        )


# ------------------------------------------------------------------------------------------------ sides
def aux_coef(cfg, config) -> float:
    """The aux-loss weight moe8 finetune uses (build_model): the config's, else the model's."""
    return (
        cfg.aux_loss_coef if cfg.aux_loss_coef is not None else getattr(config, "router_aux_loss_coef", 0.0)
    )


def warmup_of(cfg) -> int:
    return cfg.warmup_steps if cfg.warmup_steps is not None else cfg.steps // 20  # as the trainer's


def settings(cfg, opt, model, aux: float, targets) -> dict:
    """What a side trained with, read back from its optimizer and model where they hold it."""
    decay = opt.param_groups[0]
    trainable = sum(p.numel() for g in opt.param_groups for p in g["params"])
    out = dict(
        optimizer="AdamW fused" if opt.defaults.get("fused") else "AdamW",
        lr=opt.defaults["lr"],
        warmup_steps=warmup_of(cfg),
        min_lr_ratio=cfg.min_lr_ratio,
        weight_decay=decay["weight_decay"],
        weight_decay_others=opt.param_groups[1]["weight_decay"] if len(opt.param_groups) > 1 else None,
        max_grad_norm=cfg.max_grad_norm,
        seed=cfg.seed,
        micro_batch=cfg.micro_batch,
        seq_len=cfg.seq_len,
        method=cfg.method,
        trainable_params=trainable,
        aux_loss_coef=aux,
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
        activation_checkpointing=bool(getattr(model, "is_gradient_checkpointing", False)),
    )
    if cfg.method == "lora":
        out.update(lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_targets=sorted(targets))
        # the dtypes the adapters and AdamW's tensors (fp32 master copies or the adapters) are in
        out.update(adapter_dtype=dtypes(p for p in model.parameters() if p.requires_grad))
        out.update(optimizer_dtype=dtypes(p for g in opt.param_groups for p in g["params"]))
    return out


def dtypes(params) -> str:
    return ",".join(sorted({str(p.dtype).replace("torch.", "") for p in params}))


def timed(values: list[float]) -> float:
    """The median over the timed steps."""
    return statistics.median(values[WARMUP:] or values)


def run_moe8(cfg, device) -> dict:
    """moe8 finetune's trainer as `moe8 finetune` runs it, no checkpoint or export written."""
    from moe8 import hf
    from moe8.finetune.train import Trainer
    from moe8.lora import TARGETS

    class Bench(Trainer):
        def save(self, step):
            pass

        def export(self):
            pass

    peaks = Peaks(device)
    trainer = Bench(cfg, log=lambda *a, **k: None)
    peaks.around(trainer.opt)
    first_batch = trainer.data.batch(0)
    trainer.run(on_step=None)
    history = [json.loads(x) for x in (trainer.out / "metrics.jsonl").read_text().splitlines()]
    steps = [h for h in history if "loss" in h]
    out = dict(
        **peaks.result(),
        tokens_per_s=timed([h["tokens_per_s"] for h in steps]),
        estimate_gib=trainer.memory.total / 2**30,
        losses=[h["loss"] for h in steps],
        aux_losses=[h.get("aux_loss") for h in steps],
        lrs=[h["lr"] for h in steps],
        grad_norms=[h["grad_norm"] for h in steps],
        params=trainer.total_params,
        experts_on="moe8" if hf.is_accelerated(trainer.model) else "transformers",
        settings=settings(cfg, trainer.opt, trainer.model, trainer.aux_coef, cfg.lora_targets or TARGETS),
    )
    return out, first_batch


def run_transformers(cfg, data, tok, device, dtype, steps: int = 0) -> dict:
    """The same model (seed, config), data and training in plain transformers: labels= loss, PEFT for LoRA.
    steps: how many of the run's steps to take (0: all of cfg.steps); the schedule is still cfg.steps'."""
    from transformers import AutoModelForCausalLM

    from moe8 import hf
    from moe8.finetune.fp8_load import random_model
    from moe8.finetune.model import config_from, fp8_base_targets, peft_lora
    from moe8.finetune.train import lr_factor, master_weights

    peaks = Peaks(device)
    config = config_from(cfg.model_config, cfg.num_layers)
    config.vocab_size = max(len(tok), config.vocab_size)
    config.pad_token_id, config.eos_token_id, config.bos_token_id = tok.pad_token_id, tok.eos_token_id, None
    coef = aux_coef(cfg, config)
    if hasattr(
        config, "router_aux_loss_coef"
    ):  # the CausalLM reads it at init: its labels= loss adds coef x aux
        config.router_aux_loss_coef = coef
    torch.manual_seed(cfg.seed)
    if fp8_base_targets(cfg, config, device):  # moe8's side builds it a layer at a time: the same weights
        model, _ = random_model(config, dtype, device)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    if hasattr(model.config, "output_router_logits"):
        model.config.output_router_logits = coef > 0
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.method == "lora":
            model.enable_input_require_grads()
    targets = []
    if cfg.method == "lora":
        model = peft_lora(model, cfg)
        lc = model.peft_config["default"]
        targets = sorted(lc.target_modules) + (["experts"] if lc.target_parameters else [])
    params = [p for p in model.parameters() if p.requires_grad]
    master = master_weights(params, cfg)  # moe8 finetune's rule (no masters for lora_dtype adapters)
    opt = torch.optim.AdamW(
        [
            {"params": [m for m in master if m.ndim >= 2], "weight_decay": cfg.weight_decay},
            {"params": [m for m in master if m.ndim < 2], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        fused=device.type == "cuda",  # transformers' Trainer default (adamw_torch_fused)
    )
    warmup = warmup_of(cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, warmup, cfg.steps, cfg.min_lr_ratio)
    )
    peaks.around(opt)
    model.train()
    times, losses, auxes, lrs, norms = [], [], [], [], []
    for step in range(min(cfg.steps, steps or cfg.steps)):
        t0 = time.perf_counter()
        x, y, pos = (t.to(device) for t in data.batch(step))
        out = model(input_ids=x, labels=y, position_ids=pos)
        out.loss.backward()
        aux = getattr(out, "aux_loss", None) if coef else None
        ce = out.loss.detach() - (coef * aux.detach() if aux is not None else 0.0)
        for p, m in zip(params, master):
            if m is not p:
                m.grad, p.grad = (None if p.grad is None else p.grad.float()), None
        norm = torch.nn.utils.clip_grad_norm_(master, cfg.max_grad_norm or math.inf)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, master):
                if m is not p:
                    p.copy_(m)
        losses.append(float(ce))  # a device sync: the step's time includes its kernels
        auxes.append(None if aux is None else float(aux.detach()))
        norms.append(float(norm))
        times.append(time.perf_counter() - t0)
    return dict(
        **peaks.result(),
        tokens_per_s=cfg.micro_batch * cfg.seq_len / timed(times),
        losses=losses,
        aux_losses=auxes,
        lrs=lrs,
        grad_norms=norms,
        params=sum(p.numel() for p in model.parameters()),
        experts_on="moe8" if hf.is_accelerated(model) else "transformers",
        settings=settings(
            cfg, opt, model, coef if getattr(model.config, "output_router_logits", False) else 0.0, targets
        ),
    )


# ------------------------------------------------------------------------------------------------ run
def recipe_ep(name: str) -> int:
    """The expert-parallel size recipes/NAME.toml asks for (1 when it sets none)."""
    from moe8.finetune.config import load_toml

    return int(load_toml(str(ROOT / "recipes" / f"{name}.toml")).get("ep", 1))


def recipe_config(name: str, args, tmp: str):
    from moe8.finetune.config import make_config

    layers = args.layers or (2 if args.tiny else 0 if args.full else RECIPES[name][1])
    over = dict(
        model_config=model_config_json(name, args.tiny),
        num_layers=layers,  # 0: the config's own depth
        seq_len=32 if args.tiny else args.seq_len,
        steps=args.steps or (4 if args.tiny else 50),
        grad_accum=1,
        log_every=1,
        eval_fraction=0.0,
        save_every=0,
        ep=1,
        progress=False,
        output_dir=tmp,
        overwrite=True,
        max_documents=2000 if args.tiny else 5000,  # 5000 sentences: ~370 sequences of 1024 tokens
        # rows without padding: transformers' baseline counts padding in its load-balancing loss, moe8 does not
        packing="stream",
    )
    if args.full:  # the recipe as written: its sequence length and micro-batch
        del over["seq_len"]
        over["max_documents"] = 20000  # ~1,500 sequences of 1024 tokens: 50 steps of 4096 without a repeat
    if args.lr:
        over["lr"] = args.lr
    over.update(args.set)  # --set KEY=VALUE: moe8 finetune keys (e.g. fuse_attention=false)
    if args.tiny:
        over.update(device="cpu", micro_batch=2)
    elif args.micro_batch:
        over["micro_batch"] = args.micro_batch
    cfg = make_config(str(ROOT / "recipes" / f"{name}.toml"), over)
    if cfg.lr is None:
        raise ValueError(f"recipes/{name}.toml: no lr; the baseline needs the peak lr (or pass --lr)")
    if cfg.router_z_loss_coef:
        raise ValueError(
            f"recipes/{name}.toml: router_z_loss_coef {cfg.router_z_loss_coef}: transformers has none"
        )
    return cfg


@contextlib.contextmanager
def _output_dir(keep, name: str):
    """The trainer's output directory for a recipe: keep/NAME (kept: its log and report stay) or a temporary one."""
    if keep:
        path = Path(keep) / name
        path.mkdir(parents=True, exist_ok=True)
        yield str(path)
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield tmp


def run_recipe(name: str, args, device) -> dict:
    from moe8.finetune.data import Data, load_tokenizer
    from moe8.finetune.memory import MemoryCheckError
    from moe8.finetune.train import device_and_dtype

    result = {}
    with _output_dir(args.keep, name) as tmp:
        cfg = recipe_config(name, args, tmp)
        _, dtype = device_and_dtype(cfg)
        tok = load_tokenizer(cfg, None)  # as the trainer does for a model_config model
        data = Data(cfg, tok)
        order = ("moe8", "transformers") if args.first == "moe8" else ("transformers", "moe8")
        for side in order:
            if side not in args.sides:
                result[side] = dict(error=f"not run (--sides {','.join(args.sides)})")
                continue
            t0 = time.perf_counter()
            try:
                if side == "moe8":
                    r, first = run_moe8(cfg, device)
                    if not all(torch.equal(a, b) for a, b in zip(first, data.batch(0))):
                        raise RuntimeError(f"{name}: the trainer's first micro-batch is not the baseline's")
                else:
                    r = run_transformers(cfg, data, tok, device, dtype, args.baseline_steps)
            except (torch.OutOfMemoryError, MemoryCheckError) as e:  # a side that does not fit: kept as such,
                r = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0]}")  # the other side still runs
                _free(device)
            r["seconds"] = time.perf_counter() - t0
            result[side] = r
            if "error" in r:
                print(f"{name} {side}: {r['error']}", flush=True)
                continue
            print(
                f"{name} {side}: {len(r['losses'])} steps in {r['seconds']:.1f} s, loss {r['losses'][0]:.4f} -> "
                f"{r['losses'][-1]:.4f}, {r['tokens_per_s']:,.0f} tok/s, peak {r['peak_gib']:.2f} GiB",
                flush=True,
            )
    _free(device)
    estimate = result["moe8"].get("estimate_gib")
    if "error" not in result["transformers"] and estimate is not None:
        result["transformers"]["estimate_gib"] = estimate  # moe8 finetune's, for this run
    a, b = result["moe8"].get("settings"), result["transformers"].get("settings")
    differ = (
        sorted(k for k in a.keys() | b.keys() if k not in ("trainable_params",) and a.get(k) != b.get(k))
        if a and b
        else []
    )
    if differ:
        print(f"{name}: the two sides' settings differ in {differ}", flush=True)
    return dict(
        layers=cfg.num_layers or json.loads(cfg.model_config).get("num_hidden_layers"),  # 0: the config's
        seq_len=cfg.seq_len,
        micro_batch=cfg.micro_batch,
        method=cfg.method,
        activation_checkpointing=cfg.activation_checkpointing,
        estimate_gib=estimate,
        settings_differ=differ,
        order=list(result),
        moe8=result["moe8"],
        transformers=result["transformers"],
    )


def table(results: dict) -> str:
    rows = [
        f"{'recipe':26} {'layers':>6} {'GiB moe8':>9} {'GiB hf':>7} {'est.':>6} {'tok/s moe8':>11} {'tok/s hf':>9} "
        f"{'x':>5} {'loss0 moe8':>10} {'loss0 hf':>9} {'last moe8':>9} {'last hf':>8} {'step':>5}"
    ]  # "last": both sides' loss at the transformers side's last step (--baseline-steps)
    for name, r in results.items():
        a, b = r["moe8"], r["transformers"]
        failed = [f"{side}: {r[side]['error']}" for side in ("moe8", "transformers") if "error" in r[side]]
        if failed:
            rows.append(f"{name:26} {r['layers']:>6} " + "; ".join(failed))
            continue
        rows.append(
            f"{name:26} {r['layers']:>6} {a['peak_gib']:>9.2f} {b['peak_gib']:>7.2f} {r['estimate_gib']:>6.2f} "
            f"{a['tokens_per_s']:>11,.0f} {b['tokens_per_s']:>9,.0f} {a['tokens_per_s'] / b['tokens_per_s']:>5.2f} "
            f"{a['losses'][0]:>10.4f} {b['losses'][0]:>9.4f} {a['losses'][len(b['losses']) - 1]:>9.4f} "
            f"{b['losses'][-1]:>8.4f} {len(b['losses']):>5}"
        )
    return "\n".join(rows)


def _setting(ap, item: str) -> tuple:
    """--set KEY=VALUE -> (KEY, VALUE parsed as JSON: true, 4, 1e-4, [...]; any other text as a string)."""
    key, eq, text = item.partition("=")
    if not eq or not key.strip():
        ap.error(f"--set: expected KEY=VALUE, got {item!r}")
    try:
        value = json.loads(text)
    except ValueError:
        value = text
    return key.strip(), value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for recipes.json")
    ap.add_argument(
        "--keep",
        default=None,
        metavar="DIR",
        help="keep the moe8 side's trainer output (its log, report.html) in DIR/RECIPE instead of a temporary folder",
    )
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe names")
    ap.add_argument(
        "--steps",
        type=int,
        default=0,
        help=f"steps per side, the first {WARMUP} not timed (0: 50, 4 with --tiny)",
    )
    ap.add_argument(
        "--layers", type=int, default=0, help="decoder layers (0: the recipe's reduced count, 2 with --tiny)"
    )
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (32 with --tiny)")
    ap.add_argument("--micro-batch", type=int, default=0, help="0: the recipe's (2 with --tiny)")
    ap.add_argument(
        "--lr", type=float, default=0.0, help="peak learning rate of both sides (0: the recipe's)"
    )
    ap.add_argument("--first", choices=("moe8", "transformers"), default="moe8", help="which side runs first")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a moe8 finetune key over the recipe's (repeatable; VALUE as JSON: true, 4, 1e-4, or else a "
        "string), e.g. --set fuse_attention=false; each side reads the keys it has",
    )
    ap.add_argument(
        "--sides",
        default="moe8,transformers",
        help="which sides to run, comma-separated (default both; a side left out is recorded as not run)",
    )
    ap.add_argument(
        "--baseline-steps",
        type=int,
        default=0,
        help="steps of the transformers side, the first of the same schedule (0: as many as moe8's)",
    )
    ap.add_argument(
        "--full",
        action="store_true",
        help="the one-GPU recipes as written: the config's full depth, the recipe's sequence length and "
        "micro-batch (recipes with ep > 1 need that many GPUs and are left out, saying so)",
    )
    ap.add_argument("--tiny", action="store_true", help="toy-width models on the CPU (the tests)")
    args = ap.parse_args(argv)
    args.set = dict(_setting(ap, item) for item in args.set)
    args.sides = [x for x in args.sides.split(",") if x]
    if not args.sides or set(args.sides) - {"moe8", "transformers"}:
        ap.error(f"--sides: expected moe8 and/or transformers, got {','.join(args.sides)!r}")
    names = [n for n in args.recipes.split(",") if n]
    unknown = sorted(set(names) - set(RECIPES))
    if unknown:
        ap.error(f"--recipes: unknown {unknown}; expected some of {list(RECIPES)}")
    if args.full:
        if args.tiny or args.layers:
            ap.error("--full: the recipes' own depth on a GPU; not with --tiny or --layers")
        multi = {n: recipe_ep(n) for n in names if recipe_ep(n) > 1}
        for n, ep in multi.items():
            print(
                f"{n}: left out by --full: ep = {ep} needs {ep} GPUs (expert parallelism), this run has one"
            )
        names = [n for n in names if n not in multi]
    for flag in ("steps", "layers", "micro_batch", "baseline_steps"):
        if getattr(args, flag) < 0:
            ap.error(f"--{flag.replace('_', '-')}: expected >= 0, got {getattr(args, flag)}")
    for flag in ("steps", "baseline_steps"):
        n = getattr(args, flag)
        if n and n <= WARMUP and not args.tiny:
            ap.error(f"--{flag.replace('_', '-')} {n}: expected more than the {WARMUP} untimed steps")
    import transformers

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.tiny else "cuda")
    info = dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        transformers=transformers.__version__,
        tiny=args.tiny,
        untimed_steps=WARMUP,
        baseline_steps=args.baseline_steps or "as moe8's",
        set=args.set,
        first=args.first,
    )
    results, t0 = {}, time.perf_counter()
    for name in names:
        results[name] = run_recipe(name, args, device)
        info["seconds"] = time.perf_counter() - t0
        (out / "recipes.json").write_text(json.dumps(dict(info=info, recipes=results), indent=1) + "\n")
    print("\n" + table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
