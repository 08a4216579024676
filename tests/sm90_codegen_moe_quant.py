"""Compile the quantized MoE expert kernels (moe_gemm_quant.py, moe_gemv_quant.py) for an
H100/H200 (sm_90) without a GPU and count their global memory instructions by width
(sm90_codegen.py says why). Run by test_quant_moe_kernels.py in a process without
TRITON_INTERPRET. Prints JSON: kernel -> counts.

Shapes: gpt-oss-20b's MXFP4 experts (H = I = 2880, 32 experts, top-4, biases, clamped
SwiGLU) and Qwen3-30B-A3B-FP8's (H 2048, I 768, 128 experts, top-8, 128-column scale
blocks), with the configs the wrappers pick by default; the GEMV with adapters of rank
16 (it expands their shrunk rows).
"""

from __future__ import annotations

import importlib
import json

from sm90_codegen import compile_sm90, const, widths

SHAPES = {"mxfp4": (2880, 2880, 4), "fp8": (2048, 768, 8), "w8a8": (2048, 768, 8)}  # H, I, top_k


def _args(fmt: str, n: int, k: int, fuse: bool, top_k: int) -> dict:
    """The arguments the two kernels share, for weight [E, N(x2 if fused), K] (w8a8: the
    FP8 weight with e4m3 activations)."""
    mx = fmt == "mxfp4"
    a8 = fmt == "w8a8"
    fmt = "fp8" if a8 else fmt
    # MXFP4 scale rows as Mxfp4Weight stores them: padded to 16 bytes (PADDED_SCALES).
    row_bytes, scales = (k // 2, -(-k // 32 // 16) * 16) if mx else (k, -(-k // 128))
    rows = 2 * n if fuse else n
    return dict(
        a_ptr="*fp8e4nv" if a8 else "*bf16", w_ptr="*u8" if mx else "*fp8e4nv",
        scale_ptr="*u8" if mx else "*fp32",
        bias_ptr="*bf16", out_ptr="*bf16", weights_ptr="*fp32", delta_ptr="*fp32", token_slot_ptr="*i32",
        slot_mask_ptr="*i32", N=n, K_STORED=k // 2 if mx else k, num_pairs=5, limit=7.0,
        stride_am=k, stride_ak=1, stride_we=rows * row_bytes, stride_wn=row_bytes, stride_wk=1,
        stride_se=rows * scales, stride_sn=scales, stride_sk=1, stride_be=rows, stride_bn=1,
        stride_om=n, stride_on=1, stride_dm=rows,
        FORMAT=const(fmt), SCALE_BLOCK=const(32 if mx else 128), SCALE_PER_STEP=const(not mx),
        PADDED_SCALES=const(mx),
        ROW_DIV=const(top_k if fuse else 1), HAS_BIAS=const(mx), FUSE_ACT=const(fuse), HAS_DELTA=const(True),
        TOP_K=const(top_k), USE_SLOT_MASK=const(True), ACTIVATION=const("swiglu_oai" if mx else "silu"),
        ALPHA=const(1.702), MUL_ROUTED_WEIGHT=const(not fuse), UPCAST=const(False))


def _gemm_args(fmt: str, path: str = "ptx") -> dict:
    """The grouped GEMM's own: how bf16 MXFP4 experts become operands (mxfp4_path); the
    activations' scales (W8A8)."""
    a8 = fmt == "w8a8"
    return dict(MXFP4_PATH=const(path if fmt == "mxfp4" else "hand"), a_scale_ptr="*fp32",
                stride_asm=16, W8A8=const(a8), ACT_BLOCK=const(128 if a8 else 1),
                SPARSE_DELTA=const(False), OPERANDS_FIRST=const(True))  # the decode form's delta


def kernels() -> dict:
    gemm_mod = importlib.import_module("loraplex.ops.triton.moe_gemm_quant")
    gemv_mod = importlib.import_module("loraplex.ops.triton.moe_gemv_quant")
    moe_gemm = importlib.import_module("loraplex.ops.triton.moe_gemm")
    out = {}
    for fmt, (h, i, top_k) in SHAPES.items():
        defaults = moe_gemm.default_configs(fmt)
        for fuse in (True, False):
            n, k = (i, h) if fuse else (h, i)
            name = f"{fmt} {'gate_up' if fuse else 'down'}"
            decode, prefill = defaults[0][1], defaults[-1][1]
            path = "ptx" if fmt == "mxfp4" else "hand"  # bf16 MXFP4 on a GPU decodes in PTX
            for rows, cfg in (("decode", decode), ("prefill", prefill)):
                args = dict(_args(fmt, n, k, fuse, top_k), sorted_ids_ptr="*i32", block_experts_ptr="*i32",
                            num_valid_ptr="*i32", num_blocks=7, GROUP_M=const(cfg["GROUP_M"]),
                            BLOCK_M=const(cfg["BLOCK_M"]), BLOCK_N=const(cfg["BLOCK_N"]),
                            BLOCK_K=const(cfg["BLOCK_K"]), EVEN_K=const(k % cfg["BLOCK_K"] == 0),
                            EVEN_N=const(n % cfg["BLOCK_N"] == 0), DOT_PRECISION=const("tf32"),
                            **_gemm_args(fmt, path))
                compiled = compile_sm90(gemm_mod._moe_gemm_quant_kernel, args, cfg["num_warps"],
                                        cfg["num_stages"])
                out[f"gemm {name} {rows}"] = widths(compiled.asm["ptx"])
            if fmt == "w8a8":  # no GEMV form
                continue
            cfg = gemv_mod.GEMV_CONFIG
            block_k = next(b for b in (cfg["BLOCK_K"], 64, 32) if k % b == 0)
            rows = 2 * n if fuse else n  # adapters of rank 16: the GEMV expands shrunk rows
            args = dict(_args(fmt, n, k, fuse, top_k), ids_ptr="*i32", BLOCK_N=const(cfg["BLOCK_N"]),
                        BLOCK_K=const(block_k), EVEN_K=const(True), EVEN_N=const(n % cfg["BLOCK_N"] == 0),
                        PTX=const(path == "ptx"), lora_b_ptr="*bf16", stride_lbl=8 * rows * 16,
                        stride_lbe=rows * 16, stride_lbn=16, R=const(16), BLOCK_R=const(16),
                        LORA_EXPAND=const(True))
            compiled = compile_sm90(gemv_mod._moe_gemv_quant_kernel, args, cfg["num_warps"])
            out[f"gemv {name}"] = widths(compiled.asm["ptx"])
    return out


if __name__ == "__main__":
    print(json.dumps(kernels()))
