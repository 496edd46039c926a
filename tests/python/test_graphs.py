"""moe8.graphs: checkpointed decoder layers replayed as CUDA graphs. On a GPU, a tiny Qwen3-MoE with moe8 LoRA
(bf16 base and FP8 base) trains the same with graphs as without: losses and every adapter gradient over
several optimizer steps, gradient accumulation, a new sequence length, a parameter whose storage moves; and
what graphs can't reproduce runs eagerly with its reason counted (dropout, transformers recording router
logits, more signatures than max_shapes). The refusals run everywhere."""

import pytest
import torch
from conftest import _cuda

pytest.importorskip("transformers", minversion="5.0", reason="moe8.graphs takes transformers>=5 layers")

from moe8 import graphs, hf, lora  # noqa: E402

needs_gpu = pytest.mark.skipif(not _cuda(), reason="no CUDA build or no GPU")
LAYERS = 3


# a Qwen3-MoE with head dims the GPU's attention kernels take (test_hf.build's are 8)
TINY = dict(
    hidden_size=128,
    head_dim=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    moe_intermediate_size=128,
    max_position_embeddings=256,
)


def make(fp8_base=False, dropout=0.0, router_logits=False, seed=0, adapter_dtype=torch.bfloat16):
    from test_hf import build

    model = build("qwen3_moe", seed=seed, **TINY, output_router_logits=router_logits).to(
        "cuda", torch.bfloat16
    )
    model.set_attn_implementation("sdpa")  # as training runs it (the tiny config's default is eager)
    lora.apply_lora(
        model, r=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj", "experts"), dropout=dropout
    )
    if fp8_base:
        hf.accelerate(model, fp8="blockwise")
        lora.freeze_base_fp8(model)
    g = torch.Generator("cuda").manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=g)
            if p.requires_grad and adapter_dtype is not None:
                p.data = p.data.to(adapter_dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def ids_of(seq, seed=0, batch=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, seq), generator=g).cuda()


