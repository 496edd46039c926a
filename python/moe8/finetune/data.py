"""Data for `moe8 finetune`: tokenizers (the model's, or a byte-level fallback), documents (formats.py),
chats with loss on the assistant turns only (chat.py), packing into fixed-length sequences that keep the
documents apart (packing.py), and a loader whose order is a pure function of (seed, micro-batch index), so
a resumed run sees the same data."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import torch

from .._env import ENV
from .chat import ChatStats, tokenize_chat
from .config import Config, FinetuneError
from .formats import documents, file_format, read_lines, read_records
from .packing import IGNORE, pack_rows

REPO = Path(__file__).resolve().parents[3]  # the checkout root, when moe8 runs from one (python/moe8/...)
AUTO_DOCUMENTS = 20000  # documents read from the shared sample text when data = "auto"


def shared_roots() -> list[Path]:
    """Where the shared data folder is looked for: $MOE8_SHARED_DATA (moe8._env) when set, then, when moe8
    runs from a source checkout, ../shared/data beside the checkout (never the working directory: an installed
    moe8 would find a different folder from every directory)."""
    env = ENV["shared_data"]
    roots = [Path(env)] if env else []
    if (REPO / "pyproject.toml").is_file() and (REPO / "python" / "moe8").is_dir():
        roots.append(REPO.parent / "shared" / "data")
    return roots


def shared(*parts: str) -> Path | None:
    """A file under the shared data folder (shared_roots, in order); None if absent."""
    for root in shared_roots():
        p = root / Path(*parts)
        if p.exists():
            return p
    return None


def looked(*parts: str) -> str:
    """'looked in: A, B; set MOE8_SHARED_DATA ...' for a message about a shared file not found."""
    where = [str(r / Path(*parts)) for r in shared_roots()]
    unset = [] if ENV["shared_data"] else ["MOE8_SHARED_DATA (unset)"]
    return f"looked in: {', '.join(unset + where)}; set MOE8_SHARED_DATA to the folder holding {Path(*parts)}"


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


# the files one of which a Hugging Face tokenizer directory holds
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def load_tokenizer(cfg: Config, model_dir: Path | None):
    name = cfg.tokenizer
    if name == "auto":
        name = str(model_dir) if model_dir is not None else "byte"
        if model_dir is not None and not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
            raise FinetuneError(
                f"tokenizer: none found in the model directory {model_dir} (looked for "
                f"{', '.join(TOKENIZER_FILES)}); name one with --tokenizer DIR (or --tokenizer byte)"
            )
    if name == "byte":
        return byte_tokenizer()
    if name == "qwen3":
        path = shared("tokenizers", "qwen3")
        if path is None:
            raise FinetuneError(
                f"tokenizer = 'qwen3': tokenizers/qwen3 not found ({looked('tokenizers', 'qwen3')}), or use "
                "--tokenizer byte or a tokenizer directory"
            )
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


def data_path(data: str) -> Path | None:
    """The file `data` names (data = "auto": the shared sample text, None when it is missing)."""
    return shared("text", "sentences.txt") if data == "auto" else Path(data)


def read_documents(cfg: Config, data: str | None = None, key: str = "data") -> tuple[str, list, str]:
    """("text", [str], source) or ("chat", [[{role, content}]], source) of `data` (default: cfg.data); key
    names it in messages (data or eval_data)."""
    data = cfg.data if data is None else data
    limit = cfg.max_documents or None
    path = data_path(data)
    if data == "auto":
        if path is None:
            where = looked("text", "sentences.txt")
            return (
                "text",
                _generated(limit or AUTO_DOCUMENTS),
                f"generated sentences (no sample text: {where})",
            )
        fmt, compression, limit = "lines", None, limit or AUTO_DOCUMENTS
    else:
        if not path.exists():
            raise FinetuneError(f"{key}: file not found: {path}")
        if path.is_dir():
            raise FinetuneError(f"{key}: cannot read {path}: it is a directory, expected a file")
        fmt, compression = file_format(path, cfg.data_format, key)
    if fmt not in ("lines", "text"):
        records = read_records(cfg, path, fmt, limit, compression, key)
        return (*documents(cfg, records, str(path)), str(path))
    if fmt == "text":
        return "text", [read_lines(path, compression, key, whole=True)], str(path)
    return "text", read_lines(path, compression, key)[:limit], str(path)


# ------------------------------------------------------------------------------------- tokenize and pack
def tokenize_text(tok, docs: list[str]) -> list[tuple[list[int], list[int]]]:
    """[(ids, labels)]: each document followed by eos, loss on every token (a thousand documents at a time)."""
    out = []
    for i in range(0, len(docs), 1000):
        for doc in tok(docs[i : i + 1000], add_special_tokens=False)["input_ids"]:
            ids = [*doc, tok.eos_token_id]
            out.append((ids, ids))
    return out


def tokenize(cfg: Config, tok, data: str, key: str = "data") -> tuple[str, int, list, str, ChatStats | None]:
    """(kind, documents read, [(ids, labels)] documents, source, chat turn statistics or None)."""
    kind, docs, source = read_documents(cfg, data, key)
    if kind == "text":
        return kind, len(docs), tokenize_text(tok, [d for d in docs if d.strip()]), source, None
    if not getattr(tok, "chat_template", None):
        raise FinetuneError(f"data: {source}: chat messages, but the tokenizer has no chat template")
    from jinja2 import TemplateError

    stats, out = ChatStats(), []
    for n, chat in enumerate(docs, 1):
        try:
            pieces, s = tokenize_chat(tok, chat)
        except TemplateError as e:  # the template's raise_exception: roles it does not take, their order
            roles = ", ".join(str(m.get("role")) for m in chat)
            raise FinetuneError(
                f"data: {source}: conversation {n} (roles {roles}): the tokenizer's chat template refuses it: {e}"
            ) from None
        out += pieces
        stats.add(s)
    return kind, len(docs), out, source, stats


HASHED = 1 << 20  # bytes of a data file's head and of its tail that its fingerprint hashes


def file_fingerprint(path: Path | None) -> dict:
    """{path (resolved), size, head_tail (sha256 of the first and last MiB)} of a data file; generated data: its
    name only."""
    if path is None:
        return dict(path="generated sentences")
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(HASHED))
        if size > HASHED:
            f.seek(max(HASHED, size - HASHED))
            h.update(f.read(HASHED))
    return dict(path=str(path.resolve()), size=size, head_tail=h.hexdigest()[:16])


def tokenizer_fingerprint(tok) -> str:
    """'260 tokens, sha256 ab12...' of the tokenizer's vocabulary and rules (tokenizer.json) and chat template."""
    backend = getattr(tok, "backend_tokenizer", None)
    rules = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    template = getattr(tok, "chat_template", None) or ""
    digest = hashlib.sha256((rules + str(template)).encode()).hexdigest()[:16]
    return f"{len(tok)} tokens, sha256 {digest}"


