"""One LoRA training step on Qwen3-30B-A3B-shaped MoE layers: loraplex vs transformers + PEFT.

Both train rank-16 LoRA on q/k/v/o and every expert's gate_up and down projections
(PEFT: `target_modules` and `target_parameters`; --experts-only: the experts alone) of the
same model: Qwen3-30B-A3B's layer shapes (128 experts, top-8, hidden 2048, expert
intermediate 768), --layers of them, a small vocabulary (the LM head is not what is
measured), dummy weights in bf16. Per sequence length: median time of a forward +
backward over --repeats steps after a warm-up step, and peak GPU memory.

    python -m benchmarks.train_moe [--layers 2] [--seq-lens 1024 4096 16384] \
        [--sides loraplex loraplex-graph peft] [--moe-only]

The whole step: PEFT runs transformers' model with its own loss (SDPA attention);
loraplex runs `loraplex train`'s micro-step (trainer.prepare: its LoRA, routing replay,
fused norms; its attention for packed rows; the chunked loss), eager (`loraplex`) or
replayed from a CUDA graph (`loraplex-graph`, what `loraplex train` does on a GPU).
--moe-only times the MoE blocks alone (router + experts of every layer, forward and
backward to their input, from a random hidden state; eager sides only): the part
LoRA-on-experts training changes. --breakdown times one layer's primitives (eager, CUDA
events), --profile prints both sides' kernel tables, --host-profile and --check-syncs
look at loraplex's host side. --tiny --device cpu is a smoke test.

Figure: benchmarks/RESULTS.md, "Training: LoRA on MoE experts".
"""

from __future__ import annotations

from benchmarks import harness

RANK, ALPHA = 16, 32
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # LoRA targets besides the experts
TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)


def build(layers: int, tiny: bool):
    import transformers

    if tiny:
        shape = TINY
    else:
        m = harness.model_shape("qwen3-30b-a3b")
        shape = dict(hidden_size=m.hidden, intermediate_size=m.intermediate,
                     moe_intermediate_size=m.expert_intermediate, num_attention_heads=m.heads,
                     num_key_value_heads=m.kv_heads, head_dim=m.head_dim, num_experts=m.experts,
                     num_experts_per_tok=m.top_k)
    cfg = transformers.Qwen3MoeConfig(vocab_size=1024, num_hidden_layers=layers, norm_topk_prob=True,
                                      max_position_embeddings=32768, initializer_range=0.02, **shape)
    cfg.use_cache = False
    return cfg


def make(cfg, which: str, device, dtype, attention: tuple[str, ...] = ATTENTION):
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3MoeForCausalLM(cfg).to(dtype)
    if which == "peft":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=RANK, lora_alpha=ALPHA, target_modules=list(attention), init_lora_weights=False,
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    else:  # `loraplex train`'s model: its LoRA, routing replay, fused norms, attention for packed rows
        from loraplex.train.attention import register
        from loraplex.train.trainer import TrainConfig, prepare

        model.set_attn_implementation(register())
        prepare(model, TrainConfig("", "", "", rank=RANK, alpha=ALPHA, targets=[*attention, "experts"]))
    return model


def step_time(model, seq_len: int, repeats: int, device, graph: bool = False) -> tuple[float, float]:
    """Median ms of a forward + backward of the whole model on one sequence, and peak GiB.
    PEFT: the model's own loss. loraplex: `loraplex train`'s micro-step (its attention,
    the chunked loss), eager or replayed from a CUDA graph (train/graphed.py)."""
    import torch

    from loraplex.train import data
    from loraplex.train.trainer import graphed_steps, lm_loss_sum, to_device

    ids = torch.randint(0, 1024, (1, seq_len), device=device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    if hasattr(model, "get_base_model"):  # PEFT
        ms = harness.wall_ms(lambda: model(input_ids=ids, labels=ids).loss.backward(), repeats, warmup=1,
                             after=lambda: model.zero_grad(set_to_none=True))
    else:
        batch = to_device(data.pack([data.Example(ids[0].tolist(), ids[0].tolist())], bounds=True), device)
        batch["loss_scale"] = torch.tensor(1.0 / (seq_len - 1), device=device)
        params = [p for p in model.parameters() if p.requires_grad]
        if graph:
            steps = graphed_steps(model, params)
            ms = harness.wall_ms(lambda: steps(batch), repeats, warmup=1,
                                 after=lambda: model.zero_grad(set_to_none=True))
        else:
            ms = harness.wall_ms(lambda: (lm_loss_sum(model, batch) * batch["loss_scale"]).backward(),
                                 repeats, warmup=1, after=lambda: model.zero_grad(set_to_none=True))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    return ms, peak


def moe_step_time(model, cfg, seq_len: int, repeats: int, device, dtype) -> tuple[float, float]:
    """Forward + backward through the stack of MoE blocks alone, input gradient included."""
    import torch

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    blocks = [layer.mlp for layer in inner.model.layers]
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(1, seq_len, cfg.hidden_size, device=device, dtype=dtype, generator=gen)
    grad = torch.randn(x.shape, device=device, dtype=dtype, generator=gen)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    state = {"h": x.clone().requires_grad_(True)}

    def step():
        out = state["h"]
        for block in blocks:
            out = block(out)
            out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)

    def after():  # untimed: gradients cleared, a fresh leaf for the next step
        model.zero_grad(set_to_none=True)
        state["h"] = x.clone().requires_grad_(True)

    ms = harness.wall_ms(step, repeats, warmup=1, after=after)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    return ms, peak


