"""moe8 demo — trains a tiny byte-level language model made of MoE layers through moe8 for a few hundred
steps, on the GPU when there is one (bf16) else on the CPU (fp32), and prints loss and tokens/s.

Text: ../shared/data/text/sentences.txt when present (or --data FILE), generated sentences otherwise."""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
import torch.nn.functional as F
from torch import nn

from .layer import MoELayer, load_balancing_loss

_DEFAULT_DATA = os.path.join("..", "shared", "data", "text", "sentences.txt")


def load_text(path: str | None, min_bytes: int = 1 << 20) -> tuple[bytes, str]:
    for p in [path] if path else [_DEFAULT_DATA]:
        if p and os.path.exists(p):
            with open(p, "rb") as f:
                return f.read(8 << 20), p
        if path:
            raise FileNotFoundError(f"--data: file not found: {path}")
    rng = random.Random(0)
    subj = ["the cat", "a model", "my friend", "the expert", "our team", "the router"]
    verb = ["sees", "trains", "likes", "routes", "builds", "reads"]
    obj = ["a token", "the data", "every expert", "the loss", "a long book", "the gradient"]
    out = []
    while sum(map(len, out)) < min_bytes:
        out.append(f"{rng.choice(subj)} {rng.choice(verb)} {rng.choice(obj)}.\n")
    return "".join(out).encode(), "generated sentences"


class TinyMoELM(nn.Module):
    """Bytes -> embedding -> [causal mixing + MoE] x layers -> logits. The mixing is a causal depthwise
    convolution over the last 4 positions, so the model sees context without attention."""

    def __init__(self, hidden: int, inter: int, experts: int, k: int, layers: int, dtype, device):
        super().__init__()
        f = dict(dtype=dtype, device=device)
        self.emb = nn.Embedding(256, hidden, **f)
        self.mix = nn.ModuleList(nn.Conv1d(hidden, hidden, 4, groups=hidden, **f) for _ in range(layers))
        self.norms = nn.ModuleList(nn.RMSNorm(hidden, **f) for _ in range(2 * layers))
        self.moe = nn.ModuleList(
            MoELayer(hidden, inter, experts, k, dtype=dtype, device=device) for _ in range(layers)
        )
        self.head = nn.Linear(hidden, 256, bias=False, **f)

    def forward(self, tokens):  # tokens [B, S]
        x = self.emb(tokens)  # [B, S, H]
        aux = 0.0
        for i, moe in enumerate(self.moe):
            h = self.norms[2 * i](x).transpose(1, 2)  # [B, H, S]
            x = x + self.mix[i](F.pad(h, (3, 0))).transpose(1, 2)
            y, r = moe(self.norms[2 * i + 1](x))
            x = x + y
            aux = aux + load_balancing_loss(r)
        return self.head(x), aux / len(self.moe)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="moe8 demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    ap.add_argument(
        "--batch", type=int, default=None, help="sequences per step (default 8 on CPU, 32 on GPU)"
    )
    ap.add_argument(
        "--seq", type=int, default=None, help="bytes per sequence (default 64 on CPU, 256 on GPU)"
    )
    ap.add_argument("--layers", type=int, default=2, help="MoE layers (default 2)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default 64 on CPU, 256 on GPU)")
    ap.add_argument(
        "--intermediate",
        type=int,
        default=None,
        help="expert intermediate size (default 64 on CPU, 256 on GPU)",
    )
    ap.add_argument("--experts", type=int, default=8, help="experts per layer (default 8)")
    ap.add_argument("--topk", type=int, default=2, help="experts per token (default 2)")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument(
        "--data", default=None, help=f"text file to train on (default {_DEFAULT_DATA} if present)"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import moe8

    device = args.device or ("cuda" if moe8.cuda_available() else "cpu")
    if device not in ("cpu", "cuda"):
        ap.error(f"--device: expected cpu or cuda, got {device!r}")
    if device == "cuda" and not moe8.cuda_available():
        ap.error("--device cuda: no CUDA device visible, or moe8 was built without CUDA")
    gpu = device == "cuda"
    for name, cpu_default, gpu_default in (
        ("batch", 8, 32),
        ("seq", 64, 256),
        ("hidden", 64, 256),
        ("intermediate", 64, 256),
    ):
        if getattr(args, name) is None:
            setattr(args, name, gpu_default if gpu else cpu_default)
    for name in ("steps", "batch", "seq", "layers", "hidden", "intermediate", "experts", "topk"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: expected a positive integer, got {getattr(args, name)}")
    if args.topk > args.experts:
        ap.error(f"--topk: expected at most --experts={args.experts}, got {args.topk}")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    text, source = load_text(args.data)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    split = int(len(data) * 0.95)
    train, val = data[:split], data[split:]
    if len(val) <= args.seq + 1:
        ap.error(f"--data: text too short ({len(data)} bytes) for --seq {args.seq}")
    model = TinyMoELM(args.hidden, args.intermediate, args.experts, args.topk, args.layers, dtype, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"moe8 demo: {args.layers} MoE layers x {args.experts} experts (top-{args.topk}), {n_params / 1e6:.2f}M "
        f"params, {device} {str(dtype).replace('torch.', '')}, text: {source} ({len(data) / 1e6:.1f} MB)"
    )

    def batch(src):
        idx = torch.randint(0, len(src) - args.seq - 1, (args.batch,))
        seqs = torch.stack([src[i : i + args.seq + 1] for i in idx]).to(device)
        return seqs[:, :-1], seqs[:, 1:]

    def evaluate():
        model.eval()
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            idx = torch.randint(0, len(val) - args.seq - 1, (8,), generator=g)
            seqs = torch.stack([val[i : i + args.seq + 1] for i in idx]).to(device)
            logits, _ = model(seqs[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, 256), seqs[:, 1:].reshape(-1))
        model.train()
        return loss.item()

    first_eval = evaluate()
    print(f"step     0  eval loss {first_eval:.3f}", flush=True)
    tokens, t0, window_t, window_tok = 0, time.perf_counter(), time.perf_counter(), 0
    loss_val = float("nan")
    for step in range(1, args.steps + 1):
        x, y = batch(train)
        logits, aux = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
        (loss + 0.01 * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tokens += x.numel()
        window_tok += x.numel()
        if step % 50 == 0 or step == args.steps:
            loss_val = loss.item()  # syncs
            now = time.perf_counter()
            print(
                f"step {step:5d}  loss {loss_val:.3f}  aux {float(aux.detach()):.3f}  "
                f"{window_tok / (now - window_t):,.0f} tokens/s",
                flush=True,
            )
            window_t, window_tok = now, 0
    last_eval = evaluate()
    elapsed = time.perf_counter() - t0
    print(
        f"done: {args.steps} steps, {tokens:,} tokens in {elapsed:.1f}s ({tokens / elapsed:,.0f} tokens/s); "
        f"eval loss {first_eval:.3f} -> {last_eval:.3f}"
    )
    return 0 if last_eval < first_eval else 1
