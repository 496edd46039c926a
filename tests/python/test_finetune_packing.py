"""`moe8 finetune` packing on CPU: documents kept whole (best-fit decreasing, padded; every loss token with the
start of its document, measured against the documents tokenized one at a time), cut and dropped documents
counted and reported, streaming packing as the option for pretraining-style text, and the runs that would learn
nothing refused (seq_len 1, a step or a dataset without loss tokens)."""

import json
import random

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0", reason="moe8 finetune needs transformers>=5")

import test_finetune as base  # noqa: E402

from moe8.finetune.chat import tokenize_chat  # noqa: E402
from moe8.finetune.config import Config, FinetuneError  # noqa: E402
from moe8.finetune.data import Data, byte_tokenizer  # noqa: E402
from moe8.finetune.packing import IGNORE, pack_documents, pack_rows  # noqa: E402

text_file, _undo_moe8 = base.text_file, base._undo_moe8
finetune_rc, flags, chats, write_jsonl = base.finetune_rc, base.flags, base.chats, base.write_jsonl


def segments(ids, pos):
    """[(start, end)] of the documents of one packed row (a document starts where its position is 0)."""
    starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
    return list(zip(starts[:-1], starts[1:]))


def missing_prompt_share(rows, docs) -> tuple[float, float]:
    """(share of the loss tokens whose document start is not in their row, share of rows that start inside a
    document): a row's document is whole-started when its tokens are a prefix of a document tokenized alone."""
    ids, labels, pos = (t.tolist() for t in rows)
    originals = [tuple(d) for d, _ in docs]
    loss = without = mid_rows = 0
    for r_ids, r_labels, r_pos in zip(ids, labels, pos):
        for k, (a, b) in enumerate(segments(r_ids, r_pos)):
            seg = tuple(r_ids[a:b])
            whole = any(d[: len(seg)] == seg for d in originals)
            n = sum(x != IGNORE for x in r_labels[a + 1 : b])
            loss += n
            without += 0 if whole else n
            mid_rows += k == 0 and not whole
    return without / loss, mid_rows / len(ids)


@pytest.mark.parametrize("seq_len", [64, 256, 1000])
def test_chat_packing_keeps_every_prompt(tmp_path, seq_len):
    """The share of loss tokens trained without their prompt: 0 when documents are kept whole; with streaming
    packing (the option for pretraining-style text) most rows start inside a conversation."""
    tok = byte_tokenizer()
    rows = chats(60)
    docs = [d for c in rows for d in tokenize_chat(tok, c)[0]]
    jl = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in rows])
    kw = dict(data=str(jl), seq_len=seq_len, micro_batch=1, eval_fraction=0)
    whole = Data(Config(**kw), tok)
    assert missing_prompt_share(whole.train, docs)[0] == 0
    assert (whole.train[1][:, 1:] != IGNORE).any(1).all()  # every row has something to learn
    if seq_len > max(len(d) for d, _ in docs):  # nothing cut: every assistant token of the data is trained
        assert whole.packing.cut == whole.packing.dropped == 0
        n_loss = sum(sum(x != IGNORE for x in labels[1:]) for _, labels in docs)
        assert int((whole.train[1] != IGNORE).sum()) == n_loss
    stream = Data(Config(packing="stream", **kw), tok)
    lost, mid = missing_prompt_share(stream.train, docs)
    assert lost > 0.05
    if seq_len == 256:  # the figure docs/finetune.md gives
        assert mid > 0.5


def reference_rows(docs, S):
    """An independent first-fit-decreasing packing: the number of rows it needs."""
    room = []
    for n in sorted((len(d) for d in docs), reverse=True):
        for i, r in enumerate(room):
            if r >= n:
                room[i] -= n
                break
        else:
            room.append(S - n)
    return len(room)


@pytest.mark.parametrize("S", [2, 7, 32, 128])
def test_pack_documents_whole_once_in_order(S):
    rng = random.Random(S)
    docs = []
    for _ in range(200):
        n = rng.choice([1, 2, 3, rng.randint(1, 2 * S)])
        ids = [rng.randint(0, 250) for _ in range(n)]
        labels = [IGNORE if rng.random() < 0.3 else t for t in ids]
        docs.append((ids, labels))
    (ids, labels, pos), stats = pack_documents(docs, S, pad_id=259)
    assert ids.shape == labels.shape == pos.shape == (stats.rows, S) and ids.dtype == torch.int32
    # what should be kept: each document cut at S, those with a loss token after their first token
    want = []
    for d_ids, d_labels in docs:
        cut = (d_ids[:S], d_labels[:S])
        if any(x != IGNORE for x in cut[1][1:]):
            want.append(cut)
    cut = sum(len(d) > S for d, _ in docs)
    assert stats.cut == cut and stats.dropped + stats.no_loss == len(docs) - len(want)
    got = []
    for r_ids, r_labels, r_pos in zip(ids.tolist(), labels.tolist(), pos.tolist()):
        assert any(x != IGNORE for x in r_labels[1:])
        row = []
        for a, b in segments(r_ids, r_pos):
            assert r_pos[a:b] == list(range(b - a)) and r_labels[a] == IGNORE
            row.append((r_ids[a:b], r_labels[a:b]))
        if row[-1][0] and all(t == 259 for t in row[-1][0]) and all(x == IGNORE for x in row[-1][1]):
            row = row[:-1]  # the padding
        got.append(row)
    flat = [d for row in got for d in row]
    assert len(flat) == len(want) and stats.padding == stats.rows * S - sum(len(d) for d, _ in want)
    # each kept document exactly once, whole, in file order within its row and by first document across rows
    index = {}
    for k, (d_ids, d_labels) in enumerate(want):
        index.setdefault(tuple(d_ids), []).append((k, [IGNORE, *d_labels[1:]]))
    order, firsts = [], []
    for row in got:
        ks = []
        for d_ids, d_labels in row:
            k, lab = next(x for x in index[tuple(d_ids)] if x[0] not in order and x[0] not in ks)
            assert d_labels == lab
            ks.append(k)
        assert ks == sorted(ks)
        order += ks
        firsts.append(ks[0])
    assert sorted(order) == list(range(len(want))) and firsts == sorted(firsts)
    assert stats.rows <= reference_rows([d for d, _ in want], S)  # best fit needs no more rows than first fit


