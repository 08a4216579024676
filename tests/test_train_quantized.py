"""LoRA training on a frozen quantized base (train/quantized.py, train/quantized_base.py):
MXFP4 gpt-oss, FP8 block-scaled (dense, and Qwen3-MoE's per-expert layout), AWQ / GPTQ
int4, and a bf16 checkpoint quantized to FP8 as it loads. Each is written from a tiny
model in its published layout beside its dequantized twin (the writers of the serving
tests); the loss and LoRA gradients on the quantized base must be PEFT's on the twin,
the quantized weights must never be saved dequantized for backward, and an adapter
trained on the MXFP4 base must serve (loraplex, on the MXFP4 checkpoint) as PEFT
computes it on the twin."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from conftest import DEVICE, build_tiny_model, random_prompts
from quantized import check_against_twin, write_dequantized, write_fp8_block, write_tiny_qwen3_moe
from safetensors.torch import load_file, save_file
from test_gpt_oss import tiny_config
from test_quant_int4 import write_int4
from test_quant_mxfp4 import write_mxfp4
from test_train import _batch, _loss_and_grads, _memorize_records, _train, _write_jsonl, assert_peft_agrees

from loraplex.bench.synthetic import write_random_model
from loraplex.errors import ModelLoadError
from loraplex.ops.formats import Fp8Weight, Int4Weight, Mxfp4Weight
from loraplex.ops.reference.quant import dequantize, quantize_fp8
from loraplex.train.lora import LoRAExperts, lora_parameters
from loraplex.train.moe import ExpertProjection
from loraplex.train.quantized import FrozenWeight, QuantizedLinear
from loraplex.train.quantized_base import load_quantized_base
from loraplex.train.trainer import TrainConfig, prepare


@pytest.fixture(autouse=True)
def _expert_slices_of_a_few_experts(monkeypatch):
    """Expert GEMMs over quantized stacks in slices: here one gate/up matrix or three
    down matrices of the tiny models (8 experts: uneven slices)."""
    from loraplex.train import quantized

    monkeypatch.setattr(quantized, "EXPERT_SLICE_BYTES", 3 * 8192)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """name -> (quantized checkpoint, dequantized twin, --quantization or None)."""
    root = tmp_path_factory.mktemp("quantized-bases")
    gpt_oss = write_random_model(root / "gpt-oss", tiny_config(num_hidden_layers=2), 0)
    llama = build_tiny_model(root / "llama", "llama")
    qwen3 = build_tiny_model(root / "qwen3", "qwen3")
    moe = write_tiny_qwen3_moe(root / "qwen3moe")
    return {
        "mxfp4 gpt-oss": (*write_mxfp4(gpt_oss, root / "mxfp4"), None),
        "fp8 qwen3": (*write_fp8_block(qwen3, root / "fp8-dense", (16, 32)), None),
        "fp8 qwen3-moe": (*write_fp8_block(moe, root / "fp8-moe", (16, 32)), None),
        "awq llama": (*write_int4(llama, root / "awq", "awq"), None),
        "gptq llama": (*write_int4(llama, root / "gptq", "gptq_asym"), None),
        "fp8 at load qwen3-moe": (moe, write_dequantized(moe, root / "online",
                                                         lambda w: dequantize(quantize_fp8(w, 128))), "fp8"),
        "fp8 at load gpt-oss": (gpt_oss, write_dequantized(
            _fp8_round_trip_experts(gpt_oss, root / "online-experts"), root / "online-gpt-oss",
            lambda w: dequantize(quantize_fp8(w, 128))), "fp8"),
    }


def _fp8_round_trip_experts(src, out):
    """gpt-oss at src with its expert stacks ([E, in, out]) round-tripped through FP8 as
    a load-time quantization makes them (per output row, 128 inputs a scale);
    write_dequantized does the attention projections."""
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = t.transpose(1, 2).float()
            tensors[name] = torch.stack([dequantize(quantize_fp8(r, 128)) for r in rows]).transpose(1, 2)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def _quantized_model(base_dir, quantization, **cfg):
    model = load_quantized_base(base_dir, "cpu", torch.float32, quantization)
    cfg = TrainConfig(str(base_dir), "", "", rank=4, alpha=8, moe_backend="loop", **cfg)
    spec, wrapped = prepare(model, cfg)
    with torch.no_grad():  # B starts at zero: make every factor matter
        gen = torch.Generator().manual_seed(1)
        for p in lora_parameters(wrapped):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.train(), spec, wrapped


@pytest.mark.parametrize("name", ["mxfp4 gpt-oss", "fp8 qwen3", "fp8 qwen3-moe", "awq llama", "gptq llama",
                                  "fp8 at load qwen3-moe", "fp8 at load gpt-oss"])
def test_loss_and_grads_match_peft_on_the_dequantized_base(name, bases, tmp_path):
    base_dir, twin_dir, quantization = bases[name]
    model, spec, wrapped = _quantized_model(base_dir, quantization)
    fmt = {"mxfp4": Mxfp4Weight, "fp8": Fp8Weight, "awq": Int4Weight, "gptq": Int4Weight}[name.split()[0]]
    frozen = [m.qweight for m in model.modules() if isinstance(m, FrozenWeight)]
    assert frozen and all(isinstance(w, fmt) for w in frozen)
    if name.startswith("mxfp4") or "moe" in name or "gpt-oss" in name:  # experts trained on quantized stacks
        stacks = [m.base_layer.gate_up_proj for m in wrapped.values() if isinstance(m, LoRAExperts)]
        assert stacks and all(isinstance(w, FrozenWeight) for w in stacks)
    # MXFP4 quantizes gpt-oss's experts alone: attention stays in the model's dtype.
    assert any(isinstance(m, QuantizedLinear) for m in model.modules()) == (not name.startswith("mxfp4"))
    batch = _batch()
    loss, grads = _loss_and_grads(model, wrapped, batch)
    for key, g in grads.items():
        assert g.abs().max() > 0, key

    assert_peft_agrees(twin_dir, wrapped, spec, batch, loss, grads, tmp_path / "ad")


def _saved_numels(fn) -> list[int]:
    numels = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: numels.append(t.numel()) or t, lambda t: t):
        fn().sum().backward()
    return numels


def test_quantized_weights_are_not_saved_for_backward(bases):
    """A quantized linear layer and a quantized expert stack keep their bf16 values only
    while they are used: autograd saves no tensor of the weight's size (the backward
    dequantizes again), and the input's gradient is the dequantized weight's."""
    model = load_quantized_base(bases["fp8 qwen3"][0], "cpu", torch.float32)
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantizedLinear)
    x = torch.randn(3, 5, layer.in_features, requires_grad=True)
    w = layer.weight()
    assert w.numel() not in _saved_numels(lambda: layer(x))
    want = torch.autograd.grad((x @ w.T).pow(2).sum(), x)[0]
    x.grad = None
    layer(x).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, want)

    experts = load_quantized_base(bases["mxfp4 gpt-oss"][0], "cpu", torch.float32).model.layers[0].mlp.experts
    stack = experts.gate_up_proj
    assert isinstance(stack, FrozenWeight) and stack.transposed and stack().shape == stack.shape
    from loraplex.train.moe import sort_pairs

    top_k = torch.randint(0, stack.shape[0], (6, 2))
    pairs = sort_pairs(top_k, stack.shape[0])
    h = torch.randn(6, stack.shape[1], requires_grad=True)
    slices = stack.experts(transpose=True)
    assert slices.shape == tuple(stack.shape) and slices.chunk == 1  # one expert a slice (the fixture)
    saved = _saved_numels(lambda: ExpertProjection.apply(h, slices, None, None, 1.0, pairs.groups, "loop",
                                                         pairs))
    assert all(n < stack().numel() // stack.shape[0] for n in saved if n != h.numel())
    want = torch.stack([h[t] @ stack()[e] for t, e in zip(pairs.tokens.tolist(), pairs.experts.tolist())])
    got = ExpertProjection.apply(h, slices, None, None, 1.0, pairs.groups, "loop", pairs)
    torch.testing.assert_close(got, want)


def test_trained_adapter_serves_on_the_mxfp4_base(bases, tmp_path):
    """`loraplex train` on gpt-oss's MXFP4 checkpoint: the loss falls, and the adapter,
    served by loraplex on the same MXFP4 checkpoint, gives the prompt logprobs
    transformers + PEFT give on the dequantized twin, mixed with base rows."""
    from conftest import make_llm

    base_dir, twin_dir, _ = bases["mxfp4 gpt-oss"]
    jsonl = _write_jsonl(tmp_path / "data.jsonl", _memorize_records(0, False))
    losses = _train(base_dir, jsonl, tmp_path / "ad", "--epochs", "15", "--gradient-checkpointing",
                    "--device", DEVICE, "--no-packing")
    assert len(losses) == 15 and losses[-1] < 0.5 * losses[0]
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    check_against_twin(make_llm(base_dir), twin_dir, random_prompts(4, (6, 20), seed=5), tmp_path / "ad",
                       moe=True)


def test_fp8_at_load_takes_the_flag_and_other_formats_need_their_checkpoint(bases, tmp_path):
    base_dir = bases["fp8 at load qwen3-moe"][0]
    with pytest.raises(ModelLoadError, match="only to fp8"):
        load_quantized_base(base_dir, "cpu", torch.float32, "awq")
    with pytest.raises(ModelLoadError, match="cannot apply"):
        load_quantized_base(bases["awq llama"][0], "cpu", torch.float32, "fp8")
    jsonl = _write_jsonl(tmp_path / "data.jsonl", _memorize_records(0, False))
    losses = _train(base_dir, jsonl, tmp_path / "ad", "--epochs", "2", "--quantization", "fp8",
                    "--device", "cpu")
    assert len(losses) == 2 and all(loss == loss for loss in losses)


@pytest.mark.parametrize("damage", ["missing scales", "nan scale", "stray tensor", "missing tensor"])
def test_malformed_quantized_checkpoints_fail_at_load(bases, tmp_path, damage):
    src = bases["mxfp4 gpt-oss"][0]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    path = bad / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.0.mlp.experts.down_proj_scales"
    if damage == "missing scales":
        del tensors[name]
    elif damage == "nan scale":
        tensors[name] = torch.full_like(tensors[name], 255)
    elif damage == "stray tensor":
        tensors["model.layers.0.mlp.experts.extra"] = torch.zeros(3)
    else:
        del tensors["model.layers.1.self_attn.q_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    words = {"missing scales": "lacks", "nan scale": "NaN", "stray tensor": "no parameter",
             "missing tensor": "not in the checkpoint"}[damage]
    with pytest.raises(ModelLoadError, match=words):
        load_quantized_base(bad, "cpu", torch.float32)


@pytest.mark.parametrize("fmt, shape, block_k", [
    ("mxfp4", (3, 40, 96), 32), ("mxfp4", (17, 288), 32), ("fp8", (2, 19, 200), 128), ("fp8", (33, 70), 70)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dequantize_kernel_is_the_reference_bit_for_bit(fmt, shape, block_k, dtype):
    """The Triton dequantization a GPU trains with (ops/triton/dequantize.py) against the
    torch reference: leading dims, rows and columns off the block sizes, scales of
    different magnitudes (e8m0 2^-125, the smallest whose products stay normal, and
    2^127, whose largest overflow to inf as they do in the reference)."""
    from loraplex.ops.reference.quant import quantize_mxfp4
    from loraplex.ops.triton.dequantize import dequantize as dequantize_kernel

    gen = torch.Generator().manual_seed(0)
    values = torch.randn(shape, generator=gen) * 0.05
    values[..., : shape[-1] // 3] *= 64
    w = quantize_fp8(values, block_k) if fmt == "fp8" else quantize_mxfp4(values)
    w.dtype = dtype
    if fmt == "mxfp4":
        w.scale[(0,) * (w.scale.dim() - 1)][:2] = torch.tensor([2, 254], dtype=torch.uint8)
    w = w.to(DEVICE)
    weights = [w]
    if fmt == "mxfp4":  # scale rows as Mxfp4Weight pads them, and contiguous
        weights.append(copy.deepcopy(w))
        weights[-1].scale = w.scale.contiguous()
    for w in weights:
        got = dequantize_kernel(w)
        assert got.dtype == dtype and got.shape == w.shape
        assert torch.equal(got.cpu(), dequantize(w).cpu())
