"""moe8.parallel.nccl — the `nccl` transport: token rows moved with torch.distributed.all_to_all_single
(NCCL on GPUs, any number of nodes; gloo on CPU).

One dispatch costs two collectives and one device-to-host read:
  1. counts: each rank sends every destination its per-expert row counts for that destination's experts
     (plus its number of out-of-range ids), all_to_all_single of [size, E_local + 1] int32;
  2. one read of the sent and received counts to the host (the split sizes all_to_all_single takes; on a GPU
     this waits for the router and the plan to finish);
  3. rows: all_to_all_single of the [T * K, H] rows in plan order. The owner rebuilds each received row's
     local expert id from the counts, so ids never travel.
With fp8=True step 3 moves e4m3 codes and their 1x128 scales (two all_to_all_single) instead of the rows.
combine is one all_to_all_single with the splits swapped.

Every wait is bounded by the transport's timeout_s (TransportError naming the rank, the collective and the
layer): on gloo every all_to_all is waited for on the host; on NCCL the counts exchange is (its host read
follows), the rows' all_to_all only orders the compute stream, so a peer that stalls there is seen at the next
counts exchange.

Pipelined (`dispatch_pipelined(..., chunks)`, what ep_experts_forward runs with Config.ep_chunks > 1): the
tokens are cut into `chunks` contiguous parts, planned separately, their counts exchanged in one all_to_all
with one host read; then every part's rows all_to_all is started at once (async_op), and the caller waits for
part c just before its expert GEMMs, so part c + 1's rows move while part c computes, and part c's combine
(combine_async) moves while part c + 1 computes. On NCCL the collectives run on NCCL's stream and a wait
only makes the compute stream wait for that part; the backward is the plain synchronous mirror. Both are autograd functions: dispatch's backward
is a combine-direction all_to_all of the row gradients, combine's a dispatch-direction one.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import ops
from .transport import (
    DEFAULT_TIMEOUT_S,
    Meta,
    Transport,
    TransportError,
    check_dispatch_args,
    dequantize_rows,
    quantize_tokens,
    raise_bad_ids,
    source_plan,
    wait_bounded,
    where,
)


class Link(NamedTuple):
    """Where a layer's collectives run: the group, the bound on every wait, the layer's name (for messages)."""

    group: object
    timeout_s: float = DEFAULT_TIMEOUT_S
    layer: str = ""


def _wait(work, what: str, link: Link, host: bool) -> None:
    """work done (host: on the host, at most link.timeout_s; else, on NCCL, the compute stream waits for it)."""
    nccl = dist.get_backend(link.group) == "nccl"
    if not nccl:  # gloo: the collective runs on the host, its wait is the host's
        wait_bounded(work, link.timeout_s, f"{what} all_to_all", link.group, link.layer)
        return
    try:
        work.wait()
    except RuntimeError as e:
        raise _failed(what, link, e) from e
    if host:  # the host read that follows, bounded: NCCL's own bounded wait polls at 1 ms
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + link.timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                raise _failed(what, link, TimeoutError(f"not done within {link.timeout_s:g} s"))


def _all_to_all(
    x: Tensor, out_splits: list, in_splits: list, link: Link, what: str, host: bool = False
) -> Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    try:
        work = dist.all_to_all_single(
            out, x.contiguous(), out_splits, in_splits, group=link.group, async_op=True
        )
    except RuntimeError as e:
        raise _failed(what, link, e) from e
    _wait(work, what, link, host)
    return out


def _failed(what: str, link: Link, e: Exception) -> TransportError:
    rank = dist.get_rank(link.group)
    return TransportError(
        f"moe8.parallel nccl: the {what} all_to_all failed on rank {rank} of the expert-parallel group"
        f"{where(link.layer)} (a peer exited or did not reach it in time): {e}"
    )


class _AllToAll(torch.autograd.Function):
    """Rows [sum(in_splits), H] -> [sum(out_splits), H]; the backward sends the gradients the other way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, link, what):
        ctx.splits, ctx.link, ctx.what = (out_splits, in_splits), link, what
        return _all_to_all(x, out_splits, in_splits, link, what)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return (
            _all_to_all(g, in_splits, out_splits, ctx.link, ctx.what + " backward"),
            None,
            None,
            None,
            None,
        )


