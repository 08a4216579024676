"""LoRA kernels, paged attention and the small decode ops against their roofline floors, on
a dense model's shapes (Llama-3.1-8B by default).

    python -m benchmarks.kernels [--sections lora attention elementwise sweep projection chain]

Sections:
  lora         lora_shrink / lora_expand (GEMV form at 32 tokens, SGMV form at 8,192) and
               the base GEMM of each fused projection: time, bytes and FLOPs they must
               move, fraction of the floor reached (floor = max(bytes / bandwidth,
               FLOPs / tflops));
  attention    ops.paged_attention in decode and prefill shapes against its floor;
  elementwise  add_rms_norm and silu_and_mul at a decode step's size;
  sweep        the LoRA kernels' tunables (GEMV shrink / expand on decode, SGMV expand
               on prefill), adapters rotated over copies larger than L2;
  projection   a whole LoRALinear in decode: base only, + LoRA on one stream, + the
               shrink on a second stream;
  chain        the adapter kernels of a decode step as the model runs them: every
               layer's four projections (distinct weights, so they come from HBM) in one
               CUDA graph, base GEMMs alone, + LoRA GEMV with the shrink beside the GEMM on
               a side stream (decode graphs), + LoRA on one stream; us per layer.

Times are medians of CUDA-graph replays (`harness.graph_ms`). The lora/attention/
elementwise cases replay the same buffers, so 32 adapters' A/B stay in L2: optimistic;
`chain` is the in-model figure.

Figures: benchmarks/RESULTS.md, "LoRA kernels against their floors" (lora, attention,
elementwise) and "Adapter kernels in a decode step" (chain).
"""

from __future__ import annotations

import math

from benchmarks import harness

SECTIONS = ("lora", "attention", "elementwise", "sweep", "projection", "chain")


def lora_cases(shape: harness.ModelShape, fl: harness.Floors, rank=16, max_loras=32):
    import torch

    from loraplex import ops
    from loraplex.ops.metadata import make_lora_batch

    rows = []
    for tokens, adapters, label in [(32, 32, "decode 32 tok, 32 adapters"),
                                    (32, 8, "decode 32 tok, 8 adapters"),
                                    (32, 1, "decode 32 tok, 1 adapter"),
                                    (8192, 32, "prefill 8192 tok, 32 adapters")]:
        slots = [i % adapters for i in range(tokens)]
        batch = make_lora_batch(slots, [rank] * max_loras, max_loras, "cuda")
        for name, (k, outs) in shape.projections().items():
            n = sum(outs)
            x, w, a, b = harness.projection_tensors(tokens, k, outs, max_loras, rank)
            y = x @ w.T
            buf = ops.lora_shrink(x, a, batch)
            t_base = harness.graph_ms(lambda: torch.mm(x, w.T), rep=50)
            t_shrink = harness.graph_ms(lambda: ops.lora_shrink(x, a, batch), rep=50)
            t_expand = harness.graph_ms(lambda: ops.lora_expand(buf, b, y, tuple(outs), batch), rep=50)
            # Floors: each active adapter's A and B read once; x read, y read + written.
            shrink_bytes = adapters * len(outs) * rank * k * 2 + tokens * k * 2
            expand_bytes = adapters * n * rank * 2 + 2 * tokens * n * 2
            base_bytes = n * k * 2 + tokens * (k + n) * 2
            for op, t, nbytes, flops in [("base GEMM (cuBLAS)", t_base, base_bytes, 2 * tokens * n * k),
                                         ("lora_shrink", t_shrink, shrink_bytes,
                                          2 * tokens * rank * k * len(outs)),
                                         ("lora_expand", t_expand, expand_bytes, 2 * tokens * rank * n)]:
                floor = fl.ms(nbytes, flops)
                rows.append(dict(case=label, proj=name, op=op, ms=t, floor_ms=floor,
                                 frac=floor / t, MB=nbytes / 1e6, GFLOP=flops / 1e9))
    return rows


