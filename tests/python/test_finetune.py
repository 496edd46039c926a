"""`moe8 finetune` on CPU with the built-in tiny Qwen3-MoE model and the byte tokenizer: config files and flags,
the data formats (chat masking included), a full fine-tuning run whose output transformers loads, metrics and
report, resume after a kill reaching the uninterrupted run's weights, LoRA adapters PEFT loads, every bad input
(clear message, non-zero exit, no output directory) and the Trainer callback."""

import dataclasses
import importlib.util
import json
import math
import random
import re
import struct
import zlib
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0", reason="moe8 finetune needs transformers>=5")

from moe8 import cuda_available as moe8_cuda  # noqa: E402
from moe8 import finetune  # noqa: E402
from moe8.finetune import report, routing  # noqa: E402
from moe8.finetune.chat import tokenize_chat  # noqa: E402
from moe8.finetune.config import KEYS, Config, FinetuneError, make_config, validate  # noqa: E402
from moe8.finetune.data import IGNORE, Data, byte_tokenizer, shared  # noqa: E402
from moe8.finetune.train import lr_factor, run  # noqa: E402

HAS_LORA = importlib.util.find_spec("moe8.lora") is not None
QWEN3 = shared("tokenizers", "qwen3")


@pytest.fixture(autouse=True)
def _undo_moe8():
    """A run patches transformers (fused RoPE is process-wide): undone after each test, as a user's disable()."""
    yield
    from moe8 import hf

    hf.disable()


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = random.Random(0)
    words = "the cat a model routes every expert token data loss reads builds small big".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + "." for _ in range(600)]
    p = tmp_path_factory.mktemp("data") / "docs.txt"
    p.write_text("\n".join(lines) + "\n")
    return p


def chats(n=40):
    rng = random.Random(1)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append(
            [
                {"role": "system", "content": "You add numbers."},
                {"role": "user", "content": f"What is {a} plus {b}?"},
                {"role": "assistant", "content": f"{a} + {b} = {a + b}."},
                {"role": "user", "content": "Thanks!"},
                {"role": "assistant", "content": f"You are welcome ({i})."},
            ]
        )
    return out


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def flags(out, data, *extra):
    """6 steps of 2 x 32 tokens on the CPU (extra flags may say --device cuda); a metrics line every step, eval
    and checkpoint every 3."""
    small = (
        "--no-progress --steps 6 --micro_batch 2 --seq_len 32 --log_every 1 --eval_every 3 --eval_batches 2"
    )
    return [
        "--output_dir",
        str(out),
        "--data",
        str(data),
        *small.split(),
        "--save_every",
        "3",
        "--device",
        "cpu",
        *map(str, extra),
    ]


def finetune_rc(capsys, argv, **kw):
    rc = finetune.main(argv, **kw)
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


# ------------------------------------------------------------------------------------------------ config
def test_config_file_flags_and_defaults(tmp_path, capsys):
    p = tmp_path / "c.toml"
    p.write_text(
        'steps = 7\nlr = 0.01\nlora_targets = ["q_proj", "experts"]\nactivation_checkpointing = true\n'
    )
    cfg = make_config(str(p), {"steps": 9, "seq_len": 16})
    assert (cfg.steps, cfg.lr, cfg.seq_len, cfg.lora_targets) == (9, 0.01, 16, ["q_proj", "experts"])
    assert cfg.activation_checkpointing and cfg.micro_batch == Config().micro_batch
    rc, out = finetune_rc(
        capsys,
        [str(p), "--steps", "11", "--micro-batch", "3", "--no-activation-checkpointing", "--print_config"],
    )
    assert rc == 0
    for line in ("steps = 11", "micro_batch = 3", "lr = 0.01", "activation_checkpointing = false"):
        assert line in out.splitlines()
    again = tmp_path / "again.toml"  # the printed config reads back as the same config
    again.write_text(out)
    assert make_config(str(again)) == make_config(
        str(p), {"steps": 11, "micro_batch": 3, "activation_checkpointing": False}
    )
    assert make_config() == Config()  # no file, no flags: the defaults
    with pytest.raises(FinetuneError, match="unknown config keys: nope"):
        make_config(overrides={"nope": 1})


def test_help_and_docs_document_every_key():
    text = finetune.parser().format_help()
    docs = (Path(__file__).resolve().parents[2] / "docs" / "finetune.md").read_text()
    for name in KEYS:
        assert f"--{name}" in text and f"| `{name}` |" in docs


