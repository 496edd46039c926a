"""`moe8 finetune` as a new user meets it: recipes by name (in the wheel, listed with what was measured), plain
progress lines for a log file, and the messages for a LoRA target, a config key or an eval file that is wrong.
Built-in tiny model on the CPU, 1-3 steps."""

import re
import sys
from pathlib import Path

import pytest
import tomllib

import moe8

pytest.importorskip("transformers", minversion="5.0", reason="moe8 finetune needs transformers>=5")

import test_finetune as base  # noqa: E402

from moe8 import cli, finetune  # noqa: E402
from moe8.finetune import hub, recipes  # noqa: E402
from moe8.finetune.config import KEYS, FinetuneError, make_config, suggest  # noqa: E402
from moe8.finetune.loggers import Progress  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
text_file, _undo_moe8 = base.text_file, base._undo_moe8
finetune_rc = base.finetune_rc
TINY = ["--steps", "3", "--micro_batch", "2", "--seq_len", "32", "--eval_batches", "1", "--device", "cpu"]


# ------------------------------------------------------------------------------------------------ recipes
def test_recipes_ship_in_the_package_and_the_wheel(monkeypatch):
    """The recipes live in moe8/recipes; scikit-build-core's own file selection for the wheel (pyproject's
    wheel.packages, .gitignore) puts every recipe and model config into the wheel."""
    pathutil = pytest.importorskip("scikit_build_core.build._pathutil")
    assert recipes.DIR == Path(moe8.__file__).resolve().parent / "recipes" and len(recipes.names()) == 7
    assert sorted(p.name for p in (ROOT / "python" / "moe8" / "recipes").glob("*.toml")) == sorted(
        f"{n}.toml" for n in recipes.names()
    )
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"]["wheel"][
        "packages"
    ]
    monkeypatch.chdir(ROOT)
    mapping = pathutil.packages_to_file_mapping(
        packages={Path(p).name: p for p in packages},
        platlib_dir=Path("wheel"),
        include=[],
        src_exclude=[],
        target_exclude=[],
        build_dir="build/{wheel_tag}",
    )
    shipped = {Path(t).relative_to("wheel").as_posix() for t in mapping.values()}
    want = {
        f"moe8/recipes/{p.relative_to(recipes.DIR).as_posix()}" for p in recipes.DIR.rglob("*") if p.is_file()
    }
    assert any(w.endswith("configs/qwen3_30b_a3b.json") for w in want)
    assert want <= shipped, want - shipped


def test_no_recipe_hard_codes_a_model_folder():
    """A recipe's model is a Hugging Face id (ORG/NAME) or absent (no checkpoint has its shape)."""
    for name in recipes.names():
        table = tomllib.loads(recipes.path(name).read_text())
        if "model" in table:
            assert hub.is_hub_id(table["model"]) and not table["model"].startswith("/"), name
        assert "/models/" not in recipes.path(name).read_text(), name


def measured_table() -> dict:
    """recipe -> (moe8 peak GiB, tokens/s, transformers peak GiB, tokens/s) from the results file."""
    out = {}
    for line in (ROOT / "bench" / "results" / "recipes_full_h200.md").read_text().splitlines():
        m = re.match(
            r"\| `(\w+)` \([^|]*\| \d+ \| [^|]+\| ([\d.]+) \([\d.]+\) \| ([\d.]+) \| ([\d,]+) \| ([\d,]+) \|",
            line,
        )
        if m:
            name, peak, peer_peak, tps, peer_tps = m.groups()
            out[name] = (
                float(peak),
                int(tps.replace(",", "")),
                float(peer_peak),
                int(peer_tps.replace(",", "")),
            )
    return out


def test_moe8_recipes_lists_the_measured_figures(capsys):
    table = measured_table()
    assert len(table) == 5 and recipes.MEASURED == table  # every figure from the results file, none made up
    assert cli.main(["recipes"]) == 0
    out = capsys.readouterr().out
    rows = {
        line.split()[0]: line
        for line in out.splitlines()
        if line.split() and line.split()[0] in recipes.names()
    }
    assert sorted(rows) == recipes.names()
    for name, (peak, tps, _, peer_tps) in table.items():
        assert (
            f"{peak:.1f} GiB" in rows[name] and f"{tps:,}" in rows[name] and f"{peer_tps:,}" in rows[name]
        ), name
    for name in ("gpt_oss_20b_full", "qwen2_moe_a2_7b_full"):  # ep > 1: never measured
        assert "not measured" in rows[name] and "torchrun, ep" in rows[name], name
    assert "Qwen/Qwen3-30B-A3B" in rows["qwen3_30b_a3b_lora"]
    assert cli.main(["recipes", "olmoe_1b_7b_full"]) == 0
    assert capsys.readouterr().out == recipes.path("olmoe_1b_7b_full").read_text()
    assert cli.main(["recipes", "olmoe"]) == 2 and "no recipe 'olmoe'" in capsys.readouterr().err
    assert finetune.main(["--list-recipes"]) == 0 and "qwen3_30b_a3b_lora" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0 and "recipes" in capsys.readouterr().out


