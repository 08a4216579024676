"""Tuned block configs of the MoE grouped GEMM, read from JSON data files.

One file per device, GEMM shape and dtype, written by `loraplex tune` (bench/tune_moe.py):
`moe_gemm_<device>_E<E>_N<N>_K<K>_<dtype>.json`, where the weight is [E, N, K] (the
gate/up GEMM: N = 2I, K = H; the down GEMM: N = H, K = I). Quantized experts' GEMM
(moe_gemm_quant.py) has files of its own, `moe_gemm_<format>_<device>_...` (format
mxfp4, fp8 or w8a8; dtype the activations'). Keys are token counts, values the kernel's
constexprs. A batch takes the entry of the nearest token count.
Files are looked up in $LORAPLEX_MOE_CONFIG_DIR (os.pathsep-separated directories),
then in the package's configs/ directory.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from loraplex.errors import ModelLoadError
from loraplex.ops.formats import Fp8Weight, Mxfp4Weight
from loraplex.ops.reference.quant import w8a8

PACKAGE_DIR = Path(__file__).parent / "configs"
ENV_VAR = "LORAPLEX_MOE_CONFIG_DIR"
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


def device_name(device: torch.device | str | None = None) -> str:
    """The device's name as used in file names, e.g. NVIDIA_H200."""
    index = None if device is None else torch.device(device).index
    return _device_name(torch.cuda.current_device() if index is None else index)


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index).replace(" ", "_").replace("/", "_")


# Steps with this many pairs per expert or more (tokens x top_k / experts) read MXFP4
# and weight-only FP8 experts dequantized: one kernel writes each stack in its dtype into
# a scratch tensor (ops/triton/dequantize.py) and the bf16 grouped GEMM runs on it, on
# wgmma tiles fed from shared memory. The quantized GEMM decodes W in registers in front
# of the MMA: that pays while W's bytes bound the GEMM (decode) and costs more than the
# scratch's round trip (2.5-3 bytes a weight) once its FLOPs do (prefill), the sooner the
# costlier the decode (e2m1 more than e4m3). Crossovers on an H200 (benchmarks/RESULTS.md,
# "Prefill of quantized experts"): gpt-oss-20b MXFP4 ~1,000 tokens (~128 pairs an
# expert), Qwen3-30B-A3B FP8 ~4,600 (~290).
DEQUANTIZE_MIN_PAIRS_PER_EXPERT = {"mxfp4": 128, "fp8": 320}


def dequantized(w, num_tokens: int | None, top_k: int | None) -> bool:
    """Whether a step of num_tokens, top_k experts each, reads w (quantized experts) as
    dequantize(w)."""
    if num_tokens is None or top_k is None or w8a8(w, num_tokens):
        return False
    fmt = "mxfp4" if isinstance(w, Mxfp4Weight) else "fp8" if isinstance(w, Fp8Weight) else None
    return fmt is not None and num_tokens * top_k >= DEQUANTIZE_MIN_PAIRS_PER_EXPERT[fmt] * w.shape[0]


def weight_format(w, num_tokens: int | None = None, top_k: int | None = None) -> str | None:
    """The format a weight's GEMM configs are tuned for: None (a tensor, or quantized
    experts the step dequantizes first), "mxfp4", "fp8", "w8a8" (FP8 with e4m3
    activations: another kernel path), in a step of num_tokens, top_k experts each
    (None: any step where the weight quantizes its activations)."""
    if dequantized(w, num_tokens, top_k):
        return None
    if isinstance(w, Fp8Weight):
        return "w8a8" if w8a8(w, num_tokens) else "fp8"
    return "mxfp4" if isinstance(w, Mxfp4Weight) else None


def config_file_name(device: str, num_experts: int, n: int, k: int, dtype: torch.dtype,
                     fmt: str | None = None) -> str:
    kind = f"{fmt}_" if fmt else ""
    return f"moe_gemm_{kind}{device}_E{num_experts}_N{n}_K{k}_{str(dtype).removeprefix('torch.')}.json"