def test_cuda_graphs_key_and_flag(tmp_path, capsys):
    """cuda_graphs is true, false or "auto" in a file and as a flag (false by default; "auto" in the Qwen3-30B-A3B
    LoRA recipe, false in every other), printed back as TOML; any other value is refused naming the key, before
    anything is written."""
    from moe8.finetune import recipes
    from moe8.finetune.config import load_toml

    assert Config().cuda_graphs is False and make_config().cuda_graphs is False
    for name in recipes.names():
        want = "auto" if name == "qwen3_30b_a3b_lora" else False
        assert load_toml(str(recipes.path(name))).get("cuda_graphs", False) == want, name
    p = tmp_path / "c.toml"
    for toml, want in (("true", True), ("false", False), ('"auto"', "auto")):
        p.write_text(f"cuda_graphs = {toml}\n")
        got = make_config(str(p)).cuda_graphs
        assert got == want and type(got) is type(want), toml
    for flag, want, line in (
        (["--cuda_graphs", "auto"], "auto", 'cuda_graphs = "auto"'),
        (["--cuda-graphs", "true"], True, "cuda_graphs = true"),
        (["--cuda_graphs=false"], False, "cuda_graphs = false"),
        (["--cuda_graphs", "True"], True, "cuda_graphs = true"),
    ):
        rc, out = finetune_rc(
            capsys, [str(p), *flag, "--print_config"]
        )  # the flag overrides the file's "auto"
        assert rc == 0 and line in out.splitlines(), (flag, out)
        again = tmp_path / "again.toml"
        again.write_text(out)
        got = make_config(str(again)).cuda_graphs
        assert got == want and type(got) is type(want), flag
    for value in ("maybe", "1", "on", "AUTO"):
        out_dir = tmp_path / "out"
        rc, text = finetune_rc(capsys, ["--cuda_graphs", value, "--output_dir", str(out_dir)])
        assert rc == 2 and f"cuda_graphs = {value!r}: expected true, false or 'auto'" in text, text
        assert not out_dir.exists()
    with pytest.raises(FinetuneError, match=r"cuda_graphs = 'yes': expected true, false or 'auto'"):
        validate(Config(cuda_graphs="yes"))


def test_lora_dtype_key_and_flag(tmp_path, capsys):
    """lora_dtype is "auto" (the default), float32, bfloat16 or float16, in a file and as a flag, printed back as
    TOML; another value, or one other than "auto" without method lora, is refused naming the key, before
    anything is written."""
    assert Config().lora_dtype == "auto" and make_config().lora_dtype == "auto"
    p = tmp_path / "c.toml"
    for value in ("auto", "float32", "bfloat16", "float16"):
        p.write_text(f'method = "lora"\nlora_dtype = "{value}"\n')
        assert make_config(str(p)).lora_dtype == value
        flag = "float16" if value == "bfloat16" else "bfloat16"  # the flag overrides the file
        rc, out = finetune_rc(capsys, [str(p), "--lora-dtype", flag, "--print_config"])
        assert rc == 0 and f'lora_dtype = "{flag}"' in out.splitlines(), out
        again = tmp_path / "again.toml"
        again.write_text(out)
        assert make_config(str(again)).lora_dtype == flag
    for argv, message in (
        (["--method", "lora", "--lora_dtype", "bf16"], "lora_dtype = 'bf16': expected one of ['auto', "),
        (["--method", "lora", "--lora_dtype", "fp32"], "lora_dtype = 'fp32': expected one of"),
        (
            ["--lora_dtype", "bfloat16"],
            "lora_dtype = 'bfloat16': only with method = 'lora' (method = 'full')",
        ),
    ):
        out_dir = tmp_path / "out"
        rc, text = finetune_rc(capsys, [*argv, "--output_dir", str(out_dir)])
        assert rc == 2 and message in text, text
        assert not out_dir.exists()
    with pytest.raises(FinetuneError, match=r"lora_dtype = 'float64': expected one of"):
        validate(Config(method="lora", lora_dtype="float64"))
    p.write_text('adapter_dtype = "bfloat16"\n')  # another trainer's name for it
    with pytest.raises(FinetuneError, match=r"adapter_dtype \(did you mean lora_dtype\?\)"):
        make_config(str(p))


def test_cuda_graphs_decision():
    """true: capture or refuse, naming why; auto: capture where true would, else off with one log line; false:
    off, silently."""
    from moe8.finetune.cuda_graphs import unavailable, wanted

    gpu, cpu = torch.device("cuda"), torch.device("cpu")  # devices as names: nothing runs on them
    on = dict(activation_checkpointing=True)
    assert unavailable(Config(**on), gpu) is None
    for cfg, dev, why in (
        (Config(**on), cpu, "the model trains on cpu, and CUDA graphs need a CUDA device"),
        (Config(), gpu, "activation_checkpointing is off"),
        (Config(ep=2, **on), gpu, "ep = 2: the expert dispatch reads its token counts on the host"),
        (Config(fsdp=True, **on), gpu, "fsdp: FSDP2's hooks"),
    ):
        assert why in unavailable(cfg, dev)
        with pytest.raises(FinetuneError, match=re.escape(f"cuda_graphs = true: {why}")):
            wanted(dataclasses.replace(cfg, cuda_graphs=True), dev, print)
        logged = []
        assert wanted(dataclasses.replace(cfg, cuda_graphs="auto"), dev, logged.append) is False
        assert len(logged) == 1 and logged[0].startswith("cuda_graphs = 'auto': off, ") and why in logged[0]
        assert wanted(cfg, dev, logged.append) is False and len(logged) == 1  # false: nothing said
    for value, want in ((True, True), ("auto", True), (False, False)):
        logged = []
        assert wanted(Config(cuda_graphs=value, **on), gpu, logged.append) is want and not logged


def test_cuda_graphs_stats_line_and_report_row(tmp_path):
    from moe8.finetune.cuda_graphs import summary

    stats = dict(layers=2, captured=4, replayed=20, eager=2, reasons={"warming up": 2})
    stats.update(pool_reserved_gib=0.012, pool_allocated_gib=0.0)
    line = "2 layers, 4 graphs captured, 20 calls replayed, 2 eager (warming up: 2); memory pool 0.012 GiB"
    assert summary(stats) == line
    assert summary(dict(stats, eager=0, reasons={})).startswith(
        "2 layers, 4 graphs captured, 20 calls replayed, 0 eager;"
    )
    report.write(tmp_path / "r.html", [], dict(model="m", cuda_graphs=line))
    assert (
        f"<th style='text-align:left'>cuda graphs</th><td style='text-align:left'>{line}</td>"
        in (tmp_path / "r.html").read_text()
    )


