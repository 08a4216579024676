"""DeepSeek-V2 (V2-Lite's config and V2's) and V3's layout: multi-head latent attention,
dense first layers, MoE layers with shared experts beside the routed ones.

Attention (MLA): q_proj (or q_a_proj -> norm -> q_b_proj) gives each head a query of
qk_nope + qk_rope dims; kv_a_proj_with_mqa gives one latent (normed) and one rotary key
that every head shares; kv_b_proj would expand the latent into each head's key and value
but is absorbed into the query and output instead (layers/mla.py), so the cache holds
kv_lora_rank + qk_rope_head_dim values per token per layer. q_proj (or q_a_proj) and
kv_a_proj_with_mqa read the same input: one fused LoRALinear. Checkpoints rotate the
rotary dims as interleaved pairs (V3: unless rope_interleave is false); loraplex's rotary
op rotates halves, so both the query's and the key's rotary parts are de-interleaved
first: the same permutation on both sides leaves every q . k as it was.

MoE: the routed experts are SparseMoE's (V2: softmax, greedy or group-limited top-k; V3:
sigmoid scores with a correction bias choosing within groups; weights times
routed_scaling_factor); the shared experts are a gated MLP of n_shared_experts x
moe_intermediate_size whose output joins the routed rows that the next norm sums.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from loraplex import ops
from loraplex.config import ModelConfig
from loraplex.layers.context import forward_context, get_forward_context, side_stream
from loraplex.layers.linear import LoRALinear
from loraplex.layers.mla import LatentAttention
from loraplex.layers.moe import SparseMoE
from loraplex.layers.norm import RMSNorm
from loraplex.layers.parallel import partial_sums
from loraplex.layers.rotary import RotaryEmbedding
from loraplex.models.blocks import DecoderLayer, GatedMLP
from loraplex.models.dense import DenseCausalLM
from loraplex.ops.formats import Fp8Rows
from loraplex.ops.side_streams import beside, join

# DeepSeek's q_a_layernorm and kv_a_layernorm keep their class default, whatever
# rms_norm_eps says.
_LATENT_NORM_EPS = 1e-6


class LatentSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        m = self.mla = cfg.mla
        self.num_heads = h = cfg.num_heads
        q_out = h * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        if m.q_lora_rank is None:
            self.qkv_a_proj = LoRALinear(cfg.hidden_size, [q_out, m.cache_dim],
                                         ["q_proj", "kv_a_proj_with_mqa"])
        else:
            self.qkv_a_proj = LoRALinear(cfg.hidden_size, [m.q_lora_rank, m.cache_dim],
                                         ["q_a_proj", "kv_a_proj_with_mqa"])
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = LoRALinear(m.q_lora_rank, [q_out], ["q_b_proj"])
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = LoRALinear(m.kv_lora_rank, [h * (m.qk_nope_head_dim + m.v_head_dim)], ["kv_b_proj"])
        self.o_proj = LoRALinear(h * m.v_head_dim, [cfg.hidden_size], ["o_proj"])
        self.rotary = rotary
        self.attn = LatentAttention(m, h)

    def fp8_input_block(self, tokens: int) -> int:
        return self.qkv_a_proj.fp8_input_block(tokens)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, x_fp8: Fp8Rows | None = None) -> torch.Tensor:
        m, t = self.mla, x.shape[0]
        q, kv_a = self.qkv_a_proj(x, x_fp8).split(self.qkv_a_proj.output_sizes, dim=-1)
        if m.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q.contiguous()))
        q_nope, q_pe = q.view(t, self.num_heads, -1).split((m.qk_nope_head_dim, m.qk_rope_head_dim), -1)
        latent, k_pe = kv_a.split((m.kv_lora_rank, m.qk_rope_head_dim), -1)
        k_pe = k_pe.view(t, 1, -1)
        if m.rope_interleave:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = self.rotary(positions, q_pe.contiguous(), k_pe.contiguous())
        latent = self.kv_a_layernorm(latent.contiguous())
        o = self.attn(q_nope, q_pe, latent, k_pe.view(t, -1), self.kv_b_proj)
        return self.o_proj(o.reshape(t, -1))


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...): rotating halves of the
    result is rotating the pairs of x."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2).contiguous()


class SharedExpertsMoE(SparseMoE):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, router_name="gate")
        self.shared_experts = GatedMLP(cfg, cfg.moe_intermediate_size * cfg.num_shared_experts)

    def fp8_input_block(self, tokens: int) -> int:
        """Both branches read x: rows for them where they quantize it alike."""
        weights = [self.experts.gate_up_proj, self.shared_experts.gate_up_proj.weight]
        return ops.fp8_input_block(weights, tokens)

    def forward(self, x: torch.Tensor, x_fp8: Fp8Rows | None = None) -> torch.Tensor:
        ctx = get_forward_context()
        if self.experts.tp is not None:  # both branches' partial sums, one all-reduce
            with partial_sums():
                out = super().forward(x, x_fp8) + self.shared_experts(x, x_fp8)
            return self.experts.tp.group.all_reduce(out)
        if ctx.aux_stream is None:
            routed, shared = super().forward(x, x_fp8), self.shared_experts(x, x_fp8)
        else:
            # Decode and short steps: the shared experts (a few small GEMMs and their LoRA
            # kernels, latency bound) run on a side stream beside the routed pipeline. The
            # side stream starts by waiting on this one and this one waits for it before
            # the join, so memory either frees is never reused early; inside, the shared
            # experts' LoRA runs in line (no aux stream: that one serves the routed side).
            side = side_stream(x.device)
            with beside(side), forward_context(replace(ctx, aux_stream=None)):
                shared = self.shared_experts(x, x_fp8)
            routed = super().forward(x, x_fp8)
            join(side)
        return torch.cat((routed, shared.unsqueeze(1)), 1)  # [T, top_k + 1, H], unsummed


class DeepseekV2DecoderLayer(DecoderLayer):
    def make_attention(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> nn.Module:
        return LatentSelfAttention(cfg, rotary)

    def make_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        if layer not in cfg.moe_layers:
            return GatedMLP(cfg)
        return SharedExpertsMoE(cfg) if cfg.num_shared_experts else SparseMoE(cfg, router_name="gate")


class DeepseekV2CausalLM(DenseCausalLM):
    layer_cls = DeepseekV2DecoderLayer
    # --quantization fp8 leaves kv_b_proj in the model's dtype (latent attention reads its
    # weight as per-head tensors, W_uk and W_uv, absorbed into queries and outputs) and the
    # routers (routing is sensitive, V3's carries its correction bias; as DeepSeek's own
    # FP8 checkpoints keep them).
    unquantized_modules = ("kv_b_proj", "gate")

    def checkpoint_skips(self, name: str) -> bool:
        """DeepSeek-V3's multi-token prediction layers (numbered past the model's own),
        which serving does not run."""
        parts = name.split(".")
        return len(parts) > 2 and parts[:2] == ["model", "layers"] and int(parts[2]) >= self.config.num_layers
