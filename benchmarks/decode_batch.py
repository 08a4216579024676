"""A model in its decode phase, for the decode-step benchmarks (profile_decode.py,
decode_breakdown.py): an engine on dummy weights with random adapters, and a batch of
requests stepped until every one of them decodes."""

from __future__ import annotations

import argparse
from pathlib import Path

from loraplex import LLM, SamplingParams
from loraplex.bench.synthetic import LINEAR_TARGETS
from loraplex.bench.workload import prepare_model_dir, random_adapter_requests


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The model, batch and adapters that make_engine reads."""
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--expert-adapters", action="store_true", help="MoE: adapters on every expert too")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "loraplex" / "bench"))


def make_engine(args: argparse.Namespace, **llm_kwargs):
    """(engine, runner, adapter requests) for the bundled config of args.model (see
    add_arguments), dummy weights."""
    model_dir, _ = prepare_model_dir(args.model, Path(args.cache_dir))
    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_loras=max(1, args.adapters),
              max_lora_rank=16, max_num_seqs=args.batch, max_model_len=args.prompt_len + 256,
              **llm_kwargs)
    engine = llm.engine
    targets = LINEAR_TARGETS + (("experts",) if args.expert_adapters else ())
    loras = random_adapter_requests(engine, model_dir, Path(args.cache_dir), args.adapters, targets=targets)
    return engine, engine.runner, loras


def start_decode(engine, label: str, batch: int, prompt_len: int, loras: list, max_tokens: int,
                 warm_steps: int = 5) -> None:
    """`batch` requests (request i on adapter i mod len(loras), or none without loras),
    stepped until all decode, then `warm_steps` more steps."""
    sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        lora = loras[i % len(loras)] if loras else None
        engine.add_request(f"{label}-{i}", [1000 + i] * prompt_len, sp, lora)
    while any(len(r.output_token_ids) == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(warm_steps):
        engine.step()