def search_dirs() -> list[Path]:
    extra = [Path(d) for d in os.environ.get(ENV_VAR, "").split(os.pathsep) if d]
    return [*extra, PACKAGE_DIR]


@functools.cache
def load_configs(file_name: str, keys: tuple[str, ...] = CONFIG_KEYS,
                 optional: tuple[tuple[str, int], ...] = ()) -> dict[int, dict] | None:
    """{token count: config (`keys`)} from the first directory holding `file_name`, else None;
    `optional` (key, value) pairs fill keys older files lack. A file that is not such a
    table raises ModelLoadError naming it (read as the engine warms up: at startup)."""
    defaults = dict(optional)
    for d in search_dirs():
        path = d / file_name
        if path.is_file():
            try:
                table = json.loads(path.read_text())
                table = {int(m): {key: int(cfg[key] if key in cfg or key not in defaults else defaults[key])
                                  for key in keys} for m, cfg in table.items()}
                for m, cfg in table.items():
                    _check_config(m, cfg)
                return table
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ModelLoadError(f"{path}: not a table of tuned configs (token count -> "
                                     f"{', '.join(keys)}): {e!r}") from e
    return None


def _check_config(num_tokens: int, cfg: dict) -> None:
    """A hand-edited or foreign file fails here, naming the value, not as a division by
    zero or a compile error mid-step: token counts and every value >= 1, tile sizes and
    warps powers of 2."""
    if num_tokens < 1:
        raise ValueError(f"token count {num_tokens} (>= 1)")
    for key, v in cfg.items():
        pow2 = key.startswith("BLOCK_") or key == "num_warps"
        if v < 1 or (pow2 and v & (v - 1)) or (key == "num_warps" and v > 32):
            rule = "a power of 2" + (" up to 32" if key == "num_warps" else "") if pow2 else ">= 1"
            raise ValueError(f"{num_tokens}: {key} = {v} ({rule})")


def nearest(table: dict[int, dict], num_tokens: int) -> dict:
    """The entry tuned for the token count nearest `num_tokens` (the smaller on ties)."""
    return dict(table[_nearest_count(table, num_tokens)])


def _nearest_count(table: dict[int, dict], num_tokens: int) -> int:
    return min(table, key=lambda m: (abs(m - num_tokens), m))


def tuned_config(w, num_tokens: int, top_k: int | None = None) -> dict | None:
    """The tuned config of weight w [E, N, K] (a tensor or a quantized weight) on its GPU
    for `num_tokens` (top_k experts each), if a file exists."""
    if w.device.type != "cuda":
        return None
    e, n, k = w.shape
    table = load_configs(config_file_name(device_name(w.device), e, n, k, w.dtype,
                                          weight_format(w, num_tokens, top_k)))
    if not table:
        return None
    return near_entry(table, num_tokens)


def near_entry(table: dict[int, dict], num_tokens: int) -> dict | None:
    """The entry tuned for the token count nearest `num_tokens` if that count is within a
    factor of 2 of it, else None: a config tuned for a very different token count
    (decode vs prefill) is worse than the defaults, whose tiles follow the shapes."""
    m = _nearest_count(table, num_tokens)
    return dict(table[m]) if m / 2 <= num_tokens <= 2 * m else None


def save_configs(path: Path, table: dict[int, dict], keys: tuple[str, ...] = CONFIG_KEYS,
                 optional: tuple[tuple[str, int], ...] = ()) -> None:
    """Writes `table` (configs of `keys`) into the file at `path`, keeping its entries for
    other token counts (decode and prefill sizes are tuned in separate runs; an older
    entry without an `optional` key gets its value)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    old = {int(m): {**dict(optional), **cfg} for m, cfg in json.loads(path.read_text()).items()} \
        if path.is_file() else {}
    rows = {str(m): {key: int(cfg[key]) for key in keys}
            for m, cfg in sorted({**old, **table}.items())}
    path.write_text(json.dumps(rows, indent=1) + "\n")
    load_configs.cache_clear()
