"""moe8.hf against transformers' own experts implementation: for every supported family a tiny random model is
built twice with the same weights, one runs its experts on moe8; logits, loss (with the aux loss), router
logits and every gradient must agree (fp32, CPU). Also enable/disable, save/load, gradient checkpointing,
unsupported models, a 50-step training curve on real text, torch.compile and PEFT LoRA on the experts.

MOE8_HF_STANDIN=1 runs everything with the pure-PyTorch stand-in (_standin.py) instead of moe8.layer, which
tells an integration bug from a kernel bug."""

import copy
import os
import random

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0", reason="moe8.hf needs transformers>=5")

from conftest import devices  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: E402

import moe8  # noqa: E402, F401
from moe8 import experts, hf, layer  # noqa: E402
from moe8.finetune.data import shared  # noqa: E402

VOCAB = 128
TOL = 1e-5
STANDIN = os.environ.get("MOE8_HF_STANDIN") == "1"
fullgraph = pytest.mark.skipif(STANDIN, reason="the stand-in loops over experts: no fullgraph compile")


FUSIONS = ("fuse_router", "fuse_norm", "fuse_rope", "fuse_loss")  # on by default


def only(*fusions) -> dict:
    """accelerate() / enable() fields that turn on these fusions and no other (the experts alone: none)."""
    return {**{f: f in fusions for f in FUSIONS}, **dict.fromkeys(fusions, True)}  # off-by-default ones too


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def config(family, **over):
    """A tiny random config: hidden 32, 8 experts, top-2, 2-4 layers, vocab 128, eager attention."""
    c = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        initializer_range=0.05,
        output_router_logits=True,
        router_aux_loss_coef=0.05,
        num_experts_per_tok=2,
    )
    if family == "mixtral":
        c.update(intermediate_size=48, num_hidden_layers=2, num_local_experts=8)
    elif family == "qwen2_moe":  # shared expert with a sigmoid gate; decoder_sparse_step 2: layers 0, 2 dense
        c.update(
            intermediate_size=48,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=8,
            num_hidden_layers=4,
            decoder_sparse_step=2,
            mlp_only_layers=[],
            norm_topk_prob=False,
        )
    elif family == "qwen3_moe":  # mlp_only_layers: layer 1 is dense
        c.update(
            intermediate_size=48,
            moe_intermediate_size=24,
            num_experts=8,
            num_hidden_layers=3,
            head_dim=8,
            mlp_only_layers=[1],
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
    elif family == "olmoe":
        c.update(intermediate_size=24, num_experts=8, num_hidden_layers=2)
    elif (
        family == "deepseek_v3"
    ):  # first layer dense; 4 groups of 2 experts, top-2 groups; bias; scaling; shared
        for k in ("output_router_logits", "router_aux_loss_coef"):
            c.pop(k)
        c.update(
            num_key_value_heads=4,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
    elif (
        family == "gpt_oss"
    ):  # transposed interleaved gate_up with biases, clamped SwiGLU, router bias, sinks
        c.update(
            intermediate_size=32,
            num_local_experts=8,
            num_hidden_layers=2,
            head_dim=8,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    c.update(over)
    cfg = transformers.AutoConfig.for_model(family, **c)
    cfg._attn_implementation = "eager"
    return cfg


def build(family, seed=0, **over):
    """A model with transformers' default experts implementation; zero-initialised tensors (expert and router
    biases, DeepSeek's e_score_correction_bias) get random values so that they matter."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(family, **over))
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point() and t.numel() > 1 and not t.any():
                t.normal_(0, 0.05)
    return model


def twin(model, accelerate=True, cfg=None):
    """A second model with the same weights and its own config object (the experts implementation lives there);
    accelerate: its experts on moe8 and no other fusion (the tests of each fusion turn it on by name)."""
    other = AutoModelForCausalLM.from_config(cfg or copy.deepcopy(model.config)).to(model.device, model.dtype)
    other.load_state_dict(model.state_dict())
    return hf.accelerate(other, **only()) if accelerate else other


def tokens(batch=2, seq=16, seed=0):
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def run(model, ids):
    """logits, loss, aux loss, router logits and every parameter gradient of one forward/backward."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out, grads


def assert_same(out_a, grads_a, out_b, grads_b, tol=TOL):
    assert rel(out_a.logits, out_b.logits) < tol
    assert rel(out_a.loss, out_b.loss) < tol
    if getattr(out_b, "aux_loss", None) is not None:
        assert rel(out_a.aux_loss, out_b.aux_loss) < tol
        assert len(out_a.router_logits) == len(out_b.router_logits) > 0
        for ra, rb in zip(out_a.router_logits, out_b.router_logits):
            assert rel(ra, rb) < tol
    assert grads_a.keys() == grads_b.keys()
    for name, g in grads_b.items():
        assert (g is None) == (grads_a[name] is None), name
        if g is not None:
            assert rel(grads_a[name], g) < tol, name


def experts_modules(model):
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]


@pytest.fixture(autouse=True)
def _restore():
    yield
    hf.disable()


@pytest.fixture(autouse=True)
def calls(monkeypatch):
    """Counts the calls of moe8.experts.experts_forward ("n") and moe8.layer.route ("route"); with
    MOE8_HF_STANDIN=1 those of the pure-PyTorch stand-in instead."""
    if STANDIN:
        import _standin

        monkeypatch.setattr(experts, "experts_forward", _standin.experts_forward)
        monkeypatch.setattr(layer, "route", _standin.route)
    counter = {"n": 0, "route": 0}
    for module, name, key in ((experts, "experts_forward", "n"), (layer, "route", "route")):
        inner = getattr(module, name)

        def counted(*args, _inner=inner, _key=key, **kwargs):
            counter[_key] += 1
            return _inner(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return counter


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_family_matches_transformers(family, calls):
    ref = build(family)
    acc = twin(ref)
    assert hf.is_accelerated(acc) and not hf.is_accelerated(ref)
    assert ref.config._experts_implementation == "grouped_mm"
    assert list(acc.state_dict()) == list(ref.state_dict())
    n_moe = len(experts_modules(acc))
    n_dense = {"qwen2_moe": 2, "qwen3_moe": 1, "deepseek_v3": 1}.get(family, 0)
    assert n_moe == acc.config.num_hidden_layers - n_dense
    ref.train(), acc.train()
    ids = tokens()
    out_r, grads_r = run(ref, ids)
    assert calls["n"] == 0
    out_a, grads_a = run(acc, ids)
    assert calls["n"] == n_moe
    assert_same(out_r, grads_r, out_a, grads_a)


@pytest.mark.parametrize("family", hf.FAMILIES)
@pytest.mark.parametrize("T", [1, 7, 40])
def test_experts_match_hf_eager(family, T):
    """One experts module against HF's own eager loop at large magnitudes (GPT-OSS clamps at 7), int64 ids as
    HF routers give, 1 token, experts with no token, and all tokens on one expert."""
    experts = experts_modules(build(family))[0]
    E, H = experts.num_experts, experts.gate_up_proj.shape[1 if experts.is_transposed else 2]
    g = torch.Generator().manual_seed(T)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (H**-0.5 if p.dim() == 3 else 1.0))
    eager = type(experts).forward.__wrapped__
    for ids in (torch.randint(0, E // 2, (T, 2), generator=g), torch.zeros(T, 2, dtype=torch.long)):
        x = (torch.randn(T, H, generator=g) * 4).requires_grad_()
        w = torch.rand(T, 2, generator=g).requires_grad_()
        ys, grads = [], []
        for fn in (eager, hf.experts_forward):
            y = fn(experts, x, ids, w)
            dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
            grads.append(torch.autograd.grad(y, [x, w, *experts.parameters()], dy))
            ys.append(y)
        assert ys[1].dtype == x.dtype
        assert rel(ys[1], ys[0]) < TOL
        for a, b in zip(grads[1], grads[0]):
            assert rel(a, b) < TOL


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_fused_router_matches_transformers(family, calls):
    """fuse_router=True: the routing runs on moe8.layer.route inside the HF router module (its hooks still
    record the router logits for the aux loss); everything still matches, and disable() restores the routers."""
    ref = build(family)
    acc = hf.accelerate(twin(ref, accelerate=False), **only("fuse_router"))
    routers = [m for m in acc.modules() if hasattr(m, "_moe8_config")]
    assert len(routers) == len(experts_modules(acc)) > 0
    ref.train(), acc.train()
    ids = tokens()
    out_r, grads_r = run(ref, ids)
    out_a, grads_a = run(acc, ids)
    assert calls["route"] == calls["n"] == len(routers)  # the reference's routers kept their own forward
    assert_same(out_r, grads_r, out_a, grads_a)
    assert_same(out_r, grads_r, *run(copy.deepcopy(acc), ids))  # e.g. a frozen reference model for DPO
    assert calls["route"] == 2 * len(routers)
    hf.disable()
    assert not any(hasattr(m, "_moe8_config") or type(m).forward is hf.router_forward for m in routers)
    assert_same(out_r, grads_r, *run(acc, ids))
    assert calls["route"] == 2 * len(routers)


def norms_of(model):
    return [m for m in model.modules() if type(m).__name__ == hf.NORMS[model.config.model_type]]


@pytest.mark.parametrize("norm_kernel", ["torch", "moe8"])
@pytest.mark.parametrize("family", hf.FAMILIES)
def test_fused_norm_matches_transformers(family, norm_kernel, calls, monkeypatch):
    """fuse_norm=True: every RMSNorm of the model runs as one fused kernel (F.rms_norm, or moe8.ops.rms_norm with
    norm_kernel="moe8": every norm calls it); outputs and every gradient still match transformers, and disable()
    gives the norms their own forward back."""
    from moe8 import ops

    moe8_norms = {"n": 0}
    inner = ops.rms_norm

    def counted(*args):
        moe8_norms["n"] += 1
        return inner(*args)

    monkeypatch.setattr(ops, "rms_norm", counted)
    ref = build(family)
    acc = hf.accelerate(twin(ref, accelerate=False), **only("fuse_norm"), norm_kernel=norm_kernel)
    norms = norms_of(acc)
    assert len(norms) >= 2 * len(experts_modules(acc)) > 0
    assert all(type(m).forward is hf.norm_forward and hasattr(m, "_moe8_config") for m in norms)
    ref.train(), acc.train()
    ids = tokens()
    out_r, grads_r = run(ref, ids)
    assert_same(out_r, grads_r, *run(acc, ids))
    assert moe8_norms["n"] == (len(norms) if norm_kernel == "moe8" else 0)
    hf.disable()
    assert not any(hasattr(m, "_moe8_config") or type(m).forward is hf.norm_forward for m in norms)
    assert_same(out_r, grads_r, *run(acc, ids))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_fused_norm_bf16_within_one_rounding(family):
    """In bf16 the fused norm rounds once; transformers' Llama-style norm rounds x / rms(x) first. They may
    differ by a rounding step (2^-8 relative), no more; GPT-OSS's norm already rounds once."""
    torch.manual_seed(0)
    model = build(family).to(torch.bfloat16)
    norm = norms_of(model)[0]
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(64, norm.weight.shape[0], dtype=torch.bfloat16)
    expected = norm(x)
    hf.accelerate(model, **only("fuse_norm"))
    got = norm(x)
    assert got.dtype == expected.dtype
    assert ((got.float() - expected.float()).abs() <= 2**-7 * expected.float().abs() + 1e-6).all()
    if family == "gpt_oss":
        assert torch.equal(got, expected)


def test_fused_attention_matches_transformers():
    """fuse_attention=True: GPT-OSS's attention with sinks through moe8.attention (process-wide, through its
    modeling module's eager_attention_forward), sliding and full layers, a padded batch; the outputs and every
    gradient (the sinks' included) match transformers' eager attention, and disable() restores it."""
    import importlib

    import moe8.attention

    mod = importlib.import_module("transformers.models.gpt_oss.modeling_gpt_oss")
    own = mod.eager_attention_forward
    ref = build("gpt_oss", sliding_window=5)
    ref.train()
    ids = tokens(seq=13)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second row left-padded: the mask is not just causal

    def step(model):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        return out, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    out_r, grads_r = step(ref)  # before the switch: the switch is process-wide
    acc = hf.accelerate(twin(ref, accelerate=False), **only("fuse_attention"))
    assert mod.eager_attention_forward is moe8.attention.attention_forward
    acc.train()
    out_a, grads_a = step(acc)
    assert_same(out_r, grads_r, out_a, grads_a)
    assert grads_a["model.layers.0.self_attn.sinks"].abs().sum() > 0  # the sinks train
    hf.disable()
    assert mod.eager_attention_forward is own


def test_fused_attention_generates_as_transformers():
    """Generation through the fused attention (on by default): the KV-cached decode steps (one query row
    against the cache, sliding and full layers, a left-padded row) score every new token as transformers'
    eager attention does (fp32, < 1e-5), so greedy decoding picks the same tokens."""
    import importlib

    from moe8.attention import attention_forward

    ref = build("gpt_oss", sliding_window=5, output_router_logits=False)
    ref.eval()
    ids = tokens(seq=9)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, output_scores=True)
    want = ref.generate(input_ids=ids, return_dict_in_generate=True, **kw)
    acc = hf.accelerate(twin(ref, accelerate=False), **only("fuse_attention"))
    acc.eval()
    mod = importlib.import_module("transformers.models.gpt_oss.modeling_gpt_oss")
    assert acc.config._attn_implementation == "eager" and mod.eager_attention_forward is attention_forward
    got = acc.generate(input_ids=ids, return_dict_in_generate=True, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert max(rel(a, b) for a, b in zip(got.scores, want.scores)) < 1e-5
    hf.disable()


def test_fused_attention_with_dropout_runs_transformers_eager():
    """A GPT-OSS trained with attention dropout: fuse_attention (on by default) hands those calls to the eager
    function it replaced, so the same seed gives transformers' numbers, gradients included."""
    ref = build("gpt_oss", attention_dropout=0.3)
    ref.train()
    ids = tokens(seq=13)

    def step(model):
        torch.manual_seed(7)  # the same dropout masks on both sides
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    out_r, grads_r = step(ref)
    acc = hf.accelerate(twin(ref, accelerate=False), **only("fuse_attention"))
    acc.train()
    out_a, grads_a = step(acc)
    assert_same(out_r, grads_r, out_a, grads_a)
    ref.eval()  # and the dropout matters: without it the loss differs
    with torch.no_grad():
        assert not torch.allclose(ref(input_ids=ids, labels=ids).loss, out_r.loss)
    hf.disable()


@pytest.mark.parametrize("family", hf.ROPE_FAMILIES)
def test_fused_rope_matches_transformers(family, monkeypatch):
    """fuse_rope=True: the family's attention applies rotary embeddings with moe8.ops.rope (process-wide,
    through its modeling module's apply_rotary_pos_emb); outputs and gradients still match, and disable()
    restores transformers' function."""
    import importlib

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    own = mod.apply_rotary_pos_emb
    ref = build(family)
    ref.train()
    ids = tokens()
    out_r, grads_r = run(ref, ids)  # before the switch: the switch is process-wide
    calls = []
    rope = moe8.rotary.rope
    monkeypatch.setattr(moe8.rotary, "rope", lambda *a: calls.append(1) or rope(*a))
    acc = hf.accelerate(twin(ref, accelerate=False), **only("fuse_rope"))
    assert mod.apply_rotary_pos_emb is moe8.ops.apply_rotary_pos_emb
    acc.train()
    assert_same(out_r, grads_r, *run(acc, ids))
    assert len(calls) >= 2 * ref.config.num_hidden_layers  # q and k of every layer
    hf.disable()
    assert mod.apply_rotary_pos_emb is own


@pytest.mark.parametrize("device", devices())
def test_load_balancing_loss_without_a_sync_is_transformers(device):
    """accelerate() points a family's load_balancing_loss_func at moe8's (the top-k counted by scatter_add_,
    not torch.bincount, which reads the ids' maximum back to the host): the same loss bit for bit, with and
    without an attention mask, and the same gradient of the router logits; disable() restores transformers'."""
    import importlib

    from moe8.hf.forward import load_balancing_loss_func as ours

    mod = importlib.import_module("transformers.models.qwen3_moe.modeling_qwen3_moe")
    own = mod.load_balancing_loss_func
    g = torch.Generator().manual_seed(7)
    logits = tuple(torch.randn(40, 16, generator=g).to(device).requires_grad_() for _ in range(3))
    mask = (torch.rand(4, 10, generator=g) > 0.3).to(device)
    for m in (None, mask):
        a, b = own(logits, 16, 4, m), ours(logits, 16, 4, m)
        assert torch.equal(a, b)
        assert all(
            torch.equal(x, y) for x, y in zip(torch.autograd.grad(a, logits), torch.autograd.grad(b, logits))
        )
    assert ours(None, 16, 4) == own(None, 16, 4) == 0
    acc = hf.accelerate(build("qwen3_moe"))
    assert mod.load_balancing_loss_func is ours
    del acc
    hf.disable()
    assert mod.load_balancing_loss_func is own


@pytest.mark.parametrize("family", sorted(hf.MLPS))
def test_fused_mlp_matches_transformers(family, monkeypatch):
    """fuse_mlp=True: each gated dense MLP (shared experts, dense layers) runs gate+up as one GEMM and moe8's
    SwiGLU kernel; outputs and every gradient match transformers; disable() restores the class forward."""
    ref = build(family)
    acc = hf.accelerate(twin(ref, accelerate=False), **only(), fuse_mlp=True)
    mlps = [m for m in acc.modules() if type(m).__name__ == hf.MLPS[family]]
    n = {"act": 0}
    act = moe8.ops.activation
    monkeypatch.setattr(moe8.ops, "activation", lambda *a: n.__setitem__("act", n["act"] + 1) or act(*a))
    ref.train(), acc.train()
    ids = tokens()
    out_r, grads_r = run(ref, ids)
    run(hf.accelerate(twin(ref, accelerate=False), **only()).train(), ids)  # the experts' own calls
    experts_calls, n["act"] = n["act"], 0
    out_a, grads_a = run(acc, ids)
    assert n["act"] - experts_calls == len(mlps)  # one per MLP
    if family != "olmoe":  # OLMoE's MLP class exists, its models have only MoE layers
        assert len(mlps) > 0
    assert_same(out_r, grads_r, out_a, grads_a)
    hf.disable()
    assert not any(type(m).forward is hf.mlp_forward for m in mlps)
    n["act"] = 0
    assert_same(out_r, grads_r, *run(acc, ids))
    assert n["act"] == 0  # transformers' experts and MLPs again


def test_fused_mlp_leaves_wrapped_projections_alone():
    """An MLP whose projections are not plain nn.Linear (LoRA) runs its own forward under fuse_mlp."""
    model = hf.accelerate(build("qwen3_moe"), **only(), fuse_mlp=True)
    mlp = next(m for m in model.modules() if type(m).__name__ == "Qwen3MoeMLP")
    x = torch.randn(3, mlp.gate_proj.in_features)
    want = mlp(x)
    mlp.up_proj = torch.nn.Sequential(mlp.up_proj)
    assert torch.allclose(mlp(x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_fused_loss_matches_transformers(family):
    """fuse_loss=True: the training loss from the hidden states, chunk by chunk, without logits (outputs.logits
    None); the same loss (aux loss included) and every gradient as transformers; disable() restores it."""
    ref = build(family)
    acc = hf.accelerate(twin(ref, accelerate=False), **only("fuse_loss"))
    ref.train(), acc.train()
    ids = tokens()
    out_r, grads_r = run(ref, ids)
    out_a, grads_a = run(acc, ids)
    assert out_a.logits is None and rel(out_a.loss, out_r.loss) < TOL
    assert grads_a.keys() == grads_r.keys()
    for name, g in grads_r.items():
        assert rel(grads_a[name], g) < TOL, name
    hf.disable()
    assert_same(out_r, grads_r, *run(acc, ids))


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_defaults_fuse_everything_and_match_transformers(family, calls):
    """accelerate(model) with no fields: experts, routers, norms, RoPE (its families) and the loss on moe8
    (moe8.Config()'s defaults); the training loss (aux loss included) and every gradient match transformers,
    outputs.logits is None in the training forward and transformers' logits otherwise; disable() undoes it
    all, the process-wide RoPE included."""
    import importlib

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    own_rope = getattr(mod, "apply_rotary_pos_emb", None)
    ref = build(family)
    ref.train()
    ids = tokens()
    out_r, grads_r = run(ref, ids)  # before the switch: RoPE's is process-wide
    acc = hf.accelerate(twin(ref, accelerate=False))
    cfg = hf.config_of(acc)
    assert cfg == moe8.Config() and all(getattr(cfg, f) for f in FUSIONS)
    assert (mod.apply_rotary_pos_emb is moe8.ops.apply_rotary_pos_emb) == (family in hf.ROPE_FAMILIES)
    assert all(type(m).forward is hf.norm_forward for m in norms_of(acc))
    acc.train()
    out_a, grads_a = run(acc, ids)
    assert calls["route"] == calls["n"] == len(experts_modules(acc)) > 0
    assert out_a.logits is None and rel(out_a.loss, out_r.loss) < TOL
    if getattr(out_r, "aux_loss", None) is not None:
        assert rel(out_a.aux_loss, out_r.aux_loss) < TOL
    assert grads_a.keys() == grads_r.keys()
    for name, g in grads_r.items():
        assert rel(grads_a[name], g) < TOL, name
    with torch.no_grad():
        assert rel(acc(input_ids=ids).logits, ref(input_ids=ids).logits) < TOL
    hf.disable()
    assert getattr(mod, "apply_rotary_pos_emb", None) is own_rope
    assert not any(type(m).forward is hf.norm_forward for m in norms_of(acc))
    assert_same(out_r, grads_r, *run(acc, ids))


@pytest.mark.parametrize("opt_out", FUSIONS)
def test_each_default_fusion_has_an_opt_out(opt_out):
    """fuse_X=False on accelerate() or enable() leaves that fusion off and the others on."""
    import importlib

    mod = importlib.import_module("transformers.models.qwen3_moe.modeling_qwen3_moe")
    own_rope = mod.apply_rotary_pos_emb
    for switch in ("accelerate", "enable"):
        if switch == "enable":
            hf.enable(**{opt_out: False})
            model = build("qwen3_moe")
        else:
            model = hf.accelerate(build("qwen3_moe"), **{opt_out: False})
        cfg = hf.config_of(model)
        assert [getattr(cfg, f) for f in FUSIONS] == [f != opt_out for f in FUSIONS]
        ids = tokens()
        out = model(input_ids=ids, labels=ids)
        assert (out.logits is None) == (opt_out != "fuse_loss")
        assert all((type(m).forward is hf.norm_forward) == (opt_out != "fuse_norm") for m in norms_of(model))
        assert (mod.apply_rotary_pos_emb is own_rope) == (opt_out == "fuse_rope")
        hf.disable()
        assert mod.apply_rotary_pos_emb is own_rope


def test_fused_loss_steps_aside_for_a_replaced_head():
    """A head swapped after fusing (LoRA or another wrapper around it) gets transformers' loss and logits:
    the fused loss only runs for the head it took apart."""
    model = hf.accelerate(build("qwen3_moe"), **only("fuse_loss"))
    ids = tokens()
    want = model(input_ids=ids, labels=ids).loss
    model.lm_head = torch.nn.Sequential(model.lm_head)
    out = model(input_ids=ids, labels=ids)
    assert out.logits is not None and rel(out.loss, want) < TOL


def test_fuse_loss_warns_for_a_head_it_cannot_take_apart():
    model = build("qwen3_moe")
    model.lm_head = torch.nn.Sequential(model.lm_head)
    with pytest.warns(UserWarning, match="fuse_loss left .* Sequential"):
        hf.accelerate(model, **only("fuse_loss"))
    ids = tokens()
    assert model(input_ids=ids, labels=ids).logits is not None
    hf.disable()


def test_enable_fuse_loss():
    hf.enable(**only("fuse_loss"))
    model = build("qwen3_moe")
    ids = tokens()
    assert model(input_ids=ids, labels=ids).logits is None
    assert model(input_ids=ids).logits.shape == (*ids.shape, model.config.vocab_size)
    hf.disable()
    assert model(input_ids=ids, labels=ids).logits is not None


def test_enable_fuse_router(calls):
    hf.enable(**only("fuse_router", "fuse_norm", "fuse_rope"))
    model = build("deepseek_v3")
    model(input_ids=tokens())
    assert calls["route"] == calls["n"] == len(experts_modules(model))
    assert all(type(m).forward is hf.norm_forward and hasattr(m, "_moe8_config") for m in norms_of(model))
    model.set_experts_implementation("grouped_mm")  # the fused routers follow the experts implementation
    model(input_ids=tokens())
    assert calls["route"] == calls["n"] == len(experts_modules(model))


@fullgraph
@pytest.mark.parametrize("family", hf.FAMILIES)
def test_model_compile_fullgraph(family, calls):
    """The base model of every family (experts, fused routers, norms and RoPE on moe8) compiles to one
    graph."""
    ref = build(family)
    acc = hf.accelerate(twin(ref, accelerate=False), **only("fuse_router", "fuse_norm", "fuse_rope"))
    ids = tokens()
    acc.model(
        input_ids=ids
    )  # transformers installs its output-capturing hooks on the first call, under a lock
    hidden = torch.compile(acc.model, fullgraph=True, backend="aot_eager")(input_ids=ids).last_hidden_state
    assert calls["route"] == calls["n"] == 2 * len(experts_modules(acc))
    assert rel(hidden, ref.model(input_ids=ids).last_hidden_state) < TOL


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_bf16(family, calls):
    """bf16 weights and activations: close to transformers' bf16 result, gradients in bf16."""
    ref = build(family).to(torch.bfloat16)
    acc = hf.accelerate(twin(ref, accelerate=False), **only("fuse_router"))
    ids = tokens()
    (out_r, grads_r), (out_a, grads_a) = run(ref, ids), run(acc, ids)
    assert out_a.logits.dtype == out_r.logits.dtype and calls["n"] > 0
    assert rel(out_a.logits, out_r.logits) < 2e-2
    flat = [torch.cat([g[n].flatten().double() for n in sorted(grads_r)]) for g in (grads_a, grads_r)]
    assert rel(*flat) < 2e-2
    for name, g in grads_r.items():  # small tensors (router biases) cancel more: a looser bound each
        assert grads_a[name].dtype == torch.bfloat16 and rel(grads_a[name], g) < 0.15, name


def test_enable_makes_moe8_the_default_and_disable_restores():
    ref = build("mixtral")
    hf.enable(**only())
    assert "moe8" in ALL_EXPERTS_FUNCTIONS
    acc = twin(ref, accelerate=False, cfg=config("mixtral"))  # built after enable(): moe8 without asking
    assert hf.is_accelerated(acc)
    explicit = AutoModelForCausalLM.from_config(copy.deepcopy(ref.config), experts_implementation="eager")
    assert explicit.config._experts_implementation == "eager"  # an explicit choice wins
    ids = tokens()
    out_r, grads_r = run(ref, ids)
    out_a, grads_a = run(acc, ids)
    assert_same(out_r, grads_r, out_a, grads_a)

    hf.disable()
    assert "moe8" not in ALL_EXPERTS_FUNCTIONS
    assert acc.config._experts_implementation == "grouped_mm"  # switched back, still works
    assert twin(ref, accelerate=False, cfg=config("mixtral")).config._experts_implementation == "grouped_mm"
    assert_same(out_r, grads_r, *run(acc, ids))


def test_enable_families():
    hf.enable(families=["olmoe"])
    assert hf.is_accelerated(build("olmoe"))
    assert build("mixtral").config._experts_implementation == "grouped_mm"
    with pytest.raises(ValueError, match="llama"):
        hf.enable(families=["llama"])


def test_accelerate_then_disable_restores_previous_implementation():
    model = build("qwen3_moe")
    model.set_experts_implementation("eager")
    assert hf.accelerate(model) is model and hf.is_accelerated(model)
    hf.disable()
    assert model.config._experts_implementation == "eager"


def test_unsupported_models_are_untouched():
    torch.manual_seed(0)
    llama_cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    llama = AutoModelForCausalLM.from_config(llama_cfg)
    before = llama.get_experts_implementation()
    ids = tokens()
    logits = llama(input_ids=ids).logits
    with pytest.warns(UserWarning, match="left untouched: no MoE experts"):
        assert hf.accelerate(llama) is llama
    assert llama.get_experts_implementation() == before
    assert torch.equal(llama(input_ids=ids).logits, logits)

    gelu = build("mixtral", hidden_act="gelu")  # moe8 runs SiLU-gated experts only
    with pytest.warns(UserWarning, match="left untouched: activation GELUActivation"):
        hf.accelerate(gelu)
    assert gelu.config._experts_implementation == "grouped_mm"
    with pytest.warns(UserWarning, match="left untouched: model type 'mixtral'"):
        hf.accelerate(build("mixtral"), families=["olmoe"])

    hf.enable()
    AutoModelForCausalLM.from_config(llama_cfg)  # not an MoE model: no notice, nothing changes
    with pytest.warns(UserWarning, match="left on transformers' experts: hidden_act 'gelu'"):
        assert build("mixtral", hidden_act="gelu").config._experts_implementation == "grouped_mm"


def test_save_pretrained_round_trip(tmp_path, calls):
    ref = build("gpt_oss")
    acc = twin(ref)
    ids = tokens()
    logits = acc(input_ids=ids).logits
    acc.save_pretrained(tmp_path)
    assert "moe8" not in (tmp_path / "config.json").read_text()
    from safetensors.torch import load_file

    assert sorted(load_file(tmp_path / "model.safetensors")) == sorted(ref.state_dict())

    hf.enable()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert hf.is_accelerated(loaded)
    n = calls["n"]
    assert rel(loaded(input_ids=ids).logits, logits) < TOL and calls["n"] > n
    hf.disable()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert plain.config._experts_implementation == "grouped_mm"
    assert rel(plain(input_ids=ids).logits, logits) < TOL


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_gradient_checkpointing(family, calls):
    ref = build(family)
    acc = twin(ref)
    for m in (ref, acc):
        m.gradient_checkpointing_enable()
        m.train()
    ids = tokens()
    out_r, grads_r = run(ref, ids)
    out_a, grads_a = run(acc, ids)
    assert calls["n"] == 2 * len(experts_modules(acc))  # the backward recomputes each layer on moe8
    assert_same(out_r, grads_r, out_a, grads_a)


def text_batches(steps, batch, seq):
    """Real English text as bytes (ASCII < 128 = VOCAB), or generated text when the shared data is missing."""
    path = shared("text", "sentences.txt")
    if path is not None:
        with open(path, "rb") as f:
            data = f.read(steps * batch * (seq + 1) * 2)
    else:
        rng = random.Random(0)
        words = "the of and a to in is was that for it with as his on be at by had are but from".split()
        data = " ".join(rng.choice(words) for _ in range(steps * batch * seq)).encode()
    t = torch.tensor(list(data[: steps * batch * seq]), dtype=torch.long) % VOCAB
    return t.view(steps, batch, seq)


CUDA = pytest.mark.skipif(
    not (torch.cuda.is_available() and moe8.cuda_available()), reason="needs a CUDA GPU and moe8 CUDA"
)
CURVES = [  # family, device, dtype, per-step relative tolerance
    ("olmoe", "cpu", torch.float32, 1e-4),
    *[pytest.param(f, "cuda", torch.float32, 1e-3, marks=CUDA) for f in hf.FAMILIES],
]


@pytest.mark.slow
@pytest.mark.parametrize("family,device,dtype,tol", CURVES)
def test_training_curve_matches(family, device, dtype, tol, calls):
    """50 AdamW steps (lr 1e-3) on real text: the loss curves (LM + aux loss) agree step by step."""
    ref = build(family).to(device, dtype)
    acc = twin(ref)
    losses = []
    for model in (ref, acc):
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        curve = []
        for ids in text_batches(50, 2, 32):
            loss = model(input_ids=ids.to(device), labels=ids.to(device)).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            curve.append(loss.item())
        losses.append(curve)
    assert calls["n"] == 50 * len(experts_modules(acc))
    for step, (a, b) in enumerate(zip(*losses)):
        assert abs(a - b) / abs(a) < tol, (step, a, b)
    assert sum(losses[1][-5:]) < 0.8 * sum(losses[1][:5])  # it learns


@pytest.mark.slow
def test_torch_compile(calls):
    """The whole model under torch.compile (inductor): same loss and gradients; the only graph break is in
    transformers' aux loss (bincount), none in the experts."""
    ref = build("mixtral")
    acc = twin(ref)
    ids = tokens()
    out_r, grads_r = run(ref, ids)
    out_c, grads_c = run(torch.compile(acc), ids)
    assert calls["n"] == len(experts_modules(acc))
    assert_same(out_r, grads_r, out_c, {n.replace("_orig_mod.", ""): g for n, g in grads_c.items()})


@fullgraph
@pytest.mark.parametrize("family", hf.FAMILIES)
def test_experts_compile_fullgraph(family, calls):
    """Each family's experts compile to one graph (moe8's ops are torch.library custom ops)."""
    experts = experts_modules(twin(build(family)))[0]
    H = experts.gate_up_proj.shape[1 if experts.is_transposed else 2]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, H, generator=g).requires_grad_()
    ids, w = torch.randint(0, experts.num_experts, (9, 2), generator=g), torch.rand(9, 2, generator=g)
    compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")
    ys = [fn(x, ids, w) for fn in (type(experts).forward.__wrapped__.__get__(experts), compiled)]
    assert calls["n"] == 1
    assert rel(ys[1], ys[0]) < TOL
    gx = [torch.autograd.grad(y.square().sum(), x)[0] for y in ys]
    assert rel(gx[1], gx[0]) < TOL


def test_peft_lora_on_experts(calls):
    """PEFT LoRA with target_parameters on the fused experts (gate_up_proj, down_proj): same loss and LoRA
    gradients as transformers' implementation; state_dict keys unchanged."""
    peft = pytest.importorskip("peft", minversion="0.17", reason="LoRA target_parameters needs peft>=0.17")
    ref = build("qwen3_moe")
    acc = twin(ref, accelerate=False)
    lora = dict(
        r=4,
        lora_alpha=8,
        target_modules=[],
        init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    models = []
    for base in (ref, acc):
        torch.manual_seed(1)
        models.append(peft.get_peft_model(base, peft.LoraConfig(**lora)))
    hf.accelerate(models[1], **only())  # a PeftModel: accelerate finds the transformers model inside
    assert hf.is_accelerated(acc)
    assert list(models[0].state_dict()) == list(models[1].state_dict())
    ids = tokens()
    (out_r, grads_r), (out_a, grads_a) = run(models[0], ids), run(models[1], ids)
    assert calls["n"] == len(experts_modules(acc)) > 0
    assert any("lora" in n for n in grads_a) and all("lora" in n for n in grads_a)
    assert_same(out_r, grads_r, out_a, grads_a)


def test_needs_transformers_5(monkeypatch):
    import sys

    monkeypatch.setattr(
        sys.modules["transformers"], "__version__", "4.57.1"
    )  # peft may re-import transformers
    with pytest.raises(ImportError, match="transformers>=5"):
        hf.enable()


def test_notice_lines_are_short():
    with pytest.warns(UserWarning) as record:
        hf.accelerate(torch.nn.Linear(2, 2))
    assert len(record) == 1 and "\n" not in str(record[0].message)


def captured_experts_calls(model, ids):
    """(module, hidden_states, top_k_index, top_k_weights) of every experts call in one forward of `model`."""
    seen, hooks = [], []
    for m in experts_modules(model):
        hooks.append(
            m.register_forward_hook(lambda mod, args, out: seen.append((mod, *(a.detach() for a in args))))
        )
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def experts_call_grads(fn, module, x, ids, w, dy):
    """Output and the gradients of input, routing weights and every parameter of one experts call."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    params = [p for p in module.parameters() if p.requires_grad]
    y = fn(module, x, ids, w)
    return [y, *torch.autograd.grad(y, [x, w, *params], dy)]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("family", hf.FAMILIES)
def test_bf16_matches_transformers(family, device, calls):
    """bf16, moe8 vs transformers' grouped_mm on the same model, in two parts.

    1. Every experts call of a bf16 forward, on the exact inputs transformers gave it (captured by a hook):
       output and the gradients of hidden states, routing weights and every expert parameter agree < 1e-2,
       or else moe8 is no farther from the fp32 result than transformers' bf16 is (+10%, +1e-3).
    2. The whole model: loss agrees < 1e-2; logits and every parameter gradient agree < 1e-2, or else are
       within three times transformers' own bf16 error against the fp32 model (+1e-2; a wrong gradient is off
       by ~100%). Two bf16 implementations of a tiny random model cannot always agree to 1e-2 there: a
       last-bit difference in one layer flips near-tied top-k choices in the next (transformers' bf16 itself
       is 1-11% off fp32 on these models, and moe8 is closer to fp32 than it in every call of part 1)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    base = build(family, hidden_size=64).to(device)
    ref32 = twin(base, accelerate=False)
    ref = twin(base, accelerate=False).to(torch.bfloat16)
    ids = tokens(batch=4, seq=32).to(device)
    seen = captured_experts_calls(ref, ids)
    assert len(seen) == len(experts_modules(ref)) > 0
    fp32_twin = dict(zip(experts_modules(ref), experts_modules(ref32)))
    gen = torch.Generator(device).manual_seed(0)
    for i, (module, x, top_ids, top_w) in enumerate(seen):
        dy = torch.randn(x.shape, generator=gen, device=device).to(x.dtype)
        want = experts_call_grads(grouped_mm_experts_forward, module, x, top_ids, top_w, dy)
        got = experts_call_grads(hf.experts_forward, module, x, top_ids, top_w, dy)
        exact = experts_call_grads(
            grouped_mm_experts_forward, fp32_twin[module], x.float(), top_ids, top_w.float(), dy.float()
        )
        names = ["output", "d hidden", "d weights"]
        names += [n for n, p in module.named_parameters() if p.requires_grad]
        for name, a, b, f32 in zip(names, got, want, exact):
            assert a.dtype == b.dtype, name
            ok = rel(a, b) < 1e-2 or rel(a, f32) <= 1.1 * rel(b, f32) + 1e-3
            assert ok, (
                f"experts call {i}, {name}: moe8 vs HF {rel(a, b):.3g}, vs fp32 {rel(a, f32):.3g}, HF vs fp32 {rel(b, f32):.3g}"
            )
    assert calls["n"] == len(seen)

    acc = hf.accelerate(twin(ref, accelerate=False), **only())
    (o32, g32), (o_r, g_r), (o_a, g_a) = run(ref32, ids), run(ref, ids), run(acc, ids)
    assert calls["n"] > len(seen) and o_a.logits.dtype == torch.bfloat16
    assert rel(o_a.loss, o_r.loss) < 1e-2
    pairs = [("logits", o_a.logits, o_r.logits, o32.logits)]
    pairs += [(n, g_a[n], g, g32[n]) for n, g in g_r.items() if g is not None]
    for name, a, r, f32 in pairs:
        ok = rel(a, r) < 1e-2 or rel(a, f32) <= 3 * rel(r, f32) + 1e-2
        assert ok, (
            f"{name}: moe8 vs HF bf16 {rel(a, r):.3g}, vs fp32 {rel(a, f32):.3g}, HF vs fp32 {rel(r, f32):.3g}"
        )


def test_fp8_option_runs_the_expert_gemms_in_fp8(calls):
    """accelerate(model, fp8=...) routes the experts through moe8.fp8 (bf16 model; close to bf16, not equal)."""
    ref = build("qwen3_moe", hidden_size=128).to(torch.bfloat16)
    bf16 = twin(ref)
    with pytest.raises(ValueError, match="recipe: expected one of"):
        hf.accelerate(twin(ref, accelerate=False), fp8="e5m2-magic")
    fp8_model = hf.accelerate(twin(ref, accelerate=False), fp8="blockwise")
    ids = tokens()
    with torch.no_grad():
        a = fp8_model(input_ids=ids).logits.float()
        hf.disable()
        b = hf.accelerate(bf16)(input_ids=ids).logits.float()
    err = rel(a, b)
    assert 1e-4 < err < 0.1, err


def test_two_models_in_one_process_keep_their_own_config():
    """Each accelerated model carries its own moe8.Config: one model in FP8 blockwise, its twin in bf16; the
    FP8 model's outputs differ from bf16's, the bf16 twin's do not, and the FP8 setting did not leak."""
    model = build("qwen3_moe").to(torch.bfloat16)
    ids = tokens()
    ref = model(input_ids=ids).logits
    fp8_model = hf.accelerate(twin(model, accelerate=False), fp8="blockwise", fuse_norm=True)
    bf16_model = hf.accelerate(twin(model, accelerate=False), **only())  # bf16 fusions round differently
    assert hf.config_of(fp8_model).fp8.name == "blockwise" and hf.config_of(fp8_model).fuse_norm
    assert hf.config_of(bf16_model) == moe8.Config(**only())
    y8, y16 = fp8_model(input_ids=ids).logits, bf16_model(input_ids=ids).logits
    assert not torch.equal(y8, y16)
    assert rel(y16, ref) < 2e-2 and rel(y8, ref) < 0.2
    # accelerate's fields change the model's current config; a config replaces it
    hf.accelerate(fp8_model, fuse_norm=False)
    assert hf.config_of(fp8_model) == moe8.Config(fp8="blockwise", fuse_norm=False)
    hf.accelerate(fp8_model, config=moe8.Config(routed_down=False))
    assert hf.config_of(fp8_model) == moe8.Config(routed_down=False)


def test_enable_gives_new_models_its_config_and_checks_fields():
    hf.enable(families="qwen3_moe", fp8="blockwise", consume_gate_up=False)
    model = build("qwen3_moe")
    assert hf.is_accelerated(model)
    assert hf.config_of(model) == moe8.Config(fp8="blockwise", consume_gate_up=False)
    with pytest.raises(TypeError, match="no field"):
        hf.enable(fuse_everything=True)
    with pytest.raises(ValueError, match="recipe: expected one of"):
        hf.accelerate(model, fp8="fp4")
    with pytest.raises(ValueError, match="transport: expected one of"):
        moe8.Config(transport="carrier-pigeon")
    hf.disable()
    assert hf.config_of(model) is None
