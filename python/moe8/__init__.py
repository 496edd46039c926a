"""moe8 — fast Mixture-of-Experts training: fused routing, permutation and grouped GEMM in C++/CUDA,
plugged into PyTorch and Hugging Face transformers with one line (`import moe8; moe8.enable()`)."""

from . import _core, ops, optim
from .config import Config
from .hf import accelerate, disable, enable, is_accelerated
from .layer import MoELayer, RouteOut, experts_forward, load_balancing_loss, moe_forward, route, z_loss

__version__ = "0.1.0"


def cuda_available() -> bool:
    """True when moe8 was built with CUDA and a GPU is visible."""
    return _core.C.cuda_available()


__all__ = [
    "Config",
    "accelerate",
    "disable",
    "enable",
    "is_accelerated",
    "MoELayer",
    "RouteOut",
    "cuda_available",
    "experts_forward",
    "load_balancing_loss",
    "moe_forward",
    "ops",
    "optim",
    "route",
    "z_loss",
]
