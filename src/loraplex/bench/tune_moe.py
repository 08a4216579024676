"""`loraplex tune`: time block configs of the MoE grouped GEMM on this GPU and write the
best per token count to the JSON files ops/triton/moe_configs.py reads.

Each of a layer's two GEMMs is tuned on its own (gate/up with the fused activation, as
steps without expert adapters run it; down with the routing weight), over random
routing. A config is timed with CUDA events around a batch of launches, median of
repeats; configs that fail to compile (shared memory, registers) are skipped.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import statistics
from pathlib import Path

import torch
import triton

from loraplex.errors import LoraplexError, UnsupportedModel
from loraplex.ops.triton.moe_align import align_experts
from loraplex.ops.triton.moe_configs import PACKAGE_DIR, config_file_name, device_name, save_configs
from loraplex.ops.triton.moe_gemm import moe_gemm

logger = logging.getLogger("loraplex")

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096)
SMEM_BYTES = 200 * 1024  # H100 / H200 allow 227 KiB per block; leave room for the epilogue


def candidates(num_tokens: int, top_k: int, num_experts: int, elem_bytes: int = 2,
               fused: bool = False) -> list[dict]:
    """The search space for one token count: BLOCK_M no taller than twice the average
    pairs per expert (taller blocks are padding), pipelines that fit shared memory."""
    rows = num_tokens * top_k / num_experts
    max_m = max(16, 2 * triton.next_power_of_2(math.ceil(rows)))
    space = ((16, 32, 64, 128), (32, 64, 128, 256), (64, 128, 256), (1, 16), (4, 8), (2, 3, 4, 5))
    if rows >= 64:  # prefill: a GEMM per expert; small tiles and short pipelines only lose,
        # and each config is a compile (~1 s): search the tensor-core sizes alone
        space = ((64, 128), (64, 128, 256), (64,), (1, 16), (4, 8), (3, 4))
    out = []
    for bm, bn, bk, gm, warps, stages in itertools.product(*space):
        tiles = bm * bk + bk * bn * (2 if fused else 1)  # A tile, W tile(s) per stage
        if bm > max_m or stages * tiles * elem_bytes > SMEM_BYTES:
            continue
        if gm > 1 and bm * 4 > rows:  # grouped ordering needs several blocks per expert
            continue
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=warps,
                        num_stages=stages))
    return out


def time_ms(fn, repeats: int = 20, inner: int = 10) -> float:
    """Median over `repeats` of the mean time of `inner` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def _best(gemm_inputs, num_tokens: int, top_k: int, num_experts: int, fused: bool,
          elem_bytes: int) -> dict:
    topk_ids, a, w, out, kwargs = gemm_inputs
    best, best_ms = None, math.inf
    for cfg in candidates(num_tokens, top_k, num_experts, elem_bytes, fused):
        align = align_experts(topk_ids, num_experts, cfg["BLOCK_M"])
        try:
            ms = time_ms(lambda: moe_gemm(a, w, None, out, align, cfg, **kwargs))  # noqa: B023
        except Exception as e:  # out of resources, compile errors: not a candidate here
            logger.debug("skipping %s: %s", cfg, e)
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    logger.info("T=%d %s: %s (%.4f ms)", num_tokens, "gate_up" if fused else "down", best, best_ms)
    return best


def tune(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
         batch_sizes=BATCH_SIZES, out_dir: str | Path | None = None) -> list[Path]:
    """Tune both GEMMs of an MoE layer for each token count; returns the files written."""
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    w_gu = (torch.randn(num_experts, 2 * inter, hidden, device=dev, generator=gen) * 0.02).to(dtype)
    w_d = (torch.randn(num_experts, hidden, inter, device=dev, generator=gen) * 0.02).to(dtype)
    elem = w_gu.element_size()
    best_gu, best_d = {}, {}
    for t in batch_sizes:
        logits = torch.randn(t, num_experts, device=dev, generator=gen)
        weights, ids = logits.softmax(-1).topk(top_k)
        ids = ids.to(torch.int32)
        x = torch.randn(t, hidden, device=dev, generator=gen).to(dtype)
        h = torch.randn(t * top_k, inter, device=dev, generator=gen).to(dtype)
        gu_out = torch.empty(t * top_k, inter, dtype=dtype, device=dev)
        d_out = torch.empty(t * top_k, hidden, dtype=dtype, device=dev)
        gu = (ids, x, w_gu, gu_out, dict(row_div=top_k, activation="silu"))
        d = (ids, h, w_d, d_out, dict(row_div=1, routed_weights=weights.contiguous()))
        best_gu[t] = _best(gu, t, top_k, num_experts, True, elem)
        best_d[t] = _best(d, t, top_k, num_experts, False, elem)
    out = Path(out_dir) if out_dir else PACKAGE_DIR
    name = device_name(dev)
    paths = [out / config_file_name(name, num_experts, 2 * inter, hidden, dtype),
             out / config_file_name(name, num_experts, hidden, inter, dtype)]
    for path, table in zip(paths, (best_gu, best_d)):
        save_configs(path, {t: cfg for t, cfg in table.items() if cfg is not None})
        print(f"wrote {path}")
    return paths


def main(args: argparse.Namespace) -> int:
    """`loraplex tune` (arguments declared in entrypoints/cli.py)."""
    from transformers import AutoConfig

    from loraplex.bench.workload import MOE_CONFIGS, prepare_model_dir
    from loraplex.models.registry import model_config

    logging.basicConfig(level=logging.INFO)
    model_dir, _ = prepare_model_dir(args.model, Path(args.cache_dir))
    cfg = model_config(AutoConfig.from_pretrained(model_dir))
    if not cfg.moe_layers:
        raise UnsupportedModel(f"{args.model}: not a mixture-of-experts model, and only MoE kernels "
                               f"are tuned (bundled MoE configs: {', '.join(MOE_CONFIGS)})")
    if not torch.cuda.is_available():
        raise LoraplexError("loraplex tune times kernels on a CUDA GPU; this machine has none")
    tune(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok,
         getattr(torch, args.dtype), args.batch_sizes or BATCH_SIZES, args.out)
    return 0
