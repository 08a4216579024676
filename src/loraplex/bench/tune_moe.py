"""`loraplex tune`: time block configs of the MoE grouped GEMM on this GPU and write the
best per token count to the JSON files ops/triton/moe_configs.py reads (FP8 checkpoints
and --quantization fp8: the FP8 dense GEMM's too, bench/tune_fp8.py).

Each of a layer's two GEMMs is tuned on its own (gate/up with the fused activation, as
steps without expert adapters run it; down with the routing weight), over random
routing. A config is timed with CUDA events around a batch of launches, median of
repeats; configs that fail to compile (shared memory, registers) are skipped.
Quantized experts (`--quantization mxfp4|fp8`, by default the model's own) tune their
own GEMM (moe_gemm_quant.py) into files of their own; decode steps of no more pairs
than experts run its GEMV form (moe_gemv_quant.py), which has no configs to tune, and
prompt-sized steps the plain GEMM on the experts dequantized, tuned into the plain
GEMM's files.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
from pathlib import Path

import torch
import triton

from loraplex.bench.tuning import SMEM_BYTES, fastest, projection_shapes
from loraplex.errors import LoraplexError, ModelLoadError, UnsupportedModel
from loraplex.ops.formats import Fp8Weight, Mxfp4Weight
from loraplex.ops.reference.quant import quantize_fp8, quantize_mxfp4
from loraplex.ops.triton.dequantize import dequantize
from loraplex.ops.triton.fp8_activations import quantize_activations
from loraplex.ops.triton.moe_align import align_experts
from loraplex.ops.triton.moe_configs import (
    PACKAGE_DIR,
    config_file_name,
    dequantized,
    device_name,
    save_configs,
    weight_format,
)
from loraplex.ops.triton.moe_gemm import moe_gemm
from loraplex.ops.triton.moe_gemm_quant import MIN_BLOCK_K, moe_gemm_quant

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096)
FORMATS = ("mxfp4", "fp8")
WEIGHT_BYTES = {"mxfp4": 0.5, "fp8": 1}  # stored bytes per weight value


def candidates(num_tokens: int, top_k: int, num_experts: int, elem_bytes: int = 2,
               fused: bool = False, fmt: str | None = None) -> list[dict]:
    """The search space for one token count: BLOCK_M no taller than twice the average
    pairs per expert (taller blocks are padding), pipelines that fit shared memory
    (activation tiles of elem_bytes, weight tiles as stored: fmt's bytes per value)."""
    rows = num_tokens * top_k / num_experts
    max_m = max(16, 2 * triton.next_power_of_2(math.ceil(rows)))
    space = ((16, 32, 64, 128), (32, 64, 128, 256), (64, 128, 256), (1, 16), (4, 8), (2, 3, 4, 5))
    if rows >= 64:  # prefill: a GEMM per expert; small tiles and short pipelines only lose,
        # and each config is a compile (~1 s): search the tensor-core sizes alone
        space = ((64, 128), (64, 128, 256), (64,), (1, 16), (4, 8), (3, 4))
    w_bytes = WEIGHT_BYTES[fmt] if fmt else elem_bytes
    out = []
    for bm, bn, bk, gm, warps, stages in itertools.product(*space):
        tiles = bm * bk * elem_bytes + bk * bn * (2 if fused else 1) * w_bytes  # A, W tile(s) per stage
        if bm > max_m or stages * tiles > SMEM_BYTES or (fmt and bk < MIN_BLOCK_K):
            continue
        if gm > 1 and bm * 4 > rows:  # grouped ordering needs several blocks per expert
            continue
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=warps,
                        num_stages=stages))
    return out


def _best(gemm_inputs, num_tokens: int, top_k: int, num_experts: int, fused: bool,
          elem_bytes: int, fmt: str | None = None, act_block: int = 0) -> dict:
    """act_block: W8A8 experts, `a` their e4m3 rows (kwargs: a_scale), K steps inside a
    block."""
    topk_ids, a, w, out, kwargs = gemm_inputs
    gemm = moe_gemm_quant if fmt else moe_gemm

    def launch(cfg):
        align = align_experts(topk_ids, num_experts, cfg["BLOCK_M"])
        return lambda: gemm(a, w, None, out, align, cfg, **kwargs)

    cands = [c for c in candidates(num_tokens, top_k, num_experts, elem_bytes, fused, fmt)
             if not act_block or c["BLOCK_K"] <= act_block]
    return fastest(cands, launch, f"T={num_tokens} {'gate_up' if fused else 'down'}")


