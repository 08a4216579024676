"""The training loop: AdamW over the LoRA tensors only, gradient accumulation, warmup +
cosine (or constant) learning rate, a progress bar with loss and tokens/s, checkpoints
that resume bit-identically on CPU, and the final PEFT adapter.

A step is one optimizer update over `grad_accum` micro-batches; its loss is the mean over
every trained token of those micro-batches (each micro-batch's summed loss is divided by
the step's token count before its backward, so accumulation equals one large batch).
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from loraplex.train import attention as train_attention
from loraplex.train import data
from loraplex.train.checkpoint import checkpoints, load_checkpoint, save_checkpoint
from loraplex.train.expert_gemm import resolve_backend
from loraplex.train.graphed import GraphedSteps, row_length
from loraplex.train.lora import LoRAExperts, LoRASpec, default_targets, inject_lora, lora_parameters
from loraplex.train.loss import chunked_loss_sum
from loraplex.train.norms import install_fused_norms
from loraplex.train.quantized import FrozenWeight, QuantizedLinear
from loraplex.train.quantized_base import is_quantized_checkpoint, load_quantized_base
from loraplex.train.rope import install_fused_rope
from loraplex.train.routing import install_routing_replay
from loraplex.train.save import save_adapter


@dataclass
class TrainConfig:
    model: str
    data: str
    out: str
    rank: int = 16
    alpha: float | None = None  # default 2 * rank
    targets: list[str] | None = None  # default: lora.default_targets(model)
    rslora: bool = False
    lr: float = 2e-4
    epochs: int = 1
    max_steps: int | None = None
    max_seq_len: int = 2048
    batch_size: int = 4
    grad_accum: int = 1
    gradient_checkpointing: bool = False
    seed: int = 0
    warmup_steps: int = 0
    lr_scheduler: str = "cosine"  # or "constant"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    save_steps: int = 200
    resume: str | None = None  # a checkpoint dir, or "latest" (in `out`)
    moe_backend: str = "auto"
    # A bf16 checkpoint's base quantized as it loads ("fp8"); a quantized checkpoint
    # (quantization_config) trains on its own format either way (train/quantized.py).
    quantization: str | None = None
    # A micro-batch's examples as one row (data.pack), no padding: None packs where the
    # model bounds packed examples' attention (packing_supported), True insists.
    packing: bool | None = None
    # Each micro-step replayed from a CUDA graph (train/graphed.py), rows padded to a few
    # lengths: None does so on a GPU where train/attention.py bounds the packed rows.
    cuda_graph: bool | None = None
    device: str = "auto"
    dtype: str = "auto"  # bf16 on CUDA, float32 on CPU
    progress: bool = True


# What a resumed run may change: where and how it runs, when it stops or checkpoints.
_RESUMABLE_CHANGES = ("out", "resume", "progress", "max_steps", "save_steps", "device", "dtype",
                      "moe_backend", "gradient_checkpointing", "packing", "cuda_graph")
# What lm_loss_sum hands the decoder of a batch (the rest: labels, counts).
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                "max_length_q", "max_length_k")


def to_device(batch: dict[str, torch.Tensor | int], device, keys=(*MODEL_INPUTS, "labels")) -> dict:
    """The batch's entries named in `keys`, tensors moved to `device` (ints as they are)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items() if k in keys}


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy of each token predicting the next labelled one, from whole
    logits: the definition lm_loss_sum computes in chunks (tests compare the two)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=data.IGNORE, reduction="sum")


def lm_loss_sum(model, batch: dict[str, torch.Tensor | int], sync_free: bool = False) -> torch.Tensor:
    """The batch's summed next-token loss from the decoder's hidden states, in chunks
    (train/loss.py: no [tokens, vocab] logits)."""
    inputs = {k: v for k, v in batch.items() if k in MODEL_INPUTS}
    if "attention_mask" in inputs and train_attention.in_use(model):
        # transformers hands a custom attention no padding mask: padding would be attended to
        raise ValueError("a padded batch for loraplex's training attention, which bounds packed rows only")
    # No KV cache: transformers bounds packed examples' attention only without one.
    hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
    softcap = getattr(model.config, "final_logit_softcapping", None)
    return chunked_loss_sum(hidden, model.get_output_embeddings().weight, batch["labels"], softcap,
                            sync_free=sync_free)


def _schedule(cfg: TrainConfig, total: int):
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.lr_scheduler == "constant":
            return 1.0
        progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def make_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; on a GPU its fused kernel (no per-step temporaries the size of the LoRA
    tensors, which the foreach default allocates: memory a quantized base's step lacks)."""
    fused = params[0].device.type == "cuda"
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused or None)


