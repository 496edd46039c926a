"""Does FP8 train as well as bf16? Three runs of the same randomly initialised Qwen3-MoE-shaped model on the
same text in the same order, same seed: bf16, FP8 experts (blockwise + FP8 dgrad), FP8 experts + FP8 dense
layers (attention projections; Config.fp8_dense). Loss curves to <out>/fp8_convergence.json and, when
matplotlib is installed, <out>/fp8_convergence.png.

    python bench/bench_fp8_convergence.py --out bench/results/fp8_convergence    # H200: ~5 minutes in all
    python bench/bench_fp8_convergence.py --tiny --out /tmp/conv                  # CPU smoke run, < 30 s

Data: the shared corpus (text/sentences.txt) and Qwen3 tokenizer (tokenizers/qwen3) under $MOE8_SHARED_DATA
(or ../shared/data beside the checkout; --data-dir overrides); without them the script says where it looked
and exits with status 2. Model (default): hidden 1024, 12 layers, 32 experts of intermediate 512, top-4,
16 heads of 64 (4 KV heads), the tokenizer's vocabulary (151,669 ids): ~0.95B parameters, bf16, AdamW
(lr 3e-4, 50 warm-up steps, cosine to 10%), clip 1.0, 1000 steps of 8 x 512 tokens.

Prints a table last: run, first / last / min loss (mean of 20 steps), tokens/s, peak GiB, and the final
loss gap against bf16.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from run_info import run_info  # this folder is on sys.path

import moe8
from moe8 import fp8
from moe8._env import ENV
from moe8.fp8 import Float8Recipe

ROOT = Path(__file__).resolve().parents[1]
TINY_VOCAB = 512
RUNS = {  # name: moe8.accelerate fields
    "bf16": {},
    "fp8_experts": dict(fp8=Float8Recipe("blockwise", dgrad="fp8")),
    "fp8_experts_dense": dict(fp8=Float8Recipe("blockwise", dgrad="fp8"), fp8_dense=True),
}
MODEL = dict(
    hidden_size=1024,
    num_hidden_layers=12,
    num_experts=32,
    moe_intermediate_size=512,
    intermediate_size=2048,
    num_experts_per_tok=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_experts=4,
    moe_intermediate_size=32,
    intermediate_size=64,
    num_experts_per_tok=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def data_roots(data_dir) -> list:
    """Where the corpus and tokenizer are looked for, in order."""
    if data_dir:
        return [Path(data_dir)]
    roots = [Path(ENV["shared_data"])] if ENV["shared_data"] else []
    return roots + [ROOT.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]


def find_data(data_dir):
    """(sentences.txt, tokenizer folder) under the first root that has both, or None."""
    for root in data_roots(data_dir):
        text, tok = root / "text" / "sentences.txt", root / "tokenizers" / "qwen3"
        if text.is_file() and (tok / "tokenizer.json").is_file():
            return text, tok
    return None


def require_data(data_dir, prog: str):
    """find_data's (sentences.txt, tokenizer folder), or None after saying on stderr where `prog` looked."""
    found = find_data(data_dir)
    if found is None:
        looked = ", ".join(str(r) for r in data_roots(data_dir))
        print(
            f"{prog}: no corpus and Qwen3 tokenizer (text/sentences.txt, tokenizers/qwen3/tokenizer.json) under "
            f"{looked}; set MOE8_SHARED_DATA or --data-dir",
            file=sys.stderr,
        )
    return found


