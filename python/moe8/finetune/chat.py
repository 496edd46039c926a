"""Chat masking from the chat template's own structure: loss on the tokens each assistant turn adds.

For assistant turn i the template renders the conversation up to the turn with the generation prompt
(G = messages[:i] + "<|im_start|>assistant\\n" or whatever the template's header is) and up to and
including the turn (R = messages[:i+1]). When the tokens of G are a prefix of the tokens of R, the turn
is R's tokens after G (its content, reasoning included, and the token closing it; trailing whitespace
tokens dropped). No text search: a reply that also occurs in a header or a system prompt is found. A turn
that opens the conversation has no G (transformers renders no empty conversation): it starts after the
assistant header (what the generation prompt adds after a user message) where that header follows only what
the template renders before any message.

The turns of one conversation go into one sequence as long as each R extends the previous one. A
template that rewrites earlier turns (Qwen3 drops the <think> block of assistant turns before the last
user message) breaks that: the conversation then continues as a new document, R of that turn, with
only that turn labelled, so every assistant turn is trained as the template renders it when it is the
reply being generated. A turn whose G is not a prefix of R is matched through the template's
{% generation %} tags (return_assistant_tokens_mask) when it has them; otherwise it is counted as
unmatched and gets no loss."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

IGNORE = -100  # label of tokens without loss
GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")  # {% generation %}: return_assistant_tokens_mask


@dataclass
class ChatStats:
    """Assistant turns seen / given a loss (over every conversation tokenized)."""

    turns: int = 0
    matched: int = 0
    split: int = 0  # conversations split because the template rewrote an earlier turn
    unmatched_examples: list = field(default_factory=list)

    def add(self, other: ChatStats) -> None:
        self.turns += other.turns
        self.matched += other.matched
        self.split += other.split
        self.unmatched_examples += other.unmatched_examples[: max(0, 3 - len(self.unmatched_examples))]


def _render(tok, messages, generation_prompt: bool) -> list[int]:
    out = tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=True
    )
    return list(out["input_ids"])


def _trailing_whitespace(tok, ids: list[int], start: int) -> int:
    """The end of ids[start:] without its trailing whitespace-only (non-special) tokens."""
    special = set(tok.all_special_ids)
    end = len(ids)
    while end > start and ids[end - 1] not in special and not tok.decode(ids[end - 1 : end]).strip():
        end -= 1
    return end


def tokenize_chat(tok, chat: list[dict]) -> tuple[list[tuple[list[int], list[int]]], ChatStats]:
    """[(ids, labels)] documents of one conversation (usually one), and the turn statistics."""
    stats = ChatStats()
    docs: list[tuple[list[int], list[int]]] = []
    ids: list[int] = []
    labels: list[int] = []
    tagged = bool(GENERATION_TAG.search(getattr(tok, "chat_template", None) or ""))
    for i, m in enumerate(chat):
        if m.get("role") != "assistant":
            continue
        stats.turns += 1
        r = _render(tok, chat[: i + 1], False)
        start = _opening_start(tok, r) if i == 0 else _prompt_end(_render(tok, chat[:i], True), r)
        span = None if start is None else (start, _trailing_whitespace(tok, r, start))
        if span is None and tagged:
            span = _generation_span(tok, chat[: i + 1], r)
        if span is None:
            if len(stats.unmatched_examples) < 3:
                stats.unmatched_examples.append(m.get("content", "")[:60])
            continue
        start, end = span
        if end <= start:
            continue
        if r[: len(ids)] == ids:  # the turn extends the sequence so far
            labels = labels + [IGNORE] * (start - len(labels))
        else:  # the template rewrote an earlier turn: a new document from here
            docs.append((ids, labels))
            stats.split += 1
            labels = [IGNORE] * start
        labels += r[start:end] + [IGNORE] * (len(r) - end)
        ids = r
        stats.matched += 1
    if ids:
        docs.append((ids, labels))
    return [d for d in docs if d[0]], stats


def _prompt_end(g: list[int], r: list[int]) -> int | None:
    """Where the turn starts in r: after g, the generation prompt, when g is a prefix of r."""
    return len(g) if r[: len(g)] == g else None


def _opening_start(tok, r: list[int]) -> int | None:
    """Where an assistant turn that opens the conversation starts in r, its rendering. Transformers renders no
    empty conversation, so there is no generation prompt to take off: the assistant header is what the
    generation prompt adds after a user message, and the turn starts after the first occurrence of that
    header in r that only what the template renders before any message (a bos token, a default system prompt)
    precedes; None if there is none (unmatched, no loss)."""
    p, header = _assistant_header(tok, getattr(tok, "chat_template", None))
    if not header:
        return None
    for j in range(len(r) - len(header) + 1):
        if r[:j] != p[:j]:
            return None
        if r[j : j + len(header)] == header:
            return j + len(header)
    return None


@functools.lru_cache(maxsize=8)  # rendered once per tokenizer and template, not once per conversation
def _assistant_header(tok, template) -> tuple[list[int], list[int]]:
    """(what tok's chat template renders for a one-message user conversation, the assistant header the
    generation prompt adds to it); an empty header where the template refuses the probe or adds nothing.
    `template` (tok.chat_template) is part of the cache's key: a template set later renders anew."""
    from jinja2 import TemplateError

    probe = [{"role": "user", "content": "?"}]
    try:
        p, g = _render(tok, probe, False), _render(tok, probe, True)
    except TemplateError:
        return [], []
    n = _prompt_end(p, g)
    return p, (g[n:] if n is not None else [])


def _generation_span(tok, messages, r: list[int]) -> tuple[int, int] | None:
    """The last assistant turn's token span from the template's {% generation %} tags, or None."""
    try:
        out = tok.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    except (ValueError, TypeError):
        return None
    mask = list(out.get("assistant_masks") or [])
    if list(out["input_ids"]) != r or not any(mask):
        return None
    end = len(mask) - mask[::-1].index(1)
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return start, end
