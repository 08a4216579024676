"""Compile the hot Triton kernels for an H100/H200 (sm_90) without a GPU and count their
global memory instructions by width. Run by test_codegen.py in a process without
TRITON_INTERPRET (the interpreter replaces the compiler). Prints JSON: kernel -> counts.
With the argument `shared`: attention kernel -> shared memory bytes per program, for the
configs the wrappers pick (a config past the GPU's limit fails only at launch, on a GPU).

Why: a mask or an offset whose alignment the compiler cannot prove (a bound loaded from
memory, a runtime N) silently turns 16-byte vector accesses into 2-byte ones; the
kernels stay correct and get several times slower. Nothing but the generated code shows it.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def const(v):
    return ("constexpr", v)


def compile_ptx(fn, args: dict, num_warps: int = 4) -> str:
    """args: parameter -> '*bf16'-style pointer type, int value (specialized as the launcher
    would: 1 becomes a constant, multiples of 16 carry the divisibility attribute unless
    the parameter is in do_not_specialize), float, or const(value)."""
    return compile_sm90(fn, args, num_warps).asm["ptx"]


def compile_sm90(fn, args: dict, num_warps: int = 4, num_stages: int = 3):
    sig, consts, attrs = {}, {}, {}
    for i, (name, param) in enumerate(inspect.signature(fn.fn).parameters.items()):
        # Parameters left out take their defaults, except PDL: on, as on a GPU (launch.pdl).
        if name in args:
            v = args[name]
        elif name == "PDL":
            v = const(True)
        else:
            assert param.default is not param.empty, f"{fn.fn.__name__}: no argument {name}"
            v = const(param.default)
        if isinstance(v, tuple):
            sig[name], consts[name] = "constexpr", v[1]
        elif isinstance(v, str):
            sig[name], attrs[(i,)] = v, [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        elif v == 1:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if v % 16 == 0 and name not in fn.do_not_specialize and i not in fn.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def widths(ptx: str) -> dict:
    counts = Counter()
    for op, vec, bits in re.findall(r"\b(ld|st)\.global(?:\.[a-z]+)*?(?:\.(v[248]))?\.(b\d+)", ptx):
        counts[f"{op}.{vec + '.' if vec else ''}{bits}"] += 1
    # Programmatic dependent launch (ops/triton/launch.py): the wait before any input.
    for op in re.findall(r"\bgriddepcontrol\.(wait|launch_dependents)", ptx):
        counts[f"griddepcontrol.{op}"] += 1
    # Pipelined loops load global memory straight to shared memory: bytes per copy.
    copy = r"cp\.async\.c[ag]\.shared\.global\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-f]+|\d+)"
    for size in re.findall(copy, ptx):
        counts[f"cp.async.{int(size, 0)}"] += 1
    return dict(counts)


def kernels() -> dict:
    mod = lambda name: importlib.import_module(f"loraplex.ops.triton.{name}")  # noqa: E731
    bf, f32, i32 = "*bf16", "*fp32", "*i32"
    tf32 = dict(DOT_PRECISION=const("tf32"), UPCAST=const(False))
    qkv = 6144  # Llama-3.1-8B q/k/v output width; rank 16, 32 slots
    out = {}
    out["lora_expand_gemv"] = compile_ptx(mod("lora_expand_gemv")._expand_gemv_kernel, dict(
        buf_ptr=f32, b_ptr=bf, y_ptr=bf, token_slot_ptr=i32, slot_ranks_ptr=i32, slice_starts_ptr=i32,
        stride_bs=32 * 16, stride_bm=16, stride_wl=qkv * 16, stride_wn=16, stride_ym=qkv,
        N_BLOCKS_PER_SLICE=const(16), BLOCK_N=const(256), BLOCK_R=const(16), ALIGN=const(16)))
    out["lora_expand_sgmv"] = compile_ptx(mod("lora_expand_sgmv")._lora_expand_kernel, dict(
        buf_ptr=f32, b_ptr=bf, y_ptr=bf, sorted_ids_ptr=i32, group_slots_ptr=i32,
        group_starts_ptr=i32, group_ranks_ptr=i32, num_groups=32, slice_starts_ptr=i32,
        stride_bs=8192 * 16, stride_bm=16, stride_br=1,
        stride_wl=qkv * 16, stride_wn=16, stride_wr=1, stride_ym=qkv, stride_yn=1,
        N_BLOCKS_PER_SLICE=const(16), BLOCK_M=const(16), BLOCK_N=const(256), BLOCK_R=const(16),
        TILE_BLOCKS=const(4), ALIGN=const(16), **tf32))
    width = 14336  # Llama-3.1-8B intermediate size: gate_up [T, 2 x width]
    out["lora_act_gemv"] = compile_ptx(mod("lora_act_gemv")._lora_act_gemv_kernel, dict(
        gu_ptr=bf, buf_ptr=f32, b_ptr=bf, out_ptr=bf, token_slot_ptr=i32, slot_ranks_ptr=i32, width=width,
        stride_gm=2 * width, stride_bs=32 * 16, stride_bm=16, stride_wl=2 * width * 16, stride_wn=16,
        stride_om=width, BLOCK_N=const(256), BLOCK_R=const(16), GELU=const(False)))
    out["lora_act_sgmv"] = compile_ptx(mod("lora_act_sgmv")._lora_act_sgmv_kernel, dict(
        gu_ptr=bf, buf_ptr=f32, b_ptr=bf, out_ptr=bf, sorted_ids_ptr="*i64", group_slots_ptr=i32,
        group_starts_ptr=i32, group_ranks_ptr=i32, num_groups=32, num_tokens=2048, width=width,
        stride_gm=2 * width, stride_bs=2048 * 16, stride_bm=16, stride_wl=2 * width * 16, stride_wn=16,
        stride_om=width, BLOCK_M=const(16), BLOCK_N=const(256), BLOCK_R=const(16), TILE_BLOCKS=const(4),
        GELU=const(False),
        **tf32))
    h, inter, experts, r = 2048, 768, 128, 32  # Qwen3-30B-A3B experts; gate_up rank 2 x 16
    for fuse, (n, k) in ((True, (inter, h)), (False, (h, inter))):
        out[f"moe_gemm_{'gate_up' if fuse else 'down'}"] = compile_ptx(mod("moe_gemm")._moe_gemm_kernel, dict(
            a_ptr=bf, w_ptr=bf, bias_ptr=bf, out_ptr=bf, weights_ptr=f32, delta_ptr=f32,
            token_slot_ptr=i32, slot_mask_ptr=i32, sorted_ids_ptr=i32,
            block_experts_ptr=i32, num_valid_ptr=i32, N=n, K=k, num_pairs=5, num_blocks=7, limit=3,
            stride_am=k, stride_ak=1, stride_we=2 * n * k, stride_wn=k, stride_wk=1, stride_be=0,
            stride_bn=0, stride_om=n, stride_on=1, stride_dm=2 * n if fuse else n,
            ROW_DIV=const(8 if fuse else 1), HAS_BIAS=const(False), FUSE_ACT=const(fuse),
            HAS_DELTA=const(True), TOP_K=const(8), USE_SLOT_MASK=const(True), SPARSE_DELTA=const(True),
            OPERANDS_FIRST=const(False), ACTIVATION=const("silu"), ALPHA=const(1.702),
            MUL_ROUTED_WEIGHT=const(not fuse), BLOCK_M=const(64), BLOCK_N=const(128),
            BLOCK_K=const(64), GROUP_M=const(8), EVEN_K=const(True), EVEN_N=const(True), **tf32),
            num_warps=8)
    out["moe_lora"] = compile_ptx(mod("moe_lora")._moe_lora_kernel, dict(
        in_ptr=bf, a_ptr=bf, b_ptr=bf, delta_ptr=f32, sorted_ids_ptr=i32, block_groups_ptr=i32,
        num_valid_ptr=i32, ranks_ptr=i32, K=h, N=2 * inter, num_pairs=5, num_experts=experts,
        stride_im=h, stride_ik=1, stride_al=experts * r * h, stride_ae=r * h, stride_ar=h, stride_ak=1,
        stride_bl=experts * 2 * inter * r, stride_be=2 * inter * r, stride_bn=r, stride_br=1,
        stride_dm=2 * inter, stride_dn=1, R=const(r), ROW_DIV=const(8), HAS_RANKS=const(True),
        BLOCK_M=const(16),
        BLOCK_R=const(r), BLOCK_K=const(64), BLOCK_N=const(128), EVEN_K=const(True),
        EVEN_N=const(True), **tf32))
    lora_gemv = dict(
        in_ptr=bf, ids_ptr=i32, token_slot_ptr=i32, slot_mask_ptr=i32, ranks_ptr=i32, a_ptr=bf, b_ptr=bf,
        delta_ptr=f32, weights_ptr=f32, K=h, N=2 * inter, num_pairs=5,
        stride_im=h, stride_al=experts * r * h, stride_ae=r * h, stride_ar=h,
        stride_bl=experts * 2 * inter * r, stride_be=2 * inter * r, stride_bn=r, stride_dm=2 * inter,
        TOP_K=const(8), ROW_DIV=const(8), R=const(r), BLOCK_R=const(r), HAS_MASK=const(True),
        HAS_RANKS=const(True), N_SPLIT=const(2), BLOCK_K=const(512), BLOCK_N=const(256),
        EVEN_K=const(True), EVEN_N=const(True), NUM_STAGES=const(3), EXPAND=const(True))
    out["moe_lora_gemv"] = compile_ptx(mod("moe_lora_gemv")._moe_lora_gemv_kernel, lora_gemv, num_warps=8)
    # The down deltas as bf16 terms of the top-k sum (rows of [T, top_k, 2, H]: stride 2 H).
    out["moe_lora_gemv_terms"] = compile_ptx(mod("moe_lora_gemv")._moe_lora_gemv_kernel, dict(
        lora_gemv, delta_ptr=bf, stride_dm=4 * inter, ALL_ROWS=const(True), WEIGHTED=const(True)),
        num_warps=8)
    out["race_sample"] = compile_ptx(mod("sample")._race_partial_kernel, dict(
        logits_ptr=f32, temperature_ptr=f32, seeds_ptr="*i64", best_ptr=f32, best_id_ptr=i32,
        vocab=128256, stride_row=128256, min_draw=1e-20, splits=16, SPAN=const(8192),
        BLOCK_V=const(4096)), num_warps=8)
    # The decoder's norm in front of a W8A8 GEMM (Qwen3-30B-A3B FP8: hidden 2048, blocks of
    # 128): the residual, the bf16 row and its e4m3 row with their scales.
    out["rms_norm_fp8"] = compile_ptx(mod("rms_norm")._rms_norm_kernel, dict(
        x_ptr=bf, res_ptr=bf, w_ptr=bf, out_ptr=bf, res_out_ptr=bf, q_ptr="*fp8e4nv", s_ptr=f32,
        N=h, eps=1e-6, stride_x0=h, stride_x1=h, stride_r0=h, stride_o0=h, stride_o1=h, stride_q0=h,
        stride_s0=16, INNER=const(1), HAS_RESIDUAL=const(True), UNIT_OFFSET=const(False), SUM_ROWS=const(8),
        BLOCK_N=const(h), FP8_BLOCK=const(128), HAND_ROUND=const(False)))
    # The split-KV merge in front of a W8A8 o_proj (Qwen3-30B-A3B: 32 heads of 128, 4 splits).
    out["decode_merge_fp8"] = compile_ptx(mod("paged_decode")._decode_merge_kernel, dict(
        acc_ptr=f32, max_ptr=f32, sum_ptr=f32, out_ptr=bf, sinks_ptr=bf, seq_lens_ptr=i32,
        query_start_loc_ptr=i32, q8_ptr="*fp8e4nv", s8_ptr=f32, window=0, splits=4, num_heads=32,
        stride_ot=4096, stride_oh=128, stride_od=1, QUERY_LEN=const(1), HEAD_DIM=const(128),
        BLOCK_D=const(128), BLOCK_S=const(4), PARTITION=const(256), BLOCK_N=const(128),
        USE_WINDOW=const(False), USE_SINKS=const(False), FP8=const(True)), num_warps=1)
    return {name: widths(ptx) for name, ptx in out.items()}


def attention_shared_memory() -> dict:
    """Shared memory of paged attention (prefill and decode tiles) and the split-KV decode
    kernel, per (dtype, head_dim) where the configs change: rows of 512 bytes (bf16 at
    256, float32 at 128) and over (float32 at 256, Gemma 3 in float32)."""
    pa = importlib.import_module("loraplex.ops.triton.paged_attention")
    pd = importlib.import_module("loraplex.ops.triton.paged_decode")
    out, group, page = {}, 4, 16
    for dtype, size, d in (("bf16", 2, 256), ("fp32", 4, 128), ("fp32", 4, 256)):
        ptr = f"*{dtype}"
        prec = dict(DOT_PRECISION=const("ieee" if dtype == "fp32" else "tf32"), UPCAST=const(False))
        cache = dict(stride_kb=page * 2 * d, stride_ks=2 * d, stride_kh=d, stride_kd=1,
                     stride_vb=page * 2 * d, stride_vs=2 * d, stride_vh=d, stride_vd=1)
        common = dict(q_ptr=ptr, k_cache_ptr=ptr, v_cache_ptr=ptr, block_tables_ptr="*i32",
                      seq_lens_ptr="*i32", query_start_loc_ptr="*i32", scale=0.1, window=0,
                      stride_qt=d * 32, stride_qh=d, stride_qd=1, stride_bt=32, GROUP=const(group),
                      HEAD_DIM=const(d), BLOCK_D=const(d), PAGE=const(page), USE_WINDOW=const(False),
                      **cache, **prec)
        # Chunks of any length; a decode token; a verified proposal of 4 tokens.
        for kind, q_len in (("prefill", 64), ("decode", 1), ("verify", 5)):
            cfg = pa.attention_config(q_len, group, d * size)
            args = dict(out_ptr=ptr, sinks_ptr=ptr, stride_ot=d * 32, stride_oh=d, stride_od=1,
                        BLOCK_M=const(cfg["BLOCK_M"]), BLOCK_N=const(cfg["BLOCK_N"]), USE_SINKS=const(True),
                        num_seqs=33, ONE_TILE=const(kind != "prefill"), **common)
            out[f"attention {kind} {dtype} d{d}"] = compile_sm90(
                pa._paged_attention_kernel, args, cfg["num_warps"], cfg["num_stages"]).metadata.shared
        for kind, q_len in (("decode", 1), ("verify", 5)):
            cfg = pd.decode_config(group, d * size, q_len)
            args = dict(acc_ptr="*fp32", max_ptr="*fp32", sum_ptr="*fp32", splits=4, num_heads=32,
                        BLOCK_M=const(cfg["BLOCK_M"]), BLOCK_N=const(cfg["BLOCK_N"]), QUERY_LEN=const(q_len),
                        PARTITION=const(pd.PARTITION_SIZE), **common)
            out[f"split {kind} {dtype} d{d}"] = compile_sm90(
                pd._decode_split_kernel, args, cfg["num_warps"], cfg["num_stages"]).metadata.shared
    return out


if __name__ == "__main__":
    print(json.dumps(attention_shared_memory() if sys.argv[1:] == ["shared"] else kernels()))
