"""Kernel microbenchmarks on Llama-3.1-8B shapes, each against its memory/compute floor.

    python benchmarks/kernels.py [--out results.json]

Each case: median time (CUDA-graph replay, so launch gaps do not count), the bytes it
must move and FLOPs it must do, and the fraction of the floor achieved. Floors use the
measured H200 ceilings unless --bandwidth / --tflops say otherwise.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton

from loraplex import ops
from loraplex.ops.metadata import AttentionBatch, LoRABatch, make_lora_batch

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
PROJECTIONS = {  # name: (in, [slice outs])
    "qkv": (HIDDEN, [4096, 1024, 1024]),
    "o": (HIDDEN, [4096]),
    "gate_up": (HIDDEN, [INTER, INTER]),
    "down": (INTER, [HIDDEN]),
}


def bench(fn) -> float:
    """Median milliseconds of fn replayed from a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def projection_tensors(tokens: int, k: int, outs: list[int], max_loras: int, rank: int, dev):
    """Random bf16 input x [tokens, k], base weight w [sum(outs), k] and LoRA slot tensors
    A [slices, max_loras, rank, k], B [max_loras, sum(outs), rank] at trained-like scales."""
    n, bf16 = sum(outs), torch.bfloat16
    x = torch.randn(tokens, k, device=dev, dtype=bf16)
    w = torch.randn(n, k, device=dev, dtype=bf16) / k**0.5
    a = torch.randn(len(outs), max_loras, rank, k, device=dev, dtype=bf16) / k**0.5
    b = torch.randn(max_loras, n, rank, device=dev, dtype=bf16) * 0.01
    return x, w, a, b


def lora_batch(slots: list[int], ranks: list[int], max_loras: int, device) -> LoRABatch:
    return make_lora_batch(slots, ranks, max_loras, device)


def lora_cases(bw, tflops, rank=16, max_loras=32):
    dev = "cuda"
    rows = []
    for tokens, adapters, label in [(32, 32, "decode 32 tok, 32 adapters"),
                                    (32, 8, "decode 32 tok, 8 adapters"),
                                    (32, 1, "decode 32 tok, 1 adapter"),
                                    (8192, 32, "prefill 8192 tok, 32 adapters")]:
        slots = [i % adapters for i in range(tokens)]
        batch = lora_batch(slots, [rank] * max_loras, max_loras, dev)
        for name, (k, outs) in PROJECTIONS.items():
            n = sum(outs)
            x, w, a, b = projection_tensors(tokens, k, outs, max_loras, rank, dev)
            y = x @ w.T
            buf = ops.lora_shrink(x, a, batch)
            t_base = bench(lambda: torch.mm(x, w.T))
            t_shrink = bench(lambda: ops.lora_shrink(x, a, batch))
            t_expand = bench(lambda: ops.lora_expand(buf, b, y, tuple(outs), batch))
            used = adapters
            # Floors: each active adapter's A and B read once; x read, y read + written.
            shrink_bytes = used * len(outs) * rank * k * 2 + tokens * k * 2
            expand_bytes = used * n * rank * 2 + 2 * tokens * n * 2
            base_bytes = n * k * 2 + tokens * (k + n) * 2
            for op, t, nbytes, flops in [("base GEMM (cuBLAS)", t_base, base_bytes, 2 * tokens * n * k),
                                         ("lora_shrink", t_shrink, shrink_bytes,
                                          2 * tokens * rank * k * len(outs)),
                                         ("lora_expand", t_expand, expand_bytes, 2 * tokens * rank * n)]:
                floor = max(nbytes / bw, flops / tflops) * 1e3
                rows.append(dict(case=label, proj=name, op=op, ms=t, floor_ms=floor,
                                 frac=floor / t, MB=nbytes / 1e6, GFLOP=flops / 1e9))
    return rows


