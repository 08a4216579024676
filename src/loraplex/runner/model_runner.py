"""Executes StepPlans: owns the model, the KV cache, adapter slots and input buffers.

It makes no policy decisions: the plan says which tokens run, where their pages are and
which adapters to copy into which slots; the runner builds the step's tensors, runs the
model and samples.

Under tensor parallelism (`tp`) every rank runs a ModelRunner over its shard of the model
(models/tensor_parallel.py) on the same plans (runner/tensor_parallel.py). Rank 0, the
leader, samples and broadcasts the ids (and, after verifying n-gram proposals, each
sequence's added token and shift); the others take them for the next step's pending
tokens and compute logits only where rank 0 does, since the LM head gathers them.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import random
import time
from collections.abc import Mapping

import torch

from loraplex import ops
from loraplex.adapters.peft import LoRAAdapter
from loraplex.adapters.slots import LoRASlotBuffers
from loraplex.config import EngineConfig
from loraplex.device import to_device
from loraplex.errors import RequestFailed
from loraplex.layers.context import ForwardContext, forward_context
from loraplex.layers.linear import weights_deferred
from loraplex.layers.parallel import TPGroup
from loraplex.models.quant import materialize_weights, quantized_layers
from loraplex.models.registry import build_model
from loraplex.models.tensor_parallel import param_shards, shard_config, shard_model
from loraplex.models.weights import (
    adapted_modules,
    adapter_targets,
    checkpoint_tensor_names,
    init_dummy,
    load_safetensors,
)
from loraplex.ops.metadata import SHORT_QUERY_MAX
from loraplex.runner.batch_meta import InputBuffers, SpecIndex, StepInputs
from loraplex.runner.cuda_graphs import StepGraphs
from loraplex.runner.logit_rules import LogitRules
from loraplex.runner.ngram_drafts import NgramDrafts
from loraplex.runner.rejection import rejection_sample
from loraplex.runner.sampler import SamplingRows, sample, sampling_probs, token_logprobs
from loraplex.runner.step_outputs import LaunchedStep, StepTiming, concat_logprobs
from loraplex.runner.structured import GrammarRows
from loraplex.types import (
    SamplingParams,
    ScheduledChunk,
    StepPlan,
    StepResult,
)

logger = logging.getLogger("loraplex")


class ModelRunner:
    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...] = (),
                 shared_page_bytes: int = 0, reserved_bytes: int = 0, tp: TPGroup | None = None):
        """shared_page_bytes: what each KV page also costs elsewhere (a draft model's
        cache indexed by the same page ids); reserved_bytes: device memory to leave for
        weights loaded after this runner sizes its cache (the draft model's); tp: this
        process's rank of a tensor-parallel group (config.model stays the full model's;
        the runner's own config holds its shard's sizes)."""
        self.tp, self.leader = tp, tp is None or tp.rank == 0
        self.full_model = config.model
        if tp is not None:
            config = dataclasses.replace(config, model=shard_config(config.model, tp.size))
        self.config = config
        self.shared_page_bytes, self.reserved_bytes = shared_page_bytes, reserved_bytes
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.model = self._load_model()
        lora = config.lora
        self.projections, experts = adapted_modules(self.model, lora.target_modules)
        self.adapter_targets = adapter_targets(self.model, lora.target_modules)
        self.lora_slots = (
            LoRASlotBuffers(self.projections, lora.max_loras, lora.max_lora_rank, self.dtype, self.device,
                            experts)
            if lora.enabled
            else None
        )
        sched = config.scheduler
        graph_batch = min(sched.max_num_seqs, 256)
        short_chunks = self._short_chunk_graphs(graph_batch)
        self.inputs = InputBuffers(
            max_tokens=sched.max_num_batched_tokens,
            max_seqs=sched.max_num_seqs,
            max_blocks_per_seq=config.max_blocks_per_seq,
            max_loras=lora.max_loras,
            block_size=config.cache.block_size,
            device=self.device,
            max_graph_seqs=short_chunks[1] if short_chunks else 0,
        )
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self._request_generators: dict[str, torch.Generator] = {}
        self._seed_stream = random.Random(config.seed)  # draw keys of unseeded rows
        self.eos_token_ids = eos_token_ids  # min_tokens bans these
        self.graphs: StepGraphs | None = None  # captured after the KV cache exists
        # The last step's sampled ids on the device, and each request's row in them.
        self._last_token_ids: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        self._last_step: LaunchedStep | None = None
        # With n-gram proposals made on the device: per row of _last_token_ids, by how
        # much its sequence fell short of the plan (None: rows of plain samples, no shift).
        self._last_shift: torch.Tensor | None = None
        spec = config.speculative
        self.ngram = (NgramDrafts(spec, sched.max_num_seqs, sched.max_model_len, config.cache.block_size,
                                  self.device)
                      if spec is not None and spec.method == "ngram" else None)
        self._structured = GrammarRows(config.model.vocab_size, eos_token_ids)
        use_streams = self.device.type == "cuda" and config.ops_backend == "triton"
        # Decode graphs run the LoRA shrink on this side stream, beside the base GEMM.
        self.aux_stream = torch.cuda.Stream(self.device) if use_streams else None
        # Adapter copies into GPU slots, and per slot the last step that read it.
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self.device.type == "cuda":
            # cuBLASLt picks better kernels for decode's skinny GEMMs (M = batch): on an
            # H200, o_proj 13.8 -> 11.5 us and down_proj 33.5 -> 31.1 us at M = 32
            # (benchmarks/gemm_probe.py); serving throughput +2%. Process-wide setting.
            torch.backends.cuda.preferred_blas_library("cublaslt")
        self._slot_last_read: dict[int, torch.cuda.Event] = {}
        # Per slot, the end of a copy into it that no step has waited for yet.
        self._slot_ready: dict[int, torch.cuda.Event] = {}
        # MoE: (distinct experts hit, layer-steps) summed over decode steps, when measured.
        self.moe_stats = (torch.zeros(2, dtype=torch.float32, device=self.device)
                          if config.measure_moe_routing and config.model.moe_layers else None)
        self.num_blocks = self._allocate_kv_cache()
        if self.device.type == "cuda" and config.ops_backend == "triton" and config.cudagraph_mode != "NONE":
            mixed = (min(sched.max_num_batched_tokens, config.max_cudagraph_capture_size)
                     if config.cudagraph_mode == "FULL" else None)
            if config.model.mla is not None:  # latent attention has a kernel for decode steps only;
                mixed = short_chunks = None  # its op for longer chunks reads the batch on the host
            self.graphs = StepGraphs(
                self.model, self.inputs, graph_batch, mixed, self.lora_slots is not None,
                self.aux_stream, self.moe_stats, short_chunks,
                router_variants=self.lora_slots is not None and self.lora_slots.has_routers,
            )
            with ops.using_backend(config.ops_backend):
                self.graphs.capture()
                self._warm_up_eager_kernels()

    def _short_chunk_graphs(self, max_batch: int) -> tuple[int, int] | None:
        """(tokens a chunk, tokens a step) of the steps speculation verifies, where
        short-chunk graphs serve them (runner/cuda_graphs.py), else None."""
        spec = self.config.speculative
        if spec is None or spec.num_speculative_tokens + 1 > SHORT_QUERY_MAX:
            return None
        return (spec.num_speculative_tokens + 1,
                min(spec.max_step_tokens(max_batch), self.config.scheduler.max_num_batched_tokens))

    @torch.inference_mode()
    def _warm_up_eager_kernels(self) -> None:
        """The kernel variants of eager steps whose choice follows the token count (graphs
        compiled those of decode): the MoE experts' and the LoRA ones."""
        max_tokens = self.config.scheduler.max_num_batched_tokens
        moe_seen = set()
        for module in self.model.modules():
            key = module.warm_up_key() if hasattr(module, "warm_up_key") else None
            if key is not None and key not in moe_seen:
                moe_seen.add(key)
                module.warm_up(max_tokens)
        if self.lora_slots is None:
            return
        seen = set()
        for layer in self.lora_slots.layers:
            w = layer.lora
            key = (tuple(w.a.shape), tuple(w.b.shape), tuple(layer.output_sizes))
            if key not in seen:
                seen.add(key)
                ops.warm_up_lora(w.a, w.b, tuple(layer.output_sizes),
                                 self.config.scheduler.max_num_batched_tokens)

    def reset_moe_routing_stats(self) -> None:
        if self.moe_stats is not None:
            self.moe_stats.zero_()  # in place: captured graphs add into this tensor

    def moe_experts_per_layer(self) -> float | None:
        """Mean distinct experts per MoE layer per decode step since measuring began."""
        if self.moe_stats is None:
            return None
        hits, n = self.moe_stats.tolist()
        return hits / n if n else None

    # -- setup ---------------------------------------------------------------------------

    def _load_model(self) -> torch.nn.Module:
        cfg = self.config
        t0 = time.perf_counter()
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), weights_deferred():  # formats chosen below
                model = build_model(cfg.model, cfg.scheduler.max_model_len)
        finally:
            torch.set_default_dtype(prev)
        if self.tp is not None:
            shard_model(model, self.full_model, self.tp)
        shards = param_shards(model) if self.tp is not None else None
        dummy = cfg.load_format == "dummy"
        names = None if dummy else checkpoint_tensor_names(model, cfg.model_path)
        materialize_weights(model, cfg.model, self.dtype, self.device,
                            quantized_layers(model, cfg.model, names))
        with torch.no_grad():
            if dummy:
                init_dummy(model, cfg.model.initializer_range, cfg.seed, shards)
            else:
                load_safetensors(model, cfg.model_path, cfg.model.tie_word_embeddings, cfg.model.quant,
                                 shards)
        model.eval()
        quantized = [m for m in model.modules() if isinstance(m, ops.QuantizedWeight)]
        n = sum(p.numel() for p in model.parameters()) + sum(math.prod(w.shape) for w in quantized)
        nbytes = (sum(p.numel() * p.element_size() for p in model.parameters())
                  + sum(w.nbytes() for w in quantized))
        formats = cfg.dtype + (f", {len(quantized)} weights {cfg.model.quant.method}" if quantized else "")
        shard = f" (rank {self.tp.rank} of {self.tp.size})" if self.tp is not None else ""
        logger.info(
            "loaded %s (%s): %s parameters, %.2f GiB %s on %s%s in %.1f s",
            cfg.model.architecture, "dummy weights" if cfg.load_format == "dummy" else cfg.model_path,
            _count(n), nbytes / 2**30, formats, self.device, shard, time.perf_counter() - t0,
        )
        return model

    def _attention_layers(self) -> list[torch.nn.Module]:
        """Layers that keep a KV cache: each says its tensors (kv_cache_spec)."""
        return [m for m in self.model.modules() if hasattr(m, "kv_cache_spec")]

    def _bind_kv_cache(self, layers: list[torch.nn.Module], num_blocks: int) -> None:
        bs, dtype = self.config.cache.block_size, self.dtype
        for layer in layers:
            for name, shape in layer.kv_cache_spec().items():
                setattr(layer, name, torch.empty((num_blocks, bs, *shape), dtype=dtype, device=self.device))

    def _allocate_kv_cache(self) -> int:
        cfg = self.config
        layers = self._attention_layers()
        bs = cfg.cache.block_size
        per_block = bs * self.dtype.itemsize * sum(
            math.prod(shape) for layer in layers for shape in layer.kv_cache_spec().values())
        cost = per_block + self.shared_page_bytes  # a page here and its twin elsewhere
        # More pages than max_num_seqs full-length sequences can never be used.
        useful = cfg.scheduler.max_num_seqs * cfg.max_blocks_per_seq
        if cfg.cache.num_gpu_blocks_override is not None:
            num_blocks = cfg.cache.num_gpu_blocks_override
        elif self.device.type == "cuda":
            num_blocks = min(useful, max(0, self._profile_free_memory() - self.reserved_bytes) // cost)
        else:
            num_blocks = min(useful, max(0, cfg.cache.cpu_kv_cache_bytes - self.reserved_bytes) // cost)
        if self.tp is not None:  # one page table for all ranks: the smallest cache
            num_blocks = self.tp.min(num_blocks, self.device)
        if num_blocks < cfg.max_blocks_per_seq:
            raise ValueError(
                f"the KV cache holds {num_blocks * bs} tokens, less than max_model_len="
                f"{cfg.scheduler.max_model_len}; lower max_model_len or give it more memory"
            )
        # Uninitialised: attention reads only slots a step has written, and on CPU untouched
        # pages of a large cache then cost no memory.
        self._bind_kv_cache(layers, num_blocks)
        logger.info(
            "KV cache: %d pages of %d tokens (%.2f GiB)", num_blocks, bs,
            num_blocks * per_block / 2**30,
        )
        return num_blocks

    def _profile_free_memory(self) -> int:
        """Bytes left for the KV cache after weights and the largest step's activations."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.run_largest_step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info()
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak
        if budget <= 0:
            raise ValueError(
                f"no memory left for the KV cache: weights and activations take "
                f"{peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB"
            )
        return budget

    def run_largest_step(self) -> None:
        """Run the largest step the scheduler can plan, on a throwaway KV cache."""
        plan, num_blocks = largest_step(self.config)
        layers = self._attention_layers()
        saved = [{name: getattr(layer, name) for name in layer.kv_cache_spec()} for layer in layers]
        self._bind_kv_cache(layers, num_blocks)
        try:
            self.run(plan)
        finally:
            for layer, tensors in zip(layers, saved):
                for name, tensor in tensors.items():
                    setattr(layer, name, tensor)

    # -- steps ---------------------------------------------------------------------------

    def run(self, plan: StepPlan, loads: Mapping[int, LoRAAdapter] | None = None) -> StepResult:
        """Execute `plan` and wait for its result."""
        return self.collect(self.launch(plan, loads))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, loads: Mapping[int, LoRAAdapter] | None = None,
               timed: bool = False) -> LaunchedStep:
        """Queue `plan`'s work on the device; collect() returns its result. `loads`: the
        adapter of each slot in plan.lora_loads. timed: the step carries its StepTiming."""
        t0 = time.perf_counter()
        with ops.using_backend(self.config.ops_backend):
            out = self._launch(plan, loads or {}, timed)
        if out.timing is not None:
            out.timing.launch_s = time.perf_counter() - t0
        return out

    def synchronize(self) -> None:
        """Wait for all device work queued so far."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def collect(self, launched: LaunchedStep) -> StepResult:
        return launched.result()

    def close(self) -> None:
        """Drop the CUDA graphs (under tensor parallelism NCCL frees a communicator only
        after the graphs that captured its collectives are gone)."""
        self.synchronize()
        self.graphs = None
        gc.collect()

    def _launch(self, plan: StepPlan, loads: Mapping[int, LoRAAdapter], timed: bool) -> LaunchedStep:
        for request_id in plan.finished_request_ids:
            self._request_generators.pop(request_id, None)
        self._structured.forget(plan.finished_request_ids)
        out = LaunchedStep(plan)
        timing = out.timing = StepTiming(plan.num_tokens, len(plan.lora_loads)) if timed else None
        start = None
        if timed and self.device.type == "cuda" and plan.chunks:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        if plan.lora_loads:
            t0 = time.perf_counter()
            copies = self._load_slots({slot: loads[slot] for slot in plan.lora_loads}, timed)
            if timing is not None:
                timing.slot_load_s, timing.slot_copies = time.perf_counter() - t0, copies
        if not plan.chunks:
            return out
        for chunk in plan.chunks:  # the copies this step reads; others run on beside it
            ready = self._slot_ready.pop(chunk.lora_slot, None)
            if ready is not None:
                torch.cuda.current_stream().wait_event(ready)
        ranks = self.lora_slots.ranks if self.lora_slots else []
        dora = self.lora_slots.dora_slots if self.lora_slots else set()
        graph = None
        if self.graphs is not None and not any(c.lora_slot in dora for c in plan.chunks):  # DoRA: eager
            graph = self.graphs.shape_for(plan.num_tokens, len(plan.chunks),
                                          max(c.num_tokens for c in plan.chunks))
        inputs = self.inputs.prepare(plan, ranks, graph=graph, dora_slots=dora, pending_rows=self._last_rows,
                                     device_drafts=self.ngram is not None)
        found = None
        if self.ngram is not None:
            found = self.ngram.complete(plan, inputs, self._last_token_ids, self._last_shift)
            if graph is None and self._last_shift is not None:  # eager ops read the host copies
                inputs.attn.seq_lens_cpu = inputs.attn.seq_lens.tolist()
                inputs.attn.max_seq_len = max(inputs.attn.seq_lens_cpu)
        elif inputs.feed is not None:  # tokens the step in flight samples, from its device output
            inputs.input_ids[inputs.feed[0]] = self._last_token_ids[inputs.feed[1]]
        # MoE routers run their LoRA only in steps whose adapters adapt one.
        router_lora = self.lora_slots is not None and any(
            c.lora_slot in self.lora_slots.router_slots for c in plan.chunks)
        if graph is not None:
            hidden = self.graphs.replay(graph, inputs.lora is not None, router_lora)
        else:
            decode = inputs.attn.max_query_len == 1
            # No side stream for the LoRA shrink here: an eager step waits on its host, and
            # each hop between streams costs ~16 us of it (128 per Llama-8B step); on the
            # device the shrink beside the GEMM gained nothing (benchmarks/profile_prefill.py).
            ctx = ForwardContext(attn=inputs.attn, lora=inputs.lora, aux_stream=None,
                                 moe_stats=self.moe_stats if decode else None, router_lora=router_lora)
            with forward_context(ctx):
                hidden = self.model(inputs.input_ids, inputs.positions)

        spec = inputs.spec
        # One pass over the vocabulary's weights for the sampled and the verified rows.
        rows = [r for r in (inputs.sample_rows if inputs.sample_chunks else None,
                            spec.rows if spec else None) if r is not None]
        if rows:
            logits = self.model.compute_logits(hidden[torch.cat(rows) if len(rows) > 1 else rows[0]])
            num_sampled = len(inputs.sample_chunks)
            if inputs.sample_chunks:
                self._sample(plan, inputs.sample_chunks, logits[:num_sampled], out)
            if spec is not None:
                self._verify(plan, inputs, spec, logits[num_sampled:], out, found)
        self._prompt_logprobs(plan, inputs.attn.query_start_loc_cpu, hidden, out)
        out.start_copies()
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            timing.device = (start, end)
        if self.copy_stream is not None and inputs.lora is not None:
            done = torch.cuda.Event()
            done.record()
            for chunk in plan.chunks:
                if chunk.lora_slot >= 0:
                    self._slot_last_read[chunk.lora_slot] = done
        return out

    def forget_step_state(self) -> None:
        """After a failed step: no step is in flight, so no token is pending on the
        device; seeded requests start their generators again when recomputed."""
        self._last_token_ids, self._last_rows, self._last_step, self._last_shift = None, {}, None, None
        self._request_generators.clear()
        self._structured.clear()

    def _pending_id(self, request_id: str) -> int:
        """The token `request_id` sampled in the step still in flight (waits for that
        step's copy to the host)."""
        return self._last_step.sampled_ids()[self._last_rows[request_id]]

    def _load_slots(self, loads: dict[int, LoRAAdapter], timed: bool) -> tuple | None:
        """Copy adapters from pinned host memory into GPU slots on their own stream, so
        the copies overlap the steps running meanwhile; the first step that reads a slot
        waits for its copy (the scheduler runs a request whose adapter is being copied
        in from the next step on, so that is usually done by then). A slot is
        overwritten only after the last step that read it (a request that left that
        slot may still be in the step in flight). timed: returns events marking when
        the copy stream reached the loads, their slots were free, the copies were done."""
        if self.copy_stream is None:
            for slot, adapter in loads.items():
                self.lora_slots.load(slot, adapter)
            return None
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if timed else None
        with torch.cuda.stream(self.copy_stream):
            if marks:
                marks[0].record()
            for slot in loads:
                last_read = self._slot_last_read.pop(slot, None)
                if last_read is not None:
                    self.copy_stream.wait_event(last_read)
            if marks:
                marks[1].record()
            for slot, adapter in loads.items():
                self.lora_slots.load(slot, adapter)
                done = torch.cuda.Event()
                done.record(self.copy_stream)
                self._slot_ready[slot] = done
                adapter.last_copy = done  # its host buffer is free after this
            if marks:
                marks[2].record()
        return tuple(marks) if marks else None

    def _sample(self, plan: StepPlan, rows: list[int], logits: torch.Tensor, out: LaunchedStep):
        chunks = [plan.chunks[i] for i in rows]
        if not self.leader:  # the leader's ids, for the pending tokens of the next step
            token_ids = self.tp.broadcast(torch.empty(len(rows), dtype=torch.int64, device=self.device))
            self._last_token_ids, self._last_step, self._last_shift = token_ids, out, None
            self._last_rows = {c.request_id: j for j, c in enumerate(chunks)}
            return
        try:
            self._sample_rows(chunks, rows, logits, out)
        finally:
            if self.tp is not None:  # the other ranks wait for ids: they get them even on failure
                ids = out.token_ids if out.token_ids is not None else torch.zeros(
                    len(rows), dtype=torch.int64, device=self.device)
                self.tp.broadcast(ids)

    def _sample_rows(self, chunks: list[ScheduledChunk], rows: list[int], logits: torch.Tensor,
                     out: LaunchedStep):
        generators, banned, seeds, rules = zip(*(self._row_state(c) for c in chunks))
        sampling_rows = SamplingRows(
            temperature=[c.sampling.temperature for c in chunks],
            top_k=[c.sampling.top_k for c in chunks],
            top_p=[c.sampling.top_p for c in chunks],
            generators=list(generators),
            banned=list(banned),
            seeds=list(seeds),
            rules=list(rules),
            last_ids=self._last_token_ids,
            grammar=self._structured.bitmask(chunks, self._pending_id),
        )
        want = [c.sampling.logprobs for c in chunks]
        scored = any(w is not None for w in want)
        raw = logits.clone() if scored and sampling_rows.modifies_logits(logits.shape[-1]) else logits
        token_ids = sample(logits, sampling_rows, self.generator)
        if scored:
            out.sample_lps = token_logprobs(raw, token_ids, max(w or 0 for w in want))
        out.sample_chunks, out.sample_logprobs, out.token_ids = rows, want, token_ids
        self._last_token_ids, self._last_step, self._last_shift = token_ids, out, None
        self._last_rows = {c.request_id: j for j, c in enumerate(chunks)}

    def _verify(self, plan: StepPlan, inputs: StepInputs, spec: SpecIndex, logits: torch.Tensor,
                out: LaunchedStep, found: torch.Tensor | None):
        """Speculated chunks, from the target's logits at their rows (spec.rows): greedy
        acceptance (ops.greedy_accept) or rejection sampling (runner/rejection.py), which
        keeps the target's distribution. Proposals are read from the step's input ids;
        `found`: how many each chunk's draft positions hold, where the device proposed
        them (else all of them). The leader verifies; with proposals made on the device
        the other ranks take from it the token each sequence added and its shift, for
        the step after (planned before this one's results)."""
        device_drafts = plan.chunks[spec.chunks[0]].device_drafts
        num = len(spec.chunks)
        if not self.leader:
            if device_drafts:
                added, shift = self.tp.broadcast(torch.empty(2, num, dtype=torch.int64, device=self.device))
                self._note_verified(plan, inputs, spec.chunks, added, shift.to(torch.int32), out)
            return
        next_step = None
        try:
            verified, added, shift = self._accept(plan, inputs, spec, logits, found)
            next_step = torch.stack([added, shift.to(torch.int64)])
        finally:
            if self.tp is not None and device_drafts:  # the other ranks wait: they get it even on failure
                self.tp.broadcast(next_step if next_step is not None else torch.zeros(
                    2, num, dtype=torch.int64, device=self.device))
        out.spec_chunks, out.spec_verified = spec.chunks, verified
        if device_drafts:
            self._note_verified(plan, inputs, spec.chunks, added, shift, out)

    def _accept(self, plan: StepPlan, inputs: StepInputs, spec: SpecIndex, logits: torch.Tensor,
                found: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ops.greedy_accept's (verified, added, shift), greedily or by rejection sampling."""
        chunks, k = spec.chunks, spec.k
        found = spec.counts if found is None else found
        sps = [plan.chunks[i].sampling for i in chunks]
        if all(sp.greedy for sp in sps):
            best = logits.view(len(chunks), k + 1, -1).argmax(dim=-1)
            return ops.greedy_accept(best, inputs.input_ids, spec.meta, found)
        row_sps = [sp for sp in sps for _ in range(k + 1)]
        probs = sampling_probs(logits, [sp.temperature for sp in row_sps], [sp.top_k for sp in row_sps],
                               [sp.top_p for sp in row_sps]).view(len(chunks), k + 1, -1)
        greedy = to_device([sp.greedy for sp in sps], torch.bool, self.device)
        drafts = inputs.input_ids[spec.draft_rows].view(len(chunks), k)
        proposed = found[spec.meta[:, 2]].long()
        sampled = rejection_sample(probs, drafts, proposed, greedy, generator=self.generator)
        accepted = sampled.num_accepted
        verified = torch.cat([sampled.token_ids, accepted[:, None], proposed[:, None]], dim=1)
        added = sampled.token_ids.gather(1, accepted[:, None])[:, 0]
        return verified, added, (accepted - spec.meta[:, 1]).to(torch.int32)

    def _note_verified(self, plan: StepPlan, inputs: StepInputs, spec: list[int], added: torch.Tensor,
                       shift: torch.Tensor, out: LaunchedStep) -> None:
        """The next step, planned as if every draft position held a kept proposal, is fed
        each verified sequence's last token (`added`) and moved back by `shift` (<= 0);
        after this step's sampled rows, if it has any (_sample just recorded them)."""
        if inputs.sample_chunks:
            sampled, rows = self._last_token_ids, self._last_rows
            first = len(sampled)
            self._last_token_ids = torch.cat([sampled, added])
            self._last_shift = torch.cat([self.ngram.no_shift[:first], shift])
        else:
            rows, first = {}, 0
            self._last_token_ids, self._last_shift = added, shift
        self._last_rows = rows | {plan.chunks[i].request_id: first + j for j, i in enumerate(spec)}
        self._last_step = out

    def _prompt_logprobs(self, plan: StepPlan, qsl: list[int], hidden: torch.Tensor, out: LaunchedStep):
        rows, targets = [], []
        for i, chunk in enumerate(plan.chunks):
            task = chunk.prompt_logprobs
            if task is not None:
                first = qsl[i] + task.first_row
                rows.extend(range(first, first + len(task.target_ids)))
                targets.extend(task.target_ids)
                out.prompt_tasks.append((i, task))
        if not rows:
            return
        # Prompt rows can be many (a whole prefill chunk): score them in slices so the
        # [rows, vocab] logits stay small.
        max_top = max(t.num_top for _, t in out.prompt_tasks)
        parts = []
        for a in range(0, len(rows), 1024):
            idx = to_device(rows[a : a + 1024], torch.int64, self.device)
            tgt = to_device(targets[a : a + 1024], torch.int64, self.device)
            logits = self.model.compute_logits(hidden[idx])
            if self.leader:
                parts.append(token_logprobs(logits, tgt, max_top))
        out.prompt_lps = concat_logprobs(parts) if self.leader else None

    def _row_state(self, chunk: ScheduledChunk) -> tuple:
        """A sampled row's generator, banned tokens, draw key and logit rules; what fails
        here fails on this request's own parameters, so the error names it."""
        try:
            return (self._generator_for(chunk), self._banned_tokens(chunk), self._draw_seed(chunk),
                    self._logit_rules(chunk))
        except Exception as e:
            raise RequestFailed(chunk.request_id, e) from e

    def _logit_rules(self, chunk: ScheduledChunk) -> LogitRules | None:
        prompt_ids, output_ids = chunk.history or ([], [])
        pending = chunk.num_output_tokens > len(output_ids) and chunk.history is not None
        return LogitRules.of(chunk.sampling, prompt_ids, output_ids,
                             self._last_rows[chunk.request_id] if pending else None)

    def _draw_seed(self, chunk: ScheduledChunk) -> int:
        """The key of this row's draws in the fused sampler: a seeded request's seed mixed
        with the index of the token being sampled (the same token whatever the batch),
        else the next number of the engine's own seeded stream."""
        seed = chunk.sampling.seed
        if seed is None:
            return self._seed_stream.getrandbits(63)
        return _mix64(seed, chunk.num_output_tokens)

    def _generator_for(self, chunk: ScheduledChunk) -> torch.Generator | None:
        seed = chunk.sampling.seed
        if seed is None or chunk.sampling.greedy:
            return None
        gen = self._request_generators.get(chunk.request_id)
        if gen is None:
            gen = torch.Generator(self.device).manual_seed(seed)
            self._request_generators[chunk.request_id] = gen
        return gen

    def _banned_tokens(self, chunk: ScheduledChunk) -> list[int]:
        sp = chunk.sampling
        if chunk.num_output_tokens >= sp.min_tokens:
            return []
        vocab = self.config.model.vocab_size
        if any(not 0 <= t < vocab for t in sp.stop_token_ids):  # admission checks this; an
            # index past the logits would be a device assert no step recovers from
            raise ValueError(f"stop_token_ids outside [0, {vocab})")
        eos = [] if sp.ignore_eos else list(self.eos_token_ids)
        return eos + sp.stop_token_ids


def _mix64(seed: int, index: int) -> int:
    """A 63-bit key from (seed, index), well spread for nearby inputs (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


def largest_step(config: EngineConfig) -> tuple[StepPlan, int]:
    """A plan of max_num_batched_tokens prompt tokens over as few sequences as the limits
    allow, and the KV pages it needs: the step with the most activation memory."""
    sched, bs = config.scheduler, config.cache.block_size
    n = min(sched.max_num_batched_tokens, sched.max_num_seqs * sched.max_model_len)
    chunks, next_block = [], 0
    for i, start in enumerate(range(0, n, sched.max_model_len)):
        k = min(sched.max_model_len, n - start)
        pages = math.ceil(k / bs)
        chunks.append(ScheduledChunk(
            request_id=f"profile-{i}", token_ids=[0] * k, start_pos=0,
            block_ids=list(range(next_block, next_block + pages)), lora_slot=-1,
            sample=True, sampling=SamplingParams(temperature=0), num_output_tokens=0,
        ))
        next_block += pages
    return StepPlan(chunks=chunks), next_block


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)