def expert_weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, fmt: str | None,
                   device, gen: torch.Generator, block_k: int = 128, act_block: int = 0):
    """Random gate/up [E, 2I, H] and down [E, H, I] experts, N(0, 0.02), in format fmt
    (None: plain dtype tensors; "fp8": scale blocks of block_k columns, W8A8 with
    act_block)."""
    out = []
    for shape in ((num_experts, 2 * inter, hidden), (num_experts, hidden, inter)):
        values = torch.randn(shape, device=device, generator=gen) * 0.02
        if fmt == "mxfp4":
            out.append(quantize_mxfp4(values, out=Mxfp4Weight(shape, dtype, device)))
        elif fmt == "fp8":
            out.append(quantize_fp8(values, block_k, out=Fp8Weight(shape, block_k, dtype, device, act_block)))
        else:
            out.append(values.to(dtype))
    return tuple(out)


def tune(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
         batch_sizes=BATCH_SIZES, out_dir: str | Path | None = None, fmt: str | None = None,
         block_k: int = 128, act_block: int = 0) -> list[Path]:
    """Tune both GEMMs of an MoE layer for each token count, on experts in format fmt
    (None: dtype tensors; W8A8 FP8 with act_block, into files of their own); returns the
    files written. Token counts whose steps read quantized experts dequantized (prompt
    sizes: moe_configs.dequantized) tune the plain GEMM they run, into the dtype's files."""
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    w_gu, w_d = expert_weights(num_experts, hidden, inter, dtype, fmt, dev, gen, block_k, act_block)
    own, plain = split_counts(w_gu, batch_sizes, top_k)
    paths = _tune_counts(w_gu, w_d, own, top_k, dtype, out_dir, fmt, act_block, gen) if own else []
    if plain:
        paths += _tune_counts(dequantize(w_gu), dequantize(w_d), plain, top_k, dtype, out_dir, None, 0, gen)
    return paths


def split_counts(w_gu, batch_sizes, top_k: int) -> tuple[list[int], list[int]]:
    """(token counts that run w's own GEMM, those that run the plain GEMM on it dequantized)."""
    plain = [t for t in batch_sizes if dequantized(w_gu, t, top_k)]
    return [t for t in batch_sizes if t not in plain], plain


def _tune_counts(w_gu, w_d, batch_sizes, top_k: int, dtype: torch.dtype, out_dir, fmt: str | None,
                 act_block: int, gen: torch.Generator) -> list[Path]:
    dev = torch.device("cuda")
    num_experts, two_inter, hidden = w_gu.shape
    inter = two_inter // 2
    elem = 1 if act_block else torch.empty(0, dtype=dtype).element_size()
    best_gu, best_d = {}, {}
    for t in batch_sizes:
        logits = torch.randn(t, num_experts, device=dev, generator=gen)
        weights, ids = logits.softmax(-1).topk(top_k)
        ids = ids.to(torch.int32)
        x = torch.randn(t, hidden, device=dev, generator=gen).to(dtype)
        h = torch.randn(t * top_k, inter, device=dev, generator=gen).to(dtype)
        gu_out = torch.empty(t * top_k, inter, dtype=dtype, device=dev)
        d_out = torch.empty(t * top_k, hidden, dtype=dtype, device=dev)
        gu_args = dict(row_div=top_k, activation="silu")
        d_args = dict(row_div=1, routed_weights=weights.contiguous())
        if act_block:  # the rows quantized once, as fused_experts does before each GEMM
            x, gu_args["a_scale"] = quantize_activations(x, act_block)
            h, d_args["a_scale"] = quantize_activations(h, act_block)
        gu = (ids, x, w_gu, gu_out, gu_args)
        d = (ids, h, w_d, d_out, d_args)
        best_gu[t] = _best(gu, t, top_k, num_experts, True, elem, fmt, act_block)
        best_d[t] = _best(d, t, top_k, num_experts, False, elem, fmt, act_block)
    out = Path(out_dir) if out_dir else PACKAGE_DIR
    name = device_name(dev)
    paths = [out / config_file_name(name, num_experts, 2 * inter, hidden, dtype, weight_format(w_gu)),
             out / config_file_name(name, num_experts, hidden, inter, dtype, weight_format(w_d))]
    for path, table in zip(paths, (best_gu, best_d)):
        save_configs(path, {t: cfg for t, cfg in table.items() if cfg is not None})
        print(f"wrote {path}")
    return paths