def test_cuda_graphs_auto_on_cpu_trains_without_them(tmp_path, text_file, capsys):
    out = tmp_path / "auto"
    argv = flags(out, text_file, "--cuda_graphs", "auto", "--activation_checkpointing", "--steps", "2")
    rc, text = finetune_rc(capsys, argv)
    assert rc == 0 and (out / "model.safetensors").exists(), text
    assert (
        text.count("cuda_graphs = 'auto': off, the model trains on cpu, and CUDA graphs need a CUDA device")
        == 1
    )
    assert "cuda graphs:" not in text and "cuda graphs" not in (out / "report.html").read_text()
    assert 'cuda_graphs = "auto"' in (out / "finetune.toml").read_text().splitlines()


def test_cuda_graphs_true_on_cpu_is_refused_before_anything(tmp_path, text_file, capsys):
    out = tmp_path / "true"
    for extra, why in (
        (["--activation_checkpointing"], "the model trains on cpu, and CUDA graphs need a CUDA device"),
        ([], "the model trains on cpu"),  # the device is named first
    ):
        rc, text = finetune_rc(capsys, flags(out, text_file, "--cuda_graphs", "true", *extra))
        assert rc == 2 and f"moe8 finetune: error: cuda_graphs = true: {why}" in text, text
        assert "set cuda_graphs = 'auto' or false" in text
        assert not out.exists() and "moe8 finetune: tiny" not in text  # before the model was built


@pytest.mark.parametrize(
    "toml, message",
    [
        ("stepz = 3\nfoo = 1\n", "unknown config keys: foo, stepz (did you mean steps?)"),
        ('steps = "ten"\n', "steps = 'ten': expected int"),
        ("steps = 0\n", "steps = 0: expected a positive integer"),
        ('method = "qlora"\n', "method = 'qlora': expected one of ['full', 'lora']"),
        ("[lora]\nr = 4\n", "tables ['lora'] are not supported"),
        ("steps = = 3\n", "not valid TOML"),
        ('cuda_graphs = "yes"\n', "cuda_graphs = 'yes': expected true, false or 'auto'"),
        ("cuda_graphs = 1\n", "cuda_graphs = 1: expected true, false or 'auto'"),
    ],
)
def test_bad_config(tmp_path, capsys, toml, message):
    p = tmp_path / "c.toml"
    p.write_text(toml)
    out = tmp_path / "out"
    rc, text = finetune_rc(capsys, [str(p), "--output_dir", str(out)])
    assert rc == 2 and message in text and not out.exists()


# -------------------------------------------------------------------------------------------------- data
def test_text_formats(tmp_path, text_file):
    tok = byte_tokenizer()
    lines = text_file.read_text().splitlines()
    stream = dict(packing="stream")  # end to end, cut every seq_len tokens
    d = Data(Config(data=str(text_file), seq_len=32, micro_batch=2, eval_fraction=0.1, **stream), tok)
    assert d.kind == "text" and d.documents == len(lines)
    assert d.tokens == sum(len(x.encode()) + 1 for x in lines)  # bytes + one eos per document
    ids = torch.cat([d.train[0], d.eval[0]]).flatten().tolist()
    assert tok.decode(ids[: len(lines[0]) + 1]) == lines[0] + "<|im_end|>"
    x, y, pos = (t.flatten() for t in d.train)
    starts = torch.cat([torch.tensor([True]), x[:-1] == tok.eos_token_id])  # a document's first token
    assert (y[starts] == IGNORE).all() and torch.equal(x[~starts], y[~starts])  # loss on every other token
    assert (pos[starts] == 0).all() and (pos[::32] == 0).all()  # positions restart per document and row
    assert len(d.eval[0]) == round(d.tokens // 32 * 0.1)
    whole = Data(Config(data=str(text_file), data_format="text", seq_len=32, micro_batch=2, **stream), tok)
    assert whole.documents == 1 and whole.tokens == len(text_file.read_bytes()) + 1
    jl = write_jsonl(tmp_path / "t.jsonl", [{"text": x, "id": i} for i, x in enumerate(lines)])
    dj = Data(Config(data=str(jl), seq_len=32, micro_batch=2, eval_fraction=0.1, **stream), tok)
    assert dj.kind == "text" and torch.equal(dj.train[0], d.train[0])
    (tmp_path / "a.json").write_text(json.dumps([{"text": x} for x in lines], indent=1))  # one JSON array
    da = Data(
        Config(data=str(tmp_path / "a.json"), seq_len=32, micro_batch=2, eval_fraction=0.1, **stream), tok
    )
    assert torch.equal(da.train[0], d.train[0])
    limited = Data(Config(data=str(jl), seq_len=32, micro_batch=2, max_documents=100), tok)
    assert limited.documents == 100 and limited.tokens == sum(len(x.encode()) + 1 for x in lines[:100])
    other = write_jsonl(tmp_path / "o.jsonl", [{"body": x} for x in lines])
    assert Data(Config(data=str(other), text_field="body", seq_len=32, micro_batch=2), tok).tokens == d.tokens


def test_data_order_is_a_function_of_seed_and_position(text_file):
    tok = byte_tokenizer()
    a, b, c = (Data(Config(data=str(text_file), seq_len=32, micro_batch=3, seed=s), tok) for s in (0, 0, 1))
    for m in (5, 0, a.per_epoch + 2, 3):  # any order of calls, across epochs
        assert torch.equal(a.batch(m)[0], b.batch(m)[0])
    assert not torch.equal(a.batch(0)[0], c.batch(0)[0])
    epoch = torch.cat([a.batch(m)[0] for m in range(a.per_epoch)])  # an epoch visits distinct sequences
    assert len({tuple(r.tolist()) for r in epoch}) == len(epoch)


def assistant_runs(tok, ids, labels):
    runs, cur = [], []
    for t, label in zip(ids, labels):
        if label != IGNORE:
            assert label == t
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


@pytest.mark.parametrize(
    "tokenizer",
    [
        "byte",
        pytest.param(
            "qwen3", marks=pytest.mark.skipif(QWEN3 is None, reason="no ../shared/data/tokenizers/qwen3")
        ),
    ],
)
def test_chat_loss_only_on_assistant_tokens(tmp_path, tokenizer):
    from moe8.finetune.data import load_tokenizer

    tok = load_tokenizer(Config(tokenizer=tokenizer), None)
    chat = chats(1)[0]
    docs, stats = tokenize_chat(tok, chat)
    assert (stats.turns, stats.matched) == (2, 2)
    # Qwen3's template gives the reply being generated an (empty) think block and drops it from earlier
    # turns: the conversation is split there, each turn trained as the template renders it when generated
    think = "<think>\n\n</think>\n\n" if tokenizer == "qwen3" else ""
    assert len(docs) == (2 if think else 1) and stats.split == len(docs) - 1
    want = [think + m["content"] + "<|im_end|>" for m in chat if m["role"] == "assistant"]
    assert [r for ids, labels in docs for r in assistant_runs(tok, ids, labels)] == want
    assert all(tok.decode(ids).count("What is") == 1 for ids, _ in docs)  # the prompt, without loss
    jl = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in chats()])
    d = Data(Config(data=str(jl), tokenizer=tokenizer, seq_len=256, micro_batch=2, eval_fraction=0), tok)
    assert d.kind == "chat"
    ids, labels = d.train[0].flatten().tolist(), d.train[1].flatten().tolist()
    runs = assistant_runs(tok, ids, labels)
    assert runs[0] == want[0] and 0.1 < sum(x != IGNORE for x in labels) / len(labels) < 0.6


