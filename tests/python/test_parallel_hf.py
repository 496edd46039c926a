"""moe8.parallel with transformers models on CPU: gloo groups of 2 and 4 processes (the workers of
test_parallel.py) against one process on the ranks' concatenated batch: the six families under parallelize(),
LoRA on attention and experts, the global aux loss, config errors, gradient checkpointing, FSDP2,
save_pretrained -> from_pretrained and the training state (torch.distributed.checkpoint)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers", minversion="5.0", reason="moe8.parallel.hf needs transformers>=5")

from test_parallel import rel, worker_groups  # noqa: E402

import moe8  # noqa: E402
from moe8.parallel import experts_modules, make_mesh, parallelize, unparallelize  # noqa: E402


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """workers(world): this module's group of `world` processes (test_parallel.Workers)."""
    yield from worker_groups(tmp_path_factory)


# ------------------------------------------------------------------------------ transformers models
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
VOCAB = 128


def hf_config(family, **over):
    """A tiny random config: hidden 32, 8 experts, top-2, vocab 128, eager attention (as tests/test_hf.py)."""
    import transformers

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
        num_experts_per_tok=2,
        num_hidden_layers=2,
    )
    if family == "mixtral":
        c.update(intermediate_size=48, num_local_experts=8)
    elif family == "qwen2_moe":  # shared expert with a sigmoid gate; layer 0 dense
        c.update(
            intermediate_size=48,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=8,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            norm_topk_prob=False,
        )
    elif family == "qwen3_moe":
        c.update(
            intermediate_size=48, moe_intermediate_size=24, num_experts=8, head_dim=8, norm_topk_prob=True
        )
    elif family == "olmoe":
        c.update(intermediate_size=24, num_experts=8)
    elif family == "deepseek_v3":  # first layer dense; 4 groups of 2 experts, top-2 groups; shared expert
        c.update(
            num_key_value_heads=4,
            intermediate_size=64,
            moe_intermediate_size=16,
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
    elif family == "gpt_oss":  # transposed interleaved gate_up with biases, clamped SwiGLU, sinks
        c.update(
            intermediate_size=32,
            num_local_experts=8,
            head_dim=8,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    c.update(over)
    cfg = transformers.AutoConfig.for_model(family, **c)
    cfg._attn_implementation = "eager"
    return cfg


def hf_build(family, seed=0, **over):
    """fp32 model; zero-initialised tensors (biases, DeepSeek's e_score_correction_bias) made random."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **over))
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point() and t.numel() > 1 and not t.any():
                t.normal_(0, 0.05)
    return model.train()


def hf_tokens(world, per_rank=2, seq=12):
    return torch.randint(3, VOCAB, (world * per_rank, seq), generator=torch.Generator().manual_seed(7))


def hf_step(model, ids, aux=None):
    """logits, loss and every gradient of one forward/backward; aux: coefficient of the global-batch
    load-balancing loss added to the LM loss (router logits recorded by the model's hooks)."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, output_router_logits=aux is not None)
    loss = out.loss
    if aux is not None:
        from moe8.parallel.aux import global_load_balancing_loss

        group = None if dist.is_initialized() else False
        logits = out.router_logits
        if group is False:  # one process: the plain formula on its batch
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

            lb = load_balancing_loss_func(
                logits, model.config.num_local_experts, model.config.num_experts_per_tok
            )
        else:
            lb = global_load_balancing_loss(
                logits, model.config.num_local_experts, model.config.num_experts_per_tok
            )
        loss = out.logits.new_zeros(()) + torch.nn.functional.cross_entropy(
            out.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)
        )
        loss = loss + aux * lb
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), loss.detach(), grads


_meshes = {}


def _mesh(world, ep=None):
    key = (world, ep or world)
    if key not in _meshes:
        _meshes[key] = make_mesh(ep or world, device_type="cpu")
    return _meshes[key]


def _hf_case(rank, world, family, aux):
    model = hf_build(family)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    parallelize(model, _mesh(world))
    ids = hf_tokens(world).chunk(world)[rank]
    logits, loss, grads = hf_step(model, ids, aux)
    calls = sum(1 for _, m in experts_modules(model) if "_moe8_ep" in m.__dict__)
    unparallelize(model)
    restored = all(torch.equal(p, full[n]) for n, p in model.named_parameters())
    restored = restored and all("forward" not in m.__dict__ for _, m in experts_modules(model))
    return logits, loss, grads, calls, restored


def _assert_hf_matches(out, ref, world, tol):
    logits, loss, grads = ref
    assert rel(torch.cat([o[0] for o in out]), logits) < tol
    assert abs(sum(o[1].item() for o in out) / world - loss.item()) < tol * abs(loss.item())
    assert out[0][2].keys() == grads.keys()
    for name, g in grads.items():
        parts = [o[2][name] for o in out]
        if parts[0].shape == g.shape:  # dense: the data-parallel mean
            got = sum(parts) / world
        else:  # experts: each rank's shard (already scaled to the mean by parallelize's grad_scale)
            got = torch.cat(parts)
        assert rel(got, g) < tol, name


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_family_matches_single_process(workers, family):
    """parallelize() on 2 ranks: logits, loss and every gradient (dense: mean over ranks; experts: the
    shards) equal the single-process model's on the concatenated batch, with transformers' own experts.
    unparallelize() gives back every expert and the class forward."""
    out = workers(2).run(_hf_case, family, None)
    n = len(experts_modules(hf_build(family)))
    assert all(o[3] == n > 0 for o in out)
    assert all(o[4] for o in out)
    ref = hf_step(hf_build(family), hf_tokens(2))
    _assert_hf_matches(out, ref, 2, 1e-6)


def test_hf_four_ranks_and_global_aux_loss(workers):
    """4 ranks, 2 experts each, with the load-balancing loss over the global batch: the loss and the router
    gradients (mean over ranks) are those of the one-process loss on the concatenated batch."""
    out = workers(4).run(_hf_case, "mixtral", 0.5)
    ref = hf_step(hf_build("mixtral"), hf_tokens(4), aux=0.5)
    _assert_hf_matches(out, ref, 4, 1e-6)
    per_rank = [hf_step(hf_build("mixtral"), t, aux=0.5)[1] for t in hf_tokens(4).chunk(4)]
    assert abs(sum(per_rank).item() / 4 - ref[1].item()) > 1e-4  # each rank's own aux loss would differ


def _mismatch(rank, world):
    errors = []
    for over in ({"num_local_experts": 4 + 4 * rank}, {"hidden_size": 32 + 16 * rank}):
        try:
            parallelize(hf_build("mixtral", **over), _mesh(world))
        except ValueError as e:
            errors.append(str(e))
    try:
        parallelize(hf_build("mixtral"), _mesh(world), transport="nccl" if rank == 0 else "ipc")
    except ValueError as e:
        errors.append(str(e))
    try:
        parallelize(hf_build("mixtral", num_local_experts=6), _mesh(world))
    except ValueError as e:
        errors.append(str(e))
    try:  # no transport argument: each model's moe8.Config.transport ("auto" is nccl)
        model = moe8.accelerate(hf_build("mixtral"), transport="auto" if rank == 0 else "ipc")
        parallelize(model, _mesh(world))
    except ValueError as e:
        errors.append(str(e))
    finally:
        moe8.disable()
    return errors


def test_parallelize_config_errors(workers):
    """Ranks that built different models (experts, hidden size) or asked for different transports (as an
    argument, or through their models' moe8.Config), and E % ep != 0: the same ValueError on every rank, naming what differs."""
    out = workers(4).run(_mismatch)
    assert all(o == out[0] for o in out) and len(out[0]) == 5, out
    experts, hidden, transport, divisible, from_config = out[0]
    assert "disagree on experts" in experts and "rank 1: [('model.layers.0.mlp.experts', (8," in experts
    assert "disagree on experts" in hidden or "disagree on hidden_size" in hidden
    assert "disagree on transport (rank 0: nccl; rank 1: ipc, rank 2: ipc, rank 3: ipc)" in transport
    assert "disagree on transport (rank 0: nccl; rank 1: ipc, rank 2: ipc, rank 3: ipc)" in from_config
    assert (
        divisible
        == "parallelize: model.layers.0.mlp.experts has 6 experts, not divisible by the expert-parallel size 4"
    )


def _empty_rank(rank, world):
    """Rank 1 gets an empty batch: every rank raises the same ValueError before any layer runs (none is left
    waiting in a collective); then a step with tokens everywhere runs on the same model."""
    model = parallelize(hf_build("mixtral"), _mesh(world), timeout_s=30)
    timeouts = {m._moe8_ep["transport"].timeout_s for _, m in experts_modules(model)}
    ids = hf_tokens(world).chunk(world)[rank]
    try:
        model(input_ids=ids[:0] if rank == 1 else ids, labels=ids)
        message = None
    except ValueError as e:
        message = str(e)
    loss = hf_step(model, ids)[1]
    unparallelize(model)
    return message, timeouts, bool(torch.isfinite(loss)), len(model._forward_pre_hooks)


def test_a_rank_without_tokens_is_refused_on_every_rank(workers):
    out = workers(2).run(_empty_rank)
    want = "input_ids: rank 1 of the expert-parallel model has no tokens (tokens by rank: [24, 0])"
    for message, timeouts, finite, hooks in out:
        assert message is not None and message.startswith(want), message
        assert timeouts == {30.0} and finite and hooks == 0


def _parallelize_arguments(rank, world):
    errors = []
    for bad in (dict(max_tokens=0), dict(timeout_s=0), dict(max_tokens=2.5)):
        try:
            parallelize(hf_build("mixtral"), _mesh(world), **bad)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_parallelize_checks_max_tokens_and_timeout(workers):
    out = workers(2).run(_parallelize_arguments)
    assert all(o == out[0] for o in out) and len(out[0]) == 3, out
    assert out[0][0].startswith("max_tokens: expected an int >= 1 or None, got 0")
    assert out[0][1].startswith("timeout_s: expected > 0 seconds, got 0")
    assert out[0][2].startswith("max_tokens: expected an int >= 1 or None, got 2.5")


def _save(rank, world, family, path, max_shard_bytes):
    from moe8.parallel.checkpoint import save_pretrained

    model = parallelize(hf_build(family), _mesh(world))
    save_pretrained(model, path, max_shard_bytes=max_shard_bytes)
    return sorted(os.listdir(path)) if rank == 0 else None


@pytest.mark.parametrize("family, max_shard_bytes", [("mixtral", 40_000), ("gpt_oss", 5 * 2**30)])
def test_save_pretrained_loads_on_one_process(workers, tmp_path, family, max_shard_bytes):
    """Saved from 2 expert-parallel ranks (several shard files + index, or one file): from_pretrained on one
    process gives the original model's state_dict and logits bitwise, with the keys save_pretrained writes."""
    from transformers import AutoModelForCausalLM

    path = str(tmp_path / "ckpt")
    files = workers(2).run(_save, family, path, max_shard_bytes)[0]
    ref = hf_build(family)
    ref.save_pretrained(str(tmp_path / "ref"))
    from safetensors import safe_open

    def keys(d):
        out = set()
        for f in os.listdir(d):
            if f.endswith(".safetensors"):
                out |= set(safe_open(os.path.join(d, f), "pt").keys())
        return out

    assert keys(path) == keys(str(tmp_path / "ref"))
    if max_shard_bytes < 2**20:
        assert (
            "model.safetensors.index.json" in files
            and len([f for f in files if f.endswith("safetensors")]) > 1
        )
    else:
        assert "model.safetensors" in files
    loaded = AutoModelForCausalLM.from_pretrained(path)
    loaded.config._attn_implementation = "eager"
    sd, sd_ref = loaded.state_dict(), ref.state_dict()
    assert sd.keys() == sd_ref.keys() and all(torch.equal(sd[k], sd_ref[k]) for k in sd)
    ids = hf_tokens(1)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids).logits, ref.eval()(input_ids=ids).logits)


