"""Token embedding table, also used as the LM head (tied or not)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None,
                 softcap: float | None = None):
        """scale: embeddings are multiplied by it (Gemma: sqrt(hidden), in the model
        dtype); softcap: logits = softcap * tanh(logits / softcap)."""
        super().__init__()
        # Uninitialised: weights are loaded (or drawn for dummy runs) right after.
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), False)
        self.scale = scale
        self.softcap = softcap

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = F.embedding(input_ids, self.weight)
        if self.scale is not None:
            h = h * torch.tensor(self.scale, dtype=h.dtype)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, vocab]."""
        logits = F.linear(hidden, self.weight).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
