"""moe8 finetune's optimizer: AdamW with the trainer's param groups, on a GPU moe8's (moe8.optim.AdamW, torch's
fused kernel for its small tensors). The fused kernel updates exactly as the default one does (checked on the CPU,
where both exist), and on a GPU the step allocates nothing per parameter, where the default foreach AdamW holds an
fp32 temporary per parameter (the sqrt of exp_avg_sq) at the peak of a full fine-tune."""

import json

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0", reason="moe8 finetune needs transformers>=5")

import moe8.optim  # noqa: E402
from moe8.finetune.config import make_config  # noqa: E402
from moe8.finetune.train import Trainer, adamw  # noqa: E402


def groups(params):
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.01},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def test_fused_adamw_updates_as_the_default():
    torch.manual_seed(0)
    shapes = [(7, 5), (3, 1, 9), (11,), (1,)]
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(4)]
    runs = {}
    for where in ("cpu", "cuda"):  # "cuda" picks the fused kernel; the tensors stay on the CPU
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = adamw(groups(params), 1e-2, torch.device(where))
        assert bool(opt.defaults["fused"]) == (where == "cuda")
        assert isinstance(opt, moe8.optim.AdamW) == (where == "cuda")
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        runs[where] = params
    for a, b, s in zip(runs["cpu"], runs["cuda"], start):
        assert not torch.equal(a.detach(), s)  # it moved
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the optimizer step's GPU memory needs a CUDA GPU")
def test_full_finetune_step_allocates_nothing_per_parameter(tmp_path):
    spec = dict(
        model_type="olmoe",
        hidden_size=512,
        intermediate_size=256,
        num_experts=16,
        num_experts_per_tok=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_hidden_layers=2,
    )
    cfg = make_config(
        overrides=dict(
            model_config=json.dumps(spec),
            device="cuda",
            method="full",
            steps=2,
            micro_batch=1,
            seq_len=64,
            eval_fraction=0.0,
            log_every=1,
            progress=False,
            output_dir=str(tmp_path / "run"),
            max_documents=200,
        )
    )

    class NoSave(Trainer):  # no checkpoint or model written: only the steps matter here
        def save(self, step):
            pass

        def export(self):
            pass

    trainer = NoSave(cfg, log=lambda *a, **k: None)
    trainable = sum(p.numel() for p in trainer.master)
    extra = []

    def before(*_):
        torch.cuda.synchronize()
        extra.append(torch.cuda.memory_allocated())
        torch.cuda.reset_peak_memory_stats()

    def after(*_):
        torch.cuda.synchronize()
        extra[-1] = torch.cuda.max_memory_allocated() - extra[-1]

    trainer.opt.register_step_pre_hook(before)
    trainer.opt.register_step_post_hook(after)
    trainer.run()
    assert len(extra) == 2 and trainable > 30e6
    # foreach AdamW: >= 4 bytes per parameter (the first step also creates the 8 bytes of AdamW state)
    assert extra[-1] < 0.5 * trainable, f"{extra[-1] / trainable:.2f} bytes per parameter in the step"
