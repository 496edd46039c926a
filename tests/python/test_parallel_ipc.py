"""The `ipc` expert-parallel transport (moe8.parallel.ipc) with 2 and 4 processes sharing one GPU: received
rows, combined rows, outputs and gradients bitwise equal to the single-process path, several rounds on one
buffer, two layers in flight, a missing peer's named timeout, errors naming the argument and the sizes;
plus moe8._C.IpcBuffer in one process (validation, FP8 rows with scales). Every process wait is bounded:
group init (60 s), the transport's GPU waits (timeout_s), the join (kill after the deadline)."""

from __future__ import annotations

import importlib
import re
import socket
import time

import pytest
import torch

import moe8
from moe8 import _core, ops

_ext = _core.EXT


def _skip_reason():
    if not torch.cuda.is_available() or not moe8.cuda_available():
        return "the ipc transport needs CUDA: no CUDA build of moe8 or no GPU"
    if not hasattr(_ext, "IpcBuffer"):
        return "moe8._C has no IpcBuffer (rebuild moe8)"
    try:
        importlib.import_module("moe8.parallel.transport")
    except ImportError as e:
        return f"moe8.parallel.transport is not available: {e}"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, scenario: str, deadline_s: float = 240.0, **kwargs) -> list:
    """Runs `scenario` (tests/python/_ipc_workers.py) on `world` spawned processes; returns each rank's
    result; raises with the failing ranks' tracebacks. Processes still alive at the deadline are killed."""
    import _ipc_workers
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_ipc_workers.run,
            args=(r, world, port, scenario, kwargs, queue, deadline_s - 15),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results, failures = {}, {}
    end = time.monotonic() + deadline_s
    try:
        while len(results) + len(failures) < world and time.monotonic() < end:
            try:
                rank, status, out = queue.get(timeout=1.0)
            except Exception:  # queue.Empty: poll for dead processes
                if any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
                    time.sleep(2.0)
                    if queue.empty():
                        break
                continue
            (results if status == "ok" else failures)[rank] = out
    finally:
        for p in procs:
            p.join(timeout=max(1.0, end - time.monotonic()) if not failures else 5.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10.0)
    if failures:
        raise AssertionError("\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(failures.items())))
    missing = [r for r in range(world) if r not in results]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise AssertionError(f"ranks {missing} sent no result within {deadline_s} s (exit codes {codes})")
    return [results[r] for r in range(world)]


# --------------------------------------------------------------------------------- several processes
ROUNDS_2 = [[13, 7], [1, 0], [0, 0], [64, 64], [37, 50]]  # awkward sizes, 0 tokens, the capacity itself


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_roundtrip_2_ranks(dtype):
    _launch(2, "roundtrip", E=8, K=2, H=136, dtype=dtype, rounds=ROUNDS_2, seed=1, max_tokens=64)


def test_roundtrip_4_ranks():
    rounds = [[29, 0, 5, 64], [1, 1, 1, 1], [64, 63, 17, 40]]
    _launch(
        4, "roundtrip", E=16, K=4, H=256, dtype="bfloat16", rounds=rounds, seed=2, max_tokens=64, check=False
    )


def test_roundtrip_4_ranks_one_owner_gets_everything():
    # every token to rank 2's experts: the other owners receive nothing; E_local 1 in a second run
    rounds = [[20, 9, 31, 4]]
    _launch(
        4, "roundtrip", E=16, K=4, H=64, dtype="bfloat16", rounds=rounds, seed=3, max_tokens=32, skew_to=2
    )
    _launch(4, "roundtrip", E=4, K=2, H=72, dtype="float32", rounds=rounds, seed=4, max_tokens=32)


def test_roundtrip_capacity_from_first_call():
    # no max_tokens: the capacity is the group's largest first batch; later batches fit under it
    _launch(
        2,
        "roundtrip",
        E=4,
        K=2,
        H=64,
        dtype="bfloat16",
        rounds=[[30, 12], [30, 30], [5, 2]],
        seed=5,
        max_tokens=None,
    )


def test_roundtrip_capacity_grows_on_every_rank():
    # no max_tokens: a later batch larger than the first grows the buffers on every rank, the results still
    # bitwise the single-process path's; the capacity ends at the largest T x K (rank 1's 64 x 2)
    out = _launch(
        2,
        "roundtrip",
        E=4,
        K=2,
        H=64,
        dtype="bfloat16",
        rounds=[[4, 2], [40, 3], [3, 64], [10, 10], [0, 0]],
        seed=7,
        max_tokens=None,
    )
    assert out == [128, 128], out


@pytest.mark.parametrize("world,big_rank", [(2, 1), (4, 0)])
def test_oversized_batch_refused_on_every_rank(world, big_rank):
    out = _launch(world, "oversized", big_rank=big_rank)
    assert all(m == out[0] for m in out), out
    assert f"capacity exceeded: rank {big_rank} sends 40 rows (20 tokens x k 2)" in out[0], out[0]
    assert "a region holds 16 rows (max_tokens 8 x K 2)" in out[0], out[0]


def test_parallelize_ipc_grows_for_a_larger_batch():
    pytest.importorskip("transformers", minversion="5.0")
    out = _launch(2, "hf_grows")
    for capacities in out:  # 2 x 6 tokens x K 2, then rank 1's 2 x 20 x 2
        assert capacities == [24, 80, 80], out


def test_two_layers_in_flight():
    _launch(2, "interleaved", E=8, K=2, H=128, seed=6)


def test_roundtrip_expert_major():
    # the owner's rows in (expert, source, token, slot) order: each local expert's rows contiguous
    rounds = [[13, 7, 0, 30], [5, 5, 5, 5]]
    _launch(
        4,
        "roundtrip",
        E=8,
        K=2,
        H=64,
        dtype="bfloat16",
        rounds=rounds,
        seed=8,
        max_tokens=32,
        expert_major=True,
    )


@pytest.mark.parametrize("world,missing,phase", [(2, 1, "dispatch"), (4, 3, "dispatch"), (2, 0, "combine")])
def test_missing_peer_times_out_naming_it(world, missing, phase):
    out = _launch(world, "missing_peer", missing=missing, timeout_s=2.0, phase=phase)
    for r, msg in enumerate(out):
        if r != missing:
            assert f"peer rank {missing}" in msg and f"{phase} (ready" in msg, msg


def test_bad_inputs_name_the_argument_and_sizes():
    out = _launch(2, "bad_inputs")
    for messages in out:
        cap = messages["capacity"]
        assert (
            "capacity exceeded" in cap and "10 rows" in cap and "5 tokens x k 2" in cap and "holds 8" in cap
        ), cap
        assert "x, ids, weights" in messages["shape"], messages["shape"]
        assert "CUDA tensors" in messages["device"], messages["device"]
        assert "out-of-range" in messages["ids"], messages["ids"]


@pytest.mark.parametrize(
    "backward, routed_down",
    [(False, False), (True, False), (True, True)],
    ids=["forward", "forward_backward", "forward_backward_routed_down"],
)
def test_ep_experts(backward, routed_down):
    pytest.importorskip("moe8.parallel.experts", reason="moe8.parallel.experts is not available")
    _launch(
        2, "ep_experts", deadline_s=120.0, E=8, K=2, H=64, inter=32, seed=7, backward=backward,
        routed_down=routed_down,
    )  # fmt: skip


def test_ep_experts_fp8_dispatch():
    # bf16 tokens, FP8 blockwise experts: the rows travel as e4m3 codes + 1x128 scales through the buffers
    pytest.importorskip("moe8.parallel.experts", reason="moe8.parallel.experts is not available")
    _launch(2, "ep_experts", deadline_s=120.0, E=8, K=2, H=256, inter=128, seed=8, fp8_dispatch=True)


# ------------------------------------------------------------------------------- one process, the core
def _buffer(world=1, el=4, capacity=32, hidden=64, dtype="bfloat16", scale_cols=0):
    buf = _ext.IpcBuffer(0, world, el, capacity, hidden, dtype, scale_cols, torch.cuda.current_device())
    buf.open([buf.handle()])
    return buf


def _plan(ids, E):
    counts, offsets, row_to_slot, slot_to_row = ops.plan(ids.to(torch.int32), E, 1)
    return counts, offsets, row_to_slot, slot_to_row


def test_buffer_fp8_rows_with_scales_round_trip():
    # one rank: the rows (uint8 codes) and their float32 scales travel together, both directions
    E, K, T, H = 4, 2, 19, 256
    buf = _buffer(el=E, capacity=T * K, hidden=H, dtype="uint8", scale_cols=H // 128)
    dev, s = torch.device("cuda"), torch.cuda.current_stream().cuda_stream
    q = torch.randint(0, 255, (T, H), dtype=torch.uint8, device=dev)
    sc = torch.rand(T, H // 128, device=dev)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(dev)
    counts, offsets, row_to_slot, _ = _plan(ids, E)
    buf.dispatch_send(q, sc, row_to_slot, offsets, counts, None, K, True, 10.0, s, True)
    rc = torch.empty(1, E + 1, dtype=torch.int32, device=dev)
    ro = torch.empty(E + 1, dtype=torch.int32, device=dev)
    rb = torch.empty(E, dtype=torch.int32, device=dev)
    buf.dispatch_plan(rc, ro, rb, False, s)
    R = int(ro[-1])
    assert R == T * K and torch.equal(rc[0, :E], counts)
    rows = torch.full((R, H), 7, dtype=torch.uint8, device=dev)
    rows_sc = torch.full((R, H // 128), -1.0, device=dev)
    lids, ret = (
        torch.full((R,), -1, dtype=torch.int32, device=dev),
        torch.full((R,), -1, dtype=torch.int32, device=dev),
    )
    buf.dispatch_recv(ro, rb, False, rows, rows_sc, lids, ret, s)
    tok = row_to_slot.long() // K
    assert torch.equal(rows, q[tok]) and torch.equal(rows_sc, sc[tok])
    assert torch.equal(lids, ids.reshape(-1)[row_to_slot.long()].to(torch.int32))
    assert torch.equal(ret, torch.arange(R, dtype=torch.int32, device=dev))  # one rank: send row == place
    back, back_sc = torch.zeros_like(rows), torch.zeros_like(rows_sc)
    buf.combine_send(rows.flip(1), rows_sc * 2, ret, 10.0, s, True)
    buf.combine_recv(back, back_sc, s)
    buf.check(True, s)
    assert torch.equal(back, rows.flip(1)) and torch.equal(back_sc, rows_sc * 2)


def test_buffer_arguments_are_validated():
    buf = _buffer(el=4, capacity=8, hidden=64, dtype="bfloat16")
    dev, s = torch.device("cuda"), torch.cuda.current_stream().cuda_stream
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(4)]).to(dev)
    counts, offsets, row_to_slot, _ = _plan(ids, 4)
    x = torch.randn(4, 64, device=dev).to(torch.bfloat16)
    cases = [
        ("src: expected dtype bfloat16", (x.float(), None, row_to_slot, offsets, counts, None, 2)),
        (
            "src: expected shape [4, 64]",
            (
                torch.zeros(4, 72, device=dev, dtype=torch.bfloat16),
                None,
                row_to_slot,
                offsets,
                counts,
                None,
                2,
            ),
        ),
        ("src: expected a tensor on cuda", (x.cpu(), None, row_to_slot, offsets, counts, None, 2)),
        ("offsets: expected shape [5]", (x, None, row_to_slot, offsets[:4], counts, None, 2)),
        ("row_to_slot: expected shape [8]", (x, None, row_to_slot[:7], offsets, counts, None, 2)),
        (
            "src_scale: the buffer carries no scales",
            (x, torch.ones(4, 1, device=dev), row_to_slot, offsets, counts, None, 2),
        ),
        (
            "capacity exceeded: rank 0 sends 12 rows (4 tokens x k 3)",
            (x, None, row_to_slot, offsets, counts, None, 3),
        ),
    ]
    for want, args in cases:
        with pytest.raises(ValueError, match=re.escape(want)):
            buf.dispatch_send(*args, True, 10.0, s)
    with pytest.raises(ValueError, match="timeout_s: expected > 0"):
        buf.dispatch_send(x, None, row_to_slot, offsets, counts, None, 2, True, 0.0, s)
    with pytest.raises(ValueError, match="handles: the peers' buffers are already open"):
        buf.open([buf.handle()])
    with pytest.raises(ValueError, match="hidden: a row of 60 bfloat16 is 120 bytes"):
        _ext.ipc_layout(0, 2, 4, 8, 60, "bfloat16")
    with pytest.raises(ValueError, match="dtype: expected float32"):
        _ext.ipc_layout(0, 2, 4, 8, 64, "int32")
    buf.check(True, s)  # nothing above reached the GPU
