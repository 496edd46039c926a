"""moe8.parallel.transport — the interface every expert-parallel transport implements, and the steps all of
them share: the source's plan, the range check of the expert ids, and the weighted sum back at the source.

A transport moves token rows between the ranks of one expert-parallel group of `size` ranks; rank r owns the
experts [r * E_local, (r + 1) * E_local), E_local = num_experts / size.

    rows, local_ids, meta = transport.dispatch(x, ids, weights)   # x [T, H], ids [T, K] global expert ids
    out = experts(rows, local_ids)                                 # on the owner, [R_recv, H]
    back = transport.combine(out, meta)                            # [T * K, H]: each slot's row at its source
    y = weighted_sum(back, meta)                                   # [T, H], fp32 sum over the K slots

FP8 dispatch (`dispatch(..., fp8=True)`, what ep_experts_forward asks for when the experts' GEMMs are FP8 and
Config.fp8_dispatch is on): each token is quantised once at its source to e4m3 codes with 1x128 fp32 scales
(the blockwise recipe's activation format), the codes and scales travel (1 + 4/128 bytes per element instead of
2 in bf16), and the owner dequantises them into rows of x's dtype. The backward (the row gradients' way back)
stays in x's dtype; the quantisation's gradient is the identity (straight-through), as in the FP8 GEMMs.

Placement is deterministic: at the source the rows are in the single-process plan's order (expert, token,
slot), so the rows for each destination are contiguous and ordered by (expert, token, slot); on the owner
they arrive ordered by (source rank, expert, token, slot). The owner's stable plan over its local ids then
gives, within each expert, the order (source rank, token, slot): the order of the single-process plan over
the ranks' concatenated batch, so per-expert sums (weight gradients) run in the same order.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from .. import ops
from ..fp8 import dequantize, quantize_rows_1x128

DEFAULT_TIMEOUT_S = 300.0  # how long a transport's wait for its peers lasts before TransportError


class TransportError(RuntimeError):
    """A collective of a transport failed (a peer exited, or a wait timed out)."""


def check_timeout(timeout_s) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s: expected > 0 seconds, got {timeout_s!r}")
    return float(timeout_s)


def where(layer: str) -> str:
    """' (layer NAME)' for a message, or nothing when the layer has no name."""
    return f" (layer {layer})" if layer else ""


def wait_bounded(work, timeout_s: float, what: str, group, layer: str = "", transport: str = "nccl") -> None:
    """work.wait() for at most timeout_s: a peer that exited or stalls gives TransportError naming this rank,
    the collective and the layer, not a wait of the process group's own timeout (30 min with gloo)."""
    import torch.distributed as dist

    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        rank = dist.get_rank(group)
        raise TransportError(
            f"moe8.parallel {transport}: the {what} failed on rank {rank} of the expert-parallel group"
            f"{where(layer)}: a peer exited or did not reach it within {timeout_s:g} s: {e}"
        ) from e


def on_device(group):
    """The device the process group's collectives take tensors on."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"


def all_gather_bounded(
    obj, group, timeout_s: float, what: str, layer: str = "", transport: str = "nccl"
) -> list:
    """Every rank's picklable obj, as dist.all_gather_object gives, each wait bounded by timeout_s."""
    import torch.distributed as dist

    n, dev = dist.get_world_size(group), on_device(group)
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
    mine = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
    wait_bounded(
        dist.all_gather(sizes, mine, group=group, async_op=True), timeout_s, what, group, layer, transport
    )
    most = max(int(t) for t in sizes)
    parts = [torch.empty(most, dtype=torch.uint8, device=dev) for _ in range(n)]
    padded = torch.zeros(most, dtype=torch.uint8, device=dev)
    padded[: data.numel()] = data
    wait_bounded(
        dist.all_gather(parts, padded, group=group, async_op=True), timeout_s, what, group, layer, transport
    )
    return [pickle.loads(p[: int(s)].cpu().numpy().tobytes()) for p, s in zip(parts, sizes)]


def capacity_flag(slots: int, capacity: int, bad: Optional[Tensor]):
    """What a source sends in the bad-ids place of its counts: the number of out-of-range ids (>= 0), or, when
    its slots do not fit a region (slots > capacity: it then sends no rows), -slots."""
    if slots > capacity:
        return torch.full((1,), -slots, dtype=torch.int32, device=bad.device if bad is not None else "cpu")
    return bad


def agreed_capacity(flags: list, capacity: int, max_tokens: Optional[int], k: int) -> Optional[int]:
    """From every source's flag (capacity_flag; every rank receives the same list): None when every batch fit;
    else the capacity every rank grows its buffers to (the largest slots asked for), or, with a fixed capacity
    (max_tokens given), the ValueError every rank raises at once."""
    asked = {r: -f for r, f in enumerate(flags) if f < 0}
    if not asked:
        return None
    if max_tokens is not None:
        ranks = ", ".join(f"rank {r} sends {n} rows ({n // k} tokens x k {k})" for r, n in asked.items())
        raise ValueError(
            f"x: capacity exceeded: {ranks}; a region holds {capacity} rows (max_tokens {max_tokens} x K {k}); "
            "pass a larger max_tokens to moe8.parallel.parallelize / IpcTransport, or None to grow as needed"
        )
    return max(max(asked.values()), capacity)


