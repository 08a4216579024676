"""Rotary position embedding: a float32 cos/sin table per position, applied by an op."""

from __future__ import annotations

import math

import torch
from torch import nn

from loraplex import ops
from loraplex.ops.metadata import QKNorm


def rope_inv_freq(head_dim: int, theta: float, params: dict) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] for rope_type default, linear, llama3 and yarn."""
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
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, params)
    assert kind == "default", f"rope_type {kind!r}"
    return inv_freq


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, params: dict) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters): dimensions that turn more than
    beta_fast times over the original context keep their frequency, those under
    beta_slow turns are divided by `factor`, a linear ramp blends the ones between."""
    factor, old_len = params["factor"], params["original_max_position_embeddings"]
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def dim_of(turns):  # the dimension index that turns `turns` times over old_len
        return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against dividing by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    interpolated = 1.0 / (factor * theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return interpolated * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(params: dict) -> float:
    """What YaRN multiplies cos and sin by (so q.k by its square); 1 for other rope types."""
    if params.get("rope_type", params.get("type")) != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return params["attention_factor"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = params["factor"], params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, m) / mscale(factor, m_all)
    return mscale(factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, params: dict):
        """params: Hugging Face rope parameters (rope_theta, rope_type, scaling fields)."""
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, params["rope_theta"], params)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1) * rope_attention_factor(params)
        self.register_buffer("cos_sin", cos_sin, False)

    def forward(self, positions, q, k, qk_norm: QKNorm | None = None):
        return ops.rotary_embedding(q, k, positions, self.cos_sin, qk_norm)