def token_batches(text: Path, tok_dir: Path, lines: int, seq: int, batch: int, steps: int, seed: int):
    """[steps, batch, seq] token ids: the corpus tokenised once, documents joined by EOS, cut into sequences,
    shuffled with `seed` and repeated as needed (the same order for every run). Also the vocabulary size."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    with text.open(encoding="utf-8") as f:
        docs = [line.strip() for _, line in zip(range(lines), f) if line.strip()]
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = []
    for chunk in tok(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(chunk + [eos])
    n = len(ids) // seq
    seqs = torch.tensor(ids[: n * seq]).view(n, seq)
    gen = torch.Generator().manual_seed(seed)
    need = steps * batch
    order = torch.cat([torch.randperm(n, generator=gen) for _ in range(math.ceil(need / n))])[:need]
    return seqs[order].view(steps, batch, seq), len(tok), n


def corpus_meta(device, script: str, argv, found, sequences: int) -> dict:
    """The head of a corpus benchmark's JSON: run_info, the command, the data and tokenizer it read."""
    return dict(
        run_info(device),
        command=f"bench/{script} " + " ".join(argv if argv is not None else sys.argv[1:]),
        data=str(found[0]),
        tokenizer=str(found[1]),
        sequences=sequences,
    )


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(steps - warmup, 1)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(name: str, fields: dict, batches, vocab: int, shape: dict, a, device, dtype) -> dict:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=vocab, max_position_embeddings=batches.shape[2], **shape)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(a.seed)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg).to(dtype)
    moe8.accelerate(model, **fields)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    fp8.default_cache.clear()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, t0, timed_tokens = [], None, 0
    for step in range(batches.shape[0]):
        if step == min(10, batches.shape[0] - 1):  # time from here: warm-up done
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0, timed_tokens = time.perf_counter(), 0
        for g in opt.param_groups:
            g["lr"] = lr_at(step, batches.shape[0], a.lr, a.warmup)
        ids = batches[step].to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        timed_tokens += ids.numel()
        if not math.isfinite(losses[-1]):
            print(f"{name}: loss {losses[-1]} at step {step}: stopped", file=sys.stderr)
            break
        if a.log_every and step % a.log_every == 0:
            print(f"{name} step {step}: loss {losses[-1]:.4f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return dict(
        name=name,
        fields={k: str(v) for k, v in fields.items()},
        params=params,
        float8_linear_layers=converted,
        losses=losses,
        tokens_per_s=timed_tokens / secs if secs > 0 else None,
        peak_gib=peak,
    )


def window(losses: list, at: str, n: int = 20) -> float:
    part = losses[:n] if at == "first" else losses[-n:]
    return sum(part) / len(part)


def plot(runs: list, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in runs:
        ax.plot(r["losses"], label=r["name"], linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("bf16 vs FP8 (same init, same data order)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for fp8_convergence.json (and .png)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lines", type=int, default=100000, help="corpus lines read")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {list(RUNS)}")
    p.add_argument(
        "--data-dir", default=None, help="folder with text/ and tokenizers/qwen3 (default: shared)"
    )
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument(
        "--tiny",
        action="store_true",
        help="CPU smoke run: a tiny model, 8 steps of 2 x 32, ids folded into 512",
    )
    a = p.parse_args(argv)
    runs = [r for r in a.runs.split(",") if r]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown or not runs:
        p.error(f"--runs: unknown {unknown}; expected a subset of {list(RUNS)}")
    if a.tiny:
        a.steps, a.batch, a.seq, a.lines, a.warmup = 8, 2, 32, 400, 3
    found = require_data(a.data_dir, "bench_fp8_convergence")
    if found is None:
        return 2
    device = torch.device("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"data: {found[0]}, tokenizer {found[1]}", flush=True)
    batches, vocab, n_seqs = token_batches(*found, a.lines, a.seq, a.batch, a.steps, a.seed)
    if a.tiny:  # the smoke run folds the ids into 512 (a 151k-row embedding and LM head dominate on a CPU)
        batches, vocab = batches % TINY_VOCAB, TINY_VOCAB
    shape = TINY if a.tiny else MODEL
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(
        corpus_meta(device, "bench_fp8_convergence.py", argv, found, n_seqs),
        model=dict(shape, vocab_size=vocab),
        steps=a.steps,
        batch=a.batch,
        seq=a.seq,
        lr=a.lr,
        seed=a.seed,
        dtype=str(dtype),
    )
    results = []
    for r in runs:  # the JSON rewritten after each run: a time limit keeps the finished ones
        results.append(train(r, RUNS[r], batches, vocab, shape, a, device, dtype))
        (out / "fp8_convergence.json").write_text(json.dumps(dict(meta, runs=results), indent=2) + "\n")
    png = plot(results, out / "fp8_convergence.png")
    print("\n" + ("plot: " + str(out / "fp8_convergence.png") if png else "plot: matplotlib not installed"))
    base = next((r for r in results if r["name"] == "bf16"), None)
    print("| run | params | first loss | last loss | min loss | tokens/s | peak GiB | last - bf16 |")
    print("| --- " * 8 + "|")
    for r in results:
        last = window(r["losses"], "last")
        ref = window(base["losses"], "last") if base else None
        gap = f"{last - ref:+.4f} ({100 * (last - ref) / ref:+.2f}%)" if ref else "-"
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        print(
            f"| {r['name']} | {r['params'] / 1e6:.0f}M | {window(r['losses'], 'first'):.4f} | {last:.4f} | "
            f"{min(r['losses']):.4f} | {tps} | {peak} | {gap} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
