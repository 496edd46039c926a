"""bench/bench_dispatch.py and bench/bench_ep_train.py run end to end under torchrun on 2 gloo processes
(--tiny), write their JSON and print their tables last; bench_dispatch's --shared-gpu launcher runs its worlds
on CPU (--tiny), under a stand-in MPS control program, and kills a world that stalls while the next still runs.
Every wait is bounded (the launcher's --timeout per world, subprocess timeouts around it)."""

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


def shared_gpu(tmp_path, *args, path=""):
    """bench_dispatch.py --shared-gpu --tiny (its own launcher, CPU worlds): the process, its JSON and md."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ENV_PATH, os.environ.get("PYTHONPATH", "")]))
    env["PATH"] = os.pathsep.join([path, env["PATH"]]) if path else env["PATH"]
    out, md = tmp_path / "shared.json", tmp_path / "shared.md"
    cmd = [sys.executable, "bench/bench_dispatch.py", "--shared-gpu", "--tiny", "--json", out, "--md", md]
    p = subprocess.run(
        [*map(str, cmd), *map(str, args)], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT
    )
    got = json.loads(out.read_text()) if out.exists() else None
    return p, got, md.read_text() if md.exists() else ""


def test_bench_dispatch_shared_gpu_launcher_with_and_without_mps(tmp_path):
    # a stand-in for nvidia-cuda-mps-control: logs what it is asked, and where the pipe folder is
    log, bin_dir = tmp_path / "mps.log", tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-cuda-mps-control"
    fake.write_text(
        "#!/bin/sh\n"
        f'if [ "$#" -gt 0 ]; then echo "$* $CUDA_MPS_PIPE_DIRECTORY" >> {log}; exit 0; fi\n'
        f'read cmd; echo "$cmd $CUDA_MPS_PIPE_DIRECTORY" >> {log}\n'
        'if [ "$cmd" = get_server_list ]; then echo 4242; fi\n'
    )
    fake.chmod(0o755)
    args = (
        "--procs",
        "2",
        "--tokens",
        "16,64",
        "--fp8",
        "--mps",
        "--warmup",
        "1",
        "--iters",
        "2",
        "--timeout",
        "120",
    )
    p, got, md = shared_gpu(tmp_path, *args, path=str(bin_dir))
    assert p.returncode == 0, p.stdout + p.stderr
    assert got["mps"] == [False, True]
    assert [(w["world"], w["mps"], w["status"]) for w in got["worlds"]] == [(2, False, "ok"), (2, True, "ok")]
    assert got["worlds"][1]["mps_servers"] == "4242"
    calls = [line.split() for line in log.read_text().splitlines()]
    assert [c[0] for c in calls] == ["-d", "get_server_list", "quit"]
    assert len({c[1] for c in calls}) == 1 and calls[0][1].endswith(
        "mps_pipe"
    )  # one daemon, its own pipe folder
    rows = got["results"]
    keys = [(r["mps"], r["tokens"], r["rows"]) for r in rows]
    assert keys == [(m, t, k) for m in (False, True) for t in (16, 64) for k in ("bfloat16", "fp8")]
    assert all(r["world"] == 2 and r["baseline"] == "copy" and r["transport"] == "nccl" for r in rows)
    for key in ("base_dispatch", "base_combine", "dispatch", "combine"):
        assert all(r[f"{key}_gbps"] > 0 for r in rows), key
    assert all(r["layer_us"] > 0 and r["base_layer_us"] > 0 for r in rows)
    assert rows[1]["bytes"] * 2 < rows[0]["bytes"] * 1.1  # FP8 rows: about half the bytes
    assert "## Fixed cost per layer" in md and md.count("| 2 | fp8 | True |") == 2  # GB/s and fixed-cost rows
    assert p.stdout.strip().splitlines()[-1].split()[:5] == ["nccl", "fp8", "True", "2", "64"]


def test_bench_dispatch_shared_gpu_kills_a_stalled_world(tmp_path):
    # world 3 never finishes: killed at its --timeout and recorded with its ranks' logs; world 2 still runs
    args = ("--procs", "3,2", "--stall-world", "3", "--timeout", "10,120", "--warmup", "1", "--iters", "1")
    p, got, md = shared_gpu(tmp_path, *args)
    assert p.returncode == 1, p.stdout + p.stderr
    stalled, ok = got["worlds"]
    assert stalled["world"] == 3 and stalled["status"].startswith("timeout"), stalled
    assert sorted(stalled["log_tail"]) == [
        "0",
        "1",
        "2",
    ]  # each rank's last lines (stacks when it got that far)
    assert 10 <= stalled["wall_s"] < 60
    assert ok["world"] == 2 and ok["status"] == "ok"
    assert got["results"] and all(r["world"] == 2 for r in got["results"])
    assert "| 3 | False | timeout" in md


def test_bench_ep_train_tiny_two_ranks(tmp_path):
    out = tmp_path / "ep_train.json"
    args = ("--tiny", "--iters", "1", "--warmup", "1", "--ep-chunks", "1,2", "--json", out)
    p = torchrun("bench/bench_ep_train.py", *args)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(r["mode"], r["ep_chunks"]) for r in rows] == [("dp", 1), ("ep", 1), ("ep", 2)]
    assert all(r["tok_s"] > 0 for r in rows)
    assert p.stdout.strip().splitlines()[-1].split()[:3] == ["ep", "2", "32"]
