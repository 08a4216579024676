"""DeepSeek-V2 and -V3 against transformers (+ PEFT): multi-head latent attention (q_proj,
or q_a_proj -> norm -> q_b_proj; YaRN's softmax scale; interleaved rotary pairs or not),
a dense first layer, MoE layers with shared experts and scaled routed weights (greedy,
group-limited, and V3's sigmoid with a correction bias in groups); adapters on every
projection and every routed expert, mixed with base rows; the cache holds the latent,
not keys and values."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import BOS, DTYPE, EOS, VOCAB, HFOracle, make_llm, make_peft_adapter, random_prompts, tolerance

from loraplex import LoRARequest, SamplingParams
from loraplex.bench.synthetic import write_random_model
from loraplex.errors import UnsupportedModel

SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0, logprobs=5)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
            beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)


def tiny_config(v3: bool = False, **overrides):
    """3 layers (the first dense), 4 heads, latent 32, rotary 8, 8 routed experts (top-2)
    and 2 shared ones."""
    import transformers

    config = transformers.DeepseekV3Config if v3 else transformers.DeepseekV2Config
    arch = "DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"
    return config(**{**dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
        n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1, topk_method="greedy",
        norm_topk_prob=False, routed_scaling_factor=1.5, max_position_embeddings=512,
        bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.08, architectures=[arch],
    ), **overrides})


VARIANTS = {
    "q_proj": {},  # V2-Lite's form
    "q_lora-yarn-groups": dict(q_lora_rank=24, rope_parameters=YARN, topk_method="group_limited_greedy",
                               n_group=4, topk_group=2),  # V2's
    "v3": dict(v3=True, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
               routed_scaling_factor=2.5),
    "v3-halves": dict(v3=True, rope_interleave=False, n_group=2, topk_group=1, routed_scaling_factor=2.5),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def deepseek(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"deepseek-{request.param}")
    model_dir = write_random_model(root / "model", tiny_config(**VARIANTS[request.param]), 0)
    if VARIANTS[request.param].get("v3"):
        _randomise_correction_bias(model_dir)
    q = ["q_a_proj", "q_b_proj"] if VARIANTS[request.param].get("q_lora_rank") else ["q_proj"]
    adapter = make_peft_adapter(
        model_dir, root / "adapter", seed=3, r=4, lora_alpha=8,
        target_modules=[*q, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    return model_dir, adapter


def _randomise_correction_bias(model_dir):
    """transformers starts V3's e_score_correction_bias at zero: make it choose."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = 0.2 * torch.randn(t.shape, generator=gen)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _prompt_lps(out, prompt) -> torch.Tensor:
    return torch.tensor([x[t].logprob for x, t in zip(out.prompt_logprobs[1:], prompt[1:])])


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: every position; bf16: the median (a router near a tie may pick another expert)."""
    if DTYPE == "float32":
        torch.testing.assert_close(got, want, atol=tolerance(), rtol=0)
    else:
        assert (got - want).abs().median() <= tolerance(), (got - want).abs()


def test_matches_transformers(deepseek):
    model_dir, _ = deepseek
    llm = make_llm(model_dir)
    cfg = llm.config.model
    assert cfg.moe_layers == (1, 2) and cfg.num_shared_experts == 2 and cfg.mla.cache_dim == 40
    oracle = HFOracle(model_dir)
    prompts = random_prompts(3, (5, 40), seed=1)
    for prompt, out in zip(prompts, llm.generate(prompts, SP)):
        _assert_close(_prompt_lps(out, prompt), oracle.prompt_logprobs(prompt))
        if DTYPE == "float32":
            assert out.outputs[0].token_ids == oracle.greedy(prompt, SP.max_tokens)


def test_adapters_on_every_projection_and_expert_mixed_with_base_rows(deepseek):
    """kv_b_proj's adapter is applied inside the absorbed attention, exactly."""
    model_dir, adapter = deepseek
    llm = make_llm(model_dir)
    prompts = random_prompts(4, (5, 30), seed=2)
    lora = LoRARequest("all", 1, str(adapter))
    outs = llm.generate(prompts, SP, [lora, None, lora, None])
    adapted, base = HFOracle(model_dir, adapter), HFOracle(model_dir)
    assert (adapted.prompt_logprobs(prompts[0]) - base.prompt_logprobs(prompts[0])).abs().max() > 0.1
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        _assert_close(_prompt_lps(out, prompt), (adapted if i % 2 == 0 else base).prompt_logprobs(prompt))


