"""LoRA over FP8 bases quantised as the model is made (moe8.finetune.fp8_load): the same weights frozen to the same
FP8 codes and scales as freeze_base_fp8 after a whole bf16 load, and never more than one decoder layer's adapted
weights alive in bf16 while the model is loaded or built (counted through the parameters' registrations, with
the whole-model load as the control that shows the count can fail)."""

import contextlib
import re
import weakref

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0", reason="moe8 finetune needs transformers>=5")

import test_finetune  # noqa: E402 - its fixtures
from test_hf import build, config  # noqa: E402

from moe8 import hf, lora  # noqa: E402
from moe8.finetune import fp8_load  # noqa: E402
from moe8.finetune.config import Config  # noqa: E402
from moe8.finetune.data import byte_tokenizer  # noqa: E402
from moe8.finetune.model import build_model, model_config  # noqa: E402
from moe8.fp8 import frozen_fp8  # noqa: E402

_undo_moe8 = test_finetune._undo_moe8  # moe8 undone after each test
CPU, BF16 = torch.device("cpu"), torch.bfloat16
TARGETS = list(lora.TARGETS)


def frozen(model) -> dict:
    """name -> (codes, scales) of every weight held in FP8 only."""
    return {
        n: (f.value.q, f.value.scale) for n, p in model.named_parameters() if (f := frozen_fp8(p)) is not None
    }


def assert_same_frozen(got: dict, want: dict) -> None:
    assert want and sorted(got) == sorted(want)
    for n in want:
        assert torch.equal(got[n][0], want[n][0]) and torch.equal(got[n][1], want[n][1]), n


def whole_then_frozen(model):
    """Today's order: LoRA on the whole bf16 model, then its bases quantised (freeze_base_fp8)."""
    hf.accelerate(model, fp8="blockwise")
    lora.apply_lora(model, r=4, alpha=8, targets=TARGETS)
    n = lora.freeze_base_fp8(model)
    return model, n


def adapted(model) -> dict:
    """(id of module, parameter name) -> its name, for every weight apply_lora(TARGETS) adapts."""
    return {
        (id(m), p): f"{name}.{p}"
        for name, m in model.named_modules()
        for p in ("weight", "gate_up_proj", "down_proj")
        if lora.base_layout(name, m, p, TARGETS) is not None
    }


