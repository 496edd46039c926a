"""moe8.hf.registry — what enable() / accelerate() changed in this process (undone by disable()), and the
moe8.Config that models built after enable() get."""

from __future__ import annotations

import weakref

from moe8.config import DEFAULT


class _Registry:
    """What enable() / accelerate() changed in this process, so that disable() can undo it: the hooks on
    PreTrainedModel, the configs switched to "moe8", the patched classes and modeling modules."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.families = frozenset()  # families that models built after enable() switch to moe8
        self.auto = False  # enable() is in force
        self.default = DEFAULT  # the Config of models built after enable()
        self.check = None  # (transformers' _check_and_adjust_experts_implementation, moe8's wrapper)
        self.post_init = None  # (transformers' post_init, moe8's wrapper)
        self.switched = {}  # id(config) -> (weakref to the config, experts implementation to restore)
        self.fused = weakref.WeakSet()  # routers and norms running moe8's forward (they carry `_moe8_config`)
        self.configured = weakref.WeakSet()  # experts and fused modules carrying a moe8.Config (`_moe8`)
        self.loss_fused = weakref.WeakSet()  # causal LMs whose training loss moe8.loss computes
        self.patched_classes = (
            set()
        )  # router / norm classes whose forward is moe8's (own kept: `_moe8_forward`)
        # (modeling module, function name) -> its own function, while moe8's replaces it (fuse_rope:
        # apply_rotary_pos_emb; fuse_attention: eager_attention_forward)
        self.module_patches = {}
        self.sdpa = None  # transformers' "sdpa" attention function while packed_attention replaces it
        self.trainer_adamw = {}  # optim name -> transformers' own Trainer handler, while fused_adamw replaces it


registry = _Registry()
