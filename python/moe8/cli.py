"""The `moe8` command (also `python -m moe8`). `moe8 demo` trains a tiny MoE model; `moe8 finetune` fine-tunes
a Hugging Face MoE model; `moe8 merge` folds a LoRA adapter into its base; `moe8 recipes` lists the fine-tuning recipes; `moe8 info` prints the build (CPU /
CUDA / CUTLASS, architectures, versions), torch and the GPU, and warns when they don't match."""

from __future__ import annotations

import sys

USAGE = """usage: moe8 COMMAND [options]     (or: python -m moe8 COMMAND [options])

commands:
  demo       train a tiny MoE language model through moe8 and print loss and tokens/s (moe8 demo --help)
  finetune   fine-tune a Hugging Face MoE model (full or LoRA), metrics and an HTML report (moe8 finetune --help)
  merge      fold a LoRA adapter (experts included) into its base, write a Hugging Face checkpoint (moe8 merge --help)
  recipes    list the fine-tuning recipes with their measured memory and speed; `moe8 recipes NAME` prints one
  info       print what this moe8 build holds (CPU only / CUDA / CUTLASS sm90a, GPU architectures, CUDA and
             CUTLASS versions), the torch version and the GPU; warns when the GPU can't run the build's kernels

options:
  -h, --help     this text
  --version      print the moe8 version
"""


def info() -> int:
    import torch

    import moe8
    from moe8 import build_info

    build = build_info.read()
    device = build_info.visible_device()
    cuda = torch.version.cuda or "none (CPU build)"
    print(f"moe8     {moe8.__version__} ({moe8.__path__[0]})")
    print(f"build    {build.describe()}")
    print(f"torch    {torch.__version__} (CUDA {cuda})")
    if device is None:
        print("GPU      none visible")
    else:
        name, cc = device
        usable = "yes" if moe8.cuda_available() else "no"
        print(f"GPU      {name} (compute capability {cc[0]}.{cc[1]}); moe8 CUDA kernels usable: {usable}")
    warning = build_info.mismatch(build, device)
    if warning:
        print(f"warning: {warning}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "--version":
        from . import __version__

        print(f"moe8 {__version__}")
        return 0
    if cmd == "demo":
        from .demo import main as demo

        return demo(rest)
    if cmd == "finetune":
        from .finetune import main as finetune

        return finetune(rest)
    if cmd == "merge":
        from .finetune.merge import main as merge

        return merge(rest)
    if cmd == "recipes":
        from .finetune.recipes import main as recipes

        return recipes(rest)
    if cmd == "info":
        return info()
    print(f"moe8: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
