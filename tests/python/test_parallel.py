"""moe8.parallel on CPU: gloo process groups of 2 and 4 processes (torch.multiprocessing spawn, a FileStore)
against one process on the ranks' concatenated batch. Expert parallelism must not change the numbers: expert
outputs and (with the unfused combine) every gradient bitwise. Here: ep_experts_forward, bad ids, E % ep, a
dead peer, the global route loss; transformers models in test_parallel_hf.py (which reuses these workers).

Each group of workers is started once per module and runs one test function at a time; every wait is bounded
(process-group timeout, result timeout, join timeout, then kill)."""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moe8
from moe8.parallel import (
    ep_experts_forward,
    make_transport,
)

PG_TIMEOUT_S = 60
RESULT_TIMEOUT_S = 150
TOL = 1e-6


# ------------------------------------------------------------------------------------------ workers
def _serve(rank, world, store, tasks, results, pg_timeout_s):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    while True:
        msg = tasks.get()
        if msg is None:
            break
        tid, fn, args = pickle.loads(msg)
        try:
            out = ("ok", fn(rank, world, *args))
        except BaseException as e:  # pytest.raises' failures too
            out = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
        results.put(pickle.dumps((tid, rank, out)))  # plain bytes: no shared-memory handles to outlive us
    dist.destroy_process_group()


class Workers:
    """`world` spawned processes in one gloo group, each running the functions sent to it."""

    def __init__(self, world: int, store: str, pg_timeout_s: int = PG_TIMEOUT_S):
        ctx = mp.get_context("spawn")
        self.world, self.tid = world, 0
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_serve, args=(r, world, store, self.tasks[r], self.results, pg_timeout_s))
            for r in range(world)
        ]
        for p in self.procs:
            p.daemon = True
            p.start()

    def run(self, fn, *args, errors=False, ranks=None, timeout=RESULT_TIMEOUT_S):
        """fn(rank, world, *args) on every rank -> its results by rank (ranks: the ranks expected to answer).
        errors=False: a rank that raised fails the test with its traceback; True: ("ok", value) or
        ("error", message, traceback) per rank."""
        self.tid += 1
        msg = pickle.dumps((self.tid, fn, args))
        for t in self.tasks:
            t.put(msg)
        ranks = list(range(self.world)) if ranks is None else ranks
        got = {}
        try:
            while len(got) < len(ranks):
                tid, rank, out = pickle.loads(self.results.get(timeout=timeout))
                if tid == self.tid:
                    got[rank] = out
        except queue.Empty:
            self.close()
            raise TimeoutError(
                f"{fn.__name__}: ranks {sorted(set(ranks) - set(got))} gave no result"
            ) from None
        outs = [got[r] for r in ranks]
        if errors:
            return outs
        failed = [f"rank {r}: {o[2]}" for r, o in zip(ranks, outs) if o[0] != "ok"]
        assert not failed, "\n".join(failed)
        return [o[1] for o in outs]

    def close(self):
        for t in self.tasks:
            try:
                t.put(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=15)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def worker_groups(tmp_path_factory):
    """Yields get(world): a group of `world` processes, started on first use, closed at the end."""
    started = {}

    def get(world):
        if world not in started or not all(p.is_alive() for p in started[world].procs):
            store = str(tmp_path_factory.mktemp(f"store{world}") / "store")
            started[world] = Workers(world, store)
        return started[world]

    yield get
    for w in started.values():
        w.close()


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """workers(world): the module's group of `world` processes."""
    yield from worker_groups(tmp_path_factory)


# ------------------------------------------------------------------------------------------ inputs
E, H, I = 8, 24, 20


