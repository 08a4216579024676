"""Where a decode step's time goes: wall time per engine step against the device time of
its CUDA-graph replay alone, the device time of each part of a step (graph, LM head,
sampling, input uploads with the token feed), a host profile (cProfile), the kernels of the
step (torch.profiler) and the timeline of one decoder layer's kernels as they ran in a
real step's graph (start, duration, stream: what overlaps on the side streams, and what
waits); without adapters, then with them.

    python -m benchmarks.profile_decode [--model llama-3.1-8b] [--batch 32] [--adapters 32] \
        [--quantization fp8 --expert-adapters] [--trace-dir DIR]

An engine on dummy weights (a bundled config), `--batch` requests of `--prompt-len`
tokens (request i on adapter i mod N), stepped into their decode phase first.

Figure: benchmarks/RESULTS.md, "One decode step" (graph replay, parts of a step).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from benchmarks import harness


def step_parts(engine, runner, steps: int) -> dict[str, float]:
    """Device time of each part of a step (events around the runner's calls; the graph
    replay, the logits, the sampling, and the input uploads before them), ms per step."""
    import torch

    from loraplex.runner import model_runner

    spans: dict[str, list] = {}

    def wrap(owner, name, part):
        fn = getattr(owner, name)

        def timed(*a, **k):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*a, **k)
            end.record()
            spans.setdefault(part, []).append((start, end))
            return out

        setattr(owner, name, timed)
        return owner, name, fn

    # Engine internals: the runner's input buffers (the pending tokens' feed among them),
    # LM head, sampler and graphs.
    saved = [wrap(runner.inputs, "prepare", "inputs"),
             wrap(runner.model, "compute_logits", "logits (LM head)"),
             wrap(model_runner, "sample", "sampling")]
    if runner.graphs is not None:
        saved.append(wrap(runner.graphs, "replay", "graph"))
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        torch.cuda.synchronize()
        first.record()
        for _ in range(steps):
            engine.step()
        last.record()
        torch.cuda.synchronize()
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    parts = {part: sum(a.elapsed_time(b) for a, b in pairs) / steps for part, pairs in spans.items()}
    parts["whole step"] = first.elapsed_time(last) / steps
    return parts


def layer_timeline(events: list[dict], anchor: str, steps: int) -> list[dict]:
    """One decoder layer's kernels from a Chrome trace's events (torch.profiler over
    `steps` engine steps): those from an occurrence of the `anchor` kernel (one per
    layer) to the next, in the middle of the last step; each as {"start_us" (from the
    first), "us", "stream", "name"}."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    marks = [i for i, e in enumerate(kernels) if anchor in e["name"]]
    per_step = len(marks) // max(1, steps)
    if per_step < 2:
        return []
    first = marks[(steps - 1) * per_step + per_step // 2 - 1]
    last = marks[(steps - 1) * per_step + per_step // 2]
    t0 = kernels[first]["ts"]
    return [{"start_us": round(e["ts"] - t0, 1), "us": round(e["dur"], 1),
             "stream": e.get("args", {}).get("stream"), "name": e["name"].split("(")[0].split("<")[0][:60]}
            for e in kernels[first:last]]


def build_parser():
    p = harness.parser(__doc__)
    harness.add_engine_arguments(p)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: the profiler then sees every kernel of the step")
    p.add_argument("--timeline-anchor", default="_write_kv",
                   help="a kernel that runs once per decoder layer; the timeline runs from one to the next "
                   "(default: %(default)s)")
    p.add_argument("--trace-dir", default=None, help="also keep the Chrome traces here")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    import cProfile
    import pstats

    import torch

    engine, runner, loras = harness.decode_engine(args, enforce_eager=args.enforce_eager)
    results = {}
    for label, use in [("base", False), (f"{args.adapters} adapters", True)]:
        harness.start_decode(engine, label, args.batch, args.prompt_len, loras if use else [],
                             3 * args.steps + 60)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps * 1e3
        run = {"engine_step_ms": wall}
        if runner.graphs is not None:
            size = runner.graphs.shape_for(args.batch, args.batch, 1)
            router = harness.router_lora(runner)
            gpu = harness.events_ms(lambda: runner.graphs.replay(size, use, router), repeats=20)
            run["graph_replay_ms"] = gpu
            print(f"[{label}] engine step {wall:.3f} ms wall; graph replay {gpu:.3f} ms GPU; "
                  f"other (CPU + sampling + logits) {wall - gpu:.3f} ms")
        else:
            print(f"[{label}] engine step {wall:.3f} ms wall (eager)")
        run["parts_ms"] = step_parts(engine, runner, args.steps)
        print(f"[{label}] device ms per step by part: " + ", ".join(
            f"{part} {ms:.3f}" for part, ms in run["parts_ms"].items()))

        cpu = cProfile.Profile()
        cpu.enable()
        for _ in range(20):
            engine.step()
        cpu.disable()
        pstats.Stats(cpu).sort_stats("tottime").print_stats(14)

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                engine.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=32, max_name_column_width=70))
        trace_dir = Path(args.trace_dir or tempfile.mkdtemp())
        trace_dir.mkdir(parents=True, exist_ok=True)
        trace = trace_dir / f"decode-{args.model}-{'adapters' if use else 'base'}.json"
        prof.export_chrome_trace(str(trace))
        run["layer_timeline"] = layer_timeline(json.loads(trace.read_text())["traceEvents"],
                                               args.timeline_anchor, 3)
        print(f"[{label}] one decoder layer, kernels as they ran (us from the first; stream):")
        for k in run["layer_timeline"]:
            print(f"  +{k['start_us']:7.1f} {k['us']:6.1f}  s{k['stream']!s:>5}  {k['name']}")
        if args.trace_dir is None:
            trace.unlink()
        results[label] = run
        harness.abort_all(engine)
    harness.write_json(args.out, results, args)


if __name__ == "__main__":
    main()