@contextlib.contextmanager
def live_bf16():
    """Watches every parameter registered in a module (before fp8_load's own hook sees it): `peak(model)` is
    then the most bytes of the model's adapted weights alive at once in a dtype other than FP8-only. A
    parameter counts from its registration until it is freed (a weak reference)."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    seen, alive_at = (
        [],
        [],
    )  # (module id, name, weakref, bytes); indices of the ones alive at each registration

    def hook(module, name, p):
        if p is not None and not p.is_meta and frozen_fp8(p) is None:
            seen.append((id(module), name, weakref.ref(p), p.numel() * p.element_size()))
        alive_at.append([i for i, s in enumerate(seen) if s[2]() is not None])

    class Watch:
        def peak(self, model) -> int:
            targets = adapted(model)
            return max(sum(seen[i][3] for i in at if seen[i][:2] in targets) for at in alive_at)

    handle = register_module_parameter_registration_hook(hook)
    try:
        yield Watch()
    finally:
        handle.remove()


def adapted_bytes(model) -> int:
    """bf16 bytes of every weight apply_lora(TARGETS) adapts."""
    return sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if n in set(adapted(model).values())
    )


def layer_bytes(model) -> int:
    """bf16 bytes of the adapted weights of the decoder layer that has the most."""
    targets = set(adapted(model).values())
    return max(
        sum(p.numel() * p.element_size() for n, p in layer.named_parameters(prefix=name) if n in targets)
        for name, layer in fp8_load.decoder_layers(model)
    )


@pytest.fixture(params=["qwen3_moe", "gpt_oss"])  # gpt_oss: experts stored transposed ([E, H, 2I])
def saved(request, tmp_path):
    torch.manual_seed(0)
    build(request.param).to(BF16).save_pretrained(tmp_path / request.param)
    return tmp_path / request.param


def load(path, quantise: bool):
    from transformers import AutoModelForCausalLM

    with fp8_load.frozen_as_loaded(TARGETS if quantise else [], CPU) as done:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=BF16)
    return model, done.count


def test_from_pretrained_quantised_as_loaded_matches_freezing_after(saved):
    ref, n_ref = whole_then_frozen(load(saved, quantise=False)[0])
    model, n = load(saved, quantise=True)
    assert n == n_ref > 0
    kept = {k: v.clone() for k, v in model.state_dict().items() if frozen_fp8(v) is None}
    model, after = whole_then_frozen(model)
    assert after == 0  # freeze_base_fp8 finds every base already in FP8
    assert_same_frozen(frozen(model), frozen(ref))
    ref_state = ref.state_dict()
    for k, v in kept.items():  # the weights LoRA leaves alone: loaded as they are
        assert torch.equal(v, ref_state[k]), k
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_from_pretrained_holds_one_weight_at_a_time(saved):
    with live_bf16() as whole:
        model = load(saved, quantise=False)[0]
    layer = layer_bytes(model)
    assert whole.peak(model) == adapted_bytes(model) > layer  # the control: every adapted weight alive
    with live_bf16() as quantised:
        model = load(saved, quantise=True)[0]
    largest = max(p.numel() * p.element_size() for p in model.parameters() if frozen_fp8(p) is not None)
    assert 0 < quantised.peak(model) <= largest < layer


def test_random_model_quantised_a_layer_at_a_time():
    c = config("qwen3_moe", num_hidden_layers=3)
    torch.manual_seed(1)
    with live_bf16() as whole:
        plain, _ = fp8_load.random_model(c, BF16, CPU)  # no targets: every layer kept in bf16
    torch.manual_seed(1)
    with live_bf16() as layered:
        model, n = fp8_load.random_model(c, BF16, CPU, TARGETS)
    layer = layer_bytes(model)
    assert whole.peak(plain) == adapted_bytes(plain) > 2 * layer  # the control: three layers' worth alive
    assert 0 < layered.peak(model) <= layer
    ref, n_ref = whole_then_frozen(plain)  # the same seed: the same bf16 values, quantised after
    assert n == n_ref
    model, after = whole_then_frozen(model)
    assert after == 0
    assert_same_frozen(frozen(model), frozen(ref))


def test_random_model_initialised_as_from_config():
    """Not from_config's values (its torch default inits draw first) but the same distributions, the same
    buffers (RoPE's, computed by _init_weights on the device) and the same values for the same seed."""
    from transformers import AutoModelForCausalLM

    c = config("qwen3_moe", hidden_size=128, initializer_range=0.02)
    torch.manual_seed(3)
    want = AutoModelForCausalLM.from_config(c, dtype=BF16)
    torch.manual_seed(3)
    got, _ = fp8_load.random_model(c, BF16, CPU)
    torch.manual_seed(3)
    again, _ = fp8_load.random_model(c, BF16, CPU)
    assert [n for n, _ in got.named_parameters()] == [n for n, _ in want.named_parameters()]
    assert got.lm_head.weight is not got.model.embed_tokens.weight  # the config's ties kept (none here)
    for (n, g), (_, w), (_, a) in zip(
        got.named_parameters(), want.named_parameters(), again.named_parameters()
    ):
        assert torch.equal(g, a), n
        if w.dim() > 1:
            assert abs(g.float().std() / w.float().std() - 1) < 0.15 and abs(g.float().mean()) < 0.01, n
        else:
            assert torch.equal(g, w), n  # norms: ones
    for (n, g), (_, w) in zip(got.named_buffers(), want.named_buffers()):
        assert torch.equal(g, w), n


def test_random_model_keeps_tied_embeddings():
    c = config("qwen3_moe", tie_word_embeddings=True)
    model, _ = fp8_load.random_model(c, BF16, CPU, TARGETS)
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.weight.is_meta


def frozen_line(lines) -> int:
    hit = next(m for x in lines if (m := re.search(r"lora: (\d+) frozen base weights held in FP8", x)))
    return int(hit[1])


def finetune_model(**kw):
    cfg = Config(progress=False, method="lora", fp8="blockwise", lora_r=4, **kw)
    config, path = model_config(cfg)
    lines = []
    model, _ = build_model(cfg, config, path, byte_tokenizer(), BF16, CPU, lines.append)
    return model, lines


def test_build_model_from_a_directory(tmp_path):
    """moe8 finetune's build_model on a saved model: its bases quantised as loaded, the log's count right,
    the codes those of the whole load frozen after."""
    from transformers import AutoModelForCausalLM

    d = tmp_path / "model"
    test_finetune.tiny_model(moe8=False).save_pretrained(d)  # fp32 on disk: cast to bf16 as loaded
    model, lines = finetune_model(model=str(d))
    ref, n_ref = whole_then_frozen(AutoModelForCausalLM.from_pretrained(str(d), dtype=BF16))
    assert frozen_line(lines) == n_ref
    assert_same_frozen(frozen(model), frozen(ref))
    assert not any("held the whole bf16 model" in x for x in lines)


def test_build_model_from_a_model_config():
    import json

    spec = json.dumps({**config("qwen3_moe", max_position_embeddings=256).to_dict(), "vocab_size": 300})
    model, lines = finetune_model(model_config=spec)
    linear = sum(isinstance(m, lora.LoraLinear) for m in model.modules())
    experts = sum(hasattr(m, "gate_up_lora_A") for m in model.modules())
    assert frozen_line(lines) == len(frozen(model)) == linear + 2 * experts > 0


def test_build_model_says_when_nothing_was_quantised_as_loaded(tmp_path, monkeypatch):
    """A load whose weights transformers set another way: quantised after it, the log says the load held the
    whole bf16 model, and the count is still every adapted weight."""
    d = tmp_path / "model"
    test_finetune.tiny_model(moe8=False).save_pretrained(d)

    @contextlib.contextmanager
    def nothing(targets, device):
        yield fp8_load.Loaded()

    monkeypatch.setattr(fp8_load, "frozen_as_loaded", nothing)
    model, lines = finetune_model(model=str(d))
    assert any("the load held the whole bf16 model" in x for x in lines)
    assert frozen_line(lines) == len(frozen(model)) > 0
