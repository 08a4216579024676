"""Where a decode step's time goes: wall time per engine step vs. GPU time of the graph
replay alone, and the per-kernel breakdown of the replay (torch.profiler).

    python benchmarks/profile_decode.py [--model llama-3.1-8b] [--batch 32] [--adapters 32]
"""

from __future__ import annotations

import argparse
import time

import torch
from decode_batch import add_arguments, make_engine, start_decode


def step_parts(engine, runner, steps: int) -> dict[str, float]:
    """Device time of each part of a step (events around the runner's calls; the graph
    replay, the logits, the sampling, and the input uploads before them), ms per step."""
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

    saved = [wrap(runner.inputs, "prepare", "inputs"), wrap(runner, "_feed_pending_tokens", "feed tokens"),
             wrap(runner.model, "compute_logits", "logits (LM head)"),
             wrap(model_runner, "sample", "sampling")]
    if runner.graphs is not None:
        saved.append(wrap(runner.graphs, "replay", "graph"))
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    first.record()
    for _ in range(steps):
        engine.step()
    last.record()
    torch.cuda.synchronize()
    for owner, name, fn in saved:
        setattr(owner, name, fn)
    parts = {part: sum(a.elapsed_time(b) for a, b in pairs) / steps for part, pairs in spans.items()}
    parts["whole step"] = first.elapsed_time(last) / steps
    return parts


def main():
    p = argparse.ArgumentParser()
    add_arguments(p)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: the profiler then sees every kernel of the step")
    args = p.parse_args()

    engine, runner, loras = make_engine(args, enforce_eager=args.enforce_eager)
    for label, use in [("base", False), (f"{args.adapters} adapters", True)]:
        start_decode(engine, label, args.batch, args.prompt_len, loras if use else [], 3 * args.steps + 60)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall = (time.perf_counter() - t0) / args.steps * 1e3

        if runner.graphs is not None:
            size = runner.graphs.shape_for(args.batch, args.batch)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            runner.graphs.replay(size, use)
            start.record()
            for _ in range(20):
                runner.graphs.replay(size, use)
            end.record()
            torch.cuda.synchronize()
            gpu = start.elapsed_time(end) / 20
            print(f"[{label}] engine step {wall:.3f} ms wall; graph replay {gpu:.3f} ms GPU; "
                  f"other (CPU + sampling + logits) {wall - gpu:.3f} ms")
        else:
            print(f"[{label}] engine step {wall:.3f} ms wall (eager)")
        print(f"[{label}] device ms per step by part: " + ", ".join(
            f"{part} {ms:.3f}" for part, ms in step_parts(engine, runner, args.steps).items()))

        import cProfile
        import pstats

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
        for r in list(engine.scheduler.running) + list(engine.scheduler.waiting):
            engine.abort_request(r.request_id)


if __name__ == "__main__":
    main()
