"""Token embedding table, also used as the LM head (tied or not)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        # Uninitialised: weights are loaded (or drawn for dummy runs) right after.
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, vocab]."""
        return F.linear(hidden, self.weight).float()
