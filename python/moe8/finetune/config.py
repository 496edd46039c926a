"""The `moe8 finetune` configuration: one flat TOML table. Every key is also a command-line flag
(`--micro_batch 4` or `--micro-batch 4`); flags override the file, the file overrides the defaults.
The defaults are a quick run on a built-in tiny model, so `moe8 finetune` alone trains something."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import typing
from dataclasses import dataclass, field
from typing import List, Optional, Union


class FinetuneError(Exception):
    """Bad input: printed as one clear message, exit status 2, nothing written."""


class DivergedError(Exception):
    """The loss became non-finite during training: the run stops (exit status 3), keeping the last checkpoint
    (written before the divergence), metrics.jsonl and report.html."""


def _key(default, help: str):
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # model and data
    model: str = _key(
        "tiny-qwen3-moe",
        "a local Hugging Face model directory (config.json + weights) of a supported MoE family, a Hugging Face "
        "model id (ORG/NAME: from the local cache, else downloaded; HF_HUB_CACHE, HF_HUB_OFFLINE apply), or a "
        "built-in model with random weights: tiny-qwen3-moe, tiny-mixtral, tiny-olmoe (for trying things out) or "
        "qwen3-moe-1b (Qwen3-30B-A3B proportions, ~1B parameters with the qwen3 tokenizer)",
    )
    model_config: str = _key(
        "",
        "build the model with random weights from a transformers config instead of loading one (for measuring; "
        "a LoRA run then writes the adapter without its random base): a model type (qwen3_moe: its config "
        "class's defaults), a recipe's model config by name (moe8 recipes: qwen3_30b_a3b, deepseek_v3_reduced, "
        '...), a config.json path, or inline JSON ({"model_type": "mixtral", "num_local_experts": 8}); model '
        "then only names the run",
    )
    num_layers: int = _key(0, "with model_config: this many decoder layers instead of the config's (0: keep)")
    tokenizer: str = _key(
        "auto",
        "auto: the model directory's tokenizer (a built-in model: byte); byte: moe8's byte-level tokenizer "
        "(256 bytes + 4 specials, ChatML chat template); qwen3: tokenizers/qwen3 of the shared data folder "
        "($MOE8_SHARED_DATA, or ../shared/data beside a source checkout); or a directory",
    )
    data: str = _key(
        "auto",
        "training data: a text file (.txt), a JSONL / JSON file, or (with the datasets library) a csv, parquet "
        "or arrow file, of records in one of the formats (see format); .txt, .jsonl, .json and .csv files may be "
        "gzip, bz2, xz or zstd compressed (.gz, .bz2, .xz, .zst; zstd needs the zstandard module); or a Hugging "
        "Face dataset id (ORG/NAME: its train file, from the local cache, else downloaded); auto: the "
        "first 20,000 lines of "
        "text/sentences.txt of the shared data folder ($MOE8_SHARED_DATA, or ../shared/data beside a source "
        "checkout) when present, else generated sentences",
    )
    eval_data: str = _key(
        "",
        "a separate evaluation file (read like data), or a Hugging Face dataset id (its validation or test "
        "file); empty: hold out eval_fraction of the training data",
    )
    data_format: str = _key(
        "auto",
        "auto (by the suffix before any .gz/.bz2/.xz/.zst: .txt: lines, .jsonl/.json: jsonl, .csv, .parquet, "
        ".arrow; another suffix is refused), lines (one document per line), text (the whole file is one "
        "document), jsonl (one JSON object per line, or one JSON array), csv (a header row names the columns), "
        "parquet, arrow (these three through the datasets library)",
    )
    format: str = _key(
        "auto",
        "the records' format: auto (detected from the first record's keys), text (text_field), messages "
        "(messages_field: [{role, content, reasoning_content?}]), alpaca (instruction, input, output, system), "
        "sharegpt (conversations: [{from: human/gpt/system, value}])",
    )
    text_field: str = _key("text", "JSONL field holding a document's text")
    messages_field: str = _key(
        "messages",
        "JSONL field holding a chat: a list of {role, content}; rendered with the tokenizer's chat template, "
        "loss on the assistant turns only",
    )
    max_documents: int = _key(0, "read at most this many documents (0: all)")
    eval_fraction: float = _key(
        0.05, "share of the packed sequences held out for evaluation, without eval_data (0: none)"
    )
    eval_every: int = _key(50, "evaluate every N steps (and at the start and the end; 0: start and end only)")
    eval_batches: int = _key(8, "micro-batches per evaluation (0: the whole eval split)")
    # training
    method: str = _key("full", "full (every parameter) or lora (moe8.lora: attention and experts)")
    lora_r: int = _key(16, "LoRA rank")
    lora_alpha: float = _key(32.0, "LoRA alpha (scaling alpha / r)")
    lora_dropout: float = _key(0.0, "dropout on the LoRA branches' input")
    lora_targets: List[str] = _key(
        [],
        "layers LoRA adapts (comma-separated on the command line); empty: q_proj,k_proj,v_proj,o_proj,experts",
    )
    lora_dtype: str = _key(
        "auto",
        "the LoRA adapters' dtype, and so their gradients' and AdamW states': auto (fp32 under a 16-bit model, "
        "as PEFT keeps them), float32, bfloat16 or float16 (the adapters' GEMMs at the 16-bit base's speed, "
        "half the bytes, no fp32 master copies; float16 has no loss scaling); method lora only",
    )
    steps: int = _key(200, "optimizer steps")
    epochs: float = _key(0.0, "when > 0: train this many passes over the training split (sets steps)")
    run_steps: int = _key(
        0, "stop this run after N steps with a checkpoint (0: run to the end); continue later with --resume"
    )
    micro_batch: int = _key(8, "sequences per forward/backward")
    grad_accum: int = _key(1, "micro-batches per optimizer step")
    seq_len: int = _key(128, "tokens per sequence, at least 2 (documents are packed, see packing)")
    packing: str = _key(
        "documents",
        "documents: each document or conversation whole in one sequence (best-fit decreasing, the rest padded "
        "without loss; one longer than seq_len is cut at seq_len, a conversation left without an assistant "
        "token is dropped); stream: documents end to end, cut every seq_len tokens, no padding (for "
        "pretraining-style text: a document may continue in the next sequence without its start)",
    )
    lr: Optional[float] = _key(
        None,
        "peak learning rate (default: 3e-3 for the tiny built-in models, 1e-3 for qwen3-moe-1b, 2e-4 for lora, 2e-5 for full)",
    )
    weight_decay: float = _key(0.01, "AdamW weight decay (matrices only, not norms and biases)")
    warmup_steps: Optional[int] = _key(None, "linear warmup steps (default: 5%% of steps)")
    min_lr_ratio: float = _key(0.1, "cosine decay ends at lr * min_lr_ratio")
    max_grad_norm: float = _key(1.0, "clip the gradient norm to this (0: no clipping)")
    aux_loss_coef: Optional[float] = _key(
        None, "weight of the router load-balancing loss (default: the model's router_aux_loss_coef; 0: off)"
    )
    router_z_loss_coef: float = _key(
        0.0, "weight of the router z-loss, mean over tokens of logsumexp(router logits)^2 per layer (0: off)"
    )
    activation_checkpointing: bool = _key(False, "recompute activations in the backward (less memory)")
    cuda_graphs: Union[bool, str] = _key(
        False,
        "replay each checkpointed decoder layer's forward, and its recomputation with its backward, as CUDA "
        "graphs (moe8.graphs: the host no longer issues their kernels one by one): true (refused where graphs "
        "cannot run: no CUDA device, activation_checkpointing off, ep > 1 or fsdp), auto (on where they can, "
        "else off and the log says why) or false",
    )
    dtype: str = _key("auto", "auto (bf16 on GPU, fp32 on CPU), bf16 or fp32")
    device: str = _key("auto", "auto (cuda when available), cuda or cpu")
    seed: int = _key(0, "seed of the initialisation, the data order and dropout")
    moe8: bool = _key(
        True,
        "run the experts on moe8 (--no-moe8: transformers' own experts and, with lora, PEFT's LoRA, for comparison)",
    )
    fp8: str = _key(
        "none",
        "FP8 expert GEMMs (moe8.fp8): none, blockwise, rowwise, tensorwise (forward in FP8, backward bf16) or "
        "auto (blockwise where the GEMM's shape makes FP8 pay, bf16 elsewhere); on moe8 only; with lora and "
        "blockwise the frozen base weights (attention and experts) are held in FP8 only (LoRA over FP8 base "
        "weights: half their bytes)",
    )
    fuse_attention: bool = _key(
        True,
        "attention with sinks (gpt-oss) through PyTorch's fused SDPA kernels instead of transformers' eager "
        "path: no S x S scores per layer (moe8.attention; on moe8 only)",
    )
    # parallelism (under torchrun)
    ep: int = _key(
        1,
        "expert-parallel group size: the experts of every MoE layer are split over ep ranks (moe8.parallel); "
        "the world size (torchrun's WORLD_SIZE) must be a multiple of it; 1: plain data parallelism",
    )
    transport: str = _key(
        "auto",
        "how token rows move between the ep ranks: auto (ipc on CUDA within one node, else nccl), nccl or ipc",
    )
    fsdp: bool = _key(False, "shard the dense parameters with FSDP2 (moe8.parallel.apply_fsdp)")
    # output
    output_dir: str = _key("", "where everything goes (default: runs/finetune-YYYYmmdd-HHMMSS)")
    resume: bool = _key(
        False,
        "continue from the last checkpoint in output_dir (an unreadable one: the one before); refused when the "
        "data differs from the checkpoint's (see allow_data_change)",
    )
    allow_data_change: bool = _key(
        False,
        "with resume: continue although the data (file path, size, head and tail, tokenizer or token count) "
        "differs from the checkpoint's; the batches are then not those of an uninterrupted run",
    )
    overwrite: bool = _key(False, "replace an existing output_dir")
    save_every: int = _key(100, "write a checkpoint every N steps (and at the end; 0: at the end only)")
    keep_checkpoints: int = _key(2, "keep the last N checkpoints (older ones are removed)")
    log_every: int = _key(5, "append a line to metrics.jsonl every N steps")
    dead_window: int = _key(50, "an expert that got no token over this many last steps is reported dead")
    peak_tflops: Optional[float] = _key(
        None, "peak TFLOP/s for MFU (default: 989 on H100/H200, bf16 dense; else MFU is not reported)"
    )
    progress: bool = _key(
        True,
        "a progress bar when stdout and stderr are a terminal; otherwise (a log file, a pipe) and with "
        "--no-progress: one plain line per logged step (step, loss, eval loss, lr, tokens/s, MFU, ETA)",
    )
    report_to: List[str] = _key(
        [], "also log to these (comma-separated): tensorboard (output_dir/tensorboard), wandb, mlflow"
    )
    memory_check: bool = _key(
        True,
        "estimate the peak GPU memory from the config before loading and stop when it cannot fit "
        "(--no-memory-check: run anyway)",
    )


REPORT_TO = ("tensorboard", "wandb", "mlflow")
# lora_dtype's values: "auto" or the name of a torch dtype (moe8.finetune.model.adapter_dtype)
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")
BOOL_OR_AUTO = Union[bool, str]  # the type of a key that is true, false or "auto"
KEYS = {f.name: f for f in dataclasses.fields(Config)}
_TYPES = typing.get_type_hints(Config)
# keys a resumed run may change: how long it runs, where it writes, how it logs, evaluates and saves, and
# activation checkpointing, CUDA graphs and fused attention (the same gradients to rounding, less memory or
# time); every other key decides the model, the data,
# the optimizer or its schedule, so --resume refuses a value other than the checkpoint's
RESUME_MAY_CHANGE = frozenset(
    (
        "steps epochs run_steps output_dir resume overwrite save_every log_every eval_every eval_batches "
        "dead_window peak_tflops progress report_to memory_check activation_checkpointing cuda_graphs "
        "fuse_attention keep_checkpoints allow_data_change"
    ).split()
)


def _base_type(name: str):
    t = _TYPES[name]
    if typing.get_origin(t) is typing.Union and type(None) in typing.get_args(t):  # Optional[X]
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return list if typing.get_origin(t) in (list, List) else t


def _check_type(name: str, value, where: str):
    t = _base_type(name)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        list: isinstance(value, list) and all(isinstance(v, str) for v in value),
        BOOL_OR_AUTO: isinstance(value, (bool, str)),  # a word other than "auto": validate() names it
    }[t]
    if not ok:
        want = {list: "a list of strings", BOOL_OR_AUTO: "true, false or 'auto'"}.get(t) or t.__name__
        raise FinetuneError(f"{where}: {name} = {value!r}: expected {want}")
    return float(value) if t is float else value


# the names other trainers (transformers' TrainingArguments, PEFT, TRL, axolotl) give these keys
ALIASES = {
    "lr": "learning_rate",
    "micro_batch": "batch_size per_device_train_batch_size train_batch_size micro_batch_size bs",
    "grad_accum": "gradient_accumulation_steps gradient_accumulation accumulation_steps",
    "steps": "max_steps num_steps train_steps total_steps iters max_iters",
    "epochs": "num_train_epochs num_epochs epoch",
    "seq_len": "max_seq_length max_seq_len max_length sequence_len sequence_length seq_length block_size "
    "context_length cutoff_len",
    "warmup_steps": "warmup num_warmup_steps warmup_ratio",
    "min_lr_ratio": "min_lr min_lr_rate final_lr_ratio",
    "lora_r": "lora_rank rank r",
    "lora_targets": "target_modules lora_target_modules lora_target_linear",
    "lora_dtype": "adapter_dtype autocast_adapter_dtype",
    "activation_checkpointing": "gradient_checkpointing checkpointing recompute",
    "output_dir": "output out_dir output_path save_dir",
    "data": "dataset datasets train_file train_data dataset_name data_path train_dataset data_files",
    "eval_data": "eval_file validation_file eval_dataset test_data val_data test_datasets",
    "eval_fraction": "val_set_size validation_split val_split eval_split test_size",
    "model": "model_name_or_path model_name base_model model_id model_path",
    "tokenizer": "tokenizer_name tokenizer_name_or_path tokenizer_path",
    "eval_every": "eval_steps evaluation_steps",
    "save_every": "save_steps checkpoint_every",
    "log_every": "logging_steps log_steps log_interval",
    "keep_checkpoints": "save_total_limit",
    "max_grad_norm": "grad_clip clip_grad_norm gradient_clipping max_norm",
    "dtype": "torch_dtype precision bf16 fp16 mixed_precision",
    "aux_loss_coef": "router_aux_loss_coef load_balancing_loss_coef output_router_logits",
    "router_z_loss_coef": "z_loss_coef router_z_loss z_loss",
    "resume": "resume_from_checkpoint",
    "overwrite": "overwrite_output_dir",
    "report_to": "log_with trackers",
    "text_field": "dataset_text_field",
    "max_documents": "max_samples num_samples max_train_samples",
    "ep": "expert_parallel ep_size expert_parallel_size",
    "num_layers": "num_hidden_layers n_layers",
    "moe8": "use_moe8",
    "seed": "random_seed data_seed",
}
_ALIAS = {alias: key for key, names in ALIASES.items() for alias in names.split()}


def suggest(name: str) -> Optional[str]:
    """The key an unknown key most likely means: another trainer's name for it (learning_rate: lr), else the
    closest spelling (stpes: steps), else None."""
    norm = name.strip().lower().replace("-", "_")
    if norm in KEYS:
        return norm
    if norm in _ALIAS:
        return _ALIAS[norm]
    close = difflib.get_close_matches(norm, KEYS, 1, 0.6)
    if not close and len(norm) == 2:  # two letters swapped: rl, pe
        close = [k for k in KEYS if len(k) == 2 and sorted(k) == sorted(norm)]
    return close[0] if close else None


def _unknown(names, where: str):
    bad = sorted(set(names) - set(KEYS))
    if bad:
        hints = [f"{b} (did you mean {m}?)" if (m := suggest(b)) else b for b in bad]
        raise FinetuneError(
            f"{where}: unknown config keys: {', '.join(hints)}; `moe8 finetune --help` lists them"
        )


def load_toml(path: str) -> dict:
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ImportError:
            raise FinetuneError("reading TOML on Python < 3.11 needs tomli: pip install tomli") from None
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise FinetuneError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FinetuneError(f"cannot read config file {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise FinetuneError(f"{path}: not valid TOML: {e}") from None
    nested = [k for k, v in table.items() if isinstance(v, dict)]
    if nested:
        raise FinetuneError(
            f"{path}: tables {nested} are not supported: the config is one flat table of keys"
        )
    return table


def make_config(path: Optional[str] = None, overrides: Optional[dict] = None) -> Config:
    """Defaults <- the TOML file at `path` <- `overrides` (from flags), type-checked and validated."""
    values = {}
    for where, table in ((path, load_toml(path) if path else {}), ("command line", overrides or {})):
        _unknown(table, where)
        values.update({k: _check_type(k, v, where) for k, v in table.items() if v is not None})
    cfg = Config(**values)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    def need(ok: bool, msg: str):
        if not ok:
            raise FinetuneError(msg)

    for name in KEYS:  # inf / nan in a TOML file or a flag (float("inf") parses) would train to NaN
        v = getattr(cfg, name)
        need(not isinstance(v, float) or math.isfinite(v), f"{name} = {v}: expected a finite number")
    for name, choices in (
        ("method", ("full", "lora")),
        ("dtype", ("auto", "bf16", "fp32")),
        ("device", ("auto", "cuda", "cpu")),
        ("data_format", ("auto", "lines", "text", "jsonl", "csv", "parquet", "arrow")),
        ("packing", ("documents", "stream")),
        ("format", ("auto", "text", "messages", "alpaca", "sharegpt")),
        ("fp8", ("none", "blockwise", "rowwise", "tensorwise", "auto")),
        ("transport", ("auto", "nccl", "ipc")),
        ("lora_dtype", LORA_DTYPES),
    ):
        need(
            getattr(cfg, name) in choices, f"{name} = {getattr(cfg, name)!r}: expected one of {list(choices)}"
        )
    need(
        isinstance(cfg.cuda_graphs, bool) or cfg.cuda_graphs == "auto",
        f"cuda_graphs = {cfg.cuda_graphs!r}: expected true, false or 'auto'",
    )
    for name in (
        "ep",
        "steps",
        "micro_batch",
        "grad_accum",
        "log_every",
        "dead_window",
        "lora_r",
        "keep_checkpoints",
    ):
        need(getattr(cfg, name) >= 1, f"{name} = {getattr(cfg, name)}: expected a positive integer")
    need(
        cfg.seq_len >= 2,
        f"seq_len = {cfg.seq_len}: expected at least 2 (a token is trained to predict the next one, so a "
        "sequence of one token has nothing to learn)",
    )
    for name in (
        "epochs",
        "run_steps",
        "max_documents",
        "eval_every",
        "eval_batches",
        "save_every",
        "lora_dropout",
        "num_layers",
        "router_z_loss_coef",
    ):
        need(getattr(cfg, name) >= 0, f"{name} = {getattr(cfg, name)}: expected >= 0")
    for name in ("weight_decay", "max_grad_norm", "min_lr_ratio", "warmup_steps", "aux_loss_coef"):
        v = getattr(cfg, name)
        need(v is None or v >= 0, f"{name} = {v}: expected >= 0")
    need(cfg.lr is None or cfg.lr > 0, f"lr = {cfg.lr}: expected > 0")
    need(cfg.peak_tflops is None or cfg.peak_tflops > 0, f"peak_tflops = {cfg.peak_tflops}: expected > 0")
    need(0 <= cfg.eval_fraction < 1, f"eval_fraction = {cfg.eval_fraction}: expected in [0, 1)")
    need(cfg.lora_dropout < 1, f"lora_dropout = {cfg.lora_dropout}: expected < 1")
    bad = sorted(set(cfg.report_to) - set(REPORT_TO))
    need(not bad, f"report_to = {cfg.report_to}: unknown {bad}; expected some of {list(REPORT_TO)}")
    need(cfg.num_layers == 0 or bool(cfg.model_config), "num_layers: only with model_config")
    need(
        cfg.lora_dtype == "auto" or cfg.method == "lora",
        f"lora_dtype = {cfg.lora_dtype!r}: only with method = 'lora' (method = {cfg.method!r})",
    )
    need(not (cfg.resume and cfg.overwrite), "resume and overwrite exclude each other")
    need(not cfg.resume or bool(cfg.output_dir), "resume: name the run to continue with output_dir")
    need(cfg.fp8 == "none" or cfg.moe8, f"fp8 = {cfg.fp8!r}: FP8 experts run on moe8; drop --no-moe8")
    world = world_size()
    need(
        world > 1 or cfg.ep == 1,
        f"ep = {cfg.ep}: expected 1 in one process (WORLD_SIZE 1); launch with "
        f"`torchrun --nproc-per-node N moe8 finetune ...` (N a multiple of ep) for expert parallelism",
    )
    need(
        world % cfg.ep == 0,
        f"ep = {cfg.ep}: expected a divisor of the world size (WORLD_SIZE {world}), got {cfg.ep}",
    )
    need(cfg.ep == 1 or cfg.moe8, f"ep = {cfg.ep}: expert parallelism runs on moe8; drop --no-moe8")
    need(not cfg.fsdp or world > 1, "fsdp = true: expected a torchrun launch (WORLD_SIZE > 1)")
    need(not cfg.fsdp or cfg.method == "full", "fsdp = true: FSDP with lora is not supported")


def world_size() -> int:
    """torchrun's WORLD_SIZE (1 when not launched by torchrun)."""
    from .._env import ENV

    return ENV["world_size"]


