"""Routing statistics of a transformers MoE model: tokens per expert in every MoE layer, counted by a forward
pre-hook on each experts module (transformers v5 calls `experts(hidden [T, H], top_k_index [T, K], weights)`
in every family), plus the health summary (load imbalance, dead experts) that report.html and the Trainer
callback show."""

from __future__ import annotations

from functools import partial

import torch


def experts_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """(name of the MoE block, its fused experts module) for every MoE layer."""
    out = []
    for name, m in model.named_modules():
        if hasattr(m, "has_gate") and hasattr(m, "is_transposed") and hasattr(m, "gate_up_proj"):
            out.append((name.removesuffix(".experts"), m))
    return out


class RoutingStats:
    """Counts (token, slot) pairs per expert in training forwards; `take()` returns each layer's per-expert
    token fraction since the last take. Eval forwards and the recomputation of activation checkpointing (which
    runs inside the backward) are not counted. Counts stay on the model's device: no sync per layer.

    Replayable under moe8.graphs, where a graphed layer runs its Python hooks only while its graphs are
    captured and each replay repeats the kernels they queued (the backward graph's recomputation too): the
    experts' hook writes the histogram of the layer's latest run into a buffer per number of ids (a rerun on the
    same tokens writes the same histogram), and hooks on the model, outside its layers, zero those buffers
    before each training forward and add them to the counts after it."""

    def __init__(self, model):
        self.counts, self.runs, self.handles = {}, {}, []
        self.counted = set()  # the layers with a training forward since the last take
        for name, m in experts_modules(model):
            self.counts[name] = None  # [E] long, from the layer's first training forward
            self.runs[name] = {}  # ids per call -> [E] long: the histogram of the latest call with that many
            hook = partial(self._hook, name)
            hook.replay_safe = True  # what it queues is right when replayed (moe8.graphs)
            self.handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
        self.experts = {name: m.gate_up_proj.shape[0] for name, m in experts_modules(model)}
        self.handles.append(model.register_forward_pre_hook(self._begin))
        self.handles.append(model.register_forward_hook(self._end))
        self.ones = {}  # device -> [1] long 1, expanded as the histograms' source

    def _hook(self, name, module, args, kwargs):
        if not module.training or torch._C._current_graph_task_id() != -1:  # eval, or a backward recompute
            return
        ids = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
        if ids is None:
            return
        ids = ids.detach().reshape(-1).long()
        n, dev = ids.numel(), ids.device
        if n not in self.runs[name]:
            self.runs[name][n] = torch.zeros(self.experts[name], dtype=torch.long, device=dev)
        if dev not in self.ones:
            self.ones[dev] = torch.ones(1, dtype=torch.long, device=dev)
        run = self.runs[name][n]
        run.zero_()
        run.scatter_add_(0, ids, self.ones[dev].expand(n))

    def _begin(self, model, args):
        """Before a training forward: no histogram is left from an earlier call (a replayed recomputation
        writes one after the forward's counts were added)."""
        runs = [r for runs in self.runs.values() for r in runs.values()]
        if model.training and runs:
            torch._foreach_zero_(runs)

    def _end(self, model, args, output):
        if not model.training:
            return
        for name, runs in self.runs.items():
            if not runs:
                continue
            c = self.counts[name]
            if c is None:
                c = self.counts[name] = torch.zeros_like(next(iter(runs.values())))
            for run in runs.values():  # zeros for the sizes this forward did not have
                c += run
            self.counted.add(name)

    def take(self, reduce=None, device=None) -> dict[str, list[float]]:
        """reduce: an in-place sum over ranks (torch.distributed all_reduce), so the fractions are those of all
        ranks' tokens; every rank must call it then (layers without counts yet take part with zeros)."""
        if reduce is not None:
            for name, c in self.counts.items():
                if c is None:
                    c = torch.zeros(self.experts[name], dtype=torch.long, device=device)
                self.counts[name] = reduce(c)
                self.counted.add(name)
        out = {}
        for name, c in self.counts.items():
            if name in self.counted:
                f = c.cpu().double()
                out[name] = [round(x, 6) for x in (f / f.sum().clamp_min(1)).tolist()]
                c.zero_()
        self.counted.clear()
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def health(history: list[dict], dead_window: int) -> dict[str, dict]:
    """Per MoE layer, from metrics lines that carry "routing": load = fraction x experts (1 = uniform);
    imbalance = the largest load at a logged step: its last, mean and max value over the run; dead experts =
    those without a token in the lines of the last `dead_window` steps."""
    lines = [h for h in history if h.get("routing")]
    if not lines:
        return {}
    last = lines[-1]["step"]
    out = {}
    for name in lines[-1]["routing"]:
        series = [(h["step"], h["routing"][name]) for h in lines if name in h["routing"]]
        E = len(series[-1][1])
        imb = [max(f) * E for _, f in series]
        recent = [f for s, f in series if s > last - dead_window] or [series[-1][1]]
        dead = [e for e in range(E) if all(f[e] == 0 for f in recent)]
        out[name] = dict(
            experts=E, imbalance=imb[-1], mean_imbalance=sum(imb) / len(imb), max_imbalance=max(imb)
        )
        out[name]["dead"] = dead
    return out


def summary(h: dict[str, dict]) -> dict:
    """One line over all layers: max and mean imbalance, dead experts."""
    if not h:
        return {}
    worst = max(h, key=lambda n: h[n]["max_imbalance"])
    return dict(
        max_imbalance=h[worst]["max_imbalance"],
        max_imbalance_layer=worst,
        mean_imbalance=sum(v["mean_imbalance"] for v in h.values()) / len(h),
        dead_experts=sum(len(v["dead"]) for v in h.values()),
        experts=sum(v["experts"] for v in h.values()),
    )


def router_z_loss(router_logits) -> torch.Tensor | None:
    """ST-MoE's router z-loss: the mean over the tokens of every MoE layer of logsumexp(router logits)^2
    (router_logits: the per-layer [T, E] logits a model returns with output_router_logits)."""
    if not router_logits:
        return None
    if isinstance(router_logits, torch.Tensor):
        router_logits = [router_logits]
    logits = [r for r in router_logits if isinstance(r, torch.Tensor) and r.ndim >= 2]
    if not logits:
        return None
    z = torch.cat([r.reshape(-1, r.shape[-1]).float() for r in logits]).logsumexp(-1)
    return z.square().mean()
