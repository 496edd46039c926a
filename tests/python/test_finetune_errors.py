"""`moe8 finetune` failure modes: each gets a named error and a non-zero exit before anything is written, or,
failing during training, a stop with a named error that keeps the last good checkpoint and the report.
Built-in tiny model on the CPU, 1-3 steps."""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0", reason="moe8 finetune needs transformers>=5")

import test_finetune as base  # noqa: E402

from moe8 import finetune  # noqa: E402
from moe8.finetune import report  # noqa: E402

# test_finetune's fixtures (the text file, undoing moe8's patches after each test) and helpers
text_file, _undo_moe8 = base.text_file, base._undo_moe8
finetune_rc, flags = base.finetune_rc, base.flags


def quick(out, data, *extra):
    """flags() cut to 3 steps, a checkpoint every step."""
    return flags(out, data, "--steps", "3", "--save_every", "1", "--eval_every", "0", *extra)


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_uncreatable_output_dir_is_refused_first(tmp_path, text_file, capsys):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    out = blocker / "run"
    rc, text = finetune_rc(capsys, quick(out, text_file))
    assert (
        rc == 2 and "moe8 finetune: error: output_dir" in text and "cannot be created or written" in text
    ), text
    assert "moe8 finetune: tiny" not in text  # refused before the model was built
    assert tree(tmp_path) == ["file.txt"] and blocker.read_text() == "x"


def test_overwrite_deletes_only_a_moe8_run(tmp_path, text_file, capsys):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_text("keep")
    rc, text = finetune_rc(capsys, quick(out, text_file, "--overwrite"))
    assert rc == 2 and "overwrite: output_dir" in text and "is not a moe8 run" in text, text
    assert tree(out) == ["holiday.jpg"]
    run = tmp_path / "run"  # a previous run (its marker) is replaced
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    (run / "old.txt").write_text("old")
    rc, text = finetune_rc(capsys, quick(run, text_file, "--overwrite", "--steps", "1"))
    assert rc == 0, text
    assert not (run / "old.txt").exists() and (run / "finetune.toml").exists()


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--lr", "inf", "lr = inf: expected a finite number"),
        ("--lr", "nan", "lr = nan: expected a finite number"),
        ("--lr", "0", "lr = 0.0: expected > 0"),
        ("--lr=-1e-3", None, "lr = -0.001: expected > 0"),
        ("--weight_decay=-0.1", None, "weight_decay = -0.1: expected >= 0"),
        ("--weight_decay", "inf", "weight_decay = inf: expected a finite number"),
        ("--max_grad_norm", "nan", "max_grad_norm = nan: expected a finite number"),
        ("--max_grad_norm=-1", None, "max_grad_norm = -1.0: expected >= 0"),
        ("--warmup_steps=-2", None, "warmup_steps = -2: expected >= 0"),
        ("--min_lr_ratio", "inf", "min_lr_ratio = inf: expected a finite number"),
        ("--lora_alpha", "nan", "lora_alpha = nan: expected a finite number"),
    ],
)
def test_numeric_keys_are_checked(tmp_path, text_file, capsys, flag, value, message):
    out = tmp_path / "out"
    rc, text = finetune_rc(capsys, quick(out, text_file, flag, *([value] if value else [])))
    assert rc == 2 and f"moe8 finetune: error: {message}" in text, text
    assert not out.exists()


