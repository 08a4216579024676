"""Serve a base model and several LoRA adapters in one batch with the offline API.

    python examples/offline_multi_lora.py                      # tiny random model, offline
    python examples/offline_multi_lora.py --model DIR --lora name=ADAPTER_DIR ...

Without --model it builds a tiny random Qwen3 and three random adapters in a temporary
directory (no downloads), so the text is gibberish; the point is the mechanics: one
batch, a different adapter per request, each request identical to what it gets alone.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.bench.synthetic import write_random_adapter, write_random_model


def tiny_model(root: Path) -> Path:
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, initializer_range=0.1,
    )
    return write_random_model(root / "tiny-qwen3", config)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="Hugging Face model directory (default: tiny random)")
    parser.add_argument("--lora", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="loraplex-example-") as tmp:
        run(args, Path(tmp))


def run(args, tmp: Path):
    model = args.model or str(tiny_model(tmp))
    llm = LLM(model, max_loras=4, max_lora_rank=16, max_model_len=1024)
    adapters = [name_dir.split("=", 1) for name_dir in args.lora]
    if not adapters:  # random adapters of different ranks and targets
        shapes = {k: (p.in_features, p.out_features) for k, p in llm.engine.runner.projections.items()}
        for i, (rank, targets) in enumerate([(4, ("q_proj", "v_proj")), (8, None), (16, ("down_proj",))]):
            kw = {"targets": targets} if targets else {}
            path = write_random_adapter(tmp / f"adapter{i}", shapes, rank, b_std=0.2, seed=i, **kw)
            adapters.append((f"adapter{i}-r{rank}", str(path)))
    loras = [None] + [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters)]

    prompt = "t10 t11 t12 t13" if not args.model else "The capital of France is"
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate([prompt] * len(loras), sp, loras)
    dt = time.perf_counter() - t0
    for lora, out in zip(loras, outs):
        name = lora.lora_name if lora else "base"
        print(f"{name:>16}: {out.outputs[0].text!r}")
    alone = [llm.generate([prompt], sp, lora, use_tqdm=False)[0] for lora in loras]
    same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, alone))
    print(f"{len(loras)} requests, {len(loras) - 1} adapters, one batch: {dt:.2f} s; "
          f"each equal to its request alone: {same}")


if __name__ == "__main__":
    main()
