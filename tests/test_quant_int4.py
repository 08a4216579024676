"""AWQ and GPTQ int4 bases (ops/formats Int4Weight, ops/formats/int4.py): checkpoints
in the published packings load to exactly their values, and serve (adapters on top, mixed
with base rows) the prompt logprobs transformers + PEFT give on their dequantized
weights; malformed ones fail at load. The W4A16 Triton kernel (ops/triton/int4_gemm.py)
against the torch reference."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import (
    ADAPTERS,
    DEVICE,
    DTYPE,
    build_tiny_model,
    make_llm,
    make_peft_adapter,
    random_prompts,
)
from quantized import _rewrite, check_against_twin
from safetensors.torch import load_file, save_file

from loraplex.config import QuantConfig
from loraplex.errors import ModelLoadError
from loraplex.ops.formats import Int4Weight
from loraplex.ops.formats.int4 import ingest_int4
from loraplex.ops.reference.quant import dequantize, pack_nibbles, unpack_nibbles

GROUP = 32  # divides the tiny models' K (64, 96, 128)

# -- the published packings, following the publishers' own algorithms ---------------------
# AutoAWQ awq/modules/linear/gemm.py (WQLinear_GEMM.from_linear); AutoGPTQ
# auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py (QuantLinear.pack), which GPTQModel's
# pack_original repeats without the "- 1" for its v2 format.

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> int32 words (as numpy's astype does for the packers)."""
    return torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32))


def pack_awq(q: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K], zero [N, K / G] (integers in [0, 16)) -> (qweight [K, N / 8], qzeros
    [K / G, N / 8]): over W's transpose, word `col` of each row ORs column col * 8 +
    order[i] shifted by 4i."""
    def pack(t):  # [R, C] -> [R, C / 8]
        t = t.long()
        words = torch.zeros(t.shape[0], t.shape[1] // 8, dtype=torch.int64)
        for col in range(words.shape[1]):
            for i in range(8):
                words[:, col] |= t[:, col * 8 + AWQ_ORDER[i]] << (4 * i)
        return _int32(words)

    return pack(q.t()), pack(zero.t())


def pack_gptq(q: torch.Tensor, zero: torch.Tensor, v1: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K], zero [N, K / G] -> (qweight [K / 8, N], qzeros [K / G, N / 8]): qweight row
    `row` ORs W's transpose rows 8 row + j shifted by 4j; qzeros word `col` ORs zero
    columns 8 col + j shifted by 4j, each minus one in the v1 ("gptq") format (whose zero
    points are therefore 1..16)."""
    qt = q.t().long()
    qweight = torch.zeros(qt.shape[0] // 8, qt.shape[1], dtype=torch.int64)
    for row in range(qweight.shape[0]):
        for j in range(8):
            qweight[row] |= qt[row * 8 + j] << (4 * j)
    zt = zero.t().long() - (1 if v1 else 0)
    assert zt.min() >= 0 and zt.max() < 16, "AutoGPTQ's packing cannot store these zero points"
    qzeros = torch.zeros(zt.shape[0], zt.shape[1] // 8, dtype=torch.int64)
    for col in range(qzeros.shape[1]):
        for j in range(8):
            qzeros[:, col] |= zt[:, col * 8 + j] << (4 * j)
    return _int32(qweight), _int32(qzeros)


# -- quantizers (the publishers' rules, with fp16 scales) ---------------------------------

def quantize(w: torch.Tensor, group: int, scheme: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q [N, K], zero [N, K / G] integers, scale fp16 [N, K / G]).
    awq: AutoAWQ's min/max with a zero point; gptq_asym: AutoGPTQ's range widened to hold
    0; gptq_sym: AutoGPTQ's symmetric range, zero 8."""
    g = w.float().unflatten(-1, (-1, group))
    lo, hi = g.amin(-1), g.amax(-1)
    if scheme == "gptq_sym":
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
    elif scheme == "gptq_asym":
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    scale = ((hi - lo).clamp(min=1e-5) / 15).half()
    s = scale.float()
    zero = torch.full_like(s, 8.0) if scheme == "gptq_sym" else (-lo / s).round().clamp(0, 15)
    q = (g / s[..., None] + zero[..., None]).round().clamp(0, 15).flatten(-2)
    return q.long(), zero.long(), scale


def dequantized(q, zero, scale, group) -> torch.Tensor:
    spread = lambda t: t.float().repeat_interleave(group, -1)  # noqa: E731
    return (q.float() - spread(zero)) * spread(scale)


FORMATS = {  # name -> (quantization_config, quantizer scheme)
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
            "awq"),
    "gptq_sym": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
                  "checkpoint_format": "gptq"}, "gptq_sym"),
    "gptq_asym": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
                   "checkpoint_format": "gptq"}, "gptq_asym"),
    "gptq_v2": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
                 "checkpoint_format": "gptq_v2"}, "gptq_asym"),
}


