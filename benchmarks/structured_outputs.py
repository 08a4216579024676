"""What structured outputs cost a decode step: TPOT of 32 requests on 32 adapters, each
constrained by a JSON schema, against the same 32 unconstrained.

The model is a bundled config on dummy weights with a real tokenizer (--tokenizer: a
directory with tokenizer.json; the model's vocabulary grows to fit it), so the grammar
engine masks a real vocabulary. The schema (a long list of integers) keeps every
constrained request going for --output-len tokens, as ignore_eos does for the others.
Runs alternate, --repeats of each; TPOT per request is (last token - first token) /
(tokens - 1), the figure its median over requests and runs.

    python -m benchmarks.structured_outputs --tokenizer DIR [--model llama-3.1-8b]

Figure: benchmarks/RESULTS.md, "Structured outputs".
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from benchmarks import harness

SCHEMA = {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer"},
                                                      "minItems": 4000}}, "required": ["values"]}


def build_parser():
    p = harness.parser(__doc__)
    p.add_argument("--model", default="llama-3.1-8b", help="a bundled config (default: %(default)s)")
    p.add_argument("--tokenizer", type=Path, required=True, help="a directory with a tokenizer.json")
    p.add_argument("--batch", type=int, default=32, help="requests in flight, each its own adapter")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    return p


def model_dir_with_tokenizer(model: str, tokenizer_dir: Path, cache_dir: Path) -> Path:
    """The bundled config `model` beside the tokenizer of `tokenizer_dir`, its vocabulary
    (and bos / eos) the tokenizer's."""
    from transformers import AutoTokenizer

    from loraplex.bench.workload import prepare_model_dir

    src, _ = prepare_model_dir(model, cache_dir)
    out = cache_dir / f"{model}+{tokenizer_dir.name}"
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = json.loads((src / "config.json").read_text())
    config.update(vocab_size=max(config["vocab_size"], len(tok)), bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id)
    (out / "config.json").write_text(json.dumps(config))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def tpots(outs) -> list[float]:
    """ms per output token after the first, per request."""
    return [(o.metrics.finished_time - o.metrics.first_token_time) * 1e3 / (len(o.outputs[0].token_ids) - 1)
            for o in outs]


def main(argv=None):
    args = build_parser().parse_args(argv)
    from loraplex import LLM, SamplingParams, StructuredOutputs

    model_dir = model_dir_with_tokenizer(args.model, args.tokenizer, args.cache_dir)
    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_loras=args.batch, max_lora_rank=16,
              max_num_seqs=args.batch, max_model_len=args.prompt_len + args.output_len + 16)
    loras = harness.random_adapters(llm.engine, model_dir, args.cache_dir, args.batch)
    vocab = llm.engine.config.model.vocab_size
    prompts = [[1000 + (i * 7919 + j * 104729) % (vocab // 2) for j in range(args.prompt_len)]
               for i in range(args.batch)]
    plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.output_len, ignore_eos=True)
             for i in range(args.batch)]
    # No free whitespace: a random model would otherwise spend its tokens on it.
    spec = StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.output_len,
                                  structured_outputs=spec) for i in range(args.batch)]
    runs = {"plain": plain, "json schema": constrained}
    for params in runs.values():  # warm-up: graphs, kernels, the grammar's compile
        llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, params in runs.items():
            outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs), name
            if name == "json schema":
                text = outs[0].outputs[0].text
                assert text.startswith('{') and '"values"' in text, text[:80]
            times[name] += tpots(outs)
    results = {name: {"tpot_ms_median": statistics.median(t), "tpot_ms_p90": sorted(t)[int(0.9 * len(t))]}
               for name, t in times.items()}
    base = results["plain"]["tpot_ms_median"]
    for name, r in results.items():
        print(f"{name:12s} TPOT median {r['tpot_ms_median']:.2f} ms  p90 {r['tpot_ms_p90']:.2f} ms  "
              f"({r['tpot_ms_median'] / base:.3f} x plain)")
    harness.write_json(args.out, results, args)


if __name__ == "__main__":
    main()
