"""A model in its decode phase, for the decode-step benchmarks (profile_decode.py,
decode_breakdown.py): an engine on dummy weights with random adapters, and a batch of
requests stepped until every one of them decodes."""

from __future__ import annotations

from pathlib import Path

from loraplex import LLM, SamplingParams
from loraplex.bench.synthetic import LINEAR_TARGETS
from loraplex.bench.workload import prepare_model_dir, random_adapter_requests

CACHE_DIR = str(Path.home() / ".cache" / "loraplex" / "bench")


def make_engine(model: str, batch: int, adapters: int, prompt_len: int, cache_dir: str,
                expert_adapters: bool = False, **llm_kwargs):
    """(engine, runner, adapter requests) for `model`'s bundled config, dummy weights."""
    model_dir, _ = prepare_model_dir(model, Path(cache_dir))
    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_loras=max(1, adapters),
              max_lora_rank=16, max_num_seqs=batch, max_model_len=prompt_len + 256, **llm_kwargs)
    engine = llm.engine
    targets = LINEAR_TARGETS + (("experts",) if expert_adapters else ())
    loras = random_adapter_requests(engine, model_dir, Path(cache_dir), adapters, targets=targets)
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