@dataclass
class Meta:
    """What combine and the weighted sum need from dispatch (source side and owner side)."""

    weights: Tensor  # [T, K] float32 routing weights, at the source
    slot_to_row: Tensor  # [T, K] int32: slot (t, k) -> row of the source's send order
    row_to_slot: Tensor  # [T * K] int32: the inverse
    send_splits: list  # rows this rank sends to each rank of the group
    recv_splits: list  # rows this rank receives from each rank
    extra: dict = field(default_factory=dict)  # whatever else a transport keeps between its two phases


class Transport:
    """Base class: subclasses implement dispatch and combine; `name` is what parallelize() takes.
    timeout_s: the longest any wait for the peers lasts; past it the call raises TransportError naming the rank
    and the layer (the group is unusable after that: a peer stalled or exited)."""

    name = ""

    def __init__(self, group, num_experts: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        import torch.distributed as dist

        self.timeout_s = check_timeout(timeout_s)
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.size:
            raise ValueError(
                f"num_experts {num_experts} is not divisible by the expert-parallel size {self.size}"
            )
        self.num_experts = int(num_experts)
        self.num_local = self.num_experts // self.size

    def dispatch(
        self,
        x: Tensor,
        ids: Tensor,
        weights: Tensor,
        check_ids: bool = True,
        fp8: bool = False,
        layer: str = "",
    ):
        """x [T, H], ids [T, K] global expert ids, weights [T, K] -> (rows [R_recv, H], local_ids [R_recv]
        int32 in [0, E_local), Meta). Differentiable in x. fp8: the rows travel as e4m3 codes + 1x128 scales
        and arrive dequantised (see the module's docstring). layer: the layer's name, for the messages."""
        raise NotImplementedError

    def combine(self, rows: Tensor, meta: Meta) -> Tensor:
        """rows [R_recv, H] (the experts' outputs, in the order dispatch delivered them) -> [T * K, H] at the
        source, in its send order (meta.slot_to_row indexes it). Differentiable in rows."""
        raise NotImplementedError


def source_plan(ids: Tensor, num_experts: int, check_ids: bool):
    """The single-process plan of the source's slots, and the number of out-of-range ids as a device scalar
    (None when check_ids is False): (counts [E], row_to_slot [T*K], slot_to_row [T*K], bad). Out-of-range ids
    are planned as expert 0 so that the plan stays in bounds; the caller raises once every rank knows."""
    ids = ids.to(torch.int32).contiguous()
    bad: Optional[Tensor] = None
    if check_ids:
        out = (ids < 0) | (ids >= num_experts)
        bad = out.sum(dtype=torch.int32)
        ids = ids.masked_fill(out, 0)
    counts, _, row_to_slot, slot_to_row = ops.plan(ids, num_experts, 1, False)
    return counts, row_to_slot, slot_to_row, bad


def raise_bad_ids(bad_per_rank: list, num_experts: int) -> None:
    """The ValueError every rank raises when some rank's ids were out of range (same message everywhere)."""
    found = {r: n for r, n in enumerate(bad_per_rank) if n > 0}  # < 0: a capacity flag (capacity_flag)
    if found:
        ranks = ", ".join(f"rank {r}: {n}" for r, n in found.items())
        raise ValueError(f"ids: expected expert ids in [0, {num_experts}), found out-of-range ids ({ranks})")


def quantize_tokens(x: Tensor) -> tuple:
    """x [T, H] -> (codes [T, H] uint8 e4m3, scales [T, ceil(H / 128)] float32): the 1x128 activation format."""
    return quantize_rows_1x128(x.detach().contiguous(), None, 1, None)  # all four: the direct call


def dequantize_rows(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """codes [R, H] uint8, scales [R, ceil(H / 128)] -> rows [R, H] in dtype."""
    return dequantize(codes, scales, 1, 128, dtype)


def check_dispatch_args(x: Tensor, ids: Tensor, weights: Tensor) -> None:
    if x.dim() != 2 or ids.dim() != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(
            f"x, ids, weights: expected [T, H], [T, K], [T, K], got {tuple(x.shape)}, {tuple(ids.shape)}, "
            f"{tuple(weights.shape)}"
        )


def weighted_sum(back: Tensor, meta: Meta) -> Tensor:
    """y[t] = sum_k weights[t, k] * back[slot_to_row[t, k]], accumulated in fp32 in slot order (ops.combine,
    the single-process layer's combine): back [T * K, H] -> y [T, H]. Differentiable in back and weights."""
    return ops.combine(back, meta.weights, meta.slot_to_row.view(-1), meta.row_to_slot)
