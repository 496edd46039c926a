"""moe8.graphs — the checkpointed decoder layers of a transformers model replayed as CUDA graphs: a layer's
forward is one graph, its recomputation with its backward another, so the host launches two graphs a layer
instead of issuing hundreds of kernels, and the GPU no longer waits for Python. Fine-tuning with fixed shapes
(LoRA over a frozen, possibly FP8, base) is where the host falls behind; this takes it out of the step.

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    moe8.graphs.capture_layers(model)          # once, before training; returns how many layers it took
    ...train as before...
    moe8.graphs.stats(model)                   # {"captured": .., "replayed": .., "eager": .., "reasons": {..}}
    moe8.graphs.release_layers(model)          # back to transformers' checkpointing, graphs freed

It replaces each layer's checkpointing function (transformers' GradientCheckpointingLayer calls it with the
layer's call and its hidden states). A call with a new input signature (shapes, strides, dtypes, which inputs
need a gradient, the other arguments' values) runs transformers' checkpointing for `warmup` calls, then is
captured: its inputs are copied into static buffers that every layer shares, the forward graph writes the
layer's output into a shared buffer that the call clones, and the backward graph recomputes the forward from
the saved inputs and writes the input and parameter gradients, which the backward clones and hands to
autograd (so gradient accumulation, parameter hooks and optimizers see ordinary gradients). All graphs of a
model share one memory pool: nothing they allocate outlives a replay, so one layer's transient memory serves
every layer. A parameter whose storage moves (`p.data = ...`) or a change in which parameters train makes the
layer capture again.

A call runs eagerly, through transformers' checkpointing, and the reason is counted in stats() and said once
as a warning, when graphs cannot reproduce it: inputs off CUDA, gradients off, autocast on, an argument that is
not a tensor or a plain value, dropout in the layer (the recomputation would draw other random numbers),
module hooks other than transformers' idle output recorders, transformers recording outputs (router logits,
hidden states, attentions), an output that is not one tensor shaped as the hidden states, more than
`max_shapes` signatures, or a capture that fails (e.g. a kernel that synchronises with the host).

The backward graph differentiates stand-ins for the trained parameters (new leaves on the same storage, put in
the layer's modules while it is captured), so a capture does not depend on the previous step's autograd graph
being gone: a training loop may keep last step's loss until the next one replaces it. A capture that fails for
another reason leaves torch's CUDA graph state (the graph pool's recording, the generator's offsets) unusable in
that process: captures fall back and later random draws on the GPU can fail.

stats() also reports the graphs' memory pool (`pool_reserved_gib`, `pool_allocated_gib`): it holds one layer's
transients, which the eager steps before the capture held in torch's ordinary cache, so what the process needs
is the ordinary peak plus the pool (torch.cuda.max_memory_allocated does not see the memory a replay uses).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

_PLAIN = (type(None), bool, int, float, str)
_RECORDER = "transformers.utils.output_capturing"  # the module of transformers' output-recording hooks


class _NotCapturable(RuntimeError):
    pass


def _signature(x):
    if isinstance(x, Tensor):
        return (x.shape, x.stride(), x.dtype, x.device, x.requires_grad)
    return (type(x), x)


@dataclass
class _Statics:
    """The buffers one input signature's graphs read and write, shared by every layer of the model."""

    inputs: list  # static copies of the call's tensors, in the order the graphs read them
    sources: list  # (tensor, version) last copied into each input that needs no gradient, to skip a repeat
    out: Tensor  # the layer's output, written by a forward graph: [B, S, H] like the hidden states
    grad_out: Tensor  # the output's gradient, read by a backward graph
    grad_in: list  # gradients of the inputs that need one (None for the others), written by a backward graph


@dataclass
class _Shared:
    """Model-wide: the graphs' memory pool and capture stream, the statics per signature, the parameter
    gradient buffers per (position in a layer, shape, dtype), and the counts stats() reports."""

    device: torch.device
    pool: tuple = None
    stream: torch.cuda.Stream = None
    statics: dict = field(default_factory=dict)
    grads: dict = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)

    def __post_init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(self.device)

    def statics_for(self, key, tensors: list) -> _Statics:
        s = self.statics.get(key)
        if s is None:
            with torch.no_grad():
                inputs = [torch.empty_like(t).requires_grad_(t.requires_grad) for t in tensors]
                grad_in = [torch.empty_like(t) if t.requires_grad else None for t in tensors]
            out = torch.empty_like(tensors[0])
            s = _Statics(inputs, [None] * len(tensors), out, torch.zeros_like(out), grad_in)
            self.statics[key] = s
        return s

    def grad_buffers(self, params: list) -> list:
        out = []
        for i, p in enumerate(params):
            k = (i, p.shape, p.dtype)
            if k not in self.grads:
                self.grads[k] = torch.empty_like(p, memory_format=torch.contiguous_format)
            out.append(self.grads[k])
        return out

    def fill(self, s: _Statics, tensors) -> None:
        """Copy a call's tensors into the static inputs (a tensor that needs no gradient and is the one
        copied last time, unchanged since, is not copied again: the rotary tables and positions are the same
        tensors for every layer of a step)."""
        with torch.no_grad():
            for i, (dst, t) in enumerate(zip(s.inputs, tensors)):
                last = s.sources[i]
                if not t.requires_grad and last is not None and last[0] is t and last[1] == t._version:
                    continue
                dst.copy_(t)
                s.sources[i] = None if t.requires_grad else (t, t._version)


