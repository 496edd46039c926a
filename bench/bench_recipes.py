"""The recipes/ of `moe8 finetune` measured: for each recipe, N steps through moe8 finetune's trainer, then the same
model and data through plain transformers (+ PEFT for LoRA) in the same process; peak GiB and tokens/s of both,
and moe8's memory estimate beside the measured peak, into OUT/recipes.json.

There are no real checkpoints here: each model is built with random weights from its real config
(recipes/configs/*.json) at a reduced layer count, with short sequences and ep 1 on one GPU (the full fine-tuning
recipes for 4 or 8 GPUs included: fewer layers make them fit), so the whole run takes under 3 minutes on an H200:

    python bench/bench_recipes.py --out bench/results/recipes

--tiny: every model at toy width (hidden 64, 8 experts, 2 layers) on the CPU in fp32, 3 steps: the test suite's
check that each recipe runs through both paths.

Both paths train the same way: bf16 weights with fp32 master copies and fp32 AdamW (moe8 finetune's scheme), the
recipe's activation checkpointing, micro_batch and LoRA rank / targets, packed sequences with per-document
position_ids, the router aux loss at the model's coefficient. The baseline's loss is transformers' own
(labels= to the model); moe8's the chunked cross-entropy."""

from __future__ import annotations

import argparse
import gc
import json
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


def peak_gib(device) -> float:
    from moe8.finetune.memory import memory_gib

    return memory_gib(device)


def reset(device) -> None:
    from moe8 import hf

    hf.disable()  # moe8's patches of transformers are process-wide
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_moe8(cfg):
    """(result, trainer) of moe8 finetune's trainer, no checkpoint or export written."""
    from moe8 import hf
    from moe8.finetune.train import Trainer

    class Bench(Trainer):
        def save(self, step):
            pass

        def export(self):
            pass

    trainer = Bench(cfg, log=lambda *a, **k: None)
    trainer.run(on_step=None)
    history = [json.loads(x) for x in (trainer.out / "metrics.jsonl").read_text().splitlines()]
    tps = [h["tokens_per_s"] for h in history if "tokens_per_s" in h][2:]  # after 2 warm-up steps
    return dict(
        tokens_per_s=statistics.median(tps),
        peak_gib=peak_gib(trainer.device),
        estimate_gib=trainer.memory.total / 2**30,
        loss_last=history[-1].get("loss"),
        params=trainer.total_params,
        experts_on="moe8" if hf.is_accelerated(trainer.model) else "transformers",
    ), trainer


def run_transformers(cfg, trainer_data, tok, device, dtype, steps: int) -> dict:
    """The same model (same seed, config and data) in plain transformers: labels= loss, PEFT for LoRA."""
    from transformers import AutoModelForCausalLM

    from moe8.finetune.model import config_from, peft_lora

    config = config_from(cfg.model_config, cfg.num_layers)
    config.vocab_size = max(len(tok), config.vocab_size)
    config.pad_token_id, config.eos_token_id, config.bos_token_id = tok.pad_token_id, tok.eos_token_id, None
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    if hasattr(model.config, "output_router_logits"):
        model.config.output_router_logits = getattr(config, "router_aux_loss_coef", 0) > 0
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.method == "lora":
            model.enable_input_require_grads()
    if cfg.method == "lora":
        model = peft_lora(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    master = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_() for p in params]
    opt = torch.optim.AdamW(
        master, lr=1e-5, fused=True if device.type == "cuda" else None
    )  # as the trainer's
    model.train()
    times, loss = [], None
    for step in range(steps):
        t0 = time.perf_counter()
        x, y, pos = (t.to(device) for t in trainer_data.batch(step))
        loss = model(input_ids=x, labels=y, position_ids=pos).loss
        loss.backward()
        for p, m in zip(params, master):
            if m is not p:
                m.grad, p.grad = (None if p.grad is None else p.grad.float()), None
        torch.nn.utils.clip_grad_norm_(master, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, master):
                if m is not p:
                    p.copy_(m)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    tokens = cfg.micro_batch * cfg.seq_len
    return dict(
        tokens_per_s=tokens / statistics.median(times[2:] or times),
        peak_gib=peak_gib(device),
        loss_last=float(loss.detach()),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for recipes.json")
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe names")
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first 2 are not timed)")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--micro-batch", type=int, default=0, help="0: the recipe's")
    ap.add_argument("--tiny", action="store_true", help="toy-width models on the CPU (the tests)")
    args = ap.parse_args(argv)
    from moe8.finetune.config import make_config

    names = [n for n in args.recipes.split(",") if n]
    unknown = sorted(set(names) - set(RECIPES))
    if unknown:
        ap.error(f"--recipes: unknown {unknown}; expected some of {list(RECIPES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps, seq = (3, 32) if args.tiny else (args.steps, args.seq_len)
    results = {}
    for name in names:
        layers = 2 if args.tiny else RECIPES[name][1]
        with tempfile.TemporaryDirectory() as tmp:
            over = dict(
                model_config=model_config_json(name, args.tiny),
                num_layers=layers,
                seq_len=seq,
                steps=steps,
                grad_accum=1,
                log_every=1,
                eval_fraction=0.0,
                save_every=0,
                ep=1,
                progress=False,
                output_dir=tmp,
                overwrite=True,
                lr=1e-5,
            )
            if args.tiny:
                over.update(device="cpu", micro_batch=2, max_documents=2000)
            elif args.micro_batch:
                over["micro_batch"] = args.micro_batch
            cfg = make_config(str(ROOT / "recipes" / f"{name}.toml"), over)
            dev = torch.device("cpu" if args.tiny else "cuda")
            reset(dev)
            moe8_result, trainer = run_moe8(cfg)
            data, tok, device, dtype = trainer.data, trainer.tok, trainer.device, trainer.dtype
            del trainer
            reset(dev)
            base = run_transformers(cfg, data, tok, device, dtype, steps)
            reset(dev)
        results[name] = dict(
            layers=layers,
            seq_len=seq,
            micro_batch=cfg.micro_batch,
            method=cfg.method,
            activation_checkpointing=cfg.activation_checkpointing,
            moe8=moe8_result,
            transformers=base,
        )
        print(f"{name}: done", flush=True)
    info = dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        device=torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu",
        torch=torch.__version__,
        tiny=args.tiny,
        steps=steps,
    )
    import transformers

    info["transformers"] = transformers.__version__
    (out / "recipes.json").write_text(json.dumps(dict(info=info, recipes=results), indent=1) + "\n")
    print(
        f"\n{'recipe':26} {'layers':>6} {'GiB moe8':>9} {'GiB hf':>7} {'est.':>6} {'tok/s moe8':>11} {'tok/s hf':>9} {'x':>5}"
    )
    for name, r in results.items():
        a, b = r["moe8"], r["transformers"]
        print(
            f"{name:26} {r['layers']:>6} {a['peak_gib']:>9.2f} {b['peak_gib']:>7.2f} {a['estimate_gib']:>6.2f} "
            f"{a['tokens_per_s']:>11,.0f} {b['tokens_per_s']:>9,.0f} {a['tokens_per_s'] / b['tokens_per_s']:>5.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
