"""What the benchmark scripts share: GPU timing, model shapes, roofline floors, arguments,
JSON output, and the engine set-ups (with every read of engine internals they need).

How the suite runs: `benchmarks/` is a package. From the repository root, with loraplex
installed (or `PYTHONPATH=src`):

    python -m benchmarks.kernels --help
    python -m benchmarks.profile_decode --model llama-3.1-8b --out decode.json

A script imports this module (`from benchmarks import harness`) and never another script.
It imports torch, Triton and loraplex inside its functions, so importing it, and its
`--help`, need no GPU (tests/test_benchmarks.py imports every script on a CPU and runs
its `--help`). Its docstring says what it measures and which figure of
benchmarks/RESULTS.md it produces; it exposes `main(argv=None)`.
benchmarks/gpu_session.sh runs the suite on a GPU machine; benchmarks/LOG.md is the
dated history of the figures, RESULTS.md today's.

API:
- timing: `graph_ms(fn)` (small launches: fn captured into a CUDA graph and replayed,
  median; the figures' default), `events_ms(fn)` (eager calls or an already captured
  graph's replay, CUDA events, median), `host_us(fn)` (host time per call),
  `wall_ms(fn)` (host wall time with the device synchronized, median);
- shapes: `model_shape(name) -> ModelShape` (projections, PEFT modules, expert shape),
  from the bundled configs of `loraplex.bench.workload` (`bundled_configs()`,
  `moe_configs()`: llama-3.1-8b, qwen3-30b-a3b, gpt-oss-20b, ...);
- tensors: `projection_tensors(...)` (a projection's x, W and LoRA slot tensors);
- floors: `FLOORS` (4.3 TB/s device-to-device, 790 TFLOP/s dense bf16: measured on an
  H200), `Floors.ms(nbytes, flops)`, `SPEC_BANDWIDTH` / `spec_bandwidth()` (data-sheet
  HBM rates, for the figures that use them);
- arguments: `parser(doc)` (argparse with the common parent `common_parser()`: `--out`
  JSON path, `--cache-dir` = $LORAPLEX_BENCH_CACHE or ~/.cache/loraplex/bench),
  `add_floor_arguments(p)` with `floors(args)`, `add_engine_arguments(p)`;
- output: `write_json(path, results, args)` (results with the run's environment:
  date, commit ($LORAPLEX_BENCH_COMMIT or git's HEAD), GPU, versions), `environment()`;
- engines: `dummy_llm(model, cache_dir, **kw)`, `random_adapters(...)`,
  `decode_engine(args, **kw)`, `start_decode(...)`, `abort_all(engine)`, `StepLog` (the
  one reader of `LLMEngine.step_timings`). Above them, the list of every engine internal the
  suite reads and where.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------- floors

@dataclass(frozen=True)
class Floors:
    """The ceilings a roofline floor divides by: `bandwidth` bytes/s (bytes read + written)
    and `flops` FLOP/s. The defaults were measured on an H200 (benchmarks/RESULTS.md):
    a device-to-device copy moves 4.3 TB/s, a large bf16 matmul runs 790 TFLOP/s."""

    bandwidth: float = 4.3e12
    flops: float = 790e12

    def ms(self, nbytes: float = 0.0, flops: float = 0.0) -> float:
        """Floor in milliseconds: the slower of moving `nbytes` and computing `flops`."""
        return max(nbytes / self.bandwidth, flops / self.flops) * 1e3


FLOORS = Floors()
# Data-sheet HBM rates, bytes/s. The MoE-layer and decode-attention figures use them
# (benchmarks.moe_kernels, benchmarks.attention_sweep); a copy reaches ~90% of them.
SPEC_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}


def spec_bandwidth(device_name: str | None = None) -> float:
    """The data-sheet HBM rate of the GPU (by name; the current CUDA device's by default;
    an H100's when unknown)."""
    if device_name is None:
        import torch

        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((bw for gpu, bw in SPEC_BANDWIDTH.items() if gpu in device_name), SPEC_BANDWIDTH["H100"])


# ---------------------------------------------------------------- timing

def _event():
    import torch

    return torch.cuda.Event(enable_timing=True)


def graph_ms(fn: Callable[[], object], rep: int = 100, per: int = 1) -> float:
    """Median milliseconds of one call of `fn`, replayed from a CUDA graph, divided by
    `per` (e.g. the number of layers one call covers).

    fn runs once eagerly first (Triton compiles, the allocator warms up, outside any
    capture); then Triton's `do_bench_cudagraph` captures `rep` ms' worth of back-to-back
    calls in one graph and times 10 replays with CUDA events. Launch gaps do not count:
    the measure for kernels, whose launches a serving step also replays from graphs."""
    import torch
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") / per


def events_ms(fn: Callable[[], object], repeats: int = 20, inner: int = 1, warmup: int = 1) -> float:
    """Median over `repeats` of the mean milliseconds of `inner` back-to-back calls of
    `fn`, each repeat between two CUDA events on the current stream.

    All repeats are queued back to back and read after one synchronize, so the device is
    not left idle between them. For eager work (host launch gaps count where the host is
    slower than the device) and for replays of a graph captured elsewhere (the runner's)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(repeats):
        start, end = _event(), _event()
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) / inner for s, e in pairs)


def host_us(fn: Callable[[], object], calls: int = 1000) -> float:
    """Host microseconds per call of `fn`: `calls` calls queued back to back (the device
    synchronized before, not waited for inside the timing)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return us


def wall_ms(fn: Callable[[], object], repeats: int = 3, warmup: int = 1,
            after: Callable[[], object] | None = None) -> float:
    """Median host wall milliseconds of `fn` with the device synchronized before and after
    each call (a whole training step, say); `after` runs untimed after each call."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for i in range(warmup + repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        if after is not None:
            after()
    return statistics.median(times) * 1e3


# ---------------------------------------------------------------- model shapes

@dataclass(frozen=True)
class ModelShape:
    """A benchmarked model's shapes, read from its bundled config.json."""

    name: str
    hidden: int
    intermediate: int  # the dense MLP's (the config's intermediate_size)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0  # 0: a dense model
    top_k: int = 0
    expert_intermediate: int = 0
    window: int | None = None  # sliding-window layers' window, if any
    sinks: bool = False  # per-head attention sink logits (gpt-oss)

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def projections(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """One decoder layer's fused projections as `LoRALinear` holds them: name -> (in
        features, out features of each slice). MoE models: attention only."""
        out = {"qkv": (self.hidden, (self.q_size, self.kv_size, self.kv_size)),
               "o": (self.q_size, (self.hidden,))}
        if not self.is_moe:
            out["gate_up"] = (self.hidden, (self.intermediate, self.intermediate))
            out["down"] = (self.intermediate, (self.hidden,))
        return out

    def modules(self) -> dict[str, tuple[int, int]]:
        """Every projection of every layer by its PEFT module name -> (in, out), e.g.
        `model.layers.0.self_attn.q_proj` (what adapters target; MoE: attention only)."""
        per_layer = {"self_attn.q_proj": (self.hidden, self.q_size),
                     "self_attn.k_proj": (self.hidden, self.kv_size),
                     "self_attn.v_proj": (self.hidden, self.kv_size),
                     "self_attn.o_proj": (self.q_size, self.hidden)}
        if not self.is_moe:
            per_layer |= {"mlp.gate_proj": (self.hidden, self.intermediate),
                          "mlp.up_proj": (self.hidden, self.intermediate),
                          "mlp.down_proj": (self.intermediate, self.hidden)}
        return {f"model.layers.{i}.{m}": s for i in range(self.layers) for m, s in per_layer.items()}

    def expert_shape(self) -> tuple[int, int, int, int]:
        """(experts, hidden, expert intermediate, top_k) of a MoE layer."""
        if not self.is_moe:
            raise ValueError(f"{self.name} has no experts")
        return self.experts, self.hidden, self.expert_intermediate, self.top_k


def bundled_configs() -> tuple[str, ...]:
    """The configs `loraplex bench` runs with dummy weights (loraplex.bench.workload)."""
    from loraplex.bench.workload import BUNDLED_CONFIGS

    return BUNDLED_CONFIGS


def moe_configs() -> tuple[str, ...]:
    """The bundled MoE configs (those `loraplex tune` takes)."""
    from loraplex.bench.workload import MOE_CONFIGS

    return MOE_CONFIGS


@lru_cache
def model_shape(name: str) -> ModelShape:
    """The shapes of a bundled config (`bundled_configs()`), as `loraplex bench` runs it."""
    from importlib import resources

    from loraplex.bench import workload

    if name not in workload.BUNDLED_CONFIGS:
        raise ValueError(f"{name!r} is not a bundled config ({', '.join(workload.BUNDLED_CONFIGS)})")
    # The file workload.prepare_model_dir copies into a model directory.
    src = resources.files(workload.__package__) / "configs" / name / "config.json"
    cfg = json.loads(src.read_text())
    heads = cfg["num_attention_heads"]
    # Qwen3-MoE / gpt-oss, Mixtral, DeepSeek name the routed experts' count differently.
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    layer_types = cfg.get("layer_types") or []
    window = cfg.get("sliding_window")
    if layer_types and "sliding_attention" not in layer_types:
        window = None
    return ModelShape(
        name=name, hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"],
        layers=cfg["num_hidden_layers"], heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab=cfg["vocab_size"],
        experts=experts, top_k=cfg.get("num_experts_per_tok", 0) if experts else 0,
        expert_intermediate=(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else 0,
        window=window, sinks=cfg.get("model_type") == "gpt_oss",
    )


def projection_tensors(tokens: int, k: int, outs, max_loras: int, rank: int, device="cuda"):
    """Random bf16 operands of one fused projection with LoRA slots, at trained-like
    scales: x [tokens, k], base W [sum(outs), k], slot tensors A [slices, max_loras, rank,
    k] and B [max_loras, sum(outs), rank] (the layout of `LoRALinear`'s slots)."""
    import torch

    n, bf16 = sum(outs), torch.bfloat16
    x = torch.randn(tokens, k, device=device, dtype=bf16)
    w = torch.randn(n, k, device=device, dtype=bf16) / k**0.5
    a = torch.randn(len(outs), max_loras, rank, k, device=device, dtype=bf16) / k**0.5
    b = torch.randn(max_loras, n, rank, device=device, dtype=bf16) * 0.01
    return x, w, a, b


# ---------------------------------------------------------------- arguments

def default_cache_dir() -> Path:
    """Where scripts keep model directories and random adapters between runs:
    $LORAPLEX_BENCH_CACHE, else ~/.cache/loraplex/bench (as `loraplex bench`)."""
    env = os.environ.get("LORAPLEX_BENCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "loraplex" / "bench"


def common_parser() -> argparse.ArgumentParser:
    """The argparse parent every script shares: --out and --cache-dir."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("common")
    g.add_argument("--out", type=Path, default=None, metavar="JSON",
                   help="write the results, with the run's environment, to this JSON file")
    g.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                   help="model directories and random adapters, kept between runs "
                        "(default: $LORAPLEX_BENCH_CACHE or ~/.cache/loraplex/bench; now %(default)s)")
    return p


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An ArgumentParser for a script: the script's docstring as its description, the
    common arguments (`common_parser`)."""
    return argparse.ArgumentParser(description=doc, parents=[common_parser()],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_floor_arguments(p: argparse.ArgumentParser, bandwidth: float | None = FLOORS.bandwidth,
                        flops: float = FLOORS.flops) -> None:
    """--bandwidth / --tflops, the ceilings of the script's floors (`floors(args)`);
    bandwidth None: the GPU's data-sheet rate (`spec_bandwidth`)."""
    g = p.add_argument_group("floors")
    g.add_argument("--bandwidth", type=float, default=bandwidth,
                   help="bytes/s for the memory floor (default: %(default)s; None: the GPU's "
                        "data-sheet rate)")
    g.add_argument("--tflops", type=float, default=flops,
                   help="FLOP/s for the compute floor (default: %(default)s)")


def floors(args: argparse.Namespace) -> Floors:
    bw = args.bandwidth if args.bandwidth is not None else spec_bandwidth()
    return Floors(bw, args.tflops)


def add_engine_arguments(p: argparse.ArgumentParser, model: str = "llama-3.1-8b", batch: int = 32,
                         adapters: int = 32, prompt_len: int = 512) -> None:
    """The model, batch and adapters of `decode_engine` (a bundled config, dummy weights)."""
    from loraplex.config import FP8_ACTIVATIONS

    g = p.add_argument_group("engine")
    g.add_argument("--model", default=model, help="a bundled config (default: %(default)s)")
    g.add_argument("--batch", type=int, default=batch, help="sequences in flight (default: %(default)s)")
    g.add_argument("--adapters", type=int, default=adapters,
                   help="distinct rank-16 adapters, request i on adapter i mod N (default: %(default)s)")
    g.add_argument("--prompt-len", type=int, default=prompt_len,
                   help="tokens per prompt (default: %(default)s)")
    g.add_argument("--expert-adapters", action="store_true", help="MoE: adapters on every expert too")
    g.add_argument("--lora-targets", nargs="+", default=None, metavar="MODULE",
                   help="the adapters' projections (default: q/k/v/o and the MLP's three)")
    g.add_argument("--quantization", default=None, choices=["fp8", "mxfp4", "awq", "gptq"],
                   help="random weights in this format (default: bf16)")
    g.add_argument("--fp8-activations", default="unquantized", choices=FP8_ACTIVATIONS,
                   help="FP8 weights: activations as they are, or e4m3 at run time (W8A8)")


# ---------------------------------------------------------------- output

def _git(*cmd: str) -> str | None:
    try:
        out = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment() -> dict:
    """Where and when a figure was measured: date (UTC), commit ($LORAPLEX_BENCH_COMMIT, or
    git's HEAD with "-dirty" when the tree differs), host, GPU, driver-visible versions."""
    env = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "commit": os.environ.get("LORAPLEX_BENCH_COMMIT"), "host": platform.node(),
           "python": platform.python_version(), "argv": sys.argv}
    if env["commit"] is None:
        head = _git("rev-parse", "--short", "HEAD")
        if head is not None:  # diff-index reads the tree; unlike `git status` it never writes the index
            dirty = subprocess.run(["git", "diff-index", "--quiet", "HEAD", "--"], cwd=ROOT,
                                   capture_output=True).returncode != 0
            env["commit"] = head + ("-dirty" if dirty else "")
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env |= {"gpu": props.name, "gpu_memory_mib": props.total_memory // 2**20,
                    "cuda": torch.version.cuda}
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def write_json(path: str | Path | None, results, args: argparse.Namespace | None = None) -> None:
    """Write `results` to `path` (nothing without one) as {"environment", "args", "results"}."""
    if not path:
        return
    payload = {"environment": environment(), "args": vars(args) if args is not None else None,
               "results": results}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1, default=str))
    print(f"wrote {path}")


# ---------------------------------------------------------------- engines
# Everything below reads or drives engine internals (LLMEngine, ModelRunner, the
# scheduler). Where the suite reads internals that change, so that one edit follows them:
# - LLMEngine.step_timings (runner.step_outputs.StepTiming): StepLog below (used by
#   profile_prefill);
# - the scheduler's running / waiting requests, abort_request: start_decode, abort_all;
# - LoRALinear's slots (layers.lora_weights.LoRAWeights): kernels.projection_cases
#   (set), slot_load.main (read back from the slots it filled);
# - MoELoRA's fields (a_gate_up, b_gate_up, a_down, b_down, ranks, slot_mask) and the
#   expert pipeline's stages and switches (fused_moe.GEMV_MAX_TOKENS, moe_lora_gemv's
#   tunables): moe_kernels.layer_case / decode_lora; decode_breakdown.MOE_STAGES;
# - loraplex.bench.tune_moe (candidates, tune): moe_kernels.tune;
# - the runner's graphs, input buffers, streams and step methods: profile_decode.step_parts,
#   decode_breakdown.breakdown, mixed_steps.main (StepGraphs, GraphShape, StepPlan);
# - kernel modules' tunables and config functions: kernels, prefill_lora, attention_sweep,
#   moe_kernels, profile_prefill.triton_launch_cost;
# - the adapter loader's phases (read_adapter_dir, content_id, to_canonical, _all_finite,
#   read_safetensors, PinnedPool) and the slot buffers (LoRASlotBuffers, BATCHED_COPIES):
#   adapter_load, loader_interference, slot_load.

def dummy_llm(model: str, cache_dir: Path, **llm_kwargs):
    """(LLM, model dir): `model` (a bundled config, or a model directory) on dummy bf16
    weights, the model directory prepared in `cache_dir` as `loraplex bench` does."""
    from loraplex import LLM
    from loraplex.bench.workload import prepare_model_dir

    model_dir, _ = prepare_model_dir(model, Path(cache_dir))
    llm_kwargs.setdefault("load_format", "dummy")
    llm_kwargs.setdefault("dtype", "bfloat16")
    return LLM(str(model_dir), **llm_kwargs), model_dir


def random_adapters(engine, model_dir: Path, cache_dir: Path, count: int, experts: bool = False,
                    projections: list[str] | None = None) -> list:
    """LoRARequests for `count` random rank-16 adapters on `projections` (default: q/k/v/o
    and the MLP's; and every expert with `experts`), written once into `cache_dir`."""
    from loraplex.bench.synthetic import LINEAR_TARGETS
    from loraplex.bench.workload import random_adapter_requests

    targets = tuple(projections or LINEAR_TARGETS) + (("experts",) if experts else ())
    return random_adapter_requests(engine, model_dir, Path(cache_dir), count, targets=targets)


def decode_engine(args: argparse.Namespace, **llm_kwargs):
    """(engine, runner, adapter requests) for `add_engine_arguments`' model, batch and
    adapters: dummy weights, room for prompts of args.prompt_len + 256 tokens."""
    llm, model_dir = dummy_llm(args.model, args.cache_dir, max_loras=max(1, args.adapters), max_lora_rank=16,
                               max_num_seqs=args.batch, max_model_len=args.prompt_len + 256,
                               quantization=getattr(args, "quantization", None),
                               fp8_activations=getattr(args, "fp8_activations", "unquantized"), **llm_kwargs)
    engine = llm.engine
    loras = random_adapters(engine, model_dir, args.cache_dir, args.adapters, args.expert_adapters,
                            getattr(args, "lora_targets", None))
    return engine, engine.runner, loras


def router_lora(runner) -> bool:
    """Whether the runner's steps on the resident adapters run the MoE routers' LoRA (as
    ModelRunner decides per step: some adapter of the step adapts a router)."""
    return runner.lora_slots is not None and bool(runner.lora_slots.router_slots)


def start_decode(engine, label: str, batch: int, prompt_len: int, loras: list, max_tokens: int,
                 warm_steps: int = 5, random_prompts: bool = False) -> None:
    """`batch` requests (request i on adapter i mod len(loras), none without loras),
    stepped until every one decodes (each adapter primed into a GPU slot first), then
    `warm_steps` more steps; raises if fewer than `batch` decode. Prompts repeat one
    token (request i: 1000 + i), or with `random_prompts` are random tokens (seeded): an
    MoE model's routing then spreads as in serving, where repeated tokens narrow it."""
    import torch

    from loraplex import SamplingParams

    sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    if loras:
        # Adapters load in the background: cold ones (hundreds of MB each with expert
        # weights) would keep their requests waiting while the first ones decode, and
        # those could reach their length cap before the batch is whole. One token on each
        # adapter first leaves them in GPU slots.
        for i, lora in enumerate(loras):
            engine.add_request(f"{label}-prime-{i}", [1000], SamplingParams(max_tokens=1), lora)
        while engine.has_unfinished_requests():
            engine.step()
    for i in range(batch):
        lora = loras[i % len(loras)] if loras else None
        prompt = (torch.randint(1000, 30000, (prompt_len,), generator=g).tolist() if random_prompts
                  else [1000 + i] * prompt_len)
        engine.add_request(f"{label}-{i}", prompt, sp, lora)
    while any(len(r.output_token_ids) == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(warm_steps):
        engine.step()
    running = sum(1 for r in engine.scheduler.running if r.request_id.startswith(f"{label}-"))
    if running != batch:  # a figure of a smaller batch than asked for would pass unnoticed
        raise RuntimeError(f"{running} of {batch} requests decode: raise max_tokens or the KV cache")


def abort_all(engine, drain: bool = False) -> None:
    """Abort every running and waiting request; with `drain`, step until none is left."""
    for r in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort_request(r.request_id)
    while drain and engine.has_unfinished_requests():
        engine.step()


class StepLog:
    """The engine's StepTiming of each step with tokens while inside the `with`
    (`LLMEngine.step_timings`). The one place that reads them."""

    def __init__(self, engine):
        self.engine = engine
        self.rows: list = []

    def __enter__(self) -> StepLog:
        self.engine.step_timings = []
        return self

    def __exit__(self, *exc) -> None:
        self.rows = self.engine.step_timings or []
        self.engine.step_timings = None

    def steps(self) -> list[dict]:
        """Each logged step: tokens, slot loads, launch_ms (host time in runner.launch),
        slot_load_ms, device_ms (the step's timing events; NaN without them). Read after
        the device finished the steps (torch.cuda.synchronize)."""
        out = []
        for t in self.rows:
            device = t.device[0].elapsed_time(t.device[1]) if t.device else float("nan")
            out.append(dict(wall_ms=t.total_s * 1e3, tokens=t.num_tokens, loads=t.num_slot_loads,
                            launch_ms=t.launch_s * 1e3, slot_load_ms=t.slot_load_s * 1e3, device_ms=device))
        return out
