"""Grammar matchers of structured requests, on the sampler's side of the runner.

Each structured request has a matcher fed every token it samples, in order; before a
row samples, its matcher fills the row of a bitmask of the tokens its grammar allows
next (at the end of the grammar, only the stop tokens), which the sampler applies to
the logits. The token a request sampled in the step still in flight (async
scheduling) is read from that step's output: the host waits for that step's small copy
while the device runs this step's forward, so the overlap stays.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from loraplex.types import ScheduledChunk

log = logging.getLogger(__name__)


@dataclass
class _Matcher:
    matcher: object  # xgrammar.GrammarMatcher
    accepted: int = 0  # output tokens fed so far
    broken: bool = False  # a token the grammar rejects was fed: only a stop token may follow


class GrammarRows:
    def __init__(self, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._matchers: dict[str, _Matcher] = {}

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def clear(self) -> None:
        """After a failed step: tokens fed may be dropped; matchers are rebuilt from the
        known outputs."""
        self._matchers.clear()

    def bitmask(self, chunks: list[ScheduledChunk], pending_ids) -> tuple[torch.Tensor, list[int]] | None:
        """(bitmask [rows, ceil(V / 32)] int32 on the host, the sampled rows it covers)
        for the chunks (in sampled-row order) that follow a grammar, or None.
        pending_ids(request_id) -> the id its row sampled in the step in flight."""
        rows = [(j, c) for j, c in enumerate(chunks) if c.grammar is not None]
        if not rows:
            return None
        import xgrammar
        # One mask row per sampled row (xgrammar's indices name rows of both), applied
        # to the structured ones only.
        mask = xgrammar.allocate_token_bitmask(len(chunks), self.vocab_size)
        for k, c in rows:
            state = self._matchers.get(c.request_id)
            if state is None:
                state = self._matchers[c.request_id] = _Matcher(xgrammar.GrammarMatcher(c.grammar))
            outputs = c.history[1]
            tokens = list(outputs[state.accepted:])
            if c.num_output_tokens > len(outputs):  # one more in flight
                tokens.append(pending_ids(c.request_id))
            for t in tokens:
                if state.broken or state.matcher.is_terminated():
                    break
                if not state.matcher.accept_token(t):
                    # Masked sampling never does this; if it happens (a row with no allowed
                    # token left) the request ends, rather than the step failing for all.
                    log.warning("request %s sampled token %d outside its grammar; ending it",
                                c.request_id, t)
                    state.broken = True
            state.accepted += len(tokens)
            if not (state.broken or state.matcher.is_terminated()):
                state.matcher.fill_next_token_bitmask(mask, k)
            # At the end, or where no token of this vocabulary spells what the grammar
            # needs next, only a stop token may follow: the request ends.
            if state.broken or state.matcher.is_terminated() or not mask[k].any():
                mask[k] = 0
                for t in self.stop_token_ids:
                    bit = 1 << (t % 32)
                    mask[k, t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 words
        return mask, [k for k, _ in rows]


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """Disallowed tokens of `rows` to -inf, in place (xgrammar's kernel for the device)."""
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True), indices=rows)
