"""The recipes (moe8/recipes/*.toml, which recipes/ in the checkout points to): each parses, names a real config
under moe8/recipes/configs whose estimated peak fits one H200 at the recipe's ep (the full-size model, counted on
the meta device), and bench/bench_recipes.py --tiny runs recipes through moe8 finetune's trainer and plain
transformers on the CPU with the same losses, writing both into its JSON."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import tomllib
import torch

pytest.importorskip("transformers", minversion="5.0", reason="moe8 finetune needs transformers>=5")

from moe8.finetune import memory  # noqa: E402
from moe8.finetune.config import make_config  # noqa: E402
from moe8.finetune.model import config_from  # noqa: E402
from moe8.finetune.recipes import DIR as RECIPES  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
H200 = 139 * 2**30  # usable bytes of one H200 as torch reports it, about


def bench():
    spec = importlib.util.spec_from_file_location("bench_recipes", ROOT / "bench" / "bench_recipes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_recipe_parses_and_fits_its_gpus():
    import dataclasses

    b = bench()
    assert sorted(p.stem for p in RECIPES.glob("*.toml")) == sorted(b.RECIPES)
    families = {"qwen3": "qwen3_moe", "gpt_oss": "gpt_oss", "mixtral": "mixtral", "olmoe": "olmoe"}
    families |= {"qwen2_moe": "qwen2_moe", "deepseek_v3": "deepseek_v3"}
    configs = {}
    for name, (config_file, _) in b.RECIPES.items():
        path = RECIPES / f"{name}.toml"
        ep = tomllib.loads(path.read_text()).get("ep", 1)
        cfg = make_config(str(path), {"ep": 1})  # ep > 1 is refused outside torchrun: estimated below
        if config_file not in configs:
            config = config_from(str(RECIPES / "configs" / config_file))
            configs[config_file] = (config, {})
        config, counted = configs[config_file]
        assert config.model_type == next(v for k, v in families.items() if name.startswith(k)), name
        key = (cfg.method, tuple(cfg.lora_targets), cfg.lora_r)
        if key not in counted:
            counted[key] = memory.count_params(config, cfg)
        counts = counted[key]
        est = memory.estimate(config, dataclasses.replace(cfg, ep=ep), counts, torch.bfloat16)
        assert est.total + memory.CONTEXT < H200, f"{name}: {est.table()}"
        if ep > 1:  # the recipe's comment: one GPU could not hold it
            assert memory.estimate(config, cfg, counts, torch.bfloat16).total > H200, name
        experts = next(
            getattr(config, k)
            for k in ("num_experts", "num_local_experts", "n_routed_experts")
            if hasattr(config, k)
        )
        assert experts % ep == 0, f"{name}: {experts} experts over ep {ep}"


def test_qwen3_30b_lora_recipe_has_bf16_adapters_and_no_other_recipe_sets_them():
    """The Qwen3-30B-A3B LoRA recipe trains bf16 adapters (their GEMMs at the base's speed, half the bytes of
    fp32 ones), which its memory estimate counts; every other recipe keeps the default."""
    import dataclasses

    for path in RECIPES.glob("*.toml"):
        table = tomllib.loads(path.read_text())
        want = "bfloat16" if path.stem == "qwen3_30b_a3b_lora" else None
        assert table.get("lora_dtype") == want, path.stem
    cfg = make_config(str(RECIPES / "qwen3_30b_a3b_lora.toml"))
    config = config_from(str(RECIPES / "configs" / "qwen3_30b_a3b.json"))
    counts = memory.count_params(config, cfg)
    bf16 = memory.estimate(config, cfg, counts, torch.bfloat16)
    fp32 = memory.estimate(config, dataclasses.replace(cfg, lora_dtype="auto"), counts, torch.bfloat16)
    T = (
        counts.lora
    )  # 642.5M adapter parameters: 16 bytes each in fp32 (factor, gradient, two states), 8 in bf16
    assert fp32.step["weights"] - bf16.step["weights"] == 2 * T
    assert (fp32.step["adamw"], fp32.step["grads"]) == (8 * T, 4 * T)
    assert (bf16.step["adamw"], bf16.step["grads"], bf16.step["master"]) == (4 * T, 2 * T, 0)
    assert fp32.total - bf16.total > 4.5 * 2**30


def test_bench_tiny_both_sides_train_alike(tmp_path):
    """gpt-oss LoRA (aux-loss weight 0.9, PEFT) and OLMoE full fine-tuning through both sides: the same losses
    from the first step on (the same init, data, objective and lr schedule), each side's own settings alike."""
    b = bench()
    names = ["gpt_oss_20b_lora", "olmoe_1b_7b_full"]
    assert b.main(["--tiny", "--out", str(tmp_path), "--recipes", ",".join(names)]) == 0
    out = json.loads((tmp_path / "recipes.json").read_text())
    assert out["info"]["tiny"] and list(out["recipes"]) == names
    for name in names:
        r = out["recipes"][name]
        recipe = tomllib.loads((RECIPES / f"{name}.toml").read_text())
        a, t = r["moe8"], r["transformers"]
        assert r["layers"] == 2 and r["method"] == recipe["method"] and r["settings_differ"] == [], name
        assert a["settings"] == t["settings"], name
        s = a["settings"]
        assert (s["lr"], s["warmup_steps"], s["micro_batch"], s["seq_len"]) == (recipe["lr"], 30, 2, 32), name
        assert a["experts_on"] == "moe8" and t["experts_on"] == "transformers", name
        assert len(a["losses"]) == len(t["losses"]) == 4 and a["lrs"] == t["lrs"], name
        assert a["lrs"][0] == pytest.approx(recipe["lr"] / 30)  # warmup's first step, on both sides
        for side in (a, t):
            assert all(4 < x < 7 for x in side["losses"]), (
                name
            )  # cross-entropy near ln(300) ~ 5.7: random init
            assert all(x is not None and x > 0 for x in side["aux_losses"]), name
            assert side["tokens_per_s"] > 0 and side["seconds"] > 0, name
            for k in ("peak_gib", "peak_backward_gib", "peak_step_gib", "start_gib"):
                assert math.isfinite(side[k]) and side[k] >= 0, (name, k)
            assert side["peak_gib"] == max(side["peak_backward_gib"], side["peak_step_gib"]), name
        assert a["estimate_gib"] > 0 and r["estimate_gib"] == a["estimate_gib"], name
        # fp32 on the CPU: the first step's loss agrees to rounding (the aux loss is not in either recorded loss)
        assert a["losses"][0] == pytest.approx(t["losses"][0], rel=1e-5, abs=1e-5), name
        assert a["aux_losses"][0] == pytest.approx(t["aux_losses"][0], rel=1e-4), name
        # full fine-tuning stays equal to rounding; LoRA's A factors are drawn differently by moe8.lora and PEFT
        tol = 1e-4 if r["method"] == "full" else 1e-2
        assert a["losses"] == pytest.approx(t["losses"], abs=tol), name


