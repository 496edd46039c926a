"""`moe8 finetune` data files on CPU: CSV through `datasets` (its column found as JSONL's field is), gzip, bz2,
xz and zstd compressed files read as the uncompressed ones (or refused by name: zstd without its module, a
compressed file named as plain, a damaged one), and an unknown suffix refused with the known ones."""

import bz2
import gzip
import importlib.util
import json
import lzma
import sys

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0", reason="moe8 finetune needs transformers>=5")

import test_finetune as base  # noqa: E402

from moe8.finetune.config import Config, FinetuneError  # noqa: E402
from moe8.finetune.data import Data, byte_tokenizer, read_documents  # noqa: E402

text_file, _undo_moe8 = base.text_file, base._undo_moe8
finetune_rc, flags = base.finetune_rc, base.flags

ROWS = [
    {"instruction": f"say {i}", "input": "" if i % 2 else "twice", "output": f"number {i}"} for i in range(30)
]


def csv_text(rows) -> str:
    import csv
    import io

    f = io.StringIO()
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    return f.getvalue()


def test_csv_through_datasets(tmp_path, text_file):
    pytest.importorskip("datasets", reason="csv needs the optional datasets library")
    tok = byte_tokenizer()
    lines = text_file.read_text().splitlines()
    (tmp_path / "t.csv").write_text(csv_text([{"id": i, "body": x} for i, x in enumerate(lines)]))
    kind, docs, _ = read_documents(Config(data=str(tmp_path / "t.csv"), text_field="body"))
    assert kind == "text" and docs == lines  # the column named by text_field, no header line among them
    kw = dict(seq_len=32, micro_batch=2)
    from_csv = Data(Config(data=str(tmp_path / "t.csv"), text_field="body", **kw), tok)
    from_txt = Data(Config(data=str(text_file), **kw), tok)
    assert all(torch.equal(a, b) for a, b in zip(from_csv.train, from_txt.train))
    # alpaca columns: detected from the header as from a JSONL record's keys
    (tmp_path / "a.csv").write_text(csv_text(ROWS))
    base.write_jsonl(tmp_path / "a.jsonl", ROWS)
    a, b = (Data(Config(data=str(tmp_path / f"a.{s}"), **kw), tok) for s in ("csv", "jsonl"))
    assert (
        a.kind == "chat" and a.chat.matched == 30 and all(torch.equal(x, y) for x, y in zip(a.train, b.train))
    )
    (tmp_path / "o.csv").write_text("prompt,answer\nhi,ho\n")
    with pytest.raises(
        FinetuneError, match=r"record 1 has the keys \['answer', 'prompt'\], which match none"
    ):
        read_documents(Config(data=str(tmp_path / "o.csv")))


def test_csv_without_datasets_names_it(tmp_path, monkeypatch):
    (tmp_path / "t.csv").write_text("text\nhello\n")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(
        FinetuneError, match=r"reading csv files needs the datasets library: pip install 'datasets"
    ):
        read_documents(Config(data=str(tmp_path / "t.csv")))


OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


@pytest.mark.parametrize("suffix", list(OPENERS))
def test_compressed_files_read_as_plain(tmp_path, text_file, suffix):
    lines = text_file.read_text().splitlines()
    records = "".join(json.dumps({"text": x}) + "\n" for x in lines)
    for name, body in (("d.txt", text_file.read_text()), ("d.jsonl", records), ("d.csv", csv_text(ROWS))):
        if name.endswith(".csv") and importlib.util.find_spec("datasets") is None:
            continue  # csv needs the optional datasets library
        plain, packed = tmp_path / name, tmp_path / (name + suffix)
        plain.write_text(body)
        with OPENERS[suffix](packed, "wt", encoding="utf-8") as f:
            f.write(body)
        assert read_documents(Config(data=str(packed))) == (
            *read_documents(Config(data=str(plain)))[:2],
            str(packed),
        )
    whole = read_documents(Config(data=str(tmp_path / f"d.txt{suffix}"), data_format="text"))
    assert whole[1] == [text_file.read_text()]


def test_zstd_without_its_module_is_refused_by_name(tmp_path, monkeypatch):
    for name in ("d.jsonl.zst", "d.csv.zst"):  # read here, and through datasets
        (tmp_path / name).write_bytes(b"\x28\xb5\x2f\xfd")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    monkeypatch.setitem(sys.modules, "compression", None)
    for data in ("d.jsonl.zst", "d.csv.zst"):
        with pytest.raises(
            FinetuneError, match=r"zstd-compressed files needs the zstandard module: pip install"
        ):
            read_documents(Config(data=str(tmp_path / data)))


def test_zstd_read_with_its_module(tmp_path, text_file):
    zstandard = pytest.importorskip("zstandard", reason="zstd needs the optional zstandard module")
    (tmp_path / "d.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(text_file.read_bytes()))
    assert read_documents(Config(data=str(tmp_path / "d.txt.zst")))[1] == text_file.read_text().splitlines()


def test_bad_compressed_and_unknown_files_are_named(tmp_path, text_file, capsys):
    gz = gzip.compress(b'{"text": "hello"}\n' * 50)
    (tmp_path / "hidden.jsonl").write_bytes(gz)  # gzip data without .gz
    (tmp_path / "cut.jsonl.gz").write_bytes(gz[: len(gz) // 2])  # truncated
    (tmp_path / "plain.jsonl.gz").write_text('{"text": "hello"}\n')  # not gzip at all
    (tmp_path / "notes.md").write_text("a line\n")
    cases = {
        "hidden.jsonl": "it holds gzip-compressed data, but its name does not end in .gz: rename it",
        "cut.jsonl.gz": "cannot read",
        "plain.jsonl.gz": "(gzip-compressed): BadGzipFile",
        "notes.md": "unknown suffix '.md'; data_format = 'auto' knows .txt, .jsonl, .json, .csv, .parquet, "
        ".arrow, each also compressed (.gz, .bz2, .xz, .zst, .zstd); or set data_format",
    }
    for name, message in cases.items():
        out = tmp_path / "out"
        rc, text = finetune_rc(capsys, flags(out, tmp_path / name))
        assert rc == 2 and "moe8 finetune: error: data: " in text and message in text, (name, text)
        assert text.count("\n") == 1 and "Traceback" not in text and not out.exists()
    assert "(gzip-compressed)" in finetune_rc(capsys, flags(tmp_path / "out", tmp_path / "cut.jsonl.gz"))[1]
    # eval_data is named as eval_data
    rc, text = finetune_rc(capsys, flags(tmp_path / "out", text_file, "--eval_data", tmp_path / "notes.md"))
    assert rc == 2 and "moe8 finetune: error: eval_data: " in text and "unknown suffix '.md'" in text
    # data_format names how to read a file whatever its suffix
    kind, docs, _ = read_documents(Config(data=str(tmp_path / "notes.md"), data_format="lines"))
    assert docs == ["a line"]
