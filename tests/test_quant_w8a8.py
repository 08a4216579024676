"""W8A8 FP8 (`--fp8-activations dynamic`, or `prefill`: in steps of a size on): activations
quantized to e4m3 per token and block of columns at run time, e4m3 x e4m3 products. The
activation quantizer against its plain-torch definition bit for bit, the dense and expert GEMMs against
ops.reference (which quantizes the activations the same way and multiplies in float32),
and FP8 checkpoints served so against transformers (+ PEFT) on the dequantized twin
whose linear layers quantize their inputs alike (quantized.quantize_linear_inputs)."""

from __future__ import annotations

import dataclasses
import importlib
from collections import Counter

import pytest
import torch
from conftest import ADAPTERS, DEVICE, DTYPE, build_tiny_model, make_llm, make_peft_adapter, random_prompts
from quantized import PROMPT_SCORING, check_against_twin, write_fp8_block, write_tiny_qwen3_moe

from loraplex import ops
from loraplex.config import W8A8_PREFILL_MIN_TOKENS, QuantConfig
from loraplex.engine.args import EngineArgs
from loraplex.errors import ModelLoadError
from loraplex.ops.formats import Fp8Weight
from loraplex.ops.reference import moe as reference_moe
from loraplex.ops.reference.quant import (
    FP8_MAX,
    dequantized_activations,
    linear,
    quantize_activations,
    quantize_fp8,
    w8a8,
)

pytest.importorskip("triton")
from test_moe_ops import make_lora  # noqa: E402

from loraplex.ops.triton.fp8_activations import quantize_activations as triton_quantize  # noqa: E402
from loraplex.ops.triton.fp8_gemm import fp8_linear  # noqa: E402
from loraplex.ops.triton.fused_moe import fused_experts  # noqa: E402

TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}[DTYPE]
# The experts re-quantize h, which kernel and reference compute in a different order: a
# last-bit difference there moves an e4m3 rounding now and then (one value by 1/16).
EXPERTS_TOL = {"float32": 2e-3, "bfloat16": 3e-2, "float16": 2e-2}[DTYPE]


def w8a8_weight(shape, block_k: int, gen: torch.Generator, act_block: int | None = None,
                act_min_tokens: int = 0) -> Fp8Weight:
    act_block = block_k if act_block is None else act_block
    w = Fp8Weight(tuple(shape), block_k, getattr(torch, DTYPE), act_block=act_block,
                  act_min_tokens=act_min_tokens)
    quantize_fp8(torch.randn(shape, generator=gen) * 0.05, block_k, out=w)
    return w.to(DEVICE)


def weight_only_twin(w: Fp8Weight) -> Fp8Weight:
    """w's data and scales as a weight-only Fp8Weight."""
    twin = Fp8Weight(tuple(w.shape), w.block_k, w.dtype, act_block=0).to(w.device)
    twin.data.copy_(w.data)
    twin.scale.copy_(w.scale)
    return twin


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_quantized_activations_are_e4m3_per_block():
    """x ~= q * scale, scale = amax / 448 per row and block, the block's largest value at
    +-448, every q an e4m3 value (round trip exact), a zero block stays zero."""
    x = torch.randn(6, 300) * torch.logspace(-6, 2, 300)
    x[2, :128] = 0
    q, scale = quantize_activations(x, 128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (6, 3)
    blocks = torch.nn.functional.pad(x, (0, 84)).unflatten(1, (3, 128))
    assert torch.equal(scale, blocks.abs().amax(-1).clamp_min(1e-10) / FP8_MAX)
    qb = torch.nn.functional.pad(q.float(), (0, 84)).unflatten(1, (3, 128))
    nonzero = scale > 1e-10 / FP8_MAX
    assert torch.equal(qb.abs().amax(-1)[nonzero], torch.full_like(scale, FP8_MAX)[nonzero])
    assert torch.equal(q[2, :128].float(), torch.zeros(128))
    back = dequantized_activations(x, 128)
    assert ((back - x).abs() <= 2 ** -4 * x.abs() + 2 ** -9 * scale.repeat_interleave(128, 1)[:, :300]).all()


@pytest.mark.parametrize("t,k,block", [(1, 64, 128), (17, 256, 128), (5, 96, 32), (40, 300, 128)])
def test_activation_quantizer_kernel_is_the_reference_bit_for_bit(t, k, block):
    gen = torch.Generator().manual_seed(t)
    x = (torch.randn(t, k, generator=gen) * torch.logspace(-8, 2, k)).to(getattr(torch, DTYPE))
    x[0, : min(k, block)] = 0  # a zero block
    q, scale = triton_quantize(x.to(DEVICE), block)
    want_q, want_scale = quantize_activations(x, block)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale.cpu(), want_scale)