def trained(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def train(model, batches, steps, keep_last=False):
    """Per step: (loss, aux loss or None, {name: gradient}) after its micro-batches, then an AdamW step.
    keep_last: each micro-batch's outputs, with their autograd graph, stay alive until the next forward."""
    opt = torch.optim.AdamW(trained(model).values(), lr=1e-3)
    out, alive = [], []
    for _ in range(steps):
        losses, aux = [], []
        for ids in batches:
            o = model(input_ids=ids, labels=ids)
            o.loss.backward()
            losses.append(o.loss.item())
            aux.append(None if getattr(o, "aux_loss", None) is None else o.aux_loss.item())
            alive[:] = [o] if keep_last else []  # else no autograd graph of this step outlives it
            del o
        out.append((losses, aux, {n: p.grad.clone() for n, p in trained(model).items()}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_same_training(a, b, tol=2e-2):
    assert len(a) == len(b)
    for (la, xa, ga), (lb, xb, gb) in zip(a, b):
        for u, v in zip(la, lb):
            assert abs(u - v) <= 1e-3 * abs(v) + 1e-4, (la, lb)
        for u, v in zip(xa, xb):
            assert (u is None) == (v is None) and (u is None or abs(u - v) <= 1e-3 * abs(v) + 1e-4)
        assert ga.keys() == gb.keys()
        for n in gb:
            assert torch.isfinite(ga[n]).all(), n
            assert rel(ga[n], gb[n]) < tol, (n, rel(ga[n], gb[n]))


@needs_gpu
@pytest.mark.parametrize("fp8_base", [False, True], ids=["bf16-base", "fp8-base"])
def test_graphs_train_as_eager(fp8_base):
    steps, batches = 4, [ids_of(64)]
    eager = train(make(fp8_base), batches, steps)
    model = make(fp8_base)
    assert graphs.capture_layers(model) == LAYERS
    graphed = train(model, batches, steps)
    s = graphs.stats(model)
    assert s["layers"] == LAYERS and s["captured"] == 2 * LAYERS, s  # a forward and a backward graph each
    assert s["replayed"] == LAYERS * (steps - 1) and s["eager"] == LAYERS, s  # step 0 warms up
    assert len(graphs._graphed(model)[0].shared.statics) == 1  # every layer's graphs read the same buffers
    assert_same_training(graphed, eager)
    assert graphs.release_layers(model) == LAYERS and graphs.stats(model)["layers"] == 0


@needs_gpu
def test_graphs_capture_with_last_step_alive():
    """A loop that keeps the previous step's outputs (and so its autograd graph and the parameters' gradient
    accumulators) alive into the next forward still captures; the pool holds memory and no tensor outlives it."""
    steps, batches = 3, [ids_of(64)]
    eager = train(make(), batches, steps, keep_last=True)
    model = make()
    graphs.capture_layers(model)
    graphed = train(model, batches, steps, keep_last=True)
    s = graphs.stats(model)
    assert s["captured"] == 2 * LAYERS and s["replayed"] == LAYERS * (steps - 1), s
    assert not any("capture failed" in why for why in s["reasons"]), s
    assert s["pool_reserved_gib"] > 0 and s["pool_allocated_gib"] < 1e-3, s
    assert_same_training(graphed, eager)


@needs_gpu
def test_graphs_accumulate_and_new_shapes():
    """Two micro-batches a step (gradients accumulate across replays), then a second sequence length: its own
    graphs, the first length's kept (max_shapes 2)."""
    batches = [ids_of(48, 0), ids_of(48, 1)]
    eager_model, model = make(), make()
    graphs.capture_layers(model, max_shapes=2)
    assert_same_training(train(model, batches, 3), train(eager_model, batches, 3))
    other = [ids_of(80, 2)]
    assert_same_training(train(model, other, 3), train(eager_model, other, 3))
    s = graphs.stats(model)
    assert s["captured"] == 4 * LAYERS, s


@needs_gpu
def test_graphs_past_max_shapes_run_eagerly():
    model, eager_model = make(), make()
    graphs.capture_layers(model, max_shapes=1)
    for seq in (32, 40):
        assert_same_training(train(model, [ids_of(seq)], 2), train(eager_model, [ids_of(seq)], 2))
    s = graphs.stats(model)
    assert s["captured"] == 2 * LAYERS and any("max_shapes=1" in k for k in s["reasons"]), s


@needs_gpu
def test_graphs_capture_again_when_storage_moves():
    model, eager_model = make(), make()
    graphs.capture_layers(model)
    batches = [ids_of(32)]
    assert_same_training(train(model, batches, 2), train(eager_model, batches, 2))
    for m in (model, eager_model):
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_A" in n:
                    p.data = p.data.clone()  # new storage, same values
    assert_same_training(train(model, batches, 2), train(eager_model, batches, 2))
    assert graphs.stats(model)["captured"] == 4 * LAYERS


@needs_gpu
@pytest.mark.filterwarnings("ignore:moe8.graphs")
@pytest.mark.parametrize("case", ["dropout", "router_logits"])
def test_graphs_fall_back_where_they_cannot_replay(case):
    kw = dict(
        dropout=dict(dropout=0.1), router_logits=dict(router_logits=True), fp32=dict(adapter_dtype=None)
    )[case]
    model = make(**kw)
    graphs.capture_layers(model)
    batches = [ids_of(32)]
    if case != "dropout":  # router logits: the aux loss needs every layer's, recorded by hooks
        assert_same_training(train(model, batches, 2), train(make(**kw), batches, 2))
    else:
        train(model, batches, 2)
    s = graphs.stats(model)
    want = dict(dropout="dropout", router_logits="recording outputs")[case]
    assert s["captured"] == 0 and s["replayed"] == 0 and s["eager"] == 2 * LAYERS, s
    assert any(want in k for k in s["reasons"]), s


@needs_gpu
def test_graphs_fp32_adapters():
    """apply_lora's default: fp32 adapters on a bf16 model (cast per use inside the graphs)."""
    model, batches = make(adapter_dtype=None), [ids_of(32)]
    graphs.capture_layers(model)
    assert_same_training(train(model, batches, 2), train(make(adapter_dtype=None), batches, 2))
    s = graphs.stats(model)
    assert s["captured"] == 2 * LAYERS and s["replayed"] == LAYERS, s


def test_capture_layers_refusals():
    from test_hf import build

    model = build("qwen3_moe")
    with pytest.raises(ValueError, match="gradient_checkpointing_enable"):
        graphs.capture_layers(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for bad in (dict(warmup=0), dict(warmup=True), dict(max_shapes=0), dict(max_shapes=1.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            graphs.capture_layers(model, **bad)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            graphs.capture_layers(model)
    assert graphs.stats(model)["layers"] == 0 and graphs.release_layers(model) == 0


def test_dropout_is_found_in_any_of_its_forms():
    """What makes a layer's recomputation draw other random numbers: an nn.Dropout with p > 0, or a module's
    float attention / LoRA dropout rate > 0 (transformers' attention modules hold theirs as a float)."""

    class Attention(torch.nn.Module):
        def __init__(self, rate):
            super().__init__()
            self.attention_dropout = rate

    assert graphs._dropout(torch.nn.Dropout(0.1)) and not graphs._dropout(torch.nn.Dropout(0.0))
    assert graphs._dropout(Attention(0.1)) and not graphs._dropout(Attention(0.0))
    assert not graphs._dropout(torch.nn.Linear(2, 2))