def _sweep(module_name: str, settings: list[dict], fn) -> list[tuple[dict, float]]:
    """Time fn under each setting of a kernel module's tunables; restore them after."""
    import importlib

    mod = importlib.import_module(module_name)
    saved = {k: getattr(mod, k) for k in settings[0]}
    out = []
    for setting in settings:
        for k, v in setting.items():
            setattr(mod, k, v)
        out.append((setting, bench(fn)))
    for k, v in saved.items():
        setattr(mod, k, v)
    return out


def config_sweep(rank=16, max_loras=32):
    """LoRA tunables: GEMV forms on decode (32 tokens, 32 adapters), SGMV expand on prefill."""
    from loraplex.ops import triton as k

    dev, rows = "cuda", []
    pkg = "loraplex.ops.triton."
    for tokens, adapters in [(32, 32), (8192, 32)]:
        batch = lora_batch([i % adapters for i in range(tokens)], [rank] * max_loras, max_loras, dev)
        for name, (kk, outs) in PROJECTIONS.items():
            n = sum(outs)
            x = torch.randn(tokens, kk, device=dev, dtype=torch.bfloat16)
            a = torch.randn(len(outs), max_loras, rank, kk, device=dev, dtype=torch.bfloat16)
            b = torch.randn(max_loras, n, rank, device=dev, dtype=torch.bfloat16)
            y = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16)
            if tokens <= 64:
                # Rotate over copies larger than L2 together: in a model, the base weights
                # between two LoRA calls evict the adapters, so they come from HBM.
                copies = 8
                a_all = [a] + [a.clone() for _ in range(copies - 1)]
                b_all = [b] + [b.clone() for _ in range(copies - 1)]
                res = _sweep(pkg + "lora_shrink_gemv",
                             [dict(BLOCK_K=bk, PROGRAMS_PER_SM=p, NUM_WARPS=w)
                              for bk in (256, 512) for p in (1, 4, 8) for w in (4, 8)],
                             lambda: [k.lora_shrink_gemv(x, ai, batch) for ai in a_all])
                buf = k.lora_shrink_gemv(x, a, batch)
                res += _sweep(pkg + "lora_expand_gemv", [dict(BLOCK_N=bn) for bn in (128, 256, 512, 1024)],
                              lambda: [k.lora_expand_gemv(buf, bi, y, tuple(outs), batch) for bi in b_all])
                res = [(setting, ms / copies) for setting, ms in res]
            else:
                buf = k.lora_shrink_sgmv(x, a, batch)
                res = _sweep(pkg + "lora_expand_sgmv",
                             [dict(BLOCK_M=bm, BLOCK_N=bn, NUM_WARPS=w) for bm, bn in
                              ((64, 128), (128, 128), (64, 256), (128, 64)) for w in (4, 8)],
                             lambda: k.lora_expand_sgmv(buf, b, y, tuple(outs), batch))
            for setting, ms in res:
                label = " ".join(f"{a}={v}" for a, v in setting.items())
                rows.append(dict(proj=name, op=f"{tokens} tok {label}", ms=ms))
    return rows


def projection_cases(rank=16, max_loras=32, tokens=32):
    """A whole LoRALinear in decode: base only, base + LoRA serial, shrink on a 2nd stream."""
    from loraplex.layers.context import ForwardContext, forward_context
    from loraplex.layers.linear import LoRALinear

    dev, rows = "cuda", []
    batch = lora_batch(list(range(tokens)), [rank] * max_loras, max_loras, dev)
    batch.groups = []  # as in a CUDA graph
    aux = torch.cuda.Stream()
    for name, (k, outs) in PROJECTIONS.items():
        layer = LoRALinear(k, outs, [f"s{i}" for i in range(len(outs))]).to(dev, torch.bfloat16)
        layer.weight.data.normal_(0, 0.02)
        layer.lora_a = torch.randn(len(outs), max_loras, rank, k, device=dev, dtype=torch.bfloat16)
        layer.lora_b = torch.randn(max_loras, sum(outs), rank, device=dev, dtype=torch.bfloat16)
        x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
        for label, lora, stream in [("base only", None, None), ("base+lora serial", batch, None),
                                    ("base+lora, shrink on aux stream", batch, aux)]:
            ctx = ForwardContext(attn=None, lora=lora, aux_stream=stream)

            def fn(ctx=ctx):
                with forward_context(ctx):
                    layer(x)

            rows.append(dict(proj=name, op=label, ms=bench(fn)))
    return rows


