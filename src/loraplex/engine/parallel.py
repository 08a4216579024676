"""Parallel sampling: a request with n samples (or best_of candidates) runs as that many
child requests, whose outputs fold back into one RequestOutput with one CompletionOutput
per sample (index i for child i).

Children after the first wait until it has its first token: by then its prompt's pages
are in the prefix cache, so the others compute only the prompt's last partial page.
Child i draws with seed + i when the request is seeded, so sample i equals a single
request with that seed. With best_of > n the n candidates of highest cumulative logprob
are returned when all have finished (OpenAI's legacy completions field).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from loraplex.types import CompletionOutput, RequestOutput, SamplingParams


def child_id(request_id: str, i: int) -> str:
    return f"{request_id}#{i}"


@dataclass
class ParentRequest:
    request_id: str
    sampling: SamplingParams
    child_ids: list[str] = field(default_factory=list)
    latest: dict[str, RequestOutput] = field(default_factory=dict)  # child id -> its newest output
    error: Exception | None = None

    @property
    def num_children(self) -> int:
        return self.sampling.best_of or self.sampling.n

    def child_sampling(self, i: int) -> SamplingParams:
        sp = self.sampling
        # best_of ranks candidates by cumulative logprob: every child computes its own.
        logprobs = sp.logprobs if sp.logprobs is not None or not self.ranks else 0
        return replace(sp, n=1, best_of=None, seed=None if sp.seed is None else sp.seed + i,
                       logprobs=logprobs)

    @property
    def ranks(self) -> bool:
        return (self.sampling.best_of or 1) > self.sampling.n

    @property
    def finished(self) -> bool:
        return self.error is not None or (
            len(self.latest) == len(self.child_ids) and all(o.finished for o in self.latest.values()))

    def fold(self, out: RequestOutput) -> None:
        self.latest[out.request_id] = out
        if out.error is not None and self.error is None:
            self.error = out.error

    def output(self) -> RequestOutput:
        """The parent's output now: every child's sample so far (the best n once all
        candidates have finished, with best_of)."""
        first = next(iter(self.latest.values()))
        samples = [(i, self.latest[c].outputs[0]) for i, c in enumerate(self.child_ids) if c in self.latest]
        if self.ranks:
            if not self.finished:
                samples = []  # the best are known only at the end
            else:
                samples = sorted(samples, key=lambda s: -(s[1].cumulative_logprob or 0.0))[: self.sampling.n]
                samples = list(enumerate(s for _, s in samples))
        outputs = [_indexed(c, i, self.sampling.logprobs is not None) for i, c in samples]
        cached = max(o.num_cached_tokens for o in self.latest.values())
        return replace(first, request_id=self.request_id, outputs=outputs, finished=self.finished,
                       error=self.error, num_cached_tokens=cached)


def _indexed(c: CompletionOutput, index: int, keep_logprobs: bool) -> CompletionOutput:
    if keep_logprobs:
        return replace(c, index=index)
    return replace(c, index=index, logprobs=None)
