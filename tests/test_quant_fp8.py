"""FP8 dense weights: the Triton GEMM (ops/triton/fp8_gemm.py) against the torch
reference on awkward shapes, in both forms and every way of finding scales; compressed-
tensors FP8 checkpoints (llm-compressor's float-quantized layout, per channel and per
tensor) serving what transformers + PEFT give on their dequantized twin, malformed ones
failing at load; the tuned config files and `loraplex tune`'s FP8 path."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    ADAPTERS,
    DEVICE,
    build_tiny_model,
    make_llm,
    make_peft_adapter,
    random_prompts,
)
from quantized import _rewrite, check_against_twin, write_tiny_qwen3_moe
from safetensors.torch import load_file, save_file

from loraplex import ops
from loraplex.errors import ModelLoadError, UnsupportedModel
from loraplex.ops.formats import Fp8Weight
from loraplex.ops.reference import quant as reference
from loraplex.ops.reference.quant import dequantize, quantize_fp8

pytest.importorskip("triton")
from loraplex.ops.triton import fp8_configs, fp8_gemm  # noqa: E402

# -- the kernel ----------------------------------------------------------------------------

def _weight(n: int, k: int, block_k: int, dtype: torch.dtype, seed: int) -> Fp8Weight:
    """On the CPU (the reference's); _on_device gives the kernels' copy."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, k, generator=gen) * 0.05
    values[:, : k // 3] *= 8  # scale blocks of different magnitudes
    return quantize_fp8(values.to(dtype), block_k)


def _on_device(w: Fp8Weight) -> Fp8Weight:
    return copy.deepcopy(w).to(DEVICE)  # (Module.to moves in place)


@pytest.mark.parametrize("t", [1, 3, 12, 17, 64, 200])
@pytest.mark.parametrize("per_channel", [False, True], ids=["block128", "per-channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_gemm_matches_the_reference(t, per_channel, dtype):
    """ops.linear through the Triton backend: N and K multiples of no tile, K not of
    128; decode counts take the GEMV form, the others tensor-core tiles (on a GPU, from
    DEQUANTIZE_MIN_TOKENS on, W dequantized and the dense GEMM)."""
    assert 64 < fp8_gemm.DEQUANTIZE_MIN_TOKENS <= 200
    n, k = 72, 200
    w = _weight(n, k, k if per_channel else 128, dtype, seed=t)
    gen = torch.Generator().manual_seed(100 + t)
    x = torch.randn(t, k, generator=gen).to(dtype).to(DEVICE)
    bias = (torch.randn(n, generator=gen) * 0.1).to(dtype).to(DEVICE) if t % 2 else None
    with ops.using_backend("triton"):
        y = ops.linear(x, _on_device(w), bias)
    want = reference.linear(x.cpu(), w, None if bias is None else bias.cpu())
    assert y.dtype == want.dtype == dtype and y.shape == (t, n)
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(y.cpu().float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
    assert (fp8_configs.default_config(t)["BLOCK_M"] < 16) == (t <= fp8_configs.GEMV_MAX_TOKENS)


@pytest.mark.parametrize("split_k", [2, 3, 4])
@pytest.mark.parametrize("form", ["gemv", "tiles", "w8a8"])
def test_fp8_gemm_split_k(split_k, form):
    """K split over programs whose float32 sums a second kernel adds (with the bias),
    rounding once: splits that end past K or hold nothing, per-block and per-channel
    scales, and W8A8's e4m3 tiles."""
    bm = 8 if form == "gemv" else 16
    cases = [(1, 200, 128, True), (5, 96, 32, False), (3, 256, 128, True), (7, 200, 200, True)]
    for t, k, block_k, bias in cases:
        if form == "w8a8" and block_k == 200:
            continue  # (W8A8: block-scaled weights)
        w = _weight(40, k, block_k, torch.bfloat16, seed=t + split_k)
        if form == "w8a8":
            w.act_block = block_k
        gen = torch.Generator().manual_seed(t)
        x = torch.randn(t, k, generator=gen).to(torch.bfloat16).to(DEVICE)
        b = (torch.randn(40, generator=gen) * 0.1).to(torch.bfloat16).to(DEVICE) if bias else None
        cfg = dict(BLOCK_M=bm, BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2, SPLIT_K=split_k)
        got = fp8_gemm.fp8_linear(x, _on_device(w), b, cfg)
        want = reference.linear(x.cpu(), w, None if b is None else b.cpu())
        tol = 2**-7 * want.abs().max().item()
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2**-7, atol=tol)


def test_fp8_split_k_sum_adds_the_lora_expand():
    """ops.lora_linear's fused form on an FP8 weight: the expand inside the split-K sum
    (slices off the sum's blocks, tokens of two slots and none), against the reference."""
    from test_quant_int4 import _lora_operands

    from loraplex.ops.reference.lora import lora_linear, lora_shrink
    from loraplex.ops.triton.split_k_sum import FusedExpand

    sizes, k, t = (24, 300, 8), 256, 5
    w = _weight(sum(sizes), k, 128, torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(t, k, generator=gen).to(DEVICE)
    bias = torch.randn(sum(sizes), generator=gen).to(DEVICE)
    a, b, batch = _lora_operands(t, k, sizes, 8, [1, -1, 0, 2, 1], [4, 2, 0], torch.float32, seed=5)
    buf = lora_shrink(x, a, batch)
    joined = []
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2, SPLIT_K=2)
    w = _on_device(w)
    lora = FusedExpand(buf, b, sizes, batch, lambda: joined.append(1))
    got = fp8_gemm.fp8_linear(x, w, bias, cfg, lora=lora)
    want = lora_linear(x, w, bias, a, b, sizes, batch)  # (the batch's tensors are on DEVICE)
    assert joined == [1]
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-4, rtol=1e-4)


def test_adapted_decode_gemms_split_k_for_the_fused_expand(monkeypatch):
    """A decode-sized GEMM with a LoRA expand to fuse splits K at least LORA_MIN_SPLIT_K
    ways (the expand then joins the split-K sum); without adapters, or in larger steps,
    the config's split stands."""
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1)
    assert fp8_gemm._split_k(cfg, 16, lora=True) == fp8_gemm.LORA_MIN_SPLIT_K == 2
    assert fp8_gemm._split_k(cfg, 16, lora=False) == 1
    assert fp8_gemm._split_k(cfg, 4096, lora=True) == 1
    assert fp8_gemm._split_k(dict(cfg, SPLIT_K=4), 16, lora=True) == 4
    monkeypatch.setattr(fp8_gemm, "LORA_MIN_SPLIT_K", 1)
    assert fp8_gemm._split_k(cfg, 16, lora=True) == 1


# Every way a K tile finds its scales: (block_k, BLOCK_K) -> mode. K = 200.
SCALE_CASES = [(200, 64, "row"), (128, 64, "tile"), (128, 128, "tile"), (128, 256, "split"),
               (32, 128, "split"), (48, 32, "gather")]


@pytest.mark.parametrize("block_k,block_k_tile,mode", SCALE_CASES)
@pytest.mark.parametrize("form", ["gemv", "tiles"])
def test_fp8_gemm_reads_exactly_dequantize(block_k, block_k_tile, mode, form):
    """x = I: y = dequantize(W).T, bit for bit, whatever the form, the scale lookup, and
    the weight's and x's dtypes (the kernel rounds W as dequantize does, then to x's
    dtype as ops.linear's reference does)."""
    n, k = 40, 200
    assert fp8_gemm.scale_mode(block_k, k, block_k_tile) == mode
    bm = 8 if form == "gemv" else 32
    cfg = dict(BLOCK_M=bm, BLOCK_N=16 if form == "gemv" else 32, BLOCK_K=block_k_tile, GROUP_M=2,
               num_warps=4, num_stages=2)
    for w_dtype, x_dtype in [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                             (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                             (torch.float16, torch.float32)]:
        w = _weight(n, k, block_k, w_dtype, seed=block_k)
        x = torch.eye(k, dtype=x_dtype, device=DEVICE)
        y = fp8_gemm.fp8_linear(x, _on_device(w), None, cfg)
        want = dequantize(w).to(x_dtype).T
        assert torch.equal(y.cpu(), want), (w_dtype, x_dtype, (y.cpu().float() - want.float()).abs().max())


def test_fp8_gemm_leading_dims_empty_inputs_and_dispatch(monkeypatch):
    w_cpu = _weight(24, 40, 128, torch.float32, seed=1)
    w = _on_device(w_cpu)
    x = torch.randn(2, 3, 40, device=DEVICE)
    y = fp8_gemm.fp8_linear(x, w, None)
    assert y.shape == (2, 3, 24)
    torch.testing.assert_close(y.cpu(), reference.linear(x.cpu(), w_cpu, None), rtol=1e-5, atol=1e-5)
    assert fp8_gemm.fp8_linear(x[:0, 0], w, None).shape == (0, 24)
    strided = torch.randn(5, 80, device=DEVICE)[:, ::2]  # x need not be contiguous
    torch.testing.assert_close(fp8_gemm.fp8_linear(strided, w, None).cpu(),
                               reference.linear(strided.cpu(), w_cpu, None), rtol=1e-5, atol=1e-5)
    import loraplex.ops.triton as triton_ops

    calls = []
    monkeypatch.setattr(triton_ops, "fp8_linear",
                        lambda *a, **kw: calls.append(a) or fp8_gemm.fp8_linear(*a, **kw))
    with ops.using_backend("triton"):
        ops.linear(x[0], w)
    assert len(calls) == 1


def test_fp8_gemm_compiles_for_sm90():
    """Both forms and the scale lookups compile for an H100/H200 (no GPU needed: the
    interpreter accepts code the compiler does not), fit in shared memory, and read W
    in 16-byte vectors (the step's bytes: 1 per weight); W8A8 multiplies e4m3 on wgmma."""
    script = r"""
import json, re, sys
sys.path.insert(0, sys.argv[1])
from sm90_codegen import compile_sm90, const, widths
from loraplex.ops.triton import fp8_configs
from loraplex.ops.triton.fp8_gemm import _fp8_gemm_kernel, scale_mode
out = {}
k = 4096
for t, block, a8, n, split in [
        (1, 128, 0, 6144, 1), (4, 4096, 0, 6144, 1), (16, 128, 0, 6144, 1), (16, 128, 0, 2048, 1),
        (16, 128, 0, 2048, 4), (32, 128, 0, 6144, 1), (64, 128, 0, 6144, 1), (2048, 128, 0, 6144, 1),
        (2048, 4096, 0, 6144, 1), (1, 128, 1, 6144, 1), (16, 128, 1, 6144, 1), (16, 128, 1, 6144, 2),
        (64, 128, 1, 6144, 1), (2048, 128, 1, 6144, 1)]:
    cfg = fp8_configs.default_config(t, bool(a8), n)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    args = dict(x_ptr="*fp8e4nv" if a8 else "*bf16", xs_ptr="*fp32", q_ptr="*fp8e4nv", s_ptr="*fp32",
                bias_ptr="*bf16", y_ptr="*fp32" if split > 1 else "*bf16",
                T=t, N=n, K=k, K_SPLIT=k // split, stride_xt=k, stride_xst=k // 128, stride_qn=k,
                stride_sn=-(-k // block), stride_yt=n, stride_ys=t * n,
                HAS_BIAS=const(True), SCALE_BLOCK=const(block), SCALES=const(scale_mode(block, k, bk)),
                SPLIT_K=const(split),
                W8A8=const(bool(a8)), ACT_BLOCK=const(128 if a8 else 1),
                W_DTYPE=const("bfloat16"), X_DTYPE=const("bfloat16"), GEMV=const(bm < 16),
                BLOCK_M=const(bm), BLOCK_N=const(bn), BLOCK_K=const(bk), GROUP_M=const(cfg["GROUP_M"]),
                EVEN_K=const(True), EVEN_N=const(True), DOT_PRECISION=const("tf32"), UPCAST=const(False))
    c = compile_sm90(_fp8_gemm_kernel, args, cfg["num_warps"], cfg["num_stages"])
    mma = sorted(set(re.findall(r"(wgmma[.a-z_]*\.m64n\d+k\d+\.f32\.\w+|mma\.sync)", c.asm["ptx"])))
    name = f"{t}-{block}-N{n}-split{split}" + ("-w8a8" if a8 else "")
    out[name] = dict(shared=c.metadata.shared, mma=mma,
                     store_bytes=bm * bn // (32 * cfg["num_warps"]) * (4 if split > 1 else 2),
                     **widths(c.asm["ptx"]))
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    tests = Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", script, str(tests)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    for name, c in counts.items():
        assert 0 < c["shared"] <= 232_448, (name, c)
        if name.endswith("w8a8"):  # e4m3 x e4m3 on wgmma at every size (the operands swap under 64 rows)
            assert c["mma"] and all(m.startswith("wgmma") and m.endswith("e4m3") for m in c["mma"]), (name, c)
        gemv = name.split("-")[0] in ("1", "4") and not name.endswith("w8a8")
        if gemv:  # plain loads of W, 16 bytes each
            assert c.get("ld.v4.b32", 0) >= 1, (name, c)
        else:  # pipelined copies to shared memory, and vector stores of the tile (one
            # 32-bit store a thread where that is its share: 16 x 16 bf16 of 4 warps)
            wide = c["store_bytes"] > 4
            stores = c.get("st.v4.b32", 0) + c.get("st.v2.b32", 0) if wide else c.get("st.b32", 0)
            assert c.get("cp.async.16", 0) >= 2 and stores > 0, (name, c)


# -- compressed-tensors FP8 checkpoints ------------------------------------------------------

def ct_config(strategy: str, **changes) -> dict:
    """quantization_config as llm-compressor writes it for FP8_DYNAMIC-style schemes
    (compressed_tensors QuantizationConfig.model_dump, ModelCompressor.update_config)."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
               "strategy": strategy, "block_structure": None, "dynamic": False, "actorder": None,
               "observer": "minmax", "observer_kwargs": {}}
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
              "strategy": "token", "block_structure": None, "dynamic": True, "actorder": None,
              "observer": None, "observer_kwargs": {}}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
             "output_activations": None, "format": None}
    config = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "config_groups": {"group_0": group}, "ignore": ["lm_head"], "kv_cache_scheme": None,
              "quantization_status": "compressed", "global_compression_ratio": None,
              "sparsity_config": {}, "transform_config": {}, "version": "0.10.2"}
    for key, value in changes.items():
        where, _, name = key.rpartition("__")
        target = {"": config, "weights": weights, "inputs": inputs, "group": group}[where]
        target[name] = value
    return config