def test_finetune_runs_a_recipe_by_name(capsys, tmp_path):
    rc, out = finetune_rc(capsys, ["--recipe", "qwen3_30b_a3b_lora", "--print_config"])
    assert rc == 0 and 'model = "Qwen/Qwen3-30B-A3B"' in out and 'method = "lora"' in out, out
    rc, out = finetune_rc(
        capsys, ["--recipe", "qwen3_30b_a3b_lora", "--model", str(tmp_path), "--print_config"]
    )
    assert rc == 0 and f'model = "{tmp_path}"' in out  # a local copy overrides the id
    rc, out = finetune_rc(capsys, ["--recipe", "qwen3_30b_a3b_lor", "--print_config"])
    assert rc == 2 and "did you mean qwen3_30b_a3b_lora?" in out, out
    rc, out = finetune_rc(capsys, ["--recipe", "deepseek_v3_reduced_lora", "--print_config"])
    assert rc == 2 and "names no model" in out and "--model-config deepseek_v3_reduced" in out, out
    rc, out = finetune_rc(
        capsys,
        ["--recipe", "deepseek_v3_reduced_lora", "--model-config", "deepseek_v3_reduced", "--print_config"],
    )
    assert rc == 0 and 'model_config = "deepseek_v3_reduced"' in out, out
    cfg = make_config(str(recipes.path("deepseek_v3_reduced_lora")), {"model_config": "deepseek_v3_reduced"})
    from moe8.finetune.model import config_from

    assert config_from(cfg.model_config).model_type == "deepseek_v3"  # a recipe's config by its name
    rc, out = finetune_rc(capsys, [str(recipes.path("olmoe_1b_7b_full")), "--recipe", "olmoe_1b_7b_full"])
    assert rc == 2 and "give one of them" in out


# ----------------------------------------------------------------------------------------------- progress
def line(step, **kw):
    return dict(step=step, loss=2.5, lr=1e-3, tokens_per_s=12345.0, mfu=None, **kw)


def test_progress_prints_plain_lines_without_a_terminal(capsys):
    """stdout a file (here: captured): one line per logged step, none between, no carriage return."""
    p = Progress(10, 0, True)
    p.update(1, None)
    p.update(2, line(2))
    p.update(3, None)
    p.update(4, line(4, eval_loss=2.25))
    p.close()
    cap = capsys.readouterr()
    lines = cap.out.splitlines()
    assert len(lines) == 2 and "\r" not in cap.out + cap.err, cap
    assert re.fullmatch(r"step 2/10  loss 2\.500  lr 0\.001  12,345 tok/s  ETA \d+:\d\d", lines[0]), lines
    assert lines[1].startswith("step 4/10  loss 2.500  eval 2.250  lr 0.001"), lines
    Progress(10, 0, True, main=False).update(2, line(2))  # ranks other than 0 print nothing
    assert capsys.readouterr().out == ""


def test_progress_bar_on_a_terminal_plain_lines_with_no_progress(capsys, monkeypatch):
    for stream in (sys.stdout, sys.stderr):
        monkeypatch.setattr(stream, "isatty", lambda: True)
    p = Progress(4, 0, True)
    p.update(1, line(1))
    p.close()
    cap = capsys.readouterr()
    assert "step 1/4" not in cap.out and "finetune:" in cap.err  # tqdm's bar, on stderr
    p = Progress(4, 0, False)  # --no-progress: the plain lines, on a terminal too
    p.update(1, line(1))
    cap = capsys.readouterr()
    assert cap.out.startswith("step 1/4  loss 2.500") and cap.err == ""