def attention_cases(shape: harness.ModelShape, fl: harness.Floors):
    import torch

    from loraplex import ops
    from loraplex.ops.metadata import AttentionBatch

    dev, page, d = "cuda", 16, shape.head_dim
    rows = []
    for label, seqs in [("decode 32 seqs x ctx 640", [(639, 1)] * 32),
                        ("decode 32 seqs x ctx 2048", [(2047, 1)] * 32),
                        ("prefill 16 seqs x 512 new", [(0, 512)] * 16),
                        ("prefill chunk 512 on 1536 cached x 4", [(1536, 512)] * 4)]:
        num_pages = sum(math.ceil((c + n) / page) for c, n in seqs)
        kc = torch.randn(num_pages, page, shape.kv_heads, d, device=dev, dtype=torch.bfloat16)
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
        q = torch.randn(qsl[-1], shape.heads, d, device=dev, dtype=torch.bfloat16)
        t = harness.graph_ms(lambda: ops.paged_attention(q, kc, vc, batch, d**-0.5, None), rep=50)
        kv_bytes = sum((c + n) for c, n in seqs) * shape.kv_heads * d * 2 * 2
        nbytes = kv_bytes + 2 * q.numel() * 2
        flops = sum(4 * n * (c + n / 2) * shape.heads * d for c, n in seqs)
        floor = fl.ms(nbytes, flops)
        rows.append(dict(case=label, proj="-", op="paged_attention", ms=t, floor_ms=floor,
                         frac=floor / t, MB=nbytes / 1e6, GFLOP=flops / 1e9))
    return rows