def test_cache_holds_the_latent_and_prefixes_are_reused(deepseek):
    """One cache tensor per layer of kv_lora_rank + qk_rope_head_dim values a token;
    a repeated prompt reads its cached pages and gives the same logprobs."""
    model_dir, _ = deepseek
    llm = make_llm(model_dir)
    layers = [m for m in llm.engine.runner.model.modules() if hasattr(m, "kv_cache_spec")]
    assert [m.kv_cache_spec() for m in layers] == [{"latent_cache": (40,)}] * 3
    assert layers[0].latent_cache.shape[-1] == 40
    prompt = random_prompts(1, (40, 41), seed=4)[0]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)  # (prompt logprobs
    first, second = (llm.generate([prompt], sp)[0].outputs[0] for _ in range(2))  # recompute all)
    assert llm.generate([prompt], sp)[0].num_cached_tokens >= 32
    assert second.token_ids == first.token_ids
    lps = [[pos[t].logprob for pos, t in zip(o.logprobs, o.token_ids)] for o in (first, second)]
    torch.testing.assert_close(torch.tensor(lps[1]), torch.tensor(lps[0]), atol=1e-5, rtol=0)


def test_unsupported_variants_are_refused(tmp_path):
    grouped = tiny_config(topk_method="group_limited_greedy", n_group=3, topk_group=1)
    for name, cfg, match in (("method", tiny_config(topk_method="random"), "topk_method 'random'"),
                             ("groups", grouped, "do not group 8 experts")):
        with pytest.raises(UnsupportedModel, match=match):
            make_llm(write_random_model(tmp_path / name, cfg, 0))


def test_triton_backend_decodes_like_transformers(deepseek):
    """The Triton ops (the interpreter on CPU): decode steps take the latent-attention
    kernel, adapters on kv_b_proj gathered per token, beside base rows."""
    model_dir, adapter = deepseek
    llm = make_llm(model_dir, ops_backend="triton")
    prompts = random_prompts(2, (5, 20), seed=5)
    lora = LoRARequest("all", 1, str(adapter))
    outs = llm.generate(prompts, SP, [lora, None])
    for out, prompt, oracle in zip(outs, prompts, (HFOracle(model_dir, adapter), HFOracle(model_dir))):
        _assert_close(_prompt_lps(out, prompt), oracle.prompt_logprobs(prompt))
        if DTYPE == "float32":
            assert out.outputs[0].token_ids == oracle.greedy(prompt, SP.max_tokens)


def test_fp8_at_load_time(deepseek, tmp_path):
    """--quantization fp8 on a bf16 DeepSeek checkpoint: every projection and expert in
    FP8 except kv_b_proj (latent attention reads it as a tensor) and the routers; served as
    transformers + PEFT serve the weights round-tripped through FP8, adapter rows beside
    base rows, by the reference ops and by the Triton kernels."""
    from safetensors.torch import load_file, save_file

    from loraplex.ops.reference.quant import dequantize, quantize_fp8

    model_dir, adapter = deepseek
    oracle = tmp_path / "round-tripped"
    shutil.copytree(model_dir, oracle)
    tensors = load_file(str(model_dir / "model.safetensors"))
    for name, t in tensors.items():
        if (name.startswith("model.layers.") and name.endswith(("proj.weight", "mqa.weight"))
                and "kv_b_proj" not in name) or ".experts." in name:
            tensors[name] = dequantize(quantize_fp8(t, 128)).to(t.dtype)
    save_file(tensors, str(oracle / "model.safetensors"))
    _check_fp8_model(model_dir, oracle, adapter, quantization="fp8")