# ----------------------------------------------------------------------------------------------- training
def test_full_finetune_run(tmp_path, text_file, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    rc, text = finetune_rc(capsys, flags(out, text_file))
    assert rc == 0, text
    assert f"report: {out / 'report.html'}" in text and "experts on moe8" in text
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "qwen3_moe" and len(tok) == model.config.vocab_size == 260
    state = torch.load(out / "checkpoint-6" / "training_state.pt", weights_only=True)
    saved = load_file(out / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in state["model"].items() if k in saved)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]  # the last 2
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3, 4, 5, 6]
    assert [x["step"] for x in lines if "eval_loss" in x] == [0, 3, 6]
    assert lines[-1]["eval_loss"] < lines[0]["eval_loss"]
    for x in lines[1:]:
        assert {"loss", "lr", "tokens_per_s", "mfu", "memory_gib", "grad_norm", "routing"} <= set(x)
        assert x["mfu"] is None and x["memory_gib"] > 0 and x["tokens_per_s"] > 0
        assert sorted(x["routing"]) == ["model.layers.0.mlp", "model.layers.1.mlp"]
        for fractions in x["routing"].values():
            assert len(fractions) == 8 and abs(sum(fractions) - 1) < 1e-4
    html = (out / "report.html").read_text()
    for part in ("loss", "tokens / s", "MFU (%)", "memory (GiB", "Expert load per layer", "Routing health"):
        assert part in html
    assert html.count('<svg class="heat"') == 2 and html.count("data:image/png;base64,") == 2
    assert "model.layers.1.mlp" in html and "dead experts" in html
    # the output is a model directory moe8 finetune takes as its model (and tokenizer): training continues
    again = tmp_path / "again"
    rc, text = finetune_rc(capsys, flags(again, text_file, "--model", out))
    assert rc == 0 and f"moe8 finetune: {out} " in text and "experts on moe8" in text, text
    first = [json.loads(x) for x in (again / "metrics.jsonl").read_text().splitlines()][0]
    assert first["eval_loss"] == pytest.approx(lines[-1]["eval_loss"], rel=1e-5)


def test_default_run_quick(tmp_path, capsys):
    """`moe8 finetune` with no arguments, cut to 2 steps: built-in model and the built-in data source."""
    out = tmp_path / "default"
    rc, text = finetune_rc(
        capsys, ["--output_dir", str(out), "--steps", "2", "--no-progress", "--eval_batches", "1"]
    )
    assert rc == 0, text
    assert (out / "model.safetensors").exists() and (out / "report.html").exists()


def final_weights(out):
    from safetensors.torch import load_file

    return load_file(out / "model.safetensors")


def losses(out):
    return [
        (x["step"], x.get("loss"), x.get("eval_loss"))
        for x in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    ]