def breakdown(cfg, seq_len: int, device, dtype) -> None:
    """Time each primitive of one MoE layer's LoRA training step at Qwen3-30B-A3B's shapes
    (CUDA events, median of 10 after a warm-up), to see where the step goes."""
    import torch

    from loraplex.train.expert_gemm import gmm, outer, resolve_backend
    from loraplex.train.moe import sort_pairs, sum_by_token

    backend = resolve_backend("auto", device, dtype)
    e, h, i, k, r = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, RANK
    gen = torch.Generator(device).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, generator=gen) * 0.02  # noqa: E731
    x = rnd(seq_len, h)
    top = torch.randn(seq_len, e, device=device, generator=gen).topk(k).indices
    pairs = sort_pairs(top, e)
    tokens, groups = pairs.tokens, pairs.groups
    p = tokens.numel()
    w_gu, w_d = rnd(e, h, 2 * i), rnd(e, i, h)
    a_gu, b_gu, a_d, b_d = rnd(e, h, r), rnd(e, r, 2 * i), rnd(e, i, r), rnd(e, r, h)
    xs, gu, hh, y, g = x[tokens], rnd(p, 2 * i), rnd(p, i), rnd(p, h), rnd(p, h)
    xa = rnd(p, r)

    def ms(fn):
        return harness.events_ms(fn, repeats=10)

    def host_us(fn):  # submission cost alone: calls queued back to back, no waiting
        return harness.host_us(fn, calls=20)

    from loraplex import ops

    kern = ops.backend_for(device)
    wts = torch.rand(p, device=device, dtype=dtype, generator=gen)
    gu32 = rnd(p, 2 * i)

    def eager_act_backward():
        z = gu32.detach().requires_grad_()
        wz = wts.detach().requires_grad_()
        gate, up = z.chunk(2, dim=-1)
        (torch.nn.functional.silu(gate) * up * wz[:, None]).backward(hh)

    rows = {
        "sort_pairs": lambda: sort_pairs(top, e),
        "silu*up*w eager fwd+bwd (autograd)": eager_act_backward,
        "silu*up*w fused fwd (Triton)": lambda: kern.silu_mul_weighted(gu32, wts, pairs.order),
        "silu*up*w fused bwd (Triton)": lambda: kern.silu_mul_weighted_backward(hh, gu32, wts, pairs.order),
        "expand + add_ [P,H] (grouped_mm)": lambda: y.add_(gmm(xa, b_d, groups, backend)),
        "expand added in place [P,H] (Triton)":
            lambda: kern.grouped_lora_add(y, xa, b_d, groups.offsets, 1.0),
        "gather + sum over k [P,H] -> [T,H] (eager)":
            lambda: y[pairs.inv].view(-1, k, h).sum(1),
        "gather x[tokens] [P,H]": lambda: x[tokens],
        "gather index_select(x, 0, tokens) [P,H]": lambda: torch.index_select(x, 0, tokens),
        "gather w[order] [P] (weights)": lambda: wts[pairs.order],
        "gmm gate_up base (fwd)": lambda: gmm(xs, w_gu, groups, backend),
        "gmm gate_up lora shrink+expand (fwd)":
            lambda: gmm(gmm(xs, a_gu, groups, backend), b_gu, groups, backend),
        "silu(gate)*up (fwd)": lambda: torch.nn.functional.silu(gu[:, :i]) * gu[:, i:],
        "gmm down base (fwd)": lambda: gmm(hh, w_d, groups, backend),
        "gmm down lora (fwd)": lambda: gmm(gmm(hh, a_d, groups, backend), b_d, groups, backend),
        "index_add [P,H] -> [T,H]": lambda: x.new_zeros(x.shape).index_add(0, tokens, y),
        "sum_by_token [P,H] -> [T,H] (Triton)": lambda: sum_by_token(y, pairs),
        "gmm down dgrad g@W^T (bwd)": lambda: gmm(g, w_d.transpose(1, 2), groups, backend),
        "gmm gate_up dgrad (bwd)": lambda: gmm(gu, w_gu.transpose(1, 2), groups, backend),
        "outer x^T gxa (grad A gate_up)": lambda: outer(xs, xa, groups, backend),
        "outer xa^T g (grad B gate_up)": lambda: outer(xa, gu, groups, backend),
        "outer h^T gxa (grad A down)": lambda: outer(hh, xa, groups, backend),
        "outer xa^T g (grad B down)": lambda: outer(xa, g, groups, backend),
    }
    print(f"one MoE layer, {seq_len} tokens, {p} pairs, backend {backend}: GPU time, host time per call")
    for name, fn in rows.items():
        print(f"  {name:44s} {ms(fn):8.3f} ms  host {host_us(fn):6.1f} us/call")


