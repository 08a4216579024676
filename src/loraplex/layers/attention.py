"""Attention over the paged KV cache: store this step's keys/values, then attend (or attend
only, where ops.rotate_and_store stored them)."""

from __future__ import annotations

import torch
from torch import nn

from loraplex import ops
from loraplex.layers.context import get_forward_context
from loraplex.ops.formats import Fp8Rows


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None):
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # Bound by the model runner: [num_blocks, block_size, num_kv_heads, head_dim].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def kv_cache_spec(self) -> dict[str, tuple[int, ...]]:
        """The cache tensors this layer needs, each [num_blocks, block_size, *shape]."""
        return {"k_cache": (self.num_kv_heads, self.head_dim), "v_cache": (self.num_kv_heads, self.head_dim)}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: torch.Tensor | None = None, fp8_block: int = 0
                ) -> tuple[torch.Tensor, Fp8Rows | None]:
        """q [T, Hq, D], k/v [T, Hkv, D] -> (out [T, Hq, D], its e4m3 rows [T, Hq * D] in
        blocks of fp8_block for a W8A8 o_proj, None where 0); sinks [Hq]: see
        ops.paged_attention."""
        ops.write_kv_cache(k, v, self.k_cache, self.v_cache, get_forward_context().attn.slot_mapping)
        return self.attend(q, sinks, fp8_block)

    def attend(self, q: torch.Tensor, sinks: torch.Tensor | None = None, fp8_block: int = 0
               ) -> tuple[torch.Tensor, Fp8Rows | None]:
        """forward, with this step's keys and values already in the cache
        (ops.rotate_and_store wrote them)."""
        out = ops.paged_attention(q, self.k_cache, self.v_cache, get_forward_context().attn, self.scale,
                                  self.sliding_window, sinks, fp8_block)
        return out if fp8_block else (out, None)