def test_resume_after_kill_matches_uninterrupted(tmp_path, text_file, capsys):
    extra = ["--steps", "7", "--save_every", "2", "--grad_accum", "2", "--seed", "3"]
    ref = tmp_path / "ref"
    assert finetune_rc(capsys, flags(ref, text_file, *extra))[0] == 0

    def kill_at_5(step, trainer):
        if step == 5:
            raise KeyboardInterrupt

    out = tmp_path / "killed"
    rc, text = finetune_rc(capsys, flags(out, text_file, *extra), on_step=kill_at_5)
    assert rc == 130 and "--resume" in text
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert not (out / "model.safetensors").exists()
    rc, text = finetune_rc(capsys, flags(out, text_file, *extra, "--resume"))
    assert rc == 0, text
    a, b = final_weights(ref), final_weights(out)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)
    assert losses(out) == losses(ref)
    # run_steps: stop with a checkpoint after 3 steps, resume to the end
    out2 = tmp_path / "sliced"
    rc, text = finetune_rc(capsys, flags(out2, text_file, *extra, "--run_steps", "3"))
    assert rc == 0 and "stopped at step 3 of 7" in text and (out2 / "checkpoint-3").exists()
    assert finetune_rc(capsys, flags(out2, text_file, *extra, "--resume"))[0] == 0
    for k, v in final_weights(out2).items():
        torch.testing.assert_close(v, a[k], rtol=0, atol=1e-6)
    rc, text = finetune_rc(capsys, flags(out2, text_file, *extra, "--seq_len", "16", "--resume"))
    assert rc == 2 and "seq_len: 32 -> 16" in text


@pytest.mark.skipif(not HAS_LORA, reason="moe8.lora is not there yet")
@pytest.mark.filterwarnings("ignore:Unsupported layer type")  # PEFT on the fused experts' target_parameters
def test_lora_adapter_loads_in_peft(tmp_path, text_file, capsys):
    peft = pytest.importorskip("peft", minversion="0.17", reason="expert LoRA adapters need peft>=0.17")
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    small = dict(steps=4, micro_batch=2, seq_len=32, progress=False, lora_r=4, eval_every=0, device="cpu")
    cfg = make_config(overrides=dict(small, output_dir=str(out), data=str(text_file), method="lora"))
    trainer = run(cfg, log=lambda *a: None)
    assert (out / "adapter_config.json").exists() and not (out / "model.safetensors").exists()
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all("lora" in n for n in trained)
    base = AutoModelForCausalLM.from_pretrained(out / "base_model")
    loaded = peft.PeftModel.from_pretrained(base, out)
    x = trainer.data.eval[0][:2].long()
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=x).logits, trainer.model(input_ids=x).logits, rtol=1e-4, atol=1e-4
        )


