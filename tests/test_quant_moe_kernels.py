"""The Triton MoE kernels on quantized experts (ops/formats) against the plain-torch
oracle (ops.reference.moe.fused_experts, which dequantizes the same weights first):
FP8 block-scaled experts here (scale blocks of 128, of 32 across a K step, per channel),
MXFP4 in test_quant_mxfp4.py through `check_quantized_experts`; both forms (the grouped
GEMM over aligned pair blocks, the per-pair GEMV of decode steps), with and without
expert adapters, biases, swiglu_oai; warm-up and tuner over quantized experts. Also
Qwen3-MoE's per-expert FP8 checkpoint on the Triton backend."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, DTYPE, make_llm, random_prompts
from quantized import check_against_twin, write_fp8_block, write_tiny_qwen3_moe

from loraplex import ops
from loraplex.ops.formats import Fp8Weight, Mxfp4Weight, QuantizedWeight
from loraplex.ops.metadata import MoELoRA
from loraplex.ops.reference import moe as reference
from loraplex.ops.reference.quant import dequantize, quantize_fp8, quantize_mxfp4

pytest.importorskip("triton")
from test_moe_ops import REL_TOL, SMALL_BLOCKS, make_lora, pair_terms  # noqa: E402

from loraplex.bench import tune_moe  # noqa: E402
from loraplex.ops.triton import fused_moe, moe_configs  # noqa: E402


def quantized_experts(fmt: str, values: torch.Tensor, dtype: torch.dtype, gen: torch.Generator,
                      block_k: int = 128) -> QuantizedWeight:
    """values [E, N, K] in format fmt, computing in dtype. MXFP4: random bytes (every e2m1
    code, -0 included) under scales 2^-10..2^-3, and one zero scale (2^-127) per expert;
    FP8: values quantized per row and block_k columns."""
    if fmt == "fp8":
        return quantize_fp8(values, block_k, out=Fp8Weight(tuple(values.shape), block_k, dtype))
    w = quantize_mxfp4(values, out=Mxfp4Weight(tuple(values.shape), dtype))
    w.data.copy_(torch.randint(0, 256, w.data.shape, generator=gen, dtype=torch.uint8))
    w.scale.copy_(torch.randint(117, 125, w.scale.shape, generator=gen, dtype=torch.uint8))
    w.scale[:, 1, 0] = 0
    return w


def _to(v, dtype, dev):
    """A copy on dev in dtype (adapters' floats; weights move with their format)."""
    if v is None:
        return None
    if isinstance(v, MoELoRA):
        return MoELoRA(*(f.to(dtype).to(dev) for f in (v.a_gate_up, v.b_gate_up, v.a_down, v.b_down)),
                       v.token_slot.to(dev), None if v.slot_mask is None else v.slot_mask.to(dev),
                       None if v.ranks is None else v.ranks.to(dev))
    if isinstance(v, QuantizedWeight):
        return copy.deepcopy(v).to(dev)
    return v.to(dtype).to(dev)


def count_quantized_kernels(monkeypatch) -> dict[str, int]:
    """Calls of the quantized experts' kernels by form (from now on, in this test)."""
    calls = {"gemm": 0, "gemv": 0}

    def counting(form, kernel):
        def counted(*args, **kwargs):
            calls[form] += 1
            return kernel(*args, **kwargs)
        return counted

    monkeypatch.setattr(fused_moe, "moe_gemm_quant", counting("gemm", fused_moe.moe_gemm_quant))
    monkeypatch.setattr(fused_moe, "moe_gemv_quant", counting("gemv", fused_moe.moe_gemv_quant))
    return calls


def check_quantized_experts(monkeypatch, fmt, t, e, k, h, i, act, bias, form, blocks, with_lora, dtype,
                            block_k=128):
    """ops.fused_experts on the Triton backend with quantized experts against the
    reference in float32 on the same (dequantized, rounded to dtype) weights. form:
    "gemv" or "gemm", forced (fused_moe picks by the pair count); blocks: the grouped
    GEMM's configs ("default" or SMALL_BLOCKS); with_lora: None, "gemv", "aligned"."""
    monkeypatch.setattr(fused_moe, "GEMV_MAX_TOKENS", 64 if with_lora == "gemv" else 0)
    monkeypatch.setattr(fused_moe, "base_form", lambda *_: form)
    if blocks == "small":  # w_gate_up is [E, 2I, H], w_down [E, H, I]
        monkeypatch.setattr(fused_moe, "gemm_config", lambda w, *_: dict(SMALL_BLOCKS[w.shape[1] != 2 * i]))
    gen = torch.Generator().manual_seed(t * 100 + e * 10 + k + h)
    x = torch.randn(t, h, generator=gen)
    logits = torch.randn(t, e, generator=gen)
    logits[:, e - 1] = -torch.inf  # an expert no token hits
    weights, ids = reference.route_experts(logits, k, renormalize=bool(bias))
    w_gu = quantized_experts(fmt, torch.randn(e, 2 * i, h, generator=gen) / h**0.5, dtype, gen, block_k)
    w_d = quantized_experts(fmt, torch.randn(e, h, i, generator=gen) / i**0.5, dtype, gen, block_k)
    b_gu = torch.randn(e, 2 * i, generator=gen) if bias else None
    b_d = torch.randn(e, h, generator=gen) if bias else None
    lora = make_lora(e, h, i, t, gen, with_ranks=t % 2 == 1) if with_lora else None
    if lora is not None and t == 3:  # no slot mask: empty slots' (zero) weights are read
        lora = dataclasses.replace(lora, slot_mask=None)
    limit = 3.0 if act == "swiglu_oai" else None

    # The oracle: float32 throughout, on the values the kernels see (the activations and
    # adapters rounded to dtype; the weights as dequantize gives them in dtype). In
    # float32 it reads the quantized weights themselves.
    def oracle(v):
        if isinstance(v, QuantizedWeight):
            return v if dtype == torch.float32 else dequantize(v).float()
        return _to(_to(v, dtype, "cpu"), torch.float32, "cpu")

    xr, wgu, wd, bgu, bd, lo = (oracle(v) for v in (x, w_gu, w_d, b_gu, b_d, lora))
    stats_ref = torch.tensor([1.0, 2.0])
    expected = reference.fused_experts(xr, weights, ids, wgu, wd, act, bgu, bd, lo, limit, stats_ref)
    expected_terms = reference.fused_experts(xr, weights, ids, wgu, wd, act, bgu, bd, lo, limit,
                                             sum_topk=False)
    xg, wgu, wd, bgu, bd, lo = (_to(v, dtype, DEVICE) for v in (x, w_gu, w_d, b_gu, b_d, lora))
    stats = torch.tensor([1.0, 2.0], device=DEVICE)
    side = torch.cuda.Stream() if str(DEVICE).startswith("cuda") and t % 2 else None
    routing = weights.to(DEVICE), ids.to(DEVICE)
    with ops.using_backend("triton"):
        out = ops.fused_experts(xg, *routing, wgu, wd, act, bgu, bd, lo, limit, stats, side)
        terms = ops.fused_experts(xg, *routing, wgu, wd, act, bgu, bd, lo, limit, sum_topk=False)
    assert stats.cpu().tolist() == stats_ref.tolist() == [1 + len(ids.unique()), 3]
    assert out.dtype == dtype and out.shape == (t, h) and terms.shape[::2] == (t, h)
    terms = pair_terms(terms, k)  # (down deltas as terms of their own: decode-sized steps)
    assert torch.isfinite(expected).all()
    for got, want in ((out, expected), (terms, expected_terms)):
        err = (got.cpu().float() - want).norm() / want.norm()
        assert err <= REL_TOL[dtype], err


@pytest.mark.parametrize("form", ["gemv", "gemm", "gemm-large-scale"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_kernels_multiply_exactly_the_weights_dequantize_gives(fmt, dtype, form):
    """One-hot activations read each expert's weight back through either kernel: equal,
    bit for bit, to dequantize's (every e2m1 code and a 2^-127 scale; fp8 scale blocks
    across K steps), rounded to nearest even in bf16 as dequantize rounds. bf16 MXFP4
    decodes in PTX on a GPU; with a scale above 128 (gemm-large-scale), and under the
    interpreter, by hand (float32)."""
    from loraplex.ops.triton.moe_align import align_experts
    from loraplex.ops.triton.moe_gemm_quant import moe_gemm_quant, mxfp4_path
    from loraplex.ops.triton.moe_gemv_quant import moe_gemv_quant
    from loraplex.ops.triton.quant_tiles import format_args

    gen = torch.Generator().manual_seed(1)
    e, n, k = 2, 40, 96
    w = quantized_experts(fmt, torch.randn(e, n, k, generator=gen), dtype, gen, block_k=32)
    if fmt == "mxfp4" and form == "gemm-large-scale":
        w.scale[:, 0, 1] = 135
    if fmt == "mxfp4" and dtype == torch.bfloat16 and DEVICE == "cpu":
        w.scale[w.scale == 0] = 117  # the interpreter's float32 -> bf16 stores flush subnormals
    w = w.to(DEVICE)
    eye = torch.eye(k, dtype=dtype, device=DEVICE)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=2)
    want = dequantize(w)
    if fmt == "mxfp4" and dtype == torch.bfloat16:
        assert mxfp4_path(w) == ("hand" if DEVICE == "cpu" or form == "gemm-large-scale" else "ptx")
    # MXFP4 scales as Mxfp4Weight stores them (rows padded: K steps past K read padding)
    # and made contiguous (read with a mask along K).
    weights = [w]
    if fmt == "mxfp4":
        assert format_args(w, cfg["BLOCK_K"])["PADDED_SCALES"]
        unpadded = copy.deepcopy(w)
        unpadded.scale = w.scale.contiguous()
        assert not format_args(unpadded, cfg["BLOCK_K"])["PADDED_SCALES"]
        weights.append(unpadded)
    for w, expert in itertools.product(weights, range(e)):
        ids = torch.full((k, 1), expert, dtype=torch.int32, device=DEVICE)
        out = torch.empty(k, n, dtype=dtype, device=DEVICE)
        if form == "gemv":
            moe_gemv_quant(eye, w, None, out, ids, 1)
        else:
            moe_gemm_quant(eye, w, None, out, align_experts(ids, e, cfg["BLOCK_M"]), cfg, 1)
        assert torch.equal(out.T.cpu(), want[expert].cpu()), expert


# (tokens, experts, top_k, hidden, intermediate, activation, biases, form, block configs,
# fp8 scale block): K and N off every block size; several blocks per expert; one scale
# per K step (block 128), a step across scale blocks (32), per channel (K).
FP8_CASES = [
    (1, 8, 2, 40, 24, "swiglu_oai", True, "gemv", "default", 128),
    (3, 4, 3, 160, 24, "silu", False, "gemv", "small", 32),
    (17, 8, 2, 40, 36, "swiglu_oai", True, "gemm", "small", 32),
    (40, 4, 3, 144, 24, "gelu_tanh", True, "gemm", "default", 128),
    (3, 8, 1, 48, 20, "silu", True, "gemm", "default", 0),
    (17, 4, 2, 40, 24, "silu", False, "gemv", "default", 0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_lora", [None, "gemv", "aligned"], ids=["base", "lora_gemv", "lora_aligned"])
@pytest.mark.parametrize("t,e,k,h,i,act,bias,form,blocks,block_k", FP8_CASES)
def test_fp8_experts(monkeypatch, t, e, k, h, i, act, bias, form, blocks, block_k, with_lora, dtype):
    check_quantized_experts(monkeypatch, "fp8", t, e, k, h, i, act, bias, form, blocks, with_lora, dtype,
                            block_k or h)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_gemv_form_with_whole_deltas_first(monkeypatch, fmt):
    """The GEMV form's adapters with GEMV_EXPANDS_LORA off (the expert-LoRA kernel writes
    whole delta rows, the GEMV adds them, as the grouped GEMM does) against the oracle;
    test_fp8_experts / test_quant_mxfp4 cover it on (the GEMV expands the shrunk rows)."""
    monkeypatch.setattr(fused_moe, "GEMV_EXPANDS_LORA", False)
    act = "swiglu_oai" if fmt == "mxfp4" else "silu"
    check_quantized_experts(monkeypatch, fmt, 3, 8, 2, 64, 32, act, fmt == "mxfp4", "gemv", "default", "gemv",
                            torch.float32, 32 if fmt == "fp8" else 128)


@pytest.mark.parametrize("with_lora", [None, "aligned"], ids=["base", "lora"])
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_prefill_steps_read_quantized_experts_dequantized(monkeypatch, fmt, with_lora):
    """Steps of DEQUANTIZE_MIN_PAIRS_PER_EXPERT pairs an expert or more write each
    quantized stack out in its dtype (one kernel) and run the plain grouped GEMM, with
    its configs (a bf16 table, not the format's), against the same oracle; smaller steps
    keep the quantized kernels. W8A8 experts keep theirs at every size."""
    monkeypatch.setitem(moe_configs.DEQUANTIZE_MIN_PAIRS_PER_EXPERT, fmt, 8)
    calls = count_quantized_kernels(monkeypatch)
    written = []
    real = fused_moe.dequantize_kernel
    monkeypatch.setattr(fused_moe, "dequantize_kernel", lambda w: written.append(w.shape) or real(w))
    act = "swiglu_oai" if fmt == "mxfp4" else "silu"
    e, h, i = 4, 64, 32
    check_quantized_experts(monkeypatch, fmt, 17, e, 2, h, i, act, fmt == "mxfp4", "gemm", "default",
                            with_lora, torch.float32, 32)  # 17 x 2 pairs over 4 experts: >= 8 each
    assert calls == {"gemm": 0, "gemv": 0}
    assert written == [(e, 2 * i, h), (e, h, i)] * 2  # summed and per-term calls
    if fmt == "fp8":
        w8 = Fp8Weight((e, 2 * i, h), 32, torch.bfloat16, device="meta", act_block=32)
        assert not moe_configs.dequantized(w8, 4096, 2) and moe_configs.weight_format(w8, 4096, 2) == "w8a8"
        return
    w_gu, w_d = (Mxfp4Weight(shape, torch.bfloat16, device="meta") for shape in ((e, 2 * i, h), (e, h, i)))
    assert [moe_configs.weight_format(w_gu, t, 2) for t in (15, 16)] == ["mxfp4", None]
    # Warm-up compiles both sides of the switch.
    assert {15, 16} <= set(fused_moe.warm_up_token_counts(w_gu, w_d, 2, 24))


def test_mxfp4_default_configs_keep_to_decode_sized_blocks():
    """Without a tuned file, MXFP4 experts' grouped GEMM takes blocks of at most 32 pairs
    at every step size that runs it (the PTX decode feeds mma.sync: taller blocks only
    repeat it; steps from DEQUANTIZE_MIN_PAIRS_PER_EXPERT read the experts dequantized,
    under the bf16 GEMM's tables)."""
    from loraplex.ops.triton.moe_gemm import gemm_config

    w = Mxfp4Weight((32, 64, 64), torch.bfloat16)
    quantized_steps = [t for t in (1, 16, 64, 256, 512, 1023, 4096) if not moe_configs.dequantized(w, t, 4)]
    assert quantized_steps == [1, 16, 64, 256, 512, 1023]
    assert all(gemm_config(w, t, 4)["BLOCK_M"] <= 32 for t in quantized_steps)
    assert gemm_config(w, 4096, 4)["BLOCK_M"] == 64  # dequantized: the bf16 GEMM's prefill tile


def test_mxfp4_path_setting_is_checked(monkeypatch):
    """LORAPLEX_MXFP4_PATH takes "hand" or nothing; another value (the MX dot's "mx", a
    typo) fails at import with the variable's name, not silently as the default."""
    from loraplex.ops.triton import quant_tiles

    for value, want in (("", None), ("hand", "hand")):
        monkeypatch.setenv("LORAPLEX_MXFP4_PATH", value)
        assert quant_tiles._forced_mxfp4_path() == want
    for bad in ("mx", "ptx", "Hand"):
        monkeypatch.setenv("LORAPLEX_MXFP4_PATH", bad)
        with pytest.raises(ValueError, match="LORAPLEX_MXFP4_PATH must be unset or 'hand'"):
            quant_tiles._forced_mxfp4_path()


def test_int4_experts_are_dequantized_first():
    """Int4 experts (AWQ / GPTQ MoE checkpoints), which no expert kernel reads, still
    serve: dequantized on entry, as the reference does."""
    from loraplex.ops.reference.quant import quantize_int4

    gen = torch.Generator().manual_seed(3)
    e, h, i, t = 4, 64, 32, 5
    w_gu = quantize_int4(torch.randn(e, 2 * i, h, generator=gen) / 8, 32, symmetric=False)
    w_d = quantize_int4(torch.randn(e, h, i, generator=gen) / 6, 32, symmetric=False)
    x = torch.randn(t, h, generator=gen)
    weights, ids = reference.route_experts(torch.randn(t, e, generator=gen), 2, True)
    expected = reference.fused_experts(x, weights, ids, w_gu, w_d, "silu")
    assert fused_moe.base_form(1, 2, w_gu, w_d) == "gemm"
    with ops.using_backend("triton"):
        out = ops.fused_experts(x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), w_gu.to(DEVICE),
                                w_d.to(DEVICE), "silu")
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_base_form_follows_the_pair_count():
    """Quantized experts take the GEMV form while a step has no more pairs than experts
    (decode), the grouped GEMM past that; plain weights always the GEMM."""
    def mx(*shape):
        return Mxfp4Weight(shape, torch.bfloat16, device="meta")

    gu, d = mx(32, 5760, 2880), mx(32, 2880, 2880)  # gpt-oss-20b: 32 experts, top-4
    assert [fused_moe.base_form(t, 4, gu, d) for t in (1, 8, 9, 512)] == ["gemv", "gemv", "gemm", "gemm"]
    plain = torch.empty(32, 5760, 2880, device="meta")
    assert fused_moe.base_form(1, 4, plain, torch.empty(32, 2880, 2880, device="meta")) == "gemm"


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_moe_warm_up_with_quantized_experts(monkeypatch, fmt):
    """warm_up_moe runs both forms on quantized experts and changes nothing; the token
    counts it warms cover every (form, configs, expert-LoRA) choice a step can make."""
    gen = torch.Generator().manual_seed(4)
    e, h, i = 4, 64, 32
    w_gu = quantized_experts(fmt, torch.randn(e, 2 * i, h, generator=gen) / 8, torch.float32, gen).to(DEVICE)
    w_d = quantized_experts(fmt, torch.randn(e, h, i, generator=gen) / 8, torch.float32, gen).to(DEVICE)
    lora = _to(make_lora(e, h, i, 3, gen), torch.float32, DEVICE)
    before = [b.clone() for w in (w_gu, w_d) for b in w.buffers()]
    counts = fused_moe.warm_up_token_counts(w_gu, w_d, 2, 24)
    forms = {fused_moe.base_form(t, 2, w_gu, w_d) for t in counts}
    assert forms == {"gemv", "gemm"}, counts
    ran = []
    real = fused_moe.fused_experts
    monkeypatch.setattr(fused_moe, "fused_experts", lambda x, *a: ran.append(x.shape[0]) or real(x, *a))
    with ops.using_backend("triton"):
        ops.warm_up_moe(w_gu, w_d, 2, True, "swiglu_oai", None, None, lora, 7.0, max_tokens=24)
    assert sorted(set(ran)) == counts
    assert all(torch.equal(a, b) for a, b in zip(before, (b for w in (w_gu, w_d) for b in w.buffers())))


def test_quantized_tuned_config_files(tmp_path, monkeypatch):
    """Quantized experts' GEMM configs have files of their own (the format in the name),
    and the tuner searches only what their kernel can run."""
    assert (moe_configs.config_file_name("NVIDIA_H100_80GB_HBM3", 32, 5760, 2880, torch.bfloat16, "mxfp4")
            == "moe_gemm_mxfp4_NVIDIA_H100_80GB_HBM3_E32_N5760_K2880_bfloat16.json")
    w = Mxfp4Weight((32, 5760, 2880), torch.bfloat16, device="meta")
    assert moe_configs.weight_format(w) == "mxfp4" and moe_configs.tuned_config(w, 4) is None
    assert moe_configs.weight_format(torch.empty(1)) is None
    for fused in (True, False):
        for t in (1, 64, 4096):
            cands = tune_moe.candidates(t, 4, 32, fused=fused, fmt="mxfp4")
            assert cands and all(c["BLOCK_K"] >= 32 for c in cands)
            for c in cands:  # bf16 activations, half a byte per weight value
                tiles = 2 * c["BLOCK_M"] * c["BLOCK_K"] + c["BLOCK_K"] * c["BLOCK_N"] * (1 + fused) // 2
                assert c["num_stages"] * tiles <= tune_moe.SMEM_BYTES
    # Which experts `loraplex tune` tunes: a quantized checkpoint's own format (FP8 with
    # its scale block), else --quantization's, else plain tensors.
    from loraplex.config import QuantConfig

    mxfp4, fp8 = QuantConfig("mxfp4", "mxfp4"), QuantConfig("fp8", "fp8", weight_block=(128, 64))
    assert tune_moe.experts_format(mxfp4, None) == ("mxfp4", 128)
    assert tune_moe.experts_format(fp8, "fp8") == ("fp8", 64)
    assert tune_moe.experts_format(None, "mxfp4") == ("mxfp4", 128)
    assert tune_moe.experts_format(None, None) == (None, 128)
    assert tune_moe.experts_format(QuantConfig("awq", "int4", group_size=128), None) == (None, 128)
    # The tuner's weights: random experts in the format, at a trained scale.
    gen = torch.Generator().manual_seed(0)
    for fmt, cls in (("mxfp4", Mxfp4Weight), ("fp8", Fp8Weight), (None, torch.Tensor)):
        w_gu, w_d = tune_moe.expert_weights(4, 64, 32, torch.bfloat16, fmt, "cpu", gen)
        assert isinstance(w_gu, cls) and tuple(w_gu.shape) == (4, 64, 64) and tuple(w_d.shape) == (4, 64, 32)
        values = w_gu if fmt is None else dequantize(w_gu)
        assert 0.01 < values.float().std() < 0.04


def test_tuner_cli_tunes_experts_in_their_format(tmp_path, monkeypatch):
    """`loraplex tune` tunes gpt-oss's experts as MXFP4 with --quantization mxfp4, or on
    its own for the published (MXFP4) checkpoint, and as plain tensors otherwise."""
    from loraplex.bench.workload import prepare_model_dir
    from loraplex.entrypoints.cli import main as cli

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tune_moe, "tune", lambda *a: calls.append(a) or [])
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert cli(["tune", "--model", "gpt-oss-20b", "--quantization", "mxfp4", *cache]) == 0
    assert calls[-1][:4] == (32, 2880, 2880, 4) and calls[-1][-3:] == ("mxfp4", 128, 0)
    assert cli(["tune", "--model", "gpt-oss-20b", *cache]) == 0
    assert calls[-1][-3:] == (None, 128, 0)
    src, _ = prepare_model_dir("gpt-oss-20b", tmp_path / "cache")
    published = tmp_path / "gpt-oss-20b-mxfp4"
    published.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    (published / "config.json").write_text(json.dumps(config))
    assert cli(["tune", "--model", str(published), *cache]) == 0
    assert calls[-1][-3:] == ("mxfp4", 128, 0)


def test_tuner_tunes_prompt_sizes_on_the_plain_gemm():
    """Token counts whose steps read quantized experts dequantized (moe_configs.dequantized)
    are tuned on the plain GEMM they run; W8A8 experts and plain tensors on their own."""
    w = Mxfp4Weight((32, 5760, 2880), torch.bfloat16, device="meta")  # gpt-oss-20b, top-4
    own, plain = tune_moe.split_counts(w, tune_moe.BATCH_SIZES, 4)
    assert own[-1] == 512 and plain == [1024, 2048, 4096]  # 128 pairs an expert on
    w8 = Fp8Weight((32, 5760, 2880), 128, torch.bfloat16, device="meta", act_block=128)
    assert tune_moe.split_counts(w8, (16, 4096), 4) == ([16, 4096], [])
    plain_weight = torch.empty(32, 5760, 2880, device="meta")
    assert tune_moe.split_counts(plain_weight, (16, 4096), 4) == ([16, 4096], [])


@pytest.fixture(scope="module")
def sm90_counts() -> dict:
    """Global memory instructions by width of the kernels compiled for sm_90 (no GPU
    needed; sm90_codegen_moe_quant.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = Path(__file__).with_name("sm90_codegen_moe_quant.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600,
                          cwd=script.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(DTYPE != "float32", reason="compiles for sm_90 once")
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8", "w8a8"])
@pytest.mark.parametrize("gemm", ["gate_up", "down"])
def test_quantized_expert_kernels_read_16_byte_vectors(sm90_counts, fmt, gemm):
    """On an H100: the grouped GEMM copies activation tiles to shared memory 16 bytes at
    a time and weight bytes in 16 byte copies (FP8's float32 scales in 4), a K step
    masked at gpt-oss's 2880 too; it reads scales once per group (padded rows of MXFP4
    scales in the copies: none a byte at a time in the decode form's loop) and stores
    16-byte vectors; only the bias (once per tile, in the wgmma accumulator's layout)
    may be read 2 bytes at a time. The GEMV reads weight rows, and its adapters' B rows,
    in 16-byte vectors. (bf16 MXFP4 as a GPU reads it: decoded in PTX.)"""
    for rows in ("decode", "prefill"):
        c = sm90_counts[f"gemm {fmt} {gemm} {rows}"]
        assert c.get("cp.async.16", 0) > 0 and c.get("st.v4.b32", 0) > 0, c
        assert c.get("ld.b16", 0) <= 4 and c.get("cp.async.8", 0) == c.get("cp.async.2", 0) == 0, c
        assert c.get("ld.b8", 0) <= 4, c  # MXFP4: the step's BLOCK_K / 32 scales (gate and up)
        if rows == "decode" and fmt == "mxfp4":  # padded scale rows: whole steps copied ahead
            assert c.get("ld.b8", 0) == 0, c
    if fmt != "w8a8":  # (W8A8 experts have no GEMV form)
        c = sm90_counts[f"gemv {fmt} {gemm}"]
        assert c.get("ld.v4.b32", 0) >= 2 and c.get("ld.b8", 0) <= 2, c
        assert c.get("ld.b16", 0) <= 4, c  # the bias, the activations: no B row 2 bytes at a time


def test_fp8_block_moe_checkpoint_on_triton(tmp_path, monkeypatch):
    """Qwen3-MoE in Qwen3-30B-A3B-FP8's per-expert layout (`mlp.experts.E.gate_proj.weight`
    + `.weight_scale_inv`), served by the FP8 expert kernels (interpreted on CPU)."""
    src = write_tiny_qwen3_moe(tmp_path / "moe")
    quantized, oracle = write_fp8_block(src, tmp_path, (16, 32))
    # Counted from before the engine starts: on a GPU, steps replay CUDA graphs captured then.
    calls = count_quantized_kernels(monkeypatch)
    llm = make_llm(quantized, ops_backend="triton")
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, Fp8Weight) and experts.gate_up_proj.block_k == 32
    check_against_twin(llm, oracle, random_prompts(3, (5, 30), seed=4))
    assert calls["gemm"] > 0 and calls["gemv"] > 0, calls  # prefill; decode (3 tokens x 2 <= 8 experts)
