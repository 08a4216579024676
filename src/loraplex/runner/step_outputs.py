"""A launched step's device outputs, copied to the host without blocking, and turned
into a StepResult once they arrive.

Launching a step queues its work and the device-to-host copies of sampled ids and
logprobs, then records an event. Collecting waits on that event only, so the engine can
plan and launch the next step before reading this one's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplex.runner.sampler import TokenLogprobs
from loraplex.types import Logprob, PositionLogprobs, StepPlan, StepResult


@dataclass
class StepTiming:
    """Where one step's time went (the bench's step profile): host seconds, and on a GPU
    device events around its work."""

    num_tokens: int
    num_slot_loads: int  # adapters copied into slots by this step
    launch_s: float = 0.0  # host time in runner.launch
    slot_load_s: float = 0.0  # of which, queueing the slot copies
    total_s: float = 0.0  # the engine's whole step, launch and the previous step's results
    device: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # around its device work
    # On the copy stream: it reached the loads, the slots' last readers were done, the
    # copies were done.
    slot_copies: tuple[torch.cuda.Event, ...] | None = None


@dataclass
class LaunchedStep:
    plan: StepPlan
    # Sampled rows: plan chunk index, logprobs wanted (None: none), per row.
    sample_chunks: list[int] = field(default_factory=list)
    sample_logprobs: list[int | None] = field(default_factory=list)
    token_ids: torch.Tensor | None = None  # [rows] on the device
    sample_lps: TokenLogprobs | None = None
    # Prompt logprobs: (chunk index, task) in row order, and their logprobs.
    prompt_tasks: list = field(default_factory=list)
    prompt_lps: TokenLogprobs | None = None
    # Speculated chunks (plan indices) and their verification, [S, k + 3] (ops.greedy_accept):
    # k + 1 token ids, of which the first a + 1 are the output; a; the proposal's length.
    spec_chunks: list[int] = field(default_factory=list)
    spec_verified: torch.Tensor | None = None
    _host: dict = field(default_factory=dict)
    _event: torch.cuda.Event | None = None
    timing: StepTiming | None = None  # when launched with timed=True

    def start_copies(self) -> None:
        """Queue device-to-host copies of everything the host will read."""
        tensors = {"token_ids": self.token_ids, "spec_verified": self.spec_verified}
        for name in ("sample_lps", "prompt_lps"):
            lps = getattr(self, name)
            if lps is not None:
                for part in ("chosen", "rank", "top_values", "top_ids"):
                    tensors[f"{name}.{part}"] = getattr(lps, part)
        cuda = False
        for key, t in tensors.items():
            if t is not None:
                cuda |= t.is_cuda
                self._host[key] = t.to("cpu", non_blocking=True) if t.is_cuda else t
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def sampled_ids(self) -> list[int]:
        """This step's sampled ids on the host (waits for its copies, not later steps)."""
        if self._event is not None:
            self._event.synchronize()
        if "ids" not in self._host:
            self._host["ids"] = self._host["token_ids"].tolist()
        return self._host["ids"]

    def result(self) -> StepResult:
        """Wait for this step's copies (not for later steps) and build its StepResult."""
        if self._event is not None:
            self._event.synchronize()
        n = len(self.plan.chunks)
        result = StepResult([None] * n, [None] * n, [None] * n)
        if self.token_ids is not None:
            ids = self.sampled_ids()
            lps = self._host_lps("sample_lps")
            for j, (i, want) in enumerate(zip(self.sample_chunks, self.sample_logprobs)):
                result.sampled_token_ids[i] = ids[j]
                if want is not None:
                    result.logprobs[i] = position_logprobs(lps, j, ids[j], want)
        if self.spec_chunks:
            device_drafts = self.plan.chunks[self.spec_chunks[0]].device_drafts
            for i, row in zip(self.spec_chunks, self._host["spec_verified"].tolist()):
                *ids, accepted, proposed = row
                result.speculated[i] = ids[: accepted + 1]
                if device_drafts:
                    result.num_proposed[i] = proposed
        if self.prompt_tasks:
            lps = self._host_lps("prompt_lps")
            j = 0
            for i, task in self.prompt_tasks:
                result.prompt_logprobs[i] = [
                    position_logprobs(lps, j + k, tid, task.num_top)
                    for k, tid in enumerate(task.target_ids)
                ]
                j += len(task.target_ids)
        return result

    def _host_lps(self, name: str):
        if f"{name}.chosen" not in self._host:
            return None
        return TokenLogprobs(*(self._host[f"{name}.{p}"].tolist()
                               for p in ("chosen", "rank", "top_values", "top_ids")))


def concat_logprobs(parts: list[TokenLogprobs]) -> TokenLogprobs:
    return TokenLogprobs(*(torch.cat(ts) for ts in zip(*(
        (p.chosen, p.rank, p.top_values, p.top_ids) for p in parts))))


def position_logprobs(lps: TokenLogprobs, row: int, token_id: int, num_top: int) -> PositionLogprobs:
    """The chosen token's Logprob plus the row's top `num_top`, as vLLM returns them."""
    out = {token_id: Logprob(lps.chosen[row], lps.rank[row])}
    for rank, (tid, value) in enumerate(zip(lps.top_ids[row][:num_top], lps.top_values[row][:num_top]), 1):
        out.setdefault(tid, Logprob(value, rank))
    return out
