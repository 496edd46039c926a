"""`moe8 finetune` under torchrun on 2 CPU processes (gloo) with the built-in tiny Qwen3-MoE model: expert
parallelism (ep 2, stopped and resumed; and uninterrupted with FSDP2) and data parallelism (ep 1), rank 0 alone writing metrics, report and
a model transformers loads on one process; the data-parallel loss of step 1 equal to one process's on the same
global batch; bad ep values rejected with the key named and nothing written. Every launch is bounded: the
process group is killed on a timeout."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0", reason="moe8 finetune needs transformers>=5")

import moe8  # noqa: E402
from moe8 import finetune  # noqa: E402

# the torchrun processes import the moe8 these tests import: the checkout's python/ when run from it (see
# conftest.py), the installed package in CI (whose source tree has no built extension)
ENV_PATH = str(Path(moe8.__file__).resolve().parents[1])
# seconds all launches of this module may take together, each at most LAUNCH_S: room for a machine whose cores
# are shared with other tests (pytest-xdist) or a build
BUDGET = [480.0]
LAUNCH_S = 120.0


import test_finetune  # noqa: E402

_undo_moe8 = test_finetune._undo_moe8  # the same fixtures: moe8 undone after each test, the text data
text_file = test_finetune.text_file


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flags(out, data, micro_batch=2, *extra):
    small = (
        "--no-progress --steps 4 --seq_len 32 --log_every 1 --eval_every 2 --eval_batches 2 --save_every 2"
    )
    return [
        "--output_dir",
        str(out),
        "--data",
        str(data),
        "--micro_batch",
        str(micro_batch),
        "--device",
        "cpu",
    ] + (small.split() + [str(e) for e in extra])


def kill_tree(pid: int) -> None:
    """SIGKILL pid and every process below it (torchrun's workers are started with setsid, outside its process group, so killing
    its process group does not reach them)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def torchrun_cmd(*args):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
    ]
    return cmd + ["--master-port", str(_free_port()), "-m", "moe8.cli", "finetune", *map(str, args)]


def torchrun_env():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ENV_PATH, os.environ.get("PYTHONPATH", "")]))
    env.pop("WORLD_SIZE", None)
    env["MOE8_FINETUNE_DIST_TIMEOUT"] = "60"
    return env


def torchrun(tmp_path, *args):
    """moe8 finetune under torchrun, 2 processes; the whole process group is killed on a timeout (LAUNCH_S, or
    what is left of BUDGET)."""
    p = subprocess.Popen(
        torchrun_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=torchrun_env(),
        cwd=tmp_path,
        start_new_session=True,
    )  # fmt: skip
    limit, t0 = max(1.0, min(LAUNCH_S, BUDGET[0])), time.monotonic()
    try:
        out, _ = p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        kill_tree(p.pid)
        out, _ = p.communicate()
        pytest.fail(f"torchrun did not finish in {limit:.0f} s:\n{out[-4000:]}")
    finally:
        BUDGET[0] -= time.monotonic() - t0
    return p.returncode, out


def metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def check_run(out, text):
    lines = metrics(out)
    steps = [x["step"] for x in lines]
    assert steps == [0, 1, 2, 3, 4], steps  # one writer: each step once
    train = [x for x in lines if "loss" in x]
    assert all(torch.isfinite(torch.tensor(x["loss"])) for x in train)
    assert train[-1]["loss"] < train[0]["loss"]
    for x in train:
        assert len(x["memory_gib_ranks"]) == 2 and all(g > 0 for g in x["memory_gib_ranks"])
        assert x["tokens"] == x["step"] * 2 * 2 * 32  # global: 2 ranks x micro_batch 2 x seq_len 32
        for fractions in x["routing"].values():  # all 8 experts, counted over both ranks
            assert len(fractions) == 8 and abs(sum(fractions) - 1) < 1e-4
    assert text.count("done: 4 steps") == 1 and text.count("report:") == 1  # rank 0 reports
    assert text.count("moe8 finetune: tiny-qwen3-moe") == 1 and "peak memory (GiB): rank 0" in text
    html = (out / "report.html").read_text()
    assert "peak memory per rank (GiB)" in html and html.count('<svg class="heat"') == 2
    return lines


def test_expert_parallel_two_ranks_resume(tmp_path, text_file, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ep"
    rc, text = torchrun(tmp_path, *flags(out, text_file), "--ep", 2, "--run_steps", 2)
    assert rc == 0, text
    assert "stopped at step 2 of 4" in text and sorted(p.name for p in out.glob("checkpoint-*")) == [
        "checkpoint-2"
    ]
    rc, text = torchrun(tmp_path, *flags(out, text_file), "--ep", 2, "--resume")
    assert rc == 0, text
    assert "resuming from" in text and "2 ranks, expert-parallel ep 2" in text
    check_run(out, text)
    ckpt = out / "checkpoint-4"
    shards = [
        torch.load(ckpt / f, weights_only=True)["model"]
        for f in ("training_state.pt", "training_state-rank1.pt")
    ]
    model = AutoModelForCausalLM.from_pretrained(out)  # one process: the experts gathered from both ranks
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert shards[0][key].shape[0] == 4
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj, torch.cat([s[key] for s in shards]))
    assert torch.equal(model.model.embed_tokens.weight, shards[0]["model.embed_tokens.weight"])
    # one process can't continue a 2-rank checkpoint: the named error, the run left as it was
    before = sorted(p.name for p in out.iterdir())
    assert finetune.main(flags(out, text_file, 2, "--resume")) == 2
    err = capsys.readouterr().err
    assert (
        "resume: the checkpoint was written by 2 ranks with ep = 2, this run has 1 ranks with ep = 1" in err
    )
    assert sorted(p.name for p in out.iterdir()) == before
    # the same run uninterrupted with the dense parameters under FSDP2: the same weights within fp32 rounding
    fsdp = tmp_path / "fsdp"
    rc, text = torchrun(tmp_path, *flags(fsdp, text_file), "--ep", 2, "--fsdp")
    assert rc == 0, text
    assert "2 ranks, expert-parallel ep 2 (auto), FSDP2" in text
    check_run(fsdp, text)
    other = AutoModelForCausalLM.from_pretrained(fsdp).state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(other[k], v, rtol=1e-4, atol=1e-4, msg=k)


