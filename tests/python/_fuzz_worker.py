"""The child process of test_fuzz: runs a batch of generated calls of moe8's public ops and composites.

    python _fuzz_worker.py SEED N DEVICE [FIRST]

Case i (FIRST <= i < FIRST + N) is drawn from random.Random(f"{SEED}:{i}"): one op, a shape (0, 1, odd,
large-but-cheap), a dtype, maybe a non-contiguous view, NaN, and at most one fault (an index out of range, a
wrong dtype, a mismatched size). A case passes when the call returns the reference's result (moe8.reference
or plain PyTorch), or raises ValueError / TypeError whose message names the argument the fault was put in.
Before each case the worker prints "start <i> <op> <fault>" (flushed), so that the parent can name the case a
crash killed, and after it "end <i> <op> <how>" (how: result, error, unchecked or failed: judge says which);
a failed case prints "FAIL ..." and the worker exits 1 at the end; 0 when every case passed."""

from __future__ import annotations

import random
import re
import sys
import traceback

import torch
import torch.nn.functional as F
from _fuzz_common import (  # noqa: F401 - Case, OK: for the tests
    OK,
    Case,
    bad_float,
    compare,
    pick,
    randn,
    size,
)
from _fuzz_fp8 import fp8_case, fp8_cols_case, fp8_gemm_case, fp8_rows_case, routed_act_case
from _fuzz_views import other_device, views_case

import moe8
from moe8 import ops
from moe8 import reference as ref
from moe8.experts import ExpertLoRA
from moe8.loss import chunked_cross_entropy


# ---------------------------------------------------------------------------------------------- cases
def experts_case(rng, dev):
    T, H, I, E = size(rng), pick(rng, 1, 3, 8, 16), pick(rng, 1, 2, 5, 8), pick(rng, 1, 2, 3, 8, 512)
    K = min(E, pick(rng, 1, 2, 4))
    dt = pick(rng, torch.float32, torch.float32, torch.bfloat16, torch.float16)
    layout = pick(rng, "nk", "kn")
    act = pick(rng, "swiglu", "swiglu_clamped", "silu")
    n_up = 2 * I if act != "silu" else I
    gu_shape, dn_shape = ((E, n_up, H), (E, H, I)) if layout == "nk" else ((E, H, n_up), (E, I, H))
    x = randn(rng, (T, H), dt, dev, noncontig=rng.random() < 0.2, nan=rng.random() < 0.1)
    gu, dn = randn(rng, gu_shape, dt, dev), randn(rng, dn_shape, dt, dev)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    ids = ids.to(pick(rng, torch.int32, torch.int64)).to(dev)
    w = torch.rand(T, K, generator=g).to(pick(rng, torch.float32, dt)).to(dev)
    kw = dict(layout=layout, activation=act, check_ids=pick(rng, True, False))
    lora = None
    if rng.random() < 0.2 and T:
        r = pick(rng, 1, 4)
        A_up, B_up = ((E, r, H), (E, n_up, r)) if layout == "nk" else ((E, H, r), (E, r, n_up))
        A_dn, B_dn = ((E, r, I), (E, H, r)) if layout == "nk" else ((E, I, r), (E, r, H))
        lora = ExpertLoRA(*(randn(rng, s, dt, dev) for s in (A_up, B_up, A_dn, B_dn)), scaling=0.5)
        kw["lora"] = lora
    fault, names, either = (
        pick(
            rng,
            OK,
            OK,
            OK,
            "ids_out_of_range",
            "ids_huge",
            "ids_float",
            "ids_shape",
            "weights_int",
            "weights_shape",
            "x_dtype",
            "x_1d",
            "down_experts",
            "down_hidden",
            "gate_up_hidden",
            "gate_up_dtype",
            "lora_rank",
        ),
        (),
        False,
    )
    T_ok = T > 0
    if fault == "ids_out_of_range" and T_ok:
        ids = ids.clone()
        ids.view(-1)[rng.randrange(ids.numel())] = pick(rng, E, -1, E + 7)
        names, either = ("ids",), dev != "cpu" and not kw["check_ids"]
    elif fault == "ids_huge" and T_ok:
        ids = ids.long()
        ids.view(-1)[0] += 2**32
        names, either = ("ids",), dev != "cpu" and not kw["check_ids"]
    elif fault == "ids_float":
        ids, names = ids.float(), ("ids",)
    elif fault == "ids_shape":
        ids, names = ids[:, :0] if T_ok else ids.view(-1), ("ids",)
        w = w[:, :0] if T_ok else w
    elif fault == "weights_int":
        w, names = w.to(torch.int32), ("weights",)
    elif fault == "weights_shape":
        w, names = torch.ones(T, K + 1, device=dev), ("weights",)
    elif fault == "x_dtype":
        x, names = (
            x.to(bad_float(rng) if rng.random() < 0.5 else pick(rng, torch.float16, torch.bfloat16)),
            ("x",),
        )
        if x.dtype == dt:
            x, names = x.double(), ("x",)
    elif fault == "x_1d":
        x, names = x.reshape(-1), ("x",)
    elif fault == "down_experts":
        dn, names = randn(rng, (E + 1, *dn_shape[1:]), dt, dev), ("down",)
    elif fault == "down_hidden":
        dn, names = randn(rng, tuple(s + 1 for s in dn_shape), dt, dev), ("down",)
    elif fault == "gate_up_hidden":
        gu_bad = list(gu_shape)
        gu_bad[2 if layout == "nk" else 1] += 1
        gu, names = randn(rng, gu_bad, dt, dev), ("gate_up",)
    elif fault == "gate_up_dtype":
        gu = gu.to(torch.float64 if dt != torch.float32 else torch.bfloat16)
        names = ("gate_up", "x")
    elif fault == "lora_rank" and lora is not None:
        kw["lora"] = lora._replace(
            gate_up_A=lora.gate_up_A[:, :0] if layout == "nk" else lora.gate_up_A[..., :0]
        )
        names = ("lora",)
    else:
        fault = OK

    def reference():
        gu_r, dn_r = gu.float(), dn.float()
        if lora is not None:
            s = lora.scaling
            if layout == "nk":
                gu_r = gu_r + s * lora.gate_up_B.float() @ lora.gate_up_A.float()
                dn_r = dn_r + s * lora.down_B.float() @ lora.down_A.float()
            else:
                gu_r = gu_r + s * lora.gate_up_A.float() @ lora.gate_up_B.float()
                dn_r = dn_r + s * lora.down_A.float() @ lora.down_B.float()
        y = ref.experts_forward(x.float().cpu(), ids.cpu(), w.float().cpu(), gu_r.cpu(), dn_r.cpu(), layout=layout,
                                activation=act)  # fmt: skip
        return y.to(x.dtype)

    return Case("experts_forward", fault, lambda: moe8.experts_forward(x, ids, w, gu, dn, **kw), reference, names,
                either, tol=(5e-2, 5e-2) if dt != torch.float32 or lora is not None else None)  # fmt: skip


