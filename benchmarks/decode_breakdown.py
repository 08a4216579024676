"""Where one decode step's GPU time goes, op by op.

The runner's decode CUDA graph for the batch is timed as it is; then the same forward is
captured again with timing events (recorded inside the graph) around every `ops.*` call,
every MoE pipeline stage and every projection, replayed, and the time between each pair
summed per kind. The events add a little time of their own: compare their total with
the plain graph's.

    python -m benchmarks.decode_breakdown --model qwen3-30b-a3b --batch 16 --prompt-len 1600 \
        --adapters 16 --expert-adapters [--routing-stats]

An engine on dummy weights (a bundled config), `--batch` requests of `--prompt-len`
tokens stepped into their decode phase, without adapters, then with them.

Figure: benchmarks/RESULTS.md, "A decode step op by op".
"""

from __future__ import annotations

from collections import defaultdict

from benchmarks import harness

OPS = ("write_kv_cache", "paged_attention", "rms_norm", "add_rms_norm", "rotary_embedding",
       "rotate_and_store", "route_experts", "route_tokens", "fused_experts", "lora_shrink", "lora_expand",
       "silu_and_mul", "gelu_tanh_and_mul", "write_latent_cache", "mla_attention", "route_experts_grouped")
BLOCKS = ("SelfAttention", "LatentSelfAttention", "SparseMoE", "SharedExpertsMoE", "GatedMLP")
MOE_STAGES = ("align_experts", "align_lora", "moe_gemm", "moe_gemm_quant", "moe_gemv_quant", "moe_lora_gemv",
              "moe_lora")


class Marks:
    """(name, start, end) timing events recorded on the current stream during capture."""

    def __init__(self):
        self.marks: list[tuple] = []

    @staticmethod
    def _event():
        import torch

        return torch.cuda.Event(enable_timing=True, external=True)

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            start, end = self._event(), self._event()
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self.marks.append((name, start, end))
            return out
        return timed

    def hook_module(self, module, name):
        state = {}

        def pre(mod, args):
            state["start"] = self._event()
            state["start"].record()

        def post(mod, args, out):
            end = self._event()
            end.record()
            self.marks.append((name, state.pop("start"), end))
        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


def patched(targets):
    """Replace module attributes; returns an undo list."""
    undo = []
    for mod, name, new in targets:
        undo.append((mod, name, getattr(mod, name)))
        setattr(mod, name, new)
    return undo


def breakdown(runner, shape, use: bool, refill, replays: int = 20) -> dict:
    """The runner's decode forward for `shape` captured again with events around every op,
    MoE stage and projection; ms per step of each, summed over its calls."""
    import torch

    from loraplex import ops
    from loraplex.layers.context import ForwardContext, forward_context
    from loraplex.layers.linear import LoRALinear
    from loraplex.ops.triton import fused_moe

    marks = Marks()
    # Engine internals: the runner's graph inputs, streams, MoE stats and model; the
    # module names of the blocks.
    with torch.inference_mode(), ops.using_backend(runner.config.ops_backend):
        step = runner.inputs.graph_inputs(shape, use)
        ctx = ForwardContext(attn=step.attn, lora=step.lora, aux_stream=runner.aux_stream,
                             moe_stats=runner.moe_stats, router_lora=harness.router_lora(runner))
        with forward_context(ctx):
            runner.model(step.input_ids, step.positions)  # warm-up, unmarked
            torch.cuda.synchronize()
            undo = patched([(ops, n, marks.wrap(n, getattr(ops, n))) for n in OPS]
                           + [(fused_moe, n, marks.wrap("moe." + n, getattr(fused_moe, n)))
                              for n in MOE_STAGES])
            hooks = []
            for name, module in runner.model.named_modules():
                if isinstance(module, LoRALinear):
                    hooks += marks.hook_module(module, "linear." + "+".join(module.slice_names))
                elif type(module).__name__ in BLOCKS:
                    hooks += marks.hook_module(module, "block." + type(module).__name__)
                elif name.endswith(".layers.0"):
                    hooks += marks.hook_module(module, "one decoder layer (the first)")
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    runner.model(step.input_ids, step.positions)
            finally:
                for h in hooks:
                    h.remove()
                patched(undo)
    refill()  # graph_inputs padded the buffers: a real step fills them again
    total = harness.events_ms(graph.replay, repeats=50)
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        for name, s, e in marks.marks:
            sums[name] += s.elapsed_time(e) / replays
    for name, _, _ in marks.marks:
        counts[name] += 1
    order = sorted(sums, key=lambda k: -sums[k])
    return {"graph_with_events_ms": total,
            "ops": {n: {"ms_per_step": sums[n], "calls": counts[n],
                        "us_per_call": 1e3 * sums[n] / counts[n]} for n in order}}