@pytest.mark.parametrize("n,block", [(256, 128), (96, 32), (80, 32), (64, 64)])
@pytest.mark.parametrize("form", ["plain", "residual", "summed-terms", "unit-offset"])
def test_norm_writes_the_rows_the_w8a8_gemm_reads(n, block, form):
    """The norm in front of a W8A8 GEMM also writes its output's e4m3 rows and scales:
    quantize_activations of that output bit for bit (rows of whole and partial blocks,
    a zero row), the output itself as without them. The plain-torch op gives the same (on
    a GPU, torch's own quantization there: its division by 448 is a multiply)."""
    gen = torch.Generator().manual_seed(n + block)
    dtype = getattr(torch, DTYPE)
    x = (torch.randn(7, *((3,) if form == "summed-terms" else ()), n, generator=gen) * 3).to(dtype)
    x[2] = 0
    w = (torch.randn(n, generator=gen) * 0.3 + (0 if form == "unit-offset" else 1)).to(dtype)
    res = torch.randn(7, n, generator=gen).to(dtype) if form in ("residual", "summed-terms") else None
    res = None if res is None else res.to(DEVICE)
    if res is not None:
        res[2] = 0
    unit = form == "unit-offset"
    for backend in ("triton", "torch"):
        with ops.using_backend(backend):
            args = (x.to(DEVICE), res, w.to(DEVICE), 1e-6, unit)
            if res is None:
                (y, rows), plain = ops.rms_norm(*args[:1], *args[2:], fp8_block=block), ops.rms_norm(
                    *args[:1], *args[2:])
            else:
                y, r, rows = ops.add_rms_norm(*args, fp8_block=block)
                plain, plain_r = ops.add_rms_norm(*args)
                assert torch.equal(r, plain_r)
            assert torch.equal(y, plain), backend
            want_q, want_scale = quantize_activations(y if backend == "torch" else y.cpu(), block)
            assert rows.q.shape == y.shape and rows.scale.shape == want_scale.shape
            assert torch.equal(rows.q.cpu().view(torch.uint8), want_q.cpu().view(torch.uint8)), backend
            assert torch.equal(rows.scale.cpu(), want_scale.cpu()), backend


def test_w8a8_layers_read_rows_written_beside_their_inputs(tmp_path, monkeypatch):
    """Served W8A8 (Triton ops), the kernels that write a W8A8 GEMM's input write its
    e4m3 rows too: the norms in front of q/k/v and the experts, the split-KV attention's
    merge in front of o_proj (decode steps; 16-key partitions so that these split). Left:
    the experts' h and o_proj's input in prompt steps. The same logprobs as with every
    GEMM quantizing its own input."""
    from loraplex.ops.triton import fp8_activations, paged_decode

    attention = importlib.import_module("loraplex.ops.triton.paged_attention")  # the module, not the op
    monkeypatch.setattr(paged_decode, "PARTITION_SIZE", 16)
    src = write_tiny_qwen3_moe(tmp_path / "moe")
    quantized, _ = write_fp8_block(src, tmp_path, (16, 32))
    # Eager steps, so that every launch goes through the Python wrappers counted here.
    llm = make_llm(quantized, fp8_activations="dynamic", ops_backend="triton", enforce_eager=True)
    prompts = random_prompts(2, (20, 30), seed=7)  # contexts of two 16-token pages: 2 splits
    widths = Counter()

    def counted(quantize):
        def run(x, block):
            widths[x.shape[1]] += 1
            return quantize(x, block)
        return run
    for module in (fp8_activations, attention):  # the GEMMs quantize through fp8_activations.fp8_rows
        monkeypatch.setattr(module, "quantize_activations", counted(module.quantize_activations))
    fused = llm.generate(prompts, PROMPT_SCORING, use_tqdm=False)
    got, widths = widths, Counter()
    monkeypatch.setattr(ops, "fp8_input_block", lambda weights, tokens: 0)
    unfused = llm.generate(prompts, PROMPT_SCORING, use_tqdm=False)
    layer = llm.engine.runner.model.model.layers[0]
    hidden, o_in = layer.self_attn.qkv_proj.in_features, layer.self_attn.o_proj.in_features
    h = layer.mlp.experts.intermediate_size
    assert set(widths) == {hidden, o_in, h} and widths[hidden] == 2 * widths[h] > 0
    assert hidden not in got and got[h] == widths[h] and 0 < got[o_in] < widths[o_in]
    for a, b in zip(fused, unfused):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.prompt_logprobs == b.prompt_logprobs


