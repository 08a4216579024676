"""gpt-oss with MXFP4 experts (the published gpt-oss-20b layout): a tiny gpt-oss written
as an MXFP4 checkpoint beside its dequantized twin; the writer against transformers' own
unpacking, loraplex on the checkpoint against transformers + PEFT on the twin (torch
and Triton backends, adapters on attention and experts mixed with base rows), malformed
checkpoints, random MXFP4 weights; and the fused MoE kernels that read the MXFP4 (and
FP8 block-scaled) experts' bytes against the reference, which dequantizes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import DTYPE, HFOracle, make_llm, make_peft_adapter, random_prompts, tolerance
from safetensors.torch import load_file, save_file
from test_gpt_oss import gpt_oss_dir, tiny_config  # noqa: F401  (the fixture, re-used)
from test_quant_moe_kernels import check_quantized_experts, count_quantized_kernels

from loraplex import LoRARequest, SamplingParams
from loraplex.errors import ModelLoadError
from loraplex.ops.formats import Mxfp4Weight
from loraplex.ops.formats.mxfp4 import checkpoint_blocks
from loraplex.ops.reference.quant import dequantize, quantize_mxfp4

NUM_NEW = 4
SP = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=0, logprobs=0)
QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def write_mxfp4(src: Path, out: Path) -> tuple[Path, Path]:
    """(gpt-oss at src as an MXFP4 checkpoint in the published layout, its dequantized
    twin in the bf16 layout). The experts' [E, in, out] weights are quantized as
    [E, out, in] rows (gate_up's rows interleaved, as published) with quantize_mxfp4's
    rule, packed into `_blocks` [E, out, in / 32, 16] and `_scales` [E, out, in / 32];
    expert biases are bf16 in both (as published)."""
    quantized_dir, twin_dir = out / "mxfp4", out / "dequantized"
    for d in (quantized_dir, twin_dir):
        shutil.copytree(src, d)
    quantized, twin = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
            t = t.to(torch.bfloat16)
        if _EXPERTS.search(name) is None:
            quantized[name] = twin[name] = t
            continue
        w = t.transpose(1, 2)  # [E, out, in]
        e, n, k = w.shape
        q = quantize_mxfp4(w.float())
        quantized[f"{name}_blocks"] = checkpoint_blocks(q)
        quantized[f"{name}_scales"] = q.scale.contiguous()
        twin[name] = dequantize(q).transpose(1, 2).to(t.dtype).contiguous()
    save_file(quantized, str(quantized_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(twin, str(twin_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (quantized_dir / "config.json").write_text(json.dumps(config))
    return quantized_dir, twin_dir


@pytest.fixture(scope="module")
def mxfp4_dirs(gpt_oss_dir, tmp_path_factory):  # noqa: F811
    return write_mxfp4(gpt_oss_dir, tmp_path_factory.mktemp("gpt_oss_mxfp4"))


@pytest.fixture(scope="module")
def expert_adapter(mxfp4_dirs, tmp_path_factory):
    """LoRA on attention and every expert, made (by PEFT) on the twin."""
    return make_peft_adapter(mxfp4_dirs[1], tmp_path_factory.mktemp("adapter") / "a", seed=5, r=4,
                             lora_alpha=8, target_modules=["q_proj", "o_proj"],
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def test_writer_matches_transformers_unpacking(mxfp4_dirs):
    """transformers' convert_moe_packed_tensors on the written blocks / scales gives the
    twin's expert weights: the checkpoint is in the layout gpt-oss is published in."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    quantized = load_file(str(mxfp4_dirs[0] / "model.safetensors"))
    twin = load_file(str(mxfp4_dirs[1] / "model.safetensors"))
    names = [n for n in twin if _EXPERTS.search(n)]
    assert len(names) == 2 * tiny_config().num_hidden_layers
    for name in names:
        blocks, scales = quantized[f"{name}_blocks"], quantized[f"{name}_scales"]
        assert blocks.dtype == scales.dtype == torch.uint8 and blocks.shape[-1] == 16
        unpacked = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert torch.equal(unpacked, twin[name].float()), name
        assert name not in quantized
    assert quantized["model.layers.0.mlp.experts.gate_up_proj_bias"].dtype == torch.bfloat16


def _logprobs_of(positions, token_ids) -> torch.Tensor:
    return torch.tensor([pos[t].logprob for pos, t in zip(positions, token_ids)])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mxfp4_checkpoint_matches_transformers_on_its_twin(mxfp4_dirs, expert_adapter, backend, monkeypatch):
    """Prompt logprobs and greedy tokens of the MXFP4 checkpoint against transformers (+
    PEFT) on the dequantized twin, adapter rows beside base rows in one batch; on CPU
    "triton" runs the MXFP4 expert kernels in the interpreter."""
    quantized, twin = mxfp4_dirs
    # Counted from before the engine starts: on a GPU, steps replay CUDA graphs captured then.
    calls = count_quantized_kernels(monkeypatch)
    llm = make_llm(quantized, ops_backend=backend)
    model = llm.engine.runner.model.model
    for layer in model.layers:
        assert isinstance(layer.mlp.experts.gate_up_proj, Mxfp4Weight)
        assert isinstance(layer.mlp.experts.down_proj, Mxfp4Weight)
        assert isinstance(layer.mlp.router.weight, torch.nn.Parameter)  # the router stays as it was
        assert isinstance(layer.self_attn.qkv_proj.weight, torch.nn.Parameter)
    lora = LoRARequest("a", 1, str(expert_adapter))
    prompts = random_prompts(4, (12, 30), seed=3)
    loras = [lora if i % 2 == 0 else None for i in range(len(prompts))]
    outs = llm.generate(prompts, SP, loras, use_tqdm=False)
    if backend == "triton":  # prefill steps: the grouped GEMM; decode (4 tokens x 2 <= 8 experts): GEMV
        assert calls["gemm"] > 0 and calls["gemv"] > 0, calls
    oracles = {None: HFOracle(twin), lora: HFOracle(twin, expert_adapter)}
    diffs = []
    for prompt, out, adapter in zip(prompts, outs, loras):
        oracle = oracles[adapter]
        got = _logprobs_of(out.prompt_logprobs[1:], prompt[1:])
        diffs.append((got - oracle.prompt_logprobs(prompt)).abs())
        tokens = out.outputs[0].token_ids
        ref = oracle.logits(prompt + tokens)[len(prompt) - 1: -1].log_softmax(-1)
        chosen = ref[torch.arange(NUM_NEW), torch.tensor(tokens)]
        diffs.append((_logprobs_of(out.outputs[0].logprobs, tokens) - chosen).abs())
        if DTYPE == "float32":
            assert tokens == oracle.greedy(prompt, NUM_NEW)
    diff = torch.cat(diffs)
    # bf16: a router near a tie picks another expert (as in test_gpt_oss.py)
    assert (diff.max() if DTYPE == "float32" else diff.median()) <= tolerance(), diff
    with_adapter = oracles[lora].prompt_logprobs(prompts[0])
    assert (with_adapter - oracles[None].prompt_logprobs(prompts[0])).abs().max() > 0.05  # it matters


@pytest.mark.parametrize("damage, words", [
    ("blocks not uint8", "layers.1.mlp.experts.down_proj_blocks.*dtype"),
    ("blocks of another shape", "layers.1.mlp.experts.down_proj_blocks.*shape"),
    ("scales of another shape", "layers.0.mlp.experts.gate_up_proj_scales.*shape"),
    ("NaN scale", "layers.0.mlp.experts.gate_up_proj_scales.*NaN"),
    ("missing scales", "lacks.*layers.1.mlp.experts.down_proj.scale"),
    ("unknown experts tensor", "layers.0.mlp.experts.gate_up_proj_zeros"),
    ("bf16 experts beside the blocks", "layers.0.mlp.experts.down_proj"),
])
def test_malformed_mxfp4_checkpoints_fail_at_load(mxfp4_dirs, tmp_path, damage, words):
    bad = tmp_path / "bad"
    shutil.copytree(mxfp4_dirs[0], bad)
    path = bad / "model.safetensors"
    tensors = load_file(str(path))
    down, gate_up = "model.layers.1.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj"
    if damage == "blocks not uint8":
        tensors[f"{down}_blocks"] = tensors[f"{down}_blocks"].to(torch.int8)
    elif damage == "blocks of another shape":
        blocks = tensors[f"{down}_blocks"]
        tensors[f"{down}_blocks"] = blocks.reshape(*blocks.shape[:2], -1)
    elif damage == "scales of another shape":
        tensors[f"{gate_up}_scales"] = tensors[f"{gate_up}_scales"][:, :, :1].contiguous()
    elif damage == "NaN scale":
        tensors[f"{gate_up}_scales"][3, 5, 0] = 255
    elif damage == "missing scales":
        del tensors[f"{down}_scales"]
    elif damage == "unknown experts tensor":
        tensors[f"{gate_up}_zeros"] = torch.zeros(3, dtype=torch.uint8)
    else:
        tensors["model.layers.0.mlp.experts.down_proj"] = torch.zeros(8, 32, 64)
    save_file(tensors, str(path))
    with pytest.raises(ModelLoadError, match=words):
        make_llm(bad)


def test_mxfp4_random_weights(gpt_oss_dir, tmp_path):  # noqa: F811
    """load_format dummy + quantization mxfp4: MXFP4 experts (nothing else) at the
    config's initializer_range once dequantized, a bf16 router whose routing spreads over
    the experts, and a model that generates."""
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    for f in gpt_oss_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, config_only)
    llm = make_llm(config_only, load_format="dummy", quantization="mxfp4")
    std = tiny_config().initializer_range
    model = llm.engine.runner.model.model
    for layer in model.layers:
        experts, router = layer.mlp.experts, layer.mlp.router
        assert isinstance(experts.gate_up_proj, Mxfp4Weight) and isinstance(experts.down_proj, Mxfp4Weight)
        assert isinstance(router.weight, torch.nn.Parameter) and isinstance(layer.self_attn.o_proj.weight,
                                                                             torch.nn.Parameter)
        for w in (experts.gate_up_proj, experts.down_proj):
            values = dequantize(w).float()
            assert abs(values.std().item() / std - 1) < 0.1, values.std()
            assert values.mean().abs() < 0.1 * std
        # Routing of random unit-RMS hidden states: every expert is picked, none dominates.
        x = torch.randn(512, experts.hidden_size, generator=torch.Generator().manual_seed(0))
        logits = x.to(router.weight) @ router.weight.T
        counts = torch.bincount(logits.topk(2).indices.flatten(), minlength=experts.num_experts)
        assert (counts > 0).all() and counts.max() < 3 * counts.float().mean(), counts
    outs = llm.generate(random_prompts(2, (10, 20), seed=3), SP, use_tqdm=False)
    for out in outs:
        assert len(out.outputs[0].token_ids) == NUM_NEW
        assert torch.isfinite(_logprobs_of(out.outputs[0].logprobs, out.outputs[0].token_ids)).all()


