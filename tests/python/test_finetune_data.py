"""`moe8 finetune` data and bookkeeping on CPU: dataset formats (alpaca, ShareGPT, messages, parquet), chat masking
from the template's own rendering (a hand-written template and the real Qwen3 one), packing that keeps documents
apart (a packed batch's loss equals the documents run one at a time, fused RoPE on and off), the memory
estimate (hand-computed) and refusal, strict metrics JSON, report_to dispatch, the router z-loss, eval_data."""

import importlib.machinery
import json
import math
import sys
import types

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0", reason="moe8 finetune needs transformers>=5")

from moe8.finetune import main  # noqa: E402
from moe8.finetune.chat import IGNORE, tokenize_chat  # noqa: E402
from moe8.finetune.config import Config, FinetuneError  # noqa: E402
from moe8.finetune.data import Data, byte_tokenizer, load_tokenizer, shared  # noqa: E402
from moe8.finetune.formats import documents  # noqa: E402
from moe8.finetune.packing import pack, pack_rows  # noqa: E402

QWEN3 = shared("tokenizers", "qwen3")


@pytest.fixture(autouse=True)
def _undo_moe8():
    yield
    from moe8 import hf

    hf.disable()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def runs(tok, ids, labels):
    """The decoded runs of labelled tokens (each label equal to its token)."""
    out, cur = [], []
    for t, label in zip(ids, labels):
        if label != IGNORE:
            assert label == t
            cur.append(t)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    return out + ([tok.decode(cur)] if cur else [])


# ------------------------------------------------------------------------------------------------ formats
def test_formats_detected_and_named():
    cfg = Config()
    alpaca = [{"instruction": "Add", "input": "2 3", "output": "5", "system": "Be brief."}]
    kind, [chat] = documents(cfg, alpaca, "a")
    assert kind == "chat" and chat == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add\n\n2 3"},
        {"role": "assistant", "content": "5"},
    ]
    share = [
        {
            "conversations": [
                {"from": "system", "value": "S"},
                {"from": "human", "value": "Q"},
                {"from": "gpt", "value": "A"},
            ]
        }
    ]
    assert documents(cfg, share, "s")[1][0] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
    ]
    msgs = [
        {
            "messages": [
                {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A", "reasoning_content": "R"},
            ]
        }
    ]
    assert documents(cfg, msgs, "m")[1][0][1]["reasoning_content"] == "R"
    # an explicit format: a record with both `text` and `instruction` / `output` read as alpaca or as text
    both = [{"text": "T", "instruction": "I", "output": "O"}]
    assert documents(Config(format="text"), both, "b") == ("text", ["T"])
    assert documents(cfg, both, "b")[0] == "chat"
    with pytest.raises(FinetuneError, match=r"record 1 has the keys \['prompt'\], which match none .*alpaca"):
        documents(cfg, [{"prompt": "x"}], "p")
    with pytest.raises(FinetuneError, match=r"record 2 \(sharegpt format\).*from = 'bot'"):
        documents(cfg, share + [{"conversations": [{"from": "bot", "value": "x"}]}], "s")
    with pytest.raises(FinetuneError, match=r"record 1 \(alpaca format\): field 'output' is missing"):
        documents(Config(format="alpaca"), [{"instruction": "x"}], "a")


def test_parquet_and_eval_data(tmp_path):
    datasets = pytest.importorskip("datasets", reason="parquet needs the optional datasets library")
    tok = byte_tokenizer()
    rows = [{"instruction": f"say {i}", "input": "", "output": f"number {i} " * 3} for i in range(60)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    write_jsonl(tmp_path / "d.jsonl", rows)
    write_jsonl(tmp_path / "e.jsonl", rows[:20])
    kw = dict(seq_len=32, micro_batch=2, eval_fraction=0.1)
    pq = Data(Config(data=str(tmp_path / "d.parquet"), **kw), tok)
    jl = Data(Config(data=str(tmp_path / "d.jsonl"), **kw), tok)
    assert pq.kind == "chat" and pq.chat.matched == pq.chat.turns == 60
    assert all(torch.equal(a, b) for a, b in zip(pq.train, jl.train))
    ev = Data(Config(data=str(tmp_path / "d.jsonl"), eval_data=str(tmp_path / "e.jsonl"), **kw), tok)
    n_all = len(jl.train[0]) + len(jl.eval[0])
    assert len(ev.train[0]) == n_all and ev.eval_source == str(tmp_path / "e.jsonl")  # nothing held out
    assert torch.equal(ev.eval[0], pack_of(tok, rows[:20], 32))


def pack_of(tok, rows, S):
    docs = [d for r in rows for d in tokenize_chat(tok, documents(Config(), [r], "x")[1][0])[0]]
    return pack_rows(docs, S, "documents", tok.pad_token_id)[0][0]


# -------------------------------------------------------------------------------------------- chat masking
# a ChatML-like template that, as Qwen3's does, keeps reasoning only on turns after the last user message
# (from reasoning_content or a <think> block in the content) and strips it from earlier ones
THINK = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}"
    "{%- endif %}{%- endfor %}{%- for m in messages %}{%- set c = m.content %}{%- set r = m.reasoning_content or '' %}"
    "{%- if '</think>' in c %}{%- set r = c.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set c = c.split('</think>')[-1] %}{%- endif %}<|im_start|>{{ m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last and r %}<think>{{ r }}</think>{%- endif %}"
    "{{ c }}<|im_end|>{{ '\\n' }}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{%- endif %}"
)


