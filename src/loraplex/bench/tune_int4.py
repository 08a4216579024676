"""`loraplex tune` for int4 weights (AWQ, GPTQ): time block configs of the W4A16 GEMM
(ops/triton/int4_gemm.py) on this GPU at a model's projection shapes and write the best
per token count to the JSON files ops/triton/int4_configs.py reads.

Only the token counts the kernel serves are tuned (under int4_gemm.DEQUANTIZE_MIN_TOKENS:
from there W is dequantized and cuBLAS runs the GEMM). Each shape is timed over N(0,
0.02) weights quantized in the model's groups, two of them in turn (together larger than
L2, as a step's weights are), as bench/tune_fp8.py times the FP8 GEMM: CUDA events
around a batch of launches, median of repeats; configs that fail to compile or launch
are skipped. The search covers the tile width, the K step, warps, pipeline depth and
the split of K (the split-K sum included in the time).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from loraplex.bench.tuning import SMEM_BYTES, fastest
from loraplex.config import ModelConfig, QuantConfig
from loraplex.ops.triton.int4_configs import KEYS, clear_cache, config_file_name, default_config
from loraplex.ops.triton.int4_gemm import DEQUANTIZE_MIN_TOKENS, int4_linear
from loraplex.ops.triton.moe_configs import PACKAGE_DIR, device_name, save_configs

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96)


def candidates(num_tokens: int, k: int, group: int) -> list[dict]:
    """The search space for one token count, W [N, K] in groups of `group`: the default's
    BLOCK_M (an mma tile for the count), BLOCK_N 64 or 128 (32 never won a sweep at
    Llama-3.1-8B's shapes, H100 or H200), K steps that lie inside a group
    or hold whole ones (no per-k scale gathers; the bf16x2 decode needs the first), 4 or
    8 warps (8 on the widest tiles), 2-4 stages that fit shared memory, K split 1-16 ways
    (no more splits than K steps)."""
    bm = default_config(num_tokens, 1, k, group, torch.device("cpu"))["BLOCK_M"]
    out = []
    for bn, bk, warps, stages, split in itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4),
                                                          (1, 2, 4, 8, 16)):
        if group % bk and bk % group or split > max(1, k // bk) or (warps == 8 and bn < 128):
            continue
        if stages * (bm * bk * 2 + bn * bk // 2) > SMEM_BYTES:  # x (bf16) and W's bytes per stage
            continue
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=warps, num_stages=stages,
                        SPLIT_K=split))
    return out


def int4_quant(cfg: ModelConfig, asked: str | None) -> QuantConfig | None:
    """The model's int4 quantization: its checkpoint's (AWQ, GPTQ), else the one asked for
    (--quantization awq|gptq: random weights in groups of 128, as serving gives them),
    else None."""
    if cfg.quant is not None:
        return cfg.quant if cfg.quant.format == "int4" else None
    return QuantConfig.requested(asked, online=False) if asked in ("awq", "gptq") else None


def _best(x: torch.Tensor, ws: list, num_tokens: int) -> dict | None:
    n, k = ws[0].shape
    return fastest(candidates(num_tokens, k, ws[0].group),
                   lambda cfg: lambda: [int4_linear(x, w, None, cfg) for w in ws],
                   f"N={n} K={k} T={num_tokens}", per=len(ws))


def tune(shapes: list[tuple[int, int]], group: int, dtype: torch.dtype, batch_sizes=BATCH_SIZES,
         out_dir: str | Path | None = None) -> list[Path]:
    """Tune the W4A16 GEMM of each W [N, K] in `shapes` (groups of `group` along K) for
    each token count the kernel serves; returns the files written."""
    from loraplex.ops.formats import Int4Weight
    from loraplex.ops.reference.quant import quantize_int4

    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    out = Path(out_dir) if out_dir else PACKAGE_DIR
    name = device_name(dev)
    paths = []
    for n, k in shapes:
        g = group if k % group == 0 else k  # (as formats/checkpoint.new_weight gives such a weight)
        ws = []
        for _ in range(2):
            w = Int4Weight((n, k), g, dtype, dev)
            quantize_int4(torch.randn(n, k, device=dev, generator=gen) * 0.02, g, symmetric=False, out=w)
            ws.append(w)
        table = {}
        for t in (t for t in batch_sizes if t < DEQUANTIZE_MIN_TOKENS):
            x = torch.randn(t, k, device=dev, generator=gen).to(dtype)
            best = _best(x, ws, t)
            if best is not None:
                table[t] = best
        path = out / config_file_name(name, n, k, g, dtype)
        save_configs(path, table, KEYS)
        print(f"wrote {path}")
        paths.append(path)
    clear_cache()
    return paths
