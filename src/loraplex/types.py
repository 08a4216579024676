"""The objects users hand loraplex and get back, and the scheduler -> runner contract.

User-facing classes mirror vLLM's (`SamplingParams`, `LoRARequest`, `RequestOutput`)
so code written for vLLM's offline API runs unchanged.
"""

from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, field

from loraplex.errors import InvalidRequest

_GREEDY_TEMPERATURE = 1e-5  # as vLLM: below this, sampling is greedy
# Seeds seed 64-bit generators: torch takes [-2^63, 2^64).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_SAMPLES = 64  # n and best_of: each sample is a sequence of its own


MAX_SPEC_CHARS = 64 * 1024  # a structured-output spec's size (its compile time grows with it)


@dataclass
class StructuredOutputs:
    """Constrain the output (vLLM's StructuredOutputsParams): exactly one of these."""

    json: str | dict | None = None  # a JSON schema (strict: no properties beyond it)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # one of these strings
    grammar: str | None = None  # an EBNF grammar (xgrammar's dialect), root rule `root`
    strict: bool = True  # json: additionalProperties false where the schema says nothing
    disable_any_whitespace: bool = False  # json: compact, no whitespace between tokens

    def check(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequest(f"structured outputs take exactly one of json, json_object, regex, "
                                 f"choice, grammar; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidRequest("structured output json is a JSON schema (an object or its text)")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidRequest(f"structured output {name} must be a string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequest("structured output choice must be a non-empty list of non-empty strings")
        if len(self.key()) > MAX_SPEC_CHARS:
            raise InvalidRequest(f"structured output spec longer than {MAX_SPEC_CHARS} characters")

    def key(self) -> str:
        """One string per distinct constraint (compiled grammars are cached by it)."""
        return _json.dumps([self.json, self.json_object, self.regex, self.choice, self.grammar, self.strict,
                            self.disable_any_whitespace], sort_keys=True)


@dataclass
class SamplingParams:
    """How to generate; the fields and their meanings are vLLM's."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0  # EOS and stop_token_ids cannot end generation before this
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (+ the sampled one)
    prompt_logprobs: int | None = None  # same for prompt tokens; 0: only the prompt token
    skip_special_tokens: bool = True
    n: int = 1  # samples returned
    best_of: int | None = None  # candidates sampled, the n of highest cumulative logprob returned
    presence_penalty: float = 0.0  # logits -= presence_penalty for tokens in the output so far
    frequency_penalty: float = 0.0  # logits -= frequency_penalty x count in the output so far
    repetition_penalty: float = 1.0  # tokens of prompt or output: logit / r if > 0, else x r
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    structured_outputs: StructuredOutputs | None = None
    # Speculative decoding (when the engine runs it): False keeps this request to a
    # token a step, e.g. to keep its steps' timing even.
    speculate: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.check()

    def check(self) -> None:
        """Raises InvalidRequest for a value out of range."""

        def bad(msg):
            raise InvalidRequest(msg)

        if not (isinstance(self.n, int) and 1 <= self.n <= MAX_SAMPLES):
            bad(f"n must be in [1, {MAX_SAMPLES}], got {self.n}")
        best_of = self.best_of if self.best_of is not None else self.n
        if not (isinstance(best_of, int) and self.n <= best_of <= MAX_SAMPLES):
            bad(f"best_of must be in [n, {MAX_SAMPLES}], got {self.best_of}")
        if not 0 <= self.temperature < math.inf:
            bad(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad(f"top_k must be -1 (disable) or >= 0, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v < 0:
                bad(f"{name} must be >= 0, got {v}")
        if any(not s for s in self.stop):
            bad("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 100:
            bad(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.structured_outputs is not None:
            self.structured_outputs.check()
            # The grammar decides where the output ends: its end allows only EOS.
            if self.ignore_eos or self.min_tokens:
                bad("structured outputs end where their grammar does: no ignore_eos or min_tokens")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or not -100 <= bias <= 100:
                bad(f"logit_bias maps token ids to values in [-100, 100], got {token!r}: {bias!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_MIN <= self.seed <= SEED_MAX):
            bad(f"seed must fit in 64 bits ([{SEED_MIN}, {SEED_MAX}]), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE


@dataclass(frozen=True)
class LoRARequest:
    """Names an adapter for a request, as vLLM's LoRARequest.

    lora_int_id is the adapter's identity inside the engine (> 0); lora_path is a PEFT
    adapter directory (adapter_config.json + adapter_model.safetensors).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise InvalidRequest(f"lora_int_id must be > 0, got {self.lora_int_id}")

    @property
    def key(self) -> str:
        """How the engine names this adapter in slots and caches."""
        return f"{self.lora_int_id}:{self.lora_name}"


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely token
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the chosen token and the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # Where the adapter was when the request arrived: "device" (in a slot on the model's
    # device), "host" (in memory), "disk" (local files) or "remote" (downloaded); the
    # seconds the request waited for it to be read into memory (0 when it was there);
    # and its content id (see adapters/manifest.py).
    adapter_source: str | None = None
    adapter_load_time: float | None = None
    adapter_content_id: str | None = None
    # Speculative decoding: tokens proposed for this request, and of them kept.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # One entry per prompt token; None for the first (nothing predicts it).
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    lora_request: LoRARequest | None = None
    metrics: RequestMetrics | None = None
    # Why the request failed (finish_reason "error"), e.g. its adapter could not load.
    error: Exception | None = None


# ---------------------------------------------------------------------------------------
# Scheduler -> runner contract. Plain Python: the scheduler never touches tensors.
# ---------------------------------------------------------------------------------------


# Stands for a token that a step already in flight samples: the runner feeds it from that
# step's device output, so planning the next step need not wait for the host copy.
PENDING_TOKEN = -1


@dataclass
class PromptLogprobsTask:
    """Logits rows of a chunk whose log-softmax scores the prompt tokens that follow."""

    first_row: int  # chunk-relative index of the first row
    target_ids: list[int]  # the token each row predicts (row first_row + i -> target_ids[i])
    num_top: int  # top-k logprobs to return beside each target


@dataclass
class ScheduledChunk:
    """One request's share of a step: a prefill chunk, or the one token of a decode."""

    request_id: str
    token_ids: list[int]  # tokens fed this step, at positions start_pos, ...; PENDING_TOKEN:
    # the token the previous step samples for this request (the first of a decode chunk)
    start_pos: int  # = the request's num_computed_tokens before this step (as planned: a
    # chunk after device drafts in flight starts earlier by the drafts not kept)
    block_ids: list[int]  # KV pages of the request, covering start_pos + len(token_ids)
    lora_slot: int  # GPU adapter slot of every token of the chunk; -1 = base model
    sample: bool  # the chunk ends at the last known token: sample the next one
    sampling: SamplingParams
    num_output_tokens: int  # tokens generated so far, pending ones included (min_tokens)
    prompt_logprobs: PromptLogprobsTask | None = None
    # Sampled chunks with penalties or a grammar: the request's prompt and known output
    # tokens (the pending one, if any, comes from the previous step's output).
    history: tuple[list[int], list[int]] | None = None
    grammar: object = None  # structured outputs: the compiled grammar its sample must follow
    # Speculative decoding: tokens proposed after the last known one (the tail of
    # token_ids), verified by this step; the chunk samples 1 to len + 1 tokens.
    draft_ids: list[int] | None = None
    # The drafts are placeholders the runner fills on the device, from the request's
    # history row (n-gram proposals planned ahead of results: runner/ngram_drafts.py).
    device_drafts: bool = False
    # Its row of token history on the device (-1: none), and the tokens before start_pos
    # to write there first (a request admitted with cached pages).
    history_row: int = -1
    history_prefix: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class StepPlan:
    """Everything the runner needs for one forward step, in batch order."""

    chunks: list[ScheduledChunk]
    # Adapter slot -> adapter key: copy that adapter into the slot before running.
    lora_loads: dict[int, str] = field(default_factory=dict)
    # Requests that ended since the last plan: the runner drops their per-request state.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def host_drafts(self) -> bool:
        """Some chunk verifies proposals the host made: the step's results must be in
        before the next plan (its proposals extend them)."""
        return any(c.draft_ids and not c.device_drafts for c in self.chunks)


@dataclass
class StepResult:
    """What the runner returns for a plan; lists are parallel to plan.chunks."""

    sampled_token_ids: list[int | None]
    logprobs: list[PositionLogprobs | None]  # logprobs of the sampled token position
    prompt_logprobs: list[list[PositionLogprobs] | None]
    # Chunks with draft_ids (by index): the tokens verification kept, then the one it
    # added (their sampled_token_ids entry stays None).
    speculated: dict[int, list[int]] = field(default_factory=dict)
    # Chunks with device_drafts: how many of their placeholders held a proposal.
    num_proposed: dict[int, int] = field(default_factory=dict)
