"""Language-model loss without the full logits: cross-entropy of `hidden @ weight.T` computed a chunk of rows at
a time, forward and backward, so at most one [chunk, vocab] block of logits exists at once.

At Qwen3's vocabulary (151,936) a 2 x 4096-token micro-batch has 1.2G logits: 2.5 GB in bf16, and
transformers' loss adds a float32 copy, its log-softmax and their gradients (about 15 GB more). Here the
logits are rounded to the weight's dtype and then taken to float32 exactly as transformers does
(`logits.float()`), so the loss is the same up to summation order. Each chunk's gradients are computed in the
forward while its logits exist (softmax - onehot written over them by one kernel, `cross_entropy_rows`), so
a chunk costs the three GEMMs of the unfused loss and no float32 copy of anything [chunk, vocab].

A vocabulary that is not a multiple of 128 (151,669 for Qwen3's tokenizer after
`resize_token_embeddings(len(tokenizer))`) runs at a padded one: the weight gets zero rows, their logits are
set to -inf, so they add nothing to the softmax and get a zero gradient, and every GEMM runs on aligned rows
(cuBLAS takes a 1-element-aligned kernel otherwise, ~5x slower). The loss and gradients are those of the
unpadded math: the extra terms are exact zeros.

    with moe8.loss.hidden_states_as_logits(model) as head:   # the model returns hidden states as "logits"
        out = model(input_ids=x)
    loss = moe8.loss.chunked_cross_entropy(out.logits.flatten(0, 1), head.weight, labels.flatten())

or, for a transformers causal LM trained as usual (`model(input_ids=x, labels=y).loss`):
    moe8.loss.fuse_causal_lm_loss(model)   # what moe8.accelerate(model, fuse_loss=True) does
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor, nn

from ._core import C as _C
from ._core import stream as _stream

IGNORE_INDEX = -100


@torch.library.custom_op("moe8::cross_entropy_rows", mutates_args=("logits",))
def cross_entropy_rows(logits: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """Per row of logits [n, V]: the cross-entropy loss [n] float32 against target [n] int64 (0 for
    ignore_index rows, NaN for an id out of [0, V)), computed in float32; the row is overwritten with its
    gradient softmax - onehot(target) in the logits' dtype (one CUDA kernel, or the CPU reference)."""
    loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    _C.cross_entropy_rows(logits, target, ignore_index, loss, _stream(logits))
    return loss


