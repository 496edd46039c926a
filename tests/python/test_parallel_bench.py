"""bench/bench_dispatch.py and bench/bench_ep_train.py run end to end under torchrun on 2 gloo processes
(--tiny), write their JSON and print their tables last."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import moe8

ROOT = Path(__file__).resolve().parents[2]
ENV_PATH = str(Path(moe8.__file__).resolve().parents[1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script, *args):
    """script under torchrun on 2 CPU processes (gloo), with the moe8 this test runs."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ENV_PATH, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port()), script, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)


def test_bench_dispatch_tiny_two_ranks(tmp_path):
    out = tmp_path / "dispatch.json"
    p = torchrun("bench/bench_dispatch.py", "--tiny", "--fp8", "--iters", "2", "--warmup", "1", "--json", out)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(r["transport"], r["rows"]) for r in rows] == [("nccl", "bfloat16"), ("nccl", "fp8")]
    assert all(r["world"] == 2 for r in rows)
    assert rows[1]["bytes"] * 2 < rows[0]["bytes"] * 1.1  # FP8 rows: about half the bytes
    for key in ("base_dispatch", "base_combine", "dispatch", "combine"):
        assert all(r[f"{key}_gbps"] > 0 for r in rows), key
    last = p.stdout.strip().splitlines()[-1].split()
    assert last[:3] == ["nccl", "fp8", "2"] and "64x256," in last


def test_bench_ep_train_tiny_two_ranks(tmp_path):
    out = tmp_path / "ep_train.json"
    args = ("--tiny", "--iters", "1", "--warmup", "1", "--ep-chunks", "1,2", "--json", out)
    p = torchrun("bench/bench_ep_train.py", *args)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(r["mode"], r["ep_chunks"]) for r in rows] == [("dp", 1), ("ep", 1), ("ep", 2)]
    assert all(r["tok_s"] > 0 for r in rows)
    assert p.stdout.strip().splitlines()[-1].split()[:3] == ["ep", "2", "32"]