def test_bench_tiny_bf16_adapters_on_both_sides(tmp_path):
    """The Qwen3-30B-A3B LoRA recipe (lora_dtype bfloat16) through both sides: moe8's and PEFT's adapters and
    AdamW's tensors in bf16, so the settings agree; fp32 adapters on one side show up in settings_differ."""
    b = bench()
    name = "qwen3_30b_a3b_lora"
    assert b.main(["--tiny", "--out", str(tmp_path), "--recipes", name]) == 0
    r = json.loads((tmp_path / "recipes.json").read_text())["recipes"][name]
    a, t = r["moe8"], r["transformers"]
    assert r["settings_differ"] == [] and a["settings"] == t["settings"]
    assert a["settings"]["adapter_dtype"] == a["settings"]["optimizer_dtype"] == "bfloat16"
    # B = 0: the base's loss on both sides, moe8's through the recipe's FP8 base weights (blockwise codes of
    # PEFT's bf16 ones), so within their rounding
    assert a["losses"][0] == pytest.approx(t["losses"][0], rel=1e-3)
    assert a["losses"][0] != t["losses"][0]  # moe8's side did run the FP8 base
    assert all(4 < x < 7 for x in a["losses"] + t["losses"])
    cfg = make_config(str(RECIPES / f"{name}.toml"))
    model = torch.nn.Linear(4, 4)
    fp32 = b.settings(cfg, torch.optim.AdamW(model.parameters()), model, 0.0, ["q_proj"])
    model.bfloat16()
    bf16 = b.settings(cfg, torch.optim.AdamW(model.parameters()), model, 0.0, ["q_proj"])
    assert {k for k in fp32 if fp32[k] != bf16[k]} == {"adapter_dtype", "optimizer_dtype", "dtype"}


