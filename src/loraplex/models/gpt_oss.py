"""gpt-oss: the MoE decoder with gpt-oss's attention and expert checkpoint layout.

Everything but the checkpoint layout is a ModelConfig field read by the shared blocks:
q/k/v/o biases, per-head attention sinks (`attention_sinks`), sliding-window layers
alternating with full ones, YaRN rope, a biased router (`mlp.router`) whose top-k logits
are softmaxed (= softmax, top-k, renormalise), biased experts with the clamped SwiGLU
("swiglu_oai").

Checkpoints store the experts transposed ([E, H, 2I] and [E, I, H]) with gate and up
interleaved (gate = columns 0::2, up = 1::2, biases likewise); `checkpoint_transform`
turns them into loraplex's [E, 2I, H] (gate rows, then up rows) and [E, H, I] on load.
The published MXFP4 checkpoint (gpt-oss-20b, -120b) stores the experts' blocks and
scales untransposed ([E, out, in / 32, 16] and [E, out, in / 32]), gate_up's rows
interleaved alike: they are only de-interleaved here (ops/formats/mxfp4.py takes them).
"""

from __future__ import annotations

import torch
from torch import nn

from loraplex.config import ModelConfig
from loraplex.layers.moe import SparseMoE
from loraplex.models.blocks import DecoderLayer
from loraplex.models.dense import DenseCausalLM


class GptOssDecoderLayer(DecoderLayer):
    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return SparseMoE(cfg, router_name="router", bias=True)


class GptOssCausalLM(DenseCausalLM):
    layer_cls = GptOssDecoderLayer
    # --quantization fp8 leaves the routers in bf16, as the MXFP4 checkpoint does.
    unquantized_modules = ("router",)
    # Read by the adapter loader (models/weights.py adapter_targets): expert adapters in
    # the checkpoint's column order are de-interleaved like the weights.
    checkpoint_gate_up_interleaved = True

    @staticmethod
    def checkpoint_transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(".experts.gate_up_proj"):  # [E, H, 2I] interleaved -> [E, 2I, H]
            t = tensor.transpose(1, 2)
            return torch.cat((t[:, 0::2], t[:, 1::2]), 1)
        if name.endswith((".experts.gate_up_proj_bias", ".experts.gate_up_proj_blocks",
                          ".experts.gate_up_proj_scales")):  # rows [E, 2I, ...] interleaved
            # (a tensor of too few dims is left for the loader to name)
            return torch.cat((tensor[:, 0::2], tensor[:, 1::2]), 1) if tensor.dim() >= 2 else tensor
        if name.endswith(".experts.down_proj"):  # [E, I, H] -> [E, H, I]
            return tensor.transpose(1, 2)
        return tensor