def moe_case(rng, dev):
    T, H, I, E = size(rng), pick(rng, 4, 8), pick(rng, 2, 4), pick(rng, 2, 4, 6)
    k = pick(rng, 1, 2)
    x, rw = randn(rng, (T, H), torch.float32, dev), randn(rng, (E, H), torch.float32, dev)
    gu, dn = randn(rng, (E, 2 * I, H), torch.float32, dev), randn(rng, (E, H, I), torch.float32, dev)
    fault = pick(rng, OK, OK, "router_rows", "router_hidden", "router_dtype", "k_negative", "k_too_big")
    names = ()
    if fault == "router_rows":
        rw, names = randn(rng, (2 * E, H), torch.float32, dev), ("router_weight",)
    elif fault == "router_hidden":
        rw, names = randn(rng, (E, H + 1), torch.float32, dev), ("router_weight",)
    elif fault == "router_dtype":
        rw, names = rw.double(), ("router_weight",)
    elif fault == "k_negative":
        k, names = pick(rng, -1, 0), ("k",)
    elif fault == "k_too_big":
        k, names = E + 1, ("k",)

    def reference():
        logits = x.cpu() @ rw.cpu().t()
        ids, w = ref.route(logits, k)
        return ref.experts_forward(x.cpu(), ids, w, gu.cpu(), dn.cpu())

    return Case("moe_forward", fault, lambda: moe8.moe_forward(x, rw, gu, dn, k)[0], reference, names)


