"""moe8.optim — AdamW whose step on CUDA tensors is moe8's kernel (csrc/cuda/optim.cu): the update of
torch.optim.AdamW(fused=True) (float32 arithmetic, each tensor rounded once to its dtype), its tensors streamed at
the memory's rate, the CPU reference's bits (core/adamw.h).

    opt = moe8.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

A torch.optim.AdamW in every other respect: the same arguments (and kernel_min_numel), param groups, state ("step",
"exp_avg", "exp_avg_sq", so checkpoints load both ways), hooks and schedulers. What the kernel does not take runs on
torch's own AdamW in the same step (fused or foreach as asked): tensors under kernel_min_numel elements (2^20 by
default: there the host's time per tensor outweighs the GPU's saving), amsgrad, capturable or differentiable groups,
complex or sparse gradients, tensors not contiguous or not on a GPU, tensor subclasses (DTensor: FSDP2, expert
parallelism), and gradients of another dtype than their parameter. Hugging Face's Trainer gets it for
optim="adamw_torch" and "adamw_torch_fused" after moe8.enable() (moe8.Config(fused_adamw=True), the default).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from ._core import EXT, stream

_capsule = torch.utils.dlpack.to_dlpack


def adamw_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    maximize: bool = False,
) -> None:
    """One AdamW step of the tensors in place (params, exp_avgs, exp_avg_sqs): contiguous, one float dtype, one
    device, grads[i] etc. of params[i]'s shape; step counts this update (1 for the first). Bad arguments raise
    ValueError / TypeError naming them."""
    if not params:
        return
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    flat = [[_capsule(t.detach().view(-1)) for t in ts] for ts in lists]
    EXT.adamw_step(
        *flat,
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        int(step),
        bool(maximize),
        stream(params[0]),
    )
    # as torch's in-place step does (the states are never saved for a backward)
    torch.autograd.graph.increment_version(params)


_PLAIN = (Tensor, torch.nn.Parameter)
# Tensors smaller than this step on torch's AdamW (fused where it was asked for): the kernel saves ~1.4 ps of GPU
# time an element over torch's fused step, the call costs tens of microseconds of host time a tensor, and many
# small tensors (LoRA adapters, norms) are a step the host issues, not one the memory bounds.
KERNEL_MIN_NUMEL = 1 << 20


def _takes(p: Tensor, g: Tensor, state: dict, min_numel: int = KERNEL_MIN_NUMEL) -> bool:
    """Whether moe8's kernel steps p: a plain CUDA float tensor (not a DTensor or another subclass: FSDP2's and
    expert parallelism's parameters go to torch's step) of at least min_numel elements, contiguous, its gradient
    dense of its dtype."""
    if type(p) not in _PLAIN or type(g) not in _PLAIN or p.numel() < min_numel:
        return False
    if not (p.is_cuda and p.dtype in (torch.float32, torch.float16, torch.bfloat16) and p.is_contiguous()):
        return False
    if g.is_sparse or g.dtype != p.dtype or not g.is_contiguous() or g.device != p.device:
        return False
    return all(
        key not in state or (state[key].dtype == p.dtype and state[key].is_contiguous())
        for key in ("exp_avg", "exp_avg_sq")
    )


def _torch_step(opt) -> None:
    """torch's AdamW step without the optimizer-hook wrapper torch puts on a class's step once an instance exists
    (this step's own wrapper has run the hooks already)."""
    step = torch.optim.AdamW.step
    while getattr(step, "hooked", False):
        step = step.__wrapped__
    step(opt)


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW with moe8's fused step for its CUDA tensors of at least kernel_min_numel elements (see the
    module's docstring). foreach and fused choose torch's implementation for the other tensors, as they do for
    torch.optim.AdamW. A GradScaler unscales the gradients before the step (fp16 AMP), as for a step without
    fused kernels."""

    def __init__(
        self,
        params,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        kernel_min_numel: int = KERNEL_MIN_NUMEL,
    ):
        if (
            isinstance(kernel_min_numel, bool)
            or not isinstance(kernel_min_numel, int)
            or kernel_min_numel < 0
        ):
            raise ValueError(f"kernel_min_numel: expected an integer >= 0, got {kernel_min_numel!r}")
        self.kernel_min_numel = kernel_min_numel
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
            foreach=foreach,
            fused=fused,
        )
        # moe8's kernel takes no grad_scale / found_inf: a GradScaler unscales and checks the gradients itself
        self._step_supports_amp_scaling = False

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = []  # the parameters moe8 stepped, their gradients hidden from torch's step below
        left = False
        for group in self.param_groups:
            if group["amsgrad"] or group["capturable"] or group["differentiable"]:
                left = left or any(p.grad is not None for p in group["params"])
                continue
            batches = defaultdict(list)  # (device, dtype, step) -> parameters
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not _takes(p, p.grad, state, self.kernel_min_numel):
                    left = True
                    continue
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif state["step"].device.type != "cpu":  # a state made by torch's fused or capturable step
                    state["step"] = state["step"].cpu()
                state["step"] += 1
                batches[p.device, p.dtype, int(state["step"].item())].append(p)
            lr = group["lr"]
            lr = lr.item() if isinstance(lr, Tensor) else lr
            beta1, beta2 = (b.item() if isinstance(b, Tensor) else b for b in group["betas"])
            for (_, _, t), ps in batches.items():
                adamw_step(
                    ps,
                    [p.grad for p in ps],
                    [self.state[p]["exp_avg"] for p in ps],
                    [self.state[p]["exp_avg_sq"] for p in ps],
                    lr=lr,
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    step=t,
                    maximize=group["maximize"],
                )
                stepped += ps
        if left:  # torch's AdamW for the rest: it skips the parameters whose gradient is None
            grads = [p.grad for p in stepped]
            for p in stepped:
                p.grad = None
            try:
                _torch_step(self)
            finally:
                for p, g in zip(stepped, grads):
                    p.grad = g
        return loss
