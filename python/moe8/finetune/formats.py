"""Reading training data for `moe8 finetune`: text files, JSONL natively, and through `datasets` (optional)
local csv / parquet / arrow files; text, JSONL and csv files also gzip, bz2, xz or zstd compressed (named by
their last suffix); then each record in one of the known dataset formats, detected per file or named by the
`format` key, turned into a document: ("text", str) or ("chat", [{role, content}]).

| format   | a record                                                  | becomes                              |
| text     | {"text": str}  (text_field)                               | a document, loss on every token      |
| messages | {"messages": [{role, content, reasoning_content?}]}        | a chat, loss on the assistant turns  |
| alpaca   | {"instruction", "input"?, "output", "system"?}            | system? + user + assistant           |
| sharegpt | {"conversations": [{"from": human/gpt/system, "value"}]}  | the chat with roles mapped           |
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
from pathlib import Path

from .config import Config, FinetuneError

FORMATS = ("text", "messages", "alpaca", "sharegpt")
# data_format auto, by the file's suffix (before a compression suffix)
SUFFIXES = {
    ".txt": "lines",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd", ".zstd": "zstd"}
DATASETS_FORMATS = ("csv", "parquet", "arrow")  # read through the datasets library
# the first bytes of a compressed file, for a message about one whose name does not say so
MAGIC = {b"\x1f\x8b": ".gz", b"BZh": ".bz2", b"\xfd7zXZ\x00": ".xz", b"\x28\xb5\x2f\xfd": ".zst"}
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
}


def file_format(path: Path, data_format: str, key: str = "data") -> tuple[str, str | None]:
    """(format, compression or None) of a data file: the compression from its last suffix (.gz, .bz2, .xz,
    .zst), the format from data_format or, for auto, from the suffix before it; an unknown suffix is refused
    with the list of those known."""
    suffixes = [x.lower() for x in path.suffixes]
    compression = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    inner = suffixes[-2 if compression else -1] if len(suffixes) > bool(compression) else ""
    fmt = data_format if data_format != "auto" else SUFFIXES.get(inner)
    if fmt is None:
        raise FinetuneError(
            f"{key}: {path}: unknown suffix {inner or '(none)'!r}; data_format = 'auto' knows "
            f"{', '.join(SUFFIXES)}, each also compressed ({', '.join(COMPRESSIONS)}); or set data_format "
            "(lines, text, jsonl, csv, parquet, arrow)"
        )
    if compression and fmt in ("parquet", "arrow"):
        raise FinetuneError(
            f"{key}: {path}: a {compression}-compressed {fmt} file is not read ({fmt} compresses inside); "
            "decompress it"
        )
    return fmt, compression


def open_text(path: Path, compression: str | None, key: str = "data"):
    """The file as text (UTF-8), decompressed; zstd needs the zstandard module (or Python 3.14's
    compression.zstd)."""
    if not path.is_file():
        raise FinetuneError(f"{key}: file not found: {path}")
    if compression is None:
        return open(path, encoding="utf-8")
    if compression != "zstd":
        opener = {"gzip": gzip.open, "bz2": bz2.open, "xz": lzma.open}[compression]
        return opener(path, "rt", encoding="utf-8")
    try:
        from compression import zstd  # Python >= 3.14

        return zstd.open(path, "rt", encoding="utf-8")
    except ImportError:
        pass
    try:
        import zstandard
    except ImportError:
        raise FinetuneError(
            f"{key}: {path}: reading zstd-compressed files needs the zstandard module: pip install zstandard"
        ) from None
    raw = open(path, "rb")
    return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True), encoding="utf-8")


def read_lines(path: Path, compression: str | None, key: str = "data", whole: bool = False):
    """The non-blank lines of a text file (or, with whole, its text), decompressed; FinetuneError naming the
    file and its compression when it cannot be read."""
    try:
        with open_text(path, compression, key) as f:
            if whole:
                return f.read()
            return [line for line in (ln.rstrip("\r\n") for ln in f) if line.strip()]
    except FinetuneError:
        raise
    except Exception as e:  # OSError, EOFError, UnicodeDecodeError, lzma.LZMAError, zstandard.ZstdError
        what = f" ({compression}-compressed)" if compression else _compressed_hint(path)
        raise FinetuneError(f"{key}: cannot read {path}{what}: {type(e).__name__}: {e}") from None


def _compressed_hint(path: Path) -> str:
    """' (gzip-compressed data, but the name does not end in .gz)' for a compressed file named as plain text."""
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError:
        return ""
    suffix = next((s for magic, s in MAGIC.items() if head.startswith(magic)), None)
    if suffix is None:
        return ""
    return f" (it holds {COMPRESSIONS[suffix]}-compressed data, but its name does not end in {suffix}: rename it)"


def read_records(
    cfg: Config, path: Path, fmt: str, limit: int | None, compression: str | None = None, key: str = "data"
) -> list[dict]:
    """The records of a structured file: fmt is jsonl or json (read here: one object per line, or one array of
    objects), csv, parquet or arrow (read through `datasets`)."""
    if fmt in DATASETS_FORMATS:
        if compression == "zstd":
            open_text(path, compression, key).close()  # refuses without the zstd module, naming it
        return _with_datasets(path, fmt, limit, key)
    lines = read_lines(path, compression, key)
    array = bool(lines) and lines[0].lstrip().startswith("[")
    records = []
    for i, line in enumerate(["\n".join(lines)] if array else lines[:limit], 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise FinetuneError(f"data: {path}: {'' if array else f'record {i} '}is not JSON: {e}") from None
        records.extend(rec[:limit] if array and isinstance(rec, list) else [rec])
    return records


def _with_datasets(path: Path, fmt: str, limit: int | None, key: str = "data") -> list[dict]:
    if not path.is_file():
        raise FinetuneError(f"{key}: file not found: {path}")
    try:
        import datasets
    except ImportError:
        raise FinetuneError(
            f"{key}: {path}: reading {fmt} files needs the datasets library: pip install 'datasets>=3'"
        ) from None
    try:
        ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
    except Exception as e:  # datasets raises many types for an unreadable file
        raise FinetuneError(f"{key}: cannot read {path} as {fmt}: {type(e).__name__}: {e}") from None
    if limit:
        ds = ds.select(range(min(limit, len(ds))))
    return [dict(r) for r in ds]


def detect(rec: dict, cfg: Config) -> str | None:
    if cfg.messages_field in rec:
        return "messages"
    if "conversations" in rec:
        return "sharegpt"
    if "instruction" in rec and "output" in rec:
        return "alpaca"
    if cfg.text_field in rec:
        return "text"
    return None


def documents(cfg: Config, records: list, source: str) -> tuple[str, list]:
    """("text", [str]) or ("chat", [[{role, content, ...}]]) from the records of one file."""
    for i, rec in enumerate(records, 1):
        if not isinstance(rec, dict):
            raise FinetuneError(
                f"data: {source}: record {i} is a {type(rec).__name__}, expected a JSON object"
            )
    if not records:
        raise FinetuneError(f"data: {source}: empty dataset (no records)")
    fmt = cfg.format
    if fmt == "auto":
        fmt = detect(records[0], cfg)
        if fmt is None:
            raise FinetuneError(
                f"data: {source}: record 1 has the keys {sorted(records[0])}, which match none of the formats "
                f"known: text ({cfg.text_field!r}, text_field), messages ({cfg.messages_field!r}, "
                "messages_field), alpaca ('instruction', 'output'), sharegpt ('conversations'); set format "
                "(and text_field / messages_field)"
            )
    convert = {"text": _text, "messages": _messages, "alpaca": _alpaca, "sharegpt": _sharegpt}[fmt]
    docs = []
    for i, rec in enumerate(records, 1):
        try:
            docs.append(convert(rec, cfg))
        except (KeyError, TypeError, ValueError) as e:
            raise FinetuneError(f"data: {source}: record {i} ({fmt} format): {e}") from None
    return ("text" if fmt == "text" else "chat"), docs


def _str(rec: dict, key: str, optional: bool = False) -> str:
    v = rec.get(key)
    if v is None and optional:
        return ""
    if not isinstance(v, str):
        got = "missing" if key not in rec else f"a {type(v).__name__}"
        raise ValueError(f"field {key!r} is {got}, expected a string (the record has {sorted(rec)})")
    return v


def _text(rec, cfg):
    return _str(rec, cfg.text_field)


def _messages(rec, cfg):
    chat = rec.get(cfg.messages_field)
    if not isinstance(chat, list) or not chat:
        raise ValueError(f"field {cfg.messages_field!r} missing or not a non-empty list of {{role, content}}")
    out = []
    for m in chat:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"a message {m!r} is not a {{role, content}} object")
        m = {k: v for k, v in m.items() if v is not None}
        if not isinstance(m.get("content", ""), str) or not isinstance(m.get("reasoning_content", ""), str):
            raise ValueError(f"a message's content is not a string: {m!r}")
        m.setdefault("content", "")
        out.append(m)
    return out


def _alpaca(rec, cfg):
    prompt = _str(rec, "instruction")
    extra = _str(rec, "input", optional=True)
    if extra:
        prompt += "\n\n" + extra
    system = _str(rec, "system", optional=True)
    chat = [{"role": "system", "content": system}] if system else []
    return chat + [{"role": "user", "content": prompt}, {"role": "assistant", "content": _str(rec, "output")}]


def _sharegpt(rec, cfg):
    turns = rec.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise ValueError("field 'conversations' missing or not a non-empty list of {from, value}")
    chat = []
    for t in turns:
        if not isinstance(t, dict) or not isinstance(t.get("value"), str):
            raise ValueError(f"a turn {t!r} is not a {{from, value}} object with a string value")
        role = SHAREGPT_ROLES.get(str(t.get("from")).lower())
        if role is None:
            raise ValueError(
                f"a turn's role from = {t.get('from')!r}: expected one of {sorted(SHAREGPT_ROLES)}"
            )
        chat.append({"role": role, "content": t["value"]})
    return chat
