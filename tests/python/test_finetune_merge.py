"""`moe8 merge` on CPU: a LoRA adapter from `moe8 finetune` on the built-in tiny Qwen3-MoE model, merged into a
checkpoint that plain transformers loads with the logits of base + adapter (expert LoRA included); the folding
of one experts module (both layouts, GPT-OSS's [E, in, out] included) against a float64 reference; and every bad
input (clear message, exit status 2, nothing written)."""

import copy
import json
import shutil

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0", reason="moe8 merge needs transformers>=5")

from test_finetune import finetune_rc, flags, text_file  # noqa: E402, F401 (text_file: a fixture)
from test_lora import lora_model  # noqa: E402

from moe8 import cli, hf  # noqa: E402
from moe8.finetune.merge import fold_experts, merge_lora  # noqa: E402
from moe8.lora import load_adapter  # noqa: E402


@pytest.fixture(autouse=True)
def _undo_moe8():
    yield
    hf.disable()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, text_file):  # noqa: F811
    """A LoRA adapter (attention and experts, r 4) of 3 steps on the built-in tiny model, its base beside it."""
    from moe8 import finetune

    out = tmp_path_factory.mktemp("lora") / "adapter"
    argv = flags(out, text_file, "--method", "lora", "--lora_r", "4", "--steps", "3", "--eval_every", "0")
    assert finetune.main(argv) == 0
    hf.disable()
    return out


def merge_rc(capsys, *argv):
    rc = cli.main(["merge", *map(str, argv)])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def plain_model(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert not hf.is_accelerated(model)
    return model.eval()


def test_merged_checkpoint_matches_base_plus_adapter(tmp_path, adapter, capsys):
    out = tmp_path / "merged"
    rc, text = merge_rc(capsys, adapter, "--out", out)
    assert rc == 0, text
    assert "folded 10 LoRA modules" in text  # 2 layers x (4 attention projections + 1 experts module)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert "moe8" not in (out / "config.json").read_text()  # transformers' own experts implementation

    merged, base = plain_model(out), plain_model(adapter / "base_model")
    merged_sd, base_sd = merged.state_dict(), base.state_dict()  # the fused [E, ...] expert layout
    assert merged_sd.keys() == base_sd.keys()
    for name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "self_attn.q_proj.weight"):
        key = f"model.layers.1.{name}"
        assert (merged_sd[key] - base_sd[key]).abs().max() > 1e-4, f"{key} did not change"
    reference = load_adapter(plain_model(adapter / "base_model"), adapter)
    assert hf.is_accelerated(reference)  # the expert LoRA runs on moe8
    ids = torch.randint(0, merged.config.vocab_size, (3, 29), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        without = base(input_ids=ids).logits
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
    assert (without - want).abs().max() > 100 * 1e-5 * scale  # the adapter matters at this tolerance

    reference.model.layers[0].mlp.experts.gate_up_lora_B.data.zero_()  # and so does its expert LoRA
    with torch.no_grad():
        assert (reference(input_ids=ids).logits - want).abs().max() > 100 * 1e-5 * scale


@pytest.mark.filterwarnings("ignore:Unsupported layer type")  # PEFT on the fused experts' target_parameters
def test_merged_weights_match_peft_merge_and_unload(tmp_path, adapter, capsys):
    """PEFT's own folding of the same adapter (its ParamWrapper layout, not moe8's) gives the same weights."""
    peft = pytest.importorskip("peft", minversion="0.17", reason="expert LoRA adapters need peft>=0.17")
    out = tmp_path / "merged"
    assert merge_rc(capsys, adapter, "--out", out)[0] == 0
    want = peft.PeftModel.from_pretrained(plain_model(adapter / "base_model"), adapter).merge_and_unload()
    want_sd, got_sd = want.state_dict(), plain_model(out).state_dict()
    assert want_sd.keys() == got_sd.keys()
    for key, w in want_sd.items():
        torch.testing.assert_close(got_sd[key], w, rtol=1e-6, atol=1e-6 * w.abs().max().item(), msg=key)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # [E, out, in] and GPT-OSS's [E, in, out]
def test_fold_experts_matches_float64(family):
    _, model = lora_model(family, r=3)
    name, experts = next((n, m) for n, m in model.named_modules() if hasattr(m, "gate_up_lora_A"))
    s = experts.lora_scaling
    want = {}
    for w in ("gate_up", "down"):
        W = getattr(experts, f"{w}_proj").detach().double()
        A = getattr(experts, f"{w}_lora_A").detach().double()
        B = getattr(experts, f"{w}_lora_B").detach().double()
        assert B.abs().max() > 0
        # transposed: W[e] [in, out] + s * A[e] [in, r] @ B[e] [r, out]; else W[e] [out, in] + s * B[e] @ A[e]
        rows = [(A[e] @ B[e]) if experts.is_transposed else (B[e] @ A[e]) for e in range(W.shape[0])]
        want[w] = W + s * torch.stack(rows)
    fold_experts(experts)
    for w in ("gate_up", "down"):
        got = getattr(experts, f"{w}_proj").detach()
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want[w], rtol=0, atol=1e-6)
        assert not hasattr(experts, f"{w}_lora_A") and not hasattr(experts, f"{w}_lora_B")
    assert not experts._forward_pre_hooks, f"{name} still asks for moe8"