def ct_quantize(w: torch.Tensor, strategy: str, scale_dtype: torch.dtype):
    """(e4m3 weight [N, K], weight_scale) as compressed_tensors quantizes with the minmax
    observer: scale = amax / 448 over each output row ([N, 1], strategy channel) or the
    whole tensor ([1], tensor), held in the weight's dtype; weight = w / scale in e4m3."""
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    scale = (amax.float() / 448.0).to(scale_dtype)
    q = (w.float() / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def write_ct_fp8(src: Path, out: Path, strategy: str, scale_dtype=torch.float32) -> tuple[Path, Path]:
    """(the compressed-tensors checkpoint, its dequantized twin) of the model at src."""
    def convert(name, t):
        q, scale = ct_quantize(t, strategy, scale_dtype)
        stem = name.removesuffix(".weight")
        return {name: q, f"{stem}.weight_scale": scale}, q.float() * scale.float()

    quantized_dir, oracle_dir = out / f"ct-{strategy}", out / f"ct-{strategy}-dequantized"
    _rewrite(src, quantized_dir, oracle_dir, ct_config(strategy), convert)
    return quantized_dir, oracle_dir


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("dense") / "qwen3", "qwen3")


def _assert_loaded_exactly(llm, oracle_dir):
    """Every projection holds e4m3 data with one scale per row, and dequantizes to the
    twin's weights exactly (per tensor: q, k and v each their own scale)."""
    oracle = load_file(str(oracle_dir / "model.safetensors"))
    for i, layer in enumerate(llm.engine.runner.model.model.layers):
        for fused, parts in [(layer.self_attn.qkv_proj, ("self_attn.q_proj", "self_attn.k_proj",
                                                         "self_attn.v_proj")),
                             (layer.self_attn.o_proj, ("self_attn.o_proj",)),
                             (layer.mlp.gate_up_proj, ("mlp.gate_proj", "mlp.up_proj")),
                             (layer.mlp.down_proj, ("mlp.down_proj",))]:
            w = fused.weight
            assert isinstance(w, Fp8Weight) and w.block_k == w.shape[1] and w.scale.shape == (w.shape[0], 1)
            want = torch.cat([oracle[f"model.layers.{i}.{p}.weight"] for p in parts]).to(w.dtype)
            assert torch.equal(dequantize(w).cpu(), want), (i, parts)


