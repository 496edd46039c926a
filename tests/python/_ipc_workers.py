"""What each process of the ipc transport tests runs (test_parallel_ipc.py spawns them): a gloo process group
on 127.0.0.1 for the handle exchange, every rank on cuda:0 (CUDA IPC across processes of one GPU), one
scenario, and the result put on a queue. Every wait is bounded (group init and barriers by their timeouts,
GPU waits by the transport's timeout_s)."""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist


def run(rank: int, world: int, port: int, scenario: str, kwargs: dict, queue, stack_dump_s=None) -> None:
    """stack_dump_s: after that many seconds, print every thread's stack to stderr and exit (so a process that
    waits forever says where)."""
    if stack_dump_s:
        faulthandler.dump_traceback_later(stack_dump_s, exit=True)
    try:
        os.environ.setdefault("MOE8_EAGER_DIRECT", "1")
        torch.cuda.set_device(0)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        try:
            out = SCENARIOS[scenario](rank, world, **kwargs)
            queue.put((rank, "ok", out))
        finally:
            dist.destroy_process_group()
    except BaseException:  # whatever it is, the parent must hear of it
        queue.put((rank, "fail", traceback.format_exc()))


# ----------------------------------------------------------------------------------------------- inputs
def inputs(world: int, seed: int, sizes, H: int, E: int, K: int, dtype, skew_to: int = -1):
    """Every rank's tokens (the same on every process): x [T_r, H], ids [T_r, K] (distinct experts per token;
    skew_to >= 0 sends every token to that rank's experts when it has K of them), weights [T_r, K]."""
    g = torch.Generator().manual_seed(seed)
    xs, ids, ws = [], [], []
    el = E // world
    for r in range(world):
        T = sizes[r]
        xs.append(torch.randn(T, H, generator=g).to(dtype))
        if skew_to >= 0 and el >= K:
            pick = [skew_to * el + torch.randperm(el, generator=g)[:K] for _ in range(T)]
        else:
            pick = [torch.randperm(E, generator=g)[:K] for _ in range(T)]
        ids.append(torch.stack(pick) if T else torch.empty(0, K, dtype=torch.int64))
        ws.append(torch.rand(T, K, generator=g))
    return xs, ids, ws


def owner_reference(xs, ids, owner: int, el: int, expert_major: bool = False):
    """The rows owner `owner` receives in (source rank, expert, token, slot) order (expert_major: (expert,
    source rank, token, slot)), and their local ids."""
    rows, lids = [], []
    pairs = [(s, e) for s in range(len(xs)) for e in range(el)]
    if expert_major:
        pairs.sort(key=lambda se: (se[1], se[0]))
    for s, e in pairs:
        tj = (ids[s] == owner * el + e).nonzero()  # row-major: (token, slot) ascending
        rows.append(xs[s][tj[:, 0]])
        lids.append(torch.full((tj.shape[0],), e, dtype=torch.int32))
    H = xs[0].shape[1]
    return torch.cat(rows) if rows else torch.empty(0, H), torch.cat(lids)


def local_reference(x, ids, w, scale, E: int):
    """The single-process path on this rank's tokens: plan, permute, row * scale[expert], combine."""
    from moe8 import ops

    K = ids.shape[1]
    counts, _, row_to_slot, slot_to_row = ops.plan(ids.to(torch.int32), E, 1)
    rows = ops.permute(x, row_to_slot, slot_to_row, K)
    expert = ids.reshape(-1).to(torch.int64)[row_to_slot.long()]
    out = rows * scale[expert].to(rows.dtype)[:, None]
    return ops.combine(out, w, slot_to_row, row_to_slot), out


def _grad(t):
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _same(name: str, a, b) -> None:
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
        diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape and a.numel() else "n/a"
        raise AssertionError(
            f"{name}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}, max |diff| {diff}"
        )


