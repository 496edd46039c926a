"""moe8._core — the ground floor of the Python front: the extension handle (moe8._C), CUDA streams, GEMM
workspaces and what else depends only on shapes (one-group offsets, unit scales, row indices: small bounded
caches), and the direct-call path of moe8's torch.library ops. Every op module imports this one; it imports
nothing else of moe8 but the environment defaults (moe8._env).

Direct calls. A torch.library custom op call goes twice through the dispatcher and through the custom-op
wrappers before it reaches the op's Python function (~30 us of host time a call measured on a CPU, 2x the
function itself), which a single MoE layer pays ~15 times a step; on a GPU the kernels of the router, plan and
permute take microseconds, so the GPU waits for that host time. A call from plain eager code therefore runs
the op's own function, and a differentiable op an autograd.Function built from its registered setup_context /
backward: the same functions and kernels, the same results. Anything else takes the custom op: torch.compile
tracing, functorch transforms, an active TorchDispatchMode or TorchFunctionMode (fake / meta tensors,
FlopCounter, `dispatched()` below, ...), tensors other than plain CPU / CUDA tensors and parameters (DTensor,
meta), keyword arguments. An op that writes an input bumps its version counter as the dispatcher does.
MOE8_EAGER_DIRECT=0 in the environment (read once, at import) keeps every call on the custom ops.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Optional

import torch
import torch.utils.dlpack
from torch import Tensor
from torch.overrides import TorchFunctionMode

from . import _C as _ext
from ._env import ENV

EAGER_DIRECT: bool = ENV["eager_direct"]
EXT = _ext  # the extension module itself (its classes, e.g. IpcBuffer); call functions through C

SCHEMES = {"softmax": 0, "sigmoid_group": 1, "topk_softmax": 2}
ACTIVATIONS = {"swiglu": 0, "swiglu_clamped": 1, "silu": 2, "gelu": 3}
LAYOUTS = {"nk": 0, "kn": 1}


class _Core:
    """moe8._C with tensor arguments detached (DLPack refuses tensors that require grad). With direct calls
    on, tensors go over as DLPack capsules made here (torch.utils.dlpack.to_dlpack, ~0.4 us) rather than
    through Tensor.__dlpack__, which nanobind calls otherwise (~5 us a tensor on the development CPU; a layer
    step passes ~66 tensors)."""

    def __getattr__(self, name):
        fn = getattr(_ext, name)
        capsule = torch.utils.dlpack.to_dlpack

        if EAGER_DIRECT:

            def call(*args):  # detach only what requires grad (~1 us a tensor on the H200's host)
                return fn(
                    *[
                        capsule(a.detach() if a.requires_grad else a) if isinstance(a, Tensor) else a
                        for a in args
                    ]
                )

        else:

            def call(*args):
                return fn(*[a.detach() if isinstance(a, Tensor) else a for a in args])

        setattr(self, name, call)  # built once per function: later lookups skip __getattr__
        return call


C = _Core()


# the current stream's handle straight from torch's core: torch.cuda.current_stream builds a Stream object at
# each call (14 us a call under cProfile on the H200's host), and a 48-layer LoRA step asks ~3,300 times
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream(t: Tensor) -> int:
    """The current CUDA stream of t's device as an integer (0 for a CPU tensor), as the core takes it."""
    if not t.is_cuda:
        return 0
    if _raw_stream is not None:
        return _raw_stream(t.device.index)
    return torch.cuda.current_stream(t.device).cuda_stream


def choice(name: str, value: str, table: dict) -> int:
    """table[value], or a ValueError naming the argument and the expected values."""
    if value not in table:
        raise ValueError(f"{name}: expected one of {sorted(table)}, got {value!r}")
    return table[value]


def gated(kind: int) -> bool:
    return kind in (0, 1)