def _load_case(rank, world, path):
    from moe8.parallel import from_pretrained

    model = from_pretrained(path, _mesh(world), dtype=torch.float32, device="cpu")
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        logits = model(input_ids=hf_tokens(world).chunk(world)[rank]).logits
    shards = {n: p.detach().clone() for n, p in model.named_parameters()}
    return logits, shards


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("writer", ["transformers", "moe8"])
def test_from_pretrained_loads_only_local_experts(workers, tmp_path, family, writer):
    """moe8.parallel.from_pretrained on 2 ranks, from a checkpoint in the hub's format (transformers'
    save_pretrained: per-expert tensors for most families, fused for GPT-OSS) or moe8's fused one (several
    shard files): each rank holds exactly its rows of every expert tensor and the whole dense tensors, and
    the logits equal the full model's on the concatenated batch."""
    path = str(tmp_path / "ckpt")
    ref = hf_build(family)
    if writer == "transformers":
        ref.save_pretrained(path)
    else:
        workers(2).run(_save_fused, family, path)
    out = workers(2).run(_load_case, path)
    ref.config._attn_implementation = "eager"
    with torch.no_grad():
        logits = ref.eval()(input_ids=hf_tokens(2)).logits
    assert rel(torch.cat([o[0] for o in out]), logits) < 1e-6
    full = dict(ref.named_parameters())
    for r, (_, shards) in enumerate(out):
        assert shards.keys() == full.keys()
        for name, p in shards.items():
            want = full[name].detach()
            if p.shape != want.shape:  # an expert tensor: this rank's rows
                assert p.shape[0] * 2 == want.shape[0], name
                want = want.chunk(2)[r]
            assert torch.equal(p, want), name


