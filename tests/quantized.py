"""Checkpoints in the layouts quantized models are published in, written from a tiny
bf16/fp32 model, beside the same model with the dequantized weights (the oracle's)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from loraplex import LoRARequest, SamplingParams

# The decoder's linear weights a quantized checkpoint stores quantized (routers stay as they are).
LINEAR = re.compile(r"\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
                    r"|mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$")


def _rewrite(src: Path, quantized_dir: Path, oracle_dir: Path, quantization_config: dict, convert) -> None:
    """Both directories start as copies of src; each linear weight W becomes convert(name,
    W) -> (quantized tensors by name, dequantized W) in them."""
    for d in (quantized_dir, oracle_dir):
        shutil.copytree(src, d)
    tensors = load_file(str(src / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if LINEAR.search(name):
            parts, w = convert(name, t)
            quantized.update(parts)
            dequantized[name] = w.to(t.dtype)
        else:
            quantized[name] = dequantized[name] = t
    save_file(quantized, str(quantized_dir / "model.safetensors"))
    save_file(dequantized, str(oracle_dir / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (quantized_dir / "config.json").write_text(json.dumps(config))


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, weight_scale_inv [ceil(N / bn), ceil(K / bk)]) as DeepSeek / Qwen
    FP8 checkpoints hold them: W ~= weight * scale_inv, one scale per [bn, bk] block."""
    n, k = w.shape
    bn, bk = block
    padded = torch.nn.functional.pad(w.float(), (0, -k % bk, 0, -n % bn))
    blocks = padded.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))  # [N/bn, bn, K/bk, bk]
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).flatten(2).flatten(0, 1)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale


def fp8_block_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
    return q.float() * full


def write_fp8_block(src: Path, out: Path, block=(128, 128)) -> tuple[Path, Path]:
    """(the FP8 checkpoint, its dequantized twin) of the model at src."""
    def convert(name, t):
        q, scale = fp8_block_quantize(t, block)
        return {name: q, f"{name}_scale_inv": scale}, fp8_block_dequantize(q, scale, block)

    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(block)}
    quantized_dir, oracle_dir = out / "fp8", out / "dequantized"
    _rewrite(src, quantized_dir, oracle_dir, config, convert)
    return quantized_dir, oracle_dir



def write_dequantized(src: Path, out: Path, round_trip) -> Path:
    """src with each linear weight W replaced by round_trip(W) (quantized and back): the
    oracle of a model quantized as it loads."""
    def convert(name, t):
        return {name: t}, round_trip(t)

    _rewrite(src, out / "unused", out / "dequantized", {}, convert)
    return out / "dequantized"


# -- serving a checkpoint against its dequantized twin ------------------------------------

# bf16 W8A8 against its twin: the spread of tolerance() this many times over.
W8A8_BF16_SPREAD = 3

PROMPT_SCORING = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)


def prompt_logprobs_of(out, prompt) -> torch.Tensor:
    return torch.tensor([x[t].logprob for x, t in zip(out.prompt_logprobs[1:], prompt[1:])])


def quantize_linear_inputs(model: torch.nn.Module, block: int) -> None:
    """Make a transformers (+ PEFT) model on dequantized FP8 weights compute as W8A8
    serving does (--fp8-activations dynamic): each quantized linear layer (LINEAR's
    names; under an adapted one, PEFT's base_layer: the adapter keeps the unquantized
    input) and each fused experts module's matmuls see their input as
    dequantized_activations(x, block)."""
    import torch.nn.functional as F

    from loraplex.ops.reference.quant import dequantized_activations

    def fake(x):
        return dequantized_activations(x, block).to(x.dtype)

    names = re.compile(r"(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)(\.base_layer)?$")
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and names.search(name):
            module.register_forward_pre_hook(lambda m, args: (fake(args[0]), *args[1:]))
        elif type(module).__name__.endswith("Experts") and hasattr(module, "gate_up_proj"):
            if getattr(module, "config", None) is not None:  # the loop over experts, through F.linear
                module.config._experts_implementation = "eager"

            def forward(*args, _forward=module.forward, **kwargs):
                linear = F.linear
                F.linear = lambda x, w, b=None: linear(fake(x), w, b)
                try:
                    return _forward(*args, **kwargs)
                finally:
                    F.linear = linear
            module.forward = forward


def check_against_twin(llm, oracle_dir, prompts, adapter_dir=None, moe=False, act_block: int = 0) -> None:
    """Each prompt's logprobs against transformers (+ PEFT) on the dequantized twin,
    served in one batch with base rows beside the adapter's (MoE: test_moe's criterion,
    as a bf16 router near a tie may pick another expert). act_block: the twin quantizes
    its linear layers' inputs as W8A8 serving does (quantize_linear_inputs)."""
    from conftest import DTYPE, HFOracle, tolerance
    from test_moe import _assert_close

    lora = LoRARequest("a", 1, str(adapter_dir)) if adapter_dir else None
    loras = [lora if i % 2 == 0 else None for i in range(len(prompts))]
    outs = llm.generate(prompts, PROMPT_SCORING, loras, use_tqdm=False)
    oracles = {None: HFOracle(oracle_dir)}
    if lora is not None:
        oracles[lora] = HFOracle(oracle_dir, adapter_dir)
    # In bf16 the twin rounds each dequantized activation and weight to bf16 (loraplex
    # multiplies e4m3 values in float32), and a last-bit difference upstream moves an
    # activation's e4m3 rounding by a 1/16 step now and then: W8A8 widens the spread.
    spread = W8A8_BF16_SPREAD if act_block and DTYPE != "float32" else 1
    if act_block:
        for oracle in oracles.values():
            quantize_linear_inputs(oracle.model, act_block)
    for p, out, adapter in zip(prompts, outs, loras):
        want = oracles[adapter].prompt_logprobs(p)
        if moe:
            _assert_close(prompt_logprobs_of(out, p), want)
        else:
            torch.testing.assert_close(prompt_logprobs_of(out, p), want, atol=tolerance() * spread, rtol=0)


def write_tiny_qwen3_moe(out_dir: Path) -> Path:
    """A tiny Qwen3-MoE (8 experts, top-2, 2 layers) with random weights."""
    import transformers

    from loraplex.bench.synthetic import write_random_model

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=384, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, initializer_range=0.08)
    return write_random_model(out_dir, cfg, 0, None)
