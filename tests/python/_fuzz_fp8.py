"""The fuzzer's FP8 and routed-backward cases (tests/python/_fuzz_worker.py runs them): the FP8 expert
layers, the FP8 1x128 row quantisation fused with the permute, and the activation's backward with the
routing weights applied, each with indices out of range among its faults."""

from __future__ import annotations

import torch
from _fuzz_common import OK, Case, pick, randn

import moe8
from moe8 import fp8, fused
from moe8 import reference as ref


def fp8_case(rng, dev):
    T, H, I, E = pick(rng, 0, 1, 7, 33), pick(rng, 16, 128), pick(rng, 16, 64), pick(rng, 1, 4)
    x = randn(rng, (T, H), torch.bfloat16, dev)
    gu, dn = randn(rng, (E, 2 * I, H), torch.bfloat16, dev), randn(rng, (E, H, I), torch.bfloat16, dev)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    ids = torch.randint(0, E, (T, 1), generator=g).to(dev)
    w = torch.rand(T, 1, generator=g).to(dev)
    recipe = pick(rng, "blockwise", "rowwise", "tensorwise")
    fault, names = pick(rng, OK, OK, "ids_range", "x_dtype", "down_experts"), ()
    if fault == "ids_range" and T:
        ids = ids.clone()
        ids[0, 0] = E
        names = ("ids",)
    elif fault == "x_dtype":
        x, names = x.float(), ("x",)
    elif fault == "down_experts":
        dn, names = randn(rng, (E + 1, H, I), torch.bfloat16, dev), ("down",)
    else:
        fault = OK

    def close(out, want):
        assert out.shape == want.shape, f"shape {list(out.shape)}, expected {list(want.shape)}"
        if want.numel():
            rel = float((out.double().cpu() - want.double()).norm() / want.double().norm().clamp_min(1e-12))
            assert rel < 0.3, f"{recipe}: relative error {rel:.3f} against the bf16 reference"

    def reference():
        return ref.experts_forward(x.float().cpu(), ids.cpu(), w.cpu(), gu.float().cpu(), dn.float().cpu())

    return Case(f"experts_forward(fp8={recipe})", fault, lambda: moe8.experts_forward(x, ids, w, gu, dn, fp8=recipe),
                reference, names, check=close)  # fmt: skip


