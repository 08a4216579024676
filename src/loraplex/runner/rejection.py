"""Verification of speculated tokens: which of a sequence's k proposed tokens the target
model keeps, and the token it adds, so that the output has exactly the target's
distribution (Leviathan et al., 2023; Chen et al., 2023).

Per sequence: target probabilities p_0..p_n over the n + 1 positions the step ran (the
last known token, then each proposal d_1..d_n; p_j predicts the token after position
j), the proposals, and their draft probabilities q_j (None: a deterministic proposer
such as the n-gram one, q_j = one-hot(d_j)). Left to right, d_j is kept with
probability min(1, p_{j-1}(d_j) / q_j(d_j)); at the first rejection the step emits one
token drawn from the residual max(p_{j-1} - q_j, 0), renormalized, and stops; if all n
are kept it draws a bonus token from p_n. Greedy rows keep d_j while it is the argmax
of p_{j-1} and emit the argmax where it is not: the tokens plain greedy decoding gives
(a step whose rows are all greedy takes ops.greedy_accept instead, from the logits'
argmax in one launch).

Plain torch over padded [S, k + 1] layouts (S sequences, k the longest proposal; a
step verifies at most max_num_seqs x (k + 1) rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verified:
    """Per sequence: `num_accepted` proposals kept, and `token_ids` [S, k + 1] whose first
    num_accepted + 1 entries are the step's output tokens (the rest -1)."""

    token_ids: torch.Tensor
    num_accepted: torch.Tensor


def rejection_sample(
    probs: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    greedy: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Verified:
    """probs [S, k + 1, V] float32: the target's sampling distributions (after
    temperature, top-k / top-p; rows past a sequence's n + 1 are ignored); draft_ids [S,
    k] int64 (entries past num_drafts[s] ignored); num_drafts [S] int64 in 0..k; greedy
    [S] bool: rows that decode greedily (their probs need only rank the tokens);
    draft_probs [S, k, V] or None (deterministic proposals)."""
    s, k1, vocab = probs.shape
    k = k1 - 1
    assert draft_ids.shape == (s, k) and num_drafts.shape == (s,) and greedy.shape == (s,)
    device = probs.device
    positions = torch.arange(k, device=device)
    valid = positions[None, :] < num_drafts[:, None]  # [S, k]
    drafts = draft_ids.clamp(0, vocab - 1)
    p_draft = probs[:, :k].gather(-1, drafts[..., None])[..., 0]  # p_{j-1}(d_j)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, drafts[..., None])[..., 0]
    uniform = torch.rand(p_draft.shape, device=device, generator=generator)
    # u < p / q, written without dividing by a zero q (a draft never proposes those).
    kept_random = uniform * q_draft < p_draft
    kept_greedy = drafts == probs[:, :k].argmax(dim=-1)
    kept = torch.where(greedy[:, None], kept_greedy, kept_random) & valid
    # Proposals kept before the first rejection (or the end of the proposal).
    num_accepted = torch.cumprod(kept.long(), dim=-1).sum(dim=-1)

    # The extra token: from position num_accepted, the residual after a rejection, else
    # (all kept) the target's own distribution there.
    rows = torch.arange(s, device=device)
    p_next = probs[rows, num_accepted]  # [S, V]
    rejected = num_accepted < num_drafts
    if draft_probs is None:
        q_next = torch.zeros_like(p_next)
        at = num_accepted.clamp(max=k - 1) if k else num_accepted
        if k:  # scatter_ of a number: no host value to copy in, so no wait for the device
            q_next.scatter_(1, drafts[rows, at][:, None], 1.0)
    else:
        q_next = draft_probs[rows, num_accepted.clamp(max=max(k - 1, 0))] if k else torch.zeros_like(p_next)
    residual = torch.where(rejected[:, None], (p_next - q_next).clamp_min(0.0), p_next)
    # A residual of float rounding only (p == q): fall back to p itself.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p_next, residual)
    race = torch.empty_like(residual).exponential_(generator=generator).clamp_min_(1e-20)
    drawn = (residual / race).argmax(dim=-1)
    extra = torch.where(greedy, p_next.argmax(dim=-1), drawn)

    return _verified(draft_ids, num_accepted, extra)


def _verified(draft_ids: torch.Tensor, num_accepted: torch.Tensor, extra: torch.Tensor) -> Verified:
    """The step's tokens: the kept proposals, then the extra token, then -1."""
    positions = torch.arange(draft_ids.shape[1] + 1, device=draft_ids.device)[None, :]
    padded = torch.cat((draft_ids, extra[:, None]), dim=1)
    out = torch.where(positions < num_accepted[:, None], padded,
                      torch.where(positions == num_accepted[:, None], extra[:, None], -1))
    return Verified(token_ids=out, num_accepted=num_accepted)
