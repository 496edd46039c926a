"""Data for `moe8 finetune`: tokenizers (the model's, or a byte-level fallback), documents from text or JSONL
files, chat rendering with loss on the assistant turns only, packing into fixed-length sequences, and a
loader whose order is a pure function of (seed, micro-batch index), so a resumed run sees the same data."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from .._env import ENV
from .config import Config, FinetuneError

REPO = Path(__file__).resolve().parents[3]  # the checkout root (python/moe8/finetune/data.py)
IGNORE = -100  # label of tokens without loss
AUTO_DOCUMENTS = 20000  # documents read from the shared sample text when data = "auto"


def shared(*parts: str) -> Path | None:
    """A file under the shared data folder: $MOE8_SHARED_DATA when set, else ../shared/data relative to the
    working directory or to the checkout; None if absent."""
    env = ENV["shared_data"]
    roots = [Path(env)] if env else []
    roots += [root.parent / "shared" / "data" for root in (Path.cwd(), REPO)]
    for root in roots:
        p = root / Path(*parts)
        if p.exists():
            return p
    return None


# ---------------------------------------------------------------------------------------------- tokenizers
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]  # ids 256..259
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _bytes_to_unicode() -> dict:
    """GPT-2's map of the 256 bytes to printable characters (what a byte-level BPE vocabulary is made of)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_tokenizer():
    """Token id = byte value (0..255), then the ChatML specials; a real transformers tokenizer (fast, with
    offsets and a chat template), so save_pretrained / AutoTokenizer.from_pretrained round-trip it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>", chat_template=CHATML
    )


def load_tokenizer(cfg: Config, model_dir: Path | None):
    name = cfg.tokenizer
    if name == "auto":
        name = str(model_dir) if model_dir is not None else "byte"
    if name == "byte":
        return byte_tokenizer()
    if name == "qwen3":
        path = shared("tokenizers", "qwen3")
        if path is None:
            raise FinetuneError("tokenizer = 'qwen3': ../shared/data/tokenizers/qwen3 not found; use 'byte'")
    else:
        path = Path(name)
        if not path.is_dir():
            raise FinetuneError(f"tokenizer: {name} is not a directory (nor auto, byte or qwen3)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise FinetuneError(f"tokenizer: cannot load {path}: {e}") from None
    if tok.eos_token_id is None:
        raise FinetuneError(f"tokenizer: {path} has no eos token (needed between packed documents)")
    return tok


# ----------------------------------------------------------------------------------------------- documents
def _generated(n: int = AUTO_DOCUMENTS) -> list[str]:
    rng = random.Random(0)
    subj = ["the cat", "a model", "my friend", "the expert", "our team", "the router", "every layer"]
    verb = ["sees", "trains", "likes", "routes", "builds", "reads", "sends"]
    obj = ["a token", "the data", "every expert", "the loss", "a long book", "the gradient", "two tokens"]
    return [f"{rng.choice(subj)} {rng.choice(verb)} {rng.choice(obj)}." for _ in range(n)]


def read_documents(cfg: Config) -> tuple[str, list, str]:
    """("text", [str], source) or ("chat", [[{role, content}]], source)."""
    limit = cfg.max_documents or None
    if cfg.data == "auto":
        path = shared("text", "sentences.txt")
        if path is None:
            return "text", _generated(limit or AUTO_DOCUMENTS), "generated sentences"
        fmt, limit = "lines", limit or AUTO_DOCUMENTS
    else:
        path = Path(cfg.data)
        fmt = cfg.data_format
        if fmt == "auto":
            fmt = "jsonl" if path.suffix in (".jsonl", ".json") else "lines"
    try:
        with open(path, encoding="utf-8") as f:
            if fmt == "text":
                return "text", [f.read()], str(path)
            lines = [line for line in (ln.rstrip("\r\n") for ln in f) if line.strip()]
    except FileNotFoundError:
        raise FinetuneError(f"data: file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FinetuneError(f"data: cannot read {path}: {e}") from None
    if fmt == "lines":
        return "text", lines[:limit], str(path)
    return _jsonl(cfg, path, lines, limit)


def _jsonl(cfg: Config, path: Path, lines: list[str], limit: int | None) -> tuple[str, list, str]:
    """Records of a JSONL file (or of a .json file holding one array of objects)."""
    array = bool(lines) and lines[0].lstrip().startswith("[")
    records = []
    for i, line in enumerate(["\n".join(lines)] if array else lines[:limit], 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise FinetuneError(f"data: {path}: {'' if array else f'record {i} '}is not JSON: {e}") from None
        records.extend(rec[:limit] if array and isinstance(rec, list) else [rec])
    for i, rec in enumerate(records, 1):
        if not isinstance(rec, dict):
            raise FinetuneError(f"data: {path}: record {i} is a {type(rec).__name__}, expected a JSON object")
    if not records:
        raise FinetuneError(f"data: {path}: empty dataset (no records)")
    tf, mf = cfg.text_field, cfg.messages_field
    field = mf if mf in records[0] else tf if tf in records[0] else None
    if field is None:
        raise FinetuneError(
            f"data: {path}: record 1 has neither a {tf!r} nor a {mf!r} field (it has {sorted(records[0])}); "
            "set text_field or messages_field"
        )
    for i, rec in enumerate(records, 1):
        value = rec.get(field)
        ok = isinstance(value, str) if field == tf else _is_chat(value)
        if not ok:
            want = "a string" if field == tf else "a list of {role, content} objects with string values"
            raise FinetuneError(f"data: {path}: record {i}: field {field!r} missing or not {want}")
    return ("text" if field == tf else "chat"), [r[field] for r in records], str(path)


def _is_chat(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )


# ------------------------------------------------------------------------------------- tokenize and pack
def tokenize_text(tok, docs: list[str]) -> torch.Tensor:
    """Documents, each followed by eos, as one int32 tensor (built a thousand documents at a time)."""
    parts = [torch.zeros(0, dtype=torch.int32)]
    for i in range(0, len(docs), 1000):
        ids = tok(docs[i : i + 1000], add_special_tokens=False)["input_ids"]
        parts.append(torch.tensor([t for doc in ids for t in (*doc, tok.eos_token_id)], dtype=torch.int32))
    return torch.cat(parts)


def tokenize_chat(tok, chat: list[dict]) -> tuple[list[int], list[int]]:
    """A chat rendered with the tokenizer's chat template; labels: the tokens of each assistant message's
    content and the special token closing it, IGNORE elsewhere. The rendered text is matched back to the
    messages by position (offsets), so any template works that keeps the assistant text verbatim."""
    text = tok.apply_chat_template(chat, tokenize=False)
    specials = sorted(tok.all_special_tokens, key=len, reverse=True)
    spans, cursor = [], 0
    for m in chat:
        content = m["content"].strip()
        at = text.find(content, cursor) if content else -1
        if at < 0:
            continue
        end = at + len(content)
        cursor = end
        if m["role"] == "assistant":
            end += next((len(s) for s in specials if s and text.startswith(s, end)), 0)
            spans.append((at, end))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [
        t if any(a <= s and e <= b and s < e for a, b in spans) else IGNORE
        for t, (s, e) in zip(enc["input_ids"], enc["offset_mapping"])
    ]
    return enc["input_ids"], labels


class Data:
    """Packed sequences: train / eval `ids` and `labels` [N, seq_len] (int32)."""

    def __init__(self, cfg: Config, tok):
        kind, docs, self.source = read_documents(cfg)
        if kind == "chat":
            if not getattr(tok, "chat_template", None):
                raise FinetuneError("data: chat messages, but the tokenizer has no chat template")
            if not tok.is_fast:
                raise FinetuneError("data: chat messages need a fast tokenizer (offsets), this one is slow")
            pairs = [tokenize_chat(tok, c) for c in docs]
            ids = torch.tensor([t for p in pairs for t in p[0]], dtype=torch.int32)
            labels = torch.tensor([t for p in pairs for t in p[1]], dtype=torch.int32)
        else:
            ids = labels = tokenize_text(tok, [d for d in docs if d.strip()])
        self.kind, self.documents, self.tokens = kind, len(docs), len(ids)
        if not len(ids) or bool((labels == IGNORE).all()):
            what = "no assistant tokens to train on" if len(ids) else "no tokens"
            raise FinetuneError(f"data: {self.source}: empty dataset ({what})")
        S = cfg.seq_len
        n = len(ids) // S
        n_eval = max(1, round(n * cfg.eval_fraction)) if cfg.eval_fraction > 0 else 0
        if n - n_eval < cfg.micro_batch:
            raise FinetuneError(
                f"data: {self.source}: {len(ids):,} tokens make {n} sequences of seq_len {S}; the training split "
                f"({n - n_eval}) needs at least micro_batch = {cfg.micro_batch}"
            )
        ids, labels = ids[: n * S].view(n, S), labels[: n * S].view(n, S)
        self.train = (ids[: n - n_eval], labels[: n - n_eval])
        self.eval = (ids[n - n_eval :], labels[n - n_eval :])
        self.micro_batch, self.seed = cfg.micro_batch, cfg.seed
        self.per_epoch = len(self.train[0]) // cfg.micro_batch
        self._perm = (None, None)

    def batch(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch number m of the whole run: epoch m // per_epoch, in a shuffled order of that epoch."""
        epoch, j = divmod(m, self.per_epoch)
        if self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(len(self.train[0]), generator=g))
        idx = self._perm[1][j * self.micro_batch : (j + 1) * self.micro_batch]
        return self.train[0][idx].long(), self.train[1][idx].long()

    def eval_batches(self, limit: int):
        ids, labels = self.eval
        n = (len(ids) + self.micro_batch - 1) // self.micro_batch
        for i in range(min(n, limit) if limit else n):
            s = slice(i * self.micro_batch, (i + 1) * self.micro_batch)
            yield ids[s].long(), labels[s].long()