def test_mxfp4_scale_rows_are_padded():
    """Mxfp4Weight's scale rows are stored 16-byte aligned with 127 (a scale of 1) past K,
    so kernels read whole K steps: as built, through copies and module moves, and again
    after a move that made them contiguous (values kept); padded_scales says how far a
    row may be read, and a view past the storage's end is refused."""
    import copy

    from loraplex.ops.formats import Mxfp4Weight

    w = Mxfp4Weight((2, 3, 160), torch.bfloat16)  # 5 scales a row, stored in 16
    values = torch.randint(100, 130, (2, 3, 5), dtype=torch.uint8)
    w.scale.copy_(values)
    rows = torch.as_strided(w.scale, (2, 3, 16), (48, 16, 1))
    assert w.scale.stride() == (48, 16, 1) and (rows[..., 5:] == 127).all()
    assert w.padded_scales(8) and w.padded_scales(16) and not w.padded_scales(17)
    assert copy.deepcopy(w).padded_scales(16) and w.to("meta").padded_scales(16)
    w = Mxfp4Weight((2, 3, 160), torch.bfloat16)
    w.scale = values.clone()  # contiguous, as a move copies a strided view
    assert not w.padded_scales(8)
    w.to("cpu")
    assert w.padded_scales(16) and torch.equal(w.scale, values)
    # Rows of 32 in a storage of 96 bytes, the view's last row at byte 72: 16 may be read, not 32.
    w.scale = torch.as_strided(torch.full((96,), 127, dtype=torch.uint8), (2, 5), (32, 1), storage_offset=40)
    assert w.padded_scales(16) and not w.padded_scales(32)


