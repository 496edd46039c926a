"""Packing documents into fixed-length sequences that keep them apart.

Documents are laid end to end and cut every seq_len tokens. Each token carries its position in its
document (restarting at 0 at each document start and at each sequence start), passed to the model as
`position_ids`: transformers derives from them a block-diagonal causal mask (masking_utils'
find_packed_sequence_indices for sdpa / eager; flash-attention's varlen path with one packed row), and
RoPE rotates each document from position 0, moe8's fused RoPE included (it takes the cos / sin the
model computes from the position_ids). The first token of each document gets no label: the previous
document's last token does not predict it."""

from __future__ import annotations

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
