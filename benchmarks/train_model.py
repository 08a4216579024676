"""One optimizer step of a whole model: loraplex on a bf16 or quantized base, and
transformers + PEFT on the bf16 base. Peak GPU memory and step time.

A bundled config (default gpt-oss-20b) with random weights at trained scale: bf16
(transformers' init, N(0, initializer_range)), or quantized into --quantization's format
(`load_quantized_base(..., dummy=True)`: gpt-oss's experts in MXFP4, attention,
embeddings and head bf16). LoRA of --rank on attention + every expert (or --targets),
gradient checkpointing, AdamW (fused on a GPU). Per sequence length (one row): the
median wall time of a whole optimizer step (forward, backward, AdamW) over --repeats
steps after a warm-up step, and the peak GPU memory of those steps (weights included).

loraplex: its expert GEMMs, chunked loss, FlexAttention where transformers' only other
choice is eager (gpt-oss). --peft: the same model in transformers + PEFT
(`target_parameters` on the experts), loss from the model's own logits, transformers'
default attention (or --peft-attention flex_attention), gradient checkpointing; a
length that runs out of memory is reported as such.

    python -m benchmarks.train_model --model gpt-oss-20b --quantization mxfp4 --seq-lens 1024 4096 \
        [--rank 16] [--targets q_proj k_proj v_proj o_proj experts]
    python -m benchmarks.train_model --model gpt-oss-20b --quantization none --peft --seq-lens 4096 16384

--tiny --device cpu is a smoke test (a 2-layer gpt-oss of small shapes).

Figure: benchmarks/RESULTS.md, "Training whole models".
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
    p.add_argument("--quantization", default="mxfp4", choices=["mxfp4", "fp8", "awq", "gptq", "none"])
    p.add_argument("--peft", action="store_true", help="also transformers + PEFT on the bf16 base")
    p.add_argument("--peft-attention", default=None, help="transformers' attn_implementation for PEFT")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", nargs="+", default=None, help="default: attention + experts (MoE)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--profile", action="store_true",
                   help="loraplex: after the timed steps, one step under the torch profiler (top ops by "
                        "device time, and by host time)")
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


def step_stats(step, seq_len: int, repeats: int, device) -> dict:
    """Median ms of `step` after a warm-up (the optimizer's state is made there) and the
    peak GiB of the timed steps; {"oom": True} if it runs out of memory."""
    import torch

    cuda = device.type == "cuda"
    try:
        step()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            loss = step()
            if cuda:
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t) * 1e3)
    except torch.OutOfMemoryError:
        return {"oom": True}
    ms = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    return {"step_ms": ms, "tokens_per_s": seq_len / ms * 1e3, "peak_gib": peak, "loss": loss}


def optimizer_step(loss_fn, opt):
    """A whole step: the loss, its backward, the optimizer; returns the loss."""
    def step() -> float:
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def report(label: str, seq_len: int, r: dict) -> None:
    if r.get("oom"):
        print(f"{label:8s} {seq_len:6d} tokens: out of memory")
    else:
        print(f"{label:8s} {seq_len:6d} tokens: step {r['step_ms']:8.1f} ms "
              f"({r['tokens_per_s']:7.0f} tokens/s), peak {r['peak_gib']:6.2f} GiB, loss {r['loss']:.3f}")


def loraplex_runs(args, path: Path, device, dtype) -> dict:
    import torch

    from loraplex.train import data
    from loraplex.train.lora import lora_parameters
    from loraplex.train.quantized_base import load_quantized_base
    from loraplex.train.trainer import TrainConfig, lm_loss_sum, make_optimizer, prepare, training_attention

    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    attention = training_attention(str(path), device)
    if args.quantization == "none":
        model = bf16_model(path, device, dtype, attention)
    else:
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
    print(f"loraplex: {args.quantization} base, attention {attention or 'default'}; weights + LoRA "
          f"{weights_gib:.2f} GiB; {results['lora_params'] / 1e6:.1f}M LoRA parameters on "
          f"{', '.join(spec.targets)}")
    for seq_len in args.seq_lens:
        batch = {k: v.to(device) for k, v in data.pack([data.Example(*[_ids(model, seq_len)] * 2)]).items()}
        step = optimizer_step(lambda: lm_loss_sum(model, batch) / (seq_len - 1), opt)
        results[f"seq{seq_len}"] = r = step_stats(step, seq_len, args.repeats, device)
        report("loraplex", seq_len, r)
        if args.profile and not r.get("oom"):
            profile_step(step, seq_len, device)
    return results


def profile_step(step, seq_len: int, device) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    table = prof.key_averages()
    for key in (["cuda_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]:
        print(f"--- {seq_len} tokens, top ops by {key}")
        print(table.table(sort_by=key, row_limit=22, max_name_column_width=60))


def peft_runs(args, path: Path, device, dtype) -> dict:
    import peft
    import torch

    model = bf16_model(path, device, dtype, args.peft_attention)
    targets = args.targets or ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, target_modules=[t for t in targets if t != "experts"],
        target_parameters=(["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if "experts" in targets
                           else None)))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                            fused=device.type == "cuda" or None)
    results = {"attention": model.config._attn_implementation}
    print(f"PEFT: attention {results['attention']}")
    for seq_len in args.seq_lens:
        ids = torch.tensor([_ids(model, seq_len)], device=device)
        step = optimizer_step(lambda: model(input_ids=ids, labels=ids).loss, opt)
        results[f"seq{seq_len}"] = r = step_stats(step, seq_len, args.repeats, device)
        report("PEFT", seq_len, r)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return results


def bf16_model(path: Path, device, dtype, attention: str | None):
    """transformers' model of the config with its own random init (N(0, initializer_range))."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    config.use_cache = False
    torch.manual_seed(0)
    kwargs = {"attn_implementation": attention} if attention else {}
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)


def _ids(model, seq_len: int) -> list[int]:
    import torch

    gen = torch.Generator().manual_seed(seq_len)
    return torch.randint(10, model.config.vocab_size, (seq_len,), generator=gen).tolist()


def main(argv=None):
    import gc

    import torch

    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = model_dir(args)
    results = {"loraplex": loraplex_runs(args, path, device, dtype)}
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.peft:
        results["peft"] = peft_runs(args, path, device, dtype)
        for seq_len in args.seq_lens:
            ours, theirs = results["loraplex"][f"seq{seq_len}"], results["peft"][f"seq{seq_len}"]
            if not ours.get("oom") and not theirs.get("oom"):
                print(f"{seq_len:6d} tokens: loraplex {theirs['step_ms'] / ours['step_ms']:.2f}x "
                      f"PEFT's speed, {1 - ours['peak_gib'] / theirs['peak_gib']:.0%} less memory")
    harness.write_json(args.out, results, args)


if __name__ == "__main__":
    sys.exit(main())
