"""recipes/*.toml: each parses, names a real config under recipes/configs whose estimated peak fits one H200 at the
recipe's ep (the full-size model, counted on the meta device), and bench/bench_recipes.py --tiny runs a recipe
through moe8 finetune's trainer and plain transformers on the CPU, writing both into its JSON."""

import importlib.util
import json
from pathlib import Path

import pytest
import tomllib
import torch

pytest.importorskip("transformers", minversion="5.0", reason="moe8 finetune needs transformers>=5")

from moe8.finetune import memory  # noqa: E402
from moe8.finetune.config import make_config  # noqa: E402
from moe8.finetune.model import config_from  # noqa: E402

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
    assert sorted(p.stem for p in (ROOT / "recipes").glob("*.toml")) == sorted(b.RECIPES)
    families = {"qwen3": "qwen3_moe", "gpt_oss": "gpt_oss", "mixtral": "mixtral", "olmoe": "olmoe"}
    families |= {"qwen2_moe": "qwen2_moe", "deepseek_v3": "deepseek_v3"}
    configs = {}
    for name, (config_file, _) in b.RECIPES.items():
        path = ROOT / "recipes" / f"{name}.toml"
        ep = tomllib.loads(path.read_text()).get("ep", 1)
        cfg = make_config(str(path), {"ep": 1})  # ep > 1 is refused outside torchrun: estimated below
        if config_file not in configs:
            config = config_from(str(ROOT / "recipes" / "configs" / config_file))
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


def test_bench_tiny_runs_both_paths(tmp_path):
    assert bench().main(["--tiny", "--out", str(tmp_path), "--recipes", "qwen3_30b_a3b_lora"]) == 0
    out = json.loads((tmp_path / "recipes.json").read_text())
    r = out["recipes"]["qwen3_30b_a3b_lora"]
    assert out["info"]["tiny"] and r["method"] == "lora" and r["layers"] == 2
    for side in ("moe8", "transformers"):
        assert r[side]["tokens_per_s"] > 0 and r[side]["peak_gib"] > 0
        assert 4 < r[side]["loss_last"] < 7  # ln(300) ~ 5.7: random init, the same data
    assert r["moe8"]["experts_on"] == "moe8" and r["moe8"]["estimate_gib"] > 0
    # the same model and data: the first-step losses agree; after 3 steps the two trainings stay close
    assert abs(r["moe8"]["loss_last"] - r["transformers"]["loss_last"]) < 0.1
