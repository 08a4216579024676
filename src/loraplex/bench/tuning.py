"""What the kernel tuners share (bench/tune_moe.py, bench/tune_fp8.py, bench/tune_int4.py):
the shared-memory budget a config's pipeline must fit, the timer, the search for the
fastest config, and a model's quantized projection shapes."""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import replace

import torch

logger = logging.getLogger("loraplex")

SMEM_BYTES = 200 * 1024  # H100 / H200 allow 227 KiB per block; leave room for the epilogue


def time_ms(fn, repeats: int = 20, inner: int = 10) -> float:
    """Median over `repeats` of the mean time of `inner` back-to-back calls, replayed from a
    CUDA graph where `fn` can be captured (as serving replays decode steps: a kernel of a
    few microseconds is timed, not the host's launch of it), else launched eagerly."""
    fn()  # compiles, and raises for a config that cannot run
    torch.cuda.synchronize()
    replay = _captured(fn, inner)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if replay is not None:
            replay()
        else:
            for _ in range(inner):
                fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def _captured(fn, inner: int):
    """The replay of a CUDA graph of `inner` calls of fn, or None where fn cannot be
    captured."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        return graph.replay
    except RuntimeError as e:
        logger.debug("timing eagerly (no graph): %s", e)
        torch.cuda.synchronize()
        return None


def copies_past_l2(nbytes: int, device: torch.device, most: int = 64) -> int:
    """How many copies of a weight of nbytes to cycle through so that each launch reads
    its weight from device memory, as a model's layers do, not from the L2 cache where
    the previous launch left it (twice the L2, at least 2)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return min(most, max(2, -(-2 * l2 // max(nbytes, 1))))


def fastest(configs, launch, what: str, per: int = 1) -> dict | None:
    """The config of `configs` whose launch runs fastest: `launch(cfg)` prepares one and
    returns the call to time (time_ms; `per` of them in each call). Configs that fail to
    compile or launch (out of resources) are skipped. Logs the winner with `what`."""
    times = ranked(configs, launch, per)
    best_ms, best = times[0] if times else (math.inf, None)
    logger.info("%s: %s (%.4f ms)", what, best, best_ms)
    return best


def ranked(configs, launch, per: int = 1) -> list[tuple[float, dict]]:
    """(ms, config) of each config that runs, fastest first (fastest's timing)."""
    out = []
    for i, cfg in enumerate(configs):
        run = launch(cfg)
        try:
            out.append((time_ms(run) / per, i, cfg))
        except Exception as e:  # out of resources, compile errors: not a candidate here
            logger.debug("skipping %s: %s", cfg, e)
    return [(ms, cfg) for ms, _, cfg in sorted(out, key=lambda r: r[:2])]


def projection_shapes(cfg, quant) -> list[tuple[int, int]]:
    """The distinct [N, K] of the dense projections `quant` (a QuantConfig) covers in the
    model of ModelConfig `cfg` (fused slices as one), read from the model built on the
    meta device."""
    from loraplex.layers.linear import LoRALinear, weights_deferred
    from loraplex.models.quant import deferred_layers, quantized_layers
    from loraplex.models.registry import build_model

    cfg = replace(cfg, quant=quant)
    with torch.device("meta"), weights_deferred():
        model = build_model(cfg, cfg.max_position_embeddings)
    covered = quantized_layers(model, cfg, None)
    return sorted({tuple(m.weight.shape) for path, m in deferred_layers(model).items()
                   if path in covered and isinstance(m, LoRALinear)})