def training_attention(model_dir: str, device: torch.device, packing: bool | None = None) -> str | None:
    """The attention implementation to train with (None: transformers' default):
    - loraplex's (train/attention.py: causal rows bounded by the packed examples, cuDNN /
      flash kernels, no masks, no host syncs) for packed rows of models that take SDPA
      and have neither sinks nor softcapped attention logits;
    - FlexAttention on a GPU for models whose only other choice is eager attention
      (gpt-oss: sinks), which would hold [heads, tokens, tokens] scores (64 x 4K x 4K
      floats a layer at 4K tokens). Flex keeps the sliding windows as block masks and
      adds the sinks through the log-sum-exp;
    - otherwise transformers' default (padded batches: SDPA with their mask)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    sdpa = cls is None or getattr(cls, "_supports_sdpa", True)
    if packing is not False and sdpa and getattr(text, "attn_logit_softcapping", None) is None:
        return train_attention.register()
    if device.type != "cuda" or sdpa or not getattr(cls, "_supports_flex_attn", False):
        return None
    return "flex_attention"


def load_model(cfg: TrainConfig):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cuda = torch.cuda.is_available()
    device = torch.device(cfg.device if cfg.device != "auto" else "cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = dtype if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
    attention = training_attention(cfg.model, device, cfg.packing)
    if cfg.quantization or is_quantized_checkpoint(cfg.model):
        model = load_quantized_base(cfg.model, device, dtype, cfg.quantization, attn_implementation=attention)
    else:
        kwargs = {"attn_implementation": attention} if attention else {}
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype, **kwargs).to(device)
    model.config.use_cache = False
    return model, AutoTokenizer.from_pretrained(cfg.model)


def prepare(model, cfg: TrainConfig):
    """Inject LoRA (seeded), routing replay, fused norms and RoPE, gradient checkpointing ->
    (spec, wrapped)."""
    param = next(model.parameters())
    spec = LoRASpec(cfg.rank, float(cfg.alpha if cfg.alpha is not None else 2 * cfg.rank),
                    tuple(cfg.targets or default_targets(model)), cfg.rslora)
    torch.manual_seed(cfg.seed)
    wrapped = inject_lora(model, spec, resolve_backend(cfg.moe_backend, param.device, param.dtype))
    install_routing_replay(model)
    install_fused_norms(model)
    install_fused_rope(model)
    if cfg.gradient_checkpointing:
        enable_checkpointing(model, preserve_rng_state=not uses_graphs(model, cfg))
    return spec, wrapped


def uses_graphs(model, cfg: TrainConfig) -> bool:
    """Whether micro-steps replay CUDA graphs: on a GPU where train/attention.py bounds
    the rows (transformers' masks read the host), unless cfg.cuda_graph says no. Steps
    known to wait for the host are left eager: the per-expert loop reads each expert's
    row count, a quantized base's experts are made a slice at a time from them. (A step
    that turns out to wait anyway runs eagerly too: graphed.NotCapturable.)"""
    host_bound = any((isinstance(m, LoRAExperts) and m.backend == "loop") or isinstance(m, QuantizedLinear)
                     or isinstance(getattr(m, "gate_up_proj", None), FrozenWeight) for m in model.modules())
    able = next(model.parameters()).is_cuda and train_attention.in_use(model) and not host_bound
    if cfg.cuda_graph and not able:
        raise ValueError("--cuda-graph needs a GPU, packed rows of a model loraplex's training attention "
                         "takes (no attention sinks or softcapping), grouped expert GEMMs and a bf16 base")
    return able if cfg.cuda_graph is None else cfg.cuda_graph


def enable_checkpointing(model, preserve_rng_state: bool = True) -> None:
    """Recompute each decoder layer in backward (torch's non-reentrant checkpoint). A
    CUDA graph cannot read the generator's state to the host: with graphs the recompute
    does not replay random draws (LoRA training here draws none)."""
    kwargs = {"use_reentrant": False, "preserve_rng_state": preserve_rng_state}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def accumulate(model, batches: list[dict[str, torch.Tensor | int]],
               graphed: GraphedSteps | None = None) -> float:
    """Forward + backward of a step's micro-batches (replayed from `graphed`'s CUDA graphs
    if given); returns the step's mean token loss."""
    n_trained = max(1, sum(int((b["labels"][:, 1:] != data.IGNORE).sum()) for b in batches))
    device = next(model.parameters()).device
    total = 0.0
    for b in batches:
        b = to_device(b, device)
        if graphed is not None:
            b["loss_scale"] = torch.tensor(1.0 / n_trained, device=device)
            total += graphed(b).item()
            continue
        loss = lm_loss_sum(model, b) / n_trained
        loss.backward()
        total += loss.item()
    return total


def graphed_steps(model, params: list[torch.nn.Parameter]) -> GraphedSteps:
    return GraphedSteps(lambda b: lm_loss_sum(model, b, sync_free=True) * b["loss_scale"], params)


