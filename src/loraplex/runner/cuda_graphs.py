"""Steps replayed from CUDA graphs: decode steps, steps of short chunks (speculative
verification: k + 1 tokens a sequence) and mixed steps (prefill chunks + decodes).

A step launches hundreds of kernels; replaying them from a graph removes the host's
launch cost (15-50 us per call into torch or Triton), so the host can never be what a
step waits for, however busy its other threads are (adapter loads). Decode graphs are
captured per padded batch size; short-chunk graphs per padded token count, with one
sequence per token at most (their attention takes the decode kernels, a sequence's tokens
in one tile: ops/triton/paged_decode.py); mixed graphs per padded token count, each
holding every sequence a step may have. Every graph exists with and without the LoRA
kernels (steps with no adapter skip them); decode graphs of a model with MoE routers
also exist with adapters but without the routers' LoRA, for steps whose adapters do not
adapt a router. All inputs live in the runner's static buffers, including the adapter
slots and token groups, and every kernel finds its work from device tensors
(ops.triton.segment_tiles), so one graph serves any mix of chunk lengths, adapters and
base requests. Steps past the largest mixed graph run eagerly: at that size the device
time dwarfs the host's.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time

import torch

from loraplex.layers.context import ForwardContext, forward_context
from loraplex.runner.batch_meta import GraphShape, InputBuffers

logger = logging.getLogger("loraplex")

# Mixed graphs come one per multiple of MIXED_GRAPH_STEP tokens (up to the engine's
# max_cudagraph_capture_size). Padding tokens attend to nothing and use no adapter, but
# the GEMMs compute them.
MIXED_GRAPH_STEP = 64


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def mixed_graph_sizes(max_tokens: int) -> list[int]:
    sizes = list(range(MIXED_GRAPH_STEP, max_tokens + 1, MIXED_GRAPH_STEP))
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


class StepGraphs:
    def __init__(self, model: torch.nn.Module, inputs: InputBuffers, max_batch: int,
                 max_tokens: int | None, with_lora: bool, aux_stream: torch.cuda.Stream | None = None,
                 moe_stats: torch.Tensor | None = None, short_chunks: tuple[int, int] | None = None,
                 router_variants: bool = False):
        """max_tokens: the largest mixed step to capture; None: decode graphs only.
        short_chunks: (most tokens a chunk, most tokens a step) of the short-chunk graphs
        to capture (speculative verification), or None. router_variants: decode graphs
        with adapters come in two kinds, with and without the MoE routers' LoRA."""
        self.model = model
        self.moe_stats = moe_stats
        self.aux_stream = aux_stream
        self.inputs = inputs
        self.decode_sizes = graph_batch_sizes(max_batch)
        self.short_query_len, max_short = short_chunks or (0, 0)
        self.short_sizes = [s for s in graph_batch_sizes(max_short) if s > 1] if short_chunks else []
        self.mixed_sizes = mixed_graph_sizes(max_tokens) if max_tokens else []
        self.lora_variants = (False, True) if with_lora else (False,)
        self.router_variants = with_lora and router_variants
        # (shape, with adapters, with the routers' LoRA) -> (graph, its hidden states)
        self._graphs: dict[tuple[GraphShape, bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        # No garbage collection inside a capture: a finalizer it runs there (a dead
        # engine's pinned pool calls cudaHostUnregister) invalidates the capture.
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            self._capture()
        finally:
            if enabled:
                gc.enable()

    def _capture(self) -> None:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        shapes = [GraphShape(s, s, 1) for s in self.decode_sizes]
        shapes += [GraphShape(t, t, self.short_query_len) for t in self.short_sizes]
        shapes += [GraphShape(t, self.inputs.mixed_graph_seqs, None) for t in self.mixed_sizes]
        # Largest first: smaller graphs reuse its memory.
        for shape in sorted(shapes, key=lambda g: g.tokens, reverse=True):
            variants = [(lora, True) for lora in self.lora_variants]
            if self.router_variants and shape.decode:
                variants.append((True, False))
            for lora, router in variants:
                step = self.inputs.graph_inputs(shape, lora)
                # The LoRA shrink beside the base GEMM on the side stream pays in decode
                # (skinny GEMMs leave the GPU idle); in larger steps it gained nothing.
                ctx = ForwardContext(attn=step.attn, lora=step.lora,
                                     aux_stream=self.aux_stream if shape.short else None,
                                     moe_stats=self.moe_stats if shape.decode else None, router_lora=router)
                with forward_context(ctx):
                    self.model(step.input_ids, step.positions)  # compile kernels, warm up
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        hidden = self.model(step.input_ids, step.positions)
                self._graphs[(shape, lora, router)] = (graph, hidden)
        torch.cuda.synchronize()
        short = (f"; chunks of up to {self.short_query_len} tokens in steps of up to {self.short_sizes[-1]}"
                 if self.short_sizes else "")
        logger.info(
            "captured %d CUDA graphs in %.1f s: decode batch sizes %s%s; mixed steps of up to %s tokens "
            "(%d sizes); with and without adapters", len(self._graphs), time.perf_counter() - t0,
            ",".join(map(str, self.decode_sizes)), short, self.mixed_sizes[-1] if self.mixed_sizes else 0,
            len(self.mixed_sizes),
        )

    def shape_for(self, num_tokens: int, num_seqs: int, max_query_len: int) -> GraphShape | None:
        """The graph that serves a step of num_tokens tokens in num_seqs sequences of at
        most max_query_len tokens, or None (run it eagerly)."""
        if max_query_len == 1:  # decode
            i = bisect.bisect_left(self.decode_sizes, num_seqs)
            if i < len(self.decode_sizes):
                return GraphShape(self.decode_sizes[i], self.decode_sizes[i], 1)
        elif max_query_len <= self.short_query_len:
            i = bisect.bisect_left(self.short_sizes, num_tokens)
            if i < len(self.short_sizes):
                return GraphShape(self.short_sizes[i], self.short_sizes[i], self.short_query_len)
        i = bisect.bisect_left(self.mixed_sizes, num_tokens)
        if i < len(self.mixed_sizes) and num_seqs < self.inputs.mixed_graph_seqs:
            return GraphShape(self.mixed_sizes[i], self.inputs.mixed_graph_seqs, None)
        return None

    def replay(self, shape: GraphShape, with_lora: bool, router_lora: bool = True) -> torch.Tensor:
        """Run the graph of `shape` on the inputs in the buffers it reads (filled by
        InputBuffers.prepare with graph=shape); returns its hidden states. router_lora
        False: a graph without the routers' LoRA where there is one (the routers' slots of
        this step's adapters are zero, so either graph gives the same result)."""
        key = (shape, with_lora, router_lora)
        graph, hidden = self._graphs.get(key) or self._graphs[(shape, with_lora, True)]
        graph.replay()
        return hidden