def main(args: argparse.Namespace) -> int:
    """`loraplex tune` (arguments declared in entrypoints/cli.py): the MoE GEMMs of a MoE
    model, the FP8 dense GEMM (bench/tune_fp8.py) at the projection shapes of an FP8
    checkpoint or of any model with --quantization fp8, and the W4A16 GEMM
    (bench/tune_int4.py) at those of an AWQ / GPTQ checkpoint or of a dense model with
    --quantization awq|gptq."""
    from transformers import AutoConfig

    from loraplex.bench import tune_int4
    from loraplex.bench.workload import MOE_CONFIGS, prepare_model_dir
    from loraplex.models.registry import model_config

    logging.basicConfig(level=logging.INFO)
    model_dir, _ = prepare_model_dir(args.model, Path(args.cache_dir))
    cfg = model_config(AutoConfig.from_pretrained(model_dir))
    if args.quantization and cfg.quant is not None and cfg.quant.format != args.quantization:
        raise ModelLoadError(f"the checkpoint is {cfg.quant.method}-quantized; --quantization "
                             f"{args.quantization} cannot apply to it")
    fp8 = args.quantization == "fp8" or (cfg.quant is not None and cfg.quant.format == "fp8")
    int4 = tune_int4.int4_quant(cfg, args.quantization)
    if not cfg.moe_layers and not fp8 and int4 is None:
        raise UnsupportedModel(f"{args.model}: not a mixture-of-experts model, and only MoE kernels "
                               f"(bundled MoE configs: {', '.join(MOE_CONFIGS)}), FP8 GEMMs (an FP8 "
                               f"checkpoint, or --quantization fp8) and int4 GEMMs (an AWQ / GPTQ "
                               f"checkpoint, or --quantization awq|gptq) are tuned")
    if not torch.cuda.is_available():
        raise LoraplexError("loraplex tune times kernels on a CUDA GPU; this machine has none")
    act_block = fp8_act_block(cfg, fp8, getattr(args, "fp8_activations", "unquantized"))
    dtype, batch_sizes = getattr(torch, args.dtype), args.batch_sizes or BATCH_SIZES
    if cfg.moe_layers:
        fmt, block_k = experts_format(cfg.quant, args.quantization)
        tune(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok,
             dtype, batch_sizes, args.out, fmt, block_k, act_block if fmt == "fp8" else 0)
    if fp8:
        from loraplex.bench import tune_fp8

        tune_fp8.tune(tune_fp8.gemm_shapes(cfg), tune_fp8.scale_block(cfg), dtype, batch_sizes, args.out,
                      act_block)
    if int4 is not None:
        tune_int4.tune(projection_shapes(cfg, int4), int4.group_size, dtype,
                       args.batch_sizes or tune_int4.BATCH_SIZES, args.out)
    return 0


def fp8_act_block(cfg, fp8: bool, activations: str) -> int:
    """The FP8 GEMMs' activation block to tune for (--fp8-activations dynamic or prefill:
    W8A8, as serving with it runs them), else 0 (weight-only). Raises as serving would
    where W8A8 cannot apply."""
    if activations == "unquantized":
        return 0
    flag = f"--fp8-activations {activations}"
    if not fp8:
        raise ModelLoadError(f"{flag} tunes FP8 GEMMs: give an FP8 checkpoint or --quantization fp8")
    from loraplex.bench import tune_fp8

    try:
        return tune_fp8.fp8_quant(cfg).with_dynamic_activations().act_block
    except UnsupportedModel as e:
        raise ModelLoadError(f"{flag}: {e}") from e


def experts_format(quant, asked: str | None) -> tuple[str | None, int]:
    """(format of the MoE experts to tune, fp8 scale block): the checkpoint's own where
    its experts are quantized (gpt-oss's MXFP4, FP8 checkpoints), else the one asked for
    (--quantization: the format serving with it gives them), else plain tensors (None)."""
    fmt = quant.format if quant is not None else asked
    block = quant.weight_block if quant is not None and quant.format == "fp8" else None
    return (fmt if fmt in FORMATS else None), (block[1] if block and block[1] else 128)
