"""bench/bench_host.py --counts on the CPU: the per-layer counts of the LoRA decoder layer over the bf16 and the
FP8 base, their 48-layer scaling, and the host work of one FP8 linear layer's forward (one call into the
extension, two allocations: the output and the scratch of its quantised rows)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import moe8

ROOT = Path(__file__).resolve().parents[2]
ENV_PATH = str(Path(moe8.__file__).resolve().parents[1])  # the moe8 this test runs (installed or checkout)


@pytest.mark.slow
def test_bench_host_counts(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "counts.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ENV_PATH, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "bench/bench_host.py", "--counts", "--repeats", "1", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"moe8", "moe8_fp8base"}
    for r in results.values():
        for name in ("train", "no_grad"):
            layer, one = r[name]["per_layer"], r[name]["model_1_layer"]
            assert layer["ext_calls"] > 0 and layer["allocs"] > 0
            assert r[name]["step_48_layers"]["ext_calls"] == one["ext_calls"] + 47 * layer["ext_calls"]
        assert r["train"]["per_layer"]["ext_calls"] > r["no_grad"]["per_layer"]["ext_calls"]
    fp8 = results["moe8_fp8base"]
    ext = fp8["train"]["per_layer"]["ext"]
    assert (
        ext["quantize_grouped_gemm_fp8"] == 12
    )  # q, k, v, o and the experts' two GEMMs, forward and recompute
    assert "quantize_rows_1x128" not in ext and "grouped_gemm_fp8" not in ext
    q = fp8["per_call"]["q_proj"]
    assert (q["ext_calls"], q["allocs"]) == (1, 2), q
    assert results["moe8"]["per_call"]["q_proj"]["ext_calls"] == 0  # F.linear
    assert "q_proj" in p.stdout.splitlines()[-8]
