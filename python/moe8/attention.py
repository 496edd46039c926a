"""moe8.attention — attention with per-head sinks (GPT-OSS) through PyTorch's fused SDPA kernels, without the
[batch, heads, S, S] score, probability and gradient tensors of transformers' eager path.

With a sink logit s_h per head, softmax runs over the row's scores and s_h, and the sink's share is dropped:
    out = sum_j p'_j v_j,  p'_j = exp(x_j) / (Z + exp(s_h)),  Z = sum_j exp(x_j)
so out = r * o, where o is plain softmax attention (the fused kernel) and r = Z / (Z + exp(s_h)) =
sigmoid(lse - s_h) comes from the kernel's log-sum-exp. The backward runs the kernel's own backward with the
output gradient scaled by r and the final output passed as `out`: the kernel forms D = rowsum(dO * out) from
them, which is then r^2 <dO, o>, exactly the D of the attention with the sink (its log-sum-exp gradient
included), so dq, dk, dv come out of one fused backward. d s_h = -sum_rows <dO, o> r (1 - r).

On CUDA the memory-efficient kernel (it takes the additive mask transformers builds: causal, sliding window,
packed documents); on the CPU the flash kernel's CPU version. Keys and values of grouped-query attention are
expanded to the query heads for the kernel and their gradients summed back. What the kernel cannot take
(kernel_head_dim says so from the inputs) still runs: a head dim off the kernel's alignment is zero-padded up
to it (the scores and the output's first D columns are unchanged), and a dtype, device or empty shape it has
no kernel for runs the formula itself, as transformers' eager attention does.

sink_attention is the op; attention_forward has the signature of transformers' eager_attention_forward
(Config.fuse_attention puts it in place of GPT-OSS's, moe8.hf).

Rows of packed documents (packed_attention_forward, Config.packed_attention): transformers turns position_ids
that restart at each document into a block-diagonal [B, 1, S, S] mask, which keeps SDPA off its flash kernel
(on an H200, one Qwen3-30B-A3B layer's attention on 2 x 4096 tokens, forward and backward: 6.30 ms with that
mask, 1.98 ms causal without it, 1.65 ms as varlen flash over the documents). Given the documents' boundaries
as transformers' flash-attention kwargs (cu_seq_lens_q / _k, max_length_q / _k: what DataCollatorWithFlattening
returns with return_flash_attn_kwargs, or packed_sequences from the position_ids), packed_attention_forward runs
torch's varlen flash attention over them (torch.nn.attention.varlen.varlen_attn, causal within each document,
grouped-query heads as they are) and ignores the mask; any call it cannot take runs transformers' sdpa."""

from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import Tensor

_ALIGN = 16  # the memory-efficient kernel reads the mask's rows 16-element aligned
_GRID = 65535  # the CUDA kernel's grid holds the heads and the batch in its y and z dimensions


def kernel_head_dim(device_type: str, dtype: torch.dtype, head_dim: int, capability=(0, 0)) -> Optional[int]:
    """The head dim the fused kernel runs q, k and v at: head_dim, or head_dim zero-padded up to the kernel's
    alignment; None where no kernel takes the inputs (the formula runs then). CUDA (compute capability
    `capability`): the memory-efficient kernel, fp16 and fp32, bf16 from sm80; its rows are read 16 bytes at a
    time (torch builds bf16 kernels for aligned rows only: "no kernel found to launch" otherwise), so the head
    dim is a multiple of 8 in a 16-bit dtype, of 4 in fp32. CPU: the flash kernel's CPU version takes any head
    dim in fp32, fp64, bf16 and fp16."""
    if head_dim < 1:
        return None
    if device_type == "cpu":
        return head_dim if dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16) else None
    if device_type != "cuda" or dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    if dtype == torch.bfloat16 and tuple(capability) < (8, 0):
        return None
    align = 16 // dtype.itemsize
    return -(-head_dim // align) * align


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A mask as the additive one the kernels take: a boolean mask (True: attend) becomes 0 / the dtype's min."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(dtype).min
        )
    return mask.to(dtype)


