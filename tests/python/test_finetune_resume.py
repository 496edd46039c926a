"""`moe8 finetune --resume` on CPU: a resume on other data than the checkpoint's is refused (a file changed at
its path, data = "auto" falling back to generated sentences) unless --allow-data-change; the last
keep_checkpoints are kept; an unreadable last checkpoint is named and the one before it taken; a finished run
says it is finished and trains nothing."""

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0", reason="moe8 finetune needs transformers>=5")

import test_finetune as base  # noqa: E402

from moe8.finetune import data as data_module  # noqa: E402

text_file, _undo_moe8 = base.text_file, base._undo_moe8
finetune_rc, flags, final_weights, losses = base.finetune_rc, base.flags, base.final_weights, base.losses


def files(out):
    return {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_resume_refuses_changed_data(tmp_path, text_file, capsys):
    data = tmp_path / "docs.txt"
    data.write_bytes(text_file.read_bytes())
    out = tmp_path / "out"
    rc, text = finetune_rc(capsys, flags(out, data, "--run_steps", 3))
    assert rc == 0 and (out / "checkpoint-3").exists(), text
    fingerprint = torch.load(out / "checkpoint-3" / "training_state.pt", weights_only=True)["data"]
    assert (
        fingerprint["data"]["path"] == str(data.resolve())
        and fingerprint["data"]["size"] == data.stat().st_size
    )
    assert fingerprint["tokens"] > 0 and fingerprint["tokenizer"].startswith("260 tokens, sha256 ")
    data.write_text(data.read_text().replace("the", "a"))  # the same path, other contents
    before = files(out)
    rc, text = finetune_rc(capsys, flags(out, data, "--resume"))
    assert rc == 2 and "moe8 finetune: error: resume: the data differs from the checkpoint's (" in text, text
    assert "data size:" in text and "data head_tail:" in text and "tokens:" in text
    assert "--allow-data-change" in text and text.count("\n") == 1 and files(out) == before
    rc, text = finetune_rc(capsys, flags(out, data, "--resume", "--allow-data-change"))
    assert rc == 0 and "resume: on changed data (allow_data_change): data head_tail:" in text, text
    assert (out / "model.safetensors").exists()


def test_resume_refuses_auto_data_turned_generated(tmp_path, capsys, monkeypatch):
    if data_module.shared("text", "sentences.txt") is None:
        pytest.skip("no text/sentences.txt in the shared data folder")
    out = tmp_path / "out"
    argv = ["--output_dir", str(out), "--steps", "4", "--run_steps", "2", "--no-progress", "--device", "cpu"]
    argv += ["--max_documents", "600", "--micro_batch", "2", "--seq_len", "32", "--eval_batches", "1"]
    rc, text = finetune_rc(capsys, argv)
    assert rc == 0, text
    monkeypatch.setattr(data_module, "shared", lambda *parts: None)  # MOE8_SHARED_DATA unset, no checkout
    rc, text = finetune_rc(capsys, argv[:4] + argv[6:] + ["--resume"])
    assert rc == 2 and "resume: the data differs" in text and "-> generated sentences" in text, text


def test_keep_checkpoints(tmp_path, text_file, capsys):
    out = tmp_path / "out"
    rc, text = finetune_rc(capsys, flags(out, text_file, "--save_every", 1, "--keep_checkpoints", 3))
    assert rc == 0, text
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [
        "checkpoint-4",
        "checkpoint-5",
        "checkpoint-6",
    ]


def test_unreadable_checkpoint_falls_back_to_the_previous(tmp_path, text_file, capsys):
    extra = ["--steps", 5, "--save_every", 1, "--seed", 2]
    ref = tmp_path / "ref"
    assert finetune_rc(capsys, flags(ref, text_file, *extra))[0] == 0
    out = tmp_path / "out"
    rc, text = finetune_rc(capsys, flags(out, text_file, *extra, "--run_steps", 3))
    assert rc == 0 and sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    last = out / "checkpoint-3" / "training_state.pt"
    last.write_bytes(last.read_bytes()[:1000])  # truncated, as by a full disk
    rc, text = finetune_rc(capsys, flags(out, text_file, *extra, "--resume"))
    assert rc == 0, text
    notice = [line for line in text.splitlines() if line.startswith("resume: unreadable")]
    assert len(notice) == 1 and notice[0].startswith(f"resume: unreadable checkpoint {last} (")
    assert f"resuming from {out / 'checkpoint-2'} instead" in notice[0] and "Traceback" not in text
    assert f"resuming from {out / 'checkpoint-2'} (step 2)" in text
    a, b = final_weights(ref), final_weights(out)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)
    assert losses(out) == losses(ref)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-5"]
    # none readable: one message naming each
    for p in out.glob("checkpoint-*/training_state.pt"):
        p.write_bytes(b"not a checkpoint")
    rc, text = finetune_rc(capsys, flags(out, text_file, *extra, "--resume"))
    assert rc == 2 and f"resume: no readable checkpoint in {out}: " in text and "checkpoint-4" in text, text
    assert "checkpoint-5" in text and "Traceback" not in text


def test_resume_of_a_finished_run_says_so(tmp_path, text_file, capsys):
    out = tmp_path / "out"
    assert finetune_rc(capsys, flags(out, text_file))[0] == 0
    before = files(out)
    rc, text = finetune_rc(capsys, flags(out, text_file, "--resume"))
    assert rc == 0, text
    assert f"moe8 finetune: {out} is finished: its checkpoint checkpoint-6 is at step 6 of steps = 6" in text
    assert "done:" not in text and "resuming from" not in text and "moe8 finetune: tiny-qwen3-moe" not in text
    assert files(out) == before  # nothing trained, nothing written
    rc, text = finetune_rc(capsys, flags(out, text_file, "--resume", "--steps", 7))  # a longer run continues
    assert rc == 0 and "resuming from" in text and "done: 7 steps" in text, text


def test_a_checkpoint_without_the_packing_key_resumes_as_a_stream(tmp_path, text_file, capsys):
    out = tmp_path / "out"
    assert finetune_rc(capsys, flags(out, text_file, "--run_steps", 3, "--packing", "stream"))[0] == 0
    path = out / "checkpoint-3" / "training_state.pt"
    state = torch.load(path, weights_only=True)
    del state["config"]["packing"]  # as a checkpoint written without the key, whose rows were streamed
    torch.save(state, path)
    rc, text = finetune_rc(capsys, flags(out, text_file, "--resume"))
    assert rc == 2 and "packing: 'stream' -> 'documents'" in text, text
    rc, text = finetune_rc(capsys, flags(out, text_file, "--resume", "--packing", "stream"))
    assert rc == 0 and "resuming from" in text, text