def checkpoint_tensors(module: str, q, zero, scale, fmt: str) -> dict[str, torch.Tensor]:
    """One projection's tensors as its publisher names and packs them."""
    if fmt == "awq":
        qweight, qzeros = pack_awq(q, zero)
    else:
        qweight, qzeros = pack_gptq(q, zero, v1=FORMATS[fmt][0]["checkpoint_format"] == "gptq")
    out = {f"{module}.qweight": qweight, f"{module}.qzeros": qzeros,
           f"{module}.scales": scale.t().contiguous()}
    if fmt != "awq":
        out[f"{module}.g_idx"] = torch.arange(q.shape[1], dtype=torch.int32) // GROUP
    return out


def write_int4(src, out, fmt: str):
    """(the AWQ / GPTQ checkpoint of the model at src, its dequantized twin)."""
    config, scheme = FORMATS[fmt]

    def convert(name, t):
        q, zero, scale = quantize(t, GROUP, scheme)
        module = name.removesuffix(".weight")
        return checkpoint_tensors(module, q, zero, scale, fmt), dequantized(q, zero, scale, GROUP)

    quantized_dir, oracle_dir = out / fmt, out / "dequantized"
    _rewrite(src, quantized_dir, oracle_dir, config, convert)
    return quantized_dir, oracle_dir


def _quant_config(fmt: str) -> QuantConfig:
    return QuantConfig.from_hf("LlamaForCausalLM", FORMATS[fmt][0])


# -- the packings round-trip exactly ------------------------------------------------------