@pytest.mark.parametrize("strategy,scale_dtype", [("channel", torch.bfloat16), ("tensor", torch.float32)])
def test_compressed_tensors_fp8_serves_its_dequantized_weights(dense_dir, tmp_path, strategy, scale_dtype):
    quantized, oracle = write_ct_fp8(dense_dir, tmp_path, strategy, scale_dtype)
    adapter = make_peft_adapter(oracle, tmp_path / "adapter", seed=3, **ADAPTERS["all7-r8"])
    llm = make_llm(quantized)
    _assert_loaded_exactly(llm, oracle)
    check_against_twin(llm, oracle, random_prompts(4, (5, 30), seed=2), adapter)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_fp8_through_the_triton_kernel(dense_dir, tmp_path, strategy, monkeypatch):
    """The same through ops_backend triton (the FP8 GEMM; interpreted on CPU)."""
    import loraplex.ops.triton as triton_ops

    forms = set()

    def counted(x, w, bias, **kwargs):
        forms.add(fp8_configs.default_config(x.shape[0])["BLOCK_M"] < 16)
        return fp8_gemm.fp8_linear(x, w, bias, **kwargs)

    monkeypatch.setattr(triton_ops, "fp8_linear", counted)
    quantized, oracle = write_ct_fp8(dense_dir, tmp_path, strategy)
    adapter = make_peft_adapter(oracle, tmp_path / "adapter", seed=4, **ADAPTERS["qv-r4-rslora"])
    check_against_twin(make_llm(quantized, ops_backend="triton"), oracle, random_prompts(3, (5, 24), seed=6),
                       adapter)
    assert forms == {True, False}  # decode steps in the GEMV form, prefill in tiles


