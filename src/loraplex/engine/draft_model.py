"""Speculative decoding's draft-model proposer (vLLM's `{"model": DIR,
"num_speculative_tokens": k}`): a smaller model with the same vocabulary proposes each
speculating request's next tokens, greedily, from everything the request has so far.

The draft runs in its own ModelRunner (with CUDA graphs as the target's, and adapter
slots of its own) with a KV cache of as many pages as the target's, indexed by the same
page ids (the target's runner sizes its cache leaving room for the draft's weights and
a draft page beside each of its own: draft_memory): a request's
pages hold the target's KV in the target's cache and the draft's in the draft's, so
the draft needs no block manager of its own, and its positions roll back exactly as
the target's do. Per request it remembers how many tokens it has computed; before
proposing it catches up on the rest (the whole prompt the first time, then the tokens
verification kept and added), in forwards of at most the step budget, and samples the
first proposal from the last; k - 1 one-token forwards give the others. Its KV past the
request's known tokens is rewritten by the next catch-up, so proposals that were not
kept leave nothing behind. A preempted request starts over (its pages are new).

Adapters: a request's adapter may have a draft adapter, for the draft model: the
config's `draft_adapters` (adapter name -> directory), else the adapter directory's
`draft/` subdirectory. DraftAdapters reads them on a thread of its own and copies them
into the draft's own slots (as many as the target has, least recently used reused);
until one is in memory, or if it cannot be read, the request's proposals come from the
bare draft, so a draft adapter never holds a request up or fails it.

The scheduler decides which requests propose and how many tokens (speculative.py's
adaptivity, the step's draft room) and plans placeholders; `fill` replaces them before
the step launches. Proposals are deterministic (greedy), which rejection sampling takes
as a one-hot draft distribution: sampled rows keep the target's distribution.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import AutoConfig

from loraplex.adapters.peft import CONFIG_FILE, LoRAAdapter, read_adapter_dir, to_canonical
from loraplex.config import EngineConfig, LoRAConfig, ModelConfig
from loraplex.engine.request import Request
from loraplex.errors import ModelLoadError
from loraplex.models.registry import model_config
from loraplex.runner.model_runner import ModelRunner
from loraplex.types import SamplingParams, ScheduledChunk, StepPlan

logger = logging.getLogger("loraplex")

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def draft_model_config(config: EngineConfig) -> ModelConfig:
    """The draft model's config, checked: a model directory, the target's vocabulary."""
    path = config.speculative.model
    if not (Path(path) / "config.json").is_file():  # else transformers takes it for a Hub id
        raise ModelLoadError(f"speculative config: draft model {path}: not a model directory "
                             f"(no config.json)")
    try:
        model = model_config(AutoConfig.from_pretrained(path))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"speculative config: draft model {path}: {e}") from e
    if model.vocab_size != config.model.vocab_size:
        raise ModelLoadError(f"speculative config: the draft model's vocabulary ({model.vocab_size} tokens) "
                             f"differs from the model's ({config.model.vocab_size})")
    return model


def draft_memory(config: EngineConfig, model: ModelConfig) -> tuple[int, int]:
    """(bytes of each of the draft's KV pages, bytes of its weight files) for the draft
    `model`: what the target's runner leaves for the draft when it sizes its own cache
    (each page id then costs both caches). Weights are counted as stored (none under
    dummy weights)."""
    itemsize = getattr(torch, config.dtype).itemsize
    per_page = 2 * model.num_layers * config.cache.block_size * model.kv_size * itemsize
    weights = sum(f.stat().st_size for f in Path(config.speculative.model).glob("*.safetensors"))
    return per_page, weights if config.load_format != "dummy" else 0


def draft_engine_config(config: EngineConfig, model: ModelConfig, num_blocks: int) -> EngineConfig:
    """The draft's runner config: the draft `model` in the target's dtype, device, step
    budget, graphs and adapter slots; num_blocks pages (the target's count); no prefix
    cache of its own (it writes the pages the target's cache shares)."""
    path = config.speculative.model
    cache = dataclasses.replace(config.cache, num_gpu_blocks_override=num_blocks, enable_prefix_caching=False)
    lora = LoRAConfig(max_loras=config.lora.max_loras, max_lora_rank=config.lora.max_lora_rank)
    return dataclasses.replace(config, model_path=str(path), model=model, measure_moe_routing=False,
                               cache=cache, lora=lora, speculative=None)


class DraftModel:
    def __init__(self, config: EngineConfig, model: ModelConfig, num_blocks: int):
        """model: draft_model_config(config)."""
        try:
            self.runner = ModelRunner(draft_engine_config(config, model, num_blocks))
        except torch.cuda.OutOfMemoryError as e:
            raise ModelLoadError(f"speculative config: the draft model and its KV cache ({num_blocks} pages) "
                                 f"do not fit beside the model; lower gpu_memory_utilization "
                                 f"({config.cache.gpu_memory_utilization})") from e
        self.adapters = (DraftAdapters(self.runner, dict(config.speculative.draft_adapters))
                         if self.runner.lora_slots is not None else None)
        self._loads: dict[int, LoRAAdapter] = {}  # slot -> draft adapter to copy in with the next forward
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
        slots = {c.request_id: -1 for c in chunks}
        if self.adapters is not None:
            slots, self._loads = self.adapters.slots({c.request_id: requests[c.request_id].lora_request
                                                      for c in chunks})
        drafts = self._catch_up(chunks, known, requests, slots)
        for j in range(1, max(len(c.draft_ids) for c in chunks)):
            step = [ScheduledChunk(c.request_id, [drafts[c.request_id][-1]], c.start_pos + j, c.block_ids,
                                   slots[c.request_id], True, GREEDY, 0)
                    for c in chunks if len(c.draft_ids) > j]
            for chunk, token in zip(step, self._run(step)):
                drafts[chunk.request_id].append(token)
        for c in chunks:
            proposal = drafts[c.request_id][: len(c.draft_ids)]
            c.token_ids[len(c.token_ids) - len(proposal):] = proposal
            c.draft_ids = proposal

    def _catch_up(self, chunks: list[ScheduledChunk], known: dict[str, list[int]],
                  requests: Mapping[str, Request], slots: dict[str, int]) -> dict[str, list[int]]:
        """Run the draft over each request's tokens it has not computed, in forwards of
        at most the step budget; returns each request's first proposal (in a list)."""
        done = {}
        for c in chunks:
            # The draft's KV is valid while the request keeps its pages and its draft
            # adapter (a preemption, or a draft adapter now in memory: start over).
            epoch = (requests[c.request_id].metrics.num_preemptions, slots[c.request_id] >= 0)
            seen, n = self._computed.get(c.request_id, (epoch, 0))
            done[c.request_id] = n if seen == epoch else 0
            self._computed[c.request_id] = (epoch, len(known[c.request_id]))
        first: dict[str, list[int]] = {}
        while len(first) < len(chunks):
            step, room = [], self.budget
            for c in chunks:
                tokens, start = known[c.request_id], done[c.request_id]
                n = min(len(tokens) - start, room)
                if c.request_id in first or n <= 0:
                    continue
                step.append(ScheduledChunk(c.request_id, tokens[start: start + n], start, c.block_ids,
                                           slots[c.request_id], start + n == len(tokens), GREEDY, 0))
                done[c.request_id] += n
                room -= n
            for chunk, token in zip(step, self._run(step)):
                if chunk.sample:
                    first[chunk.request_id] = [token]
        return first

    def _run(self, chunks: list[ScheduledChunk]) -> list[int | None]:
        loads, self._loads = self._loads, {}
        plan = StepPlan(chunks, lora_loads={slot: f"draft-{slot}" for slot in loads},
                        finished_request_ids=self._finished)
        self._finished = []
        return self.runner.run(plan, loads).sampled_token_ids


class DraftAdapters:
    """The draft model's adapters: which one a request's adapter has, read in the
    background, and the draft runner's slots they occupy (see the module docstring)."""

    def __init__(self, runner: ModelRunner, configured: dict[str, str]):
        self.runner = runner
        self.configured = configured  # adapter name -> draft adapter directory
        self._paths: dict[tuple[str, str], str | None] = {}  # (name, path) -> its draft's directory
        self._reads: dict[str, Future] = {}  # directory -> Future[LoRAAdapter]
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # directory -> slot, least recent first
        self._free = list(range(runner.config.lora.max_loras))
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraplex-draft-adapters")

    def slots(self, loras: dict[str, object]) -> tuple[dict[str, int], dict[int, LoRAAdapter]]:
        """Each request's draft slot (-1: bare) given its LoRARequest (or None), and the
        adapters to copy into slots first."""
        slots, loads, used = {}, {}, set()
        for request_id, lora in loras.items():
            path = self._draft_path(lora) if lora is not None else None
            adapter = self._ready(path) if path is not None else None
            slot = -1
            if adapter is not None:
                slot = self._slot_of.get(path, -1)
                if slot < 0:
                    slot = self._take_slot(used)
                    if slot >= 0:
                        self._slot_of[path], loads[slot] = slot, adapter
                if slot >= 0:
                    self._slot_of.move_to_end(path)
                    used.add(slot)
            slots[request_id] = slot
        return slots, loads

    def _draft_path(self, lora) -> str | None:
        key = (lora.lora_name, lora.lora_path)
        if key not in self._paths:
            path = self.configured.get(lora.lora_name)
            if path is None and lora.lora_path and (Path(lora.lora_path) / "draft" / CONFIG_FILE).is_file():
                path = str(Path(lora.lora_path) / "draft")
            self._paths[key] = path
        return self._paths[key]

    def _ready(self, path: str) -> LoRAAdapter | None:
        """The adapter at `path` if read; starts reading it otherwise. None also for one
        that cannot be read (logged once)."""
        read = self._reads.get(path)
        if read is None:
            self._reads[path] = self._pool.submit(self._read, path)
            return None
        if not read.done() or read.exception() is not None:
            return None
        return read.result()

    def _read(self, path: str) -> LoRAAdapter:
        try:
            config, tensors = read_adapter_dir(f"draft:{path}", path)
            lora = self.runner.config.lora
            return to_canonical(f"draft:{path}", f"draft:{path}", path, config, tensors,
                                self.runner.adapter_targets, lora.max_lora_rank, self.runner.dtype)
        except Exception as e:
            logger.warning("draft adapter %s not used (its requests draft bare): %s", path, e)
            raise

    def _take_slot(self, used: set[int]) -> int:
        if self._free:
            return self._free.pop()
        for path, slot in self._slot_of.items():  # least recently used first
            if slot not in used:
                del self._slot_of[path]
                return slot
        return -1
