"""The peers bench_step_profile.py measures beside plain transformers and moe8, and why a peer's row did not run.

- Liger Kernel (`liger-kernel`, Triton): `apply_liger_kernel_to_<model_type>(model=model)` with its defaults
  (fused linear cross-entropy, RMSNorm, RoPE, SwiGLU / its fused MoE experts, each where the family has one);
  a family without such a function gets `_apply_liger_kernel_to_instance(model)`, and the row is skipped when
  that changes nothing.
- transformers' own experts implementations that load a kernel from the Hugging Face Hub (`sonicmoe`,
  `deepgemm`): a toy model of the family is built with that implementation and stepped once on the run's
  device (`probe_experts`); the full row runs only if that works, otherwise the row records the exception.

    from peers import LIGER, HUB_EXPERTS, prepare_liger, probe_experts   # this folder is on sys.path
"""

from __future__ import annotations

import importlib.metadata
import inspect
import sys

import torch

LIGER = "transformers + Liger"
LIGER_PIN = "liger-kernel==0.8.5"

# impl name in the table -> transformers' experts_implementation, and why it cannot be installed on a machine
# without network access (checked against transformers 5.17.0's integrations/{sonicmoe,deepgemm}.py and the
# PyPI distributions' metadata); the probe's own exception is recorded beside it
HUB_EXPERTS = {
    "transformers (sonicmoe)": (
        "sonicmoe",
        "transformers 5.17 loads kernels-community/sonic-moe (revision ep-support) from the Hugging Face Hub "
        "through the `kernels` package (0.16.x) and wants nvidia-cutlass-dsl >= 4.6.0; the PyPI package "
        "sonic-moe 0.1.2.post1 is not what it imports, and pins torch<=2.9.1 and nvidia-cutlass-dsl==4.4.2",
    ),
    "transformers (deepgemm)": (
        "deepgemm",
        "transformers 5.17 loads kernels-community/deep-gemm (version 2) from the Hugging Face Hub through the "
        "`kernels` package (0.16.x) and JIT-compiles it with nvcc; the PyPI deep-gemm 1.0.0 is an sdist of "
        "DeepGEMM 1.0 with FP8 GEMMs only (no m_grouped_bf16_gemm_nt_contiguous) and without its CUDA headers",
    ),
}


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: " + " ".join(str(e).split())


def liger_version() -> str | None:
    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return None


def _snapshot(model) -> tuple:
    """What a Liger patch changes: per module its class, its class's and its instance's forward, and the
    modeling module's globals (RoPE functions, norm / MLP classes)."""
    mods = tuple(
        (name, type(m), type(m).__dict__.get("forward"), m.__dict__.get("forward"))
        for name, m in model.named_modules()
    )
    modeling = sys.modules[type(model).__module__]
    return mods, tuple(sorted((k, id(v)) for k, v in vars(modeling).items()))


def prepare_liger(model, device: torch.device) -> tuple[str | None, dict]:
    """Apply Liger's defaults to `model` (in place). Returns (None, what was applied) when the row can run, or
    (why it cannot, what was applied). Liger's patches also reassign names in the family's modeling module
    (RoPE, the RMSNorm and experts classes), so the caller runs these rows after every other row."""
    version = liger_version()
    try:
        import liger_kernel.transformers as lk
    except ImportError as e:
        return f"liger-kernel is not installed (pip install {LIGER_PIN}): {_one_line(e)}", {}
    model_type = model.config.model_type
    fn_name = f"apply_liger_kernel_to_{model_type}"
    fn = getattr(lk, fn_name, None)
    if fn is None:
        before = _snapshot(model)
        lk._apply_liger_kernel_to_instance(model)
        info = {"version": version, "function": "_apply_liger_kernel_to_instance", "kernels": []}
        if _snapshot(model) == before:
            return (
                f"liger-kernel {version} has no {fn_name}, and _apply_liger_kernel_to_instance(model) changed "
                f"nothing (no entry for model_type {model_type!r} in its MODEL_TYPE_TO_APPLY_LIGER_FN)",
                info,
            )
    else:
        defaults = [k for k, p in inspect.signature(fn).parameters.items() if p.default is True]
        fn(model=model)
        info = {"version": version, "function": fn_name, "kernels": defaults}
    if device.type != "cuda":
        return (
            f"Liger's Triton kernels need a CUDA GPU; this run is on the CPU ({info['function']} applied)",
            info,
        )
    return None, info


