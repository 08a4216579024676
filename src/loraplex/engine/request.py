"""A request's state inside the engine, from arrival to its last token."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from loraplex.adapters.manager import AdapterTicket
from loraplex.engine.speculative import Acceptance, SeenSuffix
from loraplex.types import (
    PENDING_TOKEN,
    LoRARequest,
    PositionLogprobs,
    RequestMetrics,
    SamplingParams,
)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    lora_request: LoRARequest | None = None
    prompt: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixed into its pages' prefix-cache hashes: only requests with the same salt share
    # pages (the server salts with the tenant).
    cache_salt: str = ""
    # A sibling sample to wait for (engine/parallel.py): admitted once it has a token,
    # when its prompt's pages are cached.
    after: Request | None = None
    # Structured outputs: a future of its compiled grammar (engine/structured.py).
    grammar: Future | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose keys and values are in the KV cache or being written by a planned step.
    num_computed_tokens: int = 0
    # Tokens sampled by launched steps whose ids have not reached the host yet: 1 a step,
    # or 1 + k for a step verifying k proposals, as if all were kept (a step planned
    # before its results starts after them; the runner moves it back by those not kept).
    num_pending: int = 0
    block_ids: list[int] = field(default_factory=list)
    lora_slot: int = -1  # while running with an adapter: its GPU slot
    adapter: AdapterTicket | None = None  # the adapter's load state and content id
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    output_text: str = ""
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # prompt_logprobs[i] scores prompt token i + 1; filled chunk by chunk.
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    # Prefix cache: the hashes of its full pages of known tokens (a chain), how many of
    # its current block table's pages are registered, and the prompt tokens it found
    # cached when first admitted.
    page_hashes: list[bytes] = field(default_factory=list)
    num_registered_pages: int = 0
    num_cached_tokens: int = 0
    # Speculative decoding.
    acceptance: Acceptance = field(default_factory=Acceptance)  # of its proposals (speculative.py)
    # n-gram proposals, made on the device (runner/ngram_drafts.py): its row of the
    # runner's token history while running, and whether its next chunk must first write
    # the tokens before it there (admitted with cached pages).
    history_row: int = -1
    history_prefix_due: bool = False
    seen_suffix: SeenSuffix | None = None  # whether its known tokens would propose
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

    @property
    def adapter_key(self) -> str | None:
        """The adapter's content id (GPU slots and host memory are keyed by it)."""
        return self.adapter.content_id if self.adapter else None

    @property
    def cache_key(self) -> str:
        """What besides its tokens a page of this request depends on: the adapter's
        content (never its name) and the salt."""
        return f"{self.adapter_key or ''}|{self.cache_salt}"

    def known_tokens(self) -> list[int]:
        """Prompt and output tokens whose ids are known (not the one in flight)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def waits(self) -> bool:
        """Its sibling has not computed the shared prompt yet."""
        a = self.after
        return a is not None and not a.finished and not a.output_token_ids

    @property
    def grammar_ready(self) -> bool:
        g = self.grammar
        return g is None or (g.done() and g.exception() is None)

    @property
    def adapter_ready(self) -> bool:
        return self.adapter is None or self.adapter.ready

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, those still in flight included."""
        return len(self.output_token_ids) + self.num_pending

    def will_finish(self, max_model_len: int) -> bool:
        """Its pending token is its last by length: no further step needs it."""
        max_tokens = self.sampling.max_tokens
        return self.num_pending > 0 and (
            (max_tokens is not None and self.num_output_tokens >= max_tokens)
            or self.num_tokens >= max_model_len
        )

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output; PENDING_TOKEN for the one
        still in flight."""
        n = len(self.prompt_token_ids)
        known = n + len(self.output_token_ids)
        pending = [PENDING_TOKEN] * (max(end, known) - max(start, known))
        end = min(end, known)
        if start >= n:
            return self.output_token_ids[start - n : end - n] + pending
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - n)] + pending

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
