"""Speculative decoding's draft-model proposer (vLLM's `{"model": DIR,
"num_speculative_tokens": k}`): a smaller model with the same vocabulary proposes each
speculating request's next tokens, greedily, from everything the request has so far.

The draft runs in its own ModelRunner (eager, no adapters: the draft runs bare) with a
KV cache of as many pages as the target's, indexed by the same page ids: a request's
pages hold the target's KV in the target's cache and the draft's in the draft's, so
the draft needs no block manager of its own, and its positions roll back exactly as
the target's do. Per request it remembers how many tokens it has computed; before
proposing it catches up on the rest (the whole prompt the first time, then the tokens
verification kept and added), in forwards of at most the step budget, and samples the
first proposal from the last; k - 1 one-token forwards give the others. Its KV past the
request's known tokens is rewritten by the next catch-up, so proposals that were not
kept leave nothing behind. A preempted request starts over (its pages are new).

The scheduler decides which requests propose and how many tokens (speculative.py's
adaptivity, the step's draft room) and plans placeholders; `fill` replaces them before
the step launches. Proposals are deterministic (greedy), which rejection sampling takes
as a one-hot draft distribution: sampled rows keep the target's distribution.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from transformers import AutoConfig

from loraplex.config import EngineConfig, LoRAConfig
from loraplex.engine.request import Request
from loraplex.errors import ModelLoadError
from loraplex.models.registry import model_config
from loraplex.runner.model_runner import ModelRunner
from loraplex.types import SamplingParams, ScheduledChunk, StepPlan

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def draft_engine_config(config: EngineConfig, num_blocks: int) -> EngineConfig:
    """The draft's runner config: the draft model in the target's dtype, device and
    step budget; num_blocks pages (the target's count); no adapters, graphs or cache
    sharing."""
    path = config.speculative.model
    try:
        model = model_config(AutoConfig.from_pretrained(path))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"speculative config: draft model {path}: {e}") from e
    if model.vocab_size != config.model.vocab_size:
        raise ModelLoadError(f"speculative config: the draft model's vocabulary ({model.vocab_size} tokens) "
                             f"differs from the model's ({config.model.vocab_size})")
    cache = dataclasses.replace(config.cache, num_gpu_blocks_override=num_blocks, enable_prefix_caching=False)
    return dataclasses.replace(config, model_path=str(path), model=model, cudagraph_mode="NONE",
                               measure_moe_routing=False, cache=cache, lora=LoRAConfig(max_loras=0),
                               speculative=None)


class DraftModel:
    def __init__(self, config: EngineConfig, num_blocks: int):
        self.runner = ModelRunner(draft_engine_config(config, num_blocks))
        self.budget = config.scheduler.max_num_batched_tokens
        # request id -> (its preemption count, tokens whose draft KV is written)
        self._computed: dict[str, tuple[int, int]] = {}
        self._finished: list[str] = []

    def fill(self, plan: StepPlan, requests: Mapping[str, Request]) -> None:
        """Write the draft's proposals over the placeholders of plan's speculating chunks
        (their draft_ids and the tail of their token_ids)."""
        for request_id in plan.finished_request_ids:
            self._computed.pop(request_id, None)
        self._finished += plan.finished_request_ids
        chunks = [c for c in plan.chunks if c.draft_ids]
        if not chunks:
            return
        known = {}  # request id -> its tokens, the last known one (the chunk's first) included
        for c in chunks:
            req = requests[c.request_id]
            known[c.request_id] = req.prompt_token_ids + req.output_token_ids
            assert len(known[c.request_id]) == c.start_pos + 1, "proposals follow the last known token"
        drafts = self._catch_up(chunks, known, requests)
        for j in range(1, max(len(c.draft_ids) for c in chunks)):
            step = [ScheduledChunk(c.request_id, [drafts[c.request_id][-1]], c.start_pos + j, c.block_ids, -1,
                                   True, GREEDY, 0) for c in chunks if len(c.draft_ids) > j]
            for chunk, token in zip(step, self._run(step)):
                drafts[chunk.request_id].append(token)
        for c in chunks:
            proposal = drafts[c.request_id][: len(c.draft_ids)]
            c.token_ids[len(c.token_ids) - len(proposal):] = proposal
            c.draft_ids = proposal

    def _catch_up(self, chunks: list[ScheduledChunk], known: dict[str, list[int]],
                  requests: Mapping[str, Request]) -> dict[str, list[int]]:
        """Run the draft over each request's tokens it has not computed, in forwards of
        at most the step budget; returns each request's first proposal (in a list)."""
        done = {}
        for c in chunks:
            preemptions = requests[c.request_id].metrics.num_preemptions
            seen, n = self._computed.get(c.request_id, (preemptions, 0))
            done[c.request_id] = n if seen == preemptions else 0
            self._computed[c.request_id] = (preemptions, len(known[c.request_id]))
        first: dict[str, list[int]] = {}
        while len(first) < len(chunks):
            step, room = [], self.budget
            for c in chunks:
                tokens, start = known[c.request_id], done[c.request_id]
                n = min(len(tokens) - start, room)
                if c.request_id in first or n <= 0:
                    continue
                step.append(ScheduledChunk(c.request_id, tokens[start: start + n], start, c.block_ids, -1,
                                           start + n == len(tokens), GREEDY, 0))
                done[c.request_id] += n
                room -= n
            for chunk, token in zip(step, self._run(step)):
                if chunk.sample:
                    first[chunk.request_id] = [token]
        return first

    def _run(self, chunks: list[ScheduledChunk]) -> list[int | None]:
        plan = StepPlan(chunks, finished_request_ids=self._finished)
        self._finished = []
        return self.runner.run(plan).sampled_token_ids