# -------------------------------------------------------------------------------------------- scenarios
def roundtrip(
    rank,
    world,
    *,
    E,
    K,
    H,
    dtype,
    rounds,
    seed,
    max_tokens,
    skew_to=-1,
    check=True,
    expert_major=False,
    timeout_s=60.0,
):
    """dispatch -> row * scale[expert] at the owner -> combine -> weighted sum, forward and backward, for
    several rounds of different sizes on one transport: rows, ids, outputs and gradients bitwise equal to
    the single-process reference."""
    from moe8.parallel.ipc import IpcTransport
    from moe8.parallel.transport import weighted_sum

    dtype = getattr(torch, dtype)
    el = E // world
    t = IpcTransport(
        dist.group.WORLD,
        E,
        max_tokens=max_tokens,
        timeout_s=timeout_s,
        check=check,
        expert_major=expert_major,
    )
    scale = torch.linspace(0.5, 2.0, E, device="cuda")
    for i, sizes in enumerate(rounds):
        xs, ids, ws = inputs(world, seed + i, sizes, H, E, K, dtype, skew_to)
        x = xs[rank].cuda().requires_grad_()
        w = ws[rank].cuda().requires_grad_()
        idr = ids[rank].cuda()
        rows, local_ids, meta = t.dispatch(x, idr, w)
        ref_rows, ref_lids = owner_reference(xs, ids, rank, el, expert_major)
        _same(f"round {i}: received rows", rows, ref_rows)
        _same(f"round {i}: local ids", local_ids, ref_lids)
        out = rows * scale[rank * el + local_ids.long()].to(dtype)[:, None]
        back = t.combine(out, meta)
        y = weighted_sum(back, meta)

        x2 = xs[rank].cuda().requires_grad_()
        w2 = ws[rank].cuda().requires_grad_()
        y_ref, out_ref = local_reference(x2, idr, w2, scale, E)
        _same(f"round {i}: combined rows (send order)", back, out_ref)
        _same(f"round {i}: y", y, y_ref)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 100 + i)).to(dtype).cuda()
        (y.float() * dy.float()).sum().backward()
        (y_ref.float() * dy.float()).sum().backward()
        _same(f"round {i}: x.grad", _grad(x), _grad(x2))
        _same(f"round {i}: weights.grad", _grad(w), _grad(w2))
    t.close()
    return t.capacity


def interleaved(rank, world, *, E, K, H, seed):
    """Two dispatches in flight (layer 1, layer 2) before their combines (2 then 1), backward through both:
    each layer's metadata is its own, the buffer's regions are reused safely."""
    from moe8.parallel.ipc import IpcTransport
    from moe8.parallel.transport import weighted_sum

    el = E // world
    t = IpcTransport(dist.group.WORLD, E, max_tokens=64, timeout_s=60.0, check=True)
    scale = torch.linspace(0.5, 2.0, E, device="cuda")
    sizes = [40 + 7 * r for r in range(world)]
    xs1, ids1, ws1 = inputs(world, seed, sizes, H, E, K, torch.float32)
    xs2, ids2, ws2 = inputs(world, seed + 1, sizes[::-1], H, E, K, torch.float32)
    got = []
    for xs, ids, ws in ((xs1, ids1, ws1), (xs2, ids2, ws2)):
        x = xs[rank].cuda().requires_grad_()
        w = ws[rank].cuda()
        got.append((x, w, ids[rank].cuda(), *t.dispatch(x, ids[rank].cuda(), w)))
    ys = [None, None]
    for layer in (1, 0):
        x, w, idr, rows, local_ids, meta = got[layer]
        out = rows * scale[rank * el + local_ids.long()][:, None]
        ys[layer] = weighted_sum(t.combine(out, meta), meta)
    (ys[0].sum() + 2 * ys[1].sum()).backward()
    for layer, (xs, ids, ws) in enumerate(((xs1, ids1, ws1), (xs2, ids2, ws2))):
        x2 = xs[rank].cuda().requires_grad_()
        y_ref, _ = local_reference(x2, ids[rank].cuda(), ws[rank].cuda(), scale, E)
        ((1 + layer) * y_ref.sum()).backward()
        _same(f"layer {layer}: y", ys[layer], y_ref)
        _same(f"layer {layer}: x.grad", got[layer][0].grad, x2.grad)
    t.close()
    return "ok"


