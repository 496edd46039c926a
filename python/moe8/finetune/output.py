"""The output directory of `moe8 finetune`, checked before the model is built or anything is written: it must
be creatable and writable, an existing non-empty one is continued only by --resume, and --overwrite deletes
only an empty directory or a moe8 run (one holding finetune.toml or metrics.jsonl)."""

from __future__ import annotations

import os
from pathlib import Path

from .config import Config, FinetuneError

MARKERS = ("finetune.toml", "metrics.jsonl")  # what every moe8 run writes first


def is_run(out: Path) -> bool:
    """Whether `out` holds a moe8 finetune run (its marker files)."""
    return any((out / m).is_file() for m in MARKERS)


def check(out: Path, cfg: Config) -> None:
    """FinetuneError for an output_dir that is a file, exists (without --resume / --overwrite), is not a moe8
    run but would be deleted by --overwrite, or cannot be created or written."""
    if out.exists() and not out.is_dir():
        raise FinetuneError(f"output_dir {out}: exists and is not a directory")
    if not cfg.resume and out.is_dir() and any(out.iterdir()):
        if not cfg.overwrite:
            raise FinetuneError(
                f"output_dir {out} exists and is not empty: --resume continues it, --overwrite replaces it"
            )
        if not is_run(out):
            raise FinetuneError(
                f"overwrite: output_dir {out} is not a moe8 run (no {' or '.join(MARKERS)}): it is not deleted; "
                "choose another output_dir, or empty it first"
            )
    writable(out)


def writable(out: Path) -> None:
    """Create `out` (and its missing parents), write and remove a probe file, then remove the directories
    created here: FinetuneError naming output_dir when any step fails."""
    created, p = [], out
    while not p.exists() and p != p.parent:
        created.append(p)
        p = p.parent
    probe = out / f".moe8-write-probe-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise FinetuneError(
            f"output_dir {out}: cannot be created or written ({e.strerror or e}"
            f"{f': {e.filename}' if e.filename else ''}); choose another output_dir"
        ) from None
    finally:
        for d in created:  # deepest first: nothing is left behind
            try:
                d.rmdir()
            except OSError:
                pass
