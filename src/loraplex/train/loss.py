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
                     softcap: float | None = None, chunk: int | None = None,
                     sync_free: bool = False) -> torch.Tensor:
    """sum over t of -log softmax(logits[t])[labels[t + 1]] (labels IGNORE skipped), with
    logits = hidden @ head^T in float32 (then softcap * tanh(. / softcap) if given).
    hidden [B, T, H], head [V, H], labels [B, T]; `chunk` rows at a time (default: by
    CHUNK_BYTES). Rows labelled IGNORE are left out of the head's GEMMs, which takes their
    count to the host; sync_free computes them and zeroes their terms instead (a CUDA
    graph cannot wait for the host)."""
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    chunk = chunk or max(1, CHUNK_BYTES // (4 * head.shape[0]))
    return _ChunkedLoss.apply(h, head, targets, softcap, chunk, sync_free)


def _rows(t: torch.Tensor, sync_free: bool):
    """The chunk's rows that count: (index or slice, their targets, 0/1 weights or None)."""
    keep = t != IGNORE
    if sync_free:
        return slice(None), torch.where(keep, t, 0), keep
    return keep, t[keep], None


def _logits(h: torch.Tensor, head: torch.Tensor, softcap: float | None) -> torch.Tensor:
    z = (h @ head.T).float()
    return z if softcap is None else softcap * torch.tanh(z / softcap)


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, head, targets, softcap, chunk, sync_free):
        total = h.new_zeros((), dtype=torch.float32)
        for a in range(0, h.shape[0], chunk):
            rows, t, weight = _rows(targets[a:a + chunk], sync_free)
            if weight is None and not t.numel():
                continue
            z = _logits(h[a:a + chunk][rows], head, softcap)
            terms = torch.logsumexp(z, -1) - z.gather(1, t[:, None]).squeeze(1)
            total += (terms if weight is None else terms * weight).sum()
        ctx.save_for_backward(h, head, targets)
        ctx.softcap, ctx.chunk, ctx.sync_free = softcap, chunk, sync_free
        return total

    @staticmethod
    def backward(ctx, grad):
        h, head, targets = ctx.saved_tensors
        softcap, chunk, sync_free = ctx.softcap, ctx.chunk, ctx.sync_free
        grad_h = torch.zeros_like(h)
        for a in range(0, h.shape[0], chunk):
            rows, t, weight = _rows(targets[a:a + chunk], sync_free)
            if weight is None and not t.numel():
                continue
            z = (h[a:a + chunk][rows] @ head.T).float()
            p = torch.softmax(z if softcap is None else softcap * torch.tanh(z / softcap), -1)
            p[torch.arange(len(p), device=p.device), t] -= 1.0  # d loss / d logits
            if softcap is not None:  # through softcap * tanh(z / softcap)
                p *= 1 - torch.tanh(z / softcap) ** 2
            del z
            p.mul_(grad if weight is None else grad * weight[:, None])
            # In the head's dtype (float32 accumulation): no float32 copy of the head
            # (2.3 GB for gpt-oss), as autograd through bf16 logits would compute it.
            grad_h[a:a + chunk][rows] = (p.to(head.dtype) @ head).to(h.dtype)
        return grad_h, None, None, None, None, None
