"""Which kernels one step of prompt tokens runs on the device, and for how long.

An engine on dummy weights (a bundled config, as `loraplex bench` builds it) admits
`--batch` requests of `--prompt-len` random tokens, first without adapters, then each on
its own random adapter; the steps until each has its first token (one step
when the prompts fit the step's token budget) run under torch.profiler after a warm-up
round of the same shape, and the top kernels by device time are printed.

    python -m benchmarks.prefill_kernels --model deepseek-v2-lite --batch 4 --prompt-len 1600 \
        --adapters 16 --expert-adapters --lora-targets q_proj kv_a_proj_with_mqa kv_b_proj o_proj \
        gate_proj up_proj down_proj

Figure: benchmarks/RESULTS.md, "DeepSeek-V2-Lite, 16 adapters" (a prompt step's kernels).
"""

from __future__ import annotations

from benchmarks import harness


def profiled_step(engine, loras, label: str, batch: int, prompt_len: int, top: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from loraplex import SamplingParams

    sp = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    rows = {}
    for rep in range(2):  # the first loads the adapters, compiles and warms up
        for i in range(batch):
            prompt = torch.randint(1000, 30000, (prompt_len,), generator=g).tolist()
            engine.add_request(f"{label}-{rep}-{i}", prompt, sp, loras[i % len(loras)] if loras else None)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            steps = 0
            while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
                engine.step()
                steps += 1
            torch.cuda.synchronize()
        harness.abort_all(engine, drain=True)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.self_device_time_total for e in events) / 1e3
    print(f"\n[{label}] {batch} x {prompt_len} prompt tokens in {steps} step(s): {total:.2f} ms of kernels")
    for e in events[:top]:
        ms = e.self_device_time_total / 1e3
        rows[e.key] = ms
        print(f"  {ms:8.3f} ms {e.count:6d}  {e.key[:90]}")
    return {"kernel_ms": total, "steps": steps, "top": rows}


def main(argv=None):
    p = harness.parser(__doc__)
    harness.add_engine_arguments(p, model="deepseek-v2-lite", batch=4, adapters=16, prompt_len=1600)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    engine, _, loras = harness.decode_engine(args)
    results = {"base": profiled_step(engine, [], "base", args.batch, args.prompt_len, args.top)}
    if args.adapters:
        label = f"{args.adapters} adapters"
        results[label] = profiled_step(engine, loras, label, args.batch, args.prompt_len, args.top)
    harness.write_json(args.out, results, args)


if __name__ == "__main__":
    main()