def test_bench_tiny_order_of_sides_changes_nothing(tmp_path):
    """transformers first, then moe8: the same losses and lrs as the other way round (no state of the first side,
    moe8's patches of transformers included, reaches the second)."""
    b = bench()
    runs = {}
    for first in ("moe8", "transformers"):
        out = tmp_path / first
        assert (
            b.main(["--tiny", "--out", str(out), "--recipes", "qwen2_moe_a2_7b_full", "--first", first]) == 0
        )
        runs[first] = json.loads((out / "recipes.json").read_text())["recipes"]["qwen2_moe_a2_7b_full"]
    assert (
        runs["moe8"]["order"] == ["moe8", "transformers"]
        and runs["transformers"]["order"][0] == "transformers"
    )
    for side in ("moe8", "transformers"):
        x, y = runs["moe8"][side], runs["transformers"][side]
        assert x["losses"] == pytest.approx(y["losses"], abs=1e-6) and x["lrs"] == y["lrs"], side
        assert x["settings"] == y["settings"], side


def test_bench_writes_each_recipe_when_done(tmp_path, monkeypatch):
    """recipes.json holds every finished recipe while the next runs: a run cut short keeps them."""
    b = bench()
    done = []

    def fake(name, args, device):
        if done:
            saved = json.loads((tmp_path / "recipes.json").read_text())
            assert list(saved["recipes"]) == done
            raise KeyboardInterrupt
        done.append(name)
        return dict(marker=name)

    monkeypatch.setattr(b, "run_recipe", fake)
    with pytest.raises(KeyboardInterrupt):
        b.main(["--tiny", "--out", str(tmp_path), "--recipes", "mixtral_8x7b_lora,olmoe_1b_7b_full"])
    assert json.loads((tmp_path / "recipes.json").read_text())["recipes"] == {
        "mixtral_8x7b_lora": {"marker": "mixtral_8x7b_lora"}
    }


def test_bench_rejects_bad_arguments(capsys):
    b = bench()
    for argv, word in (
        (["--recipes", "nope"], "--recipes"),
        (["--steps", "2"], "--steps"),
        (["--layers", "-1"], "--layers"),
        (["--full", "--tiny"], "--full"),
        (["--full", "--layers", "4"], "--full"),
    ):
        with pytest.raises(SystemExit):
            b.main(["--out", "/nonexistent/never", *argv])
        assert word in capsys.readouterr().err


def test_bench_full_leaves_out_the_multi_gpu_recipes():
    """--full runs the one-GPU recipes as written; those with ep > 1 are named and left out."""
    b = bench()
    eps = {n: b.recipe_ep(n) for n in b.RECIPES}
    assert eps["gpt_oss_20b_full"] == 8 and eps["qwen2_moe_a2_7b_full"] == 4
    assert all(ep == 1 for n, ep in eps.items() if n not in ("gpt_oss_20b_full", "qwen2_moe_a2_7b_full"))
    args = b.argparse.Namespace(
        full=True, tiny=False, layers=0, seq_len=1024, steps=0, lr=0.0, micro_batch=0, set={}
    )
    cfg = b.recipe_config("qwen3_30b_a3b_lora", args, "/tmp/never-written")
    assert cfg.num_layers == 0 and cfg.seq_len == 4096 and cfg.micro_batch == 2  # the recipe's own


def test_bench_a_side_out_of_memory_is_recorded_and_the_other_side_kept(tmp_path, monkeypatch, capsys):
    """--full runs real sizes: a side that runs out of GPU memory is an error entry of that side, the other
    side's figures stay, and the table says which side failed."""
    b = bench()

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore detail")

    monkeypatch.setattr(b, "run_transformers", oom)
    assert b.main(["--tiny", "--out", str(tmp_path), "--recipes", "olmoe_1b_7b_full"]) == 0
    r = json.loads((tmp_path / "recipes.json").read_text())["recipes"]["olmoe_1b_7b_full"]
    assert r["transformers"]["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB"
    assert len(r["moe8"]["losses"]) == 4 and r["estimate_gib"] > 0 and r["settings_differ"] == []
    assert "transformers: OutOfMemoryError" in capsys.readouterr().out