def probe_experts(build_tiny, device: torch.device) -> str | None:
    """One forward + backward of the toy model `build_tiny()` (bf16, on `device`): None when it ran, else the
    exception, on one line. The hub-kernel experts raise at their first call, not when the model is built."""
    try:
        model = build_tiny()
        ids = torch.randint(0, model.config.vocab_size, (1, 16), device=device)
        model(input_ids=ids, labels=ids).loss.backward()
    except Exception as e:  # noqa: BLE001  (any failure is the finding: it is recorded, not hidden)
        return _one_line(e)
    return None


SONICMOE = "SonicMoE"
SONICMOE_NEEDS = (
    "sonic-moe from source (github.com/Dao-AILab/sonic-moe) and quack-kernels at the commit its requirements pin, "
    "with nvidia-cutlass-dsl==4.2.1, importable (on PYTHONPATH); its first call per shape compiles its kernels"
)


def _git_commit(path) -> str | None:
    """HEAD of the git checkout whose top folder is `path`; None when `path` is not one (a source tree copied
    into another repository would otherwise report that repository's commit)."""
    import subprocess
    from pathlib import Path

    try:
        p = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "--show-toplevel", "HEAD"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = p.stdout.split()
    if p.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != Path(path).resolve():
        return None
    return lines[1]


def sonicmoe_version() -> tuple[str | None, dict]:
    """(None, what was imported: the package's folder and commit), or (why SonicMoE cannot run here, {}).
    The commit comes from a git checkout of the package, else from SONICMOE_COMMIT in the environment (for a
    source tree copied without its history), else "not recorded"."""
    import os
    from pathlib import Path

    try:
        import sonicmoe
    except Exception as e:  # noqa: BLE001  (ImportError, or the DSL failing to load: the reason is the finding)
        return f"sonicmoe is not importable ({SONICMOE_NEEDS}): {_one_line(e)}", {}
    if not torch.cuda.is_available():
        return "SonicMoE's kernels need a CUDA GPU (Hopper); this run has none", {}
    folder = Path(sonicmoe.__file__).resolve().parents[1]
    commit = _git_commit(folder) or os.environ.get("SONICMOE_COMMIT") or "not recorded"
    return None, {"path": str(folder), "commit": commit}


def sonicmoe_block(gate_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int):
    """SonicMoE's MoE module (its fused softmax top-k router and IO-aware experts, SwiGLU) holding the weights
    of a transformers Qwen3-MoE-style block: router gate_w [E, H], gate_up [E, 2I, H] (gate rows first, as
    transformers stores them; SonicMoE interleaves gate and up rows), down [E, H, I]. Its routing is the block's
    (softmax over the top-k logits = the softmax renormalised over the top k). Returns the module; call
    module(x)[0] for the output."""
    from sonicmoe import MoE
    from sonicmoe.enums import ActivationType

    E, two_i, H = gate_up.shape
    inter = two_i // 2
    with torch.device(gate_up.device):
        moe = MoE(E, top_k, H, inter, ActivationType.SWIGLU, add_bias=False, std=0.02).to(gate_up.dtype)
    with torch.no_grad():
        moe.router.weight.copy_(gate_w)
        moe.c_fc.weight[:, 0::2].copy_(gate_up[:, :inter])
        moe.c_fc.weight[:, 1::2].copy_(gate_up[:, inter:])
        moe.c_proj.weight.copy_(down)
    return moe
