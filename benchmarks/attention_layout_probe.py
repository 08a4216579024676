"""Decode attention for Llama-3.1-8B's decode step (32 seqs x ~600 keys, 8 KV heads, D 128):
does the KV cache's layout bound it?

    python benchmarks/attention_layout_probe.py [--out probe.json]

The cache is [blocks, page, kv_heads, D]: one KV head's keys of a page are 16 rows of
256 bytes, 2 KB apart, and a program (sequence, KV head) reads only those. "head-major"
stores [blocks, kv_heads, page, D] (one head's page: 4 KB contiguous) and passes the
kernels a permuted view, so the same code runs on it through the strides. Each case is
timed over 32 layers' caches in one CUDA graph (HBM, not L2), per layer.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import math

import torch
import triton
import triton.language as tl

from loraplex import ops
from loraplex.ops.metadata import AttentionBatch
from loraplex.ops.triton import paged_decode


@triton.jit
def _read_kernel(k_ptr, v_ptr, table_ptr, out_ptr, ctx, stride_b, stride_s, stride_h, stride_bt,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Program (seq, kv head) reads its keys and values through the block table, as the
    attention kernels do, and only sums them: the access pattern without the math."""
    seq, head = tl.program_id(0), tl.program_id(1)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    acc = tl.zeros((BLOCK_N, D), dtype=tl.float32)
    for n0 in range(0, ctx, BLOCK_N):
        n = n0 + offs_n
        mask = n < ctx
        page = tl.load(table_ptr + seq * stride_bt + n // PAGE, mask=mask, other=0)
        off = page * stride_b + (n % PAGE) * stride_s + head * stride_h
        k = tl.load(k_ptr + off[:, None] + offs_d[None, :], mask=mask[:, None], other=0.0)
        v = tl.load(v_ptr + off[:, None] + offs_d[None, :], mask=mask[:, None], other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(out_ptr + seq * tl.num_programs(1) + head, tl.sum(tl.sum(acc, axis=1), axis=0))


@triton.jit
def _fma_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, out_ptr, ctx, scale, stride_b, stride_s, stride_h,
                       stride_bt, GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                       D: tl.constexpr):
    """Decode attention with the scores and the weighted sum on the CUDA cores
    (broadcast-multiply-reduce in registers): no shared-memory staging for tensor-core
    tiles that a 4-row query group would fill to a quarter."""
    seq, head = tl.program_id(0), tl.program_id(1)
    offs_g = tl.arange(0, GROUP)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + (seq * tl.num_programs(1) * GROUP + head * GROUP + offs_g)[:, None] * D
                + offs_d[None, :]).to(tl.float32) * scale
    m_i = tl.full((GROUP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP,), tl.float32)
    acc = tl.zeros((GROUP, D), tl.float32)
    for n0 in range(0, ctx, BLOCK_N):
        n = n0 + offs_n
        mask = n < ctx
        page = tl.load(table_ptr + seq * stride_bt + n // PAGE, mask=mask, other=0)
        off = page * stride_b + (n % PAGE) * stride_s + head * stride_h
        k = tl.load(k_ptr + off[:, None] + offs_d[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + off[:, None] + offs_d[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP, BLOCK_N]
        s = tl.where(mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (seq * tl.num_programs(1) * GROUP + head * GROUP + offs_g)[:, None] * D
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty))


def fma_decode(q, layers, table, out, block_n, warps):
    for k, v in layers:
        _fma_decode_kernel[(SEQS, HKV)](q, k, v, table, out, CTX, D**-0.5, k.stride(0), k.stride(1),
                                        k.stride(2), table.stride(0), GROUP=HQ // HKV, PAGE=PAGE,
                                        BLOCK_N=block_n, D=D, num_warps=warps)


def read_only(layers, table, out, block_n, warps):
    for k, v in layers:
        _read_kernel[(SEQS, HKV)](k, v, table, out, CTX, k.stride(0), k.stride(1), k.stride(2),
                                  table.stride(0), PAGE=PAGE, BLOCK_N=block_n, D=D, num_warps=warps)


paged_attention = importlib.import_module("loraplex.ops.triton.paged_attention")  # the module, not the op
SEQS, CTX, MAX_LEN, HQ, HKV, D, PAGE, LAYERS = 32, 600, 640, 32, 8, 128, 16, 32


def caches(head_major: bool):
    width = math.ceil(MAX_LEN / PAGE)
    shape = (SEQS * width, HKV, PAGE, D) if head_major else (SEQS * width, PAGE, HKV, D)
    out = []
    for _ in range(LAYERS):
        k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        if head_major:
            k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        out.append((k, v))
    return out


def check_and_time(q, layers, batch, ref) -> tuple[float, float]:
    """ops.paged_attention with the current configs: relative error against ref on the
    first layer's cache, and us per layer over all layers in one CUDA graph."""
    out = ops.paged_attention(q, *layers[0], batch, D**-0.5, None)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    us = 1e3 / LAYERS * triton.testing.do_bench_cudagraph(
        lambda: [ops.paged_attention(q, k, v, batch, D**-0.5, None) for k, v in layers],
        rep=50, return_mode="median")
    return err, us


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--layouts", nargs="+", default=["token-major", "head-major"])
    p.add_argument("--quick", action="store_true", help="the configs near the default only")
    args = p.parse_args()
    width = math.ceil(MAX_LEN / PAGE)
    # pages of a sequence spread over the pool, as after some serving
    perm = torch.randperm(SEQS * width, device="cuda").to(torch.int32)
    i32 = dict(dtype=torch.int32, device="cuda")
    batch = AttentionBatch(
        slot_mapping=torch.zeros(SEQS, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.arange(SEQS + 1, **i32), seq_lens=torch.full((SEQS,), CTX, **i32),
        block_tables=perm.view(SEQS, width), query_start_loc_cpu=list(range(SEQS + 1)),
        seq_lens_cpu=[CTX] * SEQS, max_query_len=1, max_seq_len=CTX)
    q = torch.randn(SEQS, HQ, D, device="cuda", dtype=torch.bfloat16)
    floor_us = SEQS * CTX * HKV * D * 2 * 2 / 4.8e12 * 1e6
    print(f"floor at 4.8 TB/s: {floor_us:.1f} us per layer")
    saved = {k: getattr(paged_decode, k) for k in ("BLOCK_N", "NUM_WARPS", "NUM_STAGES", "TARGET_PROGRAMS",
                                                   "PARTITION_SIZE")}
    rows = []
    for head_major in [layout == "head-major" for layout in args.layouts]:
        layers = caches(head_major)
        with ops.using_backend("torch"):
            ref = ops.paged_attention(q, *layers[0], batch, D**-0.5, None)
        with ops.using_backend("triton"):
            grid = itertools.product((64, 128), (2,), (264, 1056), (256,)) if args.quick else \
                itertools.product((32, 64, 128), (1, 2, 3), (264, 1056, 2112), (128, 256))
            for bn, st, tp, part in grid:
                if part < bn or (tp == 264 and (part, bn, st) != (256, 64, 2)):
                    continue
                for k, v in dict(BLOCK_N=bn, NUM_STAGES=st, TARGET_PROGRAMS=tp, PARTITION_SIZE=part).items():
                    setattr(paged_decode, k, v)
                try:
                    err, us = check_and_time(q, layers, batch, ref)
                except Exception as exc:
                    print(f"  head_major={head_major} BN {bn} st {st} tp {tp}: {type(exc).__name__}")
                    continue
                rows.append(dict(head_major=head_major, BLOCK_N=bn, stages=st, target=tp, partition=part,
                                 us=us, err=err))
                print(f"{'head-major' if head_major else 'token-major':11s} BN {bn:3d} st {st} tp {tp:4d} "
                      f"part {part}: "
                      f"{us:6.1f} us (err {err:.1e})", flush=True)
        for k, v in saved.items():
            setattr(paged_decode, k, v)
        # The single-pass kernel (one program per sequence and KV head) over its own configs.
        paged_decode.TARGET_PROGRAMS = SEQS * HKV
        default_config = paged_attention.attention_config
        for bn, warps, st in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)):
            paged_attention.attention_config = lambda *a, c=dict(BLOCK_M=16, BLOCK_N=bn, num_warps=warps,
                                                                 num_stages=st): c
            try:
                with ops.using_backend("triton"):
                    err, us = check_and_time(q, layers, batch, ref)
            except Exception as exc:
                print(f"single pass BN {bn} warps {warps} st {st}: {type(exc).__name__}")
                continue
            rows.append(dict(head_major=head_major, single_pass=True, BLOCK_N=bn, warps=warps, stages=st,
                             us=us, err=err))
            print(f"single pass BN {bn:3d} warps {warps} st {st}: {us:.1f} us (err {err:.1e})")
        paged_attention.attention_config = default_config
        paged_decode.TARGET_PROGRAMS = saved["TARGET_PROGRAMS"]
        sums = torch.empty(SEQS * HKV, device="cuda")
        for bn, warps in itertools.product((32, 64, 128), (4, 8)):
            us = 1e3 / LAYERS * triton.testing.do_bench_cudagraph(
                lambda: read_only(layers, batch.block_tables, sums, bn, warps), rep=50, return_mode="median")
            print(f"read only, BN {bn} warps {warps}: {us:.1f} us")
        got = torch.empty_like(q)
        for bn, warps in itertools.product((8, 16, 32, 64), (4, 8)):
            try:
                got.fill_(float("nan"))
                fma_decode(q, layers[:1], batch.block_tables, got, bn, warps)
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                us = 1e3 / LAYERS * triton.testing.do_bench_cudagraph(
                    lambda: fma_decode(q, layers, batch.block_tables, got, bn, warps), rep=50,
                    return_mode="median")
            except Exception as exc:
                print(f"fma decode BN {bn} warps {warps}: {type(exc).__name__} {str(exc)[:100]}")
                continue
            print(f"fma decode, BN {bn} warps {warps}: {us:.1f} us (err {err:.1e})")
        whole = [torch.cat([k.flatten(), v.flatten()]) for k, v in layers[:4]]
        us = 1e3 / 4 * triton.testing.do_bench_cudagraph(lambda: [w.sum() for w in whole], rep=50,
                                                       return_mode="median")
        print(f"torch sum over a layer's whole cache ({whole[0].numel() * 2 / 1e6:.0f} MB): {us:.1f} us")
        layers = whole = None
        torch.cuda.empty_cache()
    for hm in sorted({r["head_major"] for r in rows}):
        split = [r for r in rows if r["head_major"] == hm and "single_pass" not in r]
        best = sorted(split, key=lambda r: r["us"])[:5]
        print("best", "head-major" if hm else "token-major",
              [(r["BLOCK_N"], r["stages"], r["target"], r["partition"], round(r["us"], 1)) for r in best])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
