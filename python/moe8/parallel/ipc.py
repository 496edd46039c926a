"""moe8.parallel.ipc — the `ipc` transport: token rows moved between the GPUs (or processes) of one node by
CUDA IPC, with no NCCL call on the hot path.

Each rank allocates one receive buffer (moe8._C.IpcBuffer, layout in csrc/core/ipc_layout.h) per row dtype
and width, once, and shares it with its peers: the CUDA IPC handles travel once over the group
(all_gather_object; gloo works, also for several ranks on one GPU). Then:

  dispatch  the source's plan puts its rows in (expert, token, slot) order; a warp per row stores it (and
            its metadata: local expert, token, slot, send row) straight into the owner's buffer, in the
            region reserved for this source, at its place among the rows for that owner. A region holds
            `capacity` rows (max tokens x K), so no row is dropped and no offsets are exchanged first (a
            source with more rows sends none and says so in its counts: then every rank grows its buffers to
            the largest batch and the dispatch runs again, or, with max_tokens given, every rank raises the same
            ValueError). The
            owner reads its regions in (source rank, expert, token, slot) order (the interface's order) after
            one device-to-host read of the counts that came with the rows.
            With fp8=True the rows travel as e4m3 codes with their 1x128 scales (a uint8 buffer that also holds
            the scales) and the owner dequantises them.
  combine   the owner stores each result row straight into its source's return region at the row's place
            in the source's send order; the source copies that region out: [T * K, H] in send order.

Each direction is barrier (ready) -> stores -> barrier (done) on every rank's current stream; a barrier spins
on GPU flags and gives up after `timeout_s`, and the host then raises TransportError naming the peer and
the phase (the transport is unusable after that: recreate it on every rank); the collectives that create the
buffers are bounded by timeout_s too. Placement is a pure function
of (source rank, send row), so results are deterministic and equal to the `nccl` transport's.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .. import ops
from .._core import EXT as _ext
from .._core import stream as _stream
from .transport import (
    Meta,
    Transport,
    TransportError,
    agreed_capacity,
    all_gather_bounded,
    capacity_flag,
    check_dispatch_args,
    dequantize_rows,
    quantize_tokens,
    raise_bad_ids,
    source_plan,
    wait_bounded,
    where,
)


class _Buffer:
    """A moe8._C.IpcBuffer whose RuntimeErrors (a failed wait, seen by a call's own check; a failed launch)
    are TransportErrors; ValueErrors (bad arguments) pass as they are."""

    def __init__(self, buf):
        self._buf = buf

    def __getattr__(self, name):
        fn = getattr(self._buf, name)

        def call(*args):
            try:
                return fn(*args)
            except RuntimeError as e:
                raise TransportError(str(e)) from None

        setattr(self, name, call)
        return call


def _check(buf, sync: bool = False, stream: int = 0) -> None:
    buf.check(sync, stream)


@contextlib.contextmanager
def _named(layer: str):
    """A TransportError raised inside names the layer."""
    try:
        yield
    except TransportError as e:
        if not layer or f"(layer {layer})" in str(e):
            raise
        raise TransportError(f"{e}{where(layer)}") from e


class IpcTransport(Transport):
    """The `ipc` transport over `group` (the ranks of one node; several may share a GPU).

    max_tokens: the most tokens a rank dispatches in one call; buffers hold max_tokens * K rows per source,
        and a larger call raises the same ValueError on every rank (naming the ranks and sizes). None: the
        largest T over the group at the first dispatch, grown on every rank to a later call's largest T when
        one needs more (all ranks learn it from the counts that come with the rows).
    timeout_s: how long a barrier (or a collective creating the buffers) waits for a peer before the call
        raises TransportError.
    check: synchronise and check for a failed wait after every call (otherwise a failure surfaces at the
        dispatch's device-to-host read of the counts or at the start of the next call).
    expert_major: deliver the owner's rows in (expert, source rank, token, slot) order, each local expert's
        rows contiguous, instead of the interface's (source rank, expert, token, slot).
    """

    name = "ipc"

    def __init__(
        self,
        group,
        num_experts: int,
        max_tokens: Optional[int] = None,
        timeout_s: float = 10.0,
        check: bool = False,
        expert_major: bool = False,
    ):
        super().__init__(group, num_experts, timeout_s)
        if not hasattr(_ext, "IpcBuffer"):
            raise ValueError("transport 'ipc': this moe8._C has no IpcBuffer (rebuild moe8)")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens: expected >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.check = bool(check)
        self.expert_major = bool(expert_major)
        self.capacity: Optional[int] = None  # rows per source region, fixed by the first buffer
        self._buffers: dict = {}  # (H, dtype, scale columns, device index) -> moe8._C.IpcBuffer

    # ------------------------------------------------------------------------------------------ buffers
    def buffer(
        self,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
        slots: int = 0,
        k: int = 1,
        scale_cols: int = 0,
    ):
        """The buffer for rows of `hidden` elements of `dtype` (and `scale_cols` float32 scales per row),
        created (collectively) on first use; its capacity comes from max_tokens * k, or the group's largest
        `slots` at the first creation."""
        key = (int(hidden), dtype, int(scale_cols), device.index)
        buf = self._buffers.get(key)
        if buf is not None:
            return buf
        if self.capacity is None:
            if self.max_tokens is not None:
                self.capacity = self.max_tokens * k
            else:
                sizes = all_gather_bounded(
                    int(slots), self.group, self.timeout_s, "buffer size exchange", "", "ipc"
                )
                self.capacity = max(1, *sizes)
        try:  # every rank learns whether every rank has its buffer, so none waits for a failed peer
            with torch.cuda.device(device):
                buf = _ext.IpcBuffer(
                    self.rank,
                    self.size,
                    self.num_local,
                    self.capacity,
                    int(hidden),
                    str(dtype),
                    int(scale_cols),
                    device.index,
                )
            mine = buf.handle()
        except (RuntimeError, ValueError) as e:
            buf, mine = None, (type(e) is ValueError, f"rank {self.rank}: {e}")
        handles = all_gather_bounded(mine, self.group, self.timeout_s, "buffer handle exchange", "", "ipc")
        failed = [h for h in handles if isinstance(h, tuple)]
        if failed:
            kind = ValueError if all(bad_input for bad_input, _ in failed) else TransportError
            raise kind(
                f"ipc transport: creating the receive buffers failed: {'; '.join(m for _, m in failed)}"
            )
        buf = _Buffer(buf)
        buf.open(handles)
        self._buffers[key] = buf
        return buf

    def close(self) -> None:
        """Frees the buffers (collective): every rank unmaps its peers' buffers, then, after a group
        barrier, drops its own."""
        for buf in self._buffers.values():
            buf.close_peers()
        if self._buffers:
            work = dist.barrier(group=self.group, async_op=True)
            wait_bounded(work, self.timeout_s, "barrier before freeing the buffers", self.group, "", "ipc")
        self._buffers.clear()

    def grow(self, capacity: int) -> None:
        """Buffers of `capacity` rows per source from the next use on (collective: every rank calls it with the
        same capacity, as agreed_capacity decides from the counts every rank received)."""
        torch.cuda.synchronize()  # nothing on the GPU reads the old buffers any more
        self.close()
        self.capacity = int(capacity)

    def _after(self, buf, stream: int) -> None:
        if self.check:
            _check(buf, True, stream)

    # ------------------------------------------------------------------------------------------ moves
    def _send_tokens(self, x: Tensor, k: int, counts, offsets, row_to_slot, bad, scales=None):
        """Dispatch of tokens (x [T, H], and their scales [T, S] when x holds FP8 codes): -> rows [R, H],
        row scales [R, S] or None, local_ids [R], ret [R], recv tables, send/recv splits."""
        x = x.detach()  # DLPack refuses tensors that require grad (autograd.Function inputs still do)
        n, el = self.size, self.num_local
        sc = 0 if scales is None else scales.shape[1]
        slots = x.shape[0] * k
        buf = self.buffer(x.shape[1], x.dtype, x.device, slots, k, sc)
        _check(buf)  # an earlier failed wait raises here, before anything moves
        stream = _stream(x)
        i32 = dict(dtype=torch.int32, device=x.device)
        bad = bad.view(1) if bad is not None else None
        flag = capacity_flag(slots, self.capacity, bad)
        if flag is bad:
            buf.dispatch_send(x, scales, row_to_slot, offsets, counts, bad, k, True, self.timeout_s, stream)
        else:  # too many rows for a region: none sent, the flag tells every rank how many there are
            none = torch.zeros_like(counts)
            empty = (
                x[:0],
                None if scales is None else scales[:0],
                row_to_slot[:0],
                torch.zeros_like(offsets),
            )
            buf.dispatch_send(*empty[:3], empty[3], none, flag.to(x.device), k, True, self.timeout_s, stream)
        recv_counts = torch.empty(n, el + 1, **i32)  # [source, local expert | bad ids]
        recv_offsets = torch.empty(n * el + 1, **i32)
        recv_base = torch.empty(n * el, **i32)
        buf.dispatch_plan(recv_counts, recv_offsets, recv_base, self.expert_major, stream)
        host = torch.cat([counts, recv_counts.view(-1)]).tolist()  # the one device-to-host read
        _check(buf)  # the stream is done: a failed wait shows now, before any size is trusted
        sent, got = host[: n * el], host[n * el :]
        flags = [got[s * (el + 1) + el] for s in range(n)]
        grown = agreed_capacity(flags, self.capacity, self.max_tokens, k)
        if grown is not None:  # the same on every rank: this round's rows are dropped, and sent again
            self.grow(grown)
            return self._send_tokens(x, k, counts, offsets, row_to_slot, bad, scales)
        raise_bad_ids(flags, self.num_experts)
        recv_splits = [sum(got[s * (el + 1) : s * (el + 1) + el]) for s in range(n)]
        send_splits = [sum(sent[d * el : (d + 1) * el]) for d in range(n)]
        R = sum(recv_splits)
        rows = x.new_empty(R, x.shape[1])
        rows_scale = None if scales is None else scales.new_empty(R, sc)
        local_ids = torch.empty(R, **i32)
        ret = torch.empty(R, **i32)
        buf.dispatch_recv(
            recv_offsets, recv_base, self.expert_major, rows, rows_scale, local_ids, ret, stream
        )
        self._after(buf, stream)
        return rows, rows_scale, local_ids, ret, (recv_offsets, recv_base), send_splits, recv_splits

    def _send_grads(self, g: Tensor, offsets: Tensor, tables, num_rows: int) -> Tensor:
        """Dispatch direction for gradients in send order [T * K, H] -> [R, H] at the owners, placed as the
        forward dispatch placed their rows."""
        g = g.detach().contiguous()
        buf = self.buffer(g.shape[1], g.dtype, g.device)
        _check(buf)
        stream = _stream(g)
        buf.dispatch_send(g, None, None, offsets, None, None, 1, False, self.timeout_s, stream)
        out = g.new_empty(num_rows, g.shape[1])
        buf.dispatch_recv(tables[0], tables[1], self.expert_major, out, None, None, None, stream)
        self._after(buf, stream)
        return out

    def _send_back(self, rows: Tensor, ret: Tensor, num_slots: int) -> Tensor:
        """Combine direction: rows [R, H] at the owners -> [T * K, H] at their sources, in send order."""
        rows = rows.detach().contiguous()
        buf = self.buffer(rows.shape[1], rows.dtype, rows.device)
        _check(buf)
        stream = _stream(rows)
        buf.combine_send(rows, None, ret, self.timeout_s, stream)
        out = rows.new_empty(num_slots, rows.shape[1])
        buf.combine_recv(out, None, stream)
        self._after(buf, stream)
        return out

    # ------------------------------------------------------------------------------------------ interface
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
        if not x.is_cuda or not ids.is_cuda:
            raise ValueError(f"x, ids: the ipc transport moves CUDA tensors, got {x.device} and {ids.device}")
        k = ids.shape[1]
        counts, row_to_slot, slot_to_row, bad = source_plan(ids, self.num_experts, check_ids)
        offsets = F.pad(counts.cumsum(0, dtype=torch.int32), (1, 0))  # [E + 1]: the plan has no padding
        meta = Meta(weights.float().contiguous(), slot_to_row.view(ids.shape), row_to_slot, [], [])
        meta.extra.update(
            transport=self, offsets=offsets, counts=counts, bad=bad, k=k, fp8=bool(fp8), layer=layer
        )
        rows, local_ids = _Dispatch.apply(x.contiguous(), meta)
        return rows, local_ids, meta

    def combine(self, rows: Tensor, meta: Meta) -> Tensor:
        return _Combine.apply(rows, meta)


class _Dispatch(torch.autograd.Function):
    """x [T, H] -> (rows [R, H], local_ids [R]) at the owners; fills meta with what combine needs. Backward:
    the row gradients go back to their sources (combine direction) and each token sums its K slots in slot
    order, in fp32 (ops.combine_rows, as the single-process permute's backward)."""

    @staticmethod
    def forward(ctx, x, meta):
        t, e = meta.extra["transport"], meta.extra
        src, scales = quantize_tokens(x) if e["fp8"] else (x, None)
        with _named(e["layer"]):
            rows, rows_scale, local_ids, ret, tables, send_splits, recv_splits = t._send_tokens(
                src, e["k"], e["counts"], e["offsets"], meta.row_to_slot, e["bad"], scales
            )
        if e["fp8"]:
            rows = dequantize_rows(rows, rows_scale, x.dtype)
        meta.send_splits, meta.recv_splits = send_splits, recv_splits
        e.update(ret=ret, tables=tables)
        ctx.meta = meta
        ctx.mark_non_differentiable(local_ids)
        return rows, local_ids

    @staticmethod
    def backward(ctx, g, _):
        meta = ctx.meta
        t = meta.extra["transport"]
        with _named(meta.extra["layer"]):
            back = t._send_back(g, meta.extra["ret"], meta.row_to_slot.numel())  # [T * K, H] in send order
        return ops.combine_rows(back, meta.slot_to_row, None), None


class _Combine(torch.autograd.Function):
    """rows [R, H] at the owners -> [T * K, H] at the sources in send order. Backward: the gradients of the
    send rows travel the dispatch direction to the places their rows came from."""

    @staticmethod
    def forward(ctx, rows, meta):
        ctx.meta = meta
        t = meta.extra["transport"]
        with _named(meta.extra["layer"]):
            return t._send_back(rows, meta.extra["ret"], meta.row_to_slot.numel())

    @staticmethod
    def backward(ctx, g):
        meta = ctx.meta
        t = meta.extra["transport"]
        with _named(meta.extra["layer"]):
            grads = t._send_grads(g, meta.extra["offsets"], meta.extra["tables"], meta.extra["ret"].numel())
        return grads, None


__all__ = ["IpcTransport"]
