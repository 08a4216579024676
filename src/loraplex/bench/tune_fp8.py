"""`loraplex tune` for FP8 weights: time block configs of the FP8 dense GEMM
(ops/triton/fp8_gemm.py) on this GPU at a model's projection shapes and write the best
per token count to the JSON files ops/triton/fp8_configs.py reads.

A model's shapes are its fused projections' [N, K] (q/k/v, o, gate/up, down of every
dense layer), read from the model built on the meta device. Each is timed over random
e4m3 weights with the model's scale blocks (128 columns for block-scaled checkpoints and
load-time quantization, K per channel), enough copies of it to read each from device
memory rather than L2 (as a model's layers are read), launches replayed from a CUDA
graph (bench/tuning.time_ms: decode-sized GEMMs take a few microseconds, less than the
host's launch), median of repeats; configs that fail to compile or launch are skipped.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
import triton

from loraplex.bench.tuning import SMEM_BYTES, copies_past_l2, logger, projection_shapes, ranked
from loraplex.config import ModelConfig, QuantConfig
from loraplex.ops.triton.fp8_configs import (
    GEMV_MAX_TOKENS,
    KEYS,
    MIN_DOT_M,
    OPTIONAL,
    clear_cache,
    config_file_name,
)
from loraplex.ops.triton.fp8_gemm import DEQUANTIZE_MIN_TOKENS, fp8_linear, scale_mode
from loraplex.ops.triton.moe_configs import PACKAGE_DIR, device_name, save_configs

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096)
# Token counts whose best configs are tried again with K split (decode: too few column
# blocks to fill the GPU, and each program walks all of K).
SPLIT_K_MAX_TOKENS = 64
# GEMV form: the [BLOCK_M, BLOCK_K, BLOCK_N] product in registers, at most 64 float32
# values per thread of 4 warps (more spills).
GEMV_MAX_PRODUCT = 64 * 32 * 4


def candidates(num_tokens: int, k: int, block_k: int, elem_bytes: int = 2, w8a8: bool = False) -> list[dict]:
    """The search space for one token count, W [N, K] scaled per block_k columns: up to
    GEMV_MAX_TOKENS the GEMV form (BLOCK_M the count rounded up to a power of 2) beside
    tiles of 16 rows; above, tiles no taller than twice the count, pipelines that fit
    shared memory. K steps stay whole scale blocks or parts of one (no per-element
    scale gathers), and no longer than K rounded up to a power of 2. W8A8 (x in e4m3,
    elem_bytes 1): tiles alone, K steps inside one block."""
    max_k = max(16, triton.next_power_of_2(k))

    def scales_ok(bk: int) -> bool:
        if w8a8 and bk > min(block_k, max_k):
            return False
        return bk <= max_k and scale_mode(block_k, k, bk) != "gather"

    out = []
    if num_tokens <= GEMV_MAX_TOKENS and not w8a8:
        bm = triton.next_power_of_2(num_tokens)
        for bn, bk, warps in itertools.product((8, 16, 32, 64), (128, 256, 512, 1024), (4, 8)):
            if bm * bn * bk <= GEMV_MAX_PRODUCT * warps // 4 and scales_ok(bk):
                out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=warps,
                                num_stages=3, SPLIT_K=1))
    max_m = max(MIN_DOT_M, 2 * triton.next_power_of_2(num_tokens))
    # BLOCK_N 16: a narrow W (o's 2,048 rows) in enough programs at decode sizes
    space = ((16, 32, 64, 128), (16, 32, 64, 128, 256), (64, 128, 256), (4, 8), (3, 4, 6))
    if num_tokens >= 256:  # prefill: tensor-core sizes only
        space = ((64, 128), (64, 128, 256), (64, 128), (4, 8), (3, 4))
    for bm, bn, bk, warps, stages in itertools.product(*space):
        if bm > max_m or not scales_ok(bk) or (warps == 8 and bm * bn < 64 * 128):
            continue
        # x and W (1 byte) tiles per stage, and the dequantized W tile beside them
        if stages * (bm * bk * elem_bytes + bk * bn) + bk * bn * elem_bytes > SMEM_BYTES:
            continue
        # grouped ordering where there are several row blocks to group
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8 if num_tokens >= 4 * bm else 1,
                        num_warps=warps, num_stages=stages, SPLIT_K=1))
    return out


def fp8_quant(cfg: ModelConfig) -> QuantConfig:
    """The model's FP8 quantization: its checkpoint's, else load-time (--quantization fp8:
    128-column scale blocks, as EngineArgs sets it)."""
    if cfg.quant is not None:
        return cfg.quant
    return QuantConfig("fp8", "fp8", weight_block=(1, 128), online=True)


def gemm_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """The distinct [N, K] of the projections FP8 covers in the model (fused slices as
    one)."""
    return projection_shapes(cfg, fp8_quant(cfg))


def scale_block(cfg: ModelConfig) -> int | None:
    """K columns per scale of the model's FP8 weights (None: per channel, one block of K)."""
    return fp8_quant(cfg).weight_block[1] or None


