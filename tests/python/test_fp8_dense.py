"""FP8 for the dense layers (moe8.fp8_linear): fp8_linear against float64 references for every recipe,
forward and both backward GEMMs, awkward shapes; Float8Linear and convert_to_fp8 (which layers, first / last
kept); torch.compile tracing it whole; the Config fields and the HF front; the shape rules of
moe8.fp8_rules and fp8="auto"; the weight cache's bytes. CPU (moe8's reference kernels); CUDA too where a
GPU is visible (torch._scaled_mm for rowwise / tensorwise there)."""

import pytest
import torch
from conftest import devices

import moe8
from moe8 import fp8, fp8_rules, layer
from moe8.fp8 import Float8Recipe
from moe8.fp8_linear import Float8Linear, convert_to_fp8, fp8_linear, layer_index, module_kind

FP8_TOL = 0.06  # one GEMM of two e4m3 operands: ~3.5% normwise on random data (docs/fp8.md)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


RECIPES = ["blockwise", "rowwise", "tensorwise"]
SHAPES = [(64, 256, 384), (1, 128, 128), (37, 200, 136), (130, 48, 272)]  # M, N, K


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_matches_float64(recipe, shape, device):
    M, N, K = shape
    torch.manual_seed(M + N)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(M, K, device=device, dtype=dt, requires_grad=True)
    w = (torch.randn(N, K, device=device, dtype=dt) * K**-0.5).requires_grad_()
    b = torch.randn(N, device=device, dtype=dt, requires_grad=True)
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    y_ref = xd @ wd.t() + bd
    dy = torch.randn_like(y_ref)
    dx_ref, dw_ref, db_ref = torch.autograd.grad(y_ref, [xd, wd, bd], dy)
    for r, tol_dx, tol_dw in [
        (Float8Recipe(recipe), 1e-5 if device == "cpu" else 1e-2, 1e-5 if device == "cpu" else 1e-2),
        (Float8Recipe(recipe, dgrad="fp8"), FP8_TOL, 1e-5 if device == "cpu" else 1e-2),
        (Float8Recipe(recipe, dgrad="fp8", wgrad="fp8"), FP8_TOL, FP8_TOL),
    ]:
        fp8.default_cache.clear()
        y = fp8_linear(x, w, b, r)
        assert y.dtype == dt and y.shape == (M, N)
        assert rel(y, y_ref) < FP8_TOL
        dx, dw, db = torch.autograd.grad(y, [x, w, b], dy.to(dt))
        if device == "cuda" and r.wgrad == "fp8" and M % 16:
            tol_dw = 1e-2  # the Hopper FP8 wgrad needs rows in multiples of 16: bf16 there
        assert rel(dx, dx_ref) < tol_dx, (r, "dx")
        assert rel(dw, dw_ref) < tol_dw, (r, "dw")
        assert rel(db, db_ref) < (1e-5 if device == "cpu" else 1e-2)


def test_fp8_linear_without_cache_same_bits_and_3d_input():
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 160), torch.randn(96, 160)
    y = fp8_linear(x, w, None, "blockwise", cache=None)
    assert y.shape == (3, 5, 96)
    assert torch.equal(y, fp8_linear(x.reshape(15, 160), w, None, "blockwise").view(3, 5, 96))
    with pytest.raises(ValueError, match="x, w: expected"):
        fp8_linear(x, torch.randn(96, 128))
    with pytest.raises(ValueError, match="backend: expected one of"):
        fp8_linear(x, w, backend="cublas")


def test_float8_linear_and_auto():
    torch.manual_seed(1)
    m = torch.nn.Linear(256, 512)
    x = torch.randn(4, 256)
    plain = m(x)
    Float8Linear.from_linear(m, "blockwise")
    assert isinstance(m, Float8Linear) and "fp8=blockwise" in repr(m)
    y = m(x)
    assert torch.equal(y, fp8_linear(x, m.weight, m.bias, "blockwise")) and rel(y, plain) < FP8_TOL
    m.fp8_recipe = fp8._recipe("auto")  # 4 rows: FP8 does not pay, the layer runs F.linear
    assert torch.equal(m(x), plain)
    with pytest.raises(TypeError, match="m: expected an nn.Linear"):
        Float8Linear.from_linear(torch.nn.Conv1d(2, 2, 1))


