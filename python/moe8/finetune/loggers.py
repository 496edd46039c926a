"""Where `moe8 finetune`'s metrics go besides the terminal: metrics.jsonl (strict JSON: a non-finite number is
written as null and named in the line's "nonfinite" list) and the `report_to` trackers, TensorBoard, W&B and
MLflow, each an optional dependency imported only when asked for."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import sys
import time

from .config import Config, FinetuneError

INSTALL = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def strict(line: dict) -> dict:
    """The line with NaN / inf (at any depth) replaced by None, and their top-level keys in "nonfinite"."""
    bad = []

    def clean(v, key):
        if isinstance(v, float) and not math.isfinite(v):
            bad.append(key)
            return None
        if isinstance(v, dict):
            return {k: clean(x, key) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x, key) for x in v]
        return v

    out = {k: clean(v, k) for k, v in line.items()}
    if bad:
        out["nonfinite"] = sorted(set(bad))
    return out


def dumps(line: dict) -> str:
    return json.dumps(strict(line), allow_nan=False)


def scalars(line: dict) -> dict:
    """The numbers of a metrics line for a tracker: loss, eval_loss, lr, ..., routing/max_imbalance."""
    out = {k: float(v) for k, v in line.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out.pop("step", None)
    routing = line.get("routing") or {}
    if routing:  # an expert's load: its token share x the number of experts (1: uniform)
        loads = [max(f) * len(f) for f in routing.values() if f]
        out["routing/max_imbalance"] = max(loads)
        out["routing/mean_imbalance"] = sum(loads) / len(loads)
    return {k: v for k, v in out.items() if math.isfinite(v)}


def check_installed(cfg: Config) -> None:
    """FinetuneError naming the pip command for a report_to backend that is not installed (before any work)."""
    for name in cfg.report_to:
        if importlib.util.find_spec(name) is None:
            raise FinetuneError(
                f"report_to = {cfg.report_to}: {name} is not installed: pip install {INSTALL[name]} "
                f"(or drop {name!r})"
            )


class Trackers:
    """The report_to backends of a run: log(step, line) to each, close() at the end. Rank 0 only."""

    def __init__(self, cfg: Config, out, config: dict):
        self.backends = []
        for name in cfg.report_to:
            self.backends.append(getattr(self, f"_{name}")(cfg, out, config))

    @staticmethod
    def _tensorboard(cfg, out, config):
        SummaryWriter = importlib.import_module("torch.utils.tensorboard").SummaryWriter
        writer = SummaryWriter(log_dir=str(out / "tensorboard"))

        def log(step, values):
            for k, v in values.items():
                writer.add_scalar(k, v, step)
            writer.flush()

        return log, writer.close

    @staticmethod
    def _wandb(cfg, out, config):
        wandb = importlib.import_module("wandb")
        run = wandb.init(project="moe8-finetune", name=out.name, dir=str(out), config=config)
        return (lambda step, values: run.log(values, step=step)), run.finish

    @staticmethod
    def _mlflow(cfg, out, config):
        mlflow = importlib.import_module("mlflow")
        mlflow.start_run(run_name=out.name)
        mlflow.log_params({k: str(v)[:250] for k, v in config.items()})
        return (lambda step, values: mlflow.log_metrics(values, step=step)), mlflow.end_run

    def log(self, line: dict) -> None:
        values = scalars(line)
        if values:
            for log, _ in self.backends:
                log(int(line["step"]), values)

    def close(self) -> None:
        for _, close in self.backends:
            close()


def _mfu(line: dict) -> str:
    """ "  MFU 41.3%", two significant digits below 1% (a tiny model's 0.012% is not 0.0%); "" when not known."""
    mfu = line.get("mfu")
    if mfu is None:
        return ""
    pct = 100 * mfu
    return f"  MFU {pct:.1f}%" if pct >= 1 or pct == 0 else f"  MFU {pct:.2g}%"


class Progress:
    """The training's progress, on rank 0: on a terminal (stdout and stderr both) with progress on, a tqdm bar
    (when installed; else one carriage-return line); otherwise, for a log file or a pipe, and always with
    progress off, one plain line per logged step: step, loss (and eval loss), lr, tokens/s, MFU, ETA."""

    def __init__(self, total: int, initial: int, progress: bool, main: bool = True):
        self.total, self.initial, self.main = total, initial, main
        self.t0, self.text, self.bar = time.perf_counter(), "", None
        self.live = main and progress and sys.stdout.isatty() and sys.stderr.isatty()
        if self.live:
            try:
                from tqdm import tqdm

                self.bar = tqdm(
                    total=total, initial=initial, unit="step", desc="finetune", dynamic_ncols=True
                )
            except ImportError:
                pass

    def eta(self, step: int) -> str:
        s = int((time.perf_counter() - self.t0) / max(1, step - self.initial) * (self.total - step))
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"

    def update(self, step: int, line: dict | None) -> None:
        """After each step; `line` is the step's metrics line when it was logged, else None."""
        if not self.main:
            return
        if line is not None:
            self.text = f"loss {line['loss']:.3f}  {line['tokens_per_s']:,.0f} tok/s" + _mfu(line)
        if self.bar is not None:
            if line is not None:
                self.bar.set_postfix_str(self.text, refresh=False)
            self.bar.update(1)
        elif self.live:
            sys.stderr.write(f"\r{step}/{self.total}  {self.text}  ETA {self.eta(step)} ")
            sys.stderr.flush()
        elif line is not None:
            ev = f"  eval {line['eval_loss']:.3f}" if line.get("eval_loss") is not None else ""
            print(
                f"step {step}/{self.total}  loss {line['loss']:.3f}{ev}  lr {line['lr']:.3g}  "
                f"{line['tokens_per_s']:,.0f} tok/s{_mfu(line)}  ETA {self.eta(step)}",
                flush=True,
            )

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(("\n" if self.live and self.text else "") + msg, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.live:
            sys.stderr.write("\n")
