"""DeepSeek's multi-head latent attention over the paged cache: each token keeps one
normed KV latent and one rotary key (cache_dim values per layer, whatever the number of
heads); queries attend over the latents with kv_b_proj absorbed into them
(ops.mla_attention), so keys and values are never expanded. kv_b_proj's adapter stays
exact: its delta B A is absorbed the same way, per token's slot (ops.MLALoRA)."""

from __future__ import annotations

import torch
from torch import nn

from loraplex import ops
from loraplex.config import MLAConfig
from loraplex.layers.context import get_forward_context
from loraplex.layers.linear import LoRALinear
from loraplex.ops.metadata import MLALoRA


class LatentAttention(nn.Module):
    def __init__(self, mla: MLAConfig, num_heads: int):
        super().__init__()
        self.mla, self.num_heads = mla, num_heads
        # Bound by the model runner (kv_cache_spec): [num_blocks, block_size, cache_dim].
        self.latent_cache: torch.Tensor | None = None

    def kv_cache_spec(self) -> dict[str, tuple[int, ...]]:
        """The cache tensors this layer needs, each [num_blocks, block_size, *shape]."""
        return {"latent_cache": (self.mla.cache_dim,)}

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                kv_b: LoRALinear) -> torch.Tensor:
        """q_nope [T, H, n], q_pe [T, H, d] (rotated), latent [T, r] (normed), k_pe [T, d]
        (rotated) -> [T, H, v]."""
        m, attn = self.mla, get_forward_context().attn
        ops.write_latent_cache(torch.cat((latent, k_pe), -1), self.latent_cache, attn.slot_mapping)
        w = kv_b.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_uk, w_uv = w.split((m.qk_nope_head_dim, m.v_head_dim), 1)
        return ops.mla_attention(q_nope, q_pe, self.latent_cache, w_uk, w_uv, attn, m.scale,
                                 self._lora(kv_b))

    def _lora(self, kv_b: LoRALinear) -> MLALoRA | None:
        batch = kv_b.lora_batch()
        if batch is None:
            return None
        m, w = self.mla, kv_b.lora
        b = w.b.view(w.b.shape[0], self.num_heads, m.qk_nope_head_dim + m.v_head_dim, w.b.shape[-1])
        b_k, b_v = b.split((m.qk_nope_head_dim, m.v_head_dim), 2)
        return MLALoRA(w.a[0], b_k, b_v, batch)