def test_compressed_tensors_fp8_moe_checkpoint(tmp_path):
    """Qwen3-MoE as llm-compressor publishes it: per-expert modules in FP8, the router
    (ignored, re:.*mlp.gate$) in its dtype."""
    src = write_tiny_qwen3_moe(tmp_path / "moe")
    quantized, oracle = write_ct_fp8(src, tmp_path, "channel")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*mlp.gate$"]
    (quantized / "config.json").write_text(json.dumps(config))
    llm = make_llm(quantized)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, Fp8Weight) and isinstance(experts.down_proj, Fp8Weight)
    check_against_twin(llm, oracle, random_prompts(3, (5, 30), seed=4), moe=True)


@pytest.mark.parametrize("strategy,damage", [
    ("channel", "missing scale"), ("channel", "nan scale"), ("channel", "zero scale"),
    ("channel", "negative scale"), ("channel", "scale [N]"), ("channel", "scale [1, N]"),
    ("channel", "scale rows"), ("channel", "scale per tensor"), ("channel", "int scale"),
    ("tensor", "scale [1, 1]"), ("tensor", "scale [N, 1]"), ("tensor", "scale []"),
    ("channel", "weight not fp8"), ("channel", "weight e5m2"), ("channel", "nonzero zero point"),
    ("channel", "input_scale"),
])
def test_malformed_compressed_tensors_checkpoints_fail_at_load(dense_dir, tmp_path, strategy, damage):
    quantized, _ = write_ct_fp8(dense_dir, tmp_path, strategy)
    path = quantized / "model.safetensors"
    tensors = load_file(str(path))
    stem = "model.layers.0.self_attn.k_proj"
    scale = tensors[f"{stem}.weight_scale"]
    n = tensors[f"{stem}.weight"].shape[0]
    if damage == "missing scale":
        del tensors[f"{stem}.weight_scale"]
    elif damage == "nan scale":
        scale.view(-1)[0] = float("nan")
    elif damage == "zero scale":
        scale.view(-1)[0] = 0.0
    elif damage == "negative scale":
        scale.view(-1)[-1] = -scale.view(-1)[-1]
    elif damage == "scale [N]":
        tensors[f"{stem}.weight_scale"] = scale.reshape(n).contiguous()
    elif damage == "scale [1, N]":
        tensors[f"{stem}.weight_scale"] = scale.reshape(1, n).contiguous()
    elif damage == "scale rows":
        tensors[f"{stem}.weight_scale"] = torch.cat([scale, scale[:1]])
    elif damage in ("scale per tensor", "scale [1, 1]", "scale []"):
        shape = {"scale per tensor": (1,), "scale [1, 1]": (1, 1), "scale []": ()}[damage]
        tensors[f"{stem}.weight_scale"] = scale.view(-1)[:1].reshape(shape).contiguous()
    elif damage == "scale [N, 1]":
        tensors[f"{stem}.weight_scale"] = scale.expand(n).reshape(n, 1).contiguous()
    elif damage == "int scale":
        tensors[f"{stem}.weight_scale"] = torch.ones_like(scale, dtype=torch.int32)
    elif damage == "weight not fp8":
        tensors[f"{stem}.weight"] = tensors[f"{stem}.weight"].float()
    elif damage == "weight e5m2":
        tensors[f"{stem}.weight"] = tensors[f"{stem}.weight"].float().to(torch.float8_e5m2)
    elif damage == "nonzero zero point":
        tensors[f"{stem}.weight_zero_point"] = torch.ones(n, 1, dtype=torch.int8)
    else:  # a static activation scale the config does not declare
        tensors[f"{stem}.input_scale"] = torch.ones(1)
    save_file(tensors, str(path))
    with pytest.raises(ModelLoadError, match="k_proj"):
        make_llm(quantized)