def _save_fused(rank, world, family, path):
    from moe8.parallel.checkpoint import save_pretrained

    save_pretrained(
        parallelize(hf_build(family), _mesh(world)), path, max_shard_bytes=40_000, original_format=False
    )


def test_from_pretrained_errors(tmp_path):
    from moe8.parallel.load import checkpoint_files

    with pytest.raises(ValueError, match="path: expected a Hugging Face checkpoint directory"):
        checkpoint_files(str(tmp_path))


def _fsdp_case(rank, world, ep, param_dtype):
    from moe8.parallel.fsdp import apply_fsdp

    mesh = _mesh(world, ep)
    model = apply_fsdp(parallelize(hf_build("mixtral"), mesh), mesh, param_dtype=param_dtype)
    ids = hf_tokens(world).chunk(world)[rank]
    logits, loss, grads = hf_step(model, ids)
    full = {}
    for n, g in grads.items():
        full[n] = g.full_tensor() if hasattr(g, "full_tensor") else g
    # gradients are already averaged by FSDP (dense: over all ranks; experts: over dp, scaled by 1 / ep)
    # experts: gather the ep shards of this dp replica
    from moe8.parallel.hf import EXPERT_PARAMS

    ep_mods = {n for n, _ in experts_modules(model)}
    for n in list(full):
        module, _, leaf = n.rpartition(".")
        if module in ep_mods and leaf in EXPERT_PARAMS:
            group = mesh["ep"].get_group()
            parts = [torch.empty_like(full[n]) for _ in range(ep)]
            dist.all_gather(parts, full[n].contiguous(), group=group)
            full[n] = torch.cat(parts)
    return logits.float(), loss.float(), full


