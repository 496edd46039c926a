"""One training step (forward, backward, AdamW) of a transformers Qwen3-MoE model, expert-parallel with
moe8.parallel against plain data parallelism (every rank holds all the experts, gradients averaged), at the
same tokens per rank.

    torchrun --nproc_per_node 8 bench/bench_ep_train.py --json bench/results/ep_train_h200.json
    torchrun --nproc_per_node 2 bench/bench_ep_train.py --tiny          # CPU / gloo smoke run

Prints a table last (mode, ranks, tokens per rank, ms per step, tokens/s per rank, peak GiB) and writes JSON
(rank 0). Both modes run the experts on moe8 (experts_forward on the owner, or on every rank)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import moe8.parallel as par

MODEL = dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, layers=4)
TINY = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, layers=2)


def build(shape, device, dtype, seed=0):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=32000 if shape is MODEL else 256,
        hidden_size=shape["hidden_size"],
        intermediate_size=4 * shape["hidden_size"],
        moe_intermediate_size=shape["moe_intermediate_size"],
        num_experts=shape["num_experts"],
        num_experts_per_tok=shape["num_experts_per_tok"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=16 if shape is MODEL else 4,
        num_key_value_heads=4 if shape is MODEL else 2,
        head_dim=128 if shape is MODEL else 16,
        norm_topk_prob=True,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).to(device, dtype)


def step_time(model, ids, opt, mode, mesh, warmup, iters, device) -> float:
    def step():
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        if mode == "ep":
            par.fsdp.average_grads(model, mesh)
        else:
            _average_all(model)
        opt.step()

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item()


def _average_all(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank (default 4, tiny 2)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 1024, tiny 16)")
    p.add_argument("--modes", default="dp,ep", help="comma-separated: dp, ep")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: all ranks)")
    p.add_argument(
        "--ep-chunks",
        default="1",
        help="comma-separated moe8.Config.ep_chunks values for the ep mode (e.g. 1,2)",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    chunks = [int(c) for c in args.ep_chunks.split(",") if c]
    shape = TINY if args.tiny else MODEL
    batch, seq = args.batch or (2 if args.tiny else 4), args.seq or (16 if args.tiny else 1024)
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    rank, world = dist.get_rank(), dist.get_world_size()
    import moe8

    rows = []
    try:
        mesh = par.make_mesh(ep=args.ep or world, device_type=device.type)
        runs = [(m, c) for m in args.modes.split(",") for c in (chunks if m == "ep" else [1])]
        for mode, ep_chunks in runs:
            # experts on moe8 in both modes; ep_chunks > 1: each part's experts overlap the next part's rows
            model = moe8.accelerate(build(shape, device, dtype), ep_chunks=ep_chunks)
            if mode == "ep":
                par.parallelize(model, mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
            g = torch.Generator().manual_seed(rank)
            ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=g).to(device)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            dt = step_time(model, ids, opt, mode, mesh, args.warmup, args.iters, device)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
            rows.append(
                dict(
                    mode=mode,
                    ep_chunks=ep_chunks,
                    world=world,
                    tokens=batch * seq,
                    ms=dt * 1e3,
                    tok_s=batch * seq / dt,
                    peak_gib=peak,
                )
            )
            del model, opt
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return
    info = dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
        torch=torch.__version__,
        dtype=str(dtype).removeprefix("torch."),
        shape=shape,
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(info, results=rows), indent=2))
    print(f"{info['device']}, torch {info['torch']}, {info['dtype']}, Qwen3-MoE-like {shape}")
    print(
        f"{'mode':>4} {'ranks':>5} {'tokens/rank':>11} {'ms/step':>9} {'tok/s/rank':>11} {'peak GiB':>8} {'chunks':>6}"
    )
    for r in rows:
        print(
            f"{r['mode']:>4} {r['world']:>5} {r['tokens']:>11} {r['ms']:9.1f} {r['tok_s']:11.0f} {r['peak_gib']:8.2f}"
            f" {r['ep_chunks']:>6}"
        )


if __name__ == "__main__":
    main()
