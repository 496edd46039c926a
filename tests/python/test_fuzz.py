"""Every call of moe8's public ops and composites either returns the reference's result or raises ValueError /
TypeError naming the argument at fault; none crashes. The calls are generated (tests/python/_fuzz_worker.py:
shapes 0, 1, odd and large-but-cheap, dtypes, strided views, NaN, indices out of range, mismatched sizes) and
run in child processes in batches, so that a segfault or a hang fails the test, naming the case it hit.

Bounded: MOE8_FUZZ_SEED (default 0) and MOE8_FUZZ_CASES (cases per device, default 400 on the CPU, which
takes well under a minute on two cores; CUDA cases run too when moe8 has CUDA and a GPU is visible).
Longer run, e.g. on a GPU machine:  MOE8_FUZZ_CASES=4000 MOE8_FUZZ_SEED=7 python -m pytest -q tests/python/test_fuzz.py
A run for a given time instead: MOE8_FUZZ_SECONDS=600 (batches start until then; MOE8_FUZZ_CASES is then
ignored), with MOE8_FUZZ_JOBS=N batches at once (default 1).

Each run counts its cases per op: how many returned the reference's result, raised a named error, ran with
unchecked values (a GPU given indices the API does not check: any result, nothing outside the tensors), failed,
and crashed or hung. The table is printed in the test's output and, through conftest's terminal summary, at
the end of every pytest run that ran the fuzzer.
"""

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import FUZZ_TABLES, devices

import moe8

WORKER = Path(__file__).resolve().parent / "_fuzz_worker.py"
SEED = os.environ.get("MOE8_FUZZ_SEED", "0")
CASES = int(os.environ.get("MOE8_FUZZ_CASES", "400"))
SECONDS = float(os.environ.get("MOE8_FUZZ_SECONDS", "0"))  # > 0: batches start until this many seconds passed
JOBS = int(os.environ.get("MOE8_FUZZ_JOBS", "1"))  # batches run at once
BATCH = 150  # cases per child process: one import of torch per batch
TIMEOUT_S = 300  # a batch that runs past this hangs


def run_batch(device: str, first: int, n: int) -> subprocess.CompletedProcess:
    where = str(Path(moe8.__file__).resolve().parents[1])  # the moe8 these tests import (installed or not)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([where, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(WORKER), SEED, str(n), device, str(first)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


COLUMNS = (
    "result",
    "error",
    "unchecked",
    "failed",
    "crashed",
)  # how a case ended; the worker's, then crashed


def tally(stdout: str, counts: dict) -> None:
    """Adds a batch's cases to counts[op][column]: each "end" line, and a "start" without its "end" (the case a
    crash or a hang stopped) as crashed."""
    started = {}
    for ln in stdout.splitlines():
        if m := re.fullmatch(r"start (\d+) (\S+) \S+", ln):
            started[m[1]] = m[2]
        elif m := re.fullmatch(r"end (\d+) (\S+) (\w+)", ln):
            started.pop(m[1], None)
            counts.setdefault(m[2], dict.fromkeys(COLUMNS, 0))[m[3]] += 1
    for op in started.values():
        counts.setdefault(op, dict.fromkeys(COLUMNS, 0))["crashed"] += 1


def table(counts: dict, device: str, cases: int, seconds: float) -> str:
    head = f"fuzz cases on {device} (seed {SEED}, {cases} cases in {seconds:.0f} s, {max(1, JOBS)} at once)"
    rows = [("op", "cases", *COLUMNS)] + [
        (op, sum(c.values()), *c.values()) for op, c in sorted(counts.items())
    ]
    total = {k: sum(c[k] for c in counts.values()) for k in COLUMNS}
    rows.append(("all", sum(total.values()), *total.values()))
    w = max(len(str(r[0])) for r in rows)
    return "\n".join([head] + [f"{r[0]:<{w}}" + "".join(f"{v:>10}" for v in r[1:]) for r in rows])


