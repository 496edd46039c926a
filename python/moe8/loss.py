"""Language-model loss without the full logits: cross-entropy of `hidden @ weight.T` computed a chunk of rows at
a time, forward and backward, so at most one [chunk, vocab] block of logits exists at once.

At Qwen3's vocabulary (151,936) a 2 x 4096-token micro-batch has 1.2G logits: 2.5 GB in bf16, and
transformers' loss adds a float32 copy, its log-softmax and their gradients (about 15 GB more). Here the
logits are rounded to the weight's dtype and then taken to float32 exactly as transformers does
(`logits.float()`), so the loss is the same up to summation order; the backward recomputes each chunk.

    with moe8.loss.hidden_states_as_logits(model) as head:   # the model returns hidden states as "logits"
        out = model(input_ids=x)
    loss = moe8.loss.chunked_cross_entropy(out.logits.flatten(0, 1), head.weight, labels.flatten())
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

IGNORE_INDEX = -100


def _chunk_logits(h: Tensor, weight: Tensor) -> Tensor:
    return (h @ weight.t()).float()


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, chunk, ignore_index):
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            logits = _chunk_logits(hidden[s : s + chunk], weight)
            t = target[s : s + chunk]
            lse[s : s + chunk] = row_lse = torch.logsumexp(logits, -1)
            picked = logits.gather(1, t.clamp_min(0).unsqueeze(1)).squeeze(1)
            total += torch.where(t != ignore_index, row_lse - picked, 0.0).sum()
            del logits
        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.chunk, ctx.ignore_index = chunk, ignore_index
        return total

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, target, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h, t = hidden[s : s + ctx.chunk], target[s : s + ctx.chunk]
            d = _chunk_logits(h, weight).sub_(lse[s : s + ctx.chunk, None]).exp_()  # softmax
            valid = t != ctx.ignore_index
            rows = torch.arange(t.shape[0], device=t.device)
            d[rows, t.clamp_min(0)] -= valid.float()
            d.mul_((grad * valid.float())[:, None])
            d = d.to(hidden.dtype)
            if need_h:
                dh[s : s + ctx.chunk] = d @ weight
            if need_w:
                dw.add_(d.t() @ h)
            del d
        return dh, dw.to(weight.dtype) if need_w else None, None, None, None


def chunked_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    chunk: int = 1024,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "sum",
) -> Tensor:
    """Cross-entropy of the logits `hidden @ weight.T` against `target`, `chunk` rows at a time.

    hidden [N, H] (float32, bf16 or fp16), weight [V, H] of the same dtype and device, target [N] integer
    class ids in [0, V) or `ignore_index`. reduction "sum" or "mean" (over the rows not ignored). Returns a
    float32 scalar; gradients flow to hidden and weight."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden, weight: expected [N, H] and [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype or hidden.device != weight.device:
        raise ValueError(
            f"weight: expected {hidden.dtype} on {hidden.device} like hidden, got {weight.dtype} on {weight.device}"
        )
    if target.shape != hidden.shape[:1] or target.is_floating_point():
        raise ValueError(
            f"target: expected integer class ids of shape [{hidden.shape[0]}], got {target.dtype} {tuple(target.shape)}"
        )
    if chunk < 1:
        raise ValueError(f"chunk: expected a positive number of rows, got {chunk}")
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction: expected 'sum' or 'mean', got {reduction!r}")
    target = target.to(hidden.device, torch.long)
    total = _ChunkedCrossEntropy.apply(hidden, weight, target, int(chunk), int(ignore_index))
    if reduction == "mean":
        total = total / (target != ignore_index).sum().clamp_min(1)
    return total


def plain_lm_head(model: nn.Module) -> nn.Linear | None:
    """The model's output embeddings when they are an nn.Linear without bias (what hidden_states_as_logits
    can take apart), else None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if isinstance(head, nn.Linear) and head.bias is None else None


@contextlib.contextmanager
def hidden_states_as_logits(model: nn.Module):
    """Inside, `model`'s output embeddings (the LM head, an nn.Linear without bias) are an identity, so its
    forward returns the final hidden states where the logits were; yields the head (its weight is what
    chunked_cross_entropy needs). Restored on exit. Raises ValueError for a head it can't take apart."""
    head = plain_lm_head(model)
    if head is None:
        found = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        raise ValueError(
            f"model: expected output embeddings that are an nn.Linear without bias, got {type(found).__name__}"
        )
    model.set_output_embeddings(nn.Identity())
    try:
        yield head
    finally:
        model.set_output_embeddings(head)
