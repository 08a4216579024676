"""Sampling and logprobs, batched over rows with different parameters.

Semantics are vLLM's: a structured request's grammar mask, then logit_bias and
penalties (runner/logit_rules.py);
temperature < 1e-5 is greedy; then min_p, top-k, top-p (keep the smallest set of most
likely tokens whose probability reaches top_p); logprobs are the model's raw
log-softmax, before any of these. Random rows draw by the exponential race
(argmax p / E, E ~ Exp(1), which picks token i with probability p_i). Two paths:
- rows with only a temperature (the common case) go through `ops.race_sample`, one
  fused pass over the logits whose draws are keyed by a per-row seed the runner gives
  (a seeded request's seed and its token index, so its tokens do not depend on its
  batch);
- a step with top-k / top-p, banned tokens or logit rules takes the torch path below, whose draws
  come from the shared generator, or from a seeded request's own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex import ops
from loraplex.device import to_device
from loraplex.runner.logit_rules import LogitRules, apply_rules, min_p_mask
from loraplex.runner.structured import apply_bitmask


@dataclass
class SamplingRows:
    """Per-row sampling parameters of one step, host side."""

    temperature: list[float]
    top_k: list[int]  # 0: off
    top_p: list[float]  # 1.0: off
    generators: list[torch.Generator | None]  # per-request generator, or None: the shared one
    banned: list[list[int]]  # tokens that may not be sampled (min_tokens)
    seeds: list[int] | None = None  # per-row draw keys of the fused path (None: torch path only)
    # Per row: logit_bias, penalties, min_p (runner/logit_rules.py), or None; and the last
    # step's sampled ids on the device, where a penalized row's in-flight token is.
    rules: list[LogitRules | None] | None = None
    last_ids: torch.Tensor | None = None
    # Structured outputs: the bitmask of tokens allowed (runner/structured.py) and the
    # rows it covers.
    grammar: tuple[torch.Tensor, list[int]] | None = None

    @property
    def has_rules(self) -> bool:
        return self.grammar is not None or (self.rules is not None and any(r is not None for r in self.rules))

    @property
    def min_p(self) -> list[float]:
        return [r.min_p if r is not None else 0.0 for r in self.rules or [None] * len(self.temperature)]

    @property
    def all_greedy(self) -> bool:
        return all(t < 1e-5 for t in self.temperature)

    def truncates(self, vocab: int) -> bool:
        """Some row keeps only its top-k / top-p tokens."""
        return any(0 < k < vocab for k in self.top_k) or any(p < 1.0 for p in self.top_p)

    def only_temperature(self, vocab: int) -> bool:
        """No row truncates (top-k / top-p) or bans tokens, or has logit rules."""
        return not any(self.banned) and not self.truncates(vocab) and not self.has_rules

    def fused(self, vocab: int) -> bool:
        """sample() draws these rows with ops.race_sample."""
        return self.seeds is not None and not self.all_greedy and self.only_temperature(vocab)

    def modifies_logits(self, vocab: int) -> bool:
        """Whether sample() writes into the logits it is given."""
        return any(self.banned) or self.has_rules or not (self.all_greedy or self.fused(vocab))


def sample(logits: torch.Tensor, rows: SamplingRows, generator: torch.Generator) -> torch.Tensor:
    """logits [N, V] float32 -> sampled token ids [N] (int64). May modify logits."""
    n, vocab = logits.shape
    device = logits.device
    if rows.fused(vocab):
        return ops.race_sample(logits, to_device(rows.temperature, torch.float32, device),
                               to_device(rows.seeds, torch.int64, device))
    if rows.grammar is not None:
        apply_bitmask(logits, *rows.grammar)
    if rows.rules is not None and any(r is not None for r in rows.rules):
        apply_rules(logits, rows.rules, rows.last_ids)
    ban_rows = [i for i, banned in enumerate(rows.banned) for _ in banned]
    if ban_rows:
        ban_cols = [t for banned in rows.banned for t in banned]
        index = to_device([ban_rows, ban_cols], torch.int64, device)
        logits[index[0], index[1]] = float("-inf")
    greedy_ids = logits.argmax(dim=-1)
    if rows.all_greedy:
        return greedy_ids

    temperature = to_device(rows.temperature, torch.float32, device)
    greedy = temperature < 1e-5
    logits.div_(torch.where(greedy, 1.0, temperature)[:, None])
    if any(rows.min_p):
        logits.masked_fill_(min_p_mask(logits.softmax(dim=-1), rows.min_p), float("-inf"))
    if rows.truncates(vocab):
        logits = _top_k_top_p(logits, rows.top_k, rows.top_p)
    probs = logits.softmax(dim=-1)

    # One draw for the whole batch from the shared generator (indexing rows by a host
    # list would block on a host-to-device copy); seeded rows then redraw from their own.
    race = torch.empty_like(probs)
    if any(g is None for g in rows.generators):
        race.exponential_(generator=generator)
    for i, g in enumerate(rows.generators):
        if g is not None:
            race[i].exponential_(generator=g)
    # A zero draw would turn 0 / 0 into NaN, which argmax picks: keep draws positive.
    random_ids = (probs / race.clamp_min_(1e-20)).argmax(dim=-1)
    return torch.where(greedy, greedy_ids, random_ids)


def sampling_probs(logits: torch.Tensor, temperature: list[float], top_k: list[int],
                   top_p: list[float]) -> torch.Tensor:
    """The distribution sample() draws a row from when only temperature, top-k and top-p
    apply, [N, V] float32 (greedy rows: the softmax of their logits, whose argmax is
    their token). Speculative verification needs it whole. May modify logits."""
    t = to_device([x if x >= 1e-5 else 1.0 for x in temperature], torch.float32, logits.device)
    logits = logits.float().div_(t[:, None])
    if any(0 < k < logits.shape[-1] for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    return logits.softmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = to_device([kk if 0 < kk < vocab else vocab for kk in top_k], torch.int64, logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits.masked_fill_(ranks >= k[:, None], float("-inf"))
    p = to_device(top_p, torch.float32, logits.device)[:, None]
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
    # p >= 1 is off: float32 cumsum can reach 1 before the tail, which must not be cut.
    remove = (mass_before >= p) & (p < 1.0)
    remove[:, 0] = False
    sorted_logits.masked_fill_(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


@dataclass
class TokenLogprobs:
    """Log-probabilities of chosen tokens and of each row's most likely ones."""

    chosen: torch.Tensor  # [N] float32: logprob of the chosen token
    rank: torch.Tensor  # [N] int64: 1 + tokens strictly more likely than the chosen one
    top_values: torch.Tensor  # [N, k] float32
    top_ids: torch.Tensor  # [N, k] int64


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, num_top: int) -> TokenLogprobs:
    """Raw logprobs of `chosen` [N] under logits [N, V], and the top `num_top` per row."""
    logprobs = logits.log_softmax(dim=-1)
    chosen_lp = logprobs.gather(-1, chosen[:, None])
    rank = (logprobs > chosen_lp).sum(dim=-1) + 1
    num_top = min(num_top, logprobs.shape[-1])
    top = logprobs.topk(num_top, dim=-1) if num_top else None
    empty = logprobs.new_empty(len(chosen), 0)
    return TokenLogprobs(
        chosen=chosen_lp[:, 0],
        rank=rank,
        top_values=top.values if top else empty,
        top_ids=top.indices if top else empty.long(),
    )
