"""The `moe8 finetune` training loop: AdamW with linear warmup and cosine decay, gradient accumulation and
clipping, metrics.jsonl + report.html, atomic checkpoints and an exact --resume.

Output directory: the fine-tuned model (save_pretrained + tokenizer, or the PEFT adapter for LoRA),
metrics.jsonl, report.html, finetune.toml (the config) and checkpoint-STEP/training_state.pt (trainable
weights, optimizer, scheduler, RNG states, data position) for --resume. A checkpoint step is always a logged
step, so no partial metrics window needs saving."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import hf
from .._env import ENV
from ..attention import packed_sequences
from ..loss import chunked_cross_entropy, hidden_states_as_logits, plain_lm_head
from ..optim import AdamW
from . import cuda_graphs, memory, output, report
from .config import KEYS, RESUME_MAY_CHANGE, Config, DivergedError, FinetuneError, to_toml
from .data import IGNORE, Data, fingerprint_changes, load_tokenizer
from .loggers import Progress, Trackers, check_installed, dumps
from .memory import memory_gib
from .model import (
    BUILTIN,
    TINY,
    active_params,
    attention_flops,
    attention_layers,
    build_model,
    dtype_name,
    model_config,
    peak_flops,
    quiet_bars,
)
from .packing import longest_document, most_documents, padding
from .routing import RoutingStats, router_z_loss

STATE = "training_state.pt"
# how long a collective waits for a peer before the run ends with an error (a dead rank: no hang)
DIST_TIMEOUT = timedelta(seconds=ENV["finetune_dist_timeout"])


def rank_state(rank: int) -> str:
    """A checkpoint's training-state file of `rank` (rank 0's is STATE, which marks a checkpoint complete)."""
    return STATE if rank == 0 else f"training_state-rank{rank}.pt"


class Dist:
    """torchrun's process group as the trainer sees it: world size, rank, and the collectives it needs. With
    WORLD_SIZE 1 every method is the one-process identity."""

    def __init__(self, device: torch.device):
        import torch.distributed as dist

        self.world, self.rank = ENV["world_size"], ENV["rank"]
        self.on = self.world > 1
        if self.on and not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            kw = dict(device_id=device) if device.type == "cuda" else {}
            dist.init_process_group(backend, timeout=DIST_TIMEOUT, **kw)
        self.dist = dist

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.on:
            self.dist.barrier()

    def sum(self, t: torch.Tensor, group=None) -> torch.Tensor:
        if self.on:
            self.dist.all_reduce(t, group=group)
        return t

    def gather(self, obj) -> list:
        """obj of every rank, in rank order (all_gather_object)."""
        if not self.on:
            return [obj]
        out = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.on and self.dist.is_initialized():
            self.dist.destroy_process_group()


def device_and_dtype(cfg: Config) -> tuple[torch.device, torch.dtype]:
    name = cfg.device if cfg.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise FinetuneError("device = 'cuda': no CUDA device visible")
    device = torch.device(name)
    if name == "cuda" and ENV["local_rank"] is not None:  # torchrun: each rank its own GPU
        local = ENV["local_rank"]
        if local >= torch.cuda.device_count():
            raise FinetuneError(
                f"LOCAL_RANK {local}: expected < the visible GPUs ({torch.cuda.device_count()}); launch at "
                "most as many processes per node as GPUs"
            )
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    dtype = cfg.dtype if cfg.dtype != "auto" else "bf16" if device.type == "cuda" else "fp32"
    return device, torch.bfloat16 if dtype == "bf16" else torch.float32


def lr_factor(step: int, warmup: int, steps: int, min_ratio: float) -> float:
    """Multiplier of the peak lr for the step after `step` finished steps: linear warmup, cosine decay."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def master_weights(params, cfg: Config) -> list:
    """What AdamW updates for each trainable parameter: an fp32 master copy of a 16-bit weight (AdamW updates
    below bf16's resolution would be lost), copied back after each step, the fp32 ones themselves; LoRA
    adapters in an explicit lora_dtype train in it, their AdamW states too (PEFT's autocast_adapter_dtype=False
    under transformers' Trainer)."""
    if cfg.method == "lora" and cfg.lora_dtype != "auto":
        return list(params)
    return [p if p.dtype == torch.float32 else p.detach().float().requires_grad_() for p in params]