def test_a_run_logged_to_a_file_and_its_cpu_memory_row(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    argv = ["--output_dir", str(out), "--data", str(text_file), "--log_every", "1", *TINY]
    rc, text = finetune_rc(capsys, argv)
    assert rc == 0, text
    steps = [x for x in text.splitlines() if x.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["1/3", "2/3", "3/3"] and "tok/s  ETA" in steps[0], text
    assert "eval " in steps[-1]  # the last step evaluates
    html = (out / "report.html").read_text()
    assert (
        "process peak RSS (with Python, torch and the data; the estimate: the training&#x27;s tensors)"
        in html
    )


# ------------------------------------------------------------------------------------------ small gaps
def test_a_lora_target_that_matches_nothing_is_an_error(tmp_path, text_file, capsys, recwarn):
    out = tmp_path / "run"
    argv = ["--output_dir", str(out), "--data", str(text_file), "--method", "lora", *TINY]
    rc, text = finetune_rc(capsys, argv + ["--lora_targets", "q_prj,experts"])
    assert (
        rc == 2 and "lora_targets: q_prj (did you mean q_proj?) match no layer of tiny-qwen3-moe" in text
    ), text
    assert "its layers LoRA can adapt: " in text and "k_proj" in text and "experts" in text, text
    assert not out.exists() and "moe8 finetune: tiny" not in text  # before the model was built
    rc, text = finetune_rc(capsys, argv + ["--lora_targets", "self_attn.q_proj,experts", "--steps", "1"])
    assert rc == 0, text  # moe8.lora's rule: a dotted suffix of the module's name
    assert not [w for w in recwarn if "moe8.lora" in str(w.message)]


def test_every_key_gets_a_did_you_mean():
    assert suggest("learning_rate") == "lr" and suggest("batch_size") == "micro_batch"
    assert suggest("gradient_accumulation_steps") == "grad_accum" and suggest("max_seq_length") == "seq_len"
    assert suggest("Learning-Rate") == "lr" and suggest("zzzz") is None
    for key in KEYS:  # a typo of every key: one letter dropped, doubled or two swapped
        for typo in (
            key + key[-1],
            key[:-1] if len(key) > 2 else key[::-1],
            key[0] + key[2:] if len(key) > 3 else key + "s",
        ):
            assert suggest(typo) == key, (key, typo)
    for alias, key in (("learning_rate", "lr"), ("batch_size", "micro_batch")):
        with pytest.raises(FinetuneError, match=rf"unknown config keys: {alias} \(did you mean {key}\?\)"):
            make_config(None, {alias: 1})


def test_flags_of_other_trainers_get_a_did_you_mean(capsys):
    for flag, want in (
        ("--learning-rate", "--lr"),
        ("--batch_size", "--micro_batch"),
        ("--no-gradient-checkpointing", "--no-activation_checkpointing"),
    ):
        with pytest.raises(SystemExit):
            finetune.main([flag, "1"] if not flag.startswith("--no-") else [flag])
        assert f"did you mean {want}?" in capsys.readouterr().err, flag


def test_a_missing_eval_data_file_names_eval_data(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    missing = tmp_path / "eval.jsonl"
    rc, text = finetune_rc(
        capsys, ["--output_dir", str(out), "--data", str(text_file), "--eval_data", str(missing), *TINY]
    )
    assert rc == 2 and f"moe8 finetune: error: eval_data: file not found: {missing}" in text, text
    rc, text = finetune_rc(capsys, ["--output_dir", str(out), "--data", str(missing), *TINY])
    assert rc == 2 and f"moe8 finetune: error: data: file not found: {missing}" in text, text
    assert not out.exists()


def test_a_model_config_lora_trial_writes_no_base_model(tmp_path, text_file, capsys):
    """Random weights for measuring: the adapter, no base_model/ (a built-in model's base is written)."""
    spec = (
        '{"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 64, '
        '"num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 4, '
        '"num_key_value_heads": 2, "head_dim": 16, "vocab_size": 260}'
    )
    out = tmp_path / "trial"
    argv = ["--output_dir", str(out), "--data", str(text_file), "--method", "lora", "--model-config", spec]
    rc, text = finetune_rc(capsys, argv + [*TINY, "--steps", "1"])
    assert rc == 0, text
    assert (out / "adapter_model.safetensors").is_file() and not (out / "base_model").exists()


def test_help_says_what_the_commands_do(capsys):
    with pytest.raises(SystemExit):
        finetune.main(["--help"])
    text = capsys.readouterr().out
    assert "about a minute" not in text and "--recipe NAME" in text and "ORG/NAME" in text, text
    assert "one line per logged step" in text


def test_progress_mfu_keeps_two_digits_below_one_percent():
    """A tiny model's MFU on a large GPU (0.012%) is printed as such, not as 0.0%; unknown MFU prints nothing."""
    from moe8.finetune.loggers import _mfu

    assert _mfu({"mfu": 0.413}) == "  MFU 41.3%"
    assert _mfu({"mfu": 0.00012}) == "  MFU 0.012%"
    assert _mfu({"mfu": None}) == "" and _mfu({}) == ""