def _best(x: torch.Tensor, ws: list, num_tokens: int) -> dict | None:
    """The fastest candidate; at decode sizes (SPLIT_K_MAX_TOKENS) then the three fastest
    again with K split 2, 4 and 8 ways (a split leaves each config's tiles as they are)."""
    w = ws[0]
    w8a8, (n, k) = bool(w.act_block), w.shape

    def launch(cfg):
        return lambda: [fp8_linear(x, w, None, cfg) for w in ws]

    cands = candidates(num_tokens, k, w.block_k, 1 if w8a8 else x.element_size(), w8a8)
    times = ranked(cands, launch, len(ws))
    if num_tokens <= SPLIT_K_MAX_TOKENS:
        splits = [dict(cfg, SPLIT_K=s) for _, cfg in times[:3] for s in (2, 4, 8)
                  if k >= 2 * s * cfg["BLOCK_K"]]
        times = sorted(times + ranked(splits, launch, len(ws)), key=lambda r: r[0])
    best_ms, best = times[0] if times else (float("inf"), None)
    logger.info("N=%d K=%d T=%d: %s (%.4f ms)", n, k, num_tokens, best, best_ms)
    return best


def tune(shapes: list[tuple[int, int]], block_k: int | None, dtype: torch.dtype,
         batch_sizes=BATCH_SIZES, out_dir: str | Path | None = None, act_block: int = 0) -> list[Path]:
    """Tune the FP8 GEMM of each W [N, K] in `shapes` (scales per block_k columns, None:
    per channel; W8A8 with act_block, into files of their own) for each token count;
    returns the files written."""
    from loraplex.ops.formats import Fp8Weight
    from loraplex.ops.reference.quant import quantize_fp8

    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    out = Path(out_dir) if out_dir else PACKAGE_DIR
    name = device_name(dev)
    paths = []
    for n, k in shapes:
        ws = []  # read from device memory in turn, as a model's layers are (not from L2)
        for _ in range(copies_past_l2(n * k, dev)):
            w = Fp8Weight((n, k), block_k or k, dtype, dev, act_block)
            quantize_fp8(torch.randn(n, k, device=dev, generator=gen) * 0.02, w.block_k, out=w)
            ws.append(w)
        table = {}
        # weight-only GEMMs of DEQUANTIZE_MIN_TOKENS or more run through cuBLAS
        for t in (t for t in batch_sizes if act_block or t < DEQUANTIZE_MIN_TOKENS):
            x = torch.randn(t, k, device=dev, generator=gen).to(dtype)
            best = _best(x, ws, t)
            if best is not None:
                table[t] = best
        path = out / config_file_name(name, n, k, dtype, bool(act_block))
        save_configs(path, table, KEYS, OPTIONAL)
        print(f"wrote {path}")
        paths.append(path)
    clear_cache()
    return paths