def elementwise_cases(shape: harness.ModelShape, fl: harness.Floors):
    import torch

    from loraplex import ops

    dev, rows, h, i = "cuda", [], shape.hidden, shape.intermediate
    x = torch.randn(32, h, device=dev, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(h, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(32, 2 * i, device=dev, dtype=torch.bfloat16)
    for name, fn, nbytes in [
        (f"add_rms_norm [32,{h}]", lambda: ops.add_rms_norm(x, r, w, 1e-5), 4 * x.numel() * 2),
        (f"silu_and_mul [32,2x{i}]", lambda: ops.silu_and_mul(gu), 1.5 * gu.numel() * 2),
    ]:
        t = harness.graph_ms(fn, rep=50)
        floor = fl.ms(nbytes)
        rows.append(dict(case="decode", proj="-", op=name, ms=t, floor_ms=floor, frac=floor / t,
                         MB=nbytes / 1e6, GFLOP=0.0))
    return rows


def _sweep(module_name: str, settings: list[dict], fn) -> list[tuple[dict, float]]:
    """Time fn under each setting of a kernel module's tunables; restore them after."""
    import importlib

    mod = importlib.import_module(module_name)
    saved = {k: getattr(mod, k) for k in settings[0]}
    out = []
    try:
        for setting in settings:
            for k, v in setting.items():
                setattr(mod, k, v)
            out.append((setting, harness.graph_ms(fn, rep=50)))
    finally:
        for k, v in saved.items():
            setattr(mod, k, v)
    return out


def config_sweep(shape: harness.ModelShape, rank=16, max_loras=32):
    """LoRA tunables: GEMV forms on decode (32 tokens, 32 adapters), SGMV expand on prefill."""
    import torch

    from loraplex.ops import triton as k
    from loraplex.ops.metadata import make_lora_batch

    dev, rows = "cuda", []
    pkg = "loraplex.ops.triton."
    for tokens, adapters in [(32, 32), (8192, 32)]:
        batch = make_lora_batch([i % adapters for i in range(tokens)], [rank] * max_loras, max_loras, dev)
        for name, (kk, outs) in shape.projections().items():
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


def projection_cases(shape: harness.ModelShape, rank=16, max_loras=32, tokens=32):
    """A whole LoRALinear in decode: base only, base + LoRA serial, shrink on a 2nd stream."""
    import torch

    from loraplex.layers.context import ForwardContext, forward_context
    from loraplex.layers.linear import LoRALinear
    from loraplex.layers.lora_weights import LoRAWeights
    from loraplex.ops.metadata import make_lora_batch

    dev, rows = "cuda", []
    batch = make_lora_batch(list(range(tokens)), [rank] * max_loras, max_loras, dev)
    batch.groups = []  # as in a CUDA graph
    aux = torch.cuda.Stream()
    for name, (k, outs) in shape.projections().items():
        layer = LoRALinear(k, list(outs), [f"s{i}" for i in range(len(outs))]).to(dev, torch.bfloat16)
        layer.weight.data.normal_(0, 0.02)
        # Engine internal: LoRALinear's slots (layers/lora_weights.py).
        layer.lora = LoRAWeights(torch.randn(len(outs), max_loras, rank, k, device=dev, dtype=torch.bfloat16),
                                 torch.randn(max_loras, sum(outs), rank, device=dev, dtype=torch.bfloat16))
        x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
        for label, lora, stream in [("base only", None, None), ("base+lora serial", batch, None),
                                    ("base+lora, shrink on aux stream", batch, aux)]:
            ctx = ForwardContext(attn=None, lora=lora, aux_stream=stream)

            def fn(ctx=ctx):
                with forward_context(ctx):
                    layer(x)

            rows.append(dict(proj=name, op=label, ms=harness.graph_ms(fn, rep=50)))
    return rows


def chain_cases(shape: harness.ModelShape, tokens=32, slots=32, rank=16):
    """Every layer's projections in one graph, us per layer: base GEMMs; + LoRA GEMV with
    the shrink on a side stream beside the GEMM (as decode graphs run it); on one stream."""
    import torch

    from loraplex.ops.metadata import make_lora_batch
    from loraplex.ops.triton.lora_expand_gemv import lora_expand_gemv
    from loraplex.ops.triton.lora_shrink_gemv import lora_shrink_gemv

    dev, dt, layers = "cuda", torch.bfloat16, shape.layers
    batch = make_lora_batch(list(range(tokens)), [rank] * slots, slots, dev)
    aux = torch.cuda.Stream()
    projs = []
    for _ in range(layers):
        for name, (k, sizes) in shape.projections().items():
            projs.append(dict(name=name, k=k, sizes=sizes,
                              w=torch.randn(sum(sizes), k, device=dev, dtype=dt) * k**-0.5,
                              a=torch.randn(len(sizes), slots, rank, k, device=dev, dtype=dt) * k**-0.5,
                              b=torch.randn(slots, sum(sizes), rank, device=dev, dtype=dt) * 0.02))
    xs = {p["k"]: torch.randn(tokens, p["k"], device=dev, dtype=dt) for p in projs}
    ys = {p["name"]: torch.empty(tokens, sum(p["sizes"]), device=dev, dtype=dt) for p in projs}

    def base():
        for p in projs:
            torch.mm(xs[p["k"]], p["w"].T, out=ys[p["name"]])

    def gemv(side: bool):
        for p in projs:
            x, y = xs[p["k"]], ys[p["name"]]
            if side:
                main = torch.cuda.current_stream()
                aux.wait_stream(main)
                with torch.cuda.stream(aux):
                    buf = lora_shrink_gemv(x, p["a"], batch)
                torch.mm(x, p["w"].T, out=y)
                main.wait_stream(aux)
            else:
                buf = lora_shrink_gemv(x, p["a"], batch)
                torch.mm(x, p["w"].T, out=y)
            lora_expand_gemv(buf, p["b"], y, p["sizes"], batch)

    rows = []
    for label, fn in [("base GEMMs", base), ("+ LoRA GEMV, shrink on a side stream (decode graphs)",
                                             lambda: gemv(True)),
                      ("+ LoRA GEMV, one stream", lambda: gemv(False))]:
        us = harness.graph_ms(fn, rep=200, per=layers) * 1e3
        rows.append(dict(case=f"{layers} layers, {tokens} tokens of {slots} adapters", op=label,
                         us_per_layer=us))
    return rows


def build_parser():
    p = harness.parser(__doc__)
    p.add_argument("--model", default="llama-3.1-8b", help="a dense bundled config (default: %(default)s)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    harness.add_floor_arguments(p)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from loraplex import ops

    shape, fl = harness.model_shape(args.model), harness.floors(args)
    if shape.is_moe:
        raise SystemExit(f"{args.model} is a MoE model: its experts are benchmarks.moe_kernels'")
    ops.use_backend("triton")
    results = {}
    rows = []
    if "lora" in args.sections:
        rows += lora_cases(shape, fl)
    if "attention" in args.sections:
        rows += attention_cases(shape, fl)
    if "elementwise" in args.sections:
        rows += elementwise_cases(shape, fl)
    if rows:
        print(f"{'case':38} {'proj':8} {'op':28} {'ms':>8} {'floor':>8} {'frac':>6}")
        for r in rows:
            print(f"{r['case']:38} {r['proj']:8} {r['op']:28} {r['ms']:8.4f} {r['floor_ms']:8.4f} "
                  f"{r['frac']:6.2f}")
        results["floors"] = rows
    if "sweep" in args.sections:
        results["sweep"] = config_sweep(shape)
        for r in results["sweep"]:
            print(f"{'sweep (32 adapters)':38} {r['proj']:8} {r['op']:40} {r['ms']:8.4f}")
    if "projection" in args.sections:
        results["projection"] = projection_cases(shape)
        for r in results["projection"]:
            print(f"{'LoRALinear, 32 tokens':38} {r['proj']:8} {r['op']:40} {r['ms']:8.4f}")
    if "chain" in args.sections:
        results["chain"] = chain_cases(shape)
        for r in results["chain"]:
            print(f"{r['case']:38} {r['op']:56} {r['us_per_layer']:8.1f} us/layer")
    harness.write_json(args.out, results, args)


if __name__ == "__main__":
    main()
