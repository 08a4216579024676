"""Sampling by the exponential race, one row at a time (the oracle of the fused kernel)."""

from __future__ import annotations

import torch

# An exponential draw is clamped here: a zero would make every score infinite.
MIN_DRAW = 1e-20


def race_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    for i in range(logits.shape[0]):
        row = logits[i].float()
        t = float(temperature[i])
        if t < 1e-5:
            out[i] = row.argmax()
            continue
        gen = torch.Generator(logits.device).manual_seed(int(seeds[i]))
        draw = torch.empty_like(row).exponential_(generator=gen).clamp_min_(MIN_DRAW)
        out[i] = (row / t - draw.log()).argmax()
    return out