@pytest.mark.parametrize("t", [1, 5, 16, 33, 70])  # 70: 64-row tiles, the others swapped
@pytest.mark.parametrize("n,k,block", [(48, 256, 128), (40, 64, 128), (32, 96, 32), (70, 300, 128)])
def test_w8a8_dense_gemm_matches_the_reference(t, n, k, block):
    gen = torch.Generator().manual_seed(n + t)
    w = w8a8_weight((n, k), block, gen)
    x = torch.randn(t, k, generator=gen).to(getattr(torch, DTYPE)).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(x.dtype).to(DEVICE)
    got = fp8_linear(x, w, bias)
    assert got.dtype == x.dtype and rel(got, linear(x, w, bias)) < TOL


@pytest.mark.parametrize("t", [1, 3, 24, 300])
@pytest.mark.parametrize("adapters", [False, True])
@pytest.mark.parametrize("h,i", [(64, 96), (48, 80)], ids=["whole-blocks", "partial-blocks"])
def test_w8a8_experts_match_the_reference(t, adapters, h, i):
    """Both GEMMs quantize their input (x, then the activation's output); the adapters
    read them unquantized. (300 tokens: 75 pairs an expert, prefill's tiles.)"""
    gen = torch.Generator().manual_seed(t)
    e, top_k = 8, 2
    w_gate_up, w_down = w8a8_weight((e, 2 * i, h), 32, gen), w8a8_weight((e, h, i), 32, gen)
    x = torch.randn(t, h, generator=gen).to(getattr(torch, DTYPE)).to(DEVICE)
    weights, ids = torch.randn(t, e, generator=gen).softmax(-1).topk(top_k, -1)
    weights, ids = weights.to(DEVICE), ids.int().to(DEVICE)
    lora = make_lora(e, h, i, t, gen) if adapters else None
    if lora is not None:
        lora = dataclasses.replace(lora, **{f: getattr(lora, f).to(x.dtype).to(DEVICE)
                                            for f in ("a_gate_up", "b_gate_up", "a_down", "b_down")},
                                   token_slot=lora.token_slot.to(DEVICE), slot_mask=lora.slot_mask.to(DEVICE),
                                   ranks=lora.ranks.to(DEVICE))
    got = fused_experts(x, weights, ids, w_gate_up, w_down, lora=lora)
    want = reference_moe.fused_experts(x, weights, ids, w_gate_up, w_down, lora=lora)
    assert rel(got, want) < EXPERTS_TOL


@pytest.mark.parametrize("t", [1, 15, 16, 40])
def test_w8a8_from_a_step_size_dense(t):
    """act_min_tokens (`--fp8-activations prefill`): GEMMs of fewer rows are the weight-
    only kernel's, bit for bit; from there on, W8A8's."""
    gen = torch.Generator().manual_seed(t)
    w = w8a8_weight((48, 256), 128, gen, act_min_tokens=16)
    x = torch.randn(t, 256, generator=gen).to(getattr(torch, DTYPE)).to(DEVICE)
    got, weight_only = fp8_linear(x, w, None), fp8_linear(x, weight_only_twin(w), None)
    assert torch.equal(got, weight_only) == (t < 16)
    assert rel(got, linear(x, w, None)) < TOL
    assert w8a8(w, t) == (t >= 16) and w8a8(w) and not w8a8(weight_only_twin(w))