def test_compressed_tensors_zero_points_of_zero_load(dense_dir, tmp_path):
    """Symmetric checkpoints of older compressed-tensors versions kept zero points of 0."""
    quantized, oracle = write_ct_fp8(dense_dir, tmp_path, "channel")
    path = quantized / "model.safetensors"
    tensors = load_file(str(path))
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        tensors[name.replace("weight_scale", "weight_zero_point")] = torch.zeros(
            tensors[name].shape, dtype=torch.int8)
    save_file(tensors, str(path))
    _assert_loaded_exactly(make_llm(quantized), oracle)


@pytest.mark.parametrize("changes,words", [
    (dict(inputs__dynamic=False), "static activation scales"),
    (dict(weights__symmetric=False), "asymmetric"),
    (dict(weights__strategy="group", weights__group_size=128), "weight strategy 'group'"),
    (dict(weights__strategy="block", weights__block_structure=[128, 128]), "weight strategy 'block'"),
    (dict(weights__dynamic=True), "dynamic"),
    (dict(weights__type="int"), "weights int of 8 bits"),
    (dict(weights__num_bits=4), "weights float of 4 bits"),
    (dict(weights__actorder="group"), "actorder"),
    (dict(format="pack-quantized"), "format 'pack-quantized'"),
    (dict(format="dense"), "format 'dense'"),
    (dict(group__format="nvfp4-pack-quantized", format="mixed-precision"), "nvfp4"),
    (dict(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}),
     "kv_cache_scheme"),
    (dict(group__output_activations={"num_bits": 8, "type": "float"}), "output activation"),
    (dict(transform_config={"config_groups": {"u": {"type": "hadamard"}}}), "transform_config"),
    (dict(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity format"),
    (dict(config_groups={"FP8_DYNAMIC": ["Linear"]}), "preset scheme 'FP8_DYNAMIC'"),
    (dict(config_groups={}), "0 config groups"),
])
def test_unsupported_compressed_tensors_variants_fail_at_startup(dense_dir, tmp_path, changes, words):
    import shutil

    d = tmp_path / "variant"
    shutil.copytree(dense_dir, d)
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = ct_config("channel", **changes)
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match=words):
        make_llm(d)