def fingerprint_changes(old: dict, new: dict) -> list[str]:
    """'data size: 1,024 -> 2,048' for each part of a data fingerprint that differs."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) or isinstance(b, dict):
            a, b = a or {}, b or {}
            out += [
                f"{key} {k}: {a.get(k)} -> {b.get(k)}"
                for k in sorted(set(a) | set(b))
                if a.get(k) != b.get(k)
            ]
        elif a != b:
            out.append(f"{key}: {a} -> {b}")
    return out


class Data:
    """Packed sequences: train / eval `ids`, `labels` and `positions` [N, seq_len] (int32). The eval split is
    the eval_data file when set, else the last eval_fraction of the packed training sequences."""

    def __init__(self, cfg: Config, tok):
        self.kind, self.documents, docs, self.source, self.chat = tokenize(cfg, tok, cfg.data)
        self.tokens = sum(len(d[0]) for d in docs)
        if not self.tokens or all(x == IGNORE for d in docs for x in d[1]):
            what = "no assistant tokens to train on" if self.tokens or self.kind == "chat" else "no tokens"
            raise FinetuneError(f"data: {self.source}: empty dataset ({what}){self._unmatched()}")
        S = cfg.seq_len
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        packed, self.packing = pack_rows(docs, S, cfg.packing, pad)
        self.packing_mode = cfg.packing
        if not len(packed[0]) and self.packing.dropped + self.packing.no_loss:
            what = "assistant token" if self.kind == "chat" else "loss token"
            raise FinetuneError(
                f"data: {self.source}: no {what} within seq_len = {S}: packing = 'documents' dropped all "
                f"{self.packing.documents} documents ({self.packing.describe()}); raise seq_len"
            )
        n = len(packed[0])
        n_eval = max(1, round(n * cfg.eval_fraction)) if cfg.eval_fraction > 0 and not cfg.eval_data else 0
        n_eval = min(n_eval, n)  # no sequence at all: nothing to hold out either
        if n - n_eval < cfg.micro_batch:
            held = f" after {n_eval} held out for evaluation (eval_fraction)" if n_eval else ""
            cut = self.packing.cut and cfg.packing == "documents"
            raise FinetuneError(
                f"data: {self.source}: {self.tokens:,} tokens make {n} sequences of seq_len {S}; the training "
                f"split ({n - n_eval} sequences{held}) needs at least micro_batch = {cfg.micro_batch}"
                + (
                    f" ({self.packing.cut} documents cut at seq_len; packing = 'stream' keeps them)"
                    if cut
                    else ""
                )
            )
        self.train = tuple(t[: n - n_eval] for t in packed)
        self.eval = tuple(t[n - n_eval :] for t in packed)
        self.eval_source = f"{n_eval} held-out sequences" if n_eval else "none"
        self.eval_tokens = 0
        if cfg.eval_data:
            kind, _, edocs, esource, estats = tokenize(cfg, tok, cfg.eval_data, "eval_data")
            self.eval, estats = pack_rows(edocs, S, cfg.packing, pad)
            self.eval_tokens = sum(len(d[0]) for d in edocs)
            if not len(self.eval[0]):
                why = f"less than one sequence of seq_len {S}"
                if estats.dropped + estats.no_loss:
                    why = f"no loss token within seq_len = {S} ({estats.describe()})"
                raise FinetuneError(f"eval_data: {esource}: {self.eval_tokens:,} tokens, {why}")
            self.eval_source = esource
        self.micro_batch, self.seed = cfg.micro_batch, cfg.seed
        self.per_epoch = len(self.train[0]) // cfg.micro_batch
        self._perm = (None, None)

    def fingerprint(self, cfg: Config, tok) -> dict:
        """What a checkpoint remembers of its data, so that a resume on other data is caught: for data and
        eval_data the resolved path, size and a hash of the head and tail of the file; the tokenizer (a hash
        of its vocabulary, rules and chat template) and the token counts."""
        out = dict(data=file_fingerprint(data_path(cfg.data)), tokens=self.tokens)
        if cfg.eval_data:
            out.update(eval_data=file_fingerprint(data_path(cfg.eval_data)), eval_tokens=self.eval_tokens)
        out["tokenizer"] = tokenizer_fingerprint(tok)
        return out

    def describe_packing(self) -> str:
        """'documents kept whole: 3 longer than seq_len cut, 12.0% padding' (or 'documents streamed'), for the
        log."""
        how = "documents kept whole" if self.packing_mode == "documents" else "documents streamed"
        what = self.packing.describe()
        return f"{how}{f': {what}' if what else ''}"

    def _unmatched(self) -> str:
        c = self.chat
        if c is None or c.matched == c.turns:
            return ""
        return (
            f"; {c.turns - c.matched} of {c.turns} assistant turns not found in the chat template's rendering "
            f"(for example {c.unmatched_examples[:2]})"
        )

    def describe_chat(self) -> str:
        """'assistant turns: 40 of 40 matched' (with splits and examples of unmatched turns), or ''."""
        c = self.chat
        if c is None:
            return ""
        text = f"assistant turns with loss: {c.matched} of {c.turns}"
        if c.split:
            text += f" ({c.split} conversations split where the template rewrites earlier turns)"
        if c.matched < c.turns:
            text += f"; unmatched, for example: {c.unmatched_examples}"
        return text

    def batch(self, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Micro-batch number m of the whole run: epoch m // per_epoch, in a shuffled order of that epoch."""
        epoch, j = divmod(m, self.per_epoch)
        if self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(len(self.train[0]), generator=g))
        idx = self._perm[1][j * self.micro_batch : (j + 1) * self.micro_batch]
        return tuple(t[idx].long() for t in self.train)

    def eval_batches(self, limit: int):
        n = (len(self.eval[0]) + self.micro_batch - 1) // self.micro_batch
        for i in range(min(n, limit) if limit else n):
            s = slice(i * self.micro_batch, (i + 1) * self.micro_batch)
            yield tuple(t[s].long() for t in self.eval)