def test_merge_lora_removes_every_wrapper():
    from moe8.lora import LoraLinear

    _, model = lora_model("qwen3_moe", r=2)
    wrapped = [m for m in model.modules() if isinstance(m, LoraLinear) or hasattr(m, "gate_up_lora_A")]
    assert len(wrapped) > model.config.num_hidden_layers * 4
    assert merge_lora(model) == len(wrapped)
    assert not any(isinstance(m, LoraLinear) for m in model.modules())
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert not hasattr(model, "_moe8_lora")
    with pytest.raises(ValueError, match="no moe8 LoRA"):
        merge_lora(model)


def test_overwrite_replaces_the_output(tmp_path, adapter, capsys):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    rc, text = merge_rc(capsys, adapter, "--out", out, "--overwrite")
    assert rc == 0, text
    assert (out / "model.safetensors").is_file() and not (out / "stale.txt").exists()
    assert not list(tmp_path.glob(".merged.merging-*"))


# ------------------------------------------------------------------------------------------------ bad input
def _copy_adapter(src, dst, base_name=""):
    """The adapter files alone (no base_model/ beside them), base_model_name_or_path set to base_name."""
    dst.mkdir()
    shutil.copy2(src / "adapter_model.safetensors", dst)
    config = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps(dict(config, base_model_name_or_path=base_name)))
    return dst


def _other_base(adapter, path):
    """A base of the same family whose experts are narrower than the adapter's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = copy.deepcopy(AutoConfig.from_pretrained(adapter / "base_model"))
    config.moe_intermediate_size //= 2
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def bad_inputs(tmp_path, adapter):
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "adapter_model.safetensors").write_bytes(b"")
    lone = _copy_adapter(adapter, tmp_path / "lone")
    named = _copy_adapter(adapter, tmp_path / "named", base_name=str(tmp_path / "gone"))
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    return {
        "missing adapter": ([tmp_path / "nope"], "adapter: .*nope is not a directory"),
        "no adapter_config.json": ([no_config], "has no adapter_config.json: not a PEFT adapter"),
        "no base": (
            [lone],
            "no base model found: looked at .*lone/base_model, base_model_name_or_path .*--base",
        ),
        "base gone": ([named], "no base model found: .*base_model_name_or_path '.*gone'"),
        "bad --base": ([adapter, "--base", tmp_path / "nope"], "--base: .*nope has no config.json"),
        "not empty": ([adapter, "--out", full], "--out: .*full exists and is not empty \\(--overwrite"),
        "out is the adapter": ([adapter, "--out", adapter, "--overwrite"], "--out: .* would overlap"),
        "shapes": (
            [lone, "--base", _other_base(adapter, tmp_path / "narrow")],
            "the base .*narrow does not fit the adapter .*lone: .*shapes",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing adapter",
        "no adapter_config.json",
        "no base",
        "base gone",
        "bad --base",
        "not empty",
        "out is the adapter",
        "shapes",
    ],
)
def test_bad_input_clear_message_nothing_written(tmp_path, adapter, capsys, case):
    import re

    argv, message = bad_inputs(tmp_path, adapter)[case]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    adapter_before = sorted(adapter.rglob("*"))
    if "--out" not in argv:
        argv = [*argv, "--out", tmp_path / "merged"]
    rc, text = merge_rc(capsys, *argv)
    assert rc == 2, text
    assert re.search(message, text), text
    assert text.startswith("moe8 merge: error: ") or "\nmoe8 merge: error: " in text
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written
    assert sorted(adapter.rglob("*")) == adapter_before


def test_help_lists_merge(capsys):
    assert cli.main(["--help"]) == 0
    assert "merge " in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["merge", "--help"])
    assert e.value.code == 0 and "--overwrite" in capsys.readouterr().out
