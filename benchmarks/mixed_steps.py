"""A mixed step (prompt chunks + decodes) run eagerly and from CUDA graphs, on the device.

For token counts T, a plan of prompt chunks (up to 512 tokens each) plus 28 one-token
decodes on 600-token contexts, the way a serving step with new arrivals looks; device
time per step (CUDA events around launch + collect, median of --reps) for: eager; the
graph of T's padded bucket; and a graph captured for exactly T tokens (what padding
costs). No sampling: the forward only.

    python -m benchmarks.mixed_steps --tokens 512 1024 1488 2048
    python -m benchmarks.mixed_steps --tokens $(seq 1024 16 2048) --eager-only
    python -m benchmarks.mixed_steps --tokens 1488 1536 --profile   # kernels by device time

Llama-3.1-8B (a bundled config) on dummy weights, no adapters.

Figure: benchmarks/RESULTS.md, "Mixed steps" (eager, graph of the bucket, graph of
exactly that size).
"""

from __future__ import annotations

import math
import random

from benchmarks import harness


def mixed_plan(num_tokens: int, decodes: int, block_size: int, context: int = 600, vocab: int = 128000):
    """A StepPlan of `decodes` one-token decodes on `context`-token contexts plus prompt
    chunks of up to 512 tokens, `num_tokens` in all. Random token ids, as a serving step
    has: a step of one repeated token feeds the GEMMs identical rows, which toggle fewer
    bits and draw less power; on a power-capped H200 it ran 12-19% faster than on random
    tokens (benchmarks/LOG.md, "The power cap sets the prefill rate")."""
    from loraplex import SamplingParams

    # Engine internal: the scheduler -> runner contract.
    from loraplex.types import ScheduledChunk, StepPlan

    sp = SamplingParams(temperature=0, max_tokens=1)
    chunks, next_block = [], 0
    rng = random.Random(num_tokens)

    def chunk(i, n, start):
        nonlocal next_block
        pages = math.ceil((start + n) / block_size)
        c = ScheduledChunk(request_id=f"p{i}", token_ids=[rng.randrange(vocab) for _ in range(n)],
                           start_pos=start, block_ids=list(range(next_block, next_block + pages)),
                           lora_slot=-1, sample=False, sampling=sp, num_output_tokens=0)
        next_block += pages
        return c

    for i in range(decodes):
        chunks.append(chunk(f"d{i}", 1, context))
    left, i = num_tokens - decodes, 0
    while left > 0:
        n = min(512, left)
        chunks.append(chunk(i, n, 0))
        left, i = left - n, i + 1
    return StepPlan(chunks=chunks)


def device_ms(runner, plan, reps: int) -> float:
    """Median device ms of launching and collecting `plan` (CUDA events around both)."""
    return harness.events_ms(lambda: runner.collect(runner.launch(plan)), repeats=reps, warmup=2)


def print_kernels(runner, plan, tokens: int, reps: int = 4) -> None:
    """Device time of one eager step by kernel name (torch.profiler over `reps` steps)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            runner.collect(runner.launch(plan))
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in rows) / reps / 1e3
    print(f"-- {tokens} tokens, eager: {total:.2f} ms of kernels per step")
    for e in rows[:14]:
        print(f"   {e.self_device_time_total / reps / 1e3:7.3f} ms  {e.count // reps:4d}x  {e.key[:100]}")


def build_parser():
    p = harness.parser(__doc__)
    p.add_argument("--model", default="llama-3.1-8b", help="a bundled config (default: %(default)s)")
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 1488, 2048])
    p.add_argument("--decodes", type=int, default=28)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--blas", default=None, choices=["cublas", "cublaslt"],
                   help="the BLAS library of the eager and exact-size runs (graphs of the "
                        "buckets keep the engine's, chosen at capture)")
    p.add_argument("--eager-only", action="store_true", help="time eager steps only (a fine sweep)")
    p.add_argument("--profile", action="store_true", help="print each eager step's kernels by device time")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    import torch

    from loraplex import ops

    # Engine internals: the runner's graphs, input buffers and graph shapes.
    from loraplex.runner.batch_meta import GraphShape
    from loraplex.runner.cuda_graphs import StepGraphs

    llm, _ = harness.dummy_llm(args.model, args.cache_dir, enable_lora=False, max_num_seqs=64,
                               max_num_batched_tokens=2048, max_model_len=2048)
    runner = llm.engine.runner
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    graphs, bs = runner.graphs, llm.config.cache.block_size
    results = {}
    for t in args.tokens:
        plan = mixed_plan(t, args.decodes, bs)
        runner.graphs = None
        eager = device_ms(runner, plan, args.reps)
        if args.profile:
            print_kernels(runner, plan, t)
        runner.graphs = graphs
        if args.eager_only:
            results[t] = dict(eager=eager)
            print(f"{t} tokens: eager {eager:.2f} ms", flush=True)
            continue
        longest = max(c.num_tokens for c in plan.chunks)
        bucket = graphs.shape_for(t, len(plan.chunks), longest)
        padded = device_ms(runner, plan, args.reps)
        exact = StepGraphs(runner.model, runner.inputs, 1, None, False)
        exact.decode_sizes, exact.mixed_sizes = [], [t]
        with ops.using_backend("triton"):
            exact.capture()
        runner.graphs = exact
        want = GraphShape(t, runner.inputs.mixed_graph_seqs, None)
        assert exact.shape_for(t, len(plan.chunks), longest) == want
        exact_ms = device_ms(runner, plan, args.reps)
        runner.graphs = graphs
        del exact
        results[t] = dict(eager=eager, bucket=bucket.tokens, graph_bucket=padded, graph_exact=exact_ms)
        print(f"{t} tokens ({len(plan.chunks)} seqs): eager {eager:.2f} ms, graph of {bucket.tokens} "
              f"{padded:.2f} ms, graph of exactly {t} {exact_ms:.2f} ms", flush=True)
    harness.write_json(args.out, results, args)


if __name__ == "__main__":
    main()
