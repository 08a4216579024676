"""Linear layers that add each token's own LoRA delta to the base output.

A `LoRALinear` fuses several projections that read the same input (q/k/v, gate/up) into
one matmul with output slices; each slice keeps its Hugging Face / PEFT module name, so
checkpoints and adapters address slices by those names. Its weight is a tensor or a
quantized weight (ops/formats; the base matmul is ops.linear either way); its adapter
slots (`lora`, a LoRAWeights) are allocated and filled by adapters/slots.py.

Inside `weights_deferred()` the weights of LoRALinear and Experts are made on the meta
device: their format is chosen once the model exists (models/quant.py), so a quantized
model never holds them in bf16 first.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

import torch
from torch import nn

from loraplex import ops
from loraplex.layers.context import get_forward_context
from loraplex.layers.lora_weights import LoRAWeights
from loraplex.layers.parallel import LinearShard, reduce_deferred
from loraplex.ops.formats import Fp8Rows
from loraplex.ops.metadata import LoRABatch
from loraplex.ops.side_streams import beside, join

_DEFERRED = contextvars.ContextVar("loraplex_weights_deferred", default=False)


@contextmanager
def weights_deferred():
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def weight_device() -> str | None:
    """Where LoRALinear and Experts make their weights: meta while deferred, else the
    default device."""
    return "meta" if _DEFERRED.get() else None


class LoRALinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        slice_names: list[str],
        bias: bool = False,
    ):
        super().__init__()
        assert len(output_sizes) == len(slice_names), (output_sizes, slice_names)
        self.in_features = in_features
        self.output_sizes = tuple(output_sizes)
        self.slice_names = tuple(slice_names)
        self.weight: nn.Parameter | ops.QuantizedWeight = nn.Parameter(
            torch.empty(sum(output_sizes), in_features, device=weight_device()), False)
        self.bias = nn.Parameter(torch.empty(sum(output_sizes)), False) if bias else None
        self.lora: LoRAWeights | None = None  # None: this engine serves no adapters
        # An MoE router: adapters seldom adapt it, so steps whose adapters do not skip its
        # LoRA (ForwardContext.router_lora; the runner keeps graphs of both kinds).
        self.is_router = False
        # Tensor parallel: which part of the full layer this rank holds (sizes above are
        # the rank's own); a row-parallel layer all-reduces its output.
        self.tp: LinearShard | None = None

    def slice_rows(self, index: int) -> slice:
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])

    def lora_batch(self) -> LoRABatch | None:
        """This step's adapter batch, or None when no adapter applies to this layer now."""
        if self.lora is None:
            return None
        ctx = get_forward_context()
        lora = ctx.lora
        if lora is None or not lora.active or (self.is_router and not ctx.router_lora):
            return None
        return lora

    def fp8_input_block(self, tokens: int) -> int:
        """The block of e4m3 rows a W8A8 weight reads x in, in a step of `tokens` (0:
        x unquantized): what the norm writing x writes beside it (x_fp8)."""
        return ops.fp8_input_block([self.weight], tokens)

    def forward(self, x: torch.Tensor, x_fp8: Fp8Rows | None = None) -> torch.Tensor:
        """x_fp8: x's e4m3 rows (ops.linear), from the norm that wrote x."""
        batch = self.lora_batch()
        if batch is None:
            y = ops.linear(x, self.weight, self.bias, x_fp8)
        else:
            y = ops.lora_linear(x, self.weight, self.bias, self.lora.a, self.lora.b, self.output_sizes, batch,
                                get_forward_context().aux_stream, x_fp8)
            if batch.dora and self.lora.dora_scale is not None:
                y = self._dora_rescale(y, batch.token_slot)
        if self.tp is not None and self.tp.reduces and not reduce_deferred():
            self.tp.group.all_reduce(y)  # partial sums, adapter deltas included
        return y

    def base_and_shrink(self, x: torch.Tensor, x_fp8: Fp8Rows | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x W^T + bias, lora_shrink's buf of x) for a step with adapters, for a consumer
        op that adds the delta itself (lora_act_and_mul)."""
        ctx = get_forward_context()
        with beside(ctx.aux_stream):  # the shrink reads only x: beside the base matmul
            buf = ops.lora_shrink(x, self.lora.a, ctx.lora)
        y = ops.linear(x, self.weight, self.bias, x_fp8)
        join(ctx.aux_stream)
        return y, buf

    def _dora_rescale(self, y: torch.Tensor, token_slot: torch.Tensor) -> torch.Tensor:
        # DoRA: y = scale * (x W^T + s x A^T B^T) + bias, per token with its slot's scale.
        dora_scale = self.lora.dora_scale
        rows = torch.where(token_slot < 0, dora_scale.shape[0] - 1, token_slot)
        scale = dora_scale[rows[: y.shape[0]]]
        out = y.float() * scale
        if self.bias is not None:
            out += self.bias.float() * (1 - scale)
        return out.to(y.dtype)