def test_stream_packing_drops_rows_without_loss():
    """Streaming a chat whose prompt spans whole rows: those rows (no label) are dropped, not trained on."""
    prompt = [7] * 50
    docs = [([*prompt, 1, 2, 3], [IGNORE] * 50 + [1, 2, 3])] * 4
    (ids, labels, pos), stats = pack_rows(docs, 16, "stream", pad_id=0)
    assert stats.empty_rows > 0 and len(ids) == stats.rows
    assert (labels[:, 1:] != IGNORE).any(1).all()


def long_chats(tmp_path):
    """A chat file: 10 short conversations, 3 whose reply ends past 200 tokens, 2 whose reply starts past it."""
    short = chats(10)
    cut = [c[:2] + [{"role": "assistant", "content": "x" * 300}] for c in chats(3)]
    dropped = [[{"role": "system", "content": "y" * 300}] + c[1:3] for c in chats(2)]
    return write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in short + cut + dropped])


def test_cut_and_dropped_conversations_are_reported(tmp_path, capsys):
    out = tmp_path / "out"
    argv = flags(out, long_chats(tmp_path), "--seq_len", 200, "--steps", 2, "--eval_every", 0)
    rc, text = finetune_rc(capsys, argv)
    assert rc == 0, text
    assert "documents kept whole: 5 longer than seq_len cut, 2 dropped (no loss token within seq_len)" in text
    # every conversation's assistant tokens within the cut, with its prompt: a reply to 'x' * 300 starts the row
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 2


def test_no_assistant_token_within_seq_len_is_refused(tmp_path, capsys):
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in chats(6)])
    out = tmp_path / "out"
    rc, text = finetune_rc(capsys, flags(out, data, "--seq_len", 40))  # the replies start after token 40
    assert rc == 2 and "no assistant token within seq_len = 40" in text and "dropped all 6 documents" in text
    assert "raise seq_len" in text and not out.exists()
    rc, text = finetune_rc(capsys, flags(out, data, "--seq_len", 40, "--packing", "stream"))  # the old way
    assert rc == 0, text


def test_seq_len_below_2_is_refused(tmp_path, text_file, capsys):
    out = tmp_path / "out"
    rc, text = finetune_rc(capsys, flags(out, text_file, "--seq_len", 1))
    assert rc == 2 and "moe8 finetune: error: seq_len = 1: expected at least 2" in text, text
    assert "Traceback" not in text and not out.exists()
    with pytest.raises(FinetuneError, match="seq_len = 0: expected at least 2"):
        base.make_config(None, {"seq_len": 0})


def test_a_step_without_loss_tokens_is_refused(tmp_path, text_file, capsys, monkeypatch):
    real = Data.batch

    def masked(self, m):
        x, y, pos = real(self, m)
        return x, torch.full_like(y, IGNORE), pos

    monkeypatch.setattr(Data, "batch", masked)
    out = tmp_path / "out"
    rc, text = finetune_rc(capsys, flags(out, text_file, "--steps", 2))
    assert rc == 2 and "step 1: its 2 sequences hold no loss tokens" in text, text
    assert "Traceback" not in text and not out.exists()  # nothing kept: no checkpoint was written


def test_padding_takes_no_part_in_the_load_balancing_loss():
    """The router's load-balancing loss of a padded batch: that of its real tokens alone (transformers'
    load_balancing_loss_func over them, no mask), whatever the padding tokens are."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from moe8.finetune.packing import padding
    from moe8.finetune.train import balance_loss

    model = base.tiny_model()
    model.config.output_router_logits = True
    balance = balance_loss(model)
    rng = random.Random(0)
    docs = [([rng.randint(0, 255) for _ in range(n)],) * 2 for n in (20, 9, 30, 5, 17, 26, 3)]
    results = []
    for pad_id in (259, 7):
        (x, y, pos), stats = pack_documents(docs, 32, pad_id)
        pad = padding(y, pos)
        assert stats.padding == int(pad.sum()) > 0 and (x[pad] == pad_id).all() and (y[pad] == IGNORE).all()
        with torch.no_grad():
            logits = model(input_ids=x.long(), position_ids=pos.long()).router_logits
        real = (~pad).flatten()
        want = load_balancing_loss_func(tuple(t[real] for t in logits), 8, 2)
        got = balance(logits, (~pad).long())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        results.append(got)
        with_pad = load_balancing_loss_func(logits, 8, 2)  # what the padding would have changed
        assert abs(float(with_pad - want)) > 1e-4
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-7)


def test_eval_data_without_a_loss_token_within_seq_len_is_refused(tmp_path, text_file, capsys):
    evals = write_jsonl(tmp_path / "e.jsonl", [{"messages": c} for c in chats(4)])
    out = tmp_path / "out"
    rc, text = finetune_rc(capsys, flags(out, text_file, "--seq_len", 40, "--eval_data", evals))
    assert rc == 2 and "eval_data: " in text and "no loss token within seq_len = 40 (4 longer than" in text, (
        text
    )
    assert not out.exists()