class _Fp8AllToAll(torch.autograd.Function):
    """Tokens x [T, H] -> rows [R_recv, H] at their owners, travelling as e4m3 codes + 1x128 scales (each token
    quantised once, its rows gathered in plan order); the owner dequantises into x's dtype. Backward: the row
    gradients go back in x's dtype and each token sums its K slots in slot order (the permute's backward)."""

    @staticmethod
    def forward(ctx, x, row_to_slot, slot_to_row, k, out_splits, in_splits, link):
        codes, scales = quantize_tokens(x)
        token = row_to_slot.long() // k  # [T * K]: the token of each row in plan order
        codes = _all_to_all(codes[token], out_splits, in_splits, link, "dispatch (fp8 codes)")
        scales = _all_to_all(scales[token], out_splits, in_splits, link, "dispatch (fp8 scales)")
        ctx.slot_to_row, ctx.splits, ctx.link = slot_to_row, (out_splits, in_splits), link
        return dequantize_rows(codes, scales, x.dtype)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        back = _all_to_all(g, in_splits, out_splits, ctx.link, "dispatch backward")  # [T * K, H] plan order
        return ops.combine_rows(back, ctx.slot_to_row, None), None, None, None, None, None, None


class Pending:
    """An async all_to_all's work, waited for by wait() (once)."""

    def __init__(self, what: str, link: Link):
        self.work, self.what, self.link = None, what, link

    def wait(self) -> None:
        if self.work is None:
            return
        _wait(self.work, self.what, self.link, False)
        self.work = None