def _rows_aligned(m: Tensor) -> bool:
    """Whether the CUDA kernel reads m as it is: its last dim dense, its start and every other stride (of a dim
    longer than 1) a multiple of 16 elements. Otherwise (T not a multiple of 16, a slice of a longer mask) it
    is copied into rows padded to 16."""
    strides = [st for st, n in zip(m.stride()[:-1], m.shape[:-1]) if n > 1]
    return (
        (m.shape[-1] <= 1 or m.stride(-1) == 1)
        and m.data_ptr() % (_ALIGN * m.element_size()) == 0
        and all(st % _ALIGN == 0 for st in strides)
    )


def _aligned_mask(mask: Optional[Tensor], q: Tensor, k: Tensor) -> Optional[Tensor]:
    """The additive mask [B or 1, 1 or H, S, T] broadcast to [B, H, S, T] in q's dtype, its rows 16-element
    aligned in storage (_rows_aligned; else copied into rows padded to a multiple of 16, a view of the first T),
    as the CUDA kernel needs; None stays None on the CPU and is a zero mask on CUDA."""
    B, H, S, T = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if mask is None:
        if not q.is_cuda:
            return None
        mask = q.new_zeros(1, 1, 1, T)  # the CUDA kernel's backward takes a mask tensor, not None
    mask = _additive(mask[..., :T], q.dtype)
    if q.is_cuda and not _rows_aligned(mask):
        padded = mask.new_zeros(*mask.shape[:-1], (T + _ALIGN - 1) // _ALIGN * _ALIGN)
        padded[..., :T] = mask
        mask = padded[..., :T]
    return mask.expand(B, H, S, T)


def _repeat(x: Tensor, groups: int) -> Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * groups, S, D] (each key / value head serving `groups` query heads)."""
    if groups == 1:
        return x
    B, H, S, D = x.shape
    return x[:, :, None].expand(B, H, groups, S, D).reshape(B, H * groups, S, D)


def _fold(dx: Tensor, groups: int) -> Tensor:
    """The gradient of _repeat: the query heads' gradients summed per key / value head."""
    if groups == 1:
        return dx
    B, H, S, D = dx.shape
    return dx.view(B, H // groups, groups, S, D).sum(2)


def _kernel_forward(q, k, v, mask, scale):
    """(o, lse [B, H, S] fp32, saved extras) of softmax(q k^T * scale + mask) v through the fused kernel."""
    if q.is_cuda:
        o, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, 0.0, False, scale=scale
        )
        return o, lse, (seed, offset)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale
    )
    return o, lse, ()


def _kernel_backward(dout, q, k, v, mask, out, lse, extras, scale):
    if q.is_cuda:
        seed, offset = extras
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, mask, out, lse, seed, offset, 0.0, [True, True, True, False], False, scale=scale
        )
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale
    )


def _scaled(x: Tensor, r: Tensor) -> Tensor:
    """x [B, H, S, D] times r [B, H, S] per row, in fp32, rounded once to x's dtype."""
    return (x.float() * r.unsqueeze(-1)).to(x.dtype)


class _SinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, mask, scale, groups):
        kx, vx = _repeat(k, groups), _repeat(v, groups)
        o, lse, extras = _kernel_forward(q, kx, vx, mask, scale)
        # the CUDA kernel pads the rows' log-sum-exp to a multiple of 32
        rows = lse[..., : q.shape[2]].float()
        r = torch.sigmoid(rows - sinks.float().view(1, -1, 1))  # [B, H, S]: 1 - the sink's share
        # saved as SDPA saves its own: q, k, v unexpanded, the kernel's output and log-sum-exp (+ r, [B, H, S]);
        # the expanded k / v and the final output are remade in the backward
        ctx.save_for_backward(q, k, v, mask, o, lse, r, *extras)
        ctx.scale, ctx.groups, ctx.sink_dtype = scale, groups, sinks.dtype
        return _scaled(o, r)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, o, lse, r, *extras = ctx.saved_tensors
        kx, vx, out = _repeat(k, ctx.groups), _repeat(v, ctx.groups), _scaled(o, r)
        dout = dout.contiguous()
        d_r = (dout.float() * o.float()).sum(-1)  # <dO, o> per row
        d_sinks = -(d_r * r * (1 - r)).sum((0, 2)).to(ctx.sink_dtype)
        dq, dk, dv = _kernel_backward(_scaled(dout, r), q, kx, vx, mask, out, lse, extras, ctx.scale)
        return dq, _fold(dk, ctx.groups), _fold(dv, ctx.groups), d_sinks, None, None, None


