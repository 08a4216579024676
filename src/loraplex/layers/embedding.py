"""Token embedding table, also used as the LM head (tied or not).

Under tensor parallelism (`tp`, a VocabShard) each rank holds a run of the vocabulary's
rows: a lookup outside it gives zeros and one all-reduce joins the ranks' rows; the
head's logits are gathered across ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.layers.parallel import VocabShard


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
        self.tp: VocabShard | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if tp is None:
            h = F.embedding(input_ids, self.weight)
        else:
            local = input_ids - tp.lo
            held = (local >= 0) & (local < tp.hi - tp.lo)
            h = F.embedding(torch.where(held, local, 0), self.weight)
            h = tp.group.all_reduce(h * held.unsqueeze(-1).to(h.dtype))
        if self.scale is not None:
            h = h * torch.tensor(self.scale, dtype=h.dtype)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, vocab]."""
        logits = F.linear(hidden, self.weight).float()
        if self.tp is not None:
            logits = self.tp.group.all_gather_columns(logits)[:, : self.tp.vocab]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