@pytest.mark.parametrize("t", [3, 24])
def test_w8a8_from_a_step_size_experts(t):
    """Experts with act_min_tokens: a step of fewer tokens runs as weight-only experts
    (bit for bit, adapters included), a larger one as W8A8; the reference agrees."""
    gen = torch.Generator().manual_seed(t)
    e, top_k, h, i = 8, 2, 64, 96
    w_gate_up, w_down = (w8a8_weight(s, 32, gen, act_min_tokens=10) for s in ((e, 2 * i, h), (e, h, i)))
    x = torch.randn(t, h, generator=gen).to(getattr(torch, DTYPE)).to(DEVICE)
    weights, ids = torch.randn(t, e, generator=gen).softmax(-1).topk(top_k, -1)
    weights, ids = weights.to(DEVICE), ids.int().to(DEVICE)
    lora = make_lora(e, h, i, t, gen)
    lora = dataclasses.replace(lora, **{f: getattr(lora, f).to(x.dtype).to(DEVICE)
                                        for f in ("a_gate_up", "b_gate_up", "a_down", "b_down")},
                               token_slot=lora.token_slot.to(DEVICE), slot_mask=lora.slot_mask.to(DEVICE),
                               ranks=lora.ranks.to(DEVICE))
    got = fused_experts(x, weights, ids, w_gate_up, w_down, lora=lora)
    weight_only = fused_experts(x, weights, ids, *map(weight_only_twin, (w_gate_up, w_down)), lora=lora)
    assert torch.equal(got, weight_only) == (t < 10)
    want = reference_moe.fused_experts(x, weights, ids, w_gate_up, w_down, lora=lora)
    assert rel(got, want) < EXPERTS_TOL


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("dense") / "qwen3", "qwen3")


def test_fp8_checkpoint_with_dynamic_activations(dense_dir, tmp_path):
    """A block-scaled checkpoint served W8A8, base rows beside an adapter's, against the
    twin quantizing its linear layers' inputs alike."""
    quantized, oracle = write_fp8_block(dense_dir, tmp_path, (16, 32))
    adapter = make_peft_adapter(oracle, tmp_path / "adapter", seed=3, **ADAPTERS["all7-r8"])
    llm = make_llm(quantized, fp8_activations="dynamic")
    w = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.weight
    assert isinstance(w, Fp8Weight) and w.act_block == 32
    check_against_twin(llm, oracle, random_prompts(4, (5, 30), seed=2), adapter, act_block=32)


def test_fp8_moe_checkpoint_with_dynamic_activations(tmp_path):
    src = write_tiny_qwen3_moe(tmp_path / "moe")
    quantized, oracle = write_fp8_block(src, tmp_path, (16, 32))
    llm = make_llm(quantized, fp8_activations="dynamic")
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.act_block == experts.down_proj.act_block == 32
    check_against_twin(llm, oracle, random_prompts(3, (5, 30), seed=4), moe=True, act_block=32)


def test_fp8_checkpoint_with_activations_quantized_in_prefill(dense_dir, tmp_path, monkeypatch):
    """`--fp8-activations prefill`: the weights carry the step size W8A8 starts at; a
    prompt step that large matches the twin quantizing its inputs, a smaller one the
    weight-only twin."""
    from loraplex.engine import args

    monkeypatch.setattr(args, "W8A8_PREFILL_MIN_TOKENS", 40)
    quantized, oracle = write_fp8_block(dense_dir, tmp_path, (16, 32))
    llm = make_llm(quantized, fp8_activations="prefill")
    w = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.weight
    assert isinstance(w, Fp8Weight) and (w.act_block, w.act_min_tokens) == (32, 40)
    check_against_twin(llm, oracle, random_prompts(3, (20, 30), seed=2), act_block=32)
    check_against_twin(llm, oracle, random_prompts(1, (8, 12), seed=5))