def route_case(rng, dev):
    T, E = size(rng), pick(rng, 1, 2, 5, 8, 64)
    k = min(E, pick(rng, 1, 2, 4))
    dt, noncontig = pick(rng, torch.float32, torch.bfloat16), rng.random() < 0.2
    logits = randn(rng, (T, E), dt, dev, noncontig=noncontig)
    if dt == torch.bfloat16:  # no ties (a bf16 randn has them, and which tied expert wins is not specified):
        g = torch.Generator().manual_seed(rng.randrange(2**31))  # a row is a permutation of multiples of 1/8
        perm = torch.rand(T, E, generator=g).argsort(1).float()
        logits = randn(rng, (T, E), dt, "cpu", noncontig=noncontig).copy_((perm - E / 2) / 8).to(dev)
    fault = pick(rng, OK, OK, "k", "logits_dtype", "logits_1d", "loss_arg")
    names = ()
    if fault == "k":
        k, names = pick(rng, -3, 0, E + 1), ("k",)
    elif fault == "logits_dtype":
        logits, names = logits.to(bad_float(rng)), ("logits",)
    elif fault == "logits_1d":
        logits, names = logits.reshape(-1), ("logits",)
    elif fault == "loss_arg":
        return Case("z_loss", fault, lambda: moe8.z_loss((logits,)), None, ("r",))

    def call():
        r = moe8.route(logits, k, renormalize=True)
        order = r.ids.long().argsort(dim=1)
        return (
            r.ids.long().gather(1, order),
            r.weights.gather(1, order),
            moe8.z_loss(r),
            moe8.load_balancing_loss(r),
        )

    def reference():
        lg = logits.float().cpu()
        ids, w = ref.route(lg, k, renormalize=True)
        order = ids.argsort(dim=1)
        z = (torch.logsumexp(lg, 1) ** 2).sum() / max(T, 1)  # documented: 0 for 0 tokens
        frac = torch.bincount(ids.view(-1), minlength=E).float() / max(T * k, 1)
        lb = E * (frac * (F.softmax(lg, 1).mean(0) if T else torch.zeros(E))).sum()
        return ids.gather(1, order), w.gather(1, order), z, lb

    return Case("route", fault, call, reference, names, tol=(1e-3, 1e-3))


def offsets_of(rng, E, R):
    cuts = sorted(rng.randrange(R + 1) for _ in range(E - 1))
    end = rng.randrange(R + 1) if rng.random() < 0.3 else R  # rows past the last group: zeros
    cuts = [min(c, end) for c in cuts]
    return torch.tensor([0, *cuts, end], dtype=torch.int32)


def grouped_ref(a, b, off, layout):
    c = torch.zeros(a.shape[0], b.shape[1] if layout == 0 else b.shape[2])
    for e in range(b.shape[0]):
        r0, r1 = int(off[e]), int(off[e + 1])
        w = b[e].float().t() if layout == 0 else b[e].float()
        c[r0:r1] = a[r0:r1].float() @ w
    return c


def grouped_gemm_case(rng, dev):
    R, Kd, N, E = size(rng), pick(rng, 1, 4, 8, 24), pick(rng, 1, 4, 8, 16), pick(rng, 1, 2, 3, 7)
    layout = pick(rng, 0, 1)
    dt = pick(rng, torch.float32, torch.bfloat16)
    a = randn(rng, (R, Kd), dt, dev)
    b = randn(rng, (E, N, Kd) if layout == 0 else (E, Kd, N), dt, dev)
    off = offsets_of(rng, E, R)
    fault = pick(rng, OK, OK, "past_rows", "decreasing", "first", "off_dtype", "off_len", "b_dtype", "b_2d",
                 "a_1d", "layout", "b_inner", "b_device", "offsets_device")  # fmt: skip
    names, either = (), False
    if fault == "past_rows":
        off = off.clone()
        off[-1] = R + pick(rng, 1, 1000)
        names = ("offsets",)
    elif fault == "decreasing" and E >= 2 and R >= 1:
        off = off.clone()
        off[1], off[2] = R, 0
        names = ("offsets",)
    elif fault == "first" and R >= 1:
        off = off.clone()
        off[0] = 1
        off = torch.maximum(off, off[0])
        names = ("offsets",)
    elif fault == "off_dtype":
        off, names = off.long(), ("offsets",)
    elif fault == "off_len":
        off, names = torch.cat([off, off[-1:]]), ("offsets",)
    elif fault == "b_dtype":
        b, names = b.to(torch.float16 if dt != torch.float16 else torch.float32), ("b",)
    elif fault == "b_2d":
        b, names = b[0], ("b",)
    elif fault == "a_1d":
        a, names = a.reshape(-1), ("a",)
    elif fault == "layout":
        layout, names = pick(rng, 2, -1), ("layout",)
    elif fault == "b_inner":
        b, names = randn(rng, (E, N, Kd + 1) if layout == 0 else (E, Kd + 1, N), dt, dev), ("b",)
    elif fault == "b_device":
        b, names = b.to(other_device(dev)), ("b",)
    elif fault != "offsets_device":
        fault = OK
    either = fault in ("past_rows", "decreasing", "first") and dev != "cpu"  # the GPU does not read them
    off = off.to(dev if fault != "offsets_device" else other_device(dev))
    names = ("offsets",) if fault == "offsets_device" else names
    return Case("grouped_gemm", fault, lambda: ops.grouped_gemm(a, b, off, layout, None),
                lambda: grouped_ref(a.cpu(), b.cpu(), off.cpu(), layout).to(dt), names, either)  # fmt: skip