def test_report_renders_non_finite_values(tmp_path, monkeypatch):
    nan, inf = float("nan"), float("inf")
    line = dict(lr=1e-3, tokens_per_s=100.0, mfu=None, memory_gib=1.0)
    hist = [dict(step=0, eval_loss=nan)]
    for s in range(1, 7):  # one inf grad norm; the loss NaN throughout; a layer's fractions NaN at step 4
        frac = [nan] * 4 if s == 4 else [0.4, 0.3, 0.2, 0.1]
        hist.append(dict(line, step=s, loss=nan, grad_norm=inf if s == 3 else 1.0, routing={"l0": frac}))
    hist.append(dict(line, step=7, loss=None, grad_norm=None, routing={"l0": [None, 0.5, 0.5, 0.0]}))
    path = tmp_path / "report.html"
    report.write(path, hist, dict(model="m", steps=7, memory_estimate_gib=1.0), dead_window=5)
    html = path.read_text()
    assert tree(tmp_path) == ["report.html"]
    assert "loss: not measured" in html  # an all-NaN series: no chart, no crash
    assert "<td style='text-align:left'>n/a</td>" in html  # the last train loss, and the eval loss
    assert "nan" not in html.lower() and "inf" not in html.split("<h2>Training")[1]
    grad = html.split("grad norm (before clipping)")[1].split("</svg>")[0]
    assert grad.count("<polyline") == 2  # steps 1-2 and 4-6: a gap at the inf
    assert html.count('<svg class="heat"') == 1 and "dead experts" in html

    def fail(*a):
        raise OSError("disk full")

    monkeypatch.setattr(report.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        report.write(tmp_path / "again.html", hist)
    assert tree(tmp_path) == ["report.html"]  # no again.html.tmp left behind


def test_nan_loss_stops_and_keeps_the_last_checkpoint(tmp_path, text_file, capsys):
    def poison_after_2(step, trainer):  # checkpoint-2 is written, then the weights turn NaN
        if step == 2:
            with torch.no_grad():
                trainer.master[0].fill_(float("nan"))

    out = tmp_path / "out"
    rc, text = finetune_rc(capsys, quick(out, text_file), on_step=poison_after_2)
    assert rc == 3 and "moe8 finetune: error: diverged: loss = nan at step 3" in text, text
    assert "checkpoint-2" in text and "--lr" in text
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]  # the last 2
    state = torch.load(out / "checkpoint-2" / "training_state.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 3 and lines[-1]["loss"] is None and "loss" in lines[-1]["nonfinite"]
    assert (out / "report.html").exists() and not (out / "report.html.tmp").exists()
    assert not (out / "model.safetensors").exists()  # no export of a diverged model


def test_resume_refuses_changed_settings(tmp_path, text_file, capsys):
    out = tmp_path / "out"
    rc, text = finetune_rc(capsys, quick(out, text_file, "--run_steps", "1"))
    assert rc == 0 and (out / "checkpoint-1").exists(), text
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    rc, text = finetune_rc(
        capsys, quick(out, text_file, "--resume", "--lr", "0.5", "--weight_decay", "0.2", "--steps", "4")
    )
    assert rc == 2 and "resume: the config differs from the checkpoint's in" in text, text
    assert "lr: None -> 0.5" in text and "weight_decay: 0.01 -> 0.2" in text and "steps:" not in text
    assert "finetune.toml" in text
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing written
    # what may change on resume: the length of the run, logging, evaluation and saving
    rc, text = finetune_rc(
        capsys, quick(out, text_file, "--resume", "--steps", "2", "--log_every", "2", "--eval_every", "1")
    )
    assert rc == 0 and "resuming from" in text, text
    assert (out / "model.safetensors").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ste", "1"], "unrecognized arguments: --ste; did you mean --steps?"),
        (["--micro-bat=2"], "unrecognized arguments: --micro_bat=2; did you mean --micro_batch?"),
        (["--no-progres"], "did you mean --no-progress?"),
        (["--zzzzqq"], "unrecognized arguments: --zzzzqq\n"),
    ],
)
def test_flag_prefixes_and_typos_are_refused(tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        finetune.main(["--output_dir", str(out), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "seq_len, micro_batch, packing, split",
    [
        (4000, 2, "stream", "(0 sequences)"),
        (2048, 8, "stream", "(2 sequences after 1 held out for evaluation (eval_fraction))"),
        (4000, 2, "documents", "(0 sequences after 1 held out for evaluation (eval_fraction))"),  # 1 padded
        (2048, 8, "documents", "(3 sequences after 1 held out for evaluation (eval_fraction))"),
    ],
)
def test_too_little_data_counts_are_not_negative(tmp_path, capsys, seq_len, micro_batch, packing, split):
    data = tmp_path / "small.txt"
    data.write_text("a few words of text.\n" * (300 if seq_len == 2048 else 20))
    out = tmp_path / "out"
    extra = ("--seq_len", seq_len, "--micro_batch", micro_batch, "--packing", packing)
    rc, text = finetune_rc(capsys, quick(out, data, *extra))
    assert rc == 2 and f"the training split {split} needs at least micro_batch = {micro_batch}" in text, text
    assert "(-" not in text and not out.exists()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The built-in tiny model saved as a model directory, with the byte tokenizer."""
    from moe8.finetune.data import byte_tokenizer

    d = tmp_path_factory.mktemp("model")
    base.tiny_model(moe8=False).save_pretrained(d)  # moe8=False: transformers left unpatched
    byte_tokenizer().save_pretrained(d)
    return d


def copy_model(model_dir, dest, tokenizer=True):
    import shutil

    shutil.copytree(model_dir, dest)
    if not tokenizer:
        for p in dest.iterdir():
            if "token" in p.name or p.name in ("chat_template.jinja", "special_tokens_map.json"):
                p.unlink()
    return dest


def test_model_without_tokenizer_is_refused(tmp_path, text_file, model_dir, capsys):
    bare = copy_model(model_dir, tmp_path / "bare", tokenizer=False)
    out = tmp_path / "out"
    rc, text = finetune_rc(capsys, quick(out, text_file, "--model", bare))
    assert rc == 2 and f"tokenizer: none found in the model directory {bare}" in text, text
    assert "tokenizer.json" in text and "--tokenizer" in text and not out.exists()
    rc, text = finetune_rc(
        capsys, quick(out, text_file, "--model", bare, "--tokenizer", "byte", "--steps", "1")
    )
    assert rc == 0, text  # named explicitly: it trains


def test_truncated_weights_are_named(tmp_path, text_file, model_dir, capsys):
    cut = copy_model(model_dir, tmp_path / "cut")
    weights = cut / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    out = tmp_path / "out"
    rc, text = finetune_rc(capsys, quick(out, text_file, "--model", cut))
    assert rc == 2 and f"moe8 finetune: error: model: {weights} is not a complete safetensors file" in text, (
        text
    )
    assert "Traceback" not in text and not out.exists()
    weights.write_bytes(b"\x00" * 3)  # not even a header
    rc, text = finetune_rc(capsys, quick(out, text_file, "--model", cut))
    assert rc == 2 and f"{weights} is not a complete safetensors file (3 bytes" in text, text


def test_no_progress_silences_the_loading_bar(tmp_path, text_file, model_dir, capsys):
    from transformers.utils import logging

    assert logging.is_progress_bar_enabled()
    rc, text = finetune_rc(capsys, quick(tmp_path / "quiet", text_file, "--model", model_dir, "--steps", "1"))
    assert rc == 0 and "Loading weights" not in text and "it/s]" not in text, text
    assert logging.is_progress_bar_enabled()  # restored after
    rc, text = finetune_rc(
        capsys,
        quick(
            tmp_path / "bars",
            text_file,
            "--model",
            model_dir,
            "--steps",
            "1",
            "--run_steps",
            "1",
            "--progress",
        ),
    )
    assert rc == 0 and "Loading weights" in text, text  # the check can see the bar


def test_shared_data_comes_from_the_environment_not_the_working_directory(
    tmp_path, text_file, capsys, monkeypatch
):
    from moe8.finetune import data
    from moe8.finetune.config import Config

    shared = tmp_path / "shared" / "data"  # ../shared/data from the working directory
    data.byte_tokenizer().save_pretrained(shared / "tokenizers" / "qwen3")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setattr(data, "REPO", tmp_path / "site-packages")  # as installed: no checkout around it
    monkeypatch.setattr(data, "ENV", {**data.ENV, "shared_data": None})
    out = tmp_path / "out"
    rc, text = finetune_rc(capsys, quick(out, text_file, "--tokenizer", "qwen3"))
    assert (
        rc == 2
        and "tokenizer = 'qwen3': tokenizers/qwen3 not found (looked in: MOE8_SHARED_DATA (unset)" in text
    )
    assert "set MOE8_SHARED_DATA" in text and not out.exists(), text
    kind, docs, source = data.read_documents(Config(max_documents=3))
    assert len(docs) == 3 and source.startswith("generated sentences (no sample text: looked in: MOE8_SHARED")
    monkeypatch.setattr(data, "ENV", {**data.ENV, "shared_data": str(shared)})
    assert data.shared("tokenizers", "qwen3") == shared / "tokenizers" / "qwen3"
    assert len(data.load_tokenizer(Config(tokenizer="qwen3"), None)) == 260
