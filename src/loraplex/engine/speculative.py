"""Speculative decoding, host side: which requests speculate, how many tokens each
proposes, whether the n-gram proposer would find a proposal, and that proposer's plain
definition (the configuration, vLLM's `--speculative-config` JSON:
config.SpeculativeConfig).

The n-gram proposer (vLLM's "ngram", prompt lookup decoding) needs no model: for the
longest n in [prompt_lookup_min, prompt_lookup_max] whose last n tokens of a sequence
occurred earlier in it, the tokens that followed the latest earlier occurrence are the
proposal, num_speculative_tokens of them. Where those run into the sequence's end (the
occurrence lies within the last few tokens: a run such as "....", or a line that
repeats), the sequence repeats with that period, and the proposal goes on repeating it,
as an LZ77 copy does (truncated there, a degenerate adapter output that repeats one
token gave 3 tokens a verify step of k = 4 instead of 5; Gemma 3 270M, quote workload).
It reads only its own sequence's tokens, so proposals never cross requests. The runner
makes the proposals on the device (runner/ngram_drafts.py, ops.ngram_inputs; propose_ngram
below is their oracle), verifies them in one forward (runner/rejection.py) and keeps
the target model's distribution exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loraplex.types import SamplingParams


def speculates(sp: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request's next tokens may be proposed and verified in one step. Left
    out (they decode a token a step): requests that opt out (speculate=False), rows
    whose sampling reads the tokens before them (penalties, logit_bias, min_p, a
    grammar), rows still under min_tokens, rows that return logprobs, and seeded random
    rows (their draws are keyed by token index, which verification's draws are not)."""
    return (sp.speculate and sp.logprobs is None and sp.structured_outputs is None and not sp.logit_bias
            and sp.repetition_penalty == 1.0 and not sp.frequency_penalty and not sp.presence_penalty
            and not sp.min_p and num_output_tokens >= sp.min_tokens and (sp.seed is None or sp.greedy))


# Adaptivity. Per request, an exponential average of the share of its proposals kept,
# starting at ACCEPTANCE_PRIOR; it sets how many tokens the request proposes. A step
# with no n-gram match proposes nothing and costs nothing, so it leaves the average be:
# counting it as none kept had held requests that quote with gaps (an adapter's output
# that repeats its input between its own words) at k / 2 (Gemma 3 270M's quote workload,
# 8 in flight: 1.97 tokens a decode step at the median request, 2.41 without, on CPU).
# Below MIN_ACCEPTANCE the request stops proposing: every step that proposes costs the
# engine its overlap of planning with the step in flight (a proposal extends the tokens
# that step samples) and verification work (k = 4 at 16 in flight: 1.22-1.29x a decode
# step for Llama-3.1-8B and gpt-oss-20b, H100), so proposals rarely kept only slow the
# run. Such a request probes with one token on plans whose index is a multiple of its
# probe period:
# PROBE_PERIOD, doubled by each probe verified and not kept (up to MAX_PROBE_PERIOD;
# powers of two, so the probes of all requests fall on the same plans and the engine
# gives its overlap up once for them); a kept probe brings the request back.
ACCEPTANCE_PRIOR = 0.5
ACCEPTANCE_WEIGHT = 0.3
FULL_LENGTH_ACCEPTANCE = 0.5
MIN_ACCEPTANCE = 0.25
PROBE_PERIOD = 8
MAX_PROBE_PERIOD = 128


def draft_length(k: int, acceptance: float, probe: bool = False) -> int:
    """How many tokens a request whose recent proposals were kept at rate `acceptance`
    proposes: k, half of k, or none (one on a probe step)."""
    if acceptance >= FULL_LENGTH_ACCEPTANCE:
        return k
    if acceptance >= MIN_ACCEPTANCE:
        return max(1, k // 2)
    return 1 if probe else 0


@dataclass
class Acceptance:
    """A request's record of its proposals (see Adaptivity above)."""

    rate: float = ACCEPTANCE_PRIOR
    probe_period: int = PROBE_PERIOD

    def draft_length(self, k: int, plan_index: int) -> int:
        return draft_length(k, self.rate, plan_index % self.probe_period == 0)

    def observe(self, kept: int, proposed: int) -> None:
        """The outcome of a proposal: `kept` of `proposed` tokens."""
        if not proposed:
            return
        if self.rate < MIN_ACCEPTANCE:  # a probe verified
            self.probe_period = PROBE_PERIOD if kept else min(2 * self.probe_period, MAX_PROBE_PERIOD)
        self.rate += ACCEPTANCE_WEIGHT * (kept / proposed - self.rate)


class SeenSuffix:
    """Whether the n-gram proposer would find a proposal for a growing sequence, without
    proposing: its last n_min tokens occurred earlier with a token after them (a longer
    matching suffix implies this one). For proposals made on the device
    (runner/ngram_drafts.py) the scheduler asks this of the tokens it knows, one step
    behind, to decide whether a request proposes. A set of the n_min-grams followed by
    a token, grown as tokens arrive (an index of the n-grams of every length, built in
    Python loops, held the first decode step of 8 requests starting together ~20 ms)."""

    def __init__(self, n_min: int):
        self.n = n_min
        self.tokens: list[int] = []
        self.seen: set[tuple[int, ...]] = set()

    def matches(self, prompt: list[int], output: list[int]) -> bool:
        tokens, n = self.tokens, self.n
        old = len(tokens)
        if old < len(prompt):
            tokens.extend(prompt[old:])
        tokens.extend(output[len(tokens) - len(prompt):])
        length = len(tokens)
        # n-grams tokens[i : i + n] with a token after them: i <= length - 1 - n; those
        # with i <= old - 1 - n are in already.
        first = max(0, old - n)
        self.seen.update(zip(*(tokens[first + j: length - n + j] for j in range(n))))
        return length > n and tuple(tokens[length - n:]) in self.seen


def continuation(tokens: list[int], e: int, k: int) -> list[int]:
    """k tokens from tokens[e] on, where tokens[e - n: e] matched the sequence's last n:
    past its end the sequence repeats with period len(tokens) - e."""
    period = len(tokens) - e
    return [tokens[e + j % period] for j in range(k)]


def propose_ngram(tokens: list[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """The k tokens that followed the latest earlier occurrence of the sequence's
    longest matching suffix of n_min..n_max tokens (continuation()); [] where none
    occurred."""
    seq = np.asarray(tokens, dtype=np.int64)
    length = len(seq)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = seq[length - n:]
        # Windows that start before the suffix itself and leave a token after them.
        windows = np.lib.stride_tricks.sliding_window_view(seq[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            return continuation(seq.tolist(), int(hits[-1]) + n, k)
    return []
