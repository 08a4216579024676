"""The engine loop: plan = scheduler.schedule(); result = runner.run(plan); update.

The engine admits requests (validating prompts and adapters, so a bad request fails
alone, before it touches any shared state), turns sampled tokens into text, applies stop
strings and produces RequestOutputs.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace

from loraplex.adapters.host_cache import HostCache
from loraplex.adapters.manager import AdapterManager
from loraplex.adapters.registry import Registry
from loraplex.adapters.slot_table import SlotTable
from loraplex.adapters.sources import DiskCache
from loraplex.config import EngineConfig, cache_root
from loraplex.engine.block_manager import BlockManager
from loraplex.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from loraplex.engine.draft_model import DraftModel, draft_memory, draft_model_config
from loraplex.engine.parallel import ParentRequest, child_id
from loraplex.engine.request import Request
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.structured import GrammarCompiler
from loraplex.errors import EngineFailure, InvalidRequest, LoRADisabled, PromptTooLong, RequestFailed
from loraplex.runner.model_runner import ModelRunner
from loraplex.runner.step_outputs import LaunchedStep, StepTiming
from loraplex.runner.tensor_parallel import TensorParallelRunner
from loraplex.types import (
    CompletionOutput,
    Logprob,
    LoRARequest,
    PositionLogprobs,
    RequestOutput,
    SamplingParams,
    StructuredOutputs,
)

logger = logging.getLogger("loraplex")

# The GIL switch interval while adapter loader threads run (see LLMEngine.__init__). 0.5 ms
# is the measured best so far (5 ms before); lower values are untested on a GPU: the
# variable is there to try them.
SWITCH_INTERVAL_S = float(os.environ.get("LORAPLEX_SWITCH_INTERVAL_S", 5e-4))


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer, max_logprobs: int = 20,
                 async_scheduling: bool = True, default_stop: tuple[str, ...] = ()):
        self.config = config
        # Stop strings of the model itself (generation_config.json), added to every request.
        self.default_stop = default_stop
        # Plan each step while the one before runs, except where the host proposes tokens
        # to speculate (they extend the tokens that step samples: Scheduler.wants_proposals);
        # n-gram proposals made on the device keep the overlap (runner/ngram_drafts.py).
        self.async_scheduling = async_scheduling
        self._in_flight: LaunchedStep | None = None
        self.tokenizer = tokenizer
        self.max_logprobs = max_logprobs
        eos = set(config.model.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        spec = config.speculative
        draft = draft_model_config(config) if spec is not None and spec.method == "draft_model" else None
        # A draft model's cache takes the target's page ids: sized together (draft_model.py).
        shared_page_bytes, reserved_bytes = draft_memory(config, draft) if draft else (0, 0)
        runner = TensorParallelRunner if config.tensor_parallel_size > 1 else ModelRunner
        self.runner = runner(config, self.eos_token_ids, shared_page_bytes, reserved_bytes)
        self.draft_model = DraftModel(config, draft, self.runner.num_blocks) if draft else None
        self.adapters = self._adapter_manager(config) if config.lora.enabled else None
        if self.adapters is not None:
            # Loader threads run short Python stretches between GIL-free reads and checks.
            # The engine thread gives the GIL up at every torch call; when a loader takes
            # it, the engine waits up to the switch interval to get it back. At the default
            # 5 ms that held up the GPU (1,000 cold adapters, H200: 1,185 -> 1,400 tok/s at
            # 0.5 ms). Loaders also make no torch call per tensor (adapters/safetensors_io.py).
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.scheduler = Scheduler(
            config.scheduler,
            BlockManager(self.runner.num_blocks, config.cache.block_size,
                         enable_caching=config.cache.enable_prefix_caching),
            SlotTable(config.lora.max_loras),
            config.speculative,
        )
        self._live: dict[str, _Live] = {}
        self._parents: dict[str, ParentRequest] = {}  # requests with several samples
        self._grammars: GrammarCompiler | None = None  # made at the first structured request
        self._compiling: dict[str, Request] = {}  # requests waiting for their grammar
        self._parent_of: dict[str, str] = {}  # child request id -> its parent's
        self.num_steps = 0
        # Each step's StepTiming while a list (the bench's step profile sets one).
        self.step_timings: list[StepTiming] | None = None

    def _adapter_manager(self, config: EngineConfig) -> AdapterManager:
        lora = config.lora
        cache_dir = lora.disk_cache_dir or cache_root() / "adapters"
        return AdapterManager(
            self.runner.adapter_targets, lora.max_lora_rank, self.runner.dtype,
            HostCache(lora.host_capacity, lora.max_cpu_lora_bytes),
            registry=Registry(lora.registry) if lora.registry else None,
            disk_cache=DiskCache(cache_dir, lora.disk_cache_bytes),
            workers=lora.load_workers, timeout=lora.load_timeout,
        )

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
        prompt: str | None = None,
        cache_salt: str = "",
    ) -> Request:
        """Queue a request. Raises InvalidRequest, or AdapterError for an adapter known to
        be missing, without side effects. An adapter not in memory loads in the
        background; if that fails, the request ends with finish_reason "error".
        cache_salt: only requests with the same salt share prefix-cache pages. With n (or
        best_of) > 1 the samples run as child requests (engine/parallel.py); their
        outputs come back as this request's. Returns the (first) engine request."""
        sampling = sampling or SamplingParams()
        if request_id in self._live or request_id in self._parents:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        self.check_request(prompt_token_ids, sampling)
        if sampling.n == 1 and (sampling.best_of or 1) == 1:
            return self._add(request_id, prompt_token_ids, sampling, lora_request, prompt, cache_salt)
        parent = ParentRequest(request_id, sampling)
        first = None
        try:
            for i in range(parent.num_children):
                cid = child_id(request_id, i)
                req = self._add(cid, prompt_token_ids, parent.child_sampling(i), lora_request, prompt,
                                cache_salt, after=first)
                first = first or req
                parent.child_ids.append(cid)
                self._parent_of[cid] = request_id
        except BaseException:
            for cid in parent.child_ids:
                self._parent_of.pop(cid, None)
                self.abort_request(cid)
            raise
        self._parents[request_id] = parent
        return first

    def _add(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
             lora_request: LoRARequest | None, prompt: str | None, cache_salt: str,
             after: Request | None = None) -> Request:
        if request_id in self._live:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        ticket = None
        if lora_request is not None:
            if self.adapters is None:
                raise LoRADisabled(lora_request.lora_name, "engine started with max_loras=0")
            ticket = self.adapters.submit(lora_request)
        if self.default_stop:
            sampling = replace(sampling, stop=[*sampling.stop, *(s for s in self.default_stop
                                                               if s not in sampling.stop)])
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            lora_request=lora_request,
            prompt=prompt,
            eos_token_ids=self.eos_token_ids,
            adapter=ticket,
            cache_salt=cache_salt,
            after=after,
        )
        if ticket is not None:
            ticket.owner = req
            self._note_adapter(req)
        if sampling.structured_outputs is not None:
            req.grammar = self.compile_grammar(sampling.structured_outputs)
            self._compiling[request_id] = req
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, sampling.skip_special_tokens)
        self._live[request_id] = _Live(req, detok)
        self.scheduler.add(req)
        return req

    def check_request(self, ids: list[int], sampling: SamplingParams) -> None:
        """Everything about a request that depends on this model: checked before it is
        queued, so a value no step can run never reaches one (SamplingParams checks the
        rest when it is built)."""
        max_len = self.config.scheduler.max_model_len
        vocab = self.config.model.vocab_size
        sampling.check()  # again: a caller may have changed it since it was built
        if not ids:
            raise InvalidRequest("the prompt is empty")
        if len(ids) > max_len:
            raise PromptTooLong(f"prompt has {len(ids)} tokens, max_model_len is {max_len}")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in sampling.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be integers in [0, {vocab})")
        if any(not 0 <= t < vocab for t in sampling.logit_bias or {}):
            raise InvalidRequest(f"logit_bias token ids must be in [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(sampling, name)
            if n is not None and n > self.max_logprobs:
                raise InvalidRequest(f"{name}={n} exceeds max_logprobs={self.max_logprobs}")

    @staticmethod
    def _note_adapter(req: Request) -> None:
        """Where its adapter came from, and how long the request waited for it (none if
        it was in memory when the request arrived)."""
        t = req.adapter
        if t.ready:
            m = req.metrics
            m.adapter_source, m.adapter_content_id = t.tier, t.content_id
            m.adapter_load_time = 0.0 if t.load_time is None else time.monotonic() - m.arrival_time

    def _check_lora(self, lora_request: LoRARequest) -> AdapterManager:
        if self.adapters is None:
            raise LoRADisabled(lora_request.lora_name, "engine started with max_loras=0")
        return self.adapters

    def load_adapter(self, lora_request: LoRARequest, pin: bool = False) -> str:
        """Load and validate an adapter ahead of its requests (vLLM's --lora-modules),
        blocking; with pin, keep it in host memory and a GPU slot for good. Returns its
        content id."""
        manager = self._check_lora(lora_request)
        if not pin:
            ticket = manager.load(lora_request)
            manager.release(ticket)
            return ticket.content_id
        cid = manager.pin(lora_request)
        if self.scheduler.slots.slot_of(cid) is None:
            self.scheduler.pin_adapter(cid)
        return cid

    def prefetch_adapter(self, lora_request: LoRARequest):
        """Start loading an adapter; returns a concurrent Future of its content id."""
        return self._check_lora(lora_request).prefetch(lora_request)

    def unload_adapter(self, lora_request: LoRARequest) -> None:
        """Free an adapter's memory and GPU slot once no running request uses it."""
        if self.adapters is not None:
            cid = self.adapters.forget(lora_request)
            if cid is not None:
                self.scheduler.slots.forget(cid)

    def stats(self) -> dict[str, int]:
        """Counters and gauges for monitoring (read from any thread)."""
        out = {
            "requests_waiting": len(self.scheduler.waiting),
            "requests_running": len(self.scheduler.running),
            "kv_blocks_free": self.scheduler.blocks.num_free_blocks,
            "kv_blocks_total": self.scheduler.blocks.num_blocks,
            "adapter_slot_loads": self.scheduler.slots.num_loads,
            "adapter_slot_evictions": self.scheduler.slots.num_evictions,
            "prefix_cache_queried_tokens": self.scheduler.blocks.num_queried_tokens,
            "prefix_cache_hit_tokens": self.scheduler.blocks.num_hit_tokens,
            "prefix_cache_blocks": self.scheduler.blocks.num_cached_blocks,
            "spec_draft_tokens": self.scheduler.num_draft_tokens,
            "spec_accepted_tokens": self.scheduler.num_accepted_tokens,
            "spec_verified_chunks": self.scheduler.num_verified_chunks,
        }
        if self.adapters is not None:
            out["adapter_disk_loads"] = self.adapters.num_loads["disk"]
            out["adapter_remote_loads"] = self.adapters.num_loads["remote"]
            out["adapter_host_evictions"] = self.adapters.host.num_evictions
            out["adapters_loading"] = self.adapters.num_loading
            out["adapters_in_host"] = len(self.adapters.host)
            if self.adapters.pool is not None:
                out["adapter_pinned_pool_misses"] = self.adapters.pool.misses
        experts = self.runner.moe_experts_per_layer()
        if experts is not None:
            out["moe_experts_per_layer_decode"] = experts
        return out

    def abort_request(self, request_id: str) -> RequestOutput | None:
        parent = self._parents.get(request_id)
        if parent is not None:
            outs = [self.abort_request(c) for c in parent.child_ids]
            folded = self._fold([o for o in outs if o is not None])
            return folded[0] if folded else None
        live = self._live.get(request_id)
        if live is None:
            return None
        self.scheduler.finish(live.req, "abort")
        return self._output(live.req)

    def abort_all(self) -> None:
        """End every request and forget the step in flight (shutdown, after a failure)."""
        for request_id in list(self._live):
            self.abort_request(request_id)
        self._in_flight = None

    def close(self) -> None:
        """Release what outlives this object: tensor-parallel workers and their group."""
        self.abort_all()
        self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # -- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that progressed or ended.

        With async scheduling the step just planned is launched before the previous
        one's results are read, so the host's bookkeeping (results, detokenization,
        stop strings, the next plan) overlaps the device's work; outputs then trail the
        device by one step.

        A step that raises ends only the requests that caused it, where they can be told
        apart (see _recover); the others are recomputed and go on.
        """
        try:
            outputs = self._step()
        except Exception as error:
            logger.exception("engine step failed")
            outputs = self._recover(error)
        return self._fold(outputs)

    def _fold(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Child requests' outputs as their parent's (one per parent); a child that
        failed ends its siblings."""
        result, touched = [], {}
        for out in outputs:
            parent_id = self._parent_of.get(out.request_id)
            if parent_id is None:
                result.append(out)
                continue
            parent = self._parents[parent_id]
            parent.fold(out)
            touched[parent_id] = parent
        for parent_id, parent in touched.items():
            if parent.error is not None:
                for c in parent.child_ids:
                    if c in self._live:
                        parent.fold(self.abort_request(c))
            if parent.finished:
                del self._parents[parent_id]
                for c in parent.child_ids:
                    self._parent_of.pop(c, None)
            result.append(parent.output())
        return result

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs = self._poll_loads()
        if self._in_flight is not None and self.scheduler.wants_proposals():
            outputs += self._finish_step(self._in_flight)
            self._in_flight = None
        plan = self.scheduler.schedule()
        if self.draft_model is not None:
            self.draft_model.fill(plan, self.scheduler.requests)
        loads = {slot: self.adapters.get(key) for slot, key in plan.lora_loads.items()}
        launched = self.runner.launch(plan, loads, timed=self.step_timings is not None)
        self.num_steps += bool(plan.chunks)
        if not plan.chunks and self._in_flight is None and self.adapters and self.adapters.num_loading:
            self.adapters.wait(0.005)  # only loads are pending: do not spin
        outputs += self._finish_step(self._in_flight) if self._in_flight else []
        self._in_flight = None
        if self.async_scheduling and plan.chunks and not plan.host_drafts:
            self._in_flight = launched
        else:
            outputs += self._finish_step(launched)
        if launched.timing is not None and plan.chunks:
            launched.timing.total_s = time.perf_counter() - t0
            self.step_timings.append(launched.timing)
        return outputs

    def compile_grammar(self, spec: StructuredOutputs) -> Future:
        """A future of `spec` compiled (cached by spec), or of the InvalidRequest saying
        why it does not compile."""
        if self._grammars is None:  # made at the first structured request: it reads the vocabulary
            self._grammars = GrammarCompiler(self.tokenizer, self.config.model.vocab_size, self.eos_token_ids)
        return self._grammars.submit(spec)

    def _poll_loads(self) -> list[RequestOutput]:
        """Requests whose adapter finished loading become schedulable; those whose
        adapter failed, or whose grammar did not compile, end here with the error."""
        outputs = self._poll_adapters()
        for request_id, req in list(self._compiling.items()):
            if req.finished or req.grammar.done():
                del self._compiling[request_id]
                if not req.finished and req.grammar.exception() is not None:
                    self.scheduler.finish(req, "error")
                    outputs.append(self._output(req, error=req.grammar.exception()))
        return outputs

    def _poll_adapters(self) -> list[RequestOutput]:
        outputs = []
        for ticket in self.adapters.take_resolved() if self.adapters else []:
            req = ticket.owner
            if req is None or req.finished:
                continue
            if ticket.ready:
                self._note_adapter(req)
            else:
                self.scheduler.finish(req, "error")
                outputs.append(self._output(req, error=ticket.error))
        return outputs

    def _finish_step(self, launched: LaunchedStep) -> list[RequestOutput]:
        touched = self.scheduler.update(launched.plan, self.runner.collect(launched))
        outputs = []
        for req in touched:
            try:
                self._detokenize(req)
            except Exception as e:  # this request's tokens alone: the others go on
                logger.exception("detokenizing request %s failed", req.request_id)
                self.scheduler.finish(req, "error")
                outputs.append(self._output(req, error=RequestFailed(req.request_id, e)))
                continue
            outputs.append(self._output(req))
        return outputs

    def _detokenize(self, req: Request) -> None:
        live = self._live[req.request_id]
        self._decode_logprobs(req.prompt_logprobs[live.prompt_logprobs_decoded :])
        live.prompt_logprobs_decoded = len(req.prompt_logprobs)
        new_tokens = req.output_token_ids[live.detok.num_tokens :]
        self._decode_logprobs(req.logprobs[len(req.logprobs) - len(new_tokens) :])
        for token in new_tokens:
            self._add_text(req, live.detok.step(token))

    def _recover(self, error: Exception) -> list[RequestOutput]:
        """After a failed step: end the requests that caused it and recompute the rest.

        The culprit is the request a step names (RequestFailed: its own input made the
        step raise), else any live request that no longer passes the checks of
        admission. If none can be told apart, every request of the batch ends with the
        error (waiting requests were not in it and go on). The survivors are preempted:
        the step in flight is dropped, their pages freed, and they are recomputed from
        their tokens so far; adapter slots the failed step may not have filled are
        emptied (pinned adapters are copied in again).
        """
        culprits: dict[str, Exception] = {}
        if isinstance(error, RequestFailed):
            culprits[error.request_id] = error
        else:
            for live in list(self._live.values()):
                try:
                    self.check_request(live.req.prompt_token_ids, live.req.sampling)
                except InvalidRequest as e:
                    culprits[live.req.request_id] = e
        if not culprits:
            failure = EngineFailure(f"engine step failed: {type(error).__name__}: {error}")
            culprits = {req.request_id: failure for req in self.scheduler.running}
        outputs = []
        for request_id, cause in culprits.items():
            live = self._live.get(request_id)
            if live is not None and not live.req.finished:
                self.scheduler.finish(live.req, "error")
                outputs.append(self._output(live.req, error=cause))
        self._in_flight = None
        self.scheduler.recompute_all()
        self.runner.forget_step_state()
        return outputs

    def _add_text(self, req: Request, new_text: str) -> None:
        ended_by_token = req.finished and req.finish_reason == "stop"
        if ended_by_token and not req.sampling.include_stop_str_in_output:
            return  # as vLLM: the stop token's own text is left out
        req.output_text += new_text
        sp = req.sampling
        hit = find_stop_string(req.output_text, len(new_text), sp.stop, sp.include_stop_str_in_output)
        if hit is not None:
            stop, keep = hit
            req.output_text = req.output_text[:keep]
            if req.finished:  # ended by length on the same token: the stop string wins
                req.finish_reason, req.stop_reason = "stop", stop
            else:
                self.scheduler.finish(req, "stop", stop)

    def _decode_logprobs(self, positions: list[PositionLogprobs]) -> None:
        for pos in positions:
            for tid, lp in pos.items():
                if lp.decoded_token is None:
                    pos[tid] = Logprob(lp.logprob, lp.rank, self.tokenizer.decode([tid]))

    def _output(self, req: Request, error: Exception | None = None) -> RequestOutput:
        if req.finished:
            self._live.pop(req.request_id, None)
            if req.adapter is not None:
                self.adapters.release(req.adapter)
        sp = req.sampling
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=[None, *req.prompt_logprobs] if sp.prompt_logprobs is not None else None,
            outputs=[
                CompletionOutput(
                    index=0,
                    text=req.output_text,
                    token_ids=list(req.output_token_ids),
                    cumulative_logprob=req.cumulative_logprob if sp.logprobs is not None else None,
                    logprobs=list(req.logprobs) if sp.logprobs is not None else None,
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                )
            ],
            finished=req.finished,
            num_cached_tokens=req.num_cached_tokens,
            lora_request=req.lora_request,
            metrics=req.metrics,
            error=error,
        )


@dataclass
class _Live:
    """Engine-side state of a request that has not been returned finished yet."""

    req: Request
    detok: IncrementalDetokenizer
    prompt_logprobs_decoded: int = 0