def build_parser():
    p = harness.parser(__doc__)
    harness.add_engine_arguments(p)
    p.add_argument("--gemv-pairs-per-expert", type=float, default=None,
                   help="quantized experts: take the GEMV form up to this many pairs per expert")
    p.add_argument("--down-delta-in-epilogue", action="store_true",
                   help="MoE adapters: add the down delta in the down GEMM's epilogue (after its kernel) "
                        "instead of as terms of the top-k sum (its kernel beside the GEMM)")
    p.add_argument("--gate-up-delta-first", action="store_true",
                   help="MoE adapters in decode, W8A8 experts: the gate/up delta's kernel runs before the "
                        "gate/up GEMM, whose epilogue adds it, instead of beside the GEMM (then added with "
                        "the activation), as for other formats")
    p.add_argument("--gate-up-delta-beside", action="store_true",
                   help="MoE adapters in decode: the gate/up delta's kernel beside the gate/up GEMM for "
                        "every expert format (by default W8A8 alone: fused_moe.gate_up_delta_beside)")
    p.add_argument("--expert-lora-gemv", type=int, nargs=3, default=None,
                   metavar=("WARPS", "A_TILE", "B_TILE"),
                   help="the decode expert-LoRA kernel's warps and tile sizes (elements: moe_lora_gemv.py), "
                        "e.g. a lighter program to run beside an issue-bound GEMM")
    p.add_argument("--lora-min-split-k", type=int, default=None,
                   help="FP8 projections with adapters in decode: split K at least this many ways (the "
                        "LoRA expand joins the split-K sum); 1: the tuned split as it is")
    p.add_argument("--sparse-expert-deltas", action="store_true",
                   help="MoE adapters in decode: the delta kernels write only covered pairs' rows and the "
                        "expert GEMMs load each pair's slot and mask before its row (the aligned form's way)")
    p.add_argument("--operands-after-loop", action="store_true",
                   help="expert GEMMs: load bias, routing weights and deltas after the main loop, "
                        "even where no dependent chain precedes them")
    p.add_argument("--unpadded-scales", action="store_true",
                   help="MXFP4 experts: scale rows stored unpadded, read with a mask along K (byte loads "
                        "outside the K loop's pipeline) instead of whole steps of padded rows")
    p.add_argument("--unpaired-int4-scales", action="store_true",
                   help="int4 weights: the bf16x2 decode loads each group's scale and zero as two 2-byte "
                        "values (outside the K loop's pipeline) instead of one paired word")
    p.add_argument("--router-gemm", action="store_true",
                   help="MoE routers: the router's projection (cuBLAS), then route_experts, instead of "
                        "logits and routing in one kernel (ops.route_tokens)")
    p.add_argument("--unfused-rotary", action="store_true",
                   help="attention: the rotary op and the KV write as two launches instead of "
                        "ops.rotate_and_store's one")
    p.add_argument("--random-prompts", action="store_true",
                   help="random prompt tokens (MoE: routing spread as in serving) instead of one repeated")
    p.add_argument("--routing-stats", action="store_true",
                   help="MoE: count distinct experts per step in the graphs, as `loraplex bench` does")
    p.add_argument("--without-activation-quant", action="store_true",
                   help="W8A8: the graphs without the activations' quantization launches left (o_proj's "
                        "and the experts' down inputs; the norms write the others): each replays its first "
                        "result, wrong values, the bound of fusing them away")
    return p


