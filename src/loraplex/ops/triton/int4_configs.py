"""Block configs of the W4A16 GEMM (int4_gemm.py): defaults that follow the shapes and
the SM count, and tuned ones read from JSON data files.

One file per device, weight shape, group size and activation dtype, written by
`loraplex tune` on an int4 model (bench/tune_int4.py):
`int4_gemm_<device>_N<N>_K<K>_G<group>_<dtype>.json`, W being [N, K] (a fused
projection's whole width). Keys are token counts, values the kernel's constexprs and
SPLIT_K. Only the kernel's own token counts are tuned (under
int4_gemm.DEQUANTIZE_MIN_TOKENS; from there W is dequantized and cuBLAS runs the GEMM).
Files are found where the MoE configs are (moe_configs.py's lookup). A step takes the
entry tuned for the nearest token count if it is within a factor of 2, else the
defaults. Llama-3.1-8B's four projections at 32 tokens, H200, tuned against the
defaults: 103.5 against 111.8 us a layer (benchmarks/LOG.md, "int4 decode: the split
without the shuffles, tried; tuned configs").
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from loraplex.ops.triton.moe_configs import CONFIG_KEYS, device_name, load_configs, near_entry

KEYS = (*CONFIG_KEYS, "SPLIT_K")
# Defaults by token count (H100/H200 guesses, tuned files override them). Decode: small
# BLOCK_M (mma tiles, a lone token padded to 16 rows) and split-K; prefill-sized tiles
# in grouped order (GROUP_M row blocks sweep the column blocks together).
DEFAULT_CONFIGS = (
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)),
    (32, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)),
    (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)),
    (128, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)),
    (math.inf, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)),
)
# Split K until about this many programs per SM (a decode tile alone cannot keep enough
# bytes in flight to fill an SM's share of memory bandwidth).
PROGRAMS_PER_SM = 4
MAX_SPLIT_K = 16


def config_file_name(device: str, n: int, k: int, group: int, dtype: torch.dtype) -> str:
    return f"int4_gemm_{device}_N{n}_K{k}_G{group}_{str(dtype).removeprefix('torch.')}.json"


def int4_config(num_tokens: int, n: int, k: int, group: int, device: torch.device,
                dtype: torch.dtype = torch.bfloat16) -> dict:
    """The launch config of [num_tokens, k] x [n, k] (groups of `group` along K) with
    `dtype` activations: the tuned one of this GPU if a file has one near num_tokens, else
    default_config's."""
    if device.type == "cuda":
        table = _table(device_name(device), n, k, group, dtype)
        tuned = near_entry(table, num_tokens) if table else None
        if tuned is not None:
            return tuned
    return default_config(num_tokens, n, k, group, device)


def default_config(num_tokens: int, n: int, k: int, group: int, device: torch.device) -> dict:
    """The default table's row, its BLOCK_K fitted to the group size, and the split of K."""
    cfg = dict(next(c for limit, c in DEFAULT_CONFIGS if num_tokens <= limit))
    block_k = cfg["BLOCK_K"]
    if group % block_k and block_k % group:
        # A step inside one group where the group has a power of two of at least 16 in it
        # (tl.dot's smallest K); else scales gathered per k.
        pow2 = group & -group
        if pow2 >= 16:
            cfg["BLOCK_K"] = pow2
    cfg["SPLIT_K"] = _split_k(num_tokens, n, k, cfg, device)
    return cfg


def _split_k(m: int, n: int, k: int, cfg: dict, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    want = triton.next_power_of_2(triton.cdiv(PROGRAMS_PER_SM * _sm_count(device), tiles))
    # Partial sums: 2 x split x m x n x 4 bytes against W's n x k / 2: at most a quarter.
    traffic_cap = _pow2_floor(max(1, k // (64 * m)))
    k_blocks = _pow2_floor(triton.cdiv(k, cfg["BLOCK_K"]))
    return max(1, min(want, MAX_SPLIT_K, traffic_cap, k_blocks))


def _pow2_floor(v: int) -> int:
    return 1 << (v.bit_length() - 1)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _table(device: str, n: int, k: int, group: int, dtype: torch.dtype) -> dict[int, dict] | None:
    return load_configs(config_file_name(device, n, k, group, dtype), KEYS)


def clear_cache() -> None:
    """Forget loaded tables (after a tuning run wrote new files)."""
    _table.cache_clear()
    load_configs.cache_clear()
