"""MoE experts: one layer's fused experts against the bandwidth floor, the expert adapters
of a decode step, and a quick decode-size tuning pass.

    python -m benchmarks.moe_kernels [--sections layer decode-lora] [--tokens 1 16 64 2048]
    python -m benchmarks.moe_kernels --sections layer --tune 16 --config-dir DIR

Shapes: the bundled MoE configs (Qwen3-30B-A3B, gpt-oss-20b).

Sections:
  layer        ops.fused_experts (Triton) for each token count, without and with 16
               rank-16 expert adapters: eager calls (CUDA events, median of 20 means of
               10 calls: small token counts include ~0.15-0.3 ms of launches), against the
               touched experts' bytes read once at the GPU's data-sheet bandwidth
               (--bandwidth to change). With --tune, the grouped GEMM's block configs are
               first tuned for those token counts on a reduced search space (`loraplex
               tune` runs the full one), written to --config-dir, and the layer is timed
               again with them.
  decode-lora  the expert adapters of a decode step (16 tokens, 16 adapters on every
               expert): 6 layers of distinct weights in one CUDA graph, us per layer: base
               experts, + adapters per (token, expert) pair (GEMV form, the decode path;
               programs per pair swept) and aligned by (slot, expert) (the prefill form),
               the alignment and the per-pair kernels alone with their tunables.

  prefill-quant  quantized experts (gpt-oss-20b MXFP4, Qwen3-30B-A3B FP8 blocks of 128)
               at prompt-sized token counts: fused_experts with the quantized grouped
               GEMM (W decoded in registers) against the stacks dequantized into scratch
               then the bf16 GEMM (moe_configs.DEQUANTIZE_MIN_PAIRS_PER_EXPERT picks),
               the bf16 experts and the dequantization alone; eager calls (CUDA events).

  router       the router of a decode step (--tokens up to 64): its GEMM (cuBLAS) then
               route_experts, against ops.route_tokens' one kernel at each of its configs
               (experts a program, K chunk, warps), us a router, from CUDA graphs of 400
               routers of distinct weights (more bytes than L2 holds, as in a decode step,
               where the experts' reads leave no router in L2).

  align        the pair alignment (moe_align) by expert and by (slot, expert) (8 adapter
               slots) at each token count, in its one-program and its parallel form, us
               from CUDA graphs of 50 alignments; both forms' segments compared.

Figures: benchmarks/RESULTS.md, "One MoE layer" (layer), "Expert adapters in decode"
(decode-lora), "Prefill of quantized experts" (prefill-quant), "The router in one
launch" (router), "The alignment in parallel" (align).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from benchmarks import harness

SECTIONS = ("layer", "decode-lora", "prefill-quant", "router", "align")
# prefill-quant: each bundled MoE config in its published quantized format.
QUANT_FORMATS = {"gpt-oss-20b": "mxfp4", "qwen3-30b-a3b": "fp8"}


def layer_case(name: str, t: int, bandwidth: float, rank=16, slots=16) -> dict:
    import torch

    from loraplex import ops
    from loraplex.ops.metadata import MoELoRA
    from loraplex.ops.triton import fused_experts

    e, h, i, k = harness.model_shape(name).expert_shape()
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(dev).manual_seed(0)
    w_gu = (torch.randn(e, 2 * i, h, device=dev, generator=gen) * 0.02).to(dt)
    w_d = (torch.randn(e, h, i, device=dev, generator=gen) * 0.02).to(dt)
    x = torch.randn(t, h, device=dev, generator=gen).to(dt)
    weights, ids = ops.route_experts(torch.randn(t, e, device=dev, generator=gen), k, True)
    touched = ids.unique().numel()
    floor_bytes = touched * (3 * h * i) * 2
    lora = MoELoRA(torch.randn(slots, e, 2 * rank, h, device=dev, dtype=dt) * 0.01,
                   torch.randn(slots, e, 2 * i, 2 * rank, device=dev, dtype=dt) * 0.01,
                   torch.randn(slots, e, rank, i, device=dev, dtype=dt) * 0.01,
                   torch.randn(slots, e, h, rank, device=dev, dtype=dt) * 0.01,
                   torch.arange(t, device=dev, dtype=torch.int32) % slots)
    base = harness.events_ms(lambda: fused_experts(x, weights, ids, w_gu, w_d), repeats=20, inner=10)
    with_lora = harness.events_ms(lambda: fused_experts(x, weights, ids, w_gu, w_d, lora=lora),
                                  repeats=20, inner=10)
    floor_ms = floor_bytes / bandwidth * 1e3
    print(f"{name} T={t}: {touched}/{e} experts, {floor_bytes / 2**20:.0f} MiB; base {base * 1e3:.1f} us "
          f"({floor_ms / base:.0%} of the floor {floor_ms * 1e3:.1f} us at {bandwidth / 1e12:.2f} TB/s), "
          f"with {slots} adapters {with_lora * 1e3:.1f} us", flush=True)
    return dict(model=name, tokens=t, experts_hit=touched, floor_us=floor_ms * 1e3, base_us=base * 1e3,
                frac=floor_ms / base, adapters_us=with_lora * 1e3)


def tune(token_counts: list[int], config_dir: Path) -> None:
    """The grouped GEMM's configs tuned for `token_counts` on ~1/4 of `loraplex tune`'s
    search space (pipelines of 3-4 stages), written to config_dir and loaded."""
    import torch

    # Engine internal: the tuner's candidate list and entry point, and the config cache.
    import loraplex.bench.tune_moe as tm
    from loraplex.ops.triton import moe_configs

    full = tm.candidates

    def reduced(*a, **kw):
        return [c for c in full(*a, **kw) if c["num_stages"] in (3, 4)]

    tm.candidates = reduced
    try:
        for name in harness.moe_configs():
            e, h, i, k = harness.model_shape(name).expert_shape()
            tm.tune(e, h, i, k, torch.bfloat16, token_counts, config_dir)
    finally:
        tm.candidates = full
    moe_configs.load_configs.cache_clear()


def decode_lora(name: str, layers=6, t=16, slots=16, rank=16) -> list[dict]:
    """Expert adapters in a decode step, us per layer (see the module docstring)."""
    import torch

    from loraplex import ops
    from loraplex.ops.metadata import MoELoRA

    # Engine internals: the pipeline's form switch and the per-pair kernel's tunables.
    from loraplex.ops.triton import fused_moe, moe_lora_gemv
    from loraplex.ops.triton.moe_align import align_lora
    from loraplex.ops.triton.moe_lora import moe_lora

    e, h, i, k = harness.model_shape(name).expert_shape()
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(dev).manual_seed(0)
    rows = []

    def timed(label, fn):
        us = harness.graph_ms(fn, rep=200, per=layers) * 1e3
        rows.append(dict(model=name, case=label, us_per_layer=us))
        print(f"{name:14s} {label:64s} {us:8.2f} us", flush=True)

    w_gu = [(torch.randn(e, 2 * i, h, device=dev, generator=gen) * 0.02).to(dt) for _ in range(layers)]
    w_d = [(torch.randn(e, h, i, device=dev, generator=gen) * 0.02).to(dt) for _ in range(layers)]
    loras = [MoELoRA(torch.randn(slots, e, 2 * rank, h, device=dev, dtype=dt) * 0.02,
                     torch.randn(slots, e, 2 * i, 2 * rank, device=dev, dtype=dt) * 0.02,
                     torch.randn(slots, e, rank, i, device=dev, dtype=dt) * 0.02,
                     torch.randn(slots, e, h, rank, device=dev, dtype=dt) * 0.02,
                     torch.arange(t, device=dev, dtype=torch.int32) % slots,
                     torch.ones(slots, device=dev, dtype=torch.int32),
                     torch.full((2, slots), rank, device=dev, dtype=torch.int32).mul_(
                         torch.tensor([[2], [1]], device=dev, dtype=torch.int32)))
             for _ in range(layers)]
    x = torch.randn(t, h, device=dev, generator=gen).to(dt)
    weights, ids = ops.route_experts(torch.randn(t, e, device=dev, generator=gen), k, True)

    def run(with_lora):
        for j in range(layers):
            fused_moe.fused_experts(x, weights, ids, w_gu[j], w_d[j], lora=loras[j] if with_lora else None)

    timed("base experts", lambda: run(False))
    out_gemv = fused_moe.fused_experts(x, weights, ids, w_gu[0], w_d[0], lora=loras[0])
    timed("+ adapters, per pair (auto n_split)", lambda: run(True))
    orig = moe_lora_gemv.splits_per_pair
    try:
        for ns in (1, 2):
            moe_lora_gemv.splits_per_pair = lambda *a, ns=ns: ns
            timed(f"+ adapters, per pair, n_split {ns}", lambda: run(True))
    finally:
        moe_lora_gemv.splits_per_pair = orig
    gemv_max = fused_moe.GEMV_MAX_TOKENS
    fused_moe.GEMV_MAX_TOKENS = 0
    try:
        out_aligned = fused_moe.fused_experts(x, weights, ids, w_gu[0], w_d[0], lora=loras[0])
        timed("+ adapters, aligned by (slot, expert)", lambda: run(True))
    finally:
        fused_moe.GEMV_MAX_TOKENS = gemv_max
    diff = ((out_gemv.float() - out_aligned.float()).norm() / out_aligned.float().norm()).item()
    print(f"  per pair vs aligned: rel diff {diff:.2e}")
    # Kernels alone, gate/up projection.
    p = t * k
    delta = torch.empty(p, 2 * i, device=dev, dtype=torch.float32)
    timed("  align_lora alone",
          lambda: [align_lora(ids, lo.token_slot, e, slots, 16, lo.slot_mask) for lo in loras])
    al = align_lora(ids, loras[0].token_slot, e, slots, 16, loras[0].slot_mask)
    timed("  moe_lora gate_up (aligned) alone",
          lambda: [moe_lora(x, lo.a_gate_up, lo.b_gate_up, delta, al, k, lo.ranks[0]) for lo in loras])
    # The per-pair kernel's tunables, on the gate/up and down projections alone.
    h_in = torch.randn(p, i, device=dev, dtype=dt)
    delta_d = torch.empty(p, h, device=dev, dtype=torch.float32)
    knobs = ("A_TILE", "B_TILE", "NUM_WARPS", "NUM_STAGES", "splits_per_pair")
    orig = {kn: getattr(moe_lora_gemv, kn) for kn in knobs}
    try:
        for bk, bn, warps, stages, ns in [(16384, 8192, 8, 3, None), (16384, 8192, 8, 4, None),
                                          (16384, 4096, 8, 3, None), (8192, 8192, 8, 3, None),
                                          (16384, 16384, 8, 3, None), (32768, 8192, 8, 2, None),
                                          (16384, 8192, 4, 3, None), (16384, 8192, 8, 3, 2)]:
            for kn, v in zip(knobs, (bk, bn, warps, stages, orig["splits_per_pair"] if ns is None else
                                     (lambda *a, ns=ns: ns))):
                setattr(moe_lora_gemv, kn, v)
            tag = f"A{bk} B{bn} w{warps} stages {stages} split {ns or 'auto'}"
            try:
                gemv = moe_lora_gemv.moe_lora_gemv
                timed(f"  moe_lora_gemv gate_up alone {tag}",
                      lambda: [gemv(x, ids, lo.token_slot, lo.slot_mask, lo.ranks[0], lo.a_gate_up,
                                    lo.b_gate_up, delta, k) for lo in loras])
                timed(f"  moe_lora_gemv down alone {tag}",
                      lambda: [gemv(h_in, ids, lo.token_slot, lo.slot_mask, lo.ranks[1], lo.a_down,
                                    lo.b_down, delta_d, 1) for lo in loras])
            except Exception as exc:  # e.g. out of shared memory
                print(name, tag, type(exc).__name__, exc)
    finally:
        for kn, v in orig.items():
            setattr(moe_lora_gemv, kn, v)
    return rows


def prefill_quant(name: str, token_counts: list[int]) -> list[dict]:
    """Quantized experts at prompt sizes, both forms (see the module docstring), ms a layer."""
    import torch

    from loraplex import ops

    # Engine internals: the form switch, the dequantization kernel, the dummy quantizer.
    from loraplex.ops.formats import Fp8Weight, Mxfp4Weight
    from loraplex.ops.formats.checkpoint import init_quantized
    from loraplex.ops.triton import fused_experts, moe_configs
    from loraplex.ops.triton.dequantize import dequantize

    e, h, i, k = harness.model_shape(name).expert_shape()
    dev, dt, fmt = "cuda", torch.bfloat16, QUANT_FORMATS[name]
    gen = torch.Generator(dev).manual_seed(0)

    def quantized(shape):
        w = Mxfp4Weight(shape, dt, device=dev) if fmt == "mxfp4" else Fp8Weight(shape, 128, dt, device=dev)
        init_quantized(w, 0.02, gen)
        return w

    q_gu, q_d = quantized((e, 2 * i, h)), quantized((e, h, i))
    w_gu, w_d = dequantize(q_gu), dequantize(q_d)
    act, limit = ("swiglu_oai", 7.0) if name == "gpt-oss-20b" else ("silu", None)
    rows = []
    thresholds = moe_configs.DEQUANTIZE_MIN_PAIRS_PER_EXPERT
    saved = thresholds[fmt]
    try:
        for t in token_counts:
            x = torch.randn(t, h, device=dev, generator=gen).to(dt)
            weights, ids = ops.route_experts(torch.randn(t, e, device=dev, generator=gen), k, True)

            def timed(w1, w2, threshold):
                thresholds[fmt] = threshold
                return harness.events_ms(
                    lambda: fused_experts(x, weights, ids, w1, w2, act, swiglu_limit=limit), repeats=10)

            row = dict(model=name, format=fmt, tokens=t, bf16_ms=timed(w_gu, w_d, saved),
                       quantized_gemm_ms=timed(q_gu, q_d, 1 << 30), dequantized_ms=timed(q_gu, q_d, 0),
                       dequantize_alone_ms=harness.events_ms(lambda: (dequantize(q_gu), dequantize(q_d)),
                                                             repeats=10))
            rows.append(row)
            print(f"{name} {fmt} T={t}: bf16 {row['bf16_ms']:.3f} ms, quantized GEMM "
                  f"{row['quantized_gemm_ms']:.3f}, dequantized + bf16 GEMM {row['dequantized_ms']:.3f} "
                  f"(dequantize alone {row['dequantize_alone_ms']:.3f})", flush=True)
    finally:
        thresholds[fmt] = saved
    # The dequantization kernel's tile (rows x columns a program) and warps (its module:
    # ops.triton's `dequantize` attribute is the function).
    dq = importlib.import_module("loraplex.ops.triton.dequantize")

    default = dq.TILES[fmt]
    try:
        for tile in ((16, 256, 4), (32, 256, 4), (16, 512, 4), (32, 512, 8), (64, 256, 8), (8, 1024, 4),
                     (64, 512, 8), (16, 1024, 8), (4, 1024, 4), (2, 2048, 4), (4, 2048, 8)):
            dq.TILES[fmt] = tile
            ms = harness.events_ms(lambda: (dequantize(q_gu), dequantize(q_d)), repeats=10)
            rows.append(dict(model=name, format=fmt, dequantize_tile=tile, dequantize_ms=ms))
            print(f"{name} {fmt} dequantize, BLOCK_R x BLOCK_K x warps {tile}: {ms:.3f} ms", flush=True)
    finally:
        dq.TILES[fmt] = default
    return rows


ROUTER_CONFIGS = [(e, kc, w) for e in (4, 8, 16) for kc in (512, 1024, 2048) for w in (4, 8)]


def router(name: str, tokens: list[int], routers: int = 400) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from loraplex.ops.triton import moe_route_gemv
    from loraplex.ops.triton.moe_route import route_experts

    shape = harness.model_shape(name)
    e, h, k = shape.experts, shape.hidden, shape.top_k
    biased = name.startswith("gpt-oss")  # gpt-oss's router has a bias, Qwen3-MoE's none
    dev, dt = "cuda", torch.bfloat16
    ws = [(torch.randn(e, h, device=dev) * 0.02).to(dt) for _ in range(routers)]
    bs = [(torch.randn(e, device=dev) * 0.02).to(dt) if biased else None for _ in range(routers)]
    rows, default = [], (moe_route_gemv.BLOCK_E, moe_route_gemv.BLOCK_K, moe_route_gemv.NUM_WARPS)
    for t in [t for t in tokens if t <= moe_route_gemv.MAX_TOKENS]:
        x = torch.randn(t, h, device=dev).to(dt)
        want = [route_experts(F.linear(x, w, b), k, True) for w, b in zip(ws[:4], bs[:4])]
        gemm = harness.graph_ms(lambda: [route_experts(F.linear(x, w, b), k, True) for w, b in zip(ws, bs)],
                                per=routers) * 1e3
        print(f"{name} router, {t} tokens: GEMM + route_experts {gemm:.2f} us", flush=True)
        rows.append(dict(model=name, tokens=t, path="gemm", us=gemm))
        try:
            for cfg in ROUTER_CONFIGS:
                moe_route_gemv.BLOCK_E, moe_route_gemv.BLOCK_K, moe_route_gemv.NUM_WARPS = cfg
                got = [moe_route_gemv.route_tokens_gemv(x, w, b, k, True) for w, b in zip(ws[:4], bs[:4])]
                same = sum(int(torch.equal(g[1].sort(-1).values, r[1].sort(-1).values))
                           for g, r in zip(got, want))  # bf16 logits may round apart at a tie
                us = harness.graph_ms(lambda: [moe_route_gemv.route_tokens_gemv(x, w, b, k, True)
                                               for w, b in zip(ws, bs)], per=routers) * 1e3
                print(f"  experts a program x K chunk x warps {cfg}: {us:.2f} us "
                      f"({same}/4 routings as the GEMM's)", flush=True)
                rows.append(dict(model=name, tokens=t, path="one kernel", config=cfg, us=us, same=same))
        finally:
            moe_route_gemv.BLOCK_E, moe_route_gemv.BLOCK_K, moe_route_gemv.NUM_WARPS = default
    return rows


def align(name: str, tokens: list[int], calls: int = 50) -> list[dict]:
    import torch

    from loraplex.ops.triton import moe_align

    shape = harness.model_shape(name)
    e, k, slots = shape.experts, shape.top_k, 8
    gen = torch.Generator("cuda").manual_seed(0)
    rows, default = [], moe_align.ONE_PROGRAM_MAX_PAIRS

    def segments(al):  # (group, pair) of every placed pair, sorted: what both forms must agree on
        ids = al.sorted_ids.view(-1, al.block_m)
        group = al.block_groups[:, None].expand_as(ids).long()
        placed = ids < al.num_pairs
        return torch.sort(group[placed] * (al.num_pairs + 1) + ids[placed]).values

    for t in tokens:
        ids = torch.stack([torch.randperm(e, device="cuda", generator=gen)[:k] for _ in range(t)]).int()
        token_slot = torch.randint(0, slots, (t,), device="cuda", generator=gen, dtype=torch.int32)
        block_m = 16 if t * k <= 4 * e else 64
        cases = {"experts": lambda: moe_align.align_experts(ids, e, block_m),
                 "slot x expert": lambda: moe_align.align_lora(ids, token_slot, e, slots, block_m)}
        for label, fn in cases.items():
            row = dict(model=name, tokens=t, pairs=t * k, groups=label, block_m=block_m)
            try:
                outs = []
                for form, limit in (("one program", 1 << 30), ("parallel", 0)):
                    moe_align.ONE_PROGRAM_MAX_PAIRS = limit
                    outs.append(segments(fn()))
                    row[form] = harness.graph_ms(lambda: [fn() for _ in range(calls)], per=calls) * 1e3
            finally:
                moe_align.ONE_PROGRAM_MAX_PAIRS = default
            row["same"] = bool(torch.equal(*outs))
            rows.append(row)
            print(f"{name} align by {label}, {t} tokens ({t * k} pairs, BLOCK_M {block_m}): one program "
                  f"{row['one program']:.1f} us, parallel {row['parallel']:.1f} us, same segments: "
                  f"{row['same']}", flush=True)
    return rows


def build_parser():
    p = harness.parser(__doc__)
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 2048], help="layer: token counts")
    p.add_argument("--tune", type=int, nargs="*", default=None, help="layer: token counts to tune first")
    p.add_argument("--config-dir", type=Path, default=None,
                   help="MoE GEMM configs to read (LORAPLEX_MOE_CONFIG_DIR) and, with --tune, write")
    harness.add_floor_arguments(p, bandwidth=None)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.tune and not args.config_dir:
        raise SystemExit("--tune needs --config-dir (where the tuned configs go)")
    if args.config_dir:
        os.environ["LORAPLEX_MOE_CONFIG_DIR"] = str(args.config_dir)
    import torch

    bandwidth = harness.floors(args).bandwidth
    results = {}
    if "layer" in args.sections:
        results["layer"] = [layer_case(name, t, bandwidth)
                            for name in harness.moe_configs() for t in args.tokens]
        if args.tune:
            tune(args.tune, args.config_dir)
            print("tuned:")
            results["layer_tuned"] = [layer_case(name, t, bandwidth)
                                      for name in harness.moe_configs() for t in args.tokens]
    if "decode-lora" in args.sections:
        torch.manual_seed(0)
        results["decode_lora"] = []
        for name in harness.moe_configs():
            results["decode_lora"] += decode_lora(name)
            torch.cuda.empty_cache()
    if "prefill-quant" in args.sections:
        results["prefill_quant"] = []
        for name in QUANT_FORMATS:
            results["prefill_quant"] += prefill_quant(name, args.tokens)
            torch.cuda.empty_cache()
    if "router" in args.sections:
        results["router"] = []
        for name in harness.moe_configs():
            results["router"] += router(name, args.tokens)
    if "align" in args.sections:
        results["align"] = [row for name in harness.moe_configs() for row in align(name, args.tokens)]
    harness.write_json(args.out, results, args)


if __name__ == "__main__":
    main()
