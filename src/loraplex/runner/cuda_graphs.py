"""Decode steps replayed from CUDA graphs.

A decode step launches hundreds of small kernels; replaying them from a graph removes
the CPU launch cost. One graph is captured per padded batch size, and per adapter use
(with or without the LoRA kernels, so base-only batches skip them entirely). All inputs
live in the runner's static buffers, including the adapter slots and token groups, so
one graph serves any mix of adapters and base requests.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time

import torch

from loraplex.layers.context import ForwardContext, forward_context
from loraplex.runner.batch_meta import InputBuffers

logger = logging.getLogger("loraplex")


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, inputs: InputBuffers, max_batch: int,
                 with_lora: bool, aux_stream: torch.cuda.Stream | None = None,
                 moe_stats: torch.Tensor | None = None):
        self.model = model
        self.moe_stats = moe_stats
        self.aux_stream = aux_stream
        self.inputs = inputs
        self.sizes = graph_batch_sizes(max_batch)
        self.lora_variants = (False, True) if with_lora else (False,)
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

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
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            for lora in self.lora_variants:
                step = self.inputs.graph_inputs(size, lora)
                ctx = ForwardContext(attn=step.attn, lora=step.lora, aux_stream=self.aux_stream,
                                     moe_stats=self.moe_stats)
                with forward_context(ctx):
                    self.model(step.input_ids, step.positions)  # compile kernels, warm up
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        hidden = self.model(step.input_ids, step.positions)
                self._graphs[(size, lora)] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode graphs (batch sizes %s, with and without adapters) in %.1f s",
            len(self._graphs), ",".join(map(str, self.sizes)), time.perf_counter() - t0,
        )

    def padded_size(self, num_seqs: int) -> int | None:
        """The graph batch size that serves `num_seqs` decodes, or None if too many."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, size: int, with_lora: bool) -> torch.Tensor:
        graph, hidden = self._graphs[(size, with_lora)]
        graph.replay()
        return hidden