def hard_chat():
    return [
        {"role": "system", "content": "You are the assistant."},
        {"role": "user", "content": "Say your role."},
        {"role": "assistant", "content": "assistant"},  # the reply is also header text
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "<think>one and one</think>2"},  # reasoning dropped once not last
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
    ]


@pytest.mark.parametrize(
    "name",
    [
        "template",
        pytest.param("qwen3", marks=pytest.mark.skipif(QWEN3 is None, reason="no shared Qwen3 tokenizer")),
    ],
)
def test_chat_masking_from_the_template(name):
    if name == "template":
        tok = byte_tokenizer()
        tok.chat_template = THINK
        want = [
            "assistant<|im_end|>",
            "<think>one and one</think>2<|im_end|>",
            "<think>two and two</think>4<|im_end|>",
        ]
    else:
        tok = load_tokenizer(Config(tokenizer="qwen3"), None)
        want = [
            "<think>\n\n</think>\n\nassistant<|im_end|>",
            "<think>\none and one\n</think>\n\n2<|im_end|>",
            "<think>\ntwo and two\n</think>\n\n4<|im_end|>",
        ]
    docs, stats = tokenize_chat(tok, hard_chat())
    assert (stats.turns, stats.matched) == (3, 3)
    assert [r for ids, labels in docs for r in runs(tok, ids, labels)] == want
    # each document is the template's own rendering of the conversation up to its last labelled turn
    for ids, labels in docs:
        assert len(ids) == len(labels)
        text = tok.decode(ids)
        assert text.startswith("<|im_start|>system\nYou are the assistant.<|im_end|>")
    # a conversation the template does not rewrite stays one document with every turn labelled
    plain = [m for m in hard_chat() if "think" not in m["content"] and "reasoning_content" not in m]
    one, s = tokenize_chat(tok, plain[:3])
    assert len(one) == 1 and (s.turns, s.matched, s.split) == (1, 1, 0)