def _plan_maps(rng, T, k, pad):
    """A consistent row_to_slot [T k + pad] and slot_to_row [T k] (a random permutation, -1 on padding)."""
    R = T * k + pad
    perm = torch.randperm(R, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    r2s = torch.where(perm < T * k, perm, -1).to(torch.int32)
    s2r = torch.full((T * k,), -1, dtype=torch.int32)
    s2r[r2s[r2s >= 0].long()] = torch.nonzero(r2s >= 0).view(-1).to(torch.int32)
    return r2s, s2r


def _index_fault(rng, fault, t, n):
    """t with entry 0 past [-1, n) (fault index_high / index_low); t itself when it is empty."""
    if not t.numel():
        return t
    t = t.clone()
    t[0] = pick(rng, n + 5, 2**31 - 1) if fault == "index_high" else pick(rng, -2, -(2**31))
    return t


def fp8_rows_case(rng, dev):
    """The FP8 1x128 row quantisation fused with the permute (row by row, or token-major with slot_to_row)."""
    T, K, k, pad = pick(rng, 0, 1, 7, 33), pick(rng, 1, 16, 130, 256), pick(rng, 1, 2, 3), pick(rng, 0, 3)
    x = randn(rng, (T, K), pick(rng, torch.float32, torch.bfloat16), dev)
    r2s, s2r = _plan_maps(rng, T, k, pad)
    token_major = rng.random() < 0.5
    fault = pick(rng, OK, OK, "index_high", "index_low", "x_dtype")
    names = ()
    if fault in ("index_high", "index_low") and T:
        if token_major and rng.random() < 0.5:
            s2r, names = _index_fault(rng, fault, s2r, T * k + pad), ("slot_to_row",)
        else:
            r2s, names = _index_fault(rng, fault, r2s, T * k), ("row_to_slot",)
    elif fault == "x_dtype":
        x, names = x.double(), ("x",)
    else:
        fault = OK
    if dev != "cpu" and names == ("row_to_slot",) and not token_major:
        names = ()  # unchecked on a GPU: the row-by-row kernel reads the slot as padding, as the reference does
    r2s_d, s2r_d = r2s.to(dev), s2r.to(dev) if token_major else None

    def close(out, want):
        q, sc = out
        assert q.shape == want.shape and sc.shape == (want.shape[0], (K + 127) // 128), "shapes"
        deq = q.cpu().view(torch.float8_e4m3fn).double() * sc.cpu().double().repeat_interleave(128, 1)[:, :K]
        blk = sc.cpu().double().repeat_interleave(128, 1)[:, :K]
        err = (deq - want).abs()  # e4m3: 3 mantissa bits (2^-4 relative), subnormals 2^-9 of the scale apart
        assert bool((err <= want.abs() / 16 + blk / 512 + 1e-30).all()), f"max error {float(err.max()):.3g}"
        pad_rows = (r2s < 0) | (r2s >= T * k)
        assert bool((q.cpu()[pad_rows] == 0).all()) and bool((sc.cpu()[pad_rows] == 1).all()), "padding rows"

    def reference():
        want = torch.zeros(r2s.numel(), K, dtype=torch.float64)
        for r, s in enumerate(r2s.tolist()):
            if 0 <= s < T * k:  # out of range: padding (what the CPU raises on, and a GPU kernel reads as -1)
                want[r] = x[s // k].double().cpu()
        return want

    return Case("quantize_rows_1x128", fault, lambda: fp8.quantize_rows_1x128(x, r2s_d, k, s2r_d), reference,
                names, either=bool(names) and dev != "cpu", check=close)  # fmt: skip


def routed_act_case(rng, dev):
    """The activation's backward with the routing weights applied (the routed down projection's dgrad)."""
    T, k, pad, I = pick(rng, 0, 1, 5, 16), pick(rng, 1, 2), pick(rng, 0, 3), pick(rng, 1, 3, 8)
    act = pick(rng, "swiglu", "silu")
    kind = moe8.ops.ACTIVATIONS[act]
    interleaved = act == "swiglu" and rng.random() < 0.3
    r2s, _ = _plan_maps(rng, T, k, pad)
    R, dt = r2s.numel(), pick(rng, torch.float32, torch.bfloat16)
    h = randn(rng, (R, 2 * I if act == "swiglu" else I), dt, dev)
    dout, w = (
        randn(rng, (R, I), dt, dev),
        torch.rand(T, k, generator=torch.Generator().manual_seed(rng.randrange(99))),
    )
    fault, names = pick(rng, OK, OK, "index_high", "index_low"), ()
    if fault != OK and R:
        r2s, names = _index_fault(rng, fault, r2s, T * k), ("row_to_slot",)
        names = names if dev == "cpu" else ()  # unchecked on a GPU: read as padding, as the reference does
    else:
        fault = OK
    r2s_d, w_d = r2s.to(dev), w.to(dev)

    def reference():
        hh = h.double().cpu().requires_grad_()
        a = ref.act(hh, act, interleaved)
        live = (r2s >= 0) & (r2s < T * k)
        wr = torch.cat([w.double().view(-1), torch.zeros(1, dtype=torch.float64)])[
            torch.where(live, r2s, T * k).long()
        ]
        (wr[:, None] * a * dout.double().cpu()).sum().backward()
        dw = torch.zeros(T * k, dtype=torch.float64)
        dw[r2s[live].long()] = (a * dout.double().cpu()).sum(-1)[live].detach()
        return hh.grad.to(dt), dw.view(T, k).float()

    def call():
        return fused.activation_backward_routed(h, dout.clone(), w_d, r2s_d, kind, interleaved, 1.702, 7.0)

    return Case("activation_backward_routed", fault, call, reference, names)


def _offsets(rng, E, R, fault):
    """Offsets [E + 1] of R rows (a random split, maybe ending before R), with the fault's bad value put in."""
    cuts = sorted(rng.randrange(R + 1) for _ in range(E - 1))
    end = rng.randrange(R + 1) if rng.random() < 0.3 else R
    off = torch.tensor([0, *[min(c, end) for c in cuts], end], dtype=torch.int32)
    if fault == "past_rows":
        off[-1] = pick(rng, R + 1, R + 129, 2**31 - 1)
    elif fault == "decreasing" and E >= 2 and R >= 1:
        off[1], off[2] = R, 0
    elif fault == "negative":
        off[pick(rng, 0, E)] = pick(rng, -1, -(2**31))
    elif fault == "off_dtype":
        off = off.long()
    return off


_OFFSET_FAULTS = ("past_rows", "decreasing", "negative")


def _e4m3(rng, shape, dev):
    """Random e4m3 codes (as uint8) and their float64 values."""
    t = randn(rng, shape, torch.float32, "cpu") * 8
    q = t.to(torch.float8_e4m3fn)
    return q.view(torch.uint8).to(dev), q.double()


def _scales(rng, shape, dev):
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    return (torch.rand(*shape, generator=g) + 0.5).to(dev)


def fp8_cols_case(rng, dev):
    """The FP8 1x128 column quantisation of the weight gradient (blocks of 128 rows from each group's start)."""
    R, K, E = pick(rng, 0, 1, 7, 130, 300), pick(rng, 1, 16, 70), pick(rng, 1, 2, 4)
    x = randn(rng, (R, K), pick(rng, torch.float32, torch.bfloat16), dev)
    fault = pick(rng, OK, OK, *_OFFSET_FAULTS, "off_dtype", "x_dtype")
    if fault in ("decreasing",) and (E < 2 or R < 1):
        fault = OK
    off = _offsets(rng, E, R, fault)
    names = ("offsets",) if fault in (*_OFFSET_FAULTS, "off_dtype") else ()
    if fault == "x_dtype":
        x, names = x.double(), ("x",)
    either = fault in _OFFSET_FAULTS and dev != "cpu"  # unchecked on a GPU: group_range keeps it inside
    off_d = off.to(dev)

    def reference():
        return x.double().cpu()

    def close(out, want):
        q_t, sc = (t.cpu() for t in out)
        assert q_t.shape == (K, R) and sc.shape == (fp8.col_scale_blocks(R, E), K), "shapes"
        codes = q_t.view(torch.float8_e4m3fn).double().t()  # [R, K]
        b, used = 0, int(off[-1])
        for e in range(E):
            for r0 in range(int(off[e]), int(off[e + 1]), 128):
                r1 = min(int(off[e + 1]), r0 + 128)
                deq, blk = codes[r0:r1] * sc[b].double(), sc[b].double().expand(r1 - r0, K)
                err = (deq - want[r0:r1]).abs()
                assert bool((err <= want[r0:r1].abs() / 16 + blk / 512 + 1e-30).all()), f"group {e} block {b}"
                b += 1
        assert bool((sc[b:] == 1).all()), "scale rows past the blocks"
        assert bool((q_t[:, used:] == 0).all()), "columns past offsets[E]"

    return Case("quantize_cols_1x128", fault, lambda: fp8.quantize_cols_1x128(x, off_d), reference, names,
                either, check=close)  # fmt: skip


def fp8_gemm_case(rng, dev):
    """The blockwise FP8 grouped GEMM (the Hopper kernel where it applies, the portable one elsewhere)."""
    R, K, N, E = (
        pick(rng, 0, 1, 7, 64, 200),
        pick(rng, 16, 128, 256),
        pick(rng, 16, 128, 136),
        pick(rng, 1, 2, 4),
    )
    a, a64 = _e4m3(rng, (R, K), dev)
    b, b64 = _e4m3(rng, (E, N, K), dev)
    kb, nb = (K + 127) // 128, (N + 127) // 128
    sa, sb = _scales(rng, (R, kb), dev), _scales(rng, (E, nb, kb), dev)
    dtype = pick(rng, torch.bfloat16, torch.float32)
    fault = pick(rng, OK, OK, *_OFFSET_FAULTS, "off_dtype", "a_dtype", "b_scale_shape")
    if fault == "decreasing" and (E < 2 or R < 1):
        fault = OK
    off = _offsets(rng, E, R, fault)
    names = ("offsets",) if fault in (*_OFFSET_FAULTS, "off_dtype") else ()
    if fault == "a_dtype":
        a, names = a.float(), ("a",)
    elif fault == "b_scale_shape":
        sb, names = _scales(rng, (E, nb + 1, kb), dev), ("b_scale",)
    either = fault in _OFFSET_FAULTS and dev != "cpu"
    off_d = off.to(dev)

    def reference():
        xa = a64 * sa.cpu().double().repeat_interleave(128, 1)[:, :K]
        wb = b64 * sb.cpu().double().repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :N, :K]
        c = torch.zeros(R, N, dtype=torch.float64)
        for e in range(E):
            r0, r1 = int(off[e]), int(off[e + 1])
            c[r0:r1] = xa[r0:r1] @ wb[e].t()
        return c

    def close(out, want):
        assert out.shape == want.shape and out.dtype == dtype, f"shape {list(out.shape)} {out.dtype}"
        scale = float(want.abs().max()) if want.numel() else 1.0
        rtol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out.cpu().double(), want, rtol=rtol, atol=rtol * max(scale, 1.0))

    return Case("grouped_gemm_fp8", fault, lambda: fp8.grouped_gemm_fp8(a, sa, b, sb, off_d, dtype), reference,
                names, either, check=close)  # fmt: skip