def batch(T, K, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.argsort(torch.rand(T, E, generator=g), 1)[:, :K].to(torch.int32)  # distinct top-k experts
    w = torch.rand(T, K, generator=g)
    dy = torch.randn(T, H, generator=g).to(dtype)
    return x, ids, w, dy


def expert_weights(spec, dtype):
    g = torch.Generator().manual_seed(1234)
    kn = spec.get("layout") == "kn"
    gu = torch.randn(*((E, H, 2 * I) if kn else (E, 2 * I, H)), generator=g) * H**-0.5
    dn = torch.randn(*((E, I, H) if kn else (E, H, I)), generator=g) * I**-0.5
    out = dict(gate_up=gu.to(dtype), down=dn.to(dtype))
    if spec.pop("bias", False):
        out.update(
            gate_up_bias=(torch.randn(E, 2 * I, generator=g) * 0.1).to(dtype),
            down_bias=(torch.randn(E, H, generator=g) * 0.1).to(dtype),
        )
    return out


def _run_experts(fn, x, ids, w, dy, params, spec, **kw):
    """y and the gradients of x, weights and every expert tensor for the upstream gradient dy."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    params = {k: v.clone().requires_grad_() for k, v in params.items()}
    gu, dn = params.pop("gate_up"), params.pop("down")
    y = fn(x, ids, w, gu, dn, **params, **spec, **kw)
    y.backward(dy)
    grads = {"x": x.grad, "weights": w.grad, "gate_up": gu.grad, "down": dn.grad}
    grads.update({k: v.grad for k, v in params.items()})
    return y.detach(), grads


def _ep_case(rank, world, Ts, K, dtype, spec, routed):
    """This rank's slice of the experts and its batch; two runs (they must agree bitwise)."""
    spec = dict(spec)
    params = expert_weights(spec, dtype)
    el = E // world
    local = {k: v[rank * el : (rank + 1) * el] for k, v in params.items()}
    x, ids, w, dy = batch(Ts[rank], K, rank, dtype)
    cfg = moe8.Config(routed_down=routed)
    runs = [
        _run_experts(ep_experts_forward, x, ids, w, dy, local, spec, num_experts=E, config=cfg)
        for _ in range(2)
    ]
    (y, grads), (y2, grads2) = runs
    same = torch.equal(y, y2) and all(torch.equal(grads[k], grads2[k]) for k in grads)
    return y, grads, same


EP_CASES = [  # world, tokens per rank, K, dtype, experts spec, Config.routed_down
    (2, (5, 7), 2, torch.float32, dict(layout="nk", activation="swiglu"), False),
    (2, (0, 9), 3, torch.bfloat16, dict(layout="nk", activation="swiglu"), False),
    (
        4,
        (3, 0, 6, 5),
        2,
        torch.float32,
        dict(layout="kn", activation="swiglu_clamped", interleaved=True, bias=True),
        False,
    ),
    (4, (6, 2, 1, 4), 2, torch.float32, dict(layout="nk", activation="swiglu"), True),
    (4, (6, 2, 0, 4), 1, torch.bfloat16, dict(layout="nk", activation="swiglu"), True),
]


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("world, Ts, K, dtype, spec, routed", EP_CASES)
def test_ep_experts_match_single_process(workers, world, Ts, K, dtype, spec, routed):
    """ep_experts_forward on `world` ranks == moe8.experts_forward on the concatenated batch with all experts:
    the outputs bitwise; with the unfused combine (routed_down off) every gradient bitwise too, with the
    fused one (its backward weights the rows after the down projection's dgrad, which EP can't: the weights
    stay at the source) within rounding. Two EP runs agree bitwise. A rank with 0 tokens takes part."""
    out = workers(world).run(_ep_case, Ts, K, dtype, spec, routed)
    spec = dict(spec)
    params = expert_weights(spec, dtype)
    parts = [batch(T, K, r, dtype) for r, T in enumerate(Ts)]
    x, ids, w, dy = (torch.cat(t) for t in zip(*parts))
    y, grads = _run_experts(
        moe8.experts_forward, x, ids, w, dy, params, spec, config=moe8.Config(routed_down=routed)
    )
    assert all(same for *_, same in out), "two EP runs differ"
    y_ep = torch.cat([o[0] for o in out])
    assert y_ep.dtype == y.dtype and torch.equal(y_ep, y)
    token_grads = ("x", "weights")
    for name, g in grads.items():
        g_ep = torch.cat([o[1][name] for o in out])  # tokens: concatenated; experts: the ranks' shards
        assert g_ep.shape == g.shape, name
        if not routed:
            assert torch.equal(g_ep, g), name
        else:
            tol = TOL if dtype == torch.float32 else 2e-2
            assert rel(g_ep, g) < tol, name
            if name not in token_grads:
                assert not torch.equal(g_ep, torch.zeros_like(g_ep)), name


def _chunked_case(rank, world, Ts, K, chunks):
    params = expert_weights({}, torch.float32)
    el = E // world
    local = {k: v[rank * el : (rank + 1) * el] for k, v in params.items()}
    x, ids, w, dy = batch(Ts[rank], K, rank, torch.float32)
    cfg = moe8.Config(routed_down=False, ep_chunks=chunks)
    return _run_experts(ep_experts_forward, x, ids, w, dy, local, {}, num_experts=E, config=cfg)


@pytest.mark.parametrize("world, Ts, chunks", [(2, (7, 9), 2), (4, (5, 0, 1, 6), 3)])
def test_ep_pipelined_chunks_match(workers, world, Ts, chunks):
    """Config.ep_chunks > 1 (the tokens in parts, each part's all_to_all started before the previous part's
    experts run): outputs and the token gradients (x, routing weights) bitwise those of one process on the
    concatenated batch; the expert weight gradients, summed over the parts, within fp32 rounding. A rank
    with fewer tokens than parts (or none) takes part."""
    K = 2
    out = workers(world).run(_chunked_case, Ts, K, chunks)
    params = expert_weights({}, torch.float32)
    x, ids, w, dy = (torch.cat(t) for t in zip(*[batch(T, K, r, torch.float32) for r, T in enumerate(Ts)]))
    y, grads = _run_experts(
        moe8.experts_forward, x, ids, w, dy, params, {}, config=moe8.Config(routed_down=False)
    )
    assert torch.equal(torch.cat([o[0] for o in out]), y)
    for name, g in grads.items():
        got = torch.cat([o[1][name] for o in out])
        if name in ("x", "weights"):
            assert torch.equal(got, g), name
        else:
            assert rel(got, g) < TOL, name


def _tokens_through_fp8(x):
    """What FP8 dispatch delivers for x: each token quantised to e4m3 + 1x128 scales and dequantised."""
    from moe8.parallel.transport import dequantize_rows, quantize_tokens

    return dequantize_rows(*quantize_tokens(x), x.dtype)


def _fp8_case(rank, world, Ts, K, recipe, fp8_dispatch):
    params = expert_weights({}, torch.float32)
    el = E // world
    local = {k: v[rank * el : (rank + 1) * el] for k, v in params.items()}
    x, ids, w, dy = batch(Ts[rank], K, rank, torch.float32)
    cfg = moe8.Config(routed_down=False, fp8=recipe, fp8_dispatch=fp8_dispatch)
    return _run_experts(ep_experts_forward, x, ids, w, dy, local, {}, num_experts=E, config=cfg)


@pytest.mark.parametrize("world, Ts", [(2, (6, 9)), (4, (3, 0, 7, 5))])
def test_ep_fp8_dispatch(workers, world, Ts):
    """With FP8 experts the rows travel as e4m3 + 1x128 scales: the EP outputs and every gradient equal one
    process's on the dequantised tokens (the quantisation's gradient passes straight through) bitwise, and
    differ from the run that sends the rows in full precision (Config.fp8_dispatch=False), which itself
    equals one process on the tokens as they are."""
    K, recipe = 2, "blockwise"
    params = expert_weights({}, torch.float32)
    x, ids, w, dy = (torch.cat(t) for t in zip(*[batch(T, K, r, torch.float32) for r, T in enumerate(Ts)]))
    cfg = moe8.Config(routed_down=False, fp8=recipe)
    for fp8_dispatch in (True, False):
        out = workers(world).run(_fp8_case, Ts, K, recipe, fp8_dispatch)
        xin = _tokens_through_fp8(x) if fp8_dispatch else x
        y, grads = _run_experts(moe8.experts_forward, xin, ids, w, dy, params, {}, config=cfg)
        assert torch.equal(torch.cat([o[0] for o in out]), y), fp8_dispatch
        for name, g in grads.items():
            assert torch.equal(torch.cat([o[1][name] for o in out]), g), (fp8_dispatch, name)
    assert not torch.equal(_tokens_through_fp8(x), x)


def _bad_ids(rank, world, bad):
    x, ids, w, _ = batch(4, 2, rank, torch.float32)
    if rank == world - 1:
        ids[2, 1] = bad
    params = expert_weights({}, torch.float32)
    el = E // world
    try:
        ep_experts_forward(
            x,
            ids,
            w,
            params["gate_up"][rank * el : (rank + 1) * el],
            params["down"][rank * el : (rank + 1) * el],
        )
    except ValueError as e:
        msg = str(e)
    else:
        msg = None
    # the group is still usable afterwards
    x, ids, w, _ = batch(3, 2, rank, torch.float32)
    y = ep_experts_forward(
        x, ids, w, params["gate_up"][rank * el : (rank + 1) * el], params["down"][rank * el : (rank + 1) * el]
    )
    return msg, y.shape


@pytest.mark.parametrize("bad", [E, -1])
def test_bad_expert_id_raises_on_every_rank(workers, bad):
    out = workers(2).run(_bad_ids, bad)
    for msg, shape in out:
        assert msg is not None and "ids: expected expert ids in [0, 8)" in msg and "rank 1: 1" in msg, msg
        assert shape == (3, H)


def _not_divisible(rank, world):
    with pytest.raises(ValueError, match=r"num_experts 6 is not divisible by the expert-parallel size 4"):
        make_transport("nccl", None, 6)
    with pytest.raises(ValueError, match=r"gate_up_local: expected \[2, \.\.\.\]"):
        ep_experts_forward(
            torch.zeros(1, H),
            torch.zeros(1, 1),
            torch.ones(1, 1),
            torch.zeros(3, 4, H),
            torch.zeros(3, H, 2),
            num_experts=E,
        )
    return True


def test_experts_not_divisible(workers):
    assert all(workers(4).run(_not_divisible))


def _dies(rank, world):
    if rank == 1:
        os._exit(3)
    x, ids, w, _ = batch(4, 2, rank, torch.float32)
    params = expert_weights({}, torch.float32)
    ep_experts_forward(x, ids, w, params["gate_up"][:4], params["down"][:4])


def test_dead_peer_raises(tmp_path):
    """A rank that exits mid-step: the other raises TransportError (gloo sees the closed connection, or its
    timeout passes), it does not hang."""
    group = Workers(2, str(tmp_path / "store"), pg_timeout_s=10)
    try:
        out = group.run(_dies, errors=True, ranks=[0], timeout=60)
    finally:
        group.close()
    assert out[0][0] == "error" and out[0][1].startswith("TransportError: moe8.parallel nccl: the counts"), (
        out
    )


STALL_BOUND_S = 20  # the transport's bound on every wait, in the stalled-peer test
LAYER = "model.layers.3.mlp.experts"


def _stalls(rank, world, bound):
    """Rank 1 stays alive but reaches the layer after its peers' bound has passed: each rank's call ends
    with a TransportError naming it and the layer (rank 0: its counts wait; rank 1: the rows its peer never
    sends), within the bound, though the process group's own timeout is 30 minutes."""
    import time

    from moe8.parallel.nccl import NcclTransport
    from moe8.parallel.transport import TransportError

    el = E // world
    t = NcclTransport(dist.group.WORLD, E, timeout_s=bound)
    x, ids, w, _ = batch(4, 2, rank, torch.float32)
    params = expert_weights({}, torch.float32)
    gu, dn = params["gate_up"][rank * el : (rank + 1) * el], params["down"][rank * el : (rank + 1) * el]
    if rank == 1:
        time.sleep(bound + 5)
    start = time.monotonic()
    try:
        ep_experts_forward(x, ids, w, gu, dn, transport=t, layer=LAYER)
        return "returned", "", time.monotonic() - start
    except TransportError as e:
        return "TransportError", str(e), time.monotonic() - start


def test_stalled_peer_ends_the_group_within_the_bound(tmp_path):
    """A peer that stalls (alive, late) does not hold the others for the process group's timeout (30 min,
    gloo's default): every wait of the transport is bounded by its timeout_s (20 s here), so the whole group
    has its TransportErrors, naming the rank and the layer, in under 60 s."""
    import time

    group = Workers(2, str(tmp_path / "store"), pg_timeout_s=1800)
    try:
        group.run(_noop)  # the processes are up and in their group before the clock starts
        start = time.monotonic()
        out = group.run(_stalls, STALL_BOUND_S, timeout=120)
        total = time.monotonic() - start
    finally:
        group.close()
    assert total < 60, (total, out)
    for rank, (kind, msg, elapsed) in enumerate(out):
        assert kind == "TransportError", out
        assert f"on rank {rank} of the expert-parallel group (layer {LAYER})" in msg, msg
        assert f"within {STALL_BOUND_S} s" in msg, msg
        assert STALL_BOUND_S * 0.9 <= elapsed <= STALL_BOUND_S + 15, (rank, elapsed, msg)


def _noop(rank, world):
    dist.barrier()
    return rank


def test_timeout_is_checked():
    from moe8.parallel.nccl import NcclTransport

    for bad in (0, -1.0, "10", None, True):
        with pytest.raises(ValueError, match=r"timeout_s: expected > 0 seconds"):
            NcclTransport.__new__(NcclTransport).__init__(None, 8, timeout_s=bad)


def test_capacity_agreement():
    """The rule every rank of an ipc group applies to the counts it received (capacity flags included): all
    fit, grow to the largest batch, or, with max_tokens fixed, the same ValueError everywhere."""
    from moe8.parallel.transport import agreed_capacity, capacity_flag, raise_bad_ids

    bad = torch.tensor([2], dtype=torch.int32)
    assert capacity_flag(8, 8, None) is None and capacity_flag(8, 8, bad) is bad
    assert capacity_flag(9, 8, bad).tolist() == [-9] and capacity_flag(9, 8, None).tolist() == [-9]
    assert agreed_capacity([0, 3, 0], 8, None, 2) is None
    assert agreed_capacity([0, -20, -12], 8, None, 2) == 20
    with pytest.raises(
        ValueError,
        match=r"x: capacity exceeded: rank 1 sends 20 rows \(10 tokens x k 2\), rank 2 sends 12 rows \(6 tokens "
        r"x k 2\); a region holds 8 rows \(max_tokens 4 x K 2\)",
    ):
        agreed_capacity([0, -20, -12], 8, 4, 2)
    raise_bad_ids([0, -20, 0], 8)  # a capacity flag is not an out-of-range id
    with pytest.raises(ValueError, match=r"out-of-range ids \(rank 2: 1\)"):
        raise_bad_ids([0, -20, 1], 8)


def _agree(rank, world, tokens, max_tokens):
    """Each rank's flag travels to every rank (here through the bounded all_gather the ipc transport uses to
    create its buffers); every rank decides alone, from the same list."""
    from moe8.parallel.transport import agreed_capacity, all_gather_bounded, capacity_flag

    k, capacity = 2, 16
    flag = capacity_flag(tokens[rank] * k, capacity, torch.zeros(1, dtype=torch.int32))
    flags = all_gather_bounded(int(flag), dist.group.WORLD, 30.0, "capacity flags")
    try:
        return "grow", agreed_capacity(flags, capacity, max_tokens, k)
    except ValueError as e:
        return "refused", str(e)


@pytest.mark.parametrize("max_tokens", [None, 8])
def test_capacity_agreement_is_the_same_on_every_rank(workers, max_tokens):
    out = workers(4).run(_agree, [4, 40, 8, 13], max_tokens)
    assert all(o == out[0] for o in out), out
    if max_tokens is None:
        assert out[0] == ("grow", 80)
    else:
        assert (
            out[0][0] == "refused" and "rank 1 sends 80 rows" in out[0][1] and "rank 3 sends 26" in out[0][1]
        )
    out = workers(4).run(_agree, [4, 8, 8, 1], max_tokens)
    assert all(o == ("grow", None) for o in out), out


def _route_loss(rank, world, Ts):
    from moe8.parallel.aux import global_route_loss

    logits = torch.randn(sum(Ts), E, generator=torch.Generator().manual_seed(5))
    mine = logits[sum(Ts[:rank]) : sum(Ts[: rank + 1])].clone().requires_grad_()
    loss = global_route_loss(moe8.route(mine, 2))
    loss.backward()
    return loss.detach(), mine.grad


def test_global_route_loss(workers):
    """moe8.route's load-balancing loss over the group == moe8.load_balancing_loss on the concatenated batch;
    each rank's logits gradient is the world size times its rows of the one-process gradient (every rank
    backpropagates the same loss; a data-parallel mean divides it again)."""
    Ts = (5, 11)
    out = workers(2).run(_route_loss, Ts)
    logits = torch.randn(sum(Ts), E, generator=torch.Generator().manual_seed(5)).requires_grad_()
    loss = moe8.load_balancing_loss(moe8.route(logits, 2))
    loss.backward()
    for o in out:
        assert abs(o[0].item() - loss.item()) < TOL * loss.item()
    assert rel(torch.cat([o[1] for o in out]) / 2, logits.grad) < TOL
    local = moe8.load_balancing_loss(moe8.route(logits[:5].detach(), 2))
    assert abs(local.item() - loss.item()) > 1e-3  # the rank's own loss would differ


def test_auto_transport_is_ipc_within_a_node_on_cuda():
    """transport="auto": ipc when the experts are on CUDA and each ep group fits in a node (torchrun's
    LOCAL_WORLD_SIZE a multiple of ep), nccl otherwise; read from the launch, so every rank agrees."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "from moe8.parallel.hf import auto_transport as a; "
        "print(a(8, 'cuda'), a(4, 'cuda'), a(16, 'cuda'), a(8, 'cpu'), a(8, 'meta'))"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(moe8.__file__).parents[1]))
    for local, want in (("8", "ipc ipc nccl nccl nccl"), (None, "nccl nccl nccl nccl nccl")):
        env.pop("LOCAL_WORLD_SIZE", None)
        if local:
            env["LOCAL_WORLD_SIZE"] = local
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == want.split(), (local, out.stdout)