def test_generation_tags_fallback_and_unmatched():
    tok = byte_tokenizer()
    # a template whose generation prompt is not a prefix of the rendered turn (it closes the user turn
    # differently), with {% generation %} tags: the tags mark the turn
    tok.chat_template = (
        "{%- for m in messages %}{%- if m.role == 'assistant' %}<|im_start|>A:{% generation %}{{ m.content }}<|im_end|>"
        "{% endgeneration %}{%- else %}<|im_start|>{{ m.role }}:{{ m.content }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_end|>{%- endif %}"
    )
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    docs, stats = tokenize_chat(tok, chat)
    assert stats.matched == 1 and runs(tok, *docs[0]) == ["yo<|im_end|>"]
    tok.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    docs, stats = tokenize_chat(tok, chat)
    assert (stats.turns, stats.matched) == (1, 0) and stats.unmatched_examples == ["yo"]


# ---------------------------------------------------------------------------------------------- packing
def tiny(attn):
    from transformers import AutoConfig, AutoModelForCausalLM

    from moe8.finetune.model import BUILTIN

    family, kw = BUILTIN["tiny-qwen3-moe"]
    config = AutoConfig.for_model(family, **kw, vocab_size=260)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def loss_sum(model, x, y, pos=None):
    # use_cache off, as the trainer has it: with a cache transformers does not derive the packed mask
    logits = model(input_ids=x, position_ids=pos, use_cache=False).logits.double()
    target = torch.cat([y[:, 1:], torch.full_like(y[:, :1], IGNORE)], 1)
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="sum"
    )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("fuse_rope", [False, True])
def test_packed_batch_loss_equals_documents_one_at_a_time(attn, fuse_rope):
    from moe8 import hf

    g = torch.Generator().manual_seed(1)
    lengths = [[7, 1, 13, 11], [32], [19, 13]]  # a 1-token document; rows of 32 tokens
    docs = [[torch.randint(0, 256, (n,), generator=g).tolist() for n in row] for row in lengths]
    x, y, pos = (t.long() for t in pack([(d, d) for row in docs for d in row], 32))
    assert x.shape == (3, 32) and pos[0].tolist()[:9] == [0, 1, 2, 3, 4, 5, 6, 0, 0]
    model = tiny(attn)
    if fuse_rope:
        hf.accelerate(model, fuse_rope=True, fuse_router=False, fuse_norm=False)
    with torch.no_grad():
        packed = loss_sum(model, x, y, pos)
        alone = sum(loss_sum(model, torch.tensor([d]), torch.tensor([d])) for row in docs for d in row)
        unmasked = loss_sum(model, x, y)  # no position_ids: attention across the documents
    assert packed.item() == pytest.approx(alone.item(), rel=1e-5, abs=1e-6)
    assert abs(unmasked.item() - alone.item()) > 1e-3  # the check can tell


