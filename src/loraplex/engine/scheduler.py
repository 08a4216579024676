"""Continuous batching under a token budget. Pure Python: no tensors, no model.

Each step spends `max_num_batched_tokens` over requests, oldest first: running requests
take their next token (decode) or their next prefill chunk, then waiting requests are
admitted first come, first served while pages and sequence slots last, passing over
those whose adapter is still loading or cannot get a GPU slot yet (see _admit).
There are no phases: a request only has `num_computed_tokens` of `num_tokens`, and
chunked prefill falls out of the budget. When pages run out, the newest running request
is preempted: its pages are freed and it is recomputed from scratch later (its output
tokens so far become part of the prefill).

Planning may run one step ahead of results (async scheduling): a planned chunk advances
`num_computed_tokens` at once, and a chunk that samples leaves a pending token, which
the next step feeds from the device (PENDING_TOKEN) before its id reaches the host.
Decodes are planned before prefill chunks so that a pending token is always consumed by
the very next step; update() later fills in the ids and applies stop conditions, and a
request that turns out to have stopped simply has its in-flight token dropped.
A chunk that verifies k n-gram proposals (made on the device) leaves 1 + k
pending tokens, planned as if all were kept: the next step starts after them, and the
runner moves it back by those not kept before it runs; update() does the same here.
"""

from __future__ import annotations

import time
from collections import deque