def test_expert_parallel_kill_9_resume_matches_uninterrupted(tmp_path, text_file):
    """SIGKILL of the whole torchrun run (ep 2) two steps after its step-10 checkpoint: --resume finishes it with the
    uninterrupted run's final weights and last loss, bitwise (EP and the data order are deterministic)."""
    from transformers import AutoModelForCausalLM

    more = ("--ep", 2, "--steps", 40, "--eval_every", 0, "--seq_len", 256, "--save_every", 10)
    killed = tmp_path / "killed"
    t0 = time.monotonic()
    p = subprocess.Popen(
        torchrun_cmd(*flags(killed, text_file), *more), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=torchrun_env(), cwd=tmp_path, start_new_session=True,
    )  # fmt: skip
    try:
        # killed after step 12's line (checkpoint-10 written, 28 steps to go)
        while p.poll() is None and time.monotonic() - t0 < min(120.0, BUDGET[0]):
            m = killed / "metrics.jsonl"
            if m.exists() and len(m.read_text().splitlines()) >= 13:
                break
            time.sleep(0.01)
    finally:
        kill_tree(p.pid)
        out, _ = p.communicate()
        BUDGET[0] -= time.monotonic() - t0
    assert [c.name for c in killed.glob("checkpoint-*")] == ["checkpoint-10"], out[-3000:]
    assert b"done: 40 steps" not in out, "the run ended before the kill"
    rc, text = torchrun(tmp_path, *flags(killed, text_file), *more, "--resume")
    assert rc == 0 and "resuming from" in text, text
    whole = tmp_path / "whole"
    rc, text = torchrun(tmp_path, *flags(whole, text_file), *more)
    assert rc == 0, text
    last = [[x for x in metrics(d) if "loss" in x][-1] for d in (killed, whole)]
    assert last[0]["step"] == last[1]["step"] == 40 and last[0]["loss"] == last[1]["loss"]
    a, b = (AutoModelForCausalLM.from_pretrained(d).state_dict() for d in (killed, whole))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_data_parallel_two_ranks_matches_one_process(tmp_path, text_file, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "dp"
    rc, text = torchrun(tmp_path, *flags(out, text_file))
    assert rc == 0, text
    assert "2 ranks, data-parallel" in text
    lines = check_run(out, text)
    AutoModelForCausalLM.from_pretrained(out)
    # one process with micro_batch 4 reads the same global batch (rank r's shard is micro-batch 2g + r of the
    # micro_batch 2 order): step 1's loss, before any update, is the same within fp32 tolerance
    one = tmp_path / "one"
    assert finetune.main(flags(one, text_file, 4)) == 0, capsys.readouterr()
    ref = metrics(one)
    assert lines[1]["step"] == ref[1]["step"] == 1
    assert lines[1]["loss"] == pytest.approx(ref[1]["loss"], rel=1e-5)


def test_expert_parallel_lora_matches_one_process(tmp_path, text_file, capsys):
    """LoRA on attention and experts under ep 2: the expert LoRA factors are sharded with the experts and
    gathered for the adapter, which loads onto the base and has the one-process run's tensors (names and
    shapes); the losses of all 4 steps equal one process's at the same global batch (step 1, before any
    update, within fp32 rounding; later steps within 1e-4: AdamW turns rounding-level differences of
    near-zero gradients into lr-sized steps of single elements)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from moe8.lora import load_adapter

    out = tmp_path / "lora_ep"
    rc, text = torchrun(tmp_path, *flags(out, text_file), "--ep", 2, "--method", "lora")
    assert rc == 0, text
    assert "2 ranks, expert-parallel ep 2" in text
    lines = [x for x in metrics(out) if "loss" in x]
    load_adapter(AutoModelForCausalLM.from_pretrained(out / "base_model"), out)
    one = tmp_path / "lora_one"
    assert finetune.main(flags(one, text_file, 4, "--method", "lora")) == 0, capsys.readouterr()
    ref = [x for x in metrics(one) if "loss" in x]
    assert [x["step"] for x in lines] == [x["step"] for x in ref] == [1, 2, 3, 4]
    assert lines[0]["loss"] == pytest.approx(ref[0]["loss"], rel=1e-6)
    for a, b in zip(lines, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    got, want = (load_file(str(d / "adapter_model.safetensors")) for d in (out, one))
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    assert any(".experts." in k for k in got)


def test_bad_ep_values(tmp_path, text_file, capsys):
    out = tmp_path / "bad"
    rc, text = torchrun(tmp_path, *flags(out, text_file), "--ep", 3)
    assert rc != 0 and "ep = 3: expected a divisor of the world size (WORLD_SIZE 2), got 3" in text, text
    assert not out.exists()
    rc = finetune.main(flags(out, text_file, 2, "--ep", 2))
    err = capsys.readouterr().err
    assert rc == 2 and "ep = 2: expected 1 in one process (WORLD_SIZE 1); launch with `torchrun" in err, err
    assert not out.exists()