# ------------------------------------------------------------------------- what depends only on shapes
class _Lru:
    """Tensors by key, at most `size` of them and `max_bytes` in all: the least recently used go first, and a
    tensor larger than max_bytes is not kept. Safe to share between threads (autograd's backward runs on a
    thread of its own)."""

    def __init__(self, size: int, max_bytes: int):
        self.size, self.max_bytes, self.nbytes = size, max_bytes, 0
        self._d = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key) -> Optional[Tensor]:
        with self._lock:
            value = self._d.get(key)
            if value is not None:
                self._d.move_to_end(key)
            return value

    def put(self, key, value: Tensor) -> None:
        if value.nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._d.pop(key, None)
            self.nbytes += value.nbytes - (old.nbytes if old is not None else 0)
            self._d[key] = value
            while len(self._d) > self.size or self.nbytes > self.max_bytes:
                self.nbytes -= self._d.popitem(last=False)[1].nbytes

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self.nbytes = 0

    def __len__(self) -> int:
        return len(self._d)


_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def _uncached(t: Tensor) -> bool:
    """Whether a call on t must get tensors of its own rather than cached ones: while t's GPU stream captures a
    CUDA graph (a graph keeps what it reads alive only in its own memory pool, and a tensor made during
    capture is written when the graph replays, not before), and while anything traces (torch.compile, a
    dispatch mode, fake or functional tensors: what they make is no tensor to keep)."""
    if type(t) is not Tensor and type(t) is not torch.nn.Parameter:
        return True
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return True
    return t.is_cuda and _is_capturing is not None and _is_capturing()


_constants = _Lru(64, 4 << 20)  # read-only tensors by (what, device, shape): offsets, indices, unit scales


def _constant(key, like: Tensor, make) -> Tensor:
    """_constants[key], made by make() on a miss; a new one where _uncached(like)."""
    if _uncached(like):
        return make()
    t = _constants.get(key)
    if t is None:
        t = make()
        _constants.put(key, t)
    return t


def one_group_offsets(rows: int, like: Tensor) -> Tensor:
    """offsets [2] = [0, rows] int32 of a grouped GEMM with one group (a dense layer's GEMM), on like's device.
    Made on the device (no host copy, no sync) once per (device, rows) and shared: nothing may write it."""
    dev = like.device

    def make():
        if rows == 0:
            return torch.zeros(2, dtype=torch.int32, device=dev)
        return torch.arange(0, 2 * rows, rows, dtype=torch.int32, device=dev)

    return _constant(("one_group", dev, rows), like, make)


def shared_arange(n: int, like: Tensor) -> Tensor:
    """torch.arange(n) of like's dtype on like's device (row indices), made once per (device, dtype, n) and
    shared: nothing may write it."""
    dev, dtype = like.device, like.dtype
    return _constant(("arange", dev, dtype, n), like, lambda: torch.arange(n, dtype=dtype, device=dev))


def shared_ones(shape: tuple, like: Tensor) -> Tensor:
    """torch.ones(shape) f32 on like's device (scales that are all ones), made once per (device, shape) and
    shared: nothing may write it."""
    shape, dev = tuple(shape), like.device
    return _constant(("ones", dev, shape), like, lambda: torch.ones(shape, dtype=torch.float32, device=dev))


# ------------------------------------------------------------------------------------------ workspaces
_ws_bytes: dict = {}
_workspaces = _Lru(32, 64 << 20)  # scratch(): GEMM and plan workspaces, KiBs to a few MiB each


def sm90_workspace(
    a: Tensor, num_experts: int, query: str = "grouped_gemm_workspace_bytes"
) -> Optional[Tensor]:
    """Scratch that lets a grouped GEMM take the Hopper (CUTLASS sm_90a) path (`query` names the _C function
    giving its size); None where there is no such path. Sizes are cached per (device, experts, query); the
    scratch (a prep kernel writes the groups' arguments into it, the GEMM reads them) is scratch()'s."""
    n = sm90_workspace_bytes(a, num_experts, query)
    return scratch(a, n) if n else None