def _check_fp8_model(model_dir, oracle, adapter, **kwargs) -> None:
    """The model at model_dir served in FP8 (`kwargs`: how it gets there) by the reference
    ops and the Triton kernels (the interpreter on CPU): every projection and expert in
    FP8 but kv_b_proj (latent attention reads it as a tensor) and the routers; prompt
    logprobs as transformers + PEFT give them on `oracle`, adapter rows beside base rows."""
    from loraplex.ops.formats import Fp8Weight

    llms = [make_llm(model_dir, ops_backend=b, **kwargs) for b in ("torch", "triton")]
    model = llms[0].engine.runner.model.model
    attn, moe = model.layers[1].self_attn, model.layers[1].mlp
    fp8 = (attn.qkv_a_proj.weight, attn.o_proj.weight, moe.experts.gate_up_proj, moe.experts.down_proj,
           moe.shared_experts.gate_up_proj.weight, moe.shared_experts.down_proj.weight)
    assert all(isinstance(w, Fp8Weight) for w in fp8)
    assert isinstance(attn.kv_b_proj.weight, torch.nn.Parameter)
    assert isinstance(moe.gate.weight, torch.nn.Parameter)
    prompts = random_prompts(4, (5, 30), seed=8)
    lora = LoRARequest("all", 1, str(adapter))
    loras = [lora, None] * 2
    oracles = {lora: HFOracle(oracle, adapter), None: HFOracle(oracle)}
    for llm in llms:
        for p, out, a in zip(prompts, llm.generate(prompts, SP, loras), loras):
            _assert_close(_prompt_lps(out, p), oracles[a].prompt_logprobs(p))


def _write_fp8_checkpoint(model_dir, out, block=(16, 32)) -> tuple:
    """(DeepSeek's FP8 layout of model_dir, its dequantized twin): every projection of
    attention (kv_b_proj too) and of the MLPs, experts and shared experts, in e4m3 with
    weight_scale_inv per [16, 32] block (q_a_proj's 24 rows and kv_a_proj_with_mqa's 40,
    fused in one layer, are not whole blocks); routers, norms and embeddings as they were."""
    import json
    import re

    from quantized import fp8_block_dequantize, fp8_block_quantize
    from safetensors.torch import load_file, save_file

    projection = re.compile(r"\.layers\.\d+\.(self_attn|mlp)\.([a-z_]+\.)?(\d+\.)?"
                            r"[a-z_]*proj[a-z_]*\.weight$")
    quantized, dequantized = {}, {}
    for name, t in load_file(str(model_dir / "model.safetensors")).items():
        if projection.search(name):
            q, scale = fp8_block_quantize(t, block)
            quantized |= {name: q, f"{name}_scale_inv": scale}
            dequantized[name] = fp8_block_dequantize(q, scale, block).to(t.dtype)
        else:
            quantized[name] = dequantized[name] = t
    dirs = out / "fp8", out / "dequantized"
    for d, tensors in zip(dirs, (quantized, dequantized)):
        shutil.copytree(model_dir, d)
        save_file(tensors, str(d / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dirs[0] / "config.json").write_text(json.dumps(config))
    return dirs


def test_fp8_checkpoint(deepseek, tmp_path):
    """DeepSeek's own FP8 layout (block-scaled e4m3 with weight_scale_inv, kv_b_proj
    included): served as transformers + PEFT serve its dequantized twin, adapter rows
    beside base rows, by the reference ops and the Triton kernels; kv_b_proj, which
    latent attention reads as a tensor, dequantized as it loads. A projection stored
    without its scales fails at load naming it."""
    from safetensors.torch import load_file, save_file

    from loraplex.errors import ModelLoadError

    model_dir, adapter = deepseek
    quantized, oracle = _write_fp8_checkpoint(model_dir, tmp_path)
    _check_fp8_model(quantized, oracle, adapter)
    path = quantized / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"]
    save_file(tensors, str(path))
    with pytest.raises(ModelLoadError, match="kv_b_proj.*weight_scale_inv|kv_b_proj.*only its"):
        make_llm(quantized)


def test_speculation_changes_no_greedy_token(deepseek):
    """n-gram speculation over latent attention (verification steps run eagerly: the
    latent op for chunks longer than one token reads the batch on the host), adapter
    rows beside base rows: plain decoding's greedy tokens, and proposals were kept."""
    from conftest import assert_same_greedy_tokens

    model_dir, adapter = deepseek
    prompts = [([7 + i, 40 + i, 90, 13 + 2 * i] * 6)[: 12 + 3 * i] for i in range(3)]  # they repeat
    prompts += random_prompts(2, (5, 20), seed=4)
    lora = LoRARequest("all", 1, str(adapter))
    loras = [lora if i % 2 else None for i in range(len(prompts))]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = make_llm(model_dir).generate(prompts, SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, logprobs=5), loras)
    llm = make_llm(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    got = llm.generate(prompts, sp, loras)
    for g, w in zip(got, want):
        assert_same_greedy_tokens(g.outputs[0], w.outputs[0])
    assert llm.engine.stats()["spec_accepted_tokens"] > 0