def attention_cases(bw, tflops):
    dev, page = "cuda", 16
    rows = []
    for label, seqs in [("decode 32 seqs x ctx 640", [(639, 1)] * 32),
                        ("decode 32 seqs x ctx 2048", [(2047, 1)] * 32),
                        ("prefill 16 seqs x 512 new", [(0, 512)] * 16),
                        ("prefill chunk 512 on 1536 cached x 4", [(1536, 512)] * 4)]:
        num_pages = sum(math.ceil((c + n) / page) for c, n in seqs)
        kc = torch.randn(num_pages, page, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        tables, qsl, lens, nxt = [], [0], [], 0
        for c, n in seqs:
            p = math.ceil((c + n) / page)
            tables.append(list(range(nxt, nxt + p)))
            nxt += p
            qsl.append(qsl[-1] + n)
            lens.append(c + n)
        width = max(map(len, tables))
        i32 = dict(dtype=torch.int32, device=dev)
        batch = AttentionBatch(
            slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, **i32), seq_lens=torch.tensor(lens, **i32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], **i32),
            query_start_loc_cpu=qsl, seq_lens_cpu=lens,
            max_query_len=max(n for _, n in seqs), max_seq_len=max(lens),
        )
        q = torch.randn(qsl[-1], HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        t = bench(lambda: ops.paged_attention(q, kc, vc, batch, HEAD_DIM**-0.5, None))
        kv_bytes = sum((c + n) for c, n in seqs) * KV_HEADS * HEAD_DIM * 2 * 2
        nbytes = kv_bytes + 2 * q.numel() * 2
        flops = sum(4 * n * (c + n / 2) * HEADS * HEAD_DIM for c, n in seqs)
        floor = max(nbytes / bw, flops / tflops) * 1e3
        rows.append(dict(case=label, proj="-", op="paged_attention", ms=t, floor_ms=floor,
                         frac=floor / t, MB=nbytes / 1e6, GFLOP=flops / 1e9))
    return rows


def elementwise_cases(bw):
    dev, rows = "cuda", []
    x = torch.randn(32, HIDDEN, device=dev, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(32, 2 * INTER, device=dev, dtype=torch.bfloat16)
    for name, fn, nbytes in [
        ("add_rms_norm [32,4096]", lambda: ops.add_rms_norm(x, r, w, 1e-5), 4 * x.numel() * 2),
        ("silu_and_mul [32,2x14336]", lambda: ops.silu_and_mul(gu), 1.5 * gu.numel() * 2),
    ]:
        t = bench(fn)
        floor = nbytes / bw * 1e3
        rows.append(dict(case="decode", proj="-", op=name, ms=t, floor_ms=floor, frac=floor / t,
                         MB=nbytes / 1e6, GFLOP=0.0))
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s (H200 measured)")
    p.add_argument("--tflops", type=float, default=790e12, help="bf16 FLOP/s (H200 measured)")
    args = p.parse_args()
    ops.use_backend("triton")
    rows = lora_cases(args.bandwidth, args.tflops) + attention_cases(args.bandwidth, args.tflops)
    rows += elementwise_cases(args.bandwidth)
    print(f"{'case':38} {'proj':8} {'op':22} {'ms':>8} {'floor':>8} {'frac':>6}")
    for r in rows:
        print(f"{r['case']:38} {r['proj']:8} {r['op']:22} {r['ms']:8.4f} "
              f"{r['floor_ms']:8.4f} {r['frac']:6.2f}")
    extra = config_sweep() + projection_cases()
    for r in extra:
        print(f"{'sweep (32 adapters)':38} {r['proj']:8} {r['op']:40} {r['ms']:8.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows + extra, f, indent=1)


if __name__ == "__main__":
    main()