def test_compile_traces_fp8_linear_whole():
    """fullgraph=True: a graph break would raise; forward and gradients equal the eager ones."""
    torch.manual_seed(2)
    m = Float8Linear.from_linear(torch.nn.Linear(192, 160), Float8Recipe("blockwise", dgrad="fp8"))
    x = torch.randn(48, 192, requires_grad=True)
    y = m(x)
    gx, gw = torch.autograd.grad(y.square().sum(), [x, m.weight])
    torch._dynamo.reset()
    f = torch.compile(m, backend="aot_eager", fullgraph=True)
    yc = f(x)
    gxc, gwc = torch.autograd.grad(yc.square().sum(), [x, m.weight])
    assert torch.equal(y, yc) and torch.equal(gx, gxc) and torch.equal(gw, gwc)


@pytest.mark.parametrize(
    "name, kind",
    [
        ("model.layers.0.self_attn.q_proj", "attention"),
        ("model.layers.3.self_attn.o_proj", "attention"),
        ("model.layers.1.mlp.shared_expert.down_proj", "shared_expert"),
        ("model.layers.1.mlp.shared_experts.gate_proj", "shared_expert"),
        ("model.layers.0.mlp.gate_proj", "mlp"),
        ("model.layers.1.mlp.gate", None),  # router
        ("model.layers.1.mlp.shared_expert_gate", None),
        ("model.layers.1.mlp.router", None),
        ("lm_head", None),
        ("model.embed_tokens", None),
    ],
)
def test_module_kind(name, kind):
    assert module_kind(name) == kind


def test_layer_index():
    assert layer_index("model.layers.12.mlp.up_proj") == 12 and layer_index("lm_head") is None


class Toy(torch.nn.Module):
    """Decoder-shaped names: layers.<i>.self_attn.*, .mlp.gate (router), .mlp.shared_expert.*, lm_head."""

    def __init__(self, n=3, h=32):
        super().__init__()
        lin = torch.nn.Linear
        self.layers = torch.nn.ModuleList()
        for _ in range(n):
            blk = torch.nn.Module()
            blk.self_attn = torch.nn.Module()
            blk.self_attn.q_proj, blk.self_attn.o_proj = lin(h, h), lin(h, h)
            blk.mlp = torch.nn.Module()
            blk.mlp.gate = lin(h, 4)
            blk.mlp.shared_expert = torch.nn.Module()
            blk.mlp.shared_expert.up_proj = lin(h, 2 * h)
            self.layers.append(blk)
        self.lm_head = lin(h, 10)