class _AsyncAllToAll(_AllToAll):
    """Starts rows [sum(in_splits), H] -> [sum(out_splits), H] (pending.wait() before reading the result);
    the backward (_AllToAll's) sends the gradients the other way, synchronously."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, link, pending):
        ctx.splits, ctx.link, ctx.what = (out_splits, in_splits), link, pending.what
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        try:
            pending.work = dist.all_to_all_single(
                out, x.contiguous(), out_splits, in_splits, group=link.group, async_op=True
            )
        except RuntimeError as e:
            raise TransportError(
                f"moe8.parallel nccl: starting the {pending.what} all_to_all failed{where(link.layer)}: {e}"
            ) from e
        return out


class _Wait(torch.autograd.Function):
    """t, once its pending all_to_all has completed (identity for autograd)."""

    @staticmethod
    def forward(ctx, t, pending):
        pending.wait()
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g, None


def wait(t: Tensor, pending: Pending) -> Tensor:
    return _Wait.apply(t, pending)


class NcclTransport(Transport):
    name = "nccl"

    def link(self, layer: str = "") -> Link:
        return Link(self.group, self.timeout_s, layer)

    def dispatch(
        self,
        x: Tensor,
        ids: Tensor,
        weights: Tensor,
        check_ids: bool = True,
        fp8: bool = False,
        layer: str = "",
    ):
        check_dispatch_args(x, ids, weights)
        link = self.link(layer)
        k, n, el = ids.shape[1], self.size, self.num_local
        counts, row_to_slot, slot_to_row, bad = source_plan(ids, self.num_experts, check_ids)
        send = torch.zeros(n, el + 1, dtype=torch.int32, device=ids.device)  # [dest, local expert | bad ids]
        send[:, :el] = counts.view(n, el)
        if bad is not None:
            send[:, el] = bad
        recv = _all_to_all(send, [1] * n, [1] * n, link, "counts", host=True)  # [source, local expert | bad]
        host = torch.cat([send.view(-1), recv.view(-1)]).tolist()  # the one device-to-host read
        w = el + 1
        sent = [host[d * w : d * w + el] for d in range(n)]  # rows to each destination, per its local expert
        got = [host[(n + s) * w : (n + s) * w + el] for s in range(n)]  # rows from each source, per my expert
        raise_bad_ids([host[(n + s) * w + el] for s in range(n)], self.num_experts)
        send_splits, recv_splits = [sum(c) for c in sent], [sum(c) for c in got]
        if fp8:
            s2r = slot_to_row.view(ids.shape)
            rows = _Fp8AllToAll.apply(x, row_to_slot, s2r, k, recv_splits, send_splits, link)
        else:
            rows = ops.permute(
                x.contiguous(), row_to_slot, slot_to_row, k
            )  # [T * K, H] (expert, token, slot)
            rows = _AllToAll.apply(rows, recv_splits, send_splits, link, "dispatch")  # [R_recv, H]
        experts = torch.arange(el, dtype=torch.int32, device=x.device).repeat(n)  # [source, local expert]
        per_row = recv[:, :el].reshape(-1).long()  # on the device: output_size keeps this free of syncs
        local_ids = experts.repeat_interleave(per_row, output_size=sum(recv_splits))
        meta = Meta(
            weights.float().contiguous(), slot_to_row.view(ids.shape), row_to_slot, send_splits, recv_splits
        )
        meta.extra["link"] = link
        return rows, local_ids, meta

    def combine(self, rows: Tensor, meta: Meta) -> Tensor:
        link = meta.extra.get("link") or self.link()
        return _AllToAll.apply(rows, meta.send_splits, meta.recv_splits, link, "combine")

    def combine_async(self, rows: Tensor, meta: Meta):
        """combine, started: -> (back [T * K, H], Pending); wait(back, pending) before reading it."""
        link = meta.extra.get("link") or self.link()
        pending = Pending("combine", link)
        return _AsyncAllToAll.apply(rows, meta.send_splits, meta.recv_splits, link, pending), pending

    def dispatch_pipelined(
        self, x: Tensor, ids: Tensor, weights: Tensor, chunks: int, check_ids: bool = True, layer: str = ""
    ):
        """The tokens in `chunks` contiguous parts, each dispatched as by dispatch() but with one counts
        exchange and one host read for all, and every part's rows already moving on return: -> a list of
        (rows, local_ids, meta, pending) per part (wait(rows, pending) before the experts read rows)."""
        check_dispatch_args(x, ids, weights)
        link = self.link(layer)
        k, n, el = ids.shape[1], self.size, self.num_local
        bounds = [int(b) for b in torch.linspace(0, x.shape[0], chunks + 1).round().long()]
        parts, send = [], torch.zeros(n, chunks, el + 1, dtype=torch.int32, device=ids.device)
        for c in range(chunks):
            lo, hi = bounds[c], bounds[c + 1]
            counts, row_to_slot, slot_to_row, bad = source_plan(ids[lo:hi], self.num_experts, check_ids)
            send[:, c, :el] = counts.view(n, el)
            if bad is not None:
                send[:, c, el] = bad
            parts.append((lo, hi, row_to_slot, slot_to_row))
        recv = _all_to_all(send.view(n, -1), [1] * n, [1] * n, link, "counts", host=True).view(
            n, chunks, el + 1
        )
        host = torch.cat([send.view(-1), recv.view(-1)]).tolist()  # the one device-to-host read
        sent = torch.tensor(host[: send.numel()]).view(n, chunks, el + 1)
        got = torch.tensor(host[send.numel() :]).view(n, chunks, el + 1)
        raise_bad_ids(got[:, :, el].sum(1).tolist(), self.num_experts)
        experts = torch.arange(el, dtype=torch.int32, device=x.device).repeat(n)  # [source, local expert]
        out = []
        for c, (lo, hi, row_to_slot, slot_to_row) in enumerate(parts):
            send_splits = sent[:, c, :el].sum(1).tolist()
            recv_splits = got[:, c, :el].sum(1).tolist()
            rows = ops.permute(x[lo:hi].contiguous(), row_to_slot, slot_to_row, k)
            pending = Pending(f"dispatch (part {c + 1} of {chunks})", link)
            rows = _AsyncAllToAll.apply(rows, recv_splits, send_splits, link, pending)
            per_row = recv[:, c, :el].reshape(-1).long()
            local_ids = experts.repeat_interleave(per_row, output_size=sum(recv_splits))
            s2r = slot_to_row.view(hi - lo, k)
            meta = Meta(weights[lo:hi].float().contiguous(), s2r, row_to_slot, send_splits, recv_splits)
            meta.extra["link"] = link
            out.append((rows, local_ids, meta, pending))
        return out
