"""`loraplex` console entry point: one command, a subcommand per job."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


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


def _registry(args) -> int:
    from loraplex.adapters.registry import Registry

    registry = Registry(args.root)
    if args.action == "publish":
        if not (args.name and args.adapter_dir):
            raise SystemExit("usage: loraplex registry ROOT publish NAME ADAPTER_DIR [--version V]")
        version, cid = registry.publish(args.name, args.adapter_dir, args.version)
        print(f"{args.name}@{version} {cid}")
    else:
        for name in registry.names():
            index = registry.index(name)
            for version, cid in sorted(index["versions"].items()):
                latest = " (latest)" if version == index["latest"] else ""
                print(f"{name}@{version} {cid}{latest}")
    return 0


def _tune(args) -> int:
    from loraplex.ops.triton import tune_moe  # needs Triton and a GPU

    return tune_moe.main(args)


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
    from loraplex.bench.workload import BUNDLED_CONFIGS
    from loraplex.server import run as serve

    srv = sub.add_parser("serve", help="OpenAI-compatible server (default model: Gemma 3 270M)")
    serve.add_arguments(srv)
    srv.set_defaults(func=serve.main)

    b = sub.add_parser("bench", help="serving benchmark (vllm bench serve style, random dataset)")
    bench.add_arguments(b)
    b.set_defaults(func=bench.main)

    tune = sub.add_parser("tune", help="tune the MoE kernels' block configs on this GPU (JSON files)")
    tune.add_argument("--model", required=True,
                      help="MoE model directory, or a bundled config: " + ", ".join(BUNDLED_CONFIGS))
    tune.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                      help="token counts to tune (default: 1 to 4096)")
    tune.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    tune.add_argument("--out", default=None, help="output directory (default: the package's configs)")
    tune.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "loraplex" / "bench"),
                      help="where a bundled config is unpacked")
    tune.set_defaults(func=_tune)

    from loraplex.train import run as train

    tr = sub.add_parser("train", help="LoRA fine-tuning on JSONL data -> a PEFT adapter (dense and MoE)")
    train.add_arguments(tr)
    tr.set_defaults(func=train.main)

    reg = sub.add_parser("registry", help="publish adapters to / list a registry (for --lora-registry)")
    reg.add_argument("root", help="registry directory or fsspec URL")
    reg.add_argument("action", choices=["publish", "list"])
    reg.add_argument("name", nargs="?")
    reg.add_argument("adapter_dir", nargs="?")
    reg.add_argument("--version", default=None, help="default: the next integer")
    reg.set_defaults(func=_registry)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