def test_e2m1_words_hold_each_code_where_the_decode_reads_it():
    """Mxfp4Weight.data's e2m1 words (ops/formats/e2m1_words.py): loading's conversion
    of checkpoint bytes, made in place on a slice of rows (as a fused weight's parts are
    loaded), round-trips to the bytes; and the PTX decode's steps (quant_tiles'
    constants, emulated here: mask; rotate and mask; mask, multiply, mask) find every
    code, at each of a word's 8 places, at bf16 bits 15 | 8 7 | 6 of its half."""
    from loraplex.ops.formats.e2m1_words import from_nibbles_, to_nibbles
    from loraplex.ops.triton import quant_tiles as qt

    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (4, 6, 48), dtype=torch.uint8, generator=gen)
    stack = data.clone()
    from_nibbles_(stack[:, 2:5])  # a slice of rows: strided, converted in place
    assert torch.equal(stack[:, :2], data[:, :2]) and torch.equal(stack[:, 5:], data[:, 5:])
    assert not torch.equal(stack[:, 2:5], data[:, 2:5])
    assert torch.equal(to_nibbles(stack[:, 2:5]), data[:, 2:5])

    placed, rot1, rot2 = qt.E2M1_PLACED.value, qt.E2M1_ROTATE_1.value, qt.E2M1_ROTATE_2.value
    spread_mask, spread_mult = qt.E2M1_SPREAD_MASK.value, qt.E2M1_SPREAD_MULT.value
    rotr = lambda x, r: ((x >> r) | (x << (32 - r))) & 0xFFFFFFFF  # noqa: E731
    for code in range(16):
        for other in (0, 15, 6):  # the word's other codes: none, all bits, some
            for place in range(8):
                codes = [other] * 8
                codes[place] = code
                nibbles = torch.tensor([[codes[2 * b] | codes[2 * b + 1] << 4 for b in range(4)]],
                                       dtype=torch.uint8)
                word = int(from_nibbles_(nibbles).view(torch.int32)) & 0xFFFFFFFF
                outs = (word & placed, rotr(word, rot1) & placed, rotr(word, rot2) & placed,
                        ((word & spread_mask) * spread_mult) & 0xFFFFFFFF & placed)
                found = {}
                for bits, places in zip(outs, ((0, 2), (4, 6), (1, 3), (5, 7))):
                    for half, p in enumerate(places):
                        b = bits >> (16 * half)
                        found[p] = (b >> 6) & 7 | (b >> 12) & 8
                assert found == dict(enumerate(codes)), (code, other, place, found)


