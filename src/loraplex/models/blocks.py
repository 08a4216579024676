"""Building blocks of decoder-only transformers, shared by every architecture.

Module names follow Hugging Face checkpoints (self_attn, mlp, input_layernorm, ...), so
weight and adapter names map onto them with no per-model tables.
"""

from __future__ import annotations

import torch
from torch import nn

from loraplex import ops
from loraplex.config import ModelConfig
from loraplex.layers.attention import PagedAttention
from loraplex.layers.context import get_forward_context
from loraplex.layers.linear import LoRALinear
from loraplex.layers.norm import RMSNorm
from loraplex.layers.rotary import RotaryEmbedding
from loraplex.ops.formats import Fp8Rows
from loraplex.ops.metadata import QKNorm

# Attention's rotary and KV cache write in one op (ops.rotate_and_store); False: the
# rotary op, then the write inside PagedAttention (benchmarks: decode_breakdown
# --unfused-rotary).
ROTATE_AND_STORE = True


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = LoRALinear(
            cfg.hidden_size,
            [cfg.q_size, cfg.kv_size, cfg.kv_size],
            ["q_proj", "k_proj", "v_proj"],
            bias=cfg.qkv_bias,
        )
        self.o_proj = LoRALinear(cfg.q_size, [cfg.hidden_size], ["o_proj"], bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3, Gemma 3: RMSNorm over each head's vector before rotary
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.gemma_norms)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.gemma_norms)
        self.rotary = rotary
        self.attn = PagedAttention(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attn_scale or cfg.head_dim**-0.5,
            cfg.layer_window(layer),
        )
        # gpt-oss: one sink logit per query head (self_attn.sinks in checkpoints), kept in
        # float32 whatever the model's dtype: the attention op reads it as float32 logits.
        self.sinks = (nn.Parameter(torch.zeros(cfg.num_heads, dtype=torch.float32), False)
                      if cfg.attention_sinks else None)

    def fp8_input_block(self, tokens: int) -> int:
        return self.qkv_proj.fp8_input_block(tokens)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, x_fp8: Fp8Rows | None = None) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x, x_fp8).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        qk_norm = None
        if hasattr(self, "q_norm"):  # applied by the rotary op, in its launch
            qk_norm = QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.unit_offset)
        if ROTATE_AND_STORE:  # rotary and the KV write in one op
            attn = self.attn
            q = ops.rotate_and_store(q, k, v, positions, self.rotary.cos_sin, attn.k_cache, attn.v_cache,
                                     get_forward_context().attn.slot_mapping, qk_norm)
            o, o_fp8 = attn.attend(q, self.sinks, self.o_proj.fp8_input_block(t))
        else:
            q, k = self.rotary(positions, q, k, qk_norm)
            o, o_fp8 = self.attn(q, k, v, self.sinks, self.o_proj.fp8_input_block(t))
        return self.o_proj(o.reshape(t, -1), o_fp8)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused into one matmul; act is SiLU or
    tanh GELU."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        self.activation = cfg.activation
        self.act_and_mul = {"silu": ops.silu_and_mul, "gelu_tanh": ops.gelu_tanh_and_mul}[
            cfg.activation
        ]
        size = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = LoRALinear(
            cfg.hidden_size, [size, size], ["gate_proj", "up_proj"], bias=cfg.mlp_bias
        )
        self.down_proj = LoRALinear(size, [cfg.hidden_size], ["down_proj"], bias=cfg.mlp_bias)

    def fp8_input_block(self, tokens: int) -> int:
        return self.gate_up_proj.fp8_input_block(tokens)

    def forward(self, x: torch.Tensor, x_fp8: Fp8Rows | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj
        batch = gate_up.lora_batch()
        if batch is None or (batch.dora and gate_up.lora.dora_scale is not None):
            return self.down_proj(self.act_and_mul(gate_up(x, x_fp8)))
        # The gate/up delta is added inside the activation, not into gate_up's output.
        y, buf = gate_up.base_and_shrink(x, x_fp8)
        return self.down_proj(ops.lora_act_and_mul(y, buf, gate_up.lora.b, batch, self.activation))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.make_attention(cfg, layer, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.make_mlp(cfg, layer)

    def make_attention(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> nn.Module:
        return SelfAttention(cfg, layer, rotary)

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return GatedMLP(cfg)

    def forward(self, positions, h, residual):
        """Pre-norm block; the residual stream travels beside h so that each add fuses
        into the next norm. residual None: h is the embedding (first layer). Where the
        attention's or the MLP's first GEMMs are W8A8, the norm in front also writes the
        e4m3 rows they read (h_fp8), in its own launch."""
        t = h.shape[0]
        h, residual, h_fp8 = self.input_layernorm.with_fp8(h, residual, self.self_attn.fp8_input_block(t))
        h = self.self_attn(positions, h, h_fp8)
        h, residual, h_fp8 = self.post_attention_layernorm.with_fp8(h, residual, self.mlp.fp8_input_block(t))
        return self.mlp(h, h_fp8), residual