def missing_peer(rank, world, *, missing, timeout_s, phase="dispatch"):
    """Rank `missing` stops before `phase`: it creates its buffer but never dispatches ("dispatch"), or
    dispatches but never combines ("combine"). Every other rank raises TransportError naming that peer and
    the phase after about timeout_s: at the dispatch (its device-to-host read of the counts), or, for the
    combine, with check off, at the start of the next call. A call after that raises at once."""
    from moe8 import ops
    from moe8.parallel.ipc import IpcTransport
    from moe8.parallel.transport import TransportError

    E, K, H = 2 * world, 2, 64
    x = torch.randn(16, H, device="cuda").to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(16)]).cuda()
    w = torch.rand(16, K, device="cuda")
    ops.plan(ids.to(torch.int32), E, 1)  # CUDA modules loaded before the clock starts on any rank
    torch.cuda.synchronize()
    t = IpcTransport(dist.group.WORLD, E, max_tokens=16, timeout_s=timeout_s)
    t.buffer(H, torch.bfloat16, torch.device("cuda", 0), 16 * K, K)  # collective: every rank
    result = "absent"
    if phase == "combine":
        rows, _, meta = t.dispatch(x, ids, w)
    if rank != missing:
        start = time.monotonic()
        try:
            if phase == "combine":
                t.combine(rows, meta)  # returns: check is off, nothing waits for the GPU
                t.dispatch(x, ids, w)
            else:
                t.dispatch(x, ids, w)
            raise AssertionError(f"the {phase} returned although a peer never arrived")
        except TransportError as e:
            elapsed = time.monotonic() - start
            msg = str(e)
        want = [f"peer rank {missing}", "timed out", f"{phase} (ready"]
        if not all(s in msg for s in want) or not timeout_s * 0.9 <= elapsed <= timeout_s + 30:
            raise AssertionError(f"after {elapsed:.1f} s: {msg!r}; expected {want} after ~{timeout_s} s")
        start = time.monotonic()
        try:
            t.dispatch(x, ids, w)
            raise AssertionError("a call after the timeout returned")
        except TransportError as e:
            if f"peer rank {missing}" not in str(e) or time.monotonic() - start > 5:
                raise AssertionError(
                    f"the call after: {e!r} after {time.monotonic() - start:.1f} s"
                ) from None
        result = msg
    dist.barrier()  # the absent rank stays alive (its buffer mapped) until the others are done
    t.close()
    return result


def bad_inputs(rank, world):
    """Errors raised before anything moves, identically on every rank (so the group stays in step): the
    capacity, the shapes and the devices; then a valid call still works."""
    from moe8.parallel.ipc import IpcTransport

    E, K, H = 2 * world, 2, 64
    t = IpcTransport(dist.group.WORLD, E, max_tokens=4, timeout_s=60.0, check=True)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(5)]).cuda()
    x = torch.randn(5, H, device="cuda").to(torch.bfloat16)
    w = torch.rand(5, K, device="cuda")
    messages = {}
    for name, call in (
        ("capacity", lambda: t.dispatch(x, ids, w)),
        ("shape", lambda: t.dispatch(x[:4], ids, w)),
        ("device", lambda: t.dispatch(x.cpu(), ids.cpu(), w.cpu())),
        ("ids", lambda: t.dispatch(x[:4], ids[:4] + E, w[:4])),
    ):
        try:
            call()
            raise AssertionError(f"{name}: no error")
        except ValueError as e:
            messages[name] = str(e)
    rows, local_ids, meta = t.dispatch(x[:4], ids[:4], w[:4])
    t.combine(rows, meta)
    t.close()
    return messages


def _stage(rank: int, what: str) -> None:
    print(f"rank {rank}: {what} at {time.monotonic():.1f}", file=sys.stderr, flush=True)


def ep_experts(rank, world, *, E, K, H, inter, seed, backward=True, fp8_dispatch=False, routed_down=False):
    """moe8.parallel.ep_experts_forward over the ipc transport against moe8.experts_forward on the ranks'
    concatenated batch with all the experts. fp32: outputs and gradients within 1e-5. fp8_dispatch: bf16
    tokens, FP8 blockwise experts, the rows travelling as e4m3 + 1x128 scales; the reference runs on the
    dequantised tokens, and the outputs and gradients must be bitwise equal."""
    import moe8
    from moe8.parallel.experts import ep_experts_forward
    from moe8.parallel.ipc import IpcTransport
    from moe8.parallel.transport import dequantize_rows, quantize_tokens

    dtype = torch.bfloat16 if fp8_dispatch else torch.float32
    cfg = moe8.Config(routed_down=routed_down, fp8="blockwise" if fp8_dispatch else None)
    el = E // world
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * inter, H, generator=g) * 0.1).to(dtype).cuda()
    down = (torch.randn(E, H, inter, generator=g) * 0.1).to(dtype).cuda()
    sizes = [17 + 5 * r for r in range(world)]
    xs, ids, ws = inputs(world, seed + 1, sizes, H, E, K, dtype)
    t = IpcTransport(dist.group.WORLD, E, timeout_s=20.0, check=True)
    gu = gate_up[rank * el : (rank + 1) * el].clone().requires_grad_()
    dn = down[rank * el : (rank + 1) * el].clone().requires_grad_()
    x = xs[rank].cuda().requires_grad_()
    _stage(rank, "forward")
    y = ep_experts_forward(x, ids[rank].cuda(), ws[rank].cuda(), gu, dn, transport=t, config=cfg)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 2)).to(dtype).cuda()
    if backward:
        _stage(rank, "backward")
        (y * dy).sum().backward()
    torch.cuda.synchronize()
    _stage(rank, "reference")

    xr = torch.cat(xs).cuda()
    if fp8_dispatch:
        xr = dequantize_rows(*quantize_tokens(xr), dtype)
    xr.requires_grad_()
    gur, dnr = gate_up.clone().requires_grad_(), down.clone().requires_grad_()
    yr = moe8.experts_forward(xr, torch.cat(ids).cuda(), torch.cat(ws).cuda(), gur, dnr, config=cfg)
    dys = [torch.randn((s, H), generator=torch.Generator().manual_seed(seed + 2)).to(dtype) for s in sizes]
    dys[rank] = dy.cpu()
    # every rank's dy is drawn the same way, so the reference loss is the group's total loss
    (yr * torch.cat(dys).cuda()).sum().backward()
    lo = sum(sizes[:rank])
    pairs = [("y", y, yr[lo : lo + sizes[rank]])]
    if backward:
        pairs += [
            ("x.grad", x.grad, xr.grad[lo : lo + sizes[rank]]),
            ("gate_up.grad", gu.grad, gur.grad[rank * el : (rank + 1) * el]),
            ("down.grad", dn.grad, dnr.grad[rank * el : (rank + 1) * el]),
        ]
    for name, a, b in pairs:
        same = torch.equal(a, b) if fp8_dispatch else torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        if not same:
            raise AssertionError(f"{name}: max |diff| {(a.float() - b.float()).abs().max().item()}")
    t.close()
    return "ok"