@pytest.mark.parametrize("world, ep, param_dtype", [(2, 2, None), (4, 2, None), (2, 2, torch.bfloat16)])
def test_fsdp2(workers, world, ep, param_dtype):
    """FSDP2 on gloo: dense parameters sharded over all ranks, experts over dp when dp > 1, fp32 reduce. fp32
    params: logits, loss and the reduced gradients equal the one-process model's on the concatenated batch;
    bf16 params (MixedPrecisionPolicy): within bf16 rounding."""
    out = workers(world).run(_fsdp_case, ep, param_dtype)
    ref = hf_build("mixtral").to(param_dtype or torch.float32)  # bf16: the same model in bf16, one process
    logits, loss, grads = hf_step(ref, hf_tokens(world))
    logits, loss, grads = logits.float(), loss.float(), {n: g.float() for n, g in grads.items()}
    tol = 1e-6 if param_dtype is None else 2e-2
    assert rel(torch.cat([o[0] for o in out]), logits) < tol
    assert abs(sum(o[1].item() for o in out) / world - loss.item()) < tol * abs(loss.item())
    for o in out:
        assert o[2].keys() == grads.keys()
        for n, g in grads.items():
            assert rel(o[2][n].float(), g) < tol, n


def _train_state(rank, world, ep, path, fsdp):
    from moe8.parallel.checkpoint import load_state, save_state
    from moe8.parallel.fsdp import apply_fsdp, average_grads

    def make():
        mesh = _mesh(world, ep)
        model = parallelize(hf_build("mixtral"), mesh)
        if fsdp:
            apply_fsdp(model, mesh, param_dtype=None)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, opt, seed):
        ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(100 * seed + rank))
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if not fsdp:
            average_grads(model, _mesh(world, ep))
        opt.step()
        return loss.detach()

    model, opt = make()
    step(model, opt, 1)
    save_state(model, opt, path)
    after = [step(model, opt, s) for s in (2, 3)]
    model2, opt2 = make()
    step(model2, opt2, 9)  # different weights and moments, then overwritten by the load
    load_state(model2, opt2, path)
    again = [step(model2, opt2, s) for s in (2, 3)]
    return after, again