def batch_failures(first: int, n: int, out) -> list:
    """Why a batch failed (empty when it passed); out is its CompletedProcess or its TimeoutExpired."""
    if isinstance(out, subprocess.TimeoutExpired):
        last = [ln for ln in (out.stdout or "").splitlines() if ln.startswith("start")]
        return [f"batch {first}..{first + n} hung past {TIMEOUT_S} s at: {last[-1:] or 'its start'}"]
    if out.returncode == 0:
        return []
    lines = out.stdout.splitlines()
    fails = [ln for ln in lines if ln.startswith("FAIL")]
    if fails:
        return fails
    started = [ln for ln in lines if ln.startswith("start")]  # killed mid-case, or an error outside the cases
    return [
        f"batch {first}..{first + n} died with returncode {out.returncode} during "
        f"{started[-1] if started else 'start-up'} (seed {SEED}):\n{out.stderr[-3000:]}"
    ]


def run_batches(device: str) -> list:
    """[(first, n, CompletedProcess or TimeoutExpired)] for every batch run: CASES cases, or (SECONDS > 0)
    batches started until SECONDS have passed; JOBS at once."""
    deadline = time.monotonic() + SECONDS
    lock, done, nxt = threading.Lock(), [], [0]

    def take():
        with lock:
            first = nxt[0]
            n = BATCH if SECONDS > 0 else min(BATCH, CASES - first)
            if n <= 0 or (SECONDS > 0 and time.monotonic() >= deadline):
                return None
            nxt[0] += n
            return first, n

    def loop():
        while (job := take()) is not None:
            try:
                out = run_batch(device, *job)
            except subprocess.TimeoutExpired as e:
                e.stdout = (
                    (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
                )
                out = e
            with lock:
                done.append((*job, out))

    threads = [threading.Thread(target=loop) for _ in range(max(1, JOBS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(done, key=lambda d: d[0])


@pytest.mark.parametrize("device", devices())
def test_fuzz_public_api(device, request):
    start = time.monotonic()
    failures, counts, generated = [], {}, 0
    for first, n, out in run_batches(device):
        generated += n
        tally(out.stdout or "", counts)
        failures += batch_failures(first, n, out)
    summary = table(counts, device, generated, time.monotonic() - start)
    print(summary)
    request.config.stash.setdefault(FUZZ_TABLES, []).append(summary)
    assert not failures, f"{len(failures)} failing cases (seed {SEED}):\n" + "\n".join(failures[:20])
    ran = sum(sum(c.values()) for c in counts.values())
    assert ran == generated, f"{ran} cases counted, {generated} generated"  # every case ended exactly once
    assert all(c["crashed"] == 0 and c["failed"] == 0 for c in counts.values())


def test_worker_catches_a_crash_and_a_wrong_result(tmp_path):
    """The guard itself: a child killed by a signal, and a case whose result differs, both fail the batch."""
    crash = tmp_path / "crash.py"
    crash.write_text(
        "import os, signal\nprint('start 0 op fault', flush=True)\nos.kill(os.getpid(), signal.SIGSEGV)\n"
    )
    out = subprocess.run([sys.executable, str(crash)], capture_output=True, text=True, timeout=60)
    assert out.returncode < 0 and out.stdout.startswith("start 0")
    sys.path.insert(0, str(WORKER.parent))
    try:
        import _fuzz_worker as w
    finally:
        sys.path.pop(0)
    import torch

    wrong = w.Case("op", w.OK, lambda: torch.ones(3), lambda: torch.zeros(3))
    assert "differs" in w.run(wrong, "cpu")
    unnamed = w.Case("op", "fault", lambda: (_ for _ in ()).throw(ValueError("b: bad")), None, ("gate_up",))
    assert "names none" in w.run(unnamed, "cpu")
    silent = w.Case("op", "fault", lambda: torch.ones(1), None, ("x",))
    assert "no error" in w.run(silent, "cpu")
    crashing = w.Case("op", "fault", lambda: [][1], None, ("x",))
    assert "IndexError" in w.run(crashing, "cpu")


def test_tally_counts_each_case_once_and_a_case_without_its_end_as_crashed():
    counts = {}
    tally(
        "start 0 plan ok\nend 0 plan result\nstart 1 plan ids\nFAIL x\nend 1 plan failed\nstart 2 route k\n",
        counts,
    )
    tally("start 3 route ok\nend 3 route error\n", counts)
    assert counts["plan"] == dict(result=1, error=0, unchecked=0, failed=1, crashed=0)
    assert counts["route"] == dict(result=0, error=1, unchecked=0, failed=0, crashed=1)
    assert table(counts, "cpu", 4, 1.0).splitlines()[-1].split() == ["all", "4", "1", "1", "0", "1", "1"]
