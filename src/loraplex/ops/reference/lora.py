"""Plain-torch LoRA shrink and expand (and the expand fused with the gated activation, and
a whole adapted projection): the CPU path and the oracle of the kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.ops.formats import QuantizedWeight
from loraplex.ops.metadata import LoRABatch
from loraplex.ops.reference.elementwise import gelu_tanh_and_mul, silu_and_mul
from loraplex.ops.reference.quant import linear as quant_linear


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    num_slices, _, max_rank, _ = lora_a.shape
    out = torch.zeros(num_slices, x.shape[0], max_rank, dtype=torch.float32, device=x.device)
    for g in batch.groups:
        idx = batch.sorted_token_ids[g.start : g.end]
        xs = x.index_select(0, idx).float()
        for s in range(num_slices):
            out[s, idx, : g.rank] = xs @ lora_a[s, g.slot, : g.rank].float().T
    return out


def lora_expand(
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    y: torch.Tensor,
    slice_sizes: tuple[int, ...],
    batch: LoRABatch,
) -> None:
    for g in batch.groups:
        idx = batch.sorted_token_ids[g.start : g.end]
        offset = 0
        for s, size in enumerate(slice_sizes):
            b = lora_b[g.slot, offset : offset + size, : g.rank].float()
            delta = buf[s, idx, : g.rank] @ b.T
            y[:, offset : offset + size].index_add_(0, idx, delta.to(y.dtype))
            offset += size


def lora_act_and_mul(
    gate_up: torch.Tensor,
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    batch: LoRABatch,
    activation: str,
) -> torch.Tensor:
    # Exactly the unfused path: expand into (a copy of) the projection, then activate.
    y = gate_up.clone()
    width = y.shape[1] // 2
    lora_expand(buf, lora_b, y, (width, width), batch)
    return silu_and_mul(y) if activation == "silu" else gelu_tanh_and_mul(y)


def lora_linear(x, weight, bias, lora_a, lora_b, slice_sizes, batch, side_stream=None,
                x_fp8=None) -> torch.Tensor:
    y = quant_linear(x, weight, bias) if isinstance(weight, QuantizedWeight) else F.linear(x, weight, bias)
    lora_expand(lora_shrink(x, lora_a, batch), lora_b, y, slice_sizes, batch)
    return y