@pytest.mark.parametrize("fmt", list(FORMATS))
def test_published_packings_load_to_exactly_their_values(fmt):
    """Random codes over the whole nibble range (v1 zero points 1..16: stored 0..15) in
    the publisher's packing -> ingest -> the canonical buffers hold exactly them."""
    gen = torch.Generator().manual_seed(0)
    n, k = 40, 96
    q = torch.randint(0, 16, (n, k), generator=gen)
    if fmt == "gptq_sym":
        zero = torch.full((n, k // GROUP), 8)
    elif fmt == "gptq_asym":
        zero = torch.randint(1, 17, (n, k // GROUP), generator=gen)
    else:
        zero = torch.randint(0, 16, (n, k // GROUP), generator=gen)
    scale = (torch.rand(n, k // GROUP, generator=gen) * 0.1 + 1e-3).half()
    w = Int4Weight((n, k), GROUP, torch.float32)
    quant, filled = _quant_config(fmt), set()
    for name, t in checkpoint_tensors("layer", q, zero, scale, fmt).items():
        filled |= set(ingest_int4(w, quant, name.rpartition(".")[2], t, name))
    assert filled == {"data", "scale", "zero"}
    assert torch.equal(unpack_nibbles(w.data), q) and torch.equal(w.data, pack_nibbles(q))
    assert torch.equal(w.zero, zero.float()) and torch.equal(w.scale, scale.float())
    assert torch.equal(dequantize(w), dequantized(q, zero, scale, GROUP))


def test_scales_and_zeros_are_stored_as_pairs():
    """Int4Weight keeps each group's scale and zero side by side (the GEMM reads them as
    one word): as built, through copies and module moves, and again after a move that
    copies the views apart (values kept); row and K slices stay pairs."""
    import copy

    gen = torch.Generator().manual_seed(0)
    w = Int4Weight((6, 64), 16, torch.bfloat16)
    w.scale.copy_(torch.rand(6, 4, generator=gen))
    w.zero.copy_(torch.randint(0, 16, (6, 4), generator=gen))
    scale, zero = w.scale.clone(), w.zero.clone()
    assert w.paired_scales() and w.scale.stride() == (8, 2)
    assert copy.deepcopy(w).paired_scales() and w.to("meta").paired_scales()
    w = Int4Weight((6, 64), 16, torch.bfloat16)
    w.scale, w.zero = scale.clone(), zero.clone()  # apart, as a move copies them
    assert not w.paired_scales()
    w.to("cpu")
    assert w.paired_scales() and torch.equal(w.scale, scale) and torch.equal(w.zero, zero)
    part = Int4Weight((6, 64), 16, torch.bfloat16)
    for view in ({b: t[2:5] for b, t in w.named_buffers()}, {b: t[:, 1:3] for b, t in w.named_buffers()}):
        part.scale, part.zero = view["scale"], view["zero"]
        assert part.paired_scales()


def test_awq_order_and_gptq_offsets_on_known_words():
    """Hand-packed words, read as the publishers' docs and kernels say."""
    n, k, group = 8, 8, 8
    w = Int4Weight((n, k), group, torch.float32)
    awq = QuantConfig.from_hf("LlamaForCausalLM", {**FORMATS["awq"][0], "group_size": group})
    # AWQ: one word per row of W's transpose; value i holds column AWQ_ORDER[i] = 0, 2, 4, 6, 1, 3, 5, 7.
    word = sum(v << (4 * i) for i, v in enumerate([0, 2, 4, 6, 1, 3, 5, 7]))  # column c gets code c
    ingest_int4(w, awq, "qweight", torch.full((k, 1), word, dtype=torch.int32), "x.qweight")
    assert torch.equal(unpack_nibbles(w.data), torch.arange(n)[:, None].expand(n, k))
    # GPTQ v1: qzeros nibble j is column j's zero minus one; 0xF is a zero point of 16.
    gptq = QuantConfig.from_hf("LlamaForCausalLM", {**FORMATS["gptq_asym"][0], "group_size": group})
    zeros = _int32(torch.tensor([[sum(v << (4 * j) for j, v in enumerate([0, 1, 2, 3, 4, 5, 6, 15]))]]))
    ingest_int4(w, gptq, "qzeros", zeros, "x.qzeros")
    assert w.zero[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 16]
    # GPTQ qweight: row j's value i is k = 8j + i.
    ingest_int4(w, gptq, "qweight", torch.tensor([[word] * n], dtype=torch.int32), "x.qweight")
    assert unpack_nibbles(w.data)[0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


# -- checkpoints of the tiny models serve their dequantized weights -----------------------

@pytest.mark.parametrize("fmt, arch", [("awq", "llama"), ("gptq_sym", "qwen3"), ("gptq_asym", "mistral"),
                                       ("gptq_v2", "qwen2")])
def test_int4_checkpoint_serves_its_dequantized_weights(tmp_path, fmt, arch):
    src = build_tiny_model(tmp_path / arch, arch)
    quantized, oracle = write_int4(src, tmp_path, fmt)
    adapter = make_peft_adapter(oracle, tmp_path / "adapter", seed=3, **ADAPTERS["all7-r8"])
    llm = make_llm(quantized)
    layer = llm.engine.runner.model.model.layers[0]
    for w in (layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight,
              layer.mlp.down_proj.weight):
        assert isinstance(w, Int4Weight) and w.group == GROUP
    check_against_twin(llm, oracle, random_prompts(4, (5, 30), seed=2), adapter)


@pytest.mark.skipif(DTYPE != "float32", reason="the interpreter's run of the whole model, once")
def test_int4_checkpoint_through_the_triton_kernel(tmp_path):
    """The same through ops_backend triton (the W4A16 kernel; interpreted on CPU)."""
    src = build_tiny_model(tmp_path / "llama", "llama")
    quantized, oracle = write_int4(src, tmp_path, "gptq_asym")
    adapter = make_peft_adapter(oracle, tmp_path / "adapter", seed=3, **ADAPTERS["qv-r4-rslora"])
    check_against_twin(make_llm(quantized, ops_backend="triton"), oracle, random_prompts(3, (5, 24), seed=6),
                       adapter)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("int4") / "llama", "llama")


@pytest.mark.parametrize("fmt, damage", [
    ("awq", "missing qzeros"), ("awq", "nan scales"), ("awq", "zero scales"), ("awq", "qweight shape"),
    ("awq", "scales shape"), ("awq", "qweight dtype"), ("gptq_asym", "missing qweight"),
    ("gptq_asym", "act-order g_idx"), ("gptq_asym", "g_idx shape"), ("gptq_asym", "qzeros shape"),
    ("gptq_sym", "symmetric zeros not 8"), ("gptq_asym", "stray tensor"),
])
def test_malformed_int4_checkpoints_fail_at_load(llama_dir, tmp_path, fmt, damage):
    quantized, _ = write_int4(llama_dir, tmp_path, fmt)
    path = quantized / "model.safetensors"
    tensors = load_file(str(path))
    m = "model.layers.0.self_attn.k_proj"
    if damage == "missing qzeros":
        del tensors[f"{m}.qzeros"]
    elif damage == "missing qweight":
        del tensors[f"{m}.qweight"]
    elif damage == "nan scales":
        tensors[f"{m}.scales"][0, 3] = float("nan")
    elif damage == "zero scales":
        tensors[f"{m}.scales"][1, 0] = 0.0
    elif damage == "qweight shape":
        tensors[f"{m}.qweight"] = tensors[f"{m}.qweight"].t().contiguous()
    elif damage == "scales shape":
        tensors[f"{m}.scales"] = tensors[f"{m}.scales"][:1].contiguous()
    elif damage == "qweight dtype":
        tensors[f"{m}.qweight"] = tensors[f"{m}.qweight"].long()
    elif damage == "act-order g_idx":
        tensors[f"{m}.g_idx"] = tensors[f"{m}.g_idx"].flip(0).contiguous()
    elif damage == "g_idx shape":
        tensors[f"{m}.g_idx"] = tensors[f"{m}.g_idx"][:-1].contiguous()
    elif damage == "qzeros shape":
        tensors[f"{m}.qzeros"] = tensors[f"{m}.qzeros"][:, :1].contiguous()
    elif damage == "symmetric zeros not 8":
        tensors[f"{m}.qzeros"] = torch.zeros_like(tensors[f"{m}.qzeros"])  # v1: zero points 1
    else:
        tensors[f"{m}.weight"] = torch.zeros(1)
    save_file(tensors, str(path))
    with pytest.raises(ModelLoadError, match="k_proj"):
        make_llm(quantized)


def test_act_order_config_is_refused_and_formats_read(llama_dir):
    from loraplex.errors import UnsupportedModel

    with pytest.raises(UnsupportedModel, match="desc_act"):
        QuantConfig.from_hf("LlamaForCausalLM", {**FORMATS["gptq_sym"][0], "desc_act": True})
    assert json.loads(json.dumps(FORMATS["awq"][0]))["zero_point"] is True
    assert _quant_config("gptq_v2").checkpoint_format == "gptq_v2" and not _quant_config("gptq_v2").symmetric
    assert _quant_config("gptq_sym").symmetric and not _quant_config("awq").symmetric


def test_random_int4_weights_at_llama_shapes():
    """--load-format dummy --quantization awq on Llama-3.1-8B's projections: group 128 on
    every K (4096, 14336), N(0, std) weights within their group's quantization step."""
    from loraplex.config import QuantConfig as Q
    from loraplex.ops.formats.checkpoint import init_quantized, new_weight

    quant = Q("awq", "int4", group_size=128, symmetric=False)
    gen = torch.Generator().manual_seed(0)
    for shape in [(512, 4096), (64, 14336)]:  # rows of qkv / gate_up and of down
        w = new_weight(quant, shape, torch.bfloat16, "cpu")
        assert isinstance(w, Int4Weight) and w.group == 128
        init_quantized(w, 0.02, gen)
        values = dequantize(w).float()
        assert w.zero.min() >= 0 and w.zero.max() <= 15 and (w.scale > 0).all()
        assert abs(values.std().item() - 0.02) < 2e-3


# -- the W4A16 Triton kernel against the torch reference ----------------------------------

def _random_int4(n: int, k: int, group: int, dtype: torch.dtype, seed: int) -> Int4Weight:
    """Every code and zero point (0..16) over scales of trained weights."""
    gen = torch.Generator().manual_seed(seed)
    w = Int4Weight((n, k), group, dtype)
    w.data.copy_(pack_nibbles(torch.randint(0, 16, (n, k), generator=gen)))
    w.zero.copy_(torch.randint(0, 17, (n, k // group), generator=gen))
    w.scale.copy_(torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3)
    return w.to(DEVICE)


def _kernel_check(t: int, n: int, k: int, group: int, dtype: torch.dtype, bias: bool, config=None, seed=0):
    from loraplex.ops.reference.quant import linear
    from loraplex.ops.triton.int4_gemm import int4_linear

    w = _random_int4(n, k, group, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(t, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    got = int4_linear(x, w, b, config)
    want = linear(x, w, b)
    assert got.dtype == want.dtype and got.shape == want.shape
    # W is bit-exact (rounded once to its dtype): what differs is the sum's order and, in
    # bf16, the output's rounding (the interpreter truncates: up to 2 ulps apart).
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-3, rtol=1.6e-2)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [1, 3, 17, 64, 200])
@pytest.mark.parametrize("n, k, group", [(40, 96, 32), (72, 128, 128), (136, 96, 24), (48, 96, 96)],
                         ids=["groups-per-step", "group-per-step", "gathered", "odd-group"])
def test_int4_kernel_matches_the_reference(t, n, k, group, dtype):
    """Token counts across the decode and prefill configs; N off the blocks; K off
    BLOCK_K; groups that hold several steps, several groups a step, and neither."""
    _kernel_check(t, n, k, group, dtype, bias=t % 2 == 1)


@pytest.mark.parametrize("split_k", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int4_kernel_split_k(split_k, dtype):
    """Decode's split K (chosen from the SM count on a GPU: forced here), with and
    without bias, K chunks that end past K or hold nothing."""
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, SPLIT_K=split_k)
    for t, k, bias in [(1, 128, True), (5, 96, False), (3, 64, True)]:
        _kernel_check(t, 40, k, 32, dtype, bias, cfg, seed=split_k)


def _lora_operands(t, k, sizes, max_rank, slots, ranks, dtype, seed):
    """A, B of `len(ranks)` slots (zero past each slot's rank, as slots keep them:
    test_ops.slot_b) and the batch of tokens in `slots` (-1: no adapter)."""
    from test_ops import lora_batch, slot_b

    gen = torch.Generator().manual_seed(seed)
    a = slot_b(ranks, len(sizes) * k, max_rank, gen).unflatten(1, (len(sizes), k)).permute(1, 0, 3, 2)
    b = slot_b(ranks, sum(sizes), max_rank, gen)
    return ((a * 0.1).to(dtype).to(DEVICE).contiguous(), (b * 0.1).to(dtype).to(DEVICE),
            lora_batch(slots, ranks, len(ranks)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int4_split_k_sum_adds_the_lora_expand(dtype):
    """ops.lora_linear's fused form on an int4 weight: the expand inside the split-K sum,
    three slices off the sum's blocks, tokens of three slots (ranks 4, 2 and an empty
    slot) and none, against the reference (shrink, expand after the base matmul)."""
    from loraplex.ops.reference.lora import lora_linear, lora_shrink
    from loraplex.ops.reference.quant import linear
    from loraplex.ops.triton.int4_gemm import int4_linear
    from loraplex.ops.triton.split_k_sum import FusedExpand

    sizes, k, t = (24, 300, 8), 96, 5
    w = _random_int4(sum(sizes), k, 32, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(t, k, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(sum(sizes), generator=gen).to(dtype).to(DEVICE)
    a, b, batch = _lora_operands(t, k, sizes, 8, [1, -1, 0, 2, 1], [4, 2, 0], dtype, seed=5)
    buf = lora_shrink(x, a, batch)
    joined = []
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, SPLIT_K=2)
    got = int4_linear(x, w, bias, cfg, lora=FusedExpand(buf, b, sizes, batch, lambda: joined.append(1)))
    want = lora_linear(x, w, bias, a, b, sizes, batch)
    assert joined == [1]
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=1.6e-2)
    torch.testing.assert_close(got, want, **tol)
    base = linear(x, w, bias)
    delta = (want.float() - base.float()).abs().amax(dim=1)
    assert (delta > 1e-2).tolist() == [True, False, True, False, True]  # no adapter; an empty slot


def test_lora_linear_on_the_triton_backend():
    """ops.lora_linear through the Triton backend (shrink, base matmul, expand; on a CPU
    the int4 weight takes the unfused form) against the reference, bf16 and int4 bases."""
    from loraplex import ops
    from loraplex.ops.reference.lora import lora_linear

    sizes, k, t = (64, 32), 128, 3
    a, b, batch = _lora_operands(t, k, sizes, 4, [0, -1, 1], [4, 3], torch.float32, seed=9)
    x = torch.randn(t, k, device=DEVICE)
    int4 = _random_int4(sum(sizes), k, 128, torch.float32, 2)
    for w in (torch.randn(sum(sizes), k, device=DEVICE) * 0.05, int4):
        with ops.using_backend("triton"):
            got = ops.lora_linear(x, w, None, a, b, sizes, batch)
        torch.testing.assert_close(got, lora_linear(x, w, None, a, b, sizes, batch), atol=1e-4, rtol=1e-4)


def test_int4_kernel_at_llama_group_size_and_through_ops():
    """Group 128 over a Llama-sized K (4096) for one decode token, through ops.linear on
    the triton backend, and a token batch with leading dims."""
    from loraplex import ops
    from loraplex.ops.reference.quant import linear

    w = _random_int4(64, 4096, 128, torch.float32, seed=7)
    x = torch.randn(1, 4096, device=DEVICE)
    with ops.using_backend("triton"):
        got = ops.linear(x, w)
        got3 = ops.linear(torch.randn(2, 3, 4096, device=DEVICE), w)
    torch.testing.assert_close(got, linear(x, w, None), atol=1e-4, rtol=1e-4)
    assert got3.shape == (2, 3, 64)
    w16 = _random_int4(48, 256, 128, torch.bfloat16, seed=8)  # float32 activations, bf16 W
    with ops.using_backend("triton"):
        got = ops.linear(x[:, :256], w16)
    torch.testing.assert_close(got, linear(x[:, :256], w16, None), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n, k, group", [(40, 96, 32), (72, 256, 128), (136, 96, 24)])
def test_int4_dequantize_kernel_and_the_prefill_path(n, k, group, dtype):
    """Prefill-sized steps on a GPU dequantize W in one kernel, then run the dense GEMM:
    the kernel gives dequantize's values exactly, and a step of DEQUANTIZE_MIN_TOKENS
    tokens matches the reference (on a CPU: the W4A16 kernel)."""
    from loraplex.ops.reference.quant import dequantize
    from loraplex.ops.triton.int4_gemm import DEQUANTIZE_MIN_TOKENS, int4_dequantize

    w = _random_int4(n, k, group, dtype, seed=n)
    assert torch.equal(int4_dequantize(w).cpu(), dequantize(w).cpu())
    _kernel_check(DEQUANTIZE_MIN_TOKENS, n, k, group, dtype, bias=True, seed=n)


def test_bf16x2_decode_needs_integer_zero_points():
    """The bf16x2 decode (exact where q - zero is exact in bf16) is taken for bf16 on an
    sm_90 GPU with each step inside one group and integer zero points in 0..127; a
    fractional zero point or one past 127 keeps the float32 decode (the answer follows
    changes to the zero points). The kernel tests above check its values on a GPU."""
    from loraplex.ops.triton.int4_gemm import bf16x2_decode

    w = _random_int4(64, 256, 128, torch.bfloat16, seed=3)
    x = torch.randn(2, 256).to(torch.bfloat16).to(DEVICE)
    sm90 = DEVICE == "cuda" and torch.cuda.get_device_capability() >= (9, 0)
    assert w.integer_zeros() and bf16x2_decode(x, w, 128) == sm90
    assert not bf16x2_decode(x, w, 256) and not bf16x2_decode(x.float(), w, 128)
    w.zero[0, 1] = 7.5
    assert not w.integer_zeros() and not bf16x2_decode(x, w, 128)
    w.zero[0, 1] = 130
    assert not w.integer_zeros()
    w.zero[0, 1] = 16
    assert w.integer_zeros()


def test_int4_kernel_configs_follow_shapes_alone():
    """Decode configs split K on a GPU by the SM count (forced here by device type only);
    BLOCK_K fits the group."""
    from loraplex.ops.triton.int4_configs import int4_config

    cpu = torch.device("cpu")
    assert int4_config(1, 4096, 4096, 128, cpu)["BLOCK_K"] == 128
    assert int4_config(1, 4096, 4096, 96, cpu)["BLOCK_K"] == 32  # inside one group
    assert int4_config(1, 4096, 4096, 24, cpu)["BLOCK_K"] == 128  # gathered
    assert int4_config(512, 4096, 4096, 128, cpu)["BLOCK_M"] == 128
    assert all(int4_config(t, 4096, 4096, 128, cpu)["SPLIT_K"] == 1 for t in (1, 64, 512))


_CODEGEN = r"""
import json, re, sys
sys.path.insert(0, sys.argv[1])
from sm90_codegen import compile_sm90, const, widths
import torch
from loraplex.ops.triton import int4_gemm as m

n, k, group = 4096, 14336, 128  # Llama-3.1-8B's down_proj
out = {}
for t, split, bf16x2, paired in ((1, 4, False, False), (16, 1, False, False), (64, 1, False, False),
                                 (2048, 1, False, False), (1, 4, True, False), (32, 4, True, False),
                                 (32, 4, True, True), (64, 1, True, True)):
    cfg = m.int4_config(t, n, k, group, torch.device("cpu"))
    cfg["SPLIT_K"] = split
    nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
    args = dict(x_ptr="*bf16", q_ptr="*u8", scale_ptr="*bf16", zero_ptr="*bf16", bias_ptr="*bf16",
                out_ptr="*fp32" if split > 1 else "*bf16", M=7, N=n, K=k, stride_xm=k, stride_qn=k // 2,
                stride_sn=(2 if paired else 1) * k // group, stride_sg=2 if paired else 1,
                stride_os=t * n if split > 1 else 0, stride_om=n,
                GROUP=const(group), HAS_BIAS=const(True), EVEN_N=const(True), EVEN_K=const(True),
                UPCAST=const(False), DOT_PRECISION=const("tf32"), BF16X2=const(bf16x2), PAIRED=const(paired),
                **{a: const(v) for a, v in cfg.items()})
    c = compile_sm90(m._int4_gemm_kernel, args, nw, ns)
    ptx = c.asm["ptx"]
    out[f"{t}{' bf16x2' if bf16x2 else ''}{' paired' if paired else ''}"] = dict(
        widths(ptx), shared=c.metadata.shared, i2f=len(re.findall(r"cvt\.rn\.f32\.[us]", ptx)),
        mma=len(re.findall(r"\b(?:mma|wgmma\.mma_async)\.sync", ptx)), mul2=ptx.count("mul.rn.bf16x2"))
print(json.dumps(out))
"""


@pytest.mark.skipif(DTYPE != "float32", reason="compiles for sm_90 once")
def test_int4_kernel_compiles_for_sm90_reading_whole_vectors():
    """Decode (split K and not) and prefill configs at Llama-3.1-8B's down_proj compile
    for an H100 (no GPU needed), with the float32 decode and the bf16x2 one: W's bytes
    and x come in 16-byte copies, nothing is read a byte at a time, the codes become
    floats without int-to-float conversions, tl.dot runs on tensor cores, and the tiles
    fit in shared memory. With scales and zeros paired (Int4Weight), a group's two come
    in one 4-byte copy ahead of the loop's step, not as 2-byte loads inside it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-c", _CODEGEN, str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    for t, c in counts.items():
        assert c.get("cp.async.16", 0) > 0 and c.get("ld.b8", 0) == 0 and c.get("ld.u8", 0) == 0, (t, c)
        assert c["i2f"] == 0 and c["mma"] > 0, (t, c)
        assert c.get("st.b16", 0) == 0 and 0 < c["shared"] <= 232_448, (t, c)
        assert (c["mul2"] > 0) == ("bf16x2" in t), (t, c)
        if t.endswith("paired"):  # (scale, zero) words copied ahead with W: no 2-byte loads
            assert c.get("ld.b16", 0) <= 1 and c.get("cp.async.4", 0) > 0, (t, c)  # (the bias)


# -- tuned configs and the tuner ----------------------------------------------------------

def test_tuned_int4_config_files_are_read_for_their_shape(tmp_path, monkeypatch):
    """A tuned file's entry (its split of K with it) serves token counts within a factor
    of 2 of it, for its shape, group size and dtype on its GPU; anything else gets the
    defaults."""
    from loraplex.ops.triton import int4_configs, moe_configs

    name = int4_configs.config_file_name("NVIDIA_H200", 6144, 4096, 128, torch.bfloat16)
    assert name == "int4_gemm_NVIDIA_H200_N6144_K4096_G128_bfloat16.json"
    tuned = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3, SPLIT_K=4)
    moe_configs.save_configs(tmp_path / name, {32: tuned}, int4_configs.KEYS)
    monkeypatch.setenv(moe_configs.ENV_VAR, str(tmp_path))
    monkeypatch.setattr(int4_configs, "device_name", lambda device: "NVIDIA_H200")
    monkeypatch.setattr(int4_configs, "_sm_count", lambda device: 132)
    int4_configs.clear_cache()
    try:
        cuda = torch.device("cuda")
        assert int4_configs.int4_config(32, 6144, 4096, 128, cuda) == tuned
        assert int4_configs.int4_config(20, 6144, 4096, 128, cuda) == tuned
        for args in ((8, 6144, 4096, 128, cuda), (32, 4096, 8192, 128, cuda), (32, 6144, 4096, 64, cuda),
                     (32, 6144, 4096, 128, torch.device("cpu"))):
            assert int4_configs.int4_config(*args) == int4_configs.default_config(*args)
        assert int4_configs.int4_config(32, 6144, 4096, 128, cuda, torch.float16) \
            == int4_configs.default_config(32, 6144, 4096, 128, cuda)
    finally:
        int4_configs.clear_cache()


def test_int4_tuner_candidates_run_and_fit():
    """Every candidate fits shared memory, splits K at most into its steps and keeps its
    steps inside a group or whole groups; a sample computes what the reference does
    (under the interpreter on a small W)."""
    from loraplex.bench import tune_int4
    from loraplex.bench.tuning import SMEM_BYTES
    from loraplex.ops.triton.int4_configs import KEYS
    from loraplex.ops.triton.int4_gemm import int4_linear

    for t in (1, 16, 32, 64, 96):
        for k, group in ((4096, 128), (14336, 128), (4096, 32)):
            cands = tune_int4.candidates(t, k, group)
            assert cands and all(set(c) == set(KEYS) for c in cands)
            for c in cands:
                assert c["SPLIT_K"] <= k // c["BLOCK_K"]
                assert group % c["BLOCK_K"] == 0 or c["BLOCK_K"] % group == 0
                per_stage = c["BLOCK_M"] * c["BLOCK_K"] * 2 + c["BLOCK_N"] * c["BLOCK_K"] // 2
                assert c["num_stages"] * per_stage <= SMEM_BYTES
    from loraplex.ops.reference.quant import linear

    w = _random_int4(40, 256, 128, torch.float32, seed=5)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    want = linear(x, w, None)
    for cfg in tune_int4.candidates(3, 256, 128)[::23]:
        torch.testing.assert_close(int4_linear(x, w, None, cfg), want, atol=1e-4, rtol=1e-4, msg=str(cfg))


def test_int4_tuner_cli_path(tmp_path, monkeypatch, capsys):
    """`loraplex tune --quantization awq` tunes a dense model's projection shapes at group
    128 (no GPU here: the timing loop is replaced); an AWQ checkpoint needs no flag and
    brings its own group size; a dense model without either is refused."""
    from loraplex.bench import tune_int4
    from loraplex.bench.workload import prepare_model_dir
    from loraplex.entrypoints.cli import main as cli

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tune_int4, "tune", lambda *a: calls.append(a) or [])
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert cli(["tune", "--model", "llama-3.1-8b", "--quantization", "awq", "--out", str(tmp_path / "out"),
                *cache]) == 0
    assert calls == [([(4096, 4096), (4096, 14336), (6144, 4096), (28672, 4096)], 128, torch.bfloat16,
                      tune_int4.BATCH_SIZES, str(tmp_path / "out"))]
    calls.clear()
    src, _ = prepare_model_dir("qwen3-0.6b", tmp_path / "cache")
    awq_dir = tmp_path / "qwen3-0.6b-awq"
    awq_dir.mkdir()
    config = json.loads((src / "config.json").read_text())
    (awq_dir / "config.json").write_text(json.dumps({**config, "quantization_config": {
        **FORMATS["awq"][0], "group_size": 64}}))
    assert cli(["tune", "--model", str(awq_dir), "--batch-sizes", "16", "32", *cache]) == 0
    assert calls[0][1] == 64 and calls[0][3] == [16, 32]
    calls.clear()
    assert cli(["tune", "--model", "llama-3.1-8b", *cache]) == 2
    assert "int4 GEMMs" in capsys.readouterr().err and not calls


def test_tuners_take_the_fastest_config_that_runs(monkeypatch):
    """bench.tuning.fastest (every tuner's search): the least time over configs, those
    that fail to launch skipped, `per` calls in each timed one."""
    from loraplex.bench import tuning

    monkeypatch.setattr(tuning, "time_ms", lambda run: run())
    times = {"a": 3.0, "b": 1.0, "c": 2.0}

    def launch(cfg):
        if cfg == "b":
            return lambda: (_ for _ in ()).throw(RuntimeError("out of resources"))
        return lambda: times[cfg]

    assert tuning.fastest(["a", "b", "c"], launch, "test") == "c"
    assert tuning.fastest(["a", "c"], lambda cfg: lambda: times[cfg], "test", per=2) == "c"
    assert tuning.fastest(["b"], launch, "test") is None


@pytest.mark.parametrize("text", ['{"32": {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, '
                                  '"num_warps": 4, "num_stages": 3}}', '{"32": "fast"}', '[1, 2]', "{",
                                  '{"many": {}}'],
                         ids=["no-split", "not-a-config", "not-a-table", "not-json", "bad-count"])
def test_malformed_tuned_int4_config_file_fails_naming_it(tmp_path, monkeypatch, text):
    """A tuned file without a key of the kernel's configs (SPLIT_K), or not a table of
    token counts at all, is a ModelLoadError naming the file, not a KeyError in a step."""
    from loraplex.ops.triton import int4_configs, moe_configs

    name = int4_configs.config_file_name("NVIDIA_H200", 6144, 4096, 128, torch.bfloat16)
    (tmp_path / name).write_text(text)
    monkeypatch.setenv(moe_configs.ENV_VAR, str(tmp_path))
    monkeypatch.setattr(int4_configs, "device_name", lambda device: "NVIDIA_H200")
    int4_configs.clear_cache()
    try:
        with pytest.raises(ModelLoadError, match=name):
            int4_configs.int4_config(32, 6144, 4096, 128, torch.device("cuda"))
    finally:
        int4_configs.clear_cache()
