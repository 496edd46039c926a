"""Routing statistics for your own Hugging Face Trainer scripts:

    from moe8.finetune import RoutingStatsCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[RoutingStatsCallback()])

At every Trainer log step it adds `routing/max_imbalance`, `routing/mean_imbalance` and `routing/dead_experts`
to the logs (and so to trainer.state.log_history, TensorBoard, W&B, ...) and appends one JSON line with the
per-expert token fraction of every MoE layer to OUTPUT_DIR/routing.jsonl (same fields as moe8 finetune's
metrics.jsonl: step, routing). `callback.history` holds the same lines."""

from __future__ import annotations

import json
import os

from transformers import TrainerCallback

from .routing import RoutingStats, health, summary


class RoutingStatsCallback(TrainerCallback):
    def __init__(self, path: str | None = None, dead_window: int = 50):
        """path: the JSONL file (default: routing.jsonl in the Trainer's output_dir; "" writes none).
        dead_window: an expert without a token over this many last steps counts as dead."""
        self.path, self.dead_window = path, dead_window
        self.stats, self.history = None, []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.stats is None:
            self.stats = RoutingStats(model)
        if self.path is None:
            self.path = os.path.join(args.output_dir, "routing.jsonl")

    def on_log(self, args, state, control, logs=None, **kwargs):
        fractions = self.stats.take() if self.stats is not None else {}
        if not fractions:
            return
        line = dict(step=state.global_step, routing=fractions)
        self.history.append(line)
        s = summary(health(self.history, self.dead_window))
        scalars = {f"routing/{k}": s[k] for k in ("max_imbalance", "mean_imbalance", "dead_experts")}
        if logs is not None:
            logs.update(scalars)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(scalars)
        if self.path and state.is_world_process_zero:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(dict(line, **scalars)) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        if self.stats is not None:
            self.stats.remove()
            self.stats = None
