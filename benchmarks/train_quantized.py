"""LoRA training on a quantized base: peak GPU memory and step time of gpt-oss-20b from
MXFP4 (or another bundled config in another format).

The whole model (every layer, the 201K-token head through the chunked loss) with random
weights at trained scale in the format (`load_quantized_base(..., dummy=True)`: experts
in MXFP4 for gpt-oss, attention, embeddings and head in bf16), LoRA of --rank on
--targets (default attention + every expert), gradient checkpointing, fused AdamW. Per
sequence length (one packed row): the median wall time of a whole optimizer step (forward,
backward, AdamW) over --repeats steps after a warm-up step, and the peak GPU memory of
those steps, which includes the weights (reported alone too).

    python -m benchmarks.train_quantized [--model gpt-oss-20b] [--quantization mxfp4] \
        [--seq-lens 1024 4096] [--rank 16] [--targets q_proj k_proj v_proj o_proj experts]

--tiny --device cpu is a smoke test (a 2-layer gpt-oss of small shapes).

Figure: benchmarks/RESULTS.md, "Training on a quantized base".
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from benchmarks import harness


def build_parser():
    p = harness.parser(__doc__)
    p.add_argument("--model", default="gpt-oss-20b", help="a bundled config")
    p.add_argument("--quantization", default="mxfp4", choices=["mxfp4", "fp8", "awq", "gptq"])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", nargs="+", default=None, help="default: attention + experts (MoE)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer gpt-oss of small shapes (smoke test)")
    return p


def model_dir(args) -> Path:
    if not args.tiny:
        from loraplex.bench.workload import prepare_model_dir

        return prepare_model_dir(args.model, Path(args.cache_dir))[0]
    import transformers

    from loraplex.bench.synthetic import write_random_model

    out = Path(args.cache_dir) / "train-quantized-tiny"
    if not (out / "config.json").is_file():
        cfg = transformers.GptOssConfig(vocab_size=512, hidden_size=64, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                                        sliding_window=16)
        write_random_model(out, cfg, 0)
    return out


def main(argv=None):
    import torch

    from loraplex.train import data
    from loraplex.train.lora import lora_parameters
    from loraplex.train.quantized import load_quantized_base
    from loraplex.train.trainer import TrainConfig, lm_loss_sum, make_optimizer, prepare, training_attention

    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    path = model_dir(args)
    t0 = time.perf_counter()
    attention = training_attention(str(path), device)
    model = load_quantized_base(path, device, dtype, args.quantization, dummy=True,
                                attn_implementation=attention)
    cfg = TrainConfig(str(path), "", "", rank=args.rank, targets=args.targets, gradient_checkpointing=True)
    spec, wrapped = prepare(model, cfg)
    model.train()
    params = lora_parameters(wrapped)
    opt = make_optimizer(params, cfg)
    weights_gib = torch.cuda.memory_allocated(device) / 2**30 if cuda else float("nan")
    results = {"load_s": time.perf_counter() - t0, "weights_and_lora_gib": weights_gib,
               "attention": attention, "lora_params": sum(p.numel() for p in params),
               "targets": list(spec.targets)}
    print(f"loaded in {results['load_s']:.1f} s; attention {attention or 'default'}; "
          f"weights + LoRA {weights_gib:.2f} GiB; "
          f"{results['lora_params'] / 1e6:.1f}M LoRA parameters on {', '.join(spec.targets)}")
    vocab = model.config.vocab_size
    for seq_len in args.seq_lens:
        gen = torch.Generator().manual_seed(seq_len)
        ids = torch.randint(10, vocab, (seq_len,), generator=gen).tolist()
        batch = {k: v.to(device) for k, v in data.pack([data.Example(ids, ids)]).items()}

        def step():
            loss = lm_loss_sum(model, batch) / (seq_len - 1)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        step()  # warm-up (the optimizer's state is made here)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            loss = step()
            if cuda:
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t) * 1e3)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
        ms = statistics.median(times)
        results[f"seq{seq_len}"] = {"step_ms": ms, "tokens_per_s": seq_len / ms * 1e3, "peak_gib": peak,
                                    "loss": loss.item()}
        print(f"{seq_len:6d} tokens: step {ms:8.1f} ms ({seq_len / ms * 1e3:7.0f} tokens/s), "
              f"peak {peak:6.2f} GiB, loss {loss.item():.3f}")
    harness.write_json(args.out, results, args)


if __name__ == "__main__":
    sys.exit(main())
