"""Quantized bases (ops/formats): checkpoints in the published layouts load, and
serve (with adapters on top, mixed with base rows) the prompt logprobs and tokens
transformers + PEFT give on their dequantized weights; malformed ones fail at load."""

from __future__ import annotations

import json

import pytest
from conftest import (
    ADAPTERS,
    build_tiny_model,
    make_llm,
    make_peft_adapter,
    random_prompts,
)
from quantized import (
    PROMPT_SCORING,
    check_against_twin,
    write_dequantized,
    write_fp8_block,
    write_tiny_qwen3_moe,
)
from safetensors.torch import load_file, save_file
from torch import nn

from loraplex.errors import ModelLoadError
from loraplex.ops.formats import Fp8Weight

SP = PROMPT_SCORING


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("dense") / "qwen3", "qwen3")


@pytest.mark.parametrize("block", [(128, 128), (16, 32)], ids=["128x128", "16x32"])
def test_fp8_block_checkpoint_serves_its_dequantized_weights(dense_dir, tmp_path, block):
    quantized, oracle = write_fp8_block(dense_dir, tmp_path, block)
    adapter = make_peft_adapter(oracle, tmp_path / "adapter", seed=3, **ADAPTERS["all7-r8"])
    llm = make_llm(quantized)
    layer = llm.engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.weight, Fp8Weight)
    assert isinstance(layer.mlp.down_proj.weight, Fp8Weight)
    check_against_twin(llm, oracle, random_prompts(4, (5, 30), seed=2), adapter)


def test_fp8_block_moe_checkpoint(tmp_path):
    """Qwen3-MoE in the per-expert FP8 layout of Qwen3-30B-A3B-FP8 (router unquantized)."""
    src = write_tiny_qwen3_moe(tmp_path / "moe")
    quantized, oracle = write_fp8_block(src, tmp_path, (16, 32))
    llm = make_llm(quantized)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, Fp8Weight) and isinstance(experts.down_proj, Fp8Weight)
    check_against_twin(llm, oracle, random_prompts(3, (5, 30), seed=4))


@pytest.mark.parametrize("load_format", ["dummy", "safetensors"])
def test_fp8_moe_keeps_its_router(tmp_path, load_format):
    """--quantization fp8 (random weights, or a bf16 checkpoint quantized as it loads)
    lays Qwen3-MoE out as its published FP8 checkpoint: attention and experts in FP8,
    the router in the model's dtype."""
    llm = make_llm(write_tiny_qwen3_moe(tmp_path / "moe"), load_format=load_format, quantization="fp8")
    layer = llm.engine.runner.model.model.layers[0]
    assert isinstance(layer.mlp.experts.gate_up_proj, Fp8Weight)
    assert isinstance(layer.self_attn.o_proj.weight, Fp8Weight)
    assert isinstance(layer.mlp.gate.weight, nn.Parameter)
    out = llm.generate(random_prompts(2, (5, 9), seed=1), SP, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("damage", ["missing scale", "nan scale", "zero scale", "wrong block shape",
                                    "weight not fp8"])
def test_malformed_fp8_checkpoints_fail_at_load(dense_dir, tmp_path, damage):
    quantized, _ = write_fp8_block(dense_dir, tmp_path, (16, 32))
    path = quantized / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.0.self_attn.k_proj.weight"
    if damage == "missing scale":
        del tensors[f"{name}_scale_inv"]
    elif damage == "nan scale":
        tensors[f"{name}_scale_inv"][0, 0] = float("nan")
    elif damage == "zero scale":
        tensors[f"{name}_scale_inv"][0, 0] = 0.0
    elif damage == "wrong block shape":
        tensors[f"{name}_scale_inv"] = tensors[f"{name}_scale_inv"][:, :1].contiguous()
    else:
        tensors[name] = tensors[name].float()
    save_file(tensors, str(path))
    with pytest.raises(ModelLoadError, match="k_proj"):
        make_llm(quantized)


def test_unknown_quantization_variants_fail_at_startup(dense_dir, tmp_path):
    import shutil

    from loraplex.errors import UnsupportedModel

    for variant, words in [({"quant_method": "bitsandbytes"}, "bitsandbytes"),
                           ({"quant_method": "fp8", "activation_scheme": "static",
                             "weight_block_size": [128, 128]}, "static"),
                           ({"quant_method": "fp8"}, "weight_block_size"),
                           ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True},
                            "desc_act"),
                           ({"quant_method": "awq", "bits": 3, "group_size": 128}, "3 bits")]:
        d = tmp_path / words.replace(" ", "-")
        shutil.copytree(dense_dir, d)
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, "quantization_config": variant}))
        with pytest.raises(UnsupportedModel, match=words):
            make_llm(d)


def test_fp8_at_load_time_and_random_weights_in_each_format(dense_dir, tmp_path):
    """--quantization fp8 quantizes a bf16 checkpoint as it loads (serving what its
    weights round-tripped through fp8 give); with dummy weights every format builds and
    generates."""
    from loraplex.ops.formats import Int4Weight, Mxfp4Weight
    from loraplex.ops.reference.quant import dequantize, quantize_fp8

    prompts = random_prompts(2, (5, 20), seed=5)
    fp8 = make_llm(dense_dir, quantization="fp8")
    assert isinstance(fp8.engine.runner.model.model.layers[1].mlp.gate_up_proj.weight, Fp8Weight)
    oracle = write_dequantized(dense_dir, tmp_path, lambda w: dequantize(quantize_fp8(w, 128)))
    check_against_twin(fp8, oracle, prompts)
    for method, cls in [("fp8", Fp8Weight), ("gptq", Int4Weight), ("awq", Int4Weight)]:
        llm = make_llm(dense_dir, load_format="dummy", quantization=method)
        w = llm.engine.runner.model.model.layers[0].self_attn.o_proj.weight
        assert isinstance(w, cls)
        assert len(llm.generate(prompts, SP, use_tqdm=False)[0].outputs[0].token_ids) == 4
    with pytest.raises(ModelLoadError, match="mxfp4"):
        make_llm(dense_dir, quantization="mxfp4")  # only fp8 quantizes a checkpoint as it loads
    assert Mxfp4Weight  # (MXFP4 random weights: tests/test_gpt_oss.py)