def oversized(rank, world, *, big_rank):
    """A fixed capacity (max_tokens 8, through make_transport as parallelize passes it) and rank `big_rank`
    dispatching 20 tokens: every rank raises the same ValueError at once (well inside the barriers' timeout),
    none waits for a peer; the next call with small batches works."""
    from moe8 import ops
    from moe8.parallel.experts import make_transport

    E, K, H = 2 * world, 2, 64
    t = make_transport("ipc", dist.group.WORLD, E, timeout_s=5.0, max_tokens=8)
    assert t.max_tokens == 8 and t.timeout_s == 5.0, (t.max_tokens, t.timeout_s)
    T = 20 if rank == big_rank else 4
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).cuda()
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    w = torch.rand(T, K, device="cuda")
    ops.plan(ids.to(torch.int32), E, 1)  # CUDA modules loaded and the buffer made before the clock starts
    t.buffer(H, torch.bfloat16, torch.device("cuda", 0), 8 * K, K)
    torch.cuda.synchronize()
    start = time.monotonic()
    try:
        t.dispatch(x, ids, w)
        raise AssertionError("an oversized batch was dispatched")
    except ValueError as e:
        message, elapsed = str(e), time.monotonic() - start
    if elapsed > 4.0:
        raise AssertionError(f"the refusal took {elapsed:.1f} s: {message}")
    rows, _, meta = t.dispatch(x[:4], ids[:4], w[:4])
    t.combine(rows, meta)
    torch.cuda.synchronize()
    t.close()
    return message


def hf_grows(rank, world):
    """A transformers model under parallelize(transport="ipc") with no max_tokens: the buffers are sized by
    the first batch; a later, larger batch on one rank grows them on every rank, and each rank's logits are
    those of the whole model on its own batch (fp32)."""
    import copy

    import transformers

    from moe8.parallel import experts_modules, parallelize

    cfg = transformers.AutoConfig.for_model(
        "mixtral", vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    full = transformers.AutoModelForCausalLM.from_config(cfg).cuda()
    model = parallelize(copy.deepcopy(full), None, transport="ipc")
    transport = experts_modules(model)[0][1]._moe8_ep["transport"]
    capacities = []
    for step, seq in enumerate((6, 20 if rank == 1 else 6, 5)):
        g = torch.Generator().manual_seed(10 * step + rank)
        ids = torch.randint(3, 128, (2, seq), generator=g).cuda()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        with torch.no_grad():
            want = full(input_ids=ids, labels=ids)
        if not torch.allclose(out.logits, want.logits, rtol=2e-3, atol=2e-3):  # moe8's GEMMs, or TF32
            diff = (out.logits - want.logits).abs().max().item()
            raise AssertionError(f"step {step}: logits differ by {diff}")
        capacities.append(transport.capacity)
    torch.cuda.synchronize()
    transport.close()
    return capacities


SCENARIOS = {
    "oversized": oversized,
    "hf_grows": hf_grows,
    "roundtrip": roundtrip,
    "interleaved": interleaved,
    "missing_peer": missing_peer,
    "bad_inputs": bad_inputs,
    "ep_experts": ep_experts,
}