def to_toml(cfg: Config) -> str:
    """The config as TOML (None values, which TOML can't hold, as comments)."""
    lines = []
    for name, value in dataclasses.asdict(cfg).items():
        if value is None:
            lines.append(f"# {name} = (default)")
        elif isinstance(value, bool):
            lines.append(f"{name} = {str(value).lower()}")
        else:  # JSON strings, numbers and lists of strings are valid TOML
            lines.append(f"{name} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def add_flags(ap: argparse.ArgumentParser) -> None:
    """One flag --KEY per key (boolean keys also --no-KEY), defaulting to 'not given'. main() also accepts
    --kebab-case spellings (see snake_flags)."""
    for name, f in KEYS.items():
        t = _base_type(name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        shown = "" if default is None else f" (default: {','.join(default) if t is list else default})"
        names = [f"--{name}"]
        kw = dict(dest=name, default=argparse.SUPPRESS, help=f.metadata["help"] + shown)
        if t is bool:
            ap.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
        elif t == BOOL_OR_AUTO:
            ap.add_argument(*names, type=_bool_or_auto, metavar="auto|true|false", **kw)
        elif t is list:
            ap.add_argument(
                *names, type=lambda s: [x.strip() for x in s.split(",") if x.strip()], metavar="A,B", **kw
            )
        else:
            ap.add_argument(*names, type=t, metavar={int: "N", float: "X", str: "TEXT"}[t], **kw)


def _bool_or_auto(word: str):
    """A flag's value of a true / false / "auto" key: true and false as booleans, as TOML spells them; any
    other word as given, for validate() to name."""
    return {"true": True, "false": False}.get(word.strip().lower(), word)


def snake_flags(argv: list[str]) -> list[str]:
    """--micro-batch 4 -> --micro_batch 4, --no-activation-checkpointing -> --no-activation_checkpointing."""
    out = []
    for a in argv:
        if a.startswith("--") and len(a) > 2:
            flag, eq, value = a.partition("=")
            no = flag.startswith("--no-")
            a = ("--no-" if no else "--") + flag[5 if no else 2 :].replace("-", "_") + eq + value
        out.append(a)
    return out