@pytest.mark.parametrize("world, ep, fsdp", [(2, 2, False), (4, 2, False), (4, 2, True)])
def test_training_state_roundtrip(workers, tmp_path, world, ep, fsdp):
    """save_state / load_state (torch.distributed.checkpoint) of an expert-parallel model and its AdamW state,
    plain (average_grads; dp 1 and 2) and under FSDP2 (dp 2 x ep 2): two more steps after the load give bitwise the losses of the run that
    went on after the save."""
    out = workers(world).run(_train_state, ep, str(tmp_path / "state"), fsdp)
    for after, again in out:
        assert [a.item() for a in after] == [a.item() for a in again]
        assert after[0].item() != after[1].item()


def _checkpointed(rank, world):
    model = hf_build("qwen3_moe")
    model.gradient_checkpointing_enable()
    parallelize(model, _mesh(world))
    return hf_step(model, hf_tokens(world).chunk(world)[rank])


def test_hf_gradient_checkpointing(workers):
    """Gradient checkpointing recomputes each layer's forward, its dispatch included, in the backward (every
    rank in the same order): the results still equal the one-process model's."""
    out = [(*o, None, None) for o in workers(2).run(_checkpointed)]
    _assert_hf_matches(out, hf_step(hf_build("qwen3_moe"), hf_tokens(2)), 2, 1e-6)


LORA_TARGETS = ("q_proj", "v_proj", "experts")


def hf_lora_build(family):
    """hf_build + moe8.lora.apply_lora (r 4, alpha 8) on q_proj, v_proj and the experts, every LoRA B factor
    made random (they start at zero, which would leave the A factors without gradient). The default fusions,
    but fuse_loss off: hf_step compares the logits of the training forward."""
    from moe8.lora import apply_lora

    base = moe8.accelerate(hf_build(family), fuse_loss=False)  # apply_lora keeps the model's Config
    model = apply_lora(base, r=4, alpha=8, targets=LORA_TARGETS)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("lora_B", "lora_B.weight")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _lora_case(rank, world, family):
    from moe8.parallel.hf import LORA_PARAMS

    try:
        model = hf_lora_build(family)
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        parallelize(model, _mesh(world))
        local = {
            f"{n}.{p}": tuple(getattr(m, p).shape) for n, m in experts_modules(model) for p in LORA_PARAMS
        }
        ids = hf_tokens(world).chunk(world)[rank]
        logits, loss, grads = hf_step(model, ids)
        unparallelize(model)
        restored = all(torch.equal(p, full[n]) for n, p in model.named_parameters())
        restored = restored and all("forward" not in m.__dict__ for _, m in experts_modules(model))
        return logits, loss, grads, local, restored
    finally:
        moe8.disable()


@pytest.mark.parametrize("family", ("qwen3_moe", "mixtral"))
def test_hf_expert_lora_matches_single_process(workers, family):
    """moe8.lora on q_proj, v_proj and the experts, then parallelize() on 2 ranks: each rank holds its experts'
    LoRA factors ([E / 2, ...]); logits, loss and the gradient of every LoRA factor (the only trainable
    parameters; attention LoRA: mean over ranks, expert LoRA: the shards, scaled by grad_scale) equal the
    single-process model's on the concatenated batch. unparallelize() gives back the full factors."""
    out = workers(2).run(_lora_case, family)
    try:
        model = hf_lora_build(family)
        ref = hf_step(model, hf_tokens(2))
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    finally:
        moe8.disable()
    assert all(o[4] for o in out)
    for o in out:  # each rank holds E / 2 experts of every expert LoRA factor
        assert o[3] and all(s == (shapes[k][0] // 2, *shapes[k][1:]) for k, s in o[3].items())
    assert ref[2].keys() == shapes.keys()
    assert any("experts.down_lora_A" in n for n in shapes) and any("q_proj.lora_A" in n for n in shapes)
    _assert_hf_matches(out, ref, 2, 1e-6)
