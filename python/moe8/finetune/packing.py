"""Packing documents into fixed-length sequences that keep them apart.

Two ways (the `packing` key):
- `documents` (pack_documents): each document or conversation goes whole into one sequence, best-fit
  decreasing (the longest first, each into the sequence with the least room that still holds it), and the rest
  of a sequence is padding without loss. One longer than seq_len is cut at seq_len; one left without a loss
  token (a conversation whose assistant turns all lie past the cut) is dropped. No token trains without the
  start of its document.
- `stream` (pack): documents laid end to end and cut every seq_len tokens, no padding (pretraining-style
  text: a document may continue in the next sequence without its start).

Each token carries its position in its document (restarting at 0 at each document start and at each sequence
start; padding is a document of its own), passed to the model as `position_ids`: transformers derives from
them a block-diagonal causal mask (masking_utils' find_packed_sequence_indices for sdpa / eager;
flash-attention's varlen path with one packed row), and RoPE rotates each document from position 0, moe8's
fused RoPE included (it takes the cos / sin the model computes from the position_ids). The first token of each
document gets no label: the previous document's last token does not predict it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100


def pack(
    docs: list[tuple[list[int], list[int]]], seq_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, labels, position_ids), each [N, seq_len] int32, from [(ids, labels)] documents; the tail that does
    not fill a sequence is dropped."""
    ids = torch.tensor([t for d in docs for t in d[0]], dtype=torch.int32)
    labels = torch.tensor([t for d in docs for t in d[1]], dtype=torch.int32)
    start = torch.zeros(len(ids), dtype=torch.bool)
    offsets = torch.tensor([0] + [len(d[0]) for d in docs[:-1]], dtype=torch.long).cumsum(0)
    start[offsets[offsets < len(ids)]] = True
    labels[start] = IGNORE
    n = len(ids) // seq_len
    ids, labels, start = ids[: n * seq_len], labels[: n * seq_len], start[: n * seq_len]
    return ids.view(n, seq_len), labels.view(n, seq_len), positions(start.view(n, seq_len))


def positions(start: torch.Tensor) -> torch.Tensor:
    """[N, S] bool document starts -> [N, S] int32 positions within each document, restarting at each row."""
    N, S = start.shape
    idx = torch.arange(S).expand(N, S)
    first = torch.where(start, idx, torch.zeros_like(idx))
    first[:, 0] = 0
    return (idx - first.cummax(1).values).to(torch.int32)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[N, S] positions -> [N, S] index of the document of each token within its row (0, 0, 1, 1, 1, 2...)."""
    return (position_ids == 0).long().cumsum(1) - 1


def most_documents(position_ids: torch.Tensor, rows: int) -> int:
    """The most documents any `rows` of these [N, S] positions hold together (a document starts at position 0
    and at every row's start): the rows holding the most, summed."""
    per_row = (position_ids == 0).sum(1) + (position_ids[:, 0] != 0)
    return int(per_row.topk(min(rows, len(per_row))).values.sum()) if len(per_row) else 0


def longest_document(position_ids: torch.Tensor) -> int:
    """The longest document (or part of one in a row) in these [N, S] positions."""
    return int(position_ids.max()) + 1 if position_ids.numel() else 0


@dataclass
class PackStats:
    """What packing did to the documents: cut to seq_len, dropped, and the rows and padding it made."""

    seq_len: int
    documents: int = 0  # documents given
    cut: int = 0  # longer than seq_len: cut at seq_len (documents packing)
    dropped: int = 0  # cut and left without a loss token: dropped
    no_loss: int = 0  # without a loss token to begin with (a conversation with no assistant turn): dropped
    rows: int = 0
    empty_rows: int = 0  # rows without a loss token (stream packing): dropped
    padding: int = 0  # padding tokens

    def describe(self) -> str:
        """'3 longer than seq_len cut, 1 dropped (no loss token within seq_len), 12.0% padding', or ''."""
        parts = [f"{self.cut} longer than seq_len cut"] if self.cut else []
        if self.dropped:
            parts.append(f"{self.dropped} dropped (no loss token within seq_len)")
        if self.no_loss:
            parts.append(f"{self.no_loss} without a loss token dropped")
        if self.empty_rows:
            parts.append(f"{self.empty_rows} sequences without a loss token dropped")
        if self.padding:
            parts.append(f"{100 * self.padding / max(1, self.rows * self.seq_len):.1f}% padding")
        return ", ".join(parts)


def has_loss(labels: list[int]) -> bool:
    """Whether a document's labels train anything (its first token never does: no label within its document)."""
    return any(x != IGNORE for x in labels[1:])


def padding(labels: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: the padding of rows from pack_documents, the last document of a row when it has no label (a
    kept document always has one)."""
    start = pos == 0
    last = start.long().cumsum(1) == start.sum(1, keepdim=True)  # the row's last document
    return last & ~((labels != IGNORE) & last).any(1, keepdim=True)


def pack_rows(
    docs: list[tuple[list[int], list[int]]], seq_len: int, packing: str, pad_id: int
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], PackStats]:
    """(ids, labels, position_ids) [N, seq_len] int32 packed the `packing` way, and what packing did; a
    sequence without a loss token is never kept."""
    if packing == "documents":
        return pack_documents(docs, seq_len, pad_id)
    ids, labels, pos = pack(docs, seq_len)
    keep = (labels[:, 1:] != IGNORE).any(1)
    stats = PackStats(seq_len, len(docs), rows=int(keep.sum()), empty_rows=int((~keep).sum()))
    return (ids[keep], labels[keep], pos[keep]), stats


def pack_documents(
    docs: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], PackStats]:
    """Each document whole in one row (best-fit decreasing), padded with pad_id (no label, a document of its
    own); within a row the documents keep their order, and the rows are in the order of their first document."""
    S = seq_len
    stats = PackStats(S, len(docs))
    kept = []  # (ids, labels) in file order
    for ids, labels in docs:
        cut = len(ids) > S
        if cut:
            ids, labels = ids[:S], labels[:S]
            stats.cut += 1
        if not has_loss(labels):
            stats.dropped += cut
            stats.no_loss += not cut
            continue
        kept.append((ids, labels))
    rows: list[list[int]] = []  # indices into kept
    free: list[list[int]] = [[] for _ in range(S + 1)]  # free[c]: rows with exactly c tokens of room
    mask = 0  # bit c set: free[c] is not empty
    order = sorted(range(len(kept)), key=lambda k: -len(kept[k][0]))  # the longest first, ties in file order
    for k in order:
        n = len(kept[k][0])
        room = mask >> n
        if room:  # the row with the least room that holds the document
            c = n + (room & -room).bit_length() - 1
            r = free[c].pop()
            if not free[c]:
                mask &= ~(1 << c)
        else:
            c, r = S, len(rows)
            rows.append([])
        rows[r].append(k)
        if c - n:
            free[c - n].append(r)
            mask |= 1 << (c - n)
    for row in rows:
        row.sort()
    rows.sort()
    ids, labels, pos = [], [], []
    for row in rows:
        used = 0
        for k in row:
            d_ids, d_labels = kept[k]
            ids += d_ids
            labels += [IGNORE, *d_labels[1:]]
            pos += range(len(d_ids))
            used += len(d_ids)
        ids += [pad_id] * (S - used)
        labels += [IGNORE] * (S - used)
        pos += range(S - used)
        stats.padding += S - used
    stats.rows = len(rows)
    shape = (len(rows), S)
    return tuple(torch.tensor(t, dtype=torch.int32).view(shape) for t in (ids, labels, pos)), stats