def adamw(groups: list[dict], lr: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW; on a GPU moe8's (moe8.optim.AdamW: its kernel steps the large tensors at the memory's rate, torch's
    fused kernel the small ones, as transformers' Trainer gets it after moe8.enable()). Never torch's default
    foreach step: it holds an fp32 temporary per parameter (the sqrt of exp_avg_sq, a whole param group at once)
    through the step, which makes the step of a full fine-tune 22 bytes per parameter instead of 18."""
    if device.type == "cuda":
        return AdamW(groups, lr=lr, fused=True)
    return torch.optim.AdamW(groups, lr=lr, fused=False)


def checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints in `out`, oldest first (incomplete ones are hidden .tmp directories)."""
    found = [p for p in out.glob("checkpoint-*") if p.name.split("-")[-1].isdigit() and (p / STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


class Trainer:
    """Everything validated and built, nothing written: `run()` writes."""

    def __init__(self, cfg: Config, log=print):
        self.cfg = cfg
        self.device, self.dtype = device_and_dtype(cfg)
        self.dist = Dist(self.device)
        world = self.dist.world
        self.log = log if self.dist.main else lambda *a, **k: None  # rank 0 logs
        self.graphed = cuda_graphs.wanted(cfg, self.device, self.log)  # true on a CPU: refused here
        self.graph_stats = None  # moe8.graphs.stats(model) at the end of training, when graphed
        check_installed(cfg)
        self.hf_config, self.model_path = config, path = model_config(cfg)
        self.tok = load_tokenizer(cfg, path)
        self.memory = self._memory_estimate(config, path)
        self.data = Data(cfg, self.tok)
        self.fingerprint = self.data.fingerprint(cfg, self.tok)
        if len(self.data.train[0]) < cfg.micro_batch * world:
            raise FinetuneError(
                f"data: {self.data.source}: the training split has {len(self.data.train[0])} sequences; "
                f"{world} ranks of micro_batch = {cfg.micro_batch} need at least {cfg.micro_batch * world}"
            )
        per_epoch = len(self.data.train[0]) // (cfg.micro_batch * world)  # global micro-batches per epoch
        self.steps = math.ceil(cfg.epochs * per_epoch / cfg.grad_accum) if cfg.epochs else cfg.steps
        self.out = Path(cfg.output_dir or time.strftime("runs/finetune-%Y%m%d-%H%M%S"))
        if self.dist.main:  # rank 0 creates output_dir (concurrent probes would race on it)
            output.check(self.out, cfg)
        self.resumed_from, self.finished = None, False
        self.state = self._resume_state() if cfg.resume else None
        if self.state is not None and self.state["step"] >= self.steps:
            self.finished = True  # nothing to train: run() says so, the model is not built
            return
        self.model, self.aux_coef = build_model(
            cfg, config, path, self.tok, self.dtype, self.device, self.log
        )
        self.attention = attention_layers(self.model.config)
        # the documents' offsets each CUDA forward is given (varlen flash attention, Config.packed_attention),
        # padded to the most documents a micro-batch holds, with the longest document's length: the same
        # shapes and values for every batch, so graphs capture once
        splits = (self.data.train, self.data.eval)
        self.max_documents = max(most_documents(t[2], cfg.micro_batch) for t in splits)
        self.longest_document = max(longest_document(t[2]) for t in splits)
        self.balance = balance_loss(self.model) if cfg.packing == "documents" else None
        self.total_params, self.active_params = active_params(self.model)
        self.stats = RoutingStats(self.model)  # before parallelize: counts over all E experts
        self.mesh, self.expert_ids = None, set()
        if self.dist.on:
            self._parallelize()
        if self.graphed:  # after checkpointing, LoRA and FP8 changed the layers, before the first step
            self.graphed = cuda_graphs.capture(self.model, cfg, self.log)
        self.dist.barrier()  # every rank checked its input before rank 0 writes
        self.names, self.params = zip(*[(n, p) for n, p in self.model.named_parameters() if p.requires_grad])
        self.master = master_weights(self.params, cfg)
        self.peak = peak_flops(cfg, self.device)
        lr = cfg.lr or (
            3e-3
            if cfg.model in TINY
            else 1e-3
            if cfg.model in BUILTIN
            else 2e-4
            if cfg.method == "lora"
            else 2e-5
        )
        groups = [[p for p in self.master if p.ndim >= 2], [p for p in self.master if p.ndim < 2]]
        self.opt = adamw(
            [
                {"params": groups[0], "weight_decay": cfg.weight_decay},
                {"params": groups[1], "weight_decay": 0.0},
            ],
            lr,
            self.device,
        )
        warmup = cfg.warmup_steps if cfg.warmup_steps is not None else self.steps // 20
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: lr_factor(s, warmup, self.steps, cfg.min_lr_ratio)
        )

    def _memory_estimate(self, config, path) -> memory.Estimate:
        """The peak per GPU from the config (memory.py); refuses a run that cannot fit, unless memory_check is
        off. The vocabulary of a random-weight model is set as build_model will set it."""
        import copy

        cfg = self.cfg
        config = copy.deepcopy(config)
        if path is None:
            config.vocab_size = max(len(self.tok), config.vocab_size) if cfg.model_config else len(self.tok)
        est = memory.estimate(config, cfg, memory.count_params(config, cfg), self.dtype)
        if cfg.memory_check:
            memory.check(est, memory.device_memory(self.device), cfg)
        return est

    def _parallelize(self) -> None:
        """ep > 1: experts split over each group of ep ranks (moe8.parallel.parallelize); fsdp: dense
        parameters sharded with FSDP2; otherwise every rank holds the whole model and the gradients are
        averaged after the backward (moe8.parallel.fsdp.average_grads)."""
        from .. import parallel

        cfg = self.cfg
        self.mesh = parallel.make_mesh(ep=cfg.ep, device_type=self.device.type)
        try:
            if cfg.ep > 1:
                parallel.parallelize(self.model, self.mesh, transport=cfg.transport)
            if cfg.fsdp:
                parallel.fsdp.apply_fsdp(self.model, self.mesh, param_dtype=None, reduce_dtype=torch.float32)
        except (ValueError, NotImplementedError) as e:
            raise FinetuneError(f"ep = {cfg.ep}: {e}") from None
        self.expert_ids = {
            id(p)
            for _, m in parallel.experts_modules(self.model)
            if hasattr(m, "_moe8_ep")
            for p in m.parameters()
        }

    def _resume_state(self) -> dict:
        """The newest readable checkpoint's state (an unreadable one is named, then the one before it is
        taken), checked against this run: the launch's layout, the config, the data."""
        found = checkpoints(self.out) if self.out.is_dir() else []
        if not found:
            raise FinetuneError(f"resume: no checkpoint in {self.out}")
        state, own, unreadable = None, None, []
        for ckpt in reversed(found):
            try:
                state = _load_state(ckpt / STATE)
                if self.dist.rank:
                    own = _load_state(ckpt / rank_state(self.dist.rank))
            except Exception as e:  # truncated or damaged: torch raises RuntimeError, EOFError, pickle errors
                first = str(e).splitlines()[0].split(". ")[0] if str(e) else ""  # torch's first sentence
                unreadable.append(f"{ckpt / STATE} ({type(e).__name__}: {first})")
                continue
            self.resumed_from = ckpt
            break
        if self.resumed_from is None:
            raise FinetuneError(f"resume: no readable checkpoint in {self.out}: {'; '.join(unreadable)}")
        steps = self.dist.gather(state["step"])
        if len(set(steps)) > 1:
            raise FinetuneError(f"resume: the ranks' newest readable checkpoints differ (steps {steps})")
        for bad in unreadable:
            self.log(f"resume: unreadable checkpoint {bad}; resuming from {self.resumed_from} instead")
        old = {**vars(Config()), **state["config"]}  # a key newer than the checkpoint: its default
        if "packing" not in state["config"]:  # a checkpoint without the packing key streamed its rows
            old["packing"] = "stream"
        # the launch's layout first: its message says how to launch
        world, ep = state.get("world", 1), old.get("ep", 1)
        if (world, ep) != (self.dist.world, self.cfg.ep):
            raise FinetuneError(
                f"resume: the checkpoint was written by {world} ranks with ep = {ep}, this run has "
                f"{self.dist.world} ranks with ep = {self.cfg.ep}: launch it the same way"
            )
        changed = [
            f"{k}: {old[k]!r} -> {getattr(self.cfg, k)!r}"
            for k in KEYS
            if k not in RESUME_MAY_CHANGE and old[k] != getattr(self.cfg, k)
        ]
        if changed:
            raise FinetuneError(
                f"resume: the config differs from the checkpoint's in {'; '.join(changed)}; only "
                f"{', '.join(sorted(RESUME_MAY_CHANGE - {'resume', 'overwrite'}))} may change on resume "
                f"({self.out / 'finetune.toml'} holds the run's config)"
            )
        differs = fingerprint_changes(state["data"], self.fingerprint) if "data" in state else []
        if differs and not self.cfg.allow_data_change:
            raise FinetuneError(
                f"resume: the data differs from the checkpoint's ({'; '.join(differs)}), so the batches would "
                "not be the checkpoint's; restore the data, or pass --allow-data-change to continue on this data"
            )
        if differs:
            self.log(f"  resume: on changed data (allow_data_change): {'; '.join(differs)}")
        return own if self.dist.rank else state

    # ------------------------------------------------------------------------------------------ pieces
    def documents(self, pos) -> dict:
        """The forward's kwargs giving the documents' offsets in a micro-batch, pos [B, S] on the host
        (moe8.attention.packed_sequences: varlen flash attention over them instead of sdpa's block-diagonal
        mask) on CUDA; none elsewhere, where the mask made from the position_ids is what runs."""
        if self.device.type != "cuda":
            return {}
        return packed_sequences(pos, self.max_documents, self.device, self.longest_document)

    def loss_sum(self, x, y, pos, documents: dict | None = None):
        """(summed cross-entropy of next-token predictions, aux loss or None, router z-loss or None); x, y, pos
        [B, S] on the device (pos: each token's position in its packed document); documents: the documents'
        offsets for the forward (self.documents)."""
        target = torch.cat([y[:, 1:], torch.full_like(y[:, :1], IGNORE)], 1)  # position t predicts y[t + 1]
        kw = documents or {}
        if (
            not self.cfg.fsdp and plain_lm_head(self.model) is not None
        ):  # logits a chunk at a time: no [tokens, vocab] fp32 tensors
            with hidden_states_as_logits(self.model) as head:
                out = self.model(input_ids=x, position_ids=pos, **kw)
            ce = chunked_cross_entropy(
                out.logits.flatten(0, 1), head.weight, target.flatten(), ignore_index=IGNORE
            )
        else:
            out = self.model(input_ids=x, position_ids=pos, **kw)
            ce = F.cross_entropy(
                out.logits.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE, reduction="sum"
            )
        aux = getattr(out, "aux_loss", None)
        if aux is not None and self.balance is not None:  # the load-balancing loss without the padding tokens
            aux = self.balance(out.router_logits, (~padding(y, pos)).long())
        return ce, aux, router_z_loss(getattr(out, "router_logits", None))

    def forward_backward(self, x, y, pos, n_label: int, documents: dict | None = None) -> tuple:
        """Forward and backward of one micro-batch of a step with n_label loss tokens (over all ranks); returns
        its summed cross-entropy, aux loss and z-loss (None when off), detached: none of its autograd graph
        outlives the call."""
        cfg, accum = self.cfg, self.cfg.grad_accum
        ce, aux, z = self.loss_sum(x, y, pos, documents)
        loss = ce * self.dist.world / max(n_label, 1)
        aux = aux if self.aux_coef and aux is not None else None
        z = z if cfg.router_z_loss_coef and z is not None else None
        if aux is not None:
            loss = loss + self.aux_coef * aux / accum
        if z is not None:
            loss = loss + cfg.router_z_loss_coef * z / accum
        loss.backward()
        return tuple(None if t is None else t.detach() for t in (ce, aux, z))

    @torch.no_grad()
    def evaluate(self) -> float | None:
        self.model.eval()
        total, n = 0.0, 0
        for x, y, pos in self.data.eval_batches(self.cfg.eval_batches):
            dev = [t.to(self.device) for t in (x, y, pos)]
            ce, _, _ = self.loss_sum(*dev, self.documents(pos))
            total, n = total + ce.item(), n + int((y[:, 1:] != IGNORE).sum())
        self.model.train()
        return total / n if n else None

    def save(self, step: int) -> None:
        """checkpoint-STEP/training_state.pt, written into a hidden directory and renamed: a kill leaves either
        the old checkpoint or the new one. Older checkpoints are removed after."""
        tmp = self.out / f".checkpoint-{step}.tmp"
        d = self.dist
        if d.main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        d.barrier()
        state = dict(
            step=step,
            micro_batches=step * self.cfg.grad_accum,
            config=vars(self.cfg).copy(),
            data=self.fingerprint,
            world=d.world,
            model={n: _local(m).detach().cpu() for n, m in zip(self.names, self.master)},
            optimizer=self.opt.state_dict(),
            scheduler=self.sched.state_dict(),
            rng=dict(torch=torch.get_rng_state(), python=random.getstate()),
        )
        if self.device.type == "cuda":
            state["rng"]["cuda"] = torch.cuda.get_rng_state(self.device)
        torch.save(state, tmp / rank_state(d.rank))  # each rank its own shard, rank 0's last
        d.barrier()
        if d.main:
            final = self.out / f"checkpoint-{step}"
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            found = checkpoints(self.out)
            # past this step: an unreadable checkpoint a resume went back from; then all but the newest kept
            newer = [c for c in found if int(c.name.split("-")[-1]) > step]
            kept = [c for c in found if c not in newer][-self.cfg.keep_checkpoints :]
            for old in found:
                if old not in kept:
                    shutil.rmtree(old, ignore_errors=True)
        d.barrier()

    def restore(self, state: dict) -> int:
        with torch.no_grad():
            for n, p, m in zip(self.names, self.params, self.master):
                _local(m).copy_(state["model"][n])
                if p is not m:
                    p.copy_(m)
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        return state["step"]

    def export(self) -> None:
        if self.dist.on and self.cfg.ep > 1 and self.cfg.method == "lora":
            from ..parallel.hf import gathered

            with gathered(self.model):  # the expert LoRA factors on every rank (every rank takes part)
                if self.dist.main:
                    self._save_lora()
            return
        if self.dist.on and (self.cfg.ep > 1 or self.cfg.fsdp):  # gathered to rank 0: every rank takes part
            from ..parallel.checkpoint import save_pretrained

            with quiet_bars():
                save_pretrained(self.model, str(self.out))
            if self.dist.main:
                self.tok.save_pretrained(self.out)
            return
        if not self.dist.main:  # plain data parallelism: every rank holds the same model
            return
        if self.cfg.method == "lora":
            self._save_lora()
            return
        with quiet_bars():
            self.model.save_pretrained(self.out)
        self.tok.save_pretrained(self.out)

    def _save_lora(self) -> None:
        """The PEFT adapter and the tokenizer (and, for a built-in model, its random base beside them)."""
        from moe8.lora import save_adapter

        if hasattr(self.model, "peft_config"):  # --no-moe8: PEFT's own LoRA
            with quiet_bars():
                self.model.save_pretrained(self.out)
        else:
            save_adapter(self.model, self.out)
        # a built-in model's random base: rebuilt from the seed, saved beside (a model_config one is for measuring)
        if self.model_path is None and not self.cfg.model_config:
            from transformers import AutoModelForCausalLM

            where = self.device if self.cfg.model_config else torch.device("cpu")  # as build_model
            with torch.random.fork_rng(devices=[where] if where.type == "cuda" else []), where:
                torch.manual_seed(self.cfg.seed)
                base = AutoModelForCausalLM.from_config(self.hf_config, dtype=self.dtype)
            with quiet_bars():
                base.save_pretrained(self.out / "base_model")
        self.tok.save_pretrained(self.out)

    def describe(self) -> str:
        c, d = self.cfg, self.data
        on = "moe8" if hf.is_accelerated(self.model) else "transformers"
        ranks = ""
        if self.dist.on:
            how = f"expert-parallel ep {c.ep} ({c.transport})" if c.ep > 1 else "data-parallel"
            ranks = f"\n  {self.dist.world} ranks, {how}{', FSDP2' if c.fsdp else ''}; micro_batch per rank"
        return (
            f"moe8 finetune: {c.model} ({self.total_params / 1e6:.1f}M params, {self.active_params / 1e6:.1f}M "
            f"active per token), {c.method}, {self.device.type} {dtype_name(self.dtype)}, "
            f"experts on {on}{'' if c.fp8 == 'none' else f' (FP8 {c.fp8})'}\n  data: {d.source}: {d.documents:,} "
            f"{d.kind} documents, {d.tokens:,} tokens -> {len(d.train[0])} train / {len(d.eval[0])} eval "
            f"sequences of {c.seq_len} ({d.describe_packing()}){'' if not c.eval_data else f' (eval: {d.eval_source})'}"
            f"{f'; {d.describe_chat()}' if d.chat else ''}\n  {self.steps} steps of "
            f"{c.micro_batch} x {c.grad_accum} sequences, lr {self.opt.defaults['lr']:g}; output: {self.out}{ranks}\n"
            f"  memory estimate per {self.device.type}: {self.memory.table()}\n  attention: {self.describe_attention()}"
        )

    def describe_attention(self) -> str:
        """How the documents packed in a row attend: varlen flash attention over their offsets (on CUDA, where
        moe8's packed_attention runs transformers' "sdpa" function), or the block-diagonal mask transformers
        makes from the position_ids."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from ..attention import packed_attention_forward

        impl = getattr(self.model.config, "_attn_implementation", None)
        varlen = impl == "sdpa" and ALL_ATTENTION_FUNCTIONS.get("sdpa") is packed_attention_forward
        if self.device.type == "cuda" and varlen:
            return (
                f"{impl}, documents through varlen flash attention (up to {self.max_documents} a micro-batch, "
                f"the longest {self.longest_document} tokens)"
            )
        return f"{impl}, documents apart through the block-diagonal mask made from their positions"

    # -------------------------------------------------------------------------------------------- run
    def run(self, on_step=None) -> dict:
        """Train (or continue) to self.steps or run_steps, writing into self.out. on_step(step, trainer) is
        called after every step (tests use it). Returns the last metrics line."""
        cfg, out, main = self.cfg, self.out, self.dist.main
        if self.finished:
            self.log(
                f"moe8 finetune: {out} is finished: its checkpoint {self.resumed_from.name} is at step "
                f"{self.state['step']} of steps = {self.steps}; nothing to train (a larger --steps continues it)"
            )
            return {}
        created = cfg.overwrite or not out.exists()
        if main:  # rank 0 writes; the other ranks write only their checkpoint shards
            if cfg.overwrite:
                shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True, exist_ok=True)
        self.dist.barrier()
        try:
            return self._loop(on_step)
        except DivergedError:  # its metrics, report and checkpoints are kept
            raise
        except BaseException:
            # failed before anything worth keeping: leave nothing behind
            if main and created and not checkpoints(out):
                shutil.rmtree(out, ignore_errors=True)
            raise

    def _loop(self, on_step) -> dict:
        cfg, out, dev, d = self.cfg, self.out, self.device, self.dist
        start = self.restore(self.state) if self.state else 0
        history = []
        if d.main and (out / "metrics.jsonl").exists():  # drop lines past the checkpoint: they are recomputed
            history = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
            history = [h for h in history if h["step"] <= start]
        if d.main:
            (out / "metrics.jsonl").write_text("".join(dumps(h) + "\n" for h in history))
            (out / "finetune.toml").write_text(to_toml(cfg))
        metrics = open(out / "metrics.jsonl" if d.main else os.devnull, "a")
        self.log(self.describe())
        if start:
            self.log(f"  resuming from {self.resumed_from} (step {start})")
        progress = Progress(self.steps, start, cfg.progress, d.main)
        info = dict(
            model=cfg.model, method=cfg.method, device=f"{dev.type} {self.dtype}", params=self.total_params
        )
        info.update(active=self.active_params, moe8=hf.is_accelerated(self.model), steps=self.steps)
        info.update(memory_estimate_gib=round(self.memory.total / 2**30, 3), memory_parts=self.memory.table())
        if self.data.chat is not None:
            c = self.data.chat
            info["assistant turns"] = f"{c.matched} of {c.turns} with loss" + (
                f" ({c.split} conversations split)" if c.split else ""
            )
        info.update(
            eval_data=self.data.eval_source, aux_loss_coef=self.aux_coef, z_loss_coef=cfg.router_z_loss_coef
        )
        trackers = Trackers(cfg, out, vars(cfg).copy()) if d.main else None
        if d.on:
            info["ranks"] = f"{d.world} ({f'ep {cfg.ep}' if cfg.ep > 1 else 'data-parallel'})" + (
                ", FSDP2" if cfg.fsdp else ""
            )

        def emit(line):
            history.append(json.loads(dumps(line)))
            metrics.write(dumps(line) + "\n")
            metrics.flush()
            if trackers is not None:
                trackers.log(line)

        def write_report():
            if self.graphed:
                from .. import graphs

                info["cuda_graphs"] = cuda_graphs.summary(graphs.stats(self.model))
            if d.main:
                report.write(out / "report.html", history, info, cfg.dead_window)

        try:
            self.model.train()
            if start == 0 and len(self.data.eval[0]):
                emit(dict(step=0, eval_loss=self.evaluate()))
            accum, S = cfg.grad_accum, cfg.seq_len

            def new_window():  # what a metrics line averages over
                zero = torch.zeros((), device=dev)
                return dict(
                    loss=zero, aux=zero, z=zero, label_tokens=0, tokens=0, flops=0.0, t0=time.perf_counter()
                )

            window = new_window()
            stop = self.steps
            if cfg.run_steps:
                stop = min(stop, start + cfg.run_steps)
            W, R = d.world, d.rank
            for step in range(start + 1, stop + 1):
                # global micro-batch g of the run is micro-batches g * W .. g * W + W - 1 of one process's
                # order, one per rank: disjoint shards, and together the batch of one process with W x
                # micro_batch sequences
                batches = [self.data.batch(((step - 1) * accum + a) * W + R) for a in range(accum)]
                n_label = sum(int((y[:, 1:] != IGNORE).sum()) for _, y, _ in batches)
                if d.on:  # every rank divides by the global count: the averaged gradient is the global one
                    n_label = int(d.sum(torch.tensor(n_label, device=dev)))
                if not n_label:  # AdamW would still move the weights (momentum, weight decay) on no signal
                    raise FinetuneError(
                        f"step {step}: its {accum * cfg.micro_batch * W} sequences hold no loss tokens (every "
                        "label masked), so the step has nothing to learn from; check the data's loss masking"
                    )
                for x, y, pos in batches:
                    ce, aux, z = self.forward_backward(
                        *(t.to(dev, non_blocking=True) for t in (x, y, pos)), n_label, self.documents(pos)
                    )
                    if aux is not None:
                        window["aux"] = window["aux"] + aux / accum
                    if z is not None:
                        window["z"] = window["z"] + z / accum
                    window["loss"] += ce
                    window["flops"] += attention_flops(self.attention, pos) * W
                if d.on and not cfg.fsdp:  # FSDP averages in its backward
                    from ..parallel.fsdp import average_grads

                    average_grads(self.model, self.mesh)
                for p, m in zip(self.params, self.master):
                    if m is not p:
                        m.grad, p.grad = (None if p.grad is None else p.grad.float()), None
                grad_norm = self._clip(cfg.max_grad_norm)
                lr = self.opt.param_groups[0]["lr"]
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad(set_to_none=True)
                with torch.no_grad():
                    for p, m in zip(self.params, self.master):
                        if m is not p:
                            p.copy_(m)
                window["label_tokens"] += n_label
                window["tokens"] += accum * cfg.micro_batch * S * W

                do_eval = len(self.data.eval[0]) and (
                    (cfg.eval_every and step % cfg.eval_every == 0) or step == self.steps
                )
                save = (cfg.save_every and step % cfg.save_every == 0) or step == stop
                line = None
                if step % cfg.log_every == 0 or do_eval or save:
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    line = self._line(step, window, lr, grad_norm)
                    if not math.isfinite(line["loss"]):  # the window's summed loss: any step's NaN shows
                        emit(line)
                        write_report()
                        self._diverged(step, line["loss"])
                    if do_eval:
                        line["eval_loss"] = self.evaluate()
                    emit(line)
                if save:
                    self.save(step)
                    write_report()
                progress.update(step, line)
                if on_step is not None:
                    on_step(step, self)
                if line is not None:  # the next window starts after the eval and the checkpoint
                    window = new_window()
            if stop == self.steps:
                self.export()
            write_report()
        finally:
            progress.close()
            metrics.close()
            if trackers is not None:
                trackers.close()
            if self.graphed:  # the model back on transformers' checkpointing, the graphs' memory freed
                from .. import graphs

                self.graph_stats = graphs.stats(self.model)
                graphs.release_layers(self.model)
        if self.graph_stats is not None:
            self.log(f"cuda graphs: {cuda_graphs.summary(self.graph_stats)}")
        last = next((h for h in reversed(history) if h.get("memory_gib_ranks")), None)
        if last is not None:
            per_rank = ", ".join(f"rank {r} {g:.2f}" for r, g in enumerate(last["memory_gib_ranks"]))
            self.log(f"peak memory (GiB): {per_rank}")
        if stop < self.steps:
            self.log(f"stopped at step {stop} of {self.steps} (run_steps); continue with --resume")
        return history[-1] if history else {}

    def _diverged(self, step: int, loss: float) -> None:
        """DivergedError naming the step, the last good checkpoint and what to change."""
        found = checkpoints(self.out)
        kept = f"the last good checkpoint, {found[-1]}, is kept" if found else "no checkpoint was written yet"
        raise DivergedError(
            f"diverged: loss = {loss} at step {step} (in the steps since the last logged one); {kept}, and the "
            f"metrics and report in {self.out}. Start a new run with a lower --lr (now {self.opt.defaults['lr']:g}), "
            "a longer --warmup_steps, --max_grad_norm 1 or --dtype fp32 (--resume keeps the checkpoint's settings)"
        )

    def _clip(self, max_norm: float):
        """Clip the gradients to max_norm (0: no clipping); returns the norm before clipping. Over ranks: each
        element of the model counted once (dense replicas over all ranks, expert shards over their dp
        replicas, FSDP shards as held)."""
        d = self.dist
        if not d.on:
            return torch.nn.utils.clip_grad_norm_(self.master, max_norm or math.inf)
        dp = d.world // self.cfg.ep
        sq = torch.zeros((), device=self.device, dtype=torch.float32)
        grads = []
        for p, m in zip(self.params, self.master):
            if m.grad is None:
                continue
            g = m.grad
            local = getattr(g, "_local_tensor", None)
            if local is not None:
                sq += local.float().pow(2).sum()
            else:
                sq += g.float().pow(2).sum() / (dp if id(p) in self.expert_ids else d.world)
            grads.append(g)
        norm = d.sum(sq).sqrt()
        if max_norm:
            coef = min(1.0, max_norm / (float(norm) + 1e-6))
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
        return norm

    def _line(self, step: int, window: dict, lr: float, grad_norm) -> dict:
        d = self.dist
        loss = float(d.sum(window["loss"].detach().clone().float())) / max(window["label_tokens"], 1)
        seconds = max(time.perf_counter() - window["t0"], 1e-9)
        tps = window["tokens"] / seconds
        # model FLOPs: 6 x active parameters per token, plus the attention products (model.attention_flops)
        flops = (6 * self.active_params * window["tokens"] + window["flops"]) / seconds
        mfu = flops / self.peak if self.peak else None
        c = self.cfg
        n_steps = max(1, window["tokens"] // (c.grad_accum * c.micro_batch * c.seq_len * d.world))
        memory = d.gather(round(memory_gib(self.device), 4))
        line = dict(
            step=step,
            loss=loss,
            lr=lr,
            tokens_per_s=tps,
            tflops=flops / 1e12,
            mfu=mfu,
            memory_gib=max(memory),
            grad_norm=float(grad_norm),
            tokens=step * self.cfg.grad_accum * self.cfg.micro_batch * self.cfg.seq_len * d.world,
            routing=self.stats.take(d.sum if d.on else None, self.device),
        )
        if self.aux_coef:
            line["aux_loss"] = float(window["aux"]) / n_steps
        if c.router_z_loss_coef:
            line["z_loss"] = float(window["z"]) / n_steps
        if d.on:
            line["memory_gib_ranks"] = memory
        return line


def balance_loss(model):
    """(router_logits, mask [B, S]) -> the model's load-balancing loss over the tokens where mask is 1
    (transformers' load_balancing_loss_func of the model's family, as with an attention mask), or None when
    the family has none."""
    import sys

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT's wrapper
    fn = getattr(sys.modules.get(type(base).__module__), "load_balancing_loss_func", None)
    E, k = getattr(base, "num_experts", None), getattr(base, "num_experts_per_tok", None)
    if fn is None or E is None or k is None:
        return None
    return lambda logits, mask: fn(logits, E, k, mask)


def _load_state(path: Path) -> dict:
    """A training_state*.pt file; an exception when it is unreadable or not a training state."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError("not a moe8 training state")
    return state


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2) local shard, else the tensor."""
    return getattr(t, "_local_tensor", t)


def run(cfg: Config, on_step=None, log=print) -> Trainer:
    """Validate and build (raising FinetuneError for bad input, with nothing written), then train."""
    try:
        trainer = Trainer(cfg, log)
        trainer.last = trainer.run(on_step)
    finally:
        import torch.distributed as dist

        if ENV["world_size"] > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return trainer