def test_fp8_activations_option():
    """Weight-only unless asked (a draft model, read without the option, too); dynamic
    where the weights are block-scaled FP8 in blocks the kernels step through, else a
    clear error, as for an unknown value."""
    block = QuantConfig.from_hf("Qwen3", {"quant_method": "fp8", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]})
    assert block.act_block == 0 and EngineArgs("m")._activations(block).act_block == 0
    dynamic = EngineArgs("m", fp8_activations="dynamic")
    assert dynamic._activations(block).act_block == 128
    assert dynamic._activations(QuantConfig.requested("fp8", online=True)).act_block == 128
    odd = QuantConfig.from_hf("Qwen3", {"quant_method": "fp8", "weight_block_size": [128, 96]})
    per_channel = QuantConfig("compressed-tensors", "fp8", weight_block=(1, 0))
    for quant, words in ((odd, "128, 96"), (per_channel, "compressed-tensors"),
                         (QuantConfig.requested("awq", False), "awq"), (None, "not quantized")):
        with pytest.raises(ModelLoadError, match=words):
            dynamic._activations(quant)
    with pytest.raises(ValueError, match="fp8_activations"):
        EngineArgs("m", fp8_activations="static")._activations(block)
    assert dynamic._activations(block).act_min_tokens == 0
    prefill = EngineArgs("m", fp8_activations="prefill")
    got = prefill._activations(block)
    assert (got.act_block, got.act_min_tokens) == (128, W8A8_PREFILL_MIN_TOKENS)
    assert W8A8_PREFILL_MIN_TOKENS > 16  # decode steps of 16 sequences stay weight-only
    with pytest.raises(ModelLoadError, match="fp8-activations prefill.*compressed-tensors"):
        prefill._activations(per_channel)


def test_w8a8_tuner_candidates_run():
    """The W8A8 GEMM's search space: tiles of 16 rows or more, K steps inside one
    128-column block, pipelines of e4m3 tiles that fit; a sample computes correctly."""
    from loraplex.bench import tune_fp8
    from loraplex.bench.tuning import SMEM_BYTES

    for t in (1, 16, 64, 4096):
        cands = tune_fp8.candidates(t, 4096, 128, 1, w8a8=True)
        assert cands and all(c["BLOCK_M"] >= 16 and c["BLOCK_K"] <= 128 for c in cands)
        stage_bytes = [(c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] for c in cands]  # e4m3 x and W tiles
        assert all(c["num_stages"] * b <= SMEM_BYTES for c, b in zip(cands, stage_bytes))
    gen = torch.Generator().manual_seed(5)
    w = w8a8_weight((40, 200), 128, gen)
    x = torch.randn(9, 200, generator=gen).to(getattr(torch, DTYPE)).to(DEVICE)
    want = linear(x, w, None)
    for cfg in tune_fp8.candidates(9, 200, 128, 1, w8a8=True)[::7]:
        assert rel(fp8_linear(x, w, None, cfg), want) < TOL, cfg


def test_w8a8_tuner_cli_path(tmp_path, monkeypatch, capsys):
    """`loraplex tune --fp8-activations dynamic` tunes the W8A8 kernels (the experts' and
    the dense GEMMs', 128-column blocks); without FP8 weights it is refused."""
    from loraplex.bench import tune_fp8, tune_moe
    from loraplex.entrypoints.cli import main as cli

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tune_fp8, "tune", lambda *a: calls.append(("fp8", *a)) or [])
    monkeypatch.setattr(tune_moe, "tune", lambda *a: calls.append(("moe", *a)) or [])
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert cli(["tune", "--model", "qwen3-30b-a3b", "--quantization", "fp8", "--fp8-activations", "dynamic",
                *cache]) == 0
    assert [(c[0], c[-1]) for c in calls] == [("moe", 128), ("fp8", 128)]
    assert calls[0][-3:-1] == ("fp8", 128)
    calls.clear()
    assert cli(["tune", "--model", "qwen3-30b-a3b", "--fp8-activations", "dynamic", *cache]) == 2
    assert "FP8" in capsys.readouterr().err and not calls