_TENSOR = object()  # a tensor's place among a call's leaves


@dataclass
class _Call:
    """A layer's call with its tensors left out: func(*args, **kwargs) rebuilt around given tensors."""

    func: Callable
    template: list  # the call's pytree leaves, _TENSOR in each tensor's place
    spec: object  # the pytree spec of (args, kwargs)

    def __call__(self, tensors: list):
        it = iter(tensors)
        leaves = [next(it) if x is _TENSOR else x for x in self.template]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.func(*args, **kwargs)


@dataclass
class _Graphs:
    """One layer's graphs for one signature."""

    statics: _Statics
    call: _Call  # the layer's call, to run on the static inputs
    train: list  # the layer's parameters that train, in the order the backward returns their gradients
    ptrs: tuple  # every parameter's data_ptr when captured
    grads: list  # the shared buffers the backward graph writes the parameters' gradients into
    forward: Optional[torch.cuda.CUDAGraph] = None
    backward: Optional[torch.cuda.CUDAGraph] = None


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, graphs, n, *tensors):  # tensors: the call's n tensors, then the trained params
        ctx.layer, ctx.graphs, ctx.n = layer, graphs, n
        ctx.save_for_backward(*tensors[:n])
        return layer.replay_forward(graphs, tensors[:n])

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, *ctx.layer.replay_backward(ctx.graphs, ctx.saved_tensors, grad))


