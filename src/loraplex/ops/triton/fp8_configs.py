"""Block configs of the FP8 dense GEMM (fp8_gemm.py): untuned defaults, and tuned ones
read from JSON data files.

One file per device, weight shape and activation dtype, written by `loraplex tune --fp8`
(bench/tune_fp8.py): `fp8_gemm_<device>_N<N>_K<K>_<dtype>.json`, W being [N, K] (a
fused projection's whole width: q/k/v together, gate/up together). Keys are token
counts, values the kernel's constexprs (KEYS: the MoE files' BLOCK_M, BLOCK_N, BLOCK_K,
GROUP_M, num_warps, num_stages, and SPLIT_K); BLOCK_M under 16 selects the GEMV form. Files are found
where the MoE configs are ($LORAPLEX_MOE_CONFIG_DIR, then the package's configs/:
moe_configs.py's lookup, shared). A step takes the entry tuned for the nearest token
count if it is within a factor of 2, else the defaults.
"""

from __future__ import annotations

import functools

import torch
import triton

from loraplex.ops.triton.moe_configs import CONFIG_KEYS, device_name, load_configs, near_entry

# A config's keys: the MoE files' and SPLIT_K (K split over that many programs, their
# float32 sums added by a second kernel: fp8_gemm.py), 1 where a file lacks it.
KEYS = (*CONFIG_KEYS, "SPLIT_K")
OPTIONAL = (("SPLIT_K", 1),)
# Under 16 rows tl.dot has no tile: BLOCK_M < 16 is the GEMV form (fp8_gemm.py).
MIN_DOT_M = 16
GEMV_MAX_TOKENS = 8  # the defaults' GEMV form up to here
# Untuned defaults by token count. GEMV: the register product [BLOCK_M, BLOCK_K,
# BLOCK_N] at most 8K elements (64 per thread of 4 warps), BLOCK_N small so that even a
# narrow W gives a program per SM or more. Tiles: BLOCK_K 64 or 128 divides the usual
# 128 scale block (one scale per row per tile).
# Decode sizes want a program per SM or more, and their x tiles are reread by every
# program: 16-32 tokens on an H100 (Qwen3-30B-A3B, us): q/k/v [5120, 2048] at 16 8.9
# (BLOCK_N 32), at 32 13.7 -> 11.1 (BLOCK_N 64 -> 16); o [2048, 4096] at 16 11.4 -> 9.8
# (BLOCK_N 32 -> 16, BLOCK_K 256: NARROW_W), at 32 23.3 -> 11.5.
DEFAULT_CONFIGS = (
    (16, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)),
    (32, dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)),
    (64, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=4)),
    (256, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)),
    (float("inf"), dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)),
)


# W8A8 (e4m3 activations, fp8_gemm.py): tensor-core tiles at every token count (16 rows
# at least), K steps of a whole 128-column scale block. Qwen3-30B-A3B's q/k/v [5120,
# 2048] on an H100: at 2,048 tokens 93 us with 64 x 128 tiles of 4 warps, 133 with 128 x
# 128 of 8 (each step's product is scaled before it joins the sum); at 16 tokens 9.4 us
# with 6 stages, 10.0 with 4 (o [2048, 4096]: 12.3 us; the quantization's launch included).
W8A8_DEFAULT_CONFIGS = (
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=6)),
    (64, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=4)),
    (float("inf"), dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)),
)


def config_file_name(device: str, n: int, k: int, dtype: torch.dtype, w8a8: bool = False) -> str:
    kind = "w8a8_" if w8a8 else ""
    return f"fp8_gemm_{kind}{device}_N{n}_K{k}_{str(dtype).removeprefix('torch.')}.json"


# 9-16 tokens of a W of at most this many rows: 16-row column blocks, 256-column K steps.
NARROW_W = 2048


def default_config(num_tokens: int, w8a8: bool = False, n: int | None = None) -> dict:
    if w8a8:
        return dict(next(cfg for limit, cfg in W8A8_DEFAULT_CONFIGS if num_tokens <= limit))
    if num_tokens <= GEMV_MAX_TOKENS:
        bm = triton.next_power_of_2(max(1, num_tokens))
        return dict(BLOCK_M=bm, BLOCK_N=min(32, 64 // bm), BLOCK_K=128, GROUP_M=1, num_warps=4,
                    num_stages=4)
    cfg = dict(next(cfg for limit, cfg in DEFAULT_CONFIGS if num_tokens <= limit))
    if num_tokens <= 16 and n is not None and n <= NARROW_W:
        cfg.update(BLOCK_N=16, BLOCK_K=256)
    return cfg


def gemm_config(n: int, k: int, dtype: torch.dtype, num_tokens: int, device: torch.device,
                w8a8: bool = False) -> dict:
    """The tuned config of W [N, K] with `dtype` activations (w8a8: quantized to e4m3
    first) on this GPU for `num_tokens`, if a file has one near it, else the default."""
    if device.type == "cuda":
        table = _table(device_name(device), n, k, dtype, w8a8)
        tuned = near_entry(table, num_tokens) if table else None
        if tuned is not None:
            return tuned
    return default_config(num_tokens, w8a8, n)


@functools.cache
def _table(device: str, n: int, k: int, dtype: torch.dtype, w8a8: bool) -> dict[int, dict] | None:
    return load_configs(config_file_name(device, n, k, dtype, w8a8), KEYS, OPTIONAL)


def clear_cache() -> None:
    """Forget loaded tables (after a tuning run wrote new files)."""
    _table.cache_clear()
    load_configs.cache_clear()


__all__ = ["CONFIG_KEYS", "DEFAULT_CONFIGS", "W8A8_DEFAULT_CONFIGS", "config_file_name", "default_config",
           "gemm_config"]
