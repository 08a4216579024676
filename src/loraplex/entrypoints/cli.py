"""`loraplex` console entry point: one command, a subcommand per job.

A mistake of the caller's (a LoraplexError) ends the command with one line
`loraplex: error: ...` and status 2, as argparse ends its own; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from loraplex.config import FP8_ACTIVATIONS
from loraplex.engine.args import EngineArgs, at_least
from loraplex.errors import LoraplexError


def _name_path(spec: str) -> tuple[str, str]:
    name, _, path = spec.partition("=")
    if not (name and path):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {spec!r}")
    return name, path


def _generate(args) -> int:
    from loraplex.entrypoints.llm import LLM
    from loraplex.types import LoRARequest, SamplingParams

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    loras = [None]
    for i, (name, path) in enumerate(args.lora_modules):
        loras.append(LoRARequest(name, i + 1, path))
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for lora, out in zip(loras, llm.generate([args.prompt] * len(loras), sp, loras)):
        print(f"[{lora.lora_name if lora else 'base'}] {out.outputs[0].text}")
    return 0


def _registry(args) -> int:
    from loraplex.adapters.registry import Registry

    registry = Registry(args.root)
    if args.action == "publish":
        if not (args.name and args.adapter_dir) or args.public == (args.owner is not None):
            raise LoraplexError("usage: loraplex registry ROOT publish NAME ADAPTER_DIR "
                                "(--owner TENANT | --public) [--version V]")
        try:
            version, cid = registry.publish(args.name, args.adapter_dir, args.version,
                                            owner=None if args.public else args.owner)
        except ValueError as e:  # a bad name, or a name another owner has
            raise LoraplexError(str(e)) from None
        print(f"{args.name}@{version} {cid}")
        return 0
    if not registry.exists():
        raise LoraplexError(f"no registry at {args.root} (`publish` creates one)")
    for name in registry.names():
        index = registry.index(name)
        owner = ("admins only: publish again with an owner" if "owner" not in index
                 else "public" if index["owner"] is None else f"owner {index['owner']}")
        for version, cid in sorted(index["versions"].items()):
            latest = ", latest" if version == index["latest"] else ""
            print(f"{name}@{version} {cid} ({owner}{latest})")
    return 0


def _serve(args) -> int:
    from loraplex.entrypoints.default_model import use_default_model
    from loraplex.server import run as serve

    sock = serve.bind(args.host, args.port)  # a port in use fails before any model is built
    use_default_model(args)
    if args.data_parallel_size is not None:
        if args.replicas is not None:
            raise LoraplexError("--replicas (Ray Serve) and --data-parallel-size (no Ray) exclude each other")
        from loraplex.deploy import data_parallel

        return data_parallel.run(args, sock)
    if args.replicas is not None:
        if importlib.util.find_spec("ray") is None:
            raise LoraplexError("--replicas runs on Ray Serve: pip install 'loraplex[ray]'")
        from loraplex.deploy import ray_serve

        sock.close()  # Serve's HTTP proxy listens there
        return ray_serve.run(args)
    return serve.main(args, sock)


def _tune(args) -> int:
    if importlib.util.find_spec("triton") is None:
        raise LoraplexError("loraplex tune needs Triton and a CUDA GPU: pip install 'loraplex[gpu]'")
    from loraplex.bench import tune_moe

    return tune_moe.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description="Serve many LoRA adapters of one LLM.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt with the base model and each adapter")
    gen.add_argument("model", help="Hugging Face model directory")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--lora-modules", nargs="*", type=_name_path, default=[], metavar="NAME=PATH")
    gen.add_argument("--max-tokens", type=at_least(1), default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    EngineArgs.add_cli_args(gen)  # --seed among them: unseeded requests draw from the engine's
    gen.set_defaults(func=_generate)

    from loraplex.bench import run as bench
    from loraplex.bench.workload import MOE_CONFIGS
    from loraplex.deploy import args as deploy_args
    from loraplex.server import run as serve

    srv = sub.add_parser("serve", help="OpenAI-compatible server (default model: Gemma 3 270M)")
    deploy_args.add_arguments(srv)  # (its group before the engine's, which help shows last)
    serve.add_arguments(srv)
    srv.set_defaults(func=_serve)

    b = sub.add_parser("bench", help="serving benchmark (vllm bench serve style, random dataset)")
    bench.add_arguments(b)
    b.set_defaults(func=bench.main)

    tune = sub.add_parser("tune", help="tune the MoE kernels' and the FP8 and int4 GEMMs' block configs "
                                       "on this GPU (JSON files)")
    tune.add_argument("--model", required=True,
                      help="MoE, FP8 or AWQ / GPTQ model directory, or a bundled config: MoE ones ("
                           + ", ".join(MOE_CONFIGS) + ") or dense ones with --quantization")
    tune.add_argument("--quantization", choices=["fp8", "mxfp4", "awq", "gptq"], default=None,
                      help="tune for serving with --quantization: fp8 also tunes the FP8 GEMM at the "
                           "model's projection shapes, awq / gptq the int4 GEMM; a MoE model's "
                           "experts are tuned in fp8 or mxfp4 (a quantized checkpoint's are tuned in "
                           "its own without it)")
    tune.add_argument("--fp8-activations", choices=FP8_ACTIVATIONS, default="unquantized",
                      help="FP8 GEMMs: tune the weight-only kernels, or the W8A8 ones serving with "
                           "--fp8-activations dynamic runs (configs of their own)")
    tune.add_argument("--batch-sizes", type=at_least(1), nargs="+", default=None,
                      help="token counts to tune (default: 1 to 4096; the int4 GEMM: 1 to 96, its own)")
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
    reg.add_argument("--owner", default=None, metavar="TENANT",
                     help="publish: the tenant that may use it (a name keeps its first owner)")
    reg.add_argument("--public", action="store_true", help="publish: every tenant may use it")
    reg.set_defaults(func=_registry)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except LoraplexError as e:
        print(f"{parser.prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