def without_activation_quant() -> None:
    """Each W8A8 quantization of activations returns, for its shape, the rows and scales
    it first computed (eagerly, at warm-up), so the captured graphs launch none: what a
    step would take with the quantization fused into the kernels that write the
    activations. The outputs are wrong (stale e4m3 rows, finite); routing reads the bf16
    rows and stays as in serving. (The GEMMs quantize through fp8_activations.fp8_rows;
    attention's prompt steps call the quantizer themselves.)"""
    import importlib

    from loraplex.ops.formats import Fp8Rows
    from loraplex.ops.triton import fp8_activations

    attention = importlib.import_module("loraplex.ops.triton.paged_attention")  # the module, not the op
    first = fp8_activations.quantize_activations
    cache = {}

    def replay_first(x, block):
        key = (tuple(x.shape), block, x.dtype, x.device)
        if key not in cache:
            q, scale = first(x, block)
            cache[key] = Fp8Rows(q.clone(), scale.clone())
        return cache[key]
    fp8_activations.quantize_activations = attention.quantize_activations = replay_first


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.expert_lora_gemv and any(v < 1 or v & (v - 1) for v in args.expert_lora_gemv):
        parser.error(f"--expert-lora-gemv takes powers of 2 (warps, tile elements), "
                     f"got {args.expert_lora_gemv}")
    import torch

    from loraplex.ops.triton import fused_moe

    if args.gemv_pairs_per_expert is not None:
        fused_moe.GEMV_PAIRS_PER_EXPERT = args.gemv_pairs_per_expert
    if args.without_activation_quant:
        without_activation_quant()
    if args.lora_min_split_k is not None:
        from loraplex.ops.triton import fp8_gemm
        fp8_gemm.LORA_MIN_SPLIT_K = args.lora_min_split_k
    if args.down_delta_in_epilogue:
        fused_moe.DOWN_DELTA_AS_TERMS = False
    if args.gate_up_delta_first:
        fused_moe.GATE_UP_DELTA_BESIDE_GEMM = False
    if args.gate_up_delta_beside:
        fused_moe.gate_up_delta_beside = lambda w, num_tokens: True
    if args.expert_lora_gemv:
        from loraplex.ops.triton import moe_lora_gemv
        moe_lora_gemv.NUM_WARPS, moe_lora_gemv.A_TILE, moe_lora_gemv.B_TILE = args.expert_lora_gemv
    if args.sparse_expert_deltas:
        fused_moe.GEMV_DELTAS_EVERY_ROW = False
    if args.operands_after_loop:
        from loraplex.ops.triton import moe_epilogue
        moe_epilogue.OPERANDS_BEFORE_LOOP = False
    if args.router_gemm:
        from loraplex.layers import moe
        moe.ROUTE_IN_ONE_OP = False
    if args.unfused_rotary:
        from loraplex.models import blocks
        blocks.ROTATE_AND_STORE = False
    if args.unpaired_int4_scales:
        from loraplex.ops.triton import int4_gemm
        int4_gemm._paired_words = lambda w: False
    if args.unpadded_scales:
        from loraplex.ops.formats import Mxfp4Weight
        Mxfp4Weight.SCALE_ROW_ALIGN = 1

    engine, runner, loras = harness.decode_engine(args, measure_moe_routing=args.routing_stats)
    results = {"model": args.model, "batch": args.batch, "prompt_len": args.prompt_len,
               "routing_stats": args.routing_stats, "runs": {}}
    runs = [("base", False)] + ([(f"{args.adapters} adapters", True)] if args.adapters else [])
    for label, use in runs:
        harness.start_decode(engine, label, args.batch, args.prompt_len, loras if use else [], 200,
                             random_prompts=args.random_prompts)
        torch.cuda.synchronize()
        shape = runner.graphs.shape_for(args.batch, args.batch, 1)
        router = harness.router_lora(runner)
        plain = harness.events_ms(lambda: runner.graphs.replay(shape, use, router), repeats=50)

        def refill():
            for _ in range(2):
                engine.step()
            torch.cuda.synchronize()
        run = breakdown(runner, shape, use, refill)
        run["graph_ms"] = plain
        results["runs"][label] = run
        print(f"\n[{args.model} {label}] decode graph {plain:.3f} ms; with events "
              f"{run['graph_with_events_ms']:.3f} ms")
        print(f"  {'op':44s} {'ms/step':>8s} {'calls':>6s} {'us/call':>8s}")
        for name, r in run["ops"].items():
            print(f"  {name:44s} {r['ms_per_step']:8.3f} {r['calls']:6d} {r['us_per_call']:8.2f}")
        harness.abort_all(engine, drain=True)
    harness.write_json(args.out, results, args)


if __name__ == "__main__":
    main()