# The fused MoE kernels on MXFP4 experts (test_quant_moe_kernels.py: how they are checked).
# (tokens, experts, top_k, hidden, intermediate, activation, biases, form, block configs):
# K (hidden, intermediate: multiples of 32) and N off the block sizes, several blocks
# per expert, an expert no token hits; every e2m1 code and an e8m0 scale of 0.
MXFP4_CASES = [
    (1, 8, 2, 64, 32, "swiglu_oai", True, "gemv", "default"),
    (3, 4, 3, 96, 32, "silu", False, "gemv", "small"),
    (17, 4, 2, 96, 32, "swiglu_oai", True, "gemv", "default"),
    (17, 8, 2, 64, 96, "swiglu_oai", True, "gemm", "small"),
    (40, 4, 3, 160, 32, "gelu_tanh", True, "gemm", "default"),
    (3, 8, 1, 32, 64, "silu", False, "gemm", "default"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_lora", [None, "gemv", "aligned"], ids=["base", "lora_gemv", "lora_aligned"])
@pytest.mark.parametrize("t,e,k,h,i,act,bias,form,blocks", MXFP4_CASES)
def test_mxfp4_experts(monkeypatch, t, e, k, h, i, act, bias, form, blocks, with_lora, dtype):
    check_quantized_experts(monkeypatch, "mxfp4", t, e, k, h, i, act, bias, form, blocks, with_lora, dtype)