def test_compressed_tensors_configs_read():
    from loraplex.config import QuantConfig

    for strategy, block in [("channel", (1, 0)), ("tensor", (0, 0))]:
        q = QuantConfig.from_hf("Qwen3ForCausalLM", ct_config(strategy))
        assert (q.method, q.format, q.weight_block) == ("compressed-tensors", "fp8", block)
        assert q.skip == ("lm_head",)
    # weight-only FP8 (no input_activations), and the format given per group
    q = QuantConfig.from_hf("Qwen3ForCausalLM", ct_config("channel", group__input_activations=None,
                                                          group__format="float-quantized",
                                                          format="mixed-precision"))
    assert q.weight_block == (1, 0)


# -- tuned configs and the tuner ----------------------------------------------------------

def test_tuned_fp8_config_files_are_read_for_their_shape(tmp_path, monkeypatch):
    from loraplex.ops.triton import moe_configs

    name = fp8_configs.config_file_name("NVIDIA_H100_80GB_HBM3", 6144, 4096, torch.bfloat16)
    assert name == "fp8_gemm_NVIDIA_H100_80GB_HBM3_N6144_K4096_bfloat16.json"
    # a file of the first tuner's keys (no SPLIT_K: read as 1), then the tuner's entries
    gemv = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=512, GROUP_M=1, num_warps=4, num_stages=3)
    tiles = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, SPLIT_K=1)
    split = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, SPLIT_K=4)
    moe_configs.save_configs(tmp_path / name, {1: gemv})
    keys = (fp8_configs.KEYS, fp8_configs.OPTIONAL)
    moe_configs.save_configs(tmp_path / name, {16: split, 2048: tiles}, *keys)
    monkeypatch.setenv(moe_configs.ENV_VAR, str(tmp_path))
    monkeypatch.setattr(fp8_configs, "device_name", lambda device: "NVIDIA_H100_80GB_HBM3")
    fp8_configs.clear_cache()
    try:
        cuda = torch.device("cuda")
        assert fp8_configs.gemm_config(6144, 4096, torch.bfloat16, 1, cuda) == {**gemv, "SPLIT_K": 1}
        assert fp8_configs.gemm_config(6144, 4096, torch.bfloat16, 16, cuda) == split
        assert fp8_configs.gemm_config(6144, 4096, torch.bfloat16, 4000, cuda) == tiles
        # far from any tuned count, another shape or dtype, or on CPU: the defaults
        assert fp8_configs.gemm_config(6144, 4096, torch.bfloat16, 64, cuda) == fp8_configs.default_config(64)
        assert fp8_configs.gemm_config(4096, 4096, torch.bfloat16, 1, cuda) == fp8_configs.default_config(1)
        assert fp8_configs.gemm_config(6144, 4096, torch.float16, 1, cuda) == fp8_configs.default_config(1)
        assert fp8_configs.gemm_config(6144, 4096, torch.bfloat16, 1, torch.device("cpu")) \
            == fp8_configs.default_config(1)
    finally:
        fp8_configs.clear_cache()


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_fp8_tuner_tries_split_k_at_decode_sizes(monkeypatch):
    """tune_fp8: the fastest of the candidates, then (up to SPLIT_K_MAX_TOKENS tokens) the
    three fastest with K split 2 / 4 / 8 ways where K holds two steps a split; a split
    wins only where it is faster."""
    from loraplex.bench import tune_fp8

    asked = []

    def ranked(configs, launch, per):  # time = BLOCK_N, halved by each doubling of SPLIT_K
        asked.append(configs)
        return sorted(((c["BLOCK_N"] / c["SPLIT_K"], c) for c in configs), key=lambda r: r[0])

    monkeypatch.setattr(tune_fp8, "ranked", ranked)
    w = Fp8Weight((64, 512), 128, torch.bfloat16)
    x = torch.zeros(16, 512, dtype=torch.bfloat16)
    best = tune_fp8._best(x, [w], 16)
    assert len(asked) == 2 and all(c["SPLIT_K"] == 1 for c in asked[0])
    top = sorted(asked[0], key=lambda c: c["BLOCK_N"])[:3]
    assert {(c["BLOCK_N"], c["BLOCK_K"]) for c in asked[1]} <= {(c["BLOCK_N"], c["BLOCK_K"]) for c in top}
    assert all(512 >= 2 * c["SPLIT_K"] * c["BLOCK_K"] for c in asked[1])
    assert best["SPLIT_K"] > 1 and best["BLOCK_N"] == 16
    asked.clear()
    assert tune_fp8._best(torch.zeros(256, 512, dtype=torch.bfloat16), [w], 256)["SPLIT_K"] == 1
    assert len(asked) == 1