def test_convert_to_fp8_selects_modules():
    toy = Toy()
    done = convert_to_fp8(toy, "rowwise", modules=("attention",), skip_first_last=True)
    assert done == ["layers.1.self_attn.q_proj", "layers.1.self_attn.o_proj"]
    assert type(toy.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert toy.layers[1].self_attn.q_proj.fp8_recipe.name == "rowwise"
    done = convert_to_fp8(toy, "blockwise")  # all kinds; converted ones are left as they are
    assert len(done) == 3 + 2 * 2  # three shared experts, the remaining attention projections
    assert type(toy.lm_head) is torch.nn.Linear and type(toy.layers[0].mlp.gate) is torch.nn.Linear
    assert moe8.fp8_linear.convert_from_fp8(toy) == 9
    assert all(type(m) is not Float8Linear for m in toy.modules())
    with pytest.raises(ValueError, match="modules: expected a non-empty subset"):
        convert_to_fp8(toy, modules=("embeddings",))
    with pytest.raises(ValueError, match="recipe: expected one of"):
        convert_to_fp8(toy, "fp4")


def test_config_fp8_dense_fields():
    c = moe8.Config(fp8="blockwise", fp8_dense=True)
    assert c.fp8_dense == ("attention", "shared_expert", "mlp")
    assert moe8.Config(fp8="auto", fp8_dense="attention").fp8_dense == ("attention",)
    assert moe8.Config().fp8_dense == ()
    with pytest.raises(ValueError, match="fp8_dense: .* needs an FP8 recipe"):
        moe8.Config(fp8_dense=True)
    with pytest.raises(ValueError, match="fp8_dense: expected True, False or a non-empty subset"):
        moe8.Config(fp8="blockwise", fp8_dense=("router",))
    with pytest.raises(ValueError, match="fp8_dense_skip_first_last: expected True or False"):
        moe8.Config(fp8="blockwise", fp8_dense=True, fp8_dense_skip_first_last=1)


def test_enable_fp8_dense_on_hf_model():
    pytest.importorskip("transformers", minversion="5.0", reason="the HF front needs transformers>=5")
    from test_hf import build, tokens
    from test_hf import rel as hf_rel

    from moe8 import hf

    plain = build("qwen3_moe")
    try:
        moe8.enable(fp8="blockwise", fp8_dense=True)
        model = build("qwen3_moe")
    finally:
        hf.disable()
    kinds = {module_kind(n) for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert kinds == {"attention"} or kinds == {"attention", "mlp"}
    assert type(model.lm_head) is torch.nn.Linear
    ids = tokens()
    out, ref = model(input_ids=ids, labels=ids), plain(input_ids=ids, labels=ids)
    assert hf_rel(out.logits, ref.logits) < 0.1
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


# ---------------------------------------------------------------------------------------- shape rules
def test_fp8_pays_table():
    pays = fp8_rules.fp8_pays
    assert pays(4096, 28672, 4096)  # Mixtral gate_up
    assert pays(512, 4096, 7168) and pays(512, 7168, 2048)  # DeepSeek-V3
    assert not pays(1024, 1536, 2048) and not pays(1024, 2048, 768)  # Qwen3-30B-A3B: level
    assert not pays(64, 28672, 4096)  # too few rows
    assert not pays(4096, 28672, 4100)  # K not a multiple of 16
    assert not pays(0, 4096, 4096)


def test_fp8_pays_dense_follows_the_measurement():
    """dense=True: FP8 only where the H200 sweep (bench/results/fp8_dense_h200.json) measured the recipe's
    best backend at least level with bf16; the expert thresholds stay as they are."""
    import json
    from pathlib import Path

    pays = fp8_rules.fp8_pays
    assert pays(16384, 7168, 16384, "rowwise", dense=True)  # DeepSeek-V3 o_proj: 1.08-1.29x
    assert not pays(16384, 4096, 2048, dense=True)  # Qwen3 q_proj: 0.51-0.81x
    assert not pays(4096, 28672, 4096, "tensorwise", dense=True) and pays(4096, 28672, 4096, "tensorwise")
    assert not pays(8192, 7168, 16384, dense=True) and not pays(16384, 7168, 16000, dense=True)
    with pytest.raises(ValueError, match="recipe: expected one of"):
        pays(4096, 4096, 4096, "mxfp8", dense=True)
    path = Path(__file__).resolve().parents[2] / "bench" / "results" / "fp8_dense_h200.json"
    rows = json.loads(path.read_text())["gemms"]
    for r in RECIPES:
        for row in rows:
            best = max(v for k, v in row.items() if k.startswith(r) and k.endswith("_speedup"))
            if pays(row["M"], row["N"], row["K"], r, dense=True):  # conservative: misses a 1.06x, no loss
                assert best >= 1.0, (r, row["name"], best)


def test_dense_backend():
    b = fp8_rules.dense_backend
    assert b("rowwise", "cuda", (9, 0)) == "scaled_mm" and b("tensorwise", "cuda", (8, 9)) == "scaled_mm"
    assert b("blockwise", "cuda", (9, 0)) == "moe8" and b("rowwise", "cpu") == "moe8"
    assert b("rowwise", "cuda", (8, 0)) == "moe8"
    assert (
        b("rowwise", "cuda", (9, 0), 200, 128) == "moe8"
        and b("rowwise", "cuda", (9, 0), 208, 128) == "scaled_mm"
    )


def test_auto_experts_pick_per_gemm(monkeypatch):
    """fp8="auto": shapes below the thresholds run bf16 (bitwise the bf16 experts), above them blockwise
    with FP8 dgrad (bitwise that recipe)."""
    torch.manual_seed(3)
    E, H, I, T = 4, 128, 64, 64
    x, ids, w = torch.randn(T, H), torch.randint(0, E, (T, 2)), torch.rand(T, 2)
    gu, dn = torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1
    auto = layer.experts_forward(x, ids, w, gu, dn, fp8="auto")
    assert torch.equal(auto, layer.experts_forward(x, ids, w, gu, dn))
    monkeypatch.setattr(fp8_rules, "MIN_ROWS", dict(fp8_rules.MIN_ROWS, blockwise=1))
    monkeypatch.setattr(fp8_rules, "MIN_HARMONIC", dict(fp8_rules.MIN_HARMONIC, blockwise=60))  # gate_up only
    fp8.default_cache.clear()
    mixed = layer.experts_forward(x, ids, w, gu, dn, fp8="auto")
    assert not torch.equal(mixed, auto) and rel(mixed, auto) < FP8_TOL
    monkeypatch.setattr(fp8_rules, "MIN_HARMONIC", dict(fp8_rules.MIN_HARMONIC, blockwise=1))
    full = layer.experts_forward(x, ids, w, gu, dn, fp8="auto")
    assert torch.equal(full, layer.experts_forward(x, ids, w, gu, dn, fp8=Float8Recipe("blockwise", "fp8")))
    assert not torch.equal(full, mixed)


# ------------------------------------------------------------------------------------- cache memory
def test_cache_nbytes_and_one_layout():
    w = torch.randn(4, 256, 384, requires_grad=True)
    r = Float8Recipe("blockwise", dgrad="fp8")
    one_copy = 4 * 256 * 384 + 4 * 4 * 2 * 3  # codes + one fp32 scale per 128x128 block
    both = fp8.Fp8WeightCache()
    both.get(w, 0, r)
    assert both.nbytes() == 2 * one_copy and len(both) == 2  # the pair kernel made the dgrad's copy too
    lean = fp8.Fp8WeightCache(keep_transposed=False)
    a = lean.get(w, 0, r)
    t = lean.get(w, 1, r)  # derived from the held copy, not kept
    assert lean.nbytes() == one_copy and len(lean) == 1
    assert torch.equal(t.q, a.q.transpose(1, 2)) and torch.equal(t.scale, a.scale.transpose(1, 2))
    assert torch.equal(t.q, fp8.quantize_weight(w, 1, r).q)  # the same blocks: the same codes
    lean.clear()
    assert lean.nbytes() == 0


def test_frozen_weights_survive_optimizer_steps():
    """A weight that doesn't require grad keeps its copy across optimizer steps; a trained one is refreshed."""
    frozen, trained = torch.randn(2, 128, 128), torch.randn(2, 128, 128, requires_grad=True)
    cache, r = fp8.Fp8WeightCache(), Float8Recipe()
    a, b = cache.get(frozen, 0, r), cache.get(trained, 0, r)
    opt = torch.optim.SGD([trained], lr=0.0)
    trained.grad = torch.zeros_like(trained)
    opt.step()
    assert cache.get(frozen, 0, r) is a and cache.get(trained, 0, r) is not b
    with torch.no_grad():
        frozen.mul_(2)  # in place: the version counter moves
    assert cache.get(frozen, 0, r) is not a


@pytest.mark.parametrize("device", devices())
def test_fp8_cache_policies_same_bits_less_memory(device):
    """Config.fp8_cache "frozen" / "both" / "one" / "none" / "handoff": the same outputs and gradients bit for
    bit; "one" holds half of "both"'s bytes (one layout per weight), "none" nothing between calls, "frozen" (the
    default) nothing of weights that train and both layouts of frozen ones, "handoff" the dgrad's copies from
    the forward to the backward only."""
    torch.manual_seed(4)
    E, H, I, T = 4, 256, 128, 96
    x = torch.randn(T, H, device=device, requires_grad=True)
    ids, w = torch.randint(0, E, (T, 2), device=device), torch.rand(T, 2, device=device)
    gu = (torch.randn(E, 2 * I, H, device=device) * 0.1).requires_grad_()
    dn = (torch.randn(E, H, I, device=device) * 0.1).requires_grad_()
    r = Float8Recipe("blockwise", dgrad="fp8")
    results, held = [], {}
    caches = (fp8.default_cache, fp8.one_layout_cache, fp8.frozen_only_cache, fp8.hand_off_cache)
    between = {}  # bytes held from the forward to the backward

    def run(name, weights_train=True):
        for c in caches:
            c.clear()
        cfg = moe8.Config(fp8=r, fp8_cache=name)
        a, b = (gu, dn) if weights_train else (gu.detach(), dn.detach())
        y = layer.experts_forward(x, ids, w, a, b, config=cfg)
        between[name] = sum(c.nbytes() for c in caches)
        grads = torch.autograd.grad(y.square().sum(), [x, a, b] if weights_train else [x])
        return (y, *grads), sum(c.nbytes() for c in caches)

    assert moe8.Config().fp8_cache == "frozen"
    for name in fp8.CACHES:
        out, held[name] = run(name)
        results.append(out)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    one_copy = sum(t.numel() for t in (gu, dn)) + 4 * 4 * (2 * 2 + 2 * 1)
    assert held == {"frozen": 0, "both": 2 * one_copy, "one": one_copy, "none": 0, "handoff": 0}
    assert between["handoff"] == one_copy and between["frozen"] == 0  # the dgrad's copies, taken by it
    frozen_out, frozen_held = run("frozen", weights_train=False)  # frozen weights: both layouts cached
    assert frozen_held == 2 * one_copy
    assert torch.equal(frozen_out[0], results[0][0]) and torch.equal(frozen_out[1], results[0][1])
    with pytest.raises(ValueError, match="fp8_cache: expected one of"):
        moe8.Config(fp8="blockwise", fp8_cache="all")


@pytest.mark.parametrize("device", devices())
def test_fp8_cache_handoff_quantises_each_trained_weight_once(device, monkeypatch):
    """fp8_cache="handoff": one pass over each expert weight per forward and backward with an FP8 dgrad (both
    layouts from quantize_weight_128x128_pair), against two for "frozen" (the forward's layout, then the
    dgrad's); a forward without grad, or with a bf16 dgrad, quantises one layout and hands nothing over."""
    torch.manual_seed(6)
    E, H, I, T = 4, 256, 128, 64
    x = torch.randn(T, H, device=device, requires_grad=True)
    ids, w = torch.randint(0, E, (T, 2), device=device), torch.rand(T, 2, device=device)
    gu = (torch.randn(E, 2 * I, H, device=device) * 0.1).requires_grad_()
    dn = (torch.randn(E, H, I, device=device) * 0.1).requires_grad_()
    calls = []
    for name in ("quantize_weight_128x128", "quantize_weight_128x128_pair", "quantize_weight_128x128_t"):
        op = getattr(fp8, name)
        monkeypatch.setattr(fp8, name, lambda *a, op=op, name=name: calls.append(name) or op(*a))

    def passes(cache, dgrad="fp8", grad=True):
        calls.clear()
        cfg = moe8.Config(fp8=Float8Recipe("blockwise", dgrad=dgrad), fp8_cache=cache)
        with torch.set_grad_enabled(grad):
            y = layer.experts_forward(x, ids, w, gu, dn, config=cfg)
        if grad:
            torch.autograd.grad(y.square().sum(), [x, gu, dn])
        assert fp8.hand_off_cache.nbytes() == 0
        return sorted(calls)

    pair, fwd, t = "quantize_weight_128x128_pair", "quantize_weight_128x128", "quantize_weight_128x128_t"
    assert passes("handoff") == [pair, pair]
    assert passes("frozen") == sorted([fwd, fwd, t, t])
    assert passes("handoff", grad=False) == [fwd, fwd]
    assert passes("handoff", dgrad="bf16") == [fwd, fwd]


# ------------------------------------------------------------------------------- per-call cost of fp8_linear
WEIGHT_QUANT = ("quantize_weight_128x128", "quantize_rowwise", "quantize_tensorwise")
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::tolist")


@pytest.fixture
def weight_quantisations(monkeypatch):
    """Counts the core's quantisations of a weight (a 3-d input [1, N, K] or [1, K, N]) as calls happen."""
    from moe8._core import C

    counts = []
    for name in WEIGHT_QUANT:
        fn = getattr(C, name)

        def counting(*args, fn=fn, name=name):
            if args[0].dim() == 3:
                counts.append(name)
            return fn(*args)

        monkeypatch.setattr(C, name, counting)
    return counts


def _linear_step(x, w, dy, recipe, cache, backend):
    x.grad = w.grad = None
    y = fp8_linear(x, w, None, recipe, cache=cache, backend=backend)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_quantises_the_weight_once_per_version(recipe, device, weight_quantisations):
    """With an unchanged weight, forward + backward (FP8 dgrad) quantise only activations and gradients: the
    forward's and the dgrad's weight copies come from the cache, made once per weight version (blockwise:
    both from one pass; rowwise / tensorwise: one pass per layout); an in-place update makes them again."""
    torch.manual_seed(1)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(48, 256, device=device, dtype=dt, requires_grad=True)
    w = (torch.randn(128, 256, device=device, dtype=dt) * 0.06).requires_grad_()
    dy = torch.randn(48, 128, device=device, dtype=dt)
    r = Float8Recipe(recipe, dgrad="fp8")
    fp8.default_cache.clear()
    first = _linear_step(x, w, dy, r, fp8.default_cache, None)
    per_version = 1 if recipe == "blockwise" else 2
    assert len(weight_quantisations) == per_version, weight_quantisations
    for _ in range(4):
        again = _linear_step(x, w, dy, r, fp8.default_cache, None)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert len(weight_quantisations) == per_version, weight_quantisations
    with torch.no_grad():
        w.mul_(0.5)  # moves the version counter: the copies are stale
    _linear_step(x, w, dy, r, fp8.default_cache, None)
    assert len(weight_quantisations) == 2 * per_version, weight_quantisations
    fp8.default_cache.clear()


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_cache_same_bits_as_quantising_in_the_op(recipe):
    """The copies the forward hands the op (the dgrad's included) give the bits of quantising w inside the op
    (cache None), for both named caches, FP8 dgrad and wgrad, an awkward shape."""
    torch.manual_seed(2)
    x = torch.randn(37, 144, requires_grad=True)
    w = (torch.randn(160, 144) * 0.08).requires_grad_()
    dy = torch.randn(37, 160)
    for r in (Float8Recipe(recipe, dgrad="fp8"), Float8Recipe(recipe, dgrad="fp8", wgrad="fp8")):
        fp8.default_cache.clear(), fp8.one_layout_cache.clear()
        ref = _linear_step(x, w, dy, r, None, "moe8")
        for cache in (fp8.default_cache, fp8.one_layout_cache):
            for _ in range(2):  # the first call makes the copies, the second reads them
                got = _linear_step(x, w, dy, r, cache, "moe8")
                assert all(torch.equal(a, b) for a, b in zip(ref, got)), (r, cache.keep_transposed)
    fp8.default_cache.clear(), fp8.one_layout_cache.clear()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_steady_state_profile(recipe, device):
    """A call once the weight's copies exist: no trip through the dispatcher (moe8's ops run direct), no host sync
    (no .item(), nonzero or device-to-host copy), no copy of the weight (no per-call transpose), a bounded
    number of aten ops."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(3)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(64, 256, device=device, dtype=dt, requires_grad=True)
    w = (torch.randn(384, 256, device=device, dtype=dt) * 0.06).requires_grad_()
    dy = torch.randn(64, 384, device=device, dtype=dt)
    r = Float8Recipe(recipe, dgrad="fp8")
    fp8.default_cache.clear()
    for _ in range(2):
        _linear_step(x, w, dy, r, fp8.default_cache, None)
    steps = 3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            _linear_step(x, w, dy, r, fp8.default_cache, None)
    events = prof.events()
    names = [e.name for e in events]
    host_ops = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU]  # not the kernels
    assert not [n for n in host_ops if n.startswith("moe8::")], "a trip through the dispatcher per call"
    assert not [n for n in names if n in SYNC_OPS], "a host sync per call"
    if device == "cuda":
        # .item() / .cpu() on a GPU: a device-to-host copy and a stream sync (the profiler's own exit syncs the
        # device, cudaDeviceSynchronize, outside the steps)
        assert not [n for n in names if "cudaStreamSynchronize" in n or "DtoH" in n], "a host sync per call"
    weight_sized = [
        e.name
        for e in events
        if e.name in ("aten::clone", "aten::copy_", "aten::contiguous", "aten::_to_copy")
        and e.input_shapes
        and e.input_shapes[0]
        and sorted(e.input_shapes[0][-2:]) == [256, 384]
    ]
    assert not weight_sized, f"a copy of the weight per call: {weight_sized}"
    aten = sum(n.startswith("aten::") for n in names) / steps
    assert aten <= 60, f"{aten} aten ops a call"  # blockwise 28, rowwise 54, tensorwise 46 on the CPU
    fp8.default_cache.clear()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_holds_no_copy_of_a_trainable_weight(recipe, device):
    """Config.fp8_cache "frozen" (the default) and "none": between an fp8_linear's forward and its backward
    nothing of a weight that trains is held in FP8 (the autograd graph saves no uint8 tensor; the FP8 dgrad
    quantises the weight again), and the output and gradients are the bits "both" gives, which holds both;
    "handoff" holds the dgrad's blockwise copy only (made in the forward's pass), as a saved tensor."""
    torch.manual_seed(5)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(32, 256, device=device, dtype=dt, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(384, 256, device=device, dtype=dt) * 0.05)
    dy = torch.randn(32, 384, device=device, dtype=dt)
    r = Float8Recipe(recipe, dgrad="fp8")
    results, saved = {}, {}
    for name in fp8.CACHES:
        for c in (fp8.default_cache, fp8.one_layout_cache, fp8.frozen_only_cache, fp8.hand_off_cache):
            c.clear()
        kept = []

        def pack(t, kept=kept):
            kept.append(t.dtype)
            return t

        x.grad = w.grad = None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = fp8_linear(x, w, None, r, cache=fp8.cache_named(name))
        y.backward(dy)
        results[name], saved[name] = (y.detach(), x.grad, w.grad), kept
    for name in fp8.CACHES:
        assert all(torch.equal(a, b) for a, b in zip(results[name], results["both"])), name
    assert torch.uint8 in saved["both"]
    assert torch.uint8 not in saved["frozen"] and torch.uint8 not in saved["none"]
    assert (torch.uint8 in saved["handoff"]) == (recipe == "blockwise")
    assert fp8.hand_off_cache.nbytes() == 0  # the forward's copy for the dgrad was handed to the op
