"""Gemma 3 (text): the dense decoder with Gemma's block.

Differences from Llama, all but the block structure carried by ModelConfig: norms scale
by (1 + w) in float32 (`gemma_norms`), embeddings are multiplied by sqrt(hidden), the MLP
gate is tanh GELU, q/k are normalised per head, attention scales by
query_pre_attn_scalar ** -0.5, and sliding-window (local) layers alternate with global
ones, each kind with its own rope base. The block normalises the outputs of attention
and MLP too ("sandwich" norms): four norms per layer.
"""

from __future__ import annotations

from torch import nn

from loraplex.config import ModelConfig
from loraplex.layers.norm import RMSNorm
from loraplex.layers.rotary import RotaryEmbedding
from loraplex.models.blocks import GatedMLP, SelfAttention
from loraplex.models.dense import DenseCausalLM


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding):
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = SelfAttention(cfg, layer, rotary)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GatedMLP(cfg)
        self.post_feedforward_layernorm = norm()

    def forward(self, positions, h, residual):
        """h + norm(attn(norm(h))), then the same with the MLP. The residual stream
        travels beside h so that each add fuses into the next norm, and the norms in front
        of W8A8 GEMMs write their e4m3 rows too (see DecoderLayer)."""
        t = h.shape[0]
        h, residual, h_fp8 = self.input_layernorm.with_fp8(h, residual, self.self_attn.fp8_input_block(t))
        h = self.post_attention_layernorm(self.self_attn(positions, h, h_fp8))
        h, residual, h_fp8 = self.pre_feedforward_layernorm.with_fp8(h, residual, self.mlp.fp8_input_block(t))
        return self.post_feedforward_layernorm(self.mlp(h, h_fp8)), residual


class Gemma3CausalLM(DenseCausalLM):
    layer_cls = Gemma3DecoderLayer
