"""Models and datasets named by their Hugging Face Hub id (ORG/NAME) for `moe8 finetune`, through
huggingface_hub: the local cache first (HF_HUB_CACHE), the Hub only for what the cache lacks, never with
HF_HUB_OFFLINE=1. A model's config and tokenizer files come first (the checks before loading need only
them), its weights when the model is built."""

from __future__ import annotations

import re
from pathlib import Path

from .config import FinetuneError

# a model's small files (config, tokenizer, weight index, chat template) and its weights
MODEL_FILES = ["*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
WEIGHT_FILES = ["*.safetensors", "*.json"]
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".txt")
LOCAL_SUFFIXES = (*DATA_SUFFIXES, ".gz", ".bz2", ".xz", ".zst")  # a name ending so is a file, never a Hub id
# the file names of a dataset's splits, per key: data reads the train split, eval_data a held-out one
SPLITS = {"data": ("train",), "eval_data": ("validation", "valid", "val", "test", "eval", "dev")}
_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")


def is_hub_id(name: str) -> bool:
    """ORG/NAME, and no such local path: a local file or directory always wins."""
    return bool(_ID.fullmatch(name)) and ".." not in name and not Path(name).exists()


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def snapshot(repo_id: str, key: str, patterns: list[str], repo_type: str | None = None) -> Path:
    """The cached snapshot folder of repo_id holding `patterns`: from the cache when there, else downloaded
    (FinetuneError naming `key` and the cache when offline with no cached copy, or when the Hub refuses). A
    model's files are its top-level ones: subfolders hold other formats (gpt-oss' original/ weights)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    kw = dict(repo_type=repo_type, allow_patterns=patterns, ignore_patterns=None if repo_type else ["*/*"])
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, **kw))
    except (LocalEntryNotFoundError, HFValidationError):
        pass
    except OSError:  # an incomplete cached snapshot: fetched again below
        pass
    try:
        return Path(snapshot_download(repo_id, **kw))
    except (LocalEntryNotFoundError, HfHubHTTPError, HFValidationError, OSError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        what = "dataset" if repo_type == "dataset" else "model"
        raise FinetuneError(
            f"{key}: {repo_id} is not a local path, and the Hugging Face {what} {repo_id} is not in the cache "
            f"({cache_dir()}): {type(e).__name__}: {first}"
        ) from None


def model_dir(repo_id: str) -> Path:
    """The snapshot folder of a Hub model with its config and tokenizer files (no weights yet)."""
    path = snapshot(repo_id, "model", MODEL_FILES)
    if not (path / "config.json").is_file():
        raise FinetuneError(f"model: {repo_id} has no config.json in its snapshot {path}")
    return path


def model_weights(repo_id: str, path: Path) -> Path:
    """The snapshot folder of a Hub model with its weights: `path` when it holds them, else downloaded."""
    if any(path.glob("*.safetensors")) and _shards_present(path):
        return path
    got = snapshot(repo_id, "model", WEIGHT_FILES)
    if not any(got.glob("*.safetensors")) or not _shards_present(got):
        raise FinetuneError(
            f"model: {repo_id}: no complete *.safetensors weights in its snapshot {got} (cache {cache_dir()}); "
            "moe8 finetune loads safetensors checkpoints"
        )
    return got


def _shards_present(path: Path) -> bool:
    import json

    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return True
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all((path / s).is_file() for s in shards)


def data_files(spec: str, key: str) -> list[Path]:
    """The files `key` (data or eval_data) names: a local file, or a Hub dataset's files of the key's split
    (file names with train for data; validation, test, ... for eval_data; every data file when no name
    says a split). FinetuneError naming the key for a missing file."""
    path = Path(spec)
    if path.exists() or not is_hub_id(spec) or path.suffix in LOCAL_SUFFIXES:
        if not path.exists():  # a directory or unreadable file: the reader says why
            raise FinetuneError(f"{key}: file not found: {spec}")
        return [path]
    root = snapshot(spec, key, [f"*{s}" for s in DATA_SUFFIXES], repo_type="dataset")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES)
    if not files:
        raise FinetuneError(f"{key}: the dataset {spec} ({root}) has no {', '.join(DATA_SUFFIXES)} files")
    suffix = max({p.suffix for p in files}, key=lambda s: sum(p.suffix == s for p in files))
    files = [p for p in files if p.suffix == suffix]  # one kind of file: the most common one

    def split_of(p: Path) -> str | None:
        words = set(re.split(r"[^a-z]+", str(p.relative_to(root)).lower()))
        return next((k for k, names in SPLITS.items() if words & set(names)), None)

    if not any(split_of(p) for p in files):
        return files
    mine = [p for p in files if split_of(p) == key]
    if not mine:
        names = ", ".join(SPLITS[key])
        raise FinetuneError(
            f"{key}: the dataset {spec} has no {names} file (its files: "
            f"{', '.join(str(p.relative_to(root)) for p in files[:8])})"
        )
    return mine


def local_data(cfg):
    """cfg with data and eval_data as local files (data_files; auto and an empty eval_data as they are)."""
    import dataclasses

    over = {}
    for key in ("data", "eval_data"):
        spec = getattr(cfg, key)
        if spec and spec != "auto":
            files = data_files(spec, key)
            if len(files) > 1:
                raise FinetuneError(
                    f"{key}: the dataset {spec} holds {len(files)} files for this split; moe8 finetune reads one "
                    f"file: name one of them ({files[0]}, ...)"
                )
            over[key] = str(files[0])
    return dataclasses.replace(cfg, **over) if over else cfg