class LayerGraphs:
    """A decoder layer's checkpointing function that replays CUDA graphs (see the module's docstring)."""

    def __init__(
        self, layer: nn.Module, name: str, shared: _Shared, original: Callable, warmup: int, max_shapes: int
    ):
        self.layer, self.name, self.shared, self.original = layer, name, shared, original
        self.warmup, self.max_shapes = warmup, max_shapes
        self.graphs: dict = {}  # signature -> _Graphs
        self.seen: Counter = Counter()  # eager calls per signature before its capture
        self.failed: dict = {}  # signature -> why its capture failed
        self.modules = list(layer.modules())

    # ------------------------------------------------------------------------------------------ the call

    def __call__(self, fn, *args):
        kwargs = fn.keywords if isinstance(fn, functools.partial) else None
        if kwargs is None or fn.args:
            return self._eager("the layer's call is not transformers' checkpointing call", fn, args)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        why = self._why_eager(leaves)
        if why:
            return self._eager(why, fn, args)
        params = list(self.layer.parameters())
        train = [p for p in params if p.requires_grad]
        key = (tuple(_signature(x) for x in leaves), tuple(id(p) for p in train))
        if key in self.failed:
            return self._eager(self.failed[key], fn, args)
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        g = self.graphs.get(key)
        if g is not None and g.ptrs != tuple(p.data_ptr() for p in params):
            del self.graphs[key]  # a parameter's storage moved: capture again
            g = None
        if g is None:
            self.seen[key] += 1
            if self.seen[key] <= self.warmup:
                return self._eager("warming up", fn, args, say=False)
            if len(self.graphs) >= self.max_shapes:
                return self._eager(f"more than max_shapes={self.max_shapes} input signatures", fn, args)
            template = [_TENSOR if isinstance(x, Tensor) else x for x in leaves]
            g = self._capture_forward(_Call(fn.func, template, spec), key, tensors, params, train)
            if g is None:
                return self._eager(self.failed[key], fn, args)
        self.shared.counts["replayed"] += 1
        return _Replay.apply(self, g, len(tensors), *tensors, *train)

    def _why_eager(self, leaves) -> Optional[str]:
        if not torch.is_grad_enabled():
            return "gradients are off"
        if torch.is_autocast_enabled("cuda"):
            return "autocast is on"
        if torch.cuda.is_current_stream_capturing():
            return "a CUDA graph is being captured around it"
        first = leaves[0] if leaves else None
        if not isinstance(first, Tensor) or not first.is_floating_point():
            return "its first argument is not the hidden states"
        for x in leaves:
            if isinstance(x, Tensor):
                if x.device != self.shared.device:
                    return f"an input on {x.device}, not {self.shared.device}"
            elif not isinstance(x, _PLAIN):
                return f"an argument of type {type(x).__name__}"
        return self._why_eager_modules()

    def _why_eager_modules(self) -> Optional[str]:
        from torch.nn.modules import module as _m

        if _m._global_forward_hooks or _m._global_forward_pre_hooks or _m._global_backward_hooks:
            return "global module hooks"
        for m in self.modules:
            if m.training and _dropout(m):
                return "dropout in the layer (the recomputation would draw other random numbers)"
            hooks = [*m._forward_hooks.values(), *m._forward_pre_hooks.values(), *m._backward_hooks.values()]
            if not hooks:
                continue
            if any(
                getattr(h, "__module__", None) != _RECORDER and not getattr(h, "replay_safe", False)
                for h in hooks
            ):
                return f"module hooks on {type(m).__name__}"
            if _recording():
                return "transformers is recording outputs (router logits, hidden states or attentions)"
        return None

    def _eager(self, why: str, fn, args, say: bool = True):
        self.shared.counts["eager"] += 1
        self._say(why, say)
        return self.original(fn, *args)

    def _say(self, why: str, say: bool = True) -> None:
        self.shared.reasons[why] += 1
        if say and self.shared.reasons[why] == 1:
            warnings.warn(f"moe8.graphs: {self.name} runs without CUDA graphs: {why}", stacklevel=4)

    # ------------------------------------------------------------------------------------------ capture

    def _capture(self, run) -> torch.cuda.CUDAGraph:
        """Run `run` once on the capture stream (what it initialises lazily, handles and workspaces of that
        stream and thread, happens outside the capture), then capture it."""
        s, cur = self.shared.stream, torch.cuda.current_stream(self.shared.device)
        s.wait_stream(cur)
        with torch.cuda.stream(s):
            run()
        cur.wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.shared.pool, stream=s, capture_error_mode="thread_local"):
            run()
        self.shared.counts["captured"] += 1
        return graph

    def _capture_forward(self, call, key, tensors, params, train) -> Optional[_Graphs]:
        s = self.shared.statics_for(key[0], tensors)  # keyed by the inputs alone: shared by every layer
        g = _Graphs(s, call, train, tuple(p.data_ptr() for p in params), self.shared.grad_buffers(train))

        def run():  # without autograd: the backward graph recomputes what the backward needs
            with torch.no_grad():
                out = call(s.inputs)
                if not isinstance(out, Tensor) or out.shape != s.out.shape or out.dtype != s.out.dtype:
                    raise _NotCapturable("its output is not one tensor shaped as the hidden states")
                s.out.copy_(out)

        self.shared.fill(s, tensors)
        try:
            g.forward = self._capture(run)
            self._capture_backward(g)  # here, on the calling thread, rather than inside autograd's backward
        except Exception as e:  # noqa: BLE001 - any failure to capture means: run it eagerly
            self.failed[key] = _failure(e)
            torch.cuda.synchronize(self.shared.device)
            return None
        self.graphs[key] = g
        return g

    def _capture_backward(self, g: _Graphs) -> None:
        s = g.statics
        wants = [x for x in s.inputs if x.requires_grad]

        def run(aliases):
            out = g.call(s.inputs)
            grads = torch.autograd.grad(out, [*wants, *aliases], s.grad_out, allow_unused=True)
            if any(gr is None for gr in grads[len(wants) :]):
                raise _NotCapturable("a trained parameter gets no gradient through the layer's modules")
            with torch.no_grad():
                dsts = [d for d in s.grad_in if d is not None] + g.grads
                for dst, gr in zip(dsts, grads):
                    dst.zero_() if gr is None else dst.copy_(gr)

        # The graph differentiates new leaves that share the trained parameters' storage, put in their place in
        # the layer's modules while it is captured: a parameter's own gradient accumulator may belong to an
        # autograd graph of an earlier step still alive on the default stream, which a capture cannot wait on.
        with torch.enable_grad(), _aliased(self.modules, g.train) as aliases:
            g.backward = self._capture(functools.partial(run, aliases))

    # ------------------------------------------------------------------------------------------ replay

    def replay_forward(self, g: _Graphs, tensors) -> Tensor:
        self.shared.fill(g.statics, tensors)
        g.forward.replay()
        return g.statics.out.clone()

    def replay_backward(self, g: _Graphs, saved, grad) -> list:
        s = g.statics
        self.shared.fill(s, saved)
        with torch.no_grad():
            s.grad_out.copy_(grad)
        g.backward.replay()
        grads = [None if d is None else d.clone() for d in s.grad_in]
        return grads + [d.clone() for d in g.grads]


