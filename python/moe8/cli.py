"""The `moe8` command. `moe8 demo` trains a tiny MoE model; `moe8 finetune` fine-tunes a Hugging Face MoE model;
`moe8 info` prints the build and device."""

from __future__ import annotations

import sys

USAGE = """usage: moe8 COMMAND [options]

commands:
  demo      train a tiny MoE language model through moe8 and print loss and tokens/s (moe8 demo --help)
  finetune  fine-tune a Hugging Face MoE model (full or LoRA), metrics and an HTML report (moe8 finetune --help)
  info      print the moe8 version, the torch version and whether CUDA kernels are usable
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from .demo import main as demo

        return demo(rest)
    if cmd == "finetune":
        from .finetune import main as finetune

        return finetune(rest)
    if cmd == "info":
        import torch

        import moe8

        gpu = torch.cuda.get_device_name(0) if moe8.cuda_available() else "none"
        print(
            f"moe8 {moe8.__version__}, torch {torch.__version__}, CUDA kernels usable: {moe8.cuda_available()}, "
            f"GPU: {gpu}"
        )
        return 0
    print(f"moe8: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
