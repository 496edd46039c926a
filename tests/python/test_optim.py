"""moe8.optim: the AdamW step (moe8.optim.adamw_step, the CPU reference and the CUDA kernel) against a float64
reference, the kernel's bits against the reference's (fp32 / bf16 / fp16; sizes off every pack and chunk, storage
not 16-byte aligned, more tensors than one launch takes), the optimizer against torch.optim.AdamW (CPU tensors
delegated, CUDA tensors against fused=True, groups torch keeps, state interchange), argument errors, and
transformers' Trainer getting it after moe8.enable() (CUDA cases skip without a GPU)."""

import pytest
import torch
from conftest import devices

import moe8
from moe8.optim import AdamW, adamw_step

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# sizes: none, one, off the 8-element packs, a chunk (16,384) and past it, several chunks
SIZES = [0, 1, 7, 100, 16384, 16391, 3 * 16384 + 5]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
CUDA = torch.cuda.is_available() and moe8.cuda_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="no CUDA build or no GPU")


def state(n, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    p, grad = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2
    m, v = torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-4
    return [t.to(device=device, dtype=dtype) for t in (p, grad, m, v)]


def reference(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay, maximize=False):
    """One AdamW step in float64 (returns p, m, v)."""
    p, g, m, v = (t.double() for t in (p, g, m, v))
    g = -g if maximize else g
    p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = v.sqrt() / (1 - beta2**step) ** 0.5 + eps
    return p - lr / (1 - beta1**step) * m / denom, m, v


def ulps(dtype):
    """A relative tolerance of about two roundings to dtype."""
    return {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 4e-3}[dtype]


def tiny(dtype):
    """An absolute tolerance: two of dtype's smallest steps (float16's subnormals are 6e-8 apart)."""
    return {torch.float32: 1e-9, torch.bfloat16: 1e-9, torch.float16: 1.2e-7}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", devices())
def test_step_matches_float64_reference(device, dtype):
    tensors = [state(n, dtype, device, seed) for seed, n in enumerate(SIZES)]
    for step in (1, 2, 3):
        want = [reference(*t, step, **HYPER) for t in tensors]
        ps, gs, ms, vs = (list(x) for x in zip(*tensors))
        adamw_step(ps, gs, ms, vs, step=step, **HYPER)
        for (p, _, m, v), (wp, wm, wv) in zip(tensors, want):
            for got, ref in ((p, wp), (m, wm), (v, wv)):
                # one rounding to dtype of a float32 result
                torch.testing.assert_close(
                    got.double(), ref.to(dtype).double(), rtol=ulps(dtype), atol=tiny(dtype)
                )


def test_maximize_and_no_decay_cpu():
    p, g, m, v = state(1000, torch.float32, "cpu", 7)
    want = reference(p, g, m, v, 1, lr=1e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0, maximize=True)
    adamw_step(
        [p], [g], [m], [v], lr=1e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0, step=1, maximize=True
    )
    for got, ref in zip((p, m, v), want):
        torch.testing.assert_close(got.double(), ref, rtol=2e-6, atol=1e-9)


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_kernel_gives_the_reference_bits(dtype):
    # 50 tensors (two launches of 48), each size, two of them views whose storage is not 16-byte aligned
    cpu = [state(SIZES[i % len(SIZES)] + i, dtype, "cpu", i) for i in range(50)]
    gpu = [[t.cuda() for t in ts] for ts in cpu]
    for k in (3, 11):  # unaligned: a view one element into a larger buffer
        for ts in (cpu[k], gpu[k]):
            for j, t in enumerate(ts):
                buf = torch.empty(t.numel() + 1, dtype=dtype, device=t.device)
                buf[1:] = t
                ts[j] = buf[1:]
    for step in (1, 2, 3):
        for ts in (cpu, gpu):
            adamw_step(*(list(x) for x in zip(*ts)), step=step, **HYPER)
    torch.cuda.synchronize()
    for a, b in zip(cpu, gpu):
        for x, y in zip(a, b):
            assert torch.equal(x, y.cpu())


def param_set(dtype, device):
    torch.manual_seed(0)
    shapes = [(64, 33), (8, 96, 40), (4099,), (), (3, 1, 7)]
    return [torch.nn.Parameter(torch.randn(s, dtype=dtype, device=device) * 0.1) for s in shapes]


def run(opt_cls, params, steps, grad_seed=1, **kw):
    opt = opt_cls(params, **kw)
    g = torch.Generator().manual_seed(grad_seed)
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(device=p.device, dtype=p.dtype)
        opt.step()
    return opt


def test_optimizer_on_cpu_is_torch_adamw():
    mine, theirs = param_set(torch.float32, "cpu"), param_set(torch.float32, "cpu")
    a = run(AdamW, mine, 3, lr=1e-2, weight_decay=0.1)
    b = run(torch.optim.AdamW, theirs, 3, lr=1e-2, weight_decay=0.1)
    assert isinstance(a, torch.optim.AdamW)
    for x, y in zip(mine, theirs):
        assert torch.equal(x, y)
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    for i in sb:
        assert sorted(sa[i]) == sorted(sb[i]) == ["exp_avg", "exp_avg_sq", "step"]
        assert float(sa[i]["step"]) == float(sb[i]["step"]) == 3.0
        assert torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"])


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_optimizer_against_torch_fused(dtype):
    mine, theirs = param_set(dtype, "cuda"), param_set(dtype, "cuda")
    a = run(AdamW, mine, 5, lr=1e-3, weight_decay=0.01, kernel_min_numel=0)
    run(torch.optim.AdamW, theirs, 5, lr=1e-3, weight_decay=0.01, fused=True)
    for x, y in zip(mine, theirs):
        torch.testing.assert_close(x, y, rtol=ulps(dtype) * 2, atol=1e-6)
    assert all(s["step"].device.type == "cpu" and float(s["step"]) == 5 for s in a.state.values())
    # a state torch's fused step made (its step counts on the GPU) goes on with moe8's
    b = torch.optim.AdamW(theirs, lr=1e-3, weight_decay=0.01, fused=True)
    for p in theirs:
        p.grad = torch.full_like(p, 1e-3)
    b.step()
    c = AdamW(theirs, lr=1e-3, weight_decay=0.01, kernel_min_numel=0)
    c.load_state_dict(b.state_dict())
    c.step()
    assert all(float(s["step"]) == 2 for s in c.state.values())


@cuda_only
def test_cuda_groups_torch_keeps():
    """amsgrad groups, fp32 grads of bf16 params, non-contiguous params and CPU params run on torch's AdamW in
    the same step; the others on moe8's kernel; the results match torch's AdamW for every tensor."""

    def params():
        torch.manual_seed(3)
        fast = torch.nn.Parameter(torch.randn(300, 5, device="cuda"))
        ams = torch.nn.Parameter(torch.randn(77, device="cuda"))
        strided = torch.nn.Parameter(torch.randn(40, 6, device="cuda").t())  # not contiguous
        host = torch.nn.Parameter(torch.randn(50))
        frozen = torch.nn.Parameter(torch.randn(9, device="cuda"))  # never gets a gradient
        return [fast, ams, strided, host, frozen]

    def groups(ps):
        return [{"params": [ps[0], ps[2], ps[3], ps[4]]}, {"params": [ps[1]], "amsgrad": True}]

    mine, theirs = params(), params()
    a, b = AdamW(groups(mine), lr=1e-2, kernel_min_numel=0), torch.optim.AdamW(groups(theirs), lr=1e-2)
    for step in range(3):
        for ps in (mine, theirs):
            g = torch.Generator().manual_seed(step)
            for p in ps[:4]:
                p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(p.device)
        a.step()
        b.step()
    for x, y in zip(mine[:4], theirs[:4]):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
        assert torch.equal(x.grad, y.grad)  # the gradients hidden from torch's step are back
    assert mine[4].grad is None and not a.state[mine[4]]


def test_small_tensors_go_to_torch():
    """Under kernel_min_numel elements a tensor steps on torch's AdamW; the optimizer asks for torch's fused
    implementation when told to (as transformers' Trainer does), and never for AMP's scaled step."""
    from moe8.optim import KERNEL_MIN_NUMEL, _takes

    dev = "cuda" if CUDA else "cpu"
    small = torch.nn.Parameter(torch.randn(1000, device=dev))
    assert not _takes(small, small.detach().clone(), {})
    assert _takes(small, small.detach().clone(), {}, min_numel=1000) == CUDA
    assert KERNEL_MIN_NUMEL == 1 << 20
    opt = AdamW([small], fused=True)
    assert opt.defaults["fused"] and not opt._step_supports_amp_scaling
    with pytest.raises(ValueError, match="kernel_min_numel: expected an integer >= 0, got -1"):
        AdamW([small], kernel_min_numel=-1)


def test_tensor_subclasses_go_to_torch():
    """DTensors (FSDP2, expert parallelism) and other tensor subclasses never reach moe8's kernel."""
    from moe8.optim import _takes

    class Sub(torch.Tensor):
        pass

    dev = "cuda" if CUDA else "cpu"
    p, g = torch.nn.Parameter(torch.randn(8, device=dev)), torch.randn(8, device=dev)
    assert _takes(p, g, {}, min_numel=0) == CUDA
    assert not _takes(p, g.as_subclass(Sub), {}, min_numel=0)
    assert not _takes(torch.randn(8, device=dev).as_subclass(Sub), g, {}, min_numel=0)


def test_errors_name_the_argument():
    p, g, m, v = state(10, torch.float32, "cpu", 0)
    with pytest.raises(ValueError, match="grads, exp_avgs, exp_avg_sqs: expected one tensor per param"):
        adamw_step([p], [], [m], [v], step=1, **HYPER)
    with pytest.raises(ValueError, match=r"exp_avgs\[0\]: expected the shape of params\[0\]"):
        adamw_step([p], [g], [m[:5]], [v], step=1, **HYPER)
    with pytest.raises((ValueError, TypeError), match=r"exp_avg_sqs\[0\]"):
        adamw_step([p], [g], [m], [v.double()], step=1, **HYPER)
    with pytest.raises(ValueError, match=r"beta2: expected a value in \[0, 1\), got 1"):
        adamw_step([p], [g], [m], [v], step=1, **{**HYPER, "beta2": 1.0})
    with pytest.raises(ValueError, match=r"step: expected the step count"):
        adamw_step([p], [g], [m], [v], step=0, **HYPER)
    with pytest.raises(ValueError, match="expected three distinct tensors"):
        adamw_step([p], [g], [p], [v], step=1, **HYPER)


def test_trainer_builds_moe8_adamw_after_enable(tmp_path):
    transformers = pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    def cls_for(optim):
        args = TrainingArguments(output_dir=str(tmp_path), optim=optim, report_to="none", use_cpu=True)
        return Trainer.get_optimizer_cls_and_kwargs(args)[0]

    assert transformers.__version__
    try:
        moe8.enable()
        assert cls_for("adamw_torch_fused") is AdamW
        assert cls_for("adamw_torch") is AdamW
        moe8.disable()
        assert cls_for("adamw_torch_fused") is torch.optim.AdamW
        moe8.enable(fused_adamw=False)
        assert cls_for("adamw_torch") is torch.optim.AdamW
    finally:
        moe8.disable()