def sink_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sinks: Tensor,
    mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
) -> Tensor:
    """Attention whose softmax also spans one sink logit per head, dropped from the output (GPT-OSS):
    q [B, H, S, D], k / v [B, Hkv, T, D] (H a multiple of Hkv), sinks [H], mask: additive, broadcastable to
    [B, H, S, T] (None: no mask) -> [B, H, S, D] in q's dtype. scale: default D ** -0.5."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"q, k, v: expected [B, H, S, D] and two equal [B, Hkv, T, D], got {q.shape}, {k.shape}, {v.shape}"
        )
    if q.shape[1] % k.shape[1] or sinks.shape != (q.shape[1],):
        raise ValueError(
            f"k, sinks: expected a head count dividing q's {q.shape[1]} and sinks [{q.shape[1]}], got "
            f"{k.shape[1]} and {tuple(sinks.shape)}"
        )
    D, groups = q.shape[-1], q.shape[1] // k.shape[1]
    scale = D**-0.5 if scale is None else float(scale)
    cap = torch.cuda.get_device_capability(q.device) if q.is_cuda else (0, 0)
    d = kernel_head_dim(q.device.type, q.dtype, D, cap)
    same = k.dtype == v.dtype == q.dtype and k.device == v.device == q.device and v.shape[-1] == D
    sizes = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] > 0 and max(q.shape[0], q.shape[1]) <= _GRID
    if d is None or not same or not sizes:
        return _formula(q, k, v, sinks, mask, scale, groups)
    if d != D:  # zero columns add nothing to q k^T, and give zero output columns
        q, k, v = (torch.nn.functional.pad(t, (0, d - D)) for t in (q, k, v))
    out = _SinkAttention.apply(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        sinks,
        _aligned_mask(mask, q, k),
        scale,
        groups,
    )
    return out if d == D else out[..., :D]


def _formula(q, k, v, sinks, mask, scale, groups):
    """sink_attention through the scores [B, H, S, T] (transformers' eager attention, in fp32 at least): for
    what no fused kernel takes."""
    dt = torch.promote_types(q.dtype, torch.float32)
    kx, vx = _repeat(k, groups).to(dt), _repeat(v, groups).to(dt)
    scores = q.to(dt) @ kx.transpose(-1, -2) * scale  # [B, H, S, T]
    if mask is not None:
        scores = scores + _additive(mask[..., : k.shape[2]], dt)
    sink = sinks.to(dt).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return (probs @ vx).to(q.dtype)


def attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager_attention_forward of a model with sinks (module.sinks), through sink_attention:
    -> (output [B, S, H, D], None); attention weights are not formed, so none are returned. The fused kernels
    run without attention dropout (GPT-OSS trains without it): with a nonzero rate this call runs the eager
    function moe8 replaced in the module's family (moe8.hf), and raises where there is none."""
    if dropout:
        from moe8.hf.registry import registry

        own = registry.module_patches.get((sys.modules[type(module).__module__], "eager_attention_forward"))
        if own is None:
            raise ValueError(f"dropout: moe8's fused attention runs without attention dropout, got {dropout}")
        return own(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    out = sink_attention(query, key, value, module.sinks, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


# ------------------------------------------------------------------------------------ packed documents
def packed_sequences(
    position_ids: Tensor, max_sequences: Optional[int] = None, device=None, max_length: Optional[int] = None
) -> dict:
    """transformers' flash-attention kwargs for rows of packed documents: position_ids [B, S] on the host
    (each token's position in its document: a document starts where it is 0, and at every row's start) ->
    {cu_seq_lens_q, cu_seq_lens_k: the documents' offsets in the B * S flattened tokens, int32 [N + 1];
    max_length_q, max_length_k: the longest document's length}. Pass them to the model's forward with the
    position_ids (packed_attention_forward reads them). For batches of one shape (CUDA graphs capture once):
    max_sequences pads the offsets to max_sequences + 1 with empty documents at the end, and max_length, a
    bound on every batch's longest document, is given instead of this batch's (at most S; the kernels launch
    work for max_length tokens of every document, so the tighter the faster). ValueError when the rows hold
    more documents or a longer one. device: where the offsets go (copied without waiting for the GPU)."""
    if position_ids.dim() != 2 or position_ids.is_cuda:
        raise ValueError(
            f"position_ids: expected [B, S] on the host, got {tuple(position_ids.shape)} on {position_ids.device}"
        )
    B, S = position_ids.shape
    start = position_ids == 0
    start[:, :1] = True
    offsets = start.flatten().nonzero().flatten()
    n = len(offsets)
    ends = torch.cat([offsets, offsets.new_full((1,), B * S)])
    longest = int(ends.diff().max()) if n else 0
    if max_length is not None and longest > max_length:
        raise ValueError(
            f"position_ids: a document of {longest} tokens in the rows, longer than max_length = {max_length}"
        )
    if max_sequences is not None:
        if n > max_sequences:
            raise ValueError(
                f"position_ids: {n} documents in the rows, more than max_sequences = {max_sequences}"
            )
        offsets = torch.cat([offsets, offsets.new_full((max_sequences - n,), B * S)])
    cu = torch.cat([offsets, offsets.new_full((1,), B * S)]).to(torch.int32)
    if device is not None:
        cu = (
            cu.pin_memory().to(device, non_blocking=True)
            if torch.device(device).type == "cuda"
            else cu.to(device)
        )
    length = longest if max_length is None else min(max_length, S)
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=length, max_length_k=length)


def _varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


def varlen_unsupported(module, query, key, value, dropout, is_causal, kwargs) -> Optional[str]:
    """Why packed_attention_forward runs transformers' sdpa for this call, or None when varlen flash takes it:
    the documents' offsets given (packed_sequences), CUDA from sm80, fp16 / bf16, one head dim (a multiple of
    8 up to 256) for q, k and v, self-attention (as many keys as queries), causal, no dropout, no softcap, no
    sinks."""
    if not all(isinstance(kwargs.get(k), Tensor) for k in ("cu_seq_lens_q", "cu_seq_lens_k")) or not all(
        isinstance(kwargs.get(k), int) for k in ("max_length_q", "max_length_k")
    ):
        return "no documents' offsets (cu_seq_lens_q / _k, max_length_q / _k) given"
    if not query.is_cuda or torch.cuda.get_device_capability(query.device) < (8, 0):
        return f"on {query.device}, not a CUDA device of compute capability 8.0 or later"
    if query.dtype not in (torch.float16, torch.bfloat16) or not key.dtype == value.dtype == query.dtype:
        return f"dtypes {query.dtype}, {key.dtype}, {value.dtype}: varlen flash takes fp16 or bf16"
    D = query.shape[-1]
    if key.shape[-1] != D or value.shape[-1] != D or D % 8 or D > 256:
        return f"head dims {D}, {key.shape[-1]}, {value.shape[-1]}: varlen flash takes one, a multiple of 8 <= 256"
    if key.shape[2] != query.shape[2] or query.shape[1] % key.shape[1]:
        return f"{query.shape[2]} queries and {key.shape[2]} keys in {query.shape[1]} / {key.shape[1]} heads"
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        return "attention that is not causal"
    if dropout:
        return f"attention dropout {dropout}"
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        return "a softcap or attention sinks"
    if _varlen() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    return None


def packed_attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' sdpa_attention_forward, with rows of packed documents through varlen flash attention:
    query [B, H, S, D], key / value [B, Hkv, S, D] -> (output [B, S, H, D], None). With the documents' offsets
    in kwargs (packed_sequences) each document attends causally to itself only (within `sliding_window` keys
    where the layer has one) and attention_mask is not read; a call varlen_unsupported refuses runs sdpa."""
    if varlen_unsupported(module, query, key, value, dropout, is_causal, kwargs) is not None:
        from moe8.hf.registry import registry

        sdpa = registry.sdpa
        if sdpa is None:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa
        return sdpa(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    B, H, S, D = query.shape
    window = kwargs.get("sliding_window")
    flat = [t.transpose(1, 2).reshape(B * S, t.shape[1], D) for t in (query, key, value)]
    out = _varlen()(
        *flat,
        kwargs["cu_seq_lens_q"].to(torch.int32),
        kwargs["cu_seq_lens_k"].to(torch.int32),
        kwargs["max_length_q"],
        kwargs["max_length_k"],
        scale=scaling,
        window_size=(-1, 0) if window is None else (window - 1, 0),  # `window` keys, the query's own included
    )
    return out.view(B, S, H, D), None
