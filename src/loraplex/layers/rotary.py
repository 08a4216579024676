"""Rotary position embedding: a float32 cos/sin table per position, applied by an op."""

from __future__ import annotations

import math

import torch
from torch import nn

from loraplex import ops


def rope_inv_freq(head_dim: int, theta: float, params: dict) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] for rope_type default, linear and llama3."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "linear":
        return inv_freq / params["factor"]
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(medium, blended, scaled)
    assert kind == "default", f"rope_type {kind!r}"
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, params: dict):
        """params: Hugging Face rope parameters (rope_theta, rope_type, scaling fields)."""
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, params["rope_theta"], params)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin", torch.cat((freqs.cos(), freqs.sin()), -1), False)

    def forward(self, positions, q, k):
        return ops.rotary_embedding(q, k, positions, self.cos_sin)