@contextlib.contextmanager
def _aliased(modules: list, train: list):
    """Each of `train` replaced, in every module of `modules` that holds it, by a new leaf parameter on the
    same storage (same data_ptr and version counter); yields the new leaves, in `train`'s order."""
    aliases = [nn.Parameter(p.detach(), requires_grad=True) for p in train]
    by_id = {id(p): a for p, a in zip(train, aliases)}
    swapped = []
    for m in modules:
        for name, p in m._parameters.items():
            if p is not None and id(p) in by_id:
                swapped.append((m, name, p))
    try:
        for m, name, p in swapped:
            m._parameters[name] = by_id[id(p)]
        yield aliases
    finally:
        for m, name, p in swapped:
            m._parameters[name] = p


def _dropout(m: nn.Module) -> bool:
    """Whether m draws random numbers in training: an nn.Dropout, or an attention or LoRA dropout rate > 0."""
    if isinstance(m, nn.Dropout) and m.p > 0:
        return True
    rates = (getattr(m, attr, 0.0) for attr in ("attention_dropout", "lora_dropout"))
    return any(isinstance(v, float) and v > 0 for v in rates)


def _recording() -> bool:
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return False
    return bool(_active_collector.get())


def _failure(e: Exception) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"its capture failed ({type(e).__name__}: {text[:160]})"


# ---------------------------------------------------------------------------------------------- public


def _layers(model: nn.Module) -> list:
    """(name, layer) of the model's checkpointed transformers layers."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return []
    return [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
    ]


def capture_layers(model: nn.Module, warmup: int = 1, max_shapes: int = 4) -> int:
    """Replay each checkpointed decoder layer of `model` as CUDA graphs from its (warmup + 1)-th call with a
    given input signature on; returns how many layers it took. warmup: eager calls per signature first (>= 1:
    they initialise what the layer's kernels cache); max_shapes: signatures captured per layer (others run
    eagerly). Checkpointing must be on (model.gradient_checkpointing_enable()); calling that again afterwards
    puts transformers' function back (call capture_layers again)."""
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
        raise ValueError(f"warmup: expected an int >= 1, got {warmup!r}")
    if not isinstance(max_shapes, int) or isinstance(max_shapes, bool) or max_shapes < 1:
        raise ValueError(f"max_shapes: expected an int >= 1, got {max_shapes!r}")
    layers = _layers(model)
    if not layers:
        raise ValueError(
            "model: no checkpointed transformers decoder layers; call "
            "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) first"
        )
    if not torch.cuda.is_available():
        raise RuntimeError(
            "moe8.graphs.capture_layers needs a CUDA device (torch.cuda.is_available() is False)"
        )
    release_layers(model)
    device = next(layers[0][1].parameters()).device
    if device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    shared = _Shared(device)
    for name, layer in layers:
        layer._gradient_checkpointing_func = LayerGraphs(
            layer, name, shared, layer._gradient_checkpointing_func, warmup, max_shapes
        )
    return len(layers)


def _graphed(model: nn.Module) -> list:
    return [
        m._gradient_checkpointing_func
        for _, m in _layers(model)
        if isinstance(getattr(m, "_gradient_checkpointing_func", None), LayerGraphs)
    ]


def release_layers(model: nn.Module) -> int:
    """Put back each layer's original checkpointing function and free its graphs; returns how many."""
    done = _graphed(model)
    for f in done:
        f.layer._gradient_checkpointing_func = f.original
        f.graphs.clear()
    return len(done)


def stats(model: nn.Module) -> dict:
    """Counts over the model's graphed layers: captured graphs, replayed and eager calls, eager reasons, and the
    graphs' memory pool in GiB (reserved; allocated: held by tensors that outlived a capture, 0 unless one
    leaks)."""
    graphed = _graphed(model)
    if not graphed:
        empty = dict(layers=0, captured=0, replayed=0, eager=0, pool_reserved_gib=0.0, pool_allocated_gib=0.0)
        return dict(empty, reasons={})
    shared = graphed[0].shared
    return dict(
        layers=len(graphed),
        **{k: shared.counts[k] for k in ("captured", "replayed", "eager")},
        reasons=dict(shared.reasons),
        **_pool_gib(shared),
    )


def _pool_gib(shared: _Shared) -> dict:
    """The graphs' memory pool on its device, reserved and allocated."""
    pool = tuple(shared.pool)
    segments = [
        seg
        for seg in torch.cuda.memory_snapshot()
        if seg.get("device") == shared.device.index and tuple(seg.get("segment_pool_id", ())) == pool
    ]
    return dict(
        pool_reserved_gib=round(sum(seg["total_size"] for seg in segments) / 2**30, 3),
        pool_allocated_gib=round(sum(seg["allocated_size"] for seg in segments) / 2**30, 3),
    )


__all__ = ["LayerGraphs", "capture_layers", "release_layers", "stats"]
