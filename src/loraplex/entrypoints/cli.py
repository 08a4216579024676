"""`loraplex` console entry point: one command, a subcommand per job."""

from __future__ import annotations

import argparse
import sys


def _generate(args) -> int:
    from loraplex import LLM, LoRARequest, SamplingParams

    llm = LLM(
        args.model, dtype=args.dtype, load_format=args.load_format,
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_model_len=args.max_model_len,
    )
    loras = [None]
    for i, spec in enumerate(args.lora_modules):
        name, _, path = spec.partition("=")
        loras.append(LoRARequest(name, i + 1, path))
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    for lora, out in zip(loras, llm.generate([args.prompt] * len(loras), sp, loras)):
        print(f"[{lora.lora_name if lora else 'base'}] {out.outputs[0].text}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loraplex", description="Serve many LoRA adapters of one LLM.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt with the base model and each adapter")
    gen.add_argument("model", help="Hugging Face model directory")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    gen.add_argument("--max-loras", type=int, default=8)
    gen.add_argument("--max-lora-rank", type=int, default=64)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.set_defaults(func=_generate)

    from loraplex.bench import run as bench
    from loraplex.server import run as serve

    srv = sub.add_parser("serve", help="OpenAI-compatible server (default model: Gemma 3 270M)")
    serve.add_arguments(srv)
    srv.set_defaults(func=serve.main)

    b = sub.add_parser("bench", help="serving benchmark (vllm bench serve style, random dataset)")
    bench.add_arguments(b)
    b.set_defaults(func=bench.main)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