def test_fused_rope_takes_per_document_positions():
    from moe8 import hf, rotary

    x, y, pos = (t.long() for t in pack([([5, 6, 7, 8, 9], [5, 6, 7, 8, 9]), ([1, 2, 3], [1, 2, 3])] * 4, 16))
    model = tiny("sdpa")
    with torch.no_grad():
        ref = model(input_ids=x, position_ids=pos, use_cache=False).logits
        hf.accelerate(model, fuse_rope=True, fuse_router=False, fuse_norm=False)
        fused = model(input_ids=x, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
    # the fused kernel against float64 rotate-half RoPE at each token's own document position
    q, k = torch.randn(2, 2, 4, 16, 16, dtype=torch.float32).unbind(0)  # [B, H, S, D]
    cos, sin = model.model.rotary_emb(q, position_ids=pos)  # [B, S, D] from the per-document positions
    fq, fk = rotary.apply_rotary_pos_emb(q, k, cos, sin)
    theta = model.config.rope_parameters["rope_theta"]
    inv = 1.0 / theta ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    ang = pos.double()[..., None] * inv  # [B, S, 8]
    c, s_ = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def ref_rope(t):
        t = t.double()
        return t * c + torch.cat([-t[..., 8:], t[..., :8]], -1) * s_

    torch.testing.assert_close(fq.double(), ref_rope(q), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fk.double(), ref_rope(k), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ memory
def test_memory_estimate_by_hand():
    from transformers import AutoModelForCausalLM

    from moe8.finetune import memory
    from moe8.finetune.model import model_config

    cfg = Config(micro_batch=2, seq_len=32, device="cpu")
    config, _ = model_config(cfg)
    config.vocab_size = 260
    counts = memory.count_params(config, cfg)
    model = AutoModelForCausalLM.from_config(config)  # counted for real, not on the meta device
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.experts == sum(
        m.mlp.experts.gate_up_proj.numel() + m.mlp.experts.down_proj.numel() for m in model.model.layers
    )
    P, tokens, L = counts.total, 64, 2
    # per token and layer (fp32): attention 4 x (2 x 64 + 2 x (64 + 2 x 32) + 64) + 4 x 4 heads = 1808;
    # MoE 4 x (2 x 64 + 2 x (64 + 3 x 64) + 2 x 64) + 8 x 8 experts = 3136
    assert memory.per_token_layer(config, 4) == 1808 + 3136
    est = memory.estimate(config, cfg, counts, torch.float32)
    want = dict(
        weights=4 * P,
        master=0,
        adamw=8 * P,
        grads=4 * P,
        activations=tokens * L * 4944,
        logits=64 * 260 * 8,
        loss_grads=tokens * 64 * 4 + 384 * 64 * 4,  # d hidden; d weight at the vocabulary padded to 128 rows
        fp8_transient=0,  # no LoRA over FP8 bases
        attention_scores=0,  # SDPA attention: no S x S tensors
    )
    want["overhead"] = sum(want.values()) // 20
    assert est.parts == want and est.total == sum(want.values())
    # LoRA in bf16 with checkpointing: frozen bf16 base, fp32 adapters; one hidden state per layer kept
    lora = Config(micro_batch=2, seq_len=32, method="lora", lora_r=4, activation_checkpointing=True)
    c2 = memory.count_params(config, lora)
    # q (64->64), k, v (64->32), o (64->64): r x (in + out); experts: gate_up [8, 128, 64], down [8, 64, 64]
    assert c2.lora == L * 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 8 * (128 + 64) + 8 * (64 + 64))
    e2 = memory.estimate(config, lora, c2, torch.bfloat16)
    T = c2.lora
    want2 = dict(
        weights=2 * P + 4 * T,
        master=0,
        adamw=8 * T,
        grads=4 * T,
        activations=tokens * L * 64 * 2 + tokens * memory.per_token_layer(config, 2),
        logits=64 * 260 * 8,
        loss_grads=tokens * 64 * 2,  # the head is frozen: d hidden only
        fp8_transient=0,
        attention_scores=0,
    )
    want2["overhead"] = sum(want2.values()) // 20
    assert e2.parts == want2


def test_memory_refusal_names_figures_and_hints(tmp_path, capsys, monkeypatch):
    from moe8.finetune import memory

    monkeypatch.setattr(
        memory, "device_memory", lambda device: 2**30
    )  # a 1 GiB GPU: the context alone fills it
    out = tmp_path / "out"
    argv = [
        "--output_dir",
        str(out),
        "--steps",
        "1",
        "--micro_batch",
        "2",
        "--seq_len",
        "32",
        "--no-progress",
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "memory: the estimated peak is" in err and "more than the GPU's 1.0 GiB" in err
    for hint in (
        "--method lora",
        "--activation_checkpointing",
        "--micro_batch 1 --grad_accum 2",
        "--no-memory-check",
    ):
        assert hint in err
    assert not out.exists()
    assert main(argv + ["--no-memory-check", "--eval_fraction", "0"]) == 0  # the override runs
    assert "memory: estimate vs measured peak" in (out / "report.html").read_text()


# -------------------------------------------------------------------------------- metrics and trackers
def test_strict_json_and_scalars():
    from moe8.finetune.loggers import dumps, scalars

    line = dict(step=3, loss=float("nan"), lr=1e-3, mfu=None, routing={"l0": [0.75, 0.25]}, g=float("inf"))
    text = dumps(line)
    back = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert back["loss"] is None and back["g"] is None and back["nonfinite"] == ["g", "loss"]
    assert scalars(line) == {"lr": 1e-3, "routing/max_imbalance": 1.5, "routing/mean_imbalance": 1.5}


def test_report_to_dispatch_z_loss_and_eval_data(tmp_path, capsys, monkeypatch):
    calls = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    class Run:
        def log(self, values, step):
            calls.append((step, values))

        def finish(self):
            calls.append("finish")

    fake.init = lambda **kw: calls.append(("init", kw["config"]["steps"])) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    data = tmp_path / "d.txt"
    data.write_text("".join(f"line {i} of the text, with words.\n" for i in range(300)))
    ev = tmp_path / "e.txt"
    ev.write_text("".join(f"held out {i}.\n" for i in range(60)))
    out = tmp_path / "out"
    argv = f"--output_dir {out} --data {data} --eval-data {ev} --steps 4 --micro_batch 2 --seq_len 32 --log_every 1"
    argv += " --eval_every 2 --no-progress --report_to wandb --router_z_loss_coef 0.01 --aux_loss_coef 0.05"
    assert main(argv.split()) == 0, capsys.readouterr()
    assert calls[0] == ("init", 4) and calls[-1] == "finish"
    logged = {s: v for s, v in calls[1:-1]}
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(logged) == [0, 1, 2, 3, 4] and logged[4]["loss"] == lines[-1]["loss"]
    assert [x["step"] for x in lines if "eval_loss" in x] == [0, 2, 4]
    assert all(x["z_loss"] > 0 and x["aux_loss"] > 0 for x in lines[1:])
    html = (out / "report.html").read_text()
    assert "router losses (aux, z)" in html and str(ev) in html
    with pytest.raises(FinetuneError, match="mlflow is not installed: pip install mlflow"):
        from moe8.finetune.loggers import check_installed

        monkeypatch.setitem(sys.modules, "mlflow", None)
        check_installed(Config(report_to=["mlflow"]))


def test_router_z_loss_by_hand():
    from moe8.finetune.routing import router_z_loss

    a, b = torch.randn(5, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    want = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in torch.cat([a, b]).tolist()) / 8
    assert router_z_loss((a, b)).item() == pytest.approx(want, rel=1e-6)
    assert router_z_loss(None) is None


def test_tensorboard(tmp_path, capsys):
    pytest.importorskip("tensorboard", reason="report_to tensorboard needs the optional tensorboard package")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    argv = f"--output_dir {out} --steps 2 --micro_batch 2 --seq_len 32 --log_every 1 --no-progress --report_to tensorboard"
    assert main(argv.split() + ["--max_documents", "2000"]) == 0, capsys.readouterr()
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2] and "eval_loss" in acc.Tags()["scalars"]


def test_parquet_without_datasets_names_the_pip_command(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(FinetuneError, match=r"needs the datasets library: pip install 'datasets>=3'"):
        Data(Config(data=str(tmp_path / "d.parquet")), byte_tokenizer())


def test_attention_flops_by_hand():
    from transformers import AutoConfig

    from moe8.finetune.model import attention_flops, attention_layers

    config = AutoConfig.for_model(
        "gpt_oss", num_hidden_layers=2, num_attention_heads=4, head_dim=8, sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    layers = attention_layers(config)
    assert layers == [(6 * 4 * 16, 3), (6 * 4 * 16, None)]
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1]])  # two packed documents: 5 and 2 tokens
    keys_full = (1 + 2 + 3 + 4 + 5) + (1 + 2)
    keys_window = (1 + 2 + 3 + 3 + 3) + (1 + 2)
    assert attention_flops(layers, pos) == 384 * (keys_full + keys_window)
