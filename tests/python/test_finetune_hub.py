"""`moe8 finetune --model ORG/NAME` and `--data ORG/NAME`: Hugging Face Hub ids resolved through huggingface_hub
from a local cache laid out as the Hub's (models--ORG--NAME/refs/main, snapshots/COMMIT/...), made here, with
HF_HUB_OFFLINE=1: no network. Each run is a subprocess, since huggingface_hub reads its environment once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", minversion="5.0", reason="moe8 finetune needs transformers>=5")
pytest.importorskip("huggingface_hub")

import test_finetune as base  # noqa: E402

import moe8  # noqa: E402

_undo_moe8 = base._undo_moe8
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cached(cache: Path, kind: str, repo_id: str) -> Path:
    """The snapshot folder of repo_id in a Hub cache (kind: models or datasets), its refs/main pointing at it."""
    repo = cache / f"{kind}--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True, exist_ok=True)
    return snap


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A Hub cache holding the tiny model (config, weights, byte tokenizer) as acme/tiny-moe, and a chat
    dataset acme/chats with a train and a test file."""
    from moe8.finetune.data import byte_tokenizer

    cache = tmp_path_factory.mktemp("hub")
    snap = cached(cache, "models", "acme/tiny-moe")
    base.tiny_model(moe8=False).save_pretrained(snap)
    byte_tokenizer().save_pretrained(snap)
    data = cached(cache, "datasets", "acme/chats") / "data"
    data.mkdir()
    chats = [{"messages": c} for c in base.chats(40)]
    base.write_jsonl(data / "train.jsonl", chats[:30])
    base.write_jsonl(data / "test.jsonl", chats[30:])
    (data.parent / "README.md").write_text("# chats\n")
    return cache


def moe8_run(cache: Path, *args):
    where = str(Path(moe8.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=where, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    env.pop("HF_HOME", None)
    return subprocess.run(
        [sys.executable, "-m", "moe8", "finetune", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_model_and_dataset_ids_from_the_cache(tmp_path, hub_cache):
    out = tmp_path / "run"
    small = "--steps 2 --micro_batch 2 --seq_len 128 --eval_batches 1 --device cpu --no-progress".split()
    r = moe8_run(
        hub_cache,
        "--model",
        "acme/tiny-moe",
        "--data",
        "acme/chats",
        "--eval_data",
        "acme/chats",
        "--output_dir",
        str(out),
        *small,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    snap = hub_cache / "datasets--acme--chats" / "snapshots" / COMMIT / "data"
    assert f"data: {snap / 'train.jsonl'}: 30 chat documents" in r.stdout, r.stdout
    assert f"(eval: {snap / 'test.jsonl'})" in r.stdout, r.stdout
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2


def test_offline_without_a_cached_copy_names_the_cache(tmp_path, hub_cache):
    out = tmp_path / "run"
    r = moe8_run(hub_cache, "--model", "acme/absent-moe", "--output_dir", str(out), "--steps", "1")
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr
    assert "moe8 finetune: error: model: acme/absent-moe is not a local path" in err, err
    assert f"not in the cache ({hub_cache})" in err and "HF_HUB_OFFLINE" in err, (
        err
    )  # huggingface_hub's words
    assert not out.exists()
    r = moe8_run(hub_cache, "--data", "acme/absent-data", "--output_dir", str(out), "--steps", "1")
    assert r.returncode == 2 and "data: acme/absent-data is not a local path" in r.stderr, r.stderr
    assert f"({hub_cache})" in r.stderr and not out.exists()


def test_a_local_path_is_never_a_hub_id(tmp_path, monkeypatch):
    from moe8.finetune import hub
    from moe8.finetune.config import FinetuneError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "local.jsonl").write_text("{}\n")
    assert hub.is_hub_id("Qwen/Qwen3-30B-A3B") and hub.is_hub_id("mistralai/Mixtral-8x7B-v0.1")
    assert not hub.is_hub_id("acme/local.jsonl")  # it exists here
    for name in ("/models/x", "./a/b", "a/b/c", "../a/b", "tiny-qwen3-moe", "~/x"):
        assert not hub.is_hub_id(name), name
    assert hub.data_files("acme/local.jsonl", "data") == [Path("acme/local.jsonl")]
    with pytest.raises(FinetuneError, match="^eval_data: file not found: acme/gone.jsonl$"):
        hub.data_files("acme/gone.jsonl", "eval_data")  # a file's suffix: no Hub look-up


def test_a_dataset_split_is_its_files_name(tmp_path, monkeypatch):
    """data takes the train file, eval_data the validation / test one; no split in any name: every file; a
    split in several shards is refused, naming the first."""
    from moe8.finetune import hub
    from moe8.finetune.config import FinetuneError

    root = tmp_path / "snap"
    monkeypatch.setattr(hub, "snapshot", lambda repo_id, key, patterns, repo_type=None: root)
    (root / "data").mkdir(parents=True)
    for name in ("train-00000-of-00001.parquet", "validation-00000-of-00001.parquet", "README.md"):
        (root / "data" / name).write_text("x")
    assert hub.data_files("acme/set", "data") == [root / "data" / "train-00000-of-00001.parquet"]
    assert hub.data_files("acme/set", "eval_data") == [root / "data" / "validation-00000-of-00001.parquet"]
    (root / "data" / "validation-00000-of-00001.parquet").unlink()
    with pytest.raises(
        FinetuneError, match="eval_data: the dataset acme/set has no validation, valid, val, test"
    ):
        hub.data_files("acme/set", "eval_data")
    (root / "data" / "train-00000-of-00001.parquet").rename(root / "data" / "chats.parquet")
    assert hub.data_files("acme/set", "eval_data") == [root / "data" / "chats.parquet"]  # no split named
    (root / "data" / "more.parquet").write_text("x")
    cfg = base.Config(data="acme/set")
    with pytest.raises(
        FinetuneError, match=r"data: the dataset acme/set holds 2 files for this split; .* \(.*chats"
    ):
        hub.local_data(cfg)


def test_a_model_snapshot_takes_the_top_level_files(tmp_path, monkeypatch):
    """Only the top-level config, tokenizer and weights: a subfolder (gpt-oss' original/) is never fetched."""
    import huggingface_hub

    from moe8.finetune import hub

    calls = []

    def fake(repo_id, **kw):
        calls.append(kw)
        (tmp_path / "config.json").write_text("{}")
        (tmp_path / "model.safetensors").write_text("")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert hub.model_dir("acme/m") == tmp_path and hub.model_weights("acme/m", tmp_path) == tmp_path
    assert calls[0]["ignore_patterns"] == ["*/*"] and calls[0]["local_files_only"]
    assert "*.safetensors" not in calls[0]["allow_patterns"]  # the weights only when the model is built