def scratch(like: Tensor, n: int, dtype: torch.dtype = torch.uint8) -> Tensor:
    """n elements of `dtype` on like's device for kernels that write them and read them back within one call
    (a GEMM's or the plan's workspace). On a GPU one tensor per (device, stream, thread, n, dtype) serves every
    call: the calls one thread issues on one stream run one after the other; two streams never share one, nor
    two threads (whose launches on one stream could interleave). On the CPU (where no kernel keeps anything for
    later) and where _uncached(like), a new tensor."""
    if not like.is_cuda or _uncached(like):
        return torch.empty(n, dtype=dtype, device=like.device)
    key = (like.device.index, stream(like), threading.get_ident(), n, dtype)
    t = _workspaces.get(key)
    if t is None:
        t = torch.empty(n, dtype=dtype, device=like.device)
        _workspaces.put(key, t)
    return t


def sm90_workspace_bytes(a: Tensor, num_experts: int, query: str = "grouped_gemm_workspace_bytes") -> int:
    """Bytes of sm90_workspace for a's device (0: no Hopper path there, or a is on the CPU); cached."""
    if not a.is_cuda:
        return 0
    key = (a.device.index, num_experts, query)
    if key not in _ws_bytes:
        with torch.cuda.device(a.device):
            _ws_bytes[key] = getattr(C, query)(num_experts, True)
    return _ws_bytes[key]


# -------------------------------------------------------------------------------------- direct calls
_PLAIN = (Tensor, torch.nn.Parameter)


def _direct_ok(args) -> bool:
    if torch.compiler.is_compiling():
        return False
    if torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    for a in args:
        if isinstance(a, Tensor) and (type(a) not in _PLAIN or not (a.is_cuda or a.is_cpu)):
            return False
    return True


class _DirectOp(torch._library.custom_ops.CustomOpDef):
    """A moe8 custom op whose plain eager calls skip the dispatcher (see the module's docstring); an
    instance of CustomOpDef still (torch.library.opcheck, register_fake, ... see the same op)."""

    def _setup_direct(self) -> None:
        schema = self._opoverload._schema
        self._direct_nargs = len(schema.arguments)
        # the arguments an in-place op writes: their version counters are bumped as the dispatcher would,
        # so that autograd still refuses a saved tensor that was overwritten
        self._direct_writes = [
            i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        ]
        self._direct_fn = None
        impl, setup, bwd = self._init_fn, self._setup_context_fn, self._backward_fn
        if bwd is not None and setup is not None:

            def forward(ctx, *args):
                out = impl(*args)
                setup(ctx=ctx, inputs=args, output=out)
                return out

            def backward(ctx, *grads):
                return bwd(ctx, *grads)

            methods = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
            self._direct_fn = type("Direct_" + self._name, (torch.autograd.Function,), methods)

    def __call__(self, *args, **kwargs):
        if not EAGER_DIRECT or kwargs or len(args) != self._direct_nargs or not _direct_ok(args):
            return super().__call__(*args, **kwargs)
        if self._direct_fn is not None and torch.is_grad_enabled():
            if any(isinstance(a, Tensor) and a.requires_grad for a in args):
                return self._direct_fn.apply(*args)
        out = self._init_fn(*args)
        for i in self._direct_writes:
            torch.autograd.graph.increment_version(args[i])
        return out


def make_direct(namespace: dict) -> None:
    """Turns every custom op in `namespace` (a module's globals, after all its registrations) into a
    _DirectOp (the same object, its class swapped)."""
    for value in namespace.values():
        if type(value) is torch._library.custom_ops.CustomOpDef:
            value.__class__ = _DirectOp
            value._setup_direct()


class _Dispatched(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def dispatched():
    """Within this block every moe8 op call goes through the torch.library dispatcher (a TorchFunctionMode
    that changes nothing else): for comparing the direct path with the dispatched one."""
    with _Dispatched():
        yield
