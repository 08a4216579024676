"""Causal-LM cross-entropy over hidden states, chunk by chunk: the [tokens, vocab] logits
(201K columns for gpt-oss) never exist whole. Forward keeps each chunk's log-sum-exp and
target logit only; backward recomputes the chunk's logits and turns them into the hidden
states' gradient at once. The LM head is frozen in LoRA training: no gradient for it."""

from __future__ import annotations

import torch

from loraplex.train.data import IGNORE

# Float32 logits per chunk: a chunk's rows are this over 4 x vocab (gpt-oss's 201K: 333
# rows; a step's peak holds ~3 such tensors). 4,096 rows of 201K had made a 4K-token
# step of gpt-oss-20b peak 11 GiB over its weights.
CHUNK_BYTES = 256 << 20


def chunked_loss_sum(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor,
                     softcap: float | None = None, chunk: int | None = None) -> torch.Tensor:
    """sum over t of -log softmax(logits[t])[labels[t + 1]] (labels IGNORE skipped), with
    logits = hidden @ head^T in float32 (then softcap * tanh(. / softcap) if given).
    hidden [B, T, H], head [V, H], labels [B, T]; `chunk` rows at a time (default: by
    CHUNK_BYTES)."""
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    chunk = chunk or max(1, CHUNK_BYTES // (4 * head.shape[0]))
    return _ChunkedLoss.apply(h, head, targets, softcap, chunk)


def _logits(h: torch.Tensor, head: torch.Tensor, softcap: float | None) -> torch.Tensor:
    z = (h @ head.T).float()
    return z if softcap is None else softcap * torch.tanh(z / softcap)


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, head, targets, softcap, chunk):
        total = h.new_zeros((), dtype=torch.float32)
        for a in range(0, h.shape[0], chunk):
            t = targets[a:a + chunk]
            keep = t != IGNORE
            if not keep.any():
                continue
            z = _logits(h[a:a + chunk][keep], head, softcap)
            total += (torch.logsumexp(z, -1) - z.gather(1, t[keep, None]).squeeze(1)).sum()
        ctx.save_for_backward(h, head, targets)
        ctx.softcap, ctx.chunk = softcap, chunk
        return total

    @staticmethod
    def backward(ctx, grad):
        h, head, targets = ctx.saved_tensors
        softcap, chunk = ctx.softcap, ctx.chunk
        grad_h = torch.zeros_like(h)
        for a in range(0, h.shape[0], chunk):
            t = targets[a:a + chunk]
            keep = t != IGNORE
            if not keep.any():
                continue
            rows = h[a:a + chunk][keep]
            z = (rows @ head.T).float()
            p = torch.softmax(z if softcap is None else softcap * torch.tanh(z / softcap), -1)
            p[torch.arange(len(p), device=p.device), t[keep]] -= 1.0  # d loss / d logits
            if softcap is not None:  # through softcap * tanh(z / softcap)
                p *= 1 - torch.tanh(z / softcap) ** 2
            del z
            # In the head's dtype (float32 accumulation): no float32 copy of the head
            # (2.3 GB for gpt-oss), as autograd through bf16 logits would compute it.
            grad_h[a:a + chunk][keep] = (p.mul_(grad).to(head.dtype) @ head).to(h.dtype)
        return grad_h, None, None, None, None
