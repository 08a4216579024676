"""`loraplex train`: LoRA fine-tuning of a Hugging Face model directory on JSONL data,
written as a PEFT adapter that transformers + PEFT and loraplex both load."""

from __future__ import annotations

import argparse

from loraplex.train.expert_gemm import BACKENDS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--data", required=True,
                   help='JSONL: {"prompt", "completion"} or {"messages"} (chat template) per line')
    p.add_argument("--out", required=True, help="adapter directory (checkpoints go in it too)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=None, help="default: 2 x rank")
    p.add_argument("--targets", nargs="+", default=None,
                   help="module names (q_proj ... down_proj) and/or 'experts' (every expert's gate_up and "
                        "down); default: attention + MLP projections, on MoE models attention + experts")
    p.add_argument("--rslora", action="store_true", help="scale by alpha / sqrt(rank)")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lr-scheduler", default="cosine", choices=["cosine", "constant"])
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--packing", action=argparse.BooleanOptionalAction, default=None,
                   help="a micro-batch's examples as one row with attention boundaries, no padding "
                        "(default: where the model keeps packed examples apart)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each micro-step from a CUDA graph, rows padded to a few lengths "
                        "(default: on a GPU where loraplex's attention bounds the packed rows)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-steps", type=int, default=200, help="checkpoint every N steps (0: never)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                   help="continue from a checkpoint (default: the newest in --out)")
    p.add_argument("--moe-backend", default="auto", choices=BACKENDS,
                   help="expert GEMMs: grouped_mm (CUDA bf16 default) or a per-expert loop")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="quantize a bf16 checkpoint's base to FP8 as it loads; a quantized checkpoint "
                        "(MXFP4, FP8, AWQ, GPTQ) trains on its own format without this flag")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--no-progress", dest="progress", action="store_false")


def main(args: argparse.Namespace) -> int:
    from loraplex.train.trainer import TrainConfig, train

    fields = TrainConfig.__dataclass_fields__
    train(TrainConfig(**{k: v for k, v in vars(args).items() if k in fields}))
    print(f"adapter written to {args.out}")
    return 0
