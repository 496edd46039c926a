"""Reading training data for `moe8 finetune`: text files, JSONL natively, and through `datasets` (optional)
local parquet / json / jsonl / arrow files; then each record in one of the known dataset formats, detected
per file or named by the `format` key, turned into a document: ("text", str) or ("chat", [{role, content}]).

| format   | a record                                                  | becomes                              |
| text     | {"text": str}  (text_field)                               | a document, loss on every token      |
| messages | {"messages": [{role, content, reasoning_content?}]}        | a chat, loss on the assistant turns  |
| alpaca   | {"instruction", "input"?, "output", "system"?}            | system? + user + assistant           |
| sharegpt | {"conversations": [{"from": human/gpt/system, "value"}]}  | the chat with roles mapped           |
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import Config, FinetuneError

FORMATS = ("text", "messages", "alpaca", "sharegpt")
# data_format auto, by the file's suffix
SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
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


def read_records(cfg: Config, path: Path, fmt: str, limit: int | None) -> list[dict]:
    """The records of a structured file: fmt is jsonl or json (read here: one object per line, or one array of
    objects), parquet or arrow (read through `datasets`)."""
    if fmt in ("parquet", "arrow"):
        return _with_datasets(path, fmt, limit)
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in (ln.rstrip("\r\n") for ln in f) if line.strip()]
    except FileNotFoundError:
        raise FinetuneError(f"data: file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FinetuneError(f"data: cannot read {path}: {e}") from None
    array = bool(lines) and lines[0].lstrip().startswith("[")
    records = []
    for i, line in enumerate(["\n".join(lines)] if array else lines[:limit], 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise FinetuneError(f"data: {path}: {'' if array else f'record {i} '}is not JSON: {e}") from None
        records.extend(rec[:limit] if array and isinstance(rec, list) else [rec])
    return records


def _with_datasets(path: Path, fmt: str, limit: int | None) -> list[dict]:
    if not path.is_file():
        raise FinetuneError(f"data: file not found: {path}")
    try:
        import datasets
    except ImportError:
        raise FinetuneError(
            f"data: {path}: reading {fmt} files needs the datasets library: pip install 'datasets>=3'"
        ) from None
    try:
        ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
    except Exception as e:  # datasets raises many types for an unreadable file
        raise FinetuneError(f"data: cannot read {path} as {fmt}: {type(e).__name__}: {e}") from None
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