@pytest.mark.filterwarnings("ignore:Unsupported layer type")  # PEFT on the fused experts' target_parameters
def test_lora_bf16_adapters_run_save_and_load_back(tmp_path, text_file, capsys):
    """lora_dtype bfloat16 on the CPU (an fp32 model): every adapter, its gradient and its AdamW states in bf16
    (no fp32 master copies), the loss goes down, the adapter is written in bf16 and loads back (moe8 and PEFT)
    with the trained model's logits; --no-moe8 gives PEFT's adapters the same dtype."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from moe8.lora import load_adapter

    out = tmp_path / "lora"
    small = dict(steps=8, micro_batch=2, seq_len=32, progress=False, lora_r=4, eval_every=0, device="cpu")
    small.update(data=str(text_file), method="lora", lora_dtype="bfloat16", log_every=1, lr=1e-2)
    trainer = run(make_config(overrides=dict(small, output_dir=str(out))), log=lambda *a: None)
    trained = dict(zip(trainer.names, trainer.params))
    assert trained and all(p.dtype == torch.bfloat16 for p in trained.values())
    assert all(
        m is p for m, p in zip(trainer.master, trainer.params)
    )  # AdamW updates the adapters themselves
    states = [t for st in trainer.opt.state.values() for k, t in st.items() if k != "step"]
    assert states and all(t.dtype == torch.bfloat16 for t in states)
    steps = [loss for _, loss, _ in losses(out) if loss is not None]
    assert len(steps) == 8 and max(steps[-3:]) < steps[0] - 0.1, steps
    saved = load_file(str(out / "adapter_model.safetensors"))
    assert saved and {t.dtype for t in saved.values()} == {torch.bfloat16}
    x = trainer.data.eval[0][:2].long()
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model(input_ids=x).logits
    back = load_adapter(AutoModelForCausalLM.from_pretrained(out / "base_model"), out, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=x).logits, want, rtol=0, atol=0)
    peft = pytest.importorskip("peft", minversion="0.17", reason="expert LoRA adapters need peft>=0.17")
    from moe8 import hf

    hf.disable()
    baseline = tmp_path / "peft"
    cfg = make_config(overrides=dict(small, steps=2, moe8=False, output_dir=str(baseline)))
    peft_trainer = run(cfg, log=lambda *a: None)
    assert isinstance(peft_trainer.model, peft.PeftModel)
    assert {p.dtype for p in peft_trainer.params} == {torch.bfloat16}
    assert {t.dtype for t in load_file(str(baseline / "adapter_model.safetensors")).values()} == {
        torch.bfloat16
    }


@pytest.mark.skipif(not HAS_LORA, reason="moe8.lora is not there yet")
def test_lora_resume_with_dropout(tmp_path, text_file, capsys):
    """LoRA dropout draws from the RNG: the resumed run matches only if the checkpoint restored its state."""
    from safetensors.torch import load_file

    extra = "--method lora --lora_r 4 --lora_dropout 0.2 --steps 5 --save_every 2".split()
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert finetune_rc(capsys, flags(ref, text_file, *extra))[0] == 0

    def kill_at_3(step, trainer):
        if step == 3:
            raise KeyboardInterrupt

    assert finetune_rc(capsys, flags(out, text_file, *extra), on_step=kill_at_3)[0] == 130
    torch.manual_seed(123)  # whatever the RNG holds now must not matter
    assert finetune_rc(capsys, flags(out, text_file, *extra, "--resume"))[0] == 0
    a, b = load_file(ref / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------ bad input
def bad_inputs(tmp_path, text_file):
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00bad")
    write_jsonl(tmp_path / "nofield.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    write_jsonl(tmp_path / "partial.jsonl", [{"text": "a"}, {"other": "b"}])
    (tmp_path / "empty.jsonl").write_text("")
    write_jsonl(tmp_path / "noasst.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    return {
        "missing data": (["--data", tmp_path / "nope.txt"], "data: file not found"),
        "unreadable data": (["--data", tmp_path / "binary.txt"], "data: cannot read"),
        "data is a directory": (["--data", tmp_path], "data: cannot read"),
        "missing model": (["--model", tmp_path / "nomodel"], "is neither a directory nor a built-in model"),
        "not moe": (["--model", llama], "'llama' model, not an MoE family moe8 supports (mixtral, qwen2_moe"),
        "seq_len too long": (
            ["--seq_len", 5000],
            "seq_len = 5000 is over the model's max_position_embeddings (4096)",
        ),
        "no field": (
            ["--data", tmp_path / "nofield.jsonl"],
            "has the keys ['prompt'], which match none of the formats known: text",
        ),
        "partial field": (
            ["--data", tmp_path / "partial.jsonl"],
            "record 2 (text format): field 'text' is missing",
        ),
        "empty jsonl": (["--data", tmp_path / "empty.jsonl"], "empty dataset"),
        "empty text": (["--data", tmp_path / "empty.txt"], "empty dataset"),
        "no assistant": (["--data", tmp_path / "noasst.jsonl"], "no assistant tokens"),
        "too little data": (["--seq_len", 4000, "--micro_batch", 8], "the training split"),
        "missing config": ([tmp_path / "nope.toml"], "config file not found"),
        "bad tokenizer": (["--tokenizer", tmp_path / "notok"], "tokenizer: "),
        "resume nothing": (["--resume"], "resume: no checkpoint in"),
    }


BAD = [
    "missing data",
    "unreadable data",
    "data is a directory",
    "missing model",
    "not moe",
    "seq_len too long",
    "no field",
    "partial field",
    "empty jsonl",
    "empty text",
    "no assistant",
    "too little data",
    "missing config",
    "bad tokenizer",
    "resume nothing",
]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_clear_message_nothing_written(tmp_path, text_file, capsys, case):
    argv, message = bad_inputs(tmp_path, text_file)[case]
    out = tmp_path / "out"
    rc, text = finetune_rc(capsys, flags(out, text_file) + [str(a) for a in argv])
    assert rc == 2 and "moe8 finetune: error:" in text and message in text, text
    assert not out.exists()


def test_existing_output_dir_is_kept(tmp_path, text_file, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep")
    rc, text = finetune_rc(capsys, flags(out, text_file))
    assert rc == 2 and "--resume continues it, --overwrite replaces it" in text
    assert [p.name for p in out.iterdir()] == ["precious.txt"]


def test_out_of_memory_hints_and_cleanup(tmp_path, text_file, capsys):
    def oom(step, trainer):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    out = tmp_path / "out"
    rc, text = finetune_rc(capsys, flags(out, text_file), on_step=oom)
    assert rc == 1 and "CUDA out of memory" in text
    for hint in ("--micro_batch", "--activation_checkpointing", "--method lora"):
        assert hint in text
    assert not out.exists()


# -------------------------------------------------------------------------------------------------- routing
def tiny_model(**over):
    from moe8.finetune.model import build_model, model_config

    cfg = Config(progress=False, **over)
    config, path = model_config(cfg)
    model, _ = build_model(cfg, config, path, byte_tokenizer(), torch.float32, torch.device("cpu"), print)
    return model


def record_router_ids(model) -> dict:
    """{experts' layer name: [ids [T, K] of each router call]}, filled by hooks on the routers."""
    seen = {}

    def record(name):  # a router returns (logits [T, E], weights [T, K], ids [T, K])
        return lambda mod, args, out: seen.setdefault(name, []).append(out[2])

    for name, m in model.named_modules():
        if name.endswith("mlp.gate"):
            m.register_forward_hook(record(name.removesuffix(".gate")))
    return seen


@pytest.mark.parametrize("checkpointing", [False, True])
def test_routing_stats_count_each_token_once(checkpointing):
    """Counts equal the routers' own top-k, once per training forward: not in eval, not in the recompute of
    activation checkpointing."""
    model = tiny_model(activation_checkpointing=checkpointing)
    stats = routing.RoutingStats(model)
    seen = record_router_ids(model)
    x = torch.randint(0, 256, (3, 17))
    model.train()
    model(input_ids=x).logits.sum().backward()
    model.eval()
    with torch.no_grad():
        model(input_ids=x)
    got = stats.take()
    assert sorted(got) == sorted(seen) and len(got) == 2
    for name, ids in seen.items():
        counts = torch.bincount(ids[0].flatten(), minlength=8).double()
        assert got[name] == pytest.approx((counts / counts.sum()).tolist(), abs=1e-6)
    assert stats.take() == {}  # take() starts a new window


def test_routing_stats_count_reruns_once_as_graphs_replay_them():
    """moe8.graphs runs a layer again on the same tokens (its capture's warm-up, its backward graph's
    recomputation, also after the forward) and replays what the hooks queued without calling them: the hooks
    say they replay, a layer run twice in a forward is counted once, and a run after a forward (of another
    token count) is not counted in the next one."""
    model = tiny_model()
    stats = routing.RoutingStats(model)
    layers = [m for _, m in model.named_modules() if type(m).__name__.endswith("DecoderLayer")]
    hooks = [
        h
        for layer in layers
        for m in layer.modules()
        for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())
        if getattr(h, "__module__", None) != "transformers.utils.output_capturing"  # idle recorders
    ]
    assert len(hooks) == len(layers) == 2 and all(getattr(h, "replay_safe", False) for h in hooks)
    seen = record_router_ids(model)
    experts = dict(routing.experts_modules(model))
    first = next(iter(experts))

    def twice(mod, args, kwargs, out):  # the layer's experts run again on the same tokens
        if not getattr(mod, "again", False):
            mod.again = True
            mod(*args, **kwargs)
            mod.again = False

    model.train()
    rerun = experts[first].register_forward_hook(twice, with_kwargs=True)
    model(input_ids=torch.randint(0, 256, (3, 17))).logits.sum().backward()
    rerun.remove()
    H = model.config.hidden_size
    with torch.no_grad():  # after the forward: a run of 5 tokens (a replayed recomputation of that shape)
        experts[first](torch.randn(5, H), torch.zeros(5, 2, dtype=torch.long), torch.full((5, 2), 0.5))
    model(input_ids=torch.randint(0, 256, (2, 9))).logits.sum().backward()
    got = stats.take()
    assert sorted(got) == sorted(seen) and all(len(ids) == 2 for ids in seen.values())
    for name, ids in seen.items():
        counts = sum(torch.bincount(i.flatten(), minlength=8) for i in ids).double()
        assert got[name] == pytest.approx((counts / counts.sum()).tolist(), abs=1e-6), name
    assert stats.take() == {}
    stats.remove()  # its hooks gone: nothing counted
    model(input_ids=torch.randint(0, 256, (2, 9)))
    assert stats.take() == {} and all(c.sum() == 0 for c in stats.counts.values())