def lowrank_case(rng, dev):
    R, N, r, E = size(rng), pick(rng, 1, 8), pick(rng, 1, 4), pick(rng, 1, 3)
    h, t = randn(rng, (R, N), torch.float32, dev), randn(rng, (R, r), torch.float32, dev)
    b = randn(rng, (E, N, r), torch.float32, dev)
    off = offsets_of(rng, E, R)
    fault, names = pick(rng, OK, "past_rows", "t_rows", "t_device"), ()
    if fault == "past_rows":
        off = off.clone()
        off[-1] = R + 3
        names = ("offsets",)
    elif fault == "t_rows":
        t, names = randn(rng, (R + 1, r), torch.float32, dev), ("t",)
    elif fault == "t_device":
        t, names = t.to(other_device(dev)), ("t",)
    off = off.to(dev)

    def reference():
        out = h.cpu().clone()
        out[: int(off[-1])] += grouped_ref(t.cpu(), b.cpu(), off.cpu(), 0)[: int(off[-1])]
        return out

    return Case("grouped_lowrank_add", fault, lambda: ops.grouped_lowrank_add(h, t, b, off, 0), reference, names,
                either=fault == "past_rows" and dev != "cpu")  # fmt: skip


def rows_case(rng, dev):
    T, H, k = size(rng), pick(rng, 1, 3, 8), pick(rng, 1, 2, 3)
    dt = pick(rng, torch.float32, torch.bfloat16)
    src = randn(rng, (T, H), dt, dev)
    R = T * k + pick(rng, 0, 3)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    perm = torch.randperm(R, generator=g)
    r2s = torch.where(perm < T * k, perm, -1).to(torch.int32)
    s2r = torch.full((T * k,), -1, dtype=torch.int32)
    s2r[r2s[r2s >= 0].long()] = torch.nonzero(r2s >= 0).view(-1).to(torch.int32)
    scale = torch.rand(T * k, generator=g) if rng.random() < 0.5 else None
    rows = randn(rng, (R, H), dt, dev)
    wts = torch.rand(T, k, generator=g) if rng.random() < 0.7 else None
    op = pick(rng, "gather_rows", "combine_rows", "combine_weights_grad", "permute")
    fault = pick(rng, OK, OK, "index_high", "index_low", "index_dtype", "k", "src_dtype", "weights_shape")
    names = ()
    if fault in ("index_high", "index_low") and R and T:
        r2s, s2r = r2s.clone(), s2r.clone()
        bad = pick(rng, T * k + R + 5, 2**31 - 1) if fault == "index_high" else pick(rng, -2, -(2**31))
        (r2s if op == "gather_rows" else s2r).view(-1)[0] = bad
        names = ("row_to_slot",) if op == "gather_rows" else ("slot_to_row",)
        if op == "permute":
            names = ("row_to_slot", "slot_to_row")
    elif fault == "index_dtype":
        r2s, s2r = r2s.long(), s2r.long()
        names = ("row_to_slot", "slot_to_row")
    elif fault == "k" and op in ("gather_rows", "permute"):
        k, names = pick(rng, 0, -1), ("k",)
    elif fault == "src_dtype":
        src, rows, names = src.double(), rows.double(), ("src", "rows", "dy", "x")
    elif fault == "weights_shape" and op == "combine_rows":
        wts, names = torch.rand(T, k + 1), ("weights",)
    else:
        fault = OK
    either = fault in ("index_high", "index_low") and dev != "cpu"
    r2s_d, s2r_d = r2s.to(dev), s2r.to(dev)
    sc = None if scale is None else scale.to(dev)
    wd = None if wts is None else wts.to(dev)

    def gather_ref():
        out = torch.zeros(R, H)
        for r in range(R):
            s = int(r2s[r])
            if s >= 0:
                out[r] = src[s // k].float().cpu() * (1.0 if scale is None else float(scale[s]))
        return out.to(dt)

    def combine_ref():
        out = torch.zeros(T, H)
        for t in range(T):
            for j in range(k):
                r = int(s2r[t * k + j])
                if r >= 0:
                    out[t] += rows[r].float().cpu() * (1.0 if wts is None else float(wts[t, j]))
        return out.to(dt)

    if op == "gather_rows":
        return Case(op, fault, lambda: ops.gather_rows(src, r2s_d, k, sc, None), gather_ref, names, either)
    if op == "permute":
        scale = None
        return Case(op, fault, lambda: ops.permute(src, r2s_d, s2r_d, k), gather_ref, names, either)
    if op == "combine_rows":
        s2 = s2r_d.view(T, k) if s2r_d.dim() == 1 and s2r_d.numel() == T * k else s2r_d
        return Case(op, fault, lambda: ops.combine_rows(rows, s2, wd), combine_ref, names, either)
    dy = randn(rng, (T, H), rows.dtype, dev)

    def wgrad_ref():
        out = torch.zeros(T, k)
        for t in range(T):
            for j in range(k):
                r = int(s2r[t * k + j])
                if r >= 0:
                    out[t, j] = (dy[t].float().cpu() * rows[r].float().cpu()).sum()
        return out

    s2 = s2r_d.view(T, k) if s2r_d.numel() == T * k else s2r_d
    return Case(op, fault, lambda: ops.combine_weights_grad(dy, rows, s2), wgrad_ref, names, either,
                tol=(1e-4, 1e-4) if dt == torch.float32 else (4e-2, 4e-2))  # fmt: skip


def plan_case(rng, dev):
    T, K, E = size(rng), pick(rng, 1, 2, 4), pick(rng, 1, 3, 8, 512)
    pad = pick(rng, 1, 1, 8, 16)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    fault, names, check = (
        pick(rng, OK, OK, "ids_range", "ids_dtype", "experts", "pad"),
        (),
        rng.random() < 0.5,
    )
    if fault == "ids_range" and T:
        ids = ids.clone()
        ids.view(-1)[0] = pick(rng, -1, E, 2**31 - 1)
        names = ("ids",)
    elif fault == "ids_dtype":
        ids, names = ids.long(), ("ids",)
    elif fault == "experts":
        E, names = pick(rng, 0, -2, 513), ("num_experts",)
    elif fault == "pad":
        pad, names = pick(rng, 0, -1), ("pad_multiple",)
    else:
        fault = OK
    ids_d = ids.to(dev)

    def call():
        counts, offsets, r2s, s2r = ops.plan(ids_d, E, pad, check)
        # the plan's rows hold each slot once: gather the ids back through it
        slots = r2s[r2s >= 0].long().cpu()
        back = ids.view(-1)[slots] if slots.numel() else slots
        return counts, offsets[-1:], back.sort().values, s2r.ge(0).sum().view(1)

    def reference():
        counts = torch.bincount(ids.view(-1).long(), minlength=E)
        total = int(((counts + pad - 1) // pad * pad).sum())
        return counts, torch.tensor([total]), ids.view(-1).sort().values, torch.tensor([T * K])

    either = fault == "ids_range" and dev != "cpu" and not check
    return Case("plan", fault, call, reference, names, either)


def activation_case(rng, dev):
    R, I = size(rng), pick(rng, 1, 3, 8)
    act = pick(rng, "swiglu", "swiglu_clamped", "silu", "gelu")
    kind = moe8.ops.ACTIVATIONS[act]
    width = 2 * I if kind in (0, 1) else I
    interleaved = rng.random() < 0.3 and kind in (0, 1)
    h = randn(rng, (R, width), pick(rng, torch.float32, torch.bfloat16), dev, nan=rng.random() < 0.1) * 3
    fault, names = pick(rng, OK, OK, "kind", "odd", "h_dtype", "h_1d"), ()
    if fault == "kind":
        kind, names = pick(rng, 4, -1, 99), ("kind",)
    elif fault == "odd" and kind in (0, 1):
        h, names = randn(rng, (R, width + 1), h.dtype, dev), ("h",)
    elif fault == "h_dtype":
        h, names = h.to(bad_float(rng)), ("h",)
    elif fault == "h_1d":
        h, names = h.reshape(-1), ("h",)
    else:
        fault = OK
    return Case("activation", fault, lambda: ops.activation(h, kind, interleaved, 1.702, 7.0),
                lambda: ref.act(h.float().cpu(), act, interleaved).to(h.dtype), names)  # fmt: skip


def loss_case(rng, dev):
    N, H, V = size(rng), pick(rng, 1, 8), pick(rng, 1, 5, 33)
    hidden, weight = randn(rng, (N, H), torch.float32, dev), randn(rng, (V, H), torch.float32, dev)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    target = torch.randint(0, V, (N,), generator=g)
    chunk = pick(rng, 1, 3, 1024)
    fault, names = pick(rng, OK, OK, "target_float", "target_shape", "weight_hidden", "chunk"), ()
    if fault == "target_float":
        target, names = target.float(), ("target",)
    elif fault == "target_shape":
        target, names = torch.zeros(N + 1, dtype=torch.long), ("target",)
    elif fault == "weight_hidden":
        weight, names = randn(rng, (V, H + 1), torch.float32, dev), ("weight", "hidden")
    elif fault == "chunk":
        chunk, names = pick(rng, 0, -5), ("chunk",)
    target = target.to(dev)
    return Case("chunked_cross_entropy", fault,
                lambda: chunked_cross_entropy(hidden, weight, target, chunk=chunk),
                lambda: F.cross_entropy(hidden.cpu() @ weight.cpu().t(), target.cpu(), reduction="sum"),
                names)  # fmt: skip


GENERATORS = [experts_case, experts_case, moe_case, route_case, grouped_gemm_case, lowrank_case, rows_case,
              rows_case, plan_case, activation_case, loss_case, fp8_case, fp8_rows_case, routed_act_case, fp8_cols_case,
              fp8_gemm_case, views_case]  # fmt: skip


# ------------------------------------------------------------------------------------------------ run
RESULT, ERROR, UNCHECKED, FAILED = "result", "error", "unchecked", "failed"  # how a case ended


def judge(case, dev) -> tuple[str, str]:
    """(how the case ended, '' when it passed, else why not)."""
    try:
        out = case.call()
        if dev != "cpu":
            torch.cuda.synchronize()  # an illegal access shows here, as a RuntimeError
    except (ValueError, TypeError) as e:
        msg = str(e)
        if not case.names:
            return FAILED, f"unexpected {type(e).__name__}: {msg}"
        if not any(re.search(rf"(?<![\w.]){re.escape(n)}\b", msg) for n in case.names):
            return FAILED, f"{type(e).__name__} names none of {case.names}: {msg}"
        return ERROR, ""
    except Exception as e:  # noqa: BLE001 - any other exception is the defect this fuzzer looks for
        return FAILED, f"{type(e).__name__} (not a named ValueError/TypeError): {e}\n{traceback.format_exc()}"
    if case.names and not case.either:
        return FAILED, f"no error for fault {case.fault} (expected one naming {case.names})"
    if case.either:
        return (
            UNCHECKED,
            "",
        )  # unchecked values on a GPU: any result, as long as nothing was read or written outside
    try:
        want = case.reference()
        (case.check or (lambda o, w: compare(o, w, case.tol)))(out, want)
    except AssertionError as e:
        return FAILED, f"result differs from the reference: {e}"
    return RESULT, ""


def run(case, dev) -> str:
    """'' when the case passed, else why not."""
    return judge(case, dev)[1]


def main(argv) -> int:
    seed, n, dev = argv[1], int(argv[2]), argv[3]
    first = int(argv[4]) if len(argv) > 4 else 0
    torch.set_num_threads(1)
    failed = 0
    for i in range(first, first + n):
        rng = random.Random(f"{seed}:{dev}:{i}")
        gen = GENERATORS[rng.randrange(len(GENERATORS))]
        case = gen(rng, dev)
        print(f"start {i} {case.op} {case.fault}", flush=True)
        kind, why = judge(case, dev)
        if why:
            failed += 1
            print(f"FAIL case {i} {case.op} fault={case.fault}: {why}", flush=True)
        print(f"end {i} {case.op} {kind}", flush=True)
    print(f"done {n} cases, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