from loraplex.adapters.slot_table import SlotTable
from loraplex.config import DRAFT_TOKENS_PER_STEP, SchedulerConfig, SpeculativeConfig
from loraplex.engine.block_manager import BlockManager, page_hashes
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.speculative import SeenSuffix, speculates
from loraplex.types import PromptLogprobsTask, ScheduledChunk, StepPlan, StepResult


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, slots: SlotTable,
                 speculative: SpeculativeConfig | None = None):
        """speculative: with "ngram", proposals are made by the runner on the device
        (runner/ngram_drafts.py), so steps that speculate are planned ahead of results;
        a draft model's (engine/draft_model.py) on the host."""
        # Otherwise a request could outgrow the whole cache and preempt itself forever.
        assert blocks.num_blocks * blocks.block_size >= config.max_model_len, (
            "the KV cache must hold one max_model_len sequence"
        )
        self.config = config
        self.blocks = blocks
        self.slots = slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._pinned_loads: dict[int, str] = {}  # slot -> adapter to copy in next step
        self.speculative = speculative
        self.num_draft_tokens = 0  # speculation: tokens proposed, and of them kept,
        self.num_accepted_tokens = 0
        self.num_verified_chunks = 0  # in this many verified chunks
        self.num_plans = 0  # plans made (requests that stopped proposing probe on some: speculative.py)
        self._draft_room = 0  # tokens the plan being made may still propose
        self.ngram_on_device = speculative is not None and speculative.method == "ngram"
        # Rows of the runner's token history, one per running request (ngram_on_device).
        self._free_history_rows = list(range(config.max_num_seqs))[::-1] if self.ngram_on_device else []

    # -- queue -------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def pin_adapter(self, key: str) -> int:
        """Give adapter `key` a GPU slot for good (copied in by the next step)."""
        slot, must_load = self.slots.acquire(key)  # the reference is never released
        if must_load:
            self._pinned_loads[slot] = key
        return slot

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request (stop, length, abort): free its pages and adapter slot."""
        if req.finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._release(req)
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        req.metrics.finished_time = time.monotonic()
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    # -- planning ----------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan the next step. Every plan must later reach update() with its result."""
        budget = self.config.max_num_batched_tokens
        plan = StepPlan(chunks=[], finished_request_ids=self._finished_ids,
                        lora_loads=self._pinned_loads)
        self._finished_ids, self._pinned_loads = [], {}
        now = time.monotonic()

        preempted = False
        plan_index = self.num_plans
        self.num_plans += 1
        self._draft_room = DRAFT_TOKENS_PER_STEP
        max_len = self.config.max_model_len
        # Decodes (one token left) first: they always fit the budget (>= max_num_seqs).
        candidates = [r for r in self.running if not r.will_finish(max_len)]
        candidates.sort(key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        planned: set[str] = set()
        for req in candidates:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = self._propose(req, budget, plan_index) if n == 1 else []
            n += len(drafts)
            while not self.blocks.can_grow(req.block_ids, req.num_computed_tokens + n):
                victim = next(r for r in reversed(self.running) if r.request_id not in planned)
                self.running.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                self.blocks.grow(req.block_ids, req.num_computed_tokens + n)
                plan.chunks.append(self._chunk(req, n - len(drafts), drafts))
                planned.add(req.request_id)
                budget -= n

        # Admitting while preempting would only thrash pages.
        if not preempted:
            budget = self._admit(plan, budget, now)
        return plan

    def wants_proposals(self) -> bool:
        """Whether the next plan may propose tokens on the host: a running request
        speculates and has earned a proposal, or is due a probe. The engine then lets the
        step in flight finish before planning (a proposal extends the tokens that step
        samples), and otherwise plans while it runs. Never with proposals made on the
        device, which read the step in flight's tokens there."""
        spec = self.speculative
        if spec is None or self.ngram_on_device or not self._batch_speculates():
            return False
        return any(r.acceptance.draft_length(spec.num_speculative_tokens, self.num_plans)
                   and r.num_tokens - r.num_computed_tokens == 1  # decoding
                   and speculates(r.sampling, r.num_output_tokens) for r in self.running)

    def _batch_speculates(self) -> bool:
        limit = self.speculative.disable_by_batch_size
        return limit is None or len(self.running) <= limit

    def _propose(self, req: Request, budget: int, plan_index: int) -> list[int]:
        """Speculation: tokens to verify after a decoding request's last one, as many as
        its acceptance earns (speculative.py), within the step's budget and draft room,
        its max_tokens and max_model_len, and pages free now (a proposal never
        preempts)."""
        spec = self.speculative
        # Known outputs only (not those in flight): min_tokens must hold for every kept proposal.
        if spec is None or not speculates(req.sampling, len(req.output_token_ids)):
            return []
        if req.num_pending and not self.ngram_on_device:  # its proposals would need its in-flight tokens
            return []
        if not self._batch_speculates():
            return []
        room = min(req.acceptance.draft_length(spec.num_speculative_tokens, plan_index), budget - 1,
                   self._draft_room, self.config.max_model_len - req.num_tokens)
        if req.sampling.max_tokens is not None:
            room = min(room, req.sampling.max_tokens - req.num_output_tokens - 1)
        if room <= 0:
            return []
        if spec.method == "draft_model":
            drafts = [0] * room  # placeholders: the engine's DraftModel fills them in
        else:
            # n-gram: where its known tokens would propose (its in-flight ones likely go
            # on matching), room placeholders, which the runner fills from the newest tokens.
            if req.seen_suffix is None:
                req.seen_suffix = SeenSuffix(spec.prompt_lookup_min)
            drafts = [0] * room if req.seen_suffix.matches(req.prompt_token_ids, req.output_token_ids) else []
        if drafts and not self.blocks.can_grow(req.block_ids, req.num_tokens + len(drafts)):
            return []
        self._draft_room -= len(drafts)
        return drafts

    def _admit(self, plan: StepPlan, budget: int, now: float) -> int:
        """Admit waiting requests, oldest first, while pages, sequences and budget last.

        A request whose adapter is still loading is passed over; so is one whose adapter
        needs a GPU slot while none is free, in favour of requests that can run now. One
        whose adapter is copied into a slot by this step is admitted but runs from the
        next step on (unless the step has nothing else to run). Once
        one has waited max_adapter_wait for a slot, only base-model requests are admitted
        after it, so slots drain and the next one freed goes to it.
        """
        starving = False
        for req in list(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if req.num_pending or not req.adapter_ready or req.waits or not req.grammar_ready:
                continue  # its in-flight token, adapter, sibling's prompt or grammar is not here yet
            key = req.adapter_key
            if key is not None and (starving or not self.slots.can_acquire(key)):
                starving = starving or now - req.metrics.arrival_time > self.config.max_adapter_wait
                continue
            cached = self._cache_hit(req)
            start = len(cached) * self.blocks.block_size
            n = min(req.num_tokens - start, budget)
            if not self.blocks.can_grow(cached, start + n, reserved=self.blocks.num_unowned(cached)):
                break
            self.waiting.remove(req)
            if self.blocks.enable_caching and req.sampling.prompt_logprobs is None:
                req.block_ids = self.blocks.take(cached, req.num_tokens - 1)
                req.num_computed_tokens = start
                if req.metrics.first_scheduled_time is None:
                    req.num_cached_tokens = start
            must_load = False
            if key is not None:
                req.lora_slot, must_load = self.slots.acquire(key)
                if must_load:
                    plan.lora_loads[req.lora_slot] = key
                elif req.metrics.adapter_source == "host":
                    req.metrics.adapter_source = "device"
            req.status = RequestStatus.RUNNING
            if self.ngram_on_device:
                req.history_row = self._free_history_rows.pop()
                req.history_prefix_due = True
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            self.running.append(req)
            if must_load and plan.chunks:
                # Its adapter is copied into the slot beside this step (milliseconds for a
                # large one) and it runs from the next step on: a step that read the slot
                # now would make every request in it wait for the copy.
                continue
            self.blocks.grow(req.block_ids, start + n)
            plan.chunks.append(self._chunk(req, n))
            budget -= n
        return budget

    def _cache_hit(self, req: Request) -> list[int]:
        """Cached pages of a request being admitted with nothing computed: the longest
        registered run of its full pages before its last token (whose logits it needs).
        None for a request that scores its prompt (every position's logits)."""
        if (not self.blocks.enable_caching or req.num_computed_tokens
                or req.sampling.prompt_logprobs is not None):
            return []
        limit = (req.num_tokens - 1) // self.blocks.block_size
        self._hash_pages(req, limit)
        return self.blocks.cached_prefix(req.page_hashes[:limit])

    def _hash_pages(self, req: Request, upto: int) -> None:
        """Extend req.page_hashes to its first `upto` full pages (of known tokens)."""
        if upto > len(req.page_hashes):
            parent = req.page_hashes[-1] if req.page_hashes else b""
            req.page_hashes += page_hashes(req.known_tokens()[: upto * self.blocks.block_size],
                                           self.blocks.block_size, req.cache_key, parent,
                                           len(req.page_hashes))

    def _register_pages(self, req: Request) -> None:
        """Register the request's full pages whose tokens are known and computed (or
        written by the step in flight: a step that reads them runs after it)."""
        if not self.blocks.enable_caching:
            return
        full = min(req.num_computed_tokens, len(req.prompt_token_ids) + len(req.output_token_ids))
        full //= self.blocks.block_size
        self._hash_pages(req, full)
        for i in range(req.num_registered_pages, full):
            self.blocks.register(req.block_ids[i], req.page_hashes[i])
        req.num_registered_pages = max(req.num_registered_pages, full)

    def _chunk(self, req: Request, n: int, drafts: list[int] | None = None) -> ScheduledChunk:
        """The next n known tokens of `req`, then any proposed ones (`drafts`)."""
        start = req.num_computed_tokens
        end = start + n
        task = None
        if req.sampling.prompt_logprobs is not None:
            # Row at position p scores prompt token p + 1; skip rows already scored
            # before a preemption.
            a = max(start, len(req.prompt_logprobs))
            b = min(end, req.num_prompt_tokens - 1)
            if a < b:
                task = PromptLogprobsTask(
                    first_row=a - start,
                    target_ids=req.prompt_token_ids[a + 1 : b + 1],
                    num_top=req.sampling.prompt_logprobs,
                )
        chunk = ScheduledChunk(
            request_id=req.request_id,
            token_ids=req.token_ids_between(start, end) + (drafts or []),
            start_pos=start,
            block_ids=list(req.block_ids),
            lora_slot=req.lora_slot,
            sample=end == req.num_tokens,
            sampling=req.sampling,
            num_output_tokens=req.num_output_tokens,
            prompt_logprobs=task,
            draft_ids=drafts or None,
            device_drafts=bool(drafts) and self.ngram_on_device,
            history_row=req.history_row,
        )
        if req.history_prefix_due:
            req.history_prefix_due = False
            chunk.history_prefix = req.known_tokens()[:start] or None
        sp = req.sampling
        penalized = sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty
        if chunk.sample and (penalized or req.grammar is not None):
            chunk.history = (req.prompt_token_ids, req.output_token_ids)  # read at launch, not copied
        if chunk.sample and req.grammar is not None:
            chunk.grammar = req.grammar.result()
        # Drafts are computed by this step, and planned as if all were kept (the next step
        # may be planned before this one's results); update() counts those kept.
        req.num_computed_tokens = end + len(drafts or [])
        req.num_pending += chunk.sample + len(drafts or [])
        return chunk

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed_tokens = req.num_registered_pages = 0
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)

    def recompute_all(self) -> None:
        """After a failed step: every running request is preempted and no token is in
        flight any more; adapter slots the step may not have filled are emptied, and
        pinned adapters (whose references are never released) copied in again."""
        for req in reversed(self.running):
            self._preempt(req)
        self.running.clear()
        self.blocks.forget_cache()  # the dropped steps' pages may be half written
        for req in self.waiting:
            req.num_pending = 0
        for slot in range(self.slots.num_slots):
            key = self.slots.key_in(slot)
            if key is not None and not self.slots.forget(key):
                self._pinned_loads[slot] = key

    def _release(self, req: Request) -> None:
        self.blocks.free(req.block_ids)
        if req.history_row >= 0:  # steps in flight that write it run before any that reuses it
            self._free_history_rows.append(req.history_row)
            req.history_row = -1
        if req.lora_slot >= 0:
            self.slots.release(req.lora_slot)
            req.lora_slot = -1

    # -- results -----------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Apply a step's results; returns the requests that gained tokens or finished."""
        touched = []
        now = time.monotonic()
        for i, (chunk, token, logprobs, prompt_lps) in enumerate(zip(
            plan.chunks, result.sampled_token_ids, result.logprobs, result.prompt_logprobs
        )):
            req = self.requests.get(chunk.request_id)
            if req is None:
                continue  # ended (stopped, aborted) while this step was in flight
            if prompt_lps:
                req.prompt_logprobs.extend(prompt_lps)
            if chunk.draft_ids:
                self._verified(req, chunk, result.speculated[i], result.num_proposed.get(i), now)
                touched.append(req)
                continue
            if token is None:
                self._register_pages(req)
                if prompt_lps:
                    touched.append(req)
                continue
            req.num_pending -= 1
            touched.append(req)
            self._append(req, token, logprobs, now)
        return touched

    def _verified(self, req: Request, chunk: ScheduledChunk, tokens: list[int], proposed: int | None,
                  now: float) -> None:
        """A speculated chunk's result: the proposals kept and the token added (proposed:
        how many placeholders held a proposal; None: all drafts were proposals). The KV
        of the rejected ones is left behind, to be overwritten."""
        planned = len(chunk.draft_ids)
        proposed = planned if proposed is None else proposed
        req.num_pending -= 1 + planned
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += len(tokens) - 1
        self.num_verified_chunks += 1
        req.metrics.num_draft_tokens += proposed
        req.metrics.num_accepted_tokens += len(tokens) - 1
        if chunk.device_drafts and not proposed:
            # Its known tokens matched but its newest did not: verification paid for
            # `planned` rows that held nothing, as for proposals none of which was kept.
            req.acceptance.observe(0, planned)
        else:
            req.acceptance.observe(len(tokens) - 1, proposed)
        if req.status is RequestStatus.RUNNING:  # else preempted: recomputed from its known tokens
            # Planned as if all `planned` were kept; a step planned since starts as much earlier.
            req.num_computed_tokens += len(tokens) - 1 - planned
        for token in tokens:
            if self._append(req, token, None, now):
                break

    def _append(self, req: Request, token: int, logprobs, now: float) -> bool:
        """One sampled token onto `req`, then its stop conditions; True if it finished."""
        req.output_token_ids.append(token)
        if logprobs is not None:
            req.logprobs.append(logprobs)
            req.cumulative_logprob += logprobs[token].logprob
        req.metrics.first_token_time = req.metrics.first_token_time or now
        req.metrics.last_token_time = now
        self._register_pages(req)  # before a stop frees them: a next turn may reuse them
        sp = req.sampling
        n_out = len(req.output_token_ids)
        if n_out >= sp.min_tokens and not sp.ignore_eos and token in req.eos_token_ids:
            self.finish(req, "stop")
        elif n_out >= sp.min_tokens and token in sp.stop_token_ids:
            self.finish(req, "stop", token)
        elif (sp.max_tokens is not None and n_out >= sp.max_tokens) or (
            req.num_prompt_tokens + n_out >= self.config.max_model_len
        ):
            self.finish(req, "length")
        return req.finished