def profile(model, cfg, which: str, seq_len: int, device, dtype) -> None:
    """torch.profiler over two MoE-only steps: the kernels each side spends its time in."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    moe_step_time(model, cfg, seq_len, 1, device, dtype)  # warm-up, compiles, allocator
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        moe_step_time(model, cfg, seq_len, 1, device, dtype)
    print(f"\n=== {which}, MoE blocks alone, {seq_len} tokens, {cfg.num_hidden_layers} layers, 2 steps")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
    print(prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=30, max_shapes_column_width=60))


def build_parser():
    p = harness.parser(__doc__)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke test)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--moe-only", action="store_true", help="time the MoE blocks alone")
    p.add_argument("--experts-only", action="store_true", help="LoRA on the experts alone (not attention)")
    p.add_argument("--sides", nargs="+", default=["loraplex-graph", "peft"],
                   choices=["loraplex", "loraplex-graph", "peft"],
                   help="what runs: loraplex eager, loraplex's step from a CUDA graph (whole model "
                        "only; on a GPU), transformers + PEFT")
    p.add_argument("--breakdown", action="store_true", help="time one layer's primitives (CUDA)")
    p.add_argument("--profile", action="store_true", help="kernel table of the MoE-only step, both sides")
    p.add_argument("--host-profile", action="store_true", help="cProfile of loraplex's MoE-only steps")
    p.add_argument("--check-syncs", action="store_true",
                   help="one loraplex MoE-only step under CUDA sync debug mode: where the host waits")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    import torch

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = build(args.layers, args.tiny)
    attention = () if args.experts_only else ATTENTION
    if args.moe_only and "loraplex-graph" in args.sides:
        build_parser().error("--moe-only times eager sides: --sides loraplex peft")
    if args.breakdown:
        for s in args.seq_lens:
            breakdown(cfg, s, device, dtype)
        return
    if args.host_profile:  # cProfile of loraplex's MoE-only steps: where the host's time goes
        import cProfile
        import pstats

        model = make(cfg, "loraplex", device, dtype)
        moe_step_time(model, cfg, args.seq_lens[0], 2, device, dtype)
        prof = cProfile.Profile()
        prof.enable()
        moe_step_time(model, cfg, args.seq_lens[0], 10, device, dtype)
        prof.disable()
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumtime").print_stats(45)
        return
    if args.check_syncs:
        import warnings

        model = make(cfg, "loraplex", device, dtype, attention)

        def one_step(model=model):
            if args.moe_only:
                moe_step_time(model, cfg, args.seq_lens[0], 1, device, dtype)
            else:
                model(input_ids=ids, labels=ids).loss.backward()

        ids = torch.randint(0, 1024, (1, args.seq_lens[0]), device=device)
        one_step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            one_step()
            torch.cuda.set_sync_debug_mode(0)
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        print(f"{len(syncs)} implicit host syncs in one {'MoE-only' if args.moe_only else 'whole'} step")
        for w in syncs:
            print(" ", w.filename, w.lineno, str(w.message)[:100])
        return
    rows = []
    for which in args.sides:
        model = make(cfg, which.removesuffix("-graph"), device, dtype, attention)
        if args.profile:
            for s in args.seq_lens:
                profile(model, cfg, which, s, device, dtype)
            del model
            continue
        base = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        for s in args.seq_lens:
            try:
                ms, peak = (moe_step_time(model, cfg, s, args.repeats, device, dtype) if args.moe_only
                            else step_time(model, s, args.repeats, device, which.endswith("-graph")))
            except torch.OutOfMemoryError:
                ms, peak = float("nan"), float("nan")
                torch.cuda.empty_cache()
            rows.append((which, s, ms, peak, base))
            print(f"{which:14s} seq {s:6d}: {ms:9.1f} ms/step, peak {peak:6.2f} GiB (weights {base:.2f} GiB)",
                  flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.profile:
        return
    print(f"\n{'MoE blocks alone' if args.moe_only else 'whole model'}, {args.layers} layers")
    for side in (w for w in args.sides if w != "peft" and "peft" in args.sides):
        print(f"\n| seq len | {side} ms | PEFT ms | speedup | {side} peak GiB | PEFT peak GiB "
              "| memory saved |")
        print("|---|---|---|---|---|---|---|")
        for s in args.seq_lens:
            a = next(r for r in rows if r[0] == side and r[1] == s)
            b = next(r for r in rows if r[0] == "peft" and r[1] == s)
            print(f"| {s} | {a[2]:.1f} | {b[2]:.1f} | {b[2] / a[2]:.2f}x | {a[3]:.2f} | {b[3]:.2f} "
                  f"| {1 - a[3] / b[3]:.0%} |")
    harness.write_json(args.out, [dict(side=w, seq_len=s, ms=ms, peak_gib=peak, weights_gib=base)
                                  for w, s, ms, peak, base in rows], args)


if __name__ == "__main__":
    main()