def test_health_and_report_heatmap(tmp_path):
    hist = [dict(step=0, eval_loss=3.0)]
    line = dict(lr=1e-3, tokens_per_s=100.0, mfu=None, memory_gib=1.0, grad_norm=1.0)
    for s in range(1, 11):  # expert 3 gets no token after step 4
        frac = [0.5, 0.3, 0.2, 0.0] if s > 4 else [0.25] * 4
        hist.append(dict(line, step=s, loss=3 - s / 10, routing={"layers.0": frac}))
    h = routing.health(hist, dead_window=5)["layers.0"]
    assert h["dead"] == [3] and h["imbalance"] == h["max_imbalance"] == pytest.approx(2.0)
    assert routing.health(hist, dead_window=20)["layers.0"]["dead"] == []  # expert 3 had tokens early on
    report.write(tmp_path / "r.html", hist, dict(model="m", steps=10), dead_window=5)
    html = (tmp_path / "r.html").read_text()
    assert "MFU (%): not measured" in html and "1 of 4" in html and "<polyline" in html
    png = report.png([bytes([1, 2, 3, 4, 5, 6]), bytes([7, 8, 9, 10, 11, 12])])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (2, 2)
    n = struct.unpack(">I", png[33:37])[0]
    assert zlib.decompress(png[41 : 41 + n]) == b"\x00\x01\x02\x03\x04\x05\x06\x00\x07\x08\x09\x0a\x0b\x0c"


