"""The current step's batch metadata, set by the model runner around each forward.

Layers read it here instead of threading it through every model's forward signature,
so architecture files stay free of batching and adapter details.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from loraplex.ops.metadata import AttentionBatch, LoRABatch


@dataclass
class ForwardContext:
    attn: AttentionBatch
    lora: LoRABatch | None  # None: no token of this step uses an adapter
    # A second CUDA stream on which LoRA shrink overlaps the base matmul (None: serial).
    aux_stream: torch.cuda.Stream | None = None
    # Decode steps, when measured: MoE layers add (distinct experts hit, 1) into this
    # device tensor [2], without a host sync (benchmarks report the mean per layer).
    moe_stats: torch.Tensor | None = None
    # Whether MoE routers run their LoRA: False in steps where no token's adapter adapts
    # a router (their slots hold zeros there), which then skip two launches per layer.
    router_lora: bool = True


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext):
    global _current
    prev, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = prev


def get_forward_context() -> ForwardContext:
    assert _current is not None, "model forward outside forward_context()"
    return _current


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """A second stream of the device for a layer's independent branch (DeepSeek's shared
    experts beside the routed ones), apart from the aux stream that LoRA shrinks and the
    MoE LoRA use, so neither branch queues behind the other's side work."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]