def train(cfg: TrainConfig) -> list[float]:
    """Run the training; returns the loss of each step this run took."""
    out = Path(cfg.out)
    model, tokenizer = load_model(cfg)
    spec, wrapped = prepare(model, cfg)
    params = lora_parameters(wrapped)
    examples = data.load_examples(cfg.data, tokenizer, cfg.max_seq_len)
    pad_id = next(t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if t is not None)
    per_epoch = math.ceil(len(examples) / cfg.batch_size)
    micro_total = per_epoch * cfg.epochs
    total = math.ceil(micro_total / cfg.grad_accum)
    total = min(total, cfg.max_steps) if cfg.max_steps else total
    opt = make_optimizer(params, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(cfg, total))
    fingerprint = {k: v for k, v in asdict(cfg).items() if k not in _RESUMABLE_CHANGES}
    step = 0
    if cfg.resume:
        found = checkpoints(out) if cfg.resume == "latest" else [Path(cfg.resume)]
        if found:  # "latest" with none yet starts from scratch
            step = load_checkpoint(found[-1], wrapped, opt, sched, fingerprint)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "train_log.jsonl"
    kept = log.read_text().splitlines() if step and log.exists() else []
    log.write_text("".join(line + "\n" for line in kept if json.loads(line)["step"] <= step))

    @functools.lru_cache(maxsize=2)
    def epoch(e: int) -> list[list[int]]:
        return data.epoch_batches(len(examples), cfg.batch_size, cfg.seed, e)

    bounded = train_attention.in_use(model)  # rows bounded by cu_seq_lens
    packing = cfg.packing is not False and packing_supported(model)
    if cfg.packing and not packing:
        raise ValueError(f"--packing: {type(model).__name__} in transformers lets packed examples attend "
                         "across their boundaries; train with --no-packing")
    graphed = graphed_steps(model, params) if uses_graphs(model, cfg) else None

    def micro_batch(m: int) -> dict[str, torch.Tensor | int]:
        e, pos = divmod(m, per_epoch)
        chosen = [examples[i] for i in epoch(e)[pos]]
        if graphed is not None:  # a few fixed shapes: rows padded, boundaries in batch_size + 1 slots
            length = row_length(sum(len(x.input_ids) for x in chosen))
            return data.pack(chosen, bounds=True, length=length, slots=cfg.batch_size + 1, pad_id=pad_id)
        return data.pack(chosen, bounds=bounded) if packing else data.collate(chosen, pad_id)

    from tqdm.auto import tqdm

    model.train()
    bar = tqdm(total=total, initial=step, desc="train", disable=not cfg.progress)
    losses = []
    while step < total:
        t0 = time.perf_counter()
        ms = range(step * cfg.grad_accum, min((step + 1) * cfg.grad_accum, micro_total))
        batches = [micro_batch(m) for m in ms]
        loss = accumulate(model, batches, graphed)
        if cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        losses.append(loss)
        tokens = sum(data.num_tokens(b) for b in batches)
        tok_s = tokens / (time.perf_counter() - t0)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:.0f}", lr=f"{lr:.2e}", peak=_peak_memory())
        bar.update(1)
        with log.open("a") as f:
            f.write(json.dumps({"step": step, "loss": loss, "lr": lr, "tokens": tokens}) + "\n")
        if cfg.save_steps and step % cfg.save_steps == 0 and step < total:
            ckpt = out / f"checkpoint-{step}"
            save_checkpoint(ckpt, wrapped, spec, cfg.model, opt, sched, step, fingerprint)
            for old in checkpoints(out)[:-2]:
                shutil.rmtree(old)  # keep the two newest
    bar.close()
    save_adapter(out, wrapped, spec, cfg.model)
    _plot_losses(log, out / "loss.png")
    return losses


@torch.no_grad()
def packing_supported(model) -> bool:
    """Whether the model keeps packed examples apart: the second of two packed examples
    gets the logits it gets alone (transformers reads restarting position ids as
    boundaries for most architectures; gpt-oss's attention does not). A leak moves the
    boundary's logits by far more than the rounding of another batch shape."""
    device = next(model.parameters()).device
    first, second = torch.arange(3, 10, device=device), torch.arange(11, 16, device=device)
    packed = data.pack([data.Example(x.tolist(), x.tolist()) for x in (first, second)],
                       bounds=train_attention.in_use(model))
    alone = model(input_ids=second[None], use_cache=False).logits[0].float()
    inputs = to_device(packed, device, MODEL_INPUTS)
    together = model(**inputs, use_cache=False).logits[0, len(first):].float()
    return bool((together - alone).abs().max() <= 0.05 * alone.abs().max())


def _peak_memory() -> str:
    """The device's peak allocated memory so far (GPU), or the process's peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"{torch.cuda.max_memory_allocated() / 2**30:.1f}GiB"
    import resource

    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f}GiB"  # KiB on Linux


def _plot_losses(log: Path, png: Path) -> None:
    """The loss curve of train_log.jsonl (every step of the run, resumed ones too)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no loss curve: matplotlib is not installed (pip install 'loraplex[plot]'); "
              f"the losses are in {log}")
        return
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows])
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean per trained token)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
