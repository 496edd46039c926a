"""moe8.rotary — rotary position embeddings as one fused kernel per tensor (torch.library custom ops on
moe8._C, differentiable), and apply_rotary_pos_emb, the drop-in hf.py patches into the families of
hf.ROPE_FAMILIES (fuse_rope). Part of moe8.ops too (moe8.ops.rope, moe8.ops.apply_rotary_pos_emb)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._core import C as _C
from ._core import make_direct as _make_direct
from ._core import stream as _stream


def _rope_out(x: Tensor) -> Tensor:
    # empty_like keeps x's strides when x is dense (transformers' [B, S, H, D] buffer seen as [B, H, S, D]);
    # the kernel needs a contiguous last dim, so anything else gets a contiguous output.
    out = torch.empty_like(x)
    return out if out.stride(-1) == 1 else torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _rope_call(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
    if x.dim() == 4 and x.stride(-1) != 1:  # e.g. an expanded gradient
        x = x.contiguous()
    out = _rope_out(x)
    _C.rope(x, cos.contiguous(), sin.contiguous(), out, backward, _stream(x))
    return out


@torch.library.custom_op("moe8::rope", mutates_args=())
def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding, rotate_half form: x * cos + rotate_half(x) * sin with
    rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]). x [B, H, S, D] (any strides, typically
    proj(h).view(B, S, H, D).transpose(1, 2)), cos and sin [B, S, D] or [1, S, D] of x's dtype.
    fp32 math, one rounding. Differentiable in x only (cos and sin get no gradient)."""
    return _rope_call(x, cos, sin, False)


@rope.register_fake
def _rope_fake(x, cos, sin):
    return _rope_out(x if x.stride(-1) == 1 else x.contiguous())


@torch.library.custom_op("moe8::rope_backward", mutates_args=())
def rope_backward(dy: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """dx = dy * cos + rotate_half^T(dy * sin), rotate_half^T(u) = cat(u[..., D/2:], -u[..., :D/2])."""
    return _rope_call(dy, cos, sin, True)


rope_backward.register_fake(_rope_fake)


def _rope_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])


def _rope_bwd(ctx, g):
    cos, sin = ctx.saved_tensors
    return rope_backward(g, cos, sin), None, None


rope.register_autograd(_rope_bwd, setup_context=_rope_setup)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_fits(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
    if x.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    B, _, S, D = x.shape
    return (
        D % 2 == 0
        and D >= 2
        and cos.shape[0] in (1, B)
        and tuple(cos.shape[1:]) == (S, D)
        and x.stride(-1) == 1
        and x.dtype == cos.dtype == sin.dtype
        and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and x.device == cos.device == sin.device
        and not (cos.requires_grad or sin.requires_grad)  # rope gives cos and sin no gradient
    )


def _broadcasts(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int) -> None:
    """ValueError naming cos or sin where transformers' formula would fail to broadcast them over q or k."""
    for name, t in (("cos", cos), ("sin", sin)):
        for xname, x in (("q", q), ("k", k)):
            try:
                torch.broadcast_shapes(x.shape, t.unsqueeze(unsqueeze_dim).shape)
            except (RuntimeError, IndexError):
                raise ValueError(
                    f"{name}: expected a shape that broadcasts over {xname} {list(x.shape)} when unsqueezed at "
                    f"dim {unsqueeze_dim} (e.g. [B or 1, S, D] for {xname} [B, H, S, D]), got {list(t.shape)}"
                ) from None


def apply_rotary_pos_emb(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1
) -> tuple[Tensor, Tensor]:
    """Drop-in for transformers' apply_rotary_pos_emb (Llama, Qwen): q [B, Hq, S, D], k [B, Hk, S, D],
    cos and sin [B|1, S, D]. Runs `rope` where the inputs fit it; otherwise transformers' formula."""
    if unsqueeze_dim == 1 and _rope_fits(q, cos, sin) and _rope_fits(k, cos, sin):
        return rope(q, cos, sin), rope(k, cos, sin)
    _broadcasts(q, k, cos, sin, unsqueeze_dim)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


_make_direct(globals())  # last: after every op's registrations