def test_tuners_read_weights_past_l2(monkeypatch):
    """The tuners cycle through enough copies of a weight that each launch reads it from
    device memory (twice the L2), at least 2, at most `most`."""
    from types import SimpleNamespace

    from loraplex.bench import tuning

    h100 = SimpleNamespace(L2_cache_size=50 << 20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: h100)
    assert tuning.copies_past_l2(10 << 20, "cuda") == 10
    assert tuning.copies_past_l2(117 << 20, "cuda") == 2
    assert tuning.copies_past_l2(256 << 10, "cuda") == 64 and tuning.copies_past_l2(256 << 10, "cuda", 8) == 8


def test_fp8_tuner_candidates_run_and_fit():
    """Every candidate is a config the kernel computes correctly with (a sample, run
    under the interpreter on a small W), fits an H100's shared memory, and keeps K
    steps within scale blocks or whole ones."""
    from loraplex.bench import tune_fp8
    from loraplex.bench.tune_moe import SMEM_BYTES

    for t in (1, 3, 8, 16, 64, 200, 4096):
        for block_k in (128, 4096):
            cands = tune_fp8.candidates(t, 4096, block_k)
            assert cands and all(set(c) == set(fp8_configs.KEYS) and c["SPLIT_K"] == 1 for c in cands)
            gemv = [c for c in cands if c["BLOCK_M"] < fp8_configs.MIN_DOT_M]
            assert bool(gemv) == (t <= fp8_configs.GEMV_MAX_TOKENS)
            assert all(c["BLOCK_M"] == triton_next_pow2(t) for c in gemv)
            for c in cands:
                assert fp8_gemm.scale_mode(block_k, 4096, c["BLOCK_K"]) != "gather"
                if c["BLOCK_M"] >= 16:
                    assert c["BLOCK_M"] <= max(16, 2 * triton_next_pow2(t))
                    tiles = c["BLOCK_M"] * c["BLOCK_K"] * 2 + c["BLOCK_K"] * c["BLOCK_N"]
                    assert c["num_stages"] * tiles + c["BLOCK_K"] * c["BLOCK_N"] * 2 <= SMEM_BYTES
    w_cpu = _weight(40, 200, 128, torch.bfloat16, seed=7)
    w = _on_device(w_cpu)
    x = torch.randn(9, 200).to(torch.bfloat16).to(DEVICE)
    want = reference.linear(x.cpu(), w_cpu, None).float()
    sample = tune_fp8.candidates(3, 200, 128)[::5] + tune_fp8.candidates(64, 200, 128)[::17]
    for cfg in sample:
        y = fp8_gemm.fp8_linear(x, w, None, cfg).cpu().float()
        torch.testing.assert_close(y, want, rtol=2**-8, atol=2**-8 * want.abs().max().item(), msg=str(cfg))


