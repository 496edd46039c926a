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
combine is one all_to_all_single with the splits swapped. Both are autograd functions: dispatch's backward
is a combine-direction all_to_all of the row gradients, combine's a dispatch-direction one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .. import ops
from .transport import (
    Meta,
    Transport,
    TransportError,
    check_dispatch_args,
    dequantize_rows,
    quantize_tokens,
    raise_bad_ids,
    source_plan,
)


def _all_to_all(x: Tensor, out_splits: list, in_splits: list, group, what: str) -> Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    try:
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    except RuntimeError as e:
        rank = dist.get_rank(group)
        raise TransportError(
            f"moe8.parallel nccl: the {what} all_to_all failed on rank {rank} of the expert-parallel group "
            f"(a peer exited or did not reach it in time): {e}"
        ) from e
    return out


class _AllToAll(torch.autograd.Function):
    """Rows [sum(in_splits), H] -> [sum(out_splits), H]; the backward sends the gradients the other way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, what):
        ctx.splits, ctx.group, ctx.what = (out_splits, in_splits), group, what
        return _all_to_all(x, out_splits, in_splits, group, what)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return (
            _all_to_all(g, in_splits, out_splits, ctx.group, ctx.what + " backward"),
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
    def forward(ctx, x, row_to_slot, slot_to_row, k, out_splits, in_splits, group):
        codes, scales = quantize_tokens(x)
        token = row_to_slot.long() // k  # [T * K]: the token of each row in plan order
        codes = _all_to_all(codes[token], out_splits, in_splits, group, "dispatch (fp8 codes)")
        scales = _all_to_all(scales[token], out_splits, in_splits, group, "dispatch (fp8 scales)")
        ctx.slot_to_row, ctx.splits, ctx.group = slot_to_row, (out_splits, in_splits), group
        return dequantize_rows(codes, scales, x.dtype)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        back = _all_to_all(g, in_splits, out_splits, ctx.group, "dispatch backward")  # [T * K, H] plan order
        return ops.combine_rows(back, ctx.slot_to_row, None), None, None, None, None, None, None


class NcclTransport(Transport):
    name = "nccl"

    def dispatch(self, x: Tensor, ids: Tensor, weights: Tensor, check_ids: bool = True, fp8: bool = False):
        check_dispatch_args(x, ids, weights)
        k, n, el = ids.shape[1], self.size, self.num_local
        counts, row_to_slot, slot_to_row, bad = source_plan(ids, self.num_experts, check_ids)
        send = torch.zeros(n, el + 1, dtype=torch.int32, device=ids.device)  # [dest, local expert | bad ids]
        send[:, :el] = counts.view(n, el)
        if bad is not None:
            send[:, el] = bad
        recv = _all_to_all(send, [1] * n, [1] * n, self.group, "counts")  # [source, local expert | bad ids]
        host = torch.cat([send.view(-1), recv.view(-1)]).tolist()  # the one device-to-host read
        w = el + 1
        sent = [host[d * w : d * w + el] for d in range(n)]  # rows to each destination, per its local expert
        got = [host[(n + s) * w : (n + s) * w + el] for s in range(n)]  # rows from each source, per my expert
        raise_bad_ids([host[(n + s) * w + el] for s in range(n)], self.num_experts)
        send_splits, recv_splits = [sum(c) for c in sent], [sum(c) for c in got]
        if fp8:
            s2r = slot_to_row.view(ids.shape)
            rows = _Fp8AllToAll.apply(x, row_to_slot, s2r, k, recv_splits, send_splits, self.group)
        else:
            rows = ops.permute(
                x.contiguous(), row_to_slot, slot_to_row, k
            )  # [T * K, H] (expert, token, slot)
            rows = _AllToAll.apply(rows, recv_splits, send_splits, self.group, "dispatch")  # [R_recv, H]
        experts = torch.arange(el, dtype=torch.int32, device=x.device).repeat(n)  # [source, local expert]
        per_row = recv[:, :el].reshape(-1).long()  # on the device: output_size keeps this free of syncs
        local_ids = experts.repeat_interleave(per_row, output_size=sum(recv_splits))
        meta = Meta(
            weights.float().contiguous(), slot_to_row.view(ids.shape), row_to_slot, send_splits, recv_splits
        )
        return rows, local_ids, meta

    def combine(self, rows: Tensor, meta: Meta) -> Tensor:
        return _AllToAll.apply(rows, meta.send_splits, meta.recv_splits, self.group, "combine")