@cross_entropy_rows.register_fake
def _(logits, target, ignore_index):
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """The loss is a scalar, so its gradients are those of the sum times the scalar the backward gets: they
    are computed in the forward, chunk by chunk while the chunk's logits exist (three GEMMs per chunk, as
    unfused: logits, d hidden, d weight), and the backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, target, chunk, ignore_index):
        n, vocab = hidden.shape[0], weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[:2]
        padded = padded_vocab(vocab)
        if padded != vocab:  # every GEMM on aligned rows: the weight with zero rows, their logits -inf
            weight = _pad_rows(weight, padded)
            beyond = (target >= vocab) & (target != ignore_index)  # still out of range (NaN) after padding
            target = torch.where(beyond, padded + int(ignore_index == padded), target)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        dh = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        dw = None  # float32 [padded, H], the first chunk's d weight then the sum
        for s, rows in _chunks(n, chunk):
            h = hidden[s : s + rows]
            d = h @ weight.t()  # the chunk's logits [rows, padded], then (in place) d sum / d logits
            if padded != vocab:
                d[:, vocab:] = float("-inf")  # no probability, so softmax - onehot is exactly 0 there
            total += cross_entropy_rows(d, target[s : s + rows], ignore_index).sum()
            if need_h:
                torch.mm(d, weight, out=dh[s : s + rows])
            if need_w:
                dw = _add_wgrad(dw, d, h)
            del d
        if need_w and dw is None:  # no rows: a zero gradient
            dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        ctx.save_for_backward(dh, dw[:vocab] if dw is not None else None)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors
        dh = dh * grad if dh is not None else None  # in float32, rounded once to dh's dtype
        if dw is not None:  # one pass: the float32 sum times grad, rounded once to the weight's dtype
            dw = torch.mul(dw, grad, out=torch.empty(dw.shape, dtype=ctx.weight_dtype, device=dw.device))
        return dh, dw, None, None, None


def _chunks(n: int, chunk: int):
    """(start, rows) of the fewest chunks of at most `chunk` rows that cover n rows, of equal size (the last
    takes what is left): 8,192 rows at 7,040 a chunk are two of 4,096, not 7,040 and 1,152, whose small
    GEMMs and wave tails run below the large ones' rate. Above 128 rows a chunk is a multiple of 128."""
    count = -(-n // chunk) if n else 0
    rows = -(-n // count) if count else 0
    if rows > 128:
        rows = min(chunk, -(-rows // 128) * 128)
    return [(s, min(rows, n - s)) for s in range(0, n, rows)] if rows else []


def _add_wgrad(dw: Optional[Tensor], d: Tensor, h: Tensor) -> Tensor:
    """dw + d.T @ h in float32 (d.T @ h alone for dw None). On CUDA the GEMM reads bf16/fp16 operands, keeps its
    float32 accumulator and adds it to dw in its epilogue (cuBLAS with a float32 C): no [V, H] product in the
    operands' dtype, rounded and then added by a second kernel. Elsewhere the product is rounded to the operands'
    dtype first (torch's CPU matmul has no float32 output for them)."""
    f32 = torch.float32
    if d.dtype == f32:
        return torch.mm(d.t(), h) if dw is None else dw.addmm_(d.t(), h)
    if d.is_cuda:
        if dw is None:
            return torch.mm(d.t(), h, out_dtype=f32)
        return torch.addmm(dw, d.t(), h, out_dtype=f32, out=dw)
    return (d.t() @ h).to(f32) if dw is None else dw.add_(d.t() @ h)


ALIGN_ROWS = 128


def padded_vocab(vocab: int) -> int:
    """The vocabulary the loss's GEMMs run at: `vocab` rounded up to a multiple of ALIGN_ROWS. cuBLAS runs a
    GEMM whose logits have a leading dimension that is not a multiple of 8 on a slow, 1-element-aligned
    kernel (Qwen3's tokenizer, 151,669 ids: ~5x slower than at 151,936; docs/architecture.md)."""
    return -(-vocab // ALIGN_ROWS) * ALIGN_ROWS


def _pad_rows(weight: Tensor, rows: int) -> Tensor:
    """weight [V, H] as [rows, H] with zero rows after its own: one copy per forward of the loss (the head
    is trained, so its weight changes every step), freed with the forward; a few hundred microseconds for
    a 151,669 x 2,048 bf16 head on an H200, against the tens of milliseconds the unaligned GEMMs cost."""
    out = weight.new_empty(rows, weight.shape[1])
    out[: weight.shape[0]].copy_(weight)
    out[weight.shape[0] :].zero_()
    return out


def chunk_rows(weight: Tensor, budget: int = 1 << 31) -> int:
    """Rows per chunk that keep one chunk's logits within `budget` bytes (2 GiB): a multiple of 128, at least
    1024 (151,936 bf16 logits a row, Qwen3's vocabulary: 7,040 rows)."""
    per_row = weight.shape[0] * weight.element_size()
    return max(1024, budget // per_row // 128 * 128)


def chunked_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    chunk: Optional[int] = 1024,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "sum",
) -> Tensor:
    """Cross-entropy of the logits `hidden @ weight.T` against `target`, `chunk` rows at a time.

    hidden [N, H] (float32, bf16 or fp16), weight [V, H] of the same dtype and device, target [N] integer
    class ids in [0, V) or `ignore_index` (an id out of range makes the loss NaN). chunk: rows per chunk, None
    for chunk_rows(weight). reduction "sum" or "mean" (over the rows not ignored). Returns a float32 scalar;
    gradients flow to hidden and weight (computed in the forward when either requires grad)."""
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
    chunk = chunk_rows(weight) if chunk is None else chunk
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


def _causal_lm_loss(
    head: nn.Linear,
    hidden: Tensor,
    labels: Tensor,
    num_items_in_batch=None,
    ignore_index=IGNORE_INDEX,
    shift_labels=None,
    chunk: Optional[int] = None,
) -> Tensor:
    """transformers' ForCausalLMLoss (labels shifted left by one, mean over the targets not ignored, or the
    sum over num_items_in_batch when given: gradient accumulation) from the final hidden states."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    total = chunked_cross_entropy(
        hidden,
        head.weight,
        shift_labels.reshape(-1),
        chunk=chunk,
        ignore_index=ignore_index,
        reduction="sum" if num_items_in_batch is not None else "mean",
    )
    if num_items_in_batch is not None:
        total = total / torch.as_tensor(num_items_in_batch, device=total.device)
    return total


class _FusedLoss:
    """What fuse_causal_lm_loss installs on one model: while a training forward with labels runs, the LM head
    passes the hidden states through and the model's loss_function computes the loss from them chunk by
    chunk; any other call (no labels, no grad, logits_to_keep, return_dict=False, a head replaced since) is
    transformers' own."""

    def __init__(self, model, head: nn.Linear, chunk: Optional[int]):
        self.head, self.chunk, self.active = head, chunk, False
        self.loss_function = model.__dict__.get("_loss_function")  # restored by unfuse (None: the default)
        self.own_loss = model.loss_function
        self.head_forward = head.forward
        self.hooks = [
            model.register_forward_pre_hook(self.pre, with_kwargs=True),
            model.register_forward_hook(self.post, always_call=True),
        ]
        head.forward = self.forward_head
        model.loss_function = self.loss

    def pre(self, module, args, kwargs):  # labels as a keyword, as transformers' Trainer passes them
        keep = kwargs.get("logits_to_keep", 0)
        self.active = (
            module.get_output_embeddings() is self.head  # not swapped since (a LoRA wrapper around it)
            and kwargs.get("labels") is not None
            and kwargs.get("return_dict") is not False  # a tuple would hold the hidden states as its logits
            and torch.is_grad_enabled()
            and isinstance(keep, int)
            and keep == 0
        )

    def post(self, module, args, output):
        if self.active and hasattr(output, "logits"):
            output["logits"] = None  # they were the hidden states: none were computed
        self.active = False

    def forward_head(self, x):
        return x if self.active else self.head_forward(x)

    def loss(
        self,
        logits,
        labels,
        vocab_size,
        num_items_in_batch=None,
        ignore_index=IGNORE_INDEX,
        shift_labels=None,
        **kwargs,
    ):
        if not self.active:
            return self.own_loss(
                logits,
                labels,
                vocab_size,
                num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index,
                shift_labels=shift_labels,
                **kwargs,
            )
        return _causal_lm_loss(
            self.head, logits, labels, num_items_in_batch, ignore_index, shift_labels, self.chunk
        )

    def remove(self, model) -> None:
        for h in self.hooks:
            h.remove()
        del self.head.forward  # the class's forward again
        if self.loss_function is None:
            model.__dict__.pop("_loss_function", None)
        else:
            model.loss_function = self.loss_function


def fuse_causal_lm_loss(model, chunk: Optional[int] = None) -> bool:
    """Compute a transformers causal LM's training loss without its logits: in a forward with labels and grad
    on, the LM head (an nn.Linear without bias) returns the hidden states and the loss is
    chunked_cross_entropy of them (same value as transformers' ForCausalLMLoss up to summation order,
    num_items_in_batch and shift_labels honoured); outputs.logits is then None. Forwards without labels or
    grad (generation, evaluation) are unchanged. Returns False, changing nothing, for a model without such a
    head or without a loss_function; True once fused (idempotent). unfuse_causal_lm_loss undoes it.
    chunk: rows per chunk; None: chunk_rows(the head's weight), ~2 GiB of logits at a time."""
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk: expected a positive number of rows, got {chunk}")
    if getattr(model, "_moe8_fused_loss", None) is not None:
        return True
    head = plain_lm_head(model)
    if head is None or not hasattr(type(model), "loss_function"):
        return False
    model._moe8_fused_loss = _FusedLoss(model, head, chunk)
    return True


def unfuse_causal_lm_loss(model) -> None:
    """Undo fuse_causal_lm_loss (nothing for a model it did not fuse)."""
    fused = model.__dict__.pop("_moe8_fused_loss", None)
    if fused is not None:
        fused.remove(model)