def test_fp8_tuner_cli_path(tmp_path, monkeypatch, capsys):
    """`loraplex tune --quantization fp8` takes a dense model and tunes its projection
    shapes (no GPU here: the timing loop is replaced); without it a dense model is still
    refused; an FP8 checkpoint needs no flag; a MoE model gets both tuners."""
    from loraplex.bench import tune_fp8, tune_moe
    from loraplex.entrypoints.cli import main as cli

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tune_fp8, "tune", lambda *a: calls.append(("fp8", *a)) or [])
    monkeypatch.setattr(tune_moe, "tune", lambda *a: calls.append(("moe", *a)) or [])
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert cli(["tune", "--model", "llama-3.1-8b", "--quantization", "fp8", "--batch-sizes", "1", "64",
                "--out", str(tmp_path / "out"), *cache]) == 0
    assert calls == [("fp8", [(4096, 4096), (4096, 14336), (6144, 4096), (28672, 4096)], 128,
                      torch.bfloat16, [1, 64], str(tmp_path / "out"), 0)]
    calls.clear()
    assert cli(["tune", "--model", "llama-3.1-8b", *cache]) == 2
    assert "not a mixture-of-experts model" in capsys.readouterr().err and not calls
    assert cli(["tune", "--model", "qwen3-30b-a3b", "--quantization", "fp8", *cache]) == 0
    assert [c[0] for c in calls] == ["moe", "fp8"]
    assert calls[1][1] == [(2048, 4096), (5120, 2048)]  # o, qkv (experts: MoE; the router stays bf16)
    calls.clear()
    # an FP8 checkpoint: its own scale blocks (per channel: None), no flag needed
    from loraplex.bench.workload import prepare_model_dir

    src, _ = prepare_model_dir("qwen3-0.6b", tmp_path / "cache")
    fp8_dir = tmp_path / "qwen3-0.6b-fp8"
    fp8_dir.mkdir()
    config = json.loads((src / "config.json").read_text())
    (fp8_dir / "config.json").write_text(json.dumps({**config, "quantization_config": ct_config("channel")}))
    assert cli(["tune", "--model", str(fp8_dir), "--dtype", "float16", *cache]) == 0
    assert calls[0][0] == "fp8" and calls[0][2] is None and calls[0][3] == torch.float16