def test_lr_schedule():
    f = [lr_factor(s, 10, 100, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == 1.0 and f[10] == 1.0
    assert all(a >= b for a, b in zip(f[10:], f[11:])) and f[-1] == pytest.approx(0.1, abs=1e-3)


def test_trainer_callback_collects_routing(tmp_path):
    from transformers import Trainer, TrainingArguments

    from moe8.finetune import RoutingStatsCallback

    model = tiny_model()
    ids = torch.randint(0, 256, (8, 16))
    ds = [dict(input_ids=r, labels=r) for r in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        logging_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    cb = RoutingStatsCallback()
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train()
    assert [x["step"] for x in cb.history] == [1, 2]
    for x in cb.history:
        assert len(x["routing"]) == 2 and all(abs(sum(f) - 1) < 1e-4 for f in x["routing"].values())
    lines = [json.loads(x) for x in (tmp_path / "routing.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and "routing/max_imbalance" in lines[0]
    report.write(tmp_path / "r.html", cb.history)  # the report draws the callback's lines too
    assert (tmp_path / "r.html").read_text().count('<svg class="heat"') == 2
    logged = [x for x in trainer.state.log_history if "routing/max_imbalance" in x]
    assert len(logged) == 2 and all(x["routing/max_imbalance"] >= 1 for x in logged)


@pytest.mark.skipif(not (torch.cuda.is_available() and moe8_cuda()), reason="needs a CUDA GPU and moe8 CUDA")
@pytest.mark.parametrize("method", ["full", "lora"])
def test_cuda_bf16_run(tmp_path, text_file, capsys, method):
    """On the GPU: bf16 by default, the loss falls, MFU and GPU memory are reported."""
    out = tmp_path / method
    rc, text = finetune_rc(capsys, flags(out, text_file, "--method", method, "--device", "cuda"))
    assert rc == 0, text
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["eval_loss"] < lines[0]["eval_loss"]
    for x in lines[1:]:
        assert x["mfu"] is not None and x["mfu"] > 0 and x["memory_gib"] > 0
    assert "bfloat16" in text


@pytest.mark.skipif(not (torch.cuda.is_available() and moe8_cuda()), reason="needs a CUDA GPU and moe8 CUDA")
@pytest.mark.parametrize("method", ["full", "lora"])
def test_cuda_graphs_run(tmp_path, text_file, method):
    """cuda_graphs = true on the GPU (the router losses off: recorded router logits run eagerly): the
    checkpointed layers replay, the stats are logged and in the report, every step's routing is counted, the
    losses follow the run without graphs, and the model is back on transformers' checkpointing after."""
    from moe8 import graphs

    def train(out, cuda_graphs):
        logged = []
        cfg = make_config(
            None,
            dict(
                output_dir=str(out),
                data=str(text_file),
                progress=False,
                steps=6,
                micro_batch=2,
                seq_len=32,
                log_every=1,
                eval_every=3,
                eval_batches=2,
                save_every=3,
                device="cuda",
                method=method,
                activation_checkpointing=True,
                aux_loss_coef=0.0,
                cuda_graphs=cuda_graphs,
            ),
        )
        trainer = run(cfg, log=logged.append)
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return trainer, "\n".join(map(str, logged)), lines

    trainer, text, lines = train(tmp_path / "graphs", True)
    s = trainer.graph_stats
    assert s["layers"] == 2 and s["captured"] >= 4 and s["replayed"] > 0, s
    assert f"cuda graphs: 2 layers, {s['captured']} graphs captured, {s['replayed']} calls replayed" in text
    assert "<th style='text-align:left'>cuda graphs</th>" in (tmp_path / "graphs" / "report.html").read_text()
    assert s["pool_allocated_gib"] == 0  # the routing statistics' buffers are made before a capture
    assert graphs.stats(trainer.model)["layers"] == 0  # released
    for x in lines[1:]:
        for fractions in x["routing"].values():
            assert abs(sum(fractions) - 1) < 1e-4, x["step"]
    _, _, eager = train(tmp_path / "eager", False)
    for a, b in zip(lines, eager):
        for k in ("loss", "eval_loss"):
            if k in b:
                assert a[k] == pytest.approx(b[k], rel=2e-2), (k, a["step"])


def test_lora_without_moe8_runs_peft(tmp_path, text_file, capsys):
    """--method lora --no-moe8 is the comparison baseline: PEFT's LoRA on transformers' experts."""
    pytest.importorskip("peft", minversion="0.17", reason="expert LoRA through PEFT needs peft>=0.17")
    out = tmp_path / "peft"
    rc, text = finetune_rc(capsys, flags(out, text_file, "--method", "lora", "--no-moe8", "--lora_r", "4"))
    assert rc == 0, text
    assert "experts on transformers" in text
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(config["target_modules"])


def test_fp8_full_finetune_runs_and_is_checked(tmp_path, text_file, capsys):
    """--fp8 blockwise runs the experts' GEMMs in FP8 (loss still falls), with LoRA too (the adapter saved in
    PEFT format); with --no-moe8 it is refused before anything is written."""
    out = tmp_path / "fp8"
    rc, text = finetune_rc(capsys, flags(out, text_file, "--fp8", "blockwise", "--lr", "0.003"))
    assert rc == 0, text
    assert "experts on moe8 (FP8 blockwise)" in text
    losses = [
        json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x
    ]
    assert losses[-1] < losses[0]
    lora = tmp_path / "lora"
    rc, text = finetune_rc(capsys, flags(lora, text_file, "--fp8", "blockwise", "--method", "lora"))
    assert rc == 0 and "experts on moe8 (FP8 blockwise)" in text, text
    frozen = re.search(r"lora: (\d+) frozen base weights held in FP8 \(blockwise\) only", text)
    assert frozen and int(frozen[1]) > 0, text  # LoRA over FP8 base weights
    assert json.loads((lora / "adapter_config.json").read_text())["peft_type"] == "LORA"
    lora_losses = [
        json.loads(x)["loss"] for x in (lora / "metrics.jsonl").read_text().splitlines() if '"loss"' in x
    ]
    assert all(math.isfinite(x) for x in lora_losses)
    auto = tmp_path / "auto"  # auto: FP8 where the shape pays (none of the toy's), the bases kept as they are
    rc, text = finetune_rc(capsys, flags(auto, text_file, "--fp8", "auto", "--method", "lora"))
    assert rc == 0 and "experts on moe8 (FP8 auto)" in text and "frozen base weights" not in text, text
    auto_losses = [
        json.loads(x)["loss"] for x in (auto / "metrics.jsonl").read_text().splitlines() if '"loss"' in x
    ]
    assert all(math.isfinite(x) for x in auto_losses)
    bad = tmp_path / "no-moe8"
    rc, text = finetune_rc(capsys, flags(bad, text_file, "--fp8", "blockwise", "--no-moe8"))
    assert rc != 0 and "drop --no-moe8" in text and not bad.exists()
    rc, text = finetune_rc(capsys, flags(tmp_path / "x", text_file, "--fp8", "e5m2"))
    assert rc != 0 and "fp8 = 'e5m2': expected one of" in text
