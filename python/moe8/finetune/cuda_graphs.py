"""The `cuda_graphs` key of `moe8 finetune`: whether moe8.graphs replays the run's checkpointed decoder layers
as CUDA graphs (true: or refuse the run; auto: where it can, else say why not), and its counts as one line for
the log and the report."""

from __future__ import annotations

from typing import Optional

import torch

from .config import Config, FinetuneError


def unavailable(cfg: Config, device: torch.device) -> Optional[str]:
    """Why moe8.graphs cannot replay this run's layers, or None when it can."""
    if device.type != "cuda":
        return f"the model trains on {device.type}, and CUDA graphs need a CUDA device"
    if not cfg.activation_checkpointing:
        return "activation_checkpointing is off, and the graphs replay the checkpointed layers"
    if cfg.ep > 1:
        return f"ep = {cfg.ep}: the expert dispatch reads its token counts on the host, which a graph cannot hold"
    if cfg.fsdp:
        return "fsdp: FSDP2's hooks on every decoder layer keep the layers eager"
    return None


def wanted(cfg: Config, device: torch.device, log) -> bool:
    """Whether to capture the layers: true refuses (FinetuneError) a run the graphs cannot replay, before anything
    is loaded; auto says once why it leaves them off."""
    why = unavailable(cfg, device)
    if why is None:
        return cfg.cuda_graphs is not False
    if cfg.cuda_graphs is True:
        raise FinetuneError(f"cuda_graphs = true: {why}; set cuda_graphs = 'auto' or false")
    if cfg.cuda_graphs == "auto":
        log(f"cuda_graphs = 'auto': off, {why}")
    return False


def capture(model, cfg: Config, log) -> bool:
    """moe8.graphs.capture_layers on the built model (checkpointing on, LoRA and FP8 applied); whether it took
    the layers (auto: not when the model has no checkpointed transformers layers, said in the log)."""
    from .. import graphs

    try:
        n = graphs.capture_layers(model)
    except (ValueError, RuntimeError) as e:
        if cfg.cuda_graphs is True:
            raise FinetuneError(f"cuda_graphs = true: {e}") from None
        log(f"cuda_graphs = 'auto': off, {e}")
        return False
    log(
        f"cuda_graphs: {n} checkpointed decoder layers replayed as CUDA graphs (each shape captured at its second call)"
    )
    return True


def summary(stats: dict) -> str:
    """moe8.graphs.stats(model) as one line: layers, graphs captured, calls replayed and eager (with why), the
    graphs' memory pool."""
    why = "; ".join(f"{reason}: {n}" for reason, n in stats["reasons"].items())
    return (
        f"{stats['layers']} layers, {stats['captured']} graphs captured, {stats['replayed']} calls replayed, "
        f"{stats['eager']} eager"
        + (f" ({why})" if why else "")
        + f"; memory pool {stats['pool_reserved_gib']:g} GiB"
    )
