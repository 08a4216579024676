"""gpt-oss base model against transformers: attention sinks, q/k/v/o biases, alternating
sliding-window and full layers, YaRN rope, biased router and experts stored transposed
with gate/up interleaved, clamped SwiGLU; on the reference ops and on the Triton kernels
(interpreted on CPU). Also YaRN tables, the real config's translation, dummy weights."""

from __future__ import annotations

import json
import shutil
from importlib import resources

import pytest
import torch
from conftest import BOS, DTYPE, EOS, VOCAB, HFOracle, make_llm, random_prompts, tolerance
from safetensors.torch import load_file, save_file

from loraplex import SamplingParams
from loraplex.bench.synthetic import write_random_model
from loraplex.errors import UnsupportedModel
from loraplex.layers.rotary import RotaryEmbedding
from loraplex.models.registry import model_config

NUM_NEW = 4
SP = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=0, logprobs=0)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, beta_fast=32.0, beta_slow=1.0,
            truncate=False, original_max_position_embeddings=64)


def tiny_config(**overrides):
    """4 layers (sliding, full, ...) with a window of 8, shorter than the test prompts;
    8 experts, top-2."""
    import transformers

    return transformers.GptOssConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
        rope_parameters=YARN, bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.08,
        architectures=["GptOssForCausalLM"],
    ), **overrides})


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    model_dir = write_random_model(tmp_path_factory.mktemp("gpt_oss") / "gpt-oss", tiny_config(), 0)
    # transformers starts biases at 0 and sinks at N(0, 0.08): too small to test anything.
    # Larger gate/up weights push some pre-activations past the SwiGLU clamp at 7
    # (transformers 5.17 hard-codes 7 whatever config.swiglu_limit says, so the test keeps 7).
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if name.endswith("sinks"):
            tensors[name] = torch.randn(t.shape, generator=gen)
        elif name.endswith("bias"):
            tensors[name] = 0.1 * torch.randn(t.shape, generator=gen)
        elif name.endswith("experts.gate_up_proj"):
            tensors[name] = 6 * t
    save_file(tensors, str(path), metadata={"format": "pt"})
    return model_dir


def _logprobs_of(positions, token_ids) -> torch.Tensor:
    return torch.tensor([pos[t].logprob for pos, t in zip(positions, token_ids)])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpt_oss_matches_transformers(gpt_oss_dir, backend):
    """Prompt logprobs (prefill) and generated tokens (decode) against transformers; on
    CPU "triton" runs the attention-with-sinks kernels in the interpreter."""
    llm = make_llm(gpt_oss_dir, ops_backend=backend)
    cfg = llm.config.model
    assert cfg.attention_sinks and cfg.activation == "swiglu_oai" and cfg.swiglu_limit == 7.0
    assert cfg.norm_topk_prob and cfg.moe_layers == (0, 1, 2, 3) and cfg.qkv_bias and cfg.o_bias
    oracle = HFOracle(gpt_oss_dir)
    prompts = random_prompts(3, (20, 36), seed=1)
    diffs = []
    for prompt, out in zip(prompts, llm.generate(prompts, SP)):
        got = _logprobs_of(out.prompt_logprobs[1:], prompt[1:])
        diffs.append((got - oracle.prompt_logprobs(prompt)).abs())
        tokens = out.outputs[0].token_ids
        ref = oracle.logits(prompt + tokens)[len(prompt) - 1 : -1].log_softmax(-1)
        chosen = ref[torch.arange(NUM_NEW), torch.tensor(tokens)]
        diffs.append((_logprobs_of(out.outputs[0].logprobs, tokens) - chosen).abs())
        if DTYPE == "float32":
            assert tokens == oracle.greedy(prompt, NUM_NEW)
    diff = torch.cat(diffs)
    if DTYPE == "float32":
        assert diff.max() <= tolerance(), diff.max()
    else:  # bf16 flips top-k near-ties, and a flip moves every later logprob (transformers'
        # own bf16 run differs from fp32 by up to ~1 here): bound the typical difference.
        assert diff.median() <= tolerance(), diff


@pytest.mark.parametrize("params", [
    YARN,
    {**YARN, "truncate": True, "factor": 32.0, "beta_fast": 16.0, "beta_slow": 2.0},
    {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5},
    {**YARN, "attention_factor": 0.8},
], ids=["gpt-oss", "truncate", "mscale", "attention_factor"])
def test_yarn_rope_matches_transformers(params):
    """cos/sin (YaRN frequency blend times the attention factor) equal transformers'."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    hf = tiny_config(rope_parameters=params, head_dim=32)
    positions = torch.arange(300)
    cos, sin = GptOssRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions[None])
    rope = model_config(hf).rope["full_attention"]
    ours = RotaryEmbedding(32, 300, rope).cos_sin
    torch.testing.assert_close(ours, torch.cat((cos[0], sin[0]), -1), atol=1e-6, rtol=0)


def _bundled_config() -> dict:
    path = resources.files("loraplex.bench") / "configs" / "gpt-oss-20b" / "config.json"
    return json.loads(path.read_text())


def test_gpt_oss_20b_config(tmp_path):
    """The bundled bf16 config translates to gpt-oss-20b's facts; the published MXFP4
    one says its experts are MXFP4; a quantization loraplex does not know is refused by
    name."""
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(_bundled_config()))
    cfg = model_config(AutoConfig.from_pretrained(tmp_path))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (32, 4, 2880)
    assert cfg.layer_types[:2] == ("sliding_attention", "full_attention") and cfg.sliding_window == 128
    assert cfg.layer_window(0) == 128 and cfg.layer_window(1) is None
    assert cfg.rope["full_attention"]["rope_type"] == "yarn" and cfg.attention_sinks
    assert cfg.moe_layers == tuple(range(24)) and cfg.swiglu_limit == 7.0

    published = {**_bundled_config(), "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    (tmp_path / "config.json").write_text(json.dumps(published))
    quant = model_config(AutoConfig.from_pretrained(tmp_path)).quant
    assert (quant.method, quant.format) == ("mxfp4", "mxfp4") and "lm_head" in quant.skip
    unknown = {**_bundled_config(), "quantization_config": {"quant_method": "bitsandbytes"}}
    (tmp_path / "config.json").write_text(json.dumps(unknown))
    with pytest.raises(UnsupportedModel, match="bitsandbytes"):
        model_config(AutoConfig.from_pretrained(tmp_path))


def test_gpt_oss_dummy_weights(gpt_oss_dir, tmp_path):
    """A config and tokenizer alone build gpt-oss with random weights (sinks 0) and generate."""
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    for f in gpt_oss_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, config_only)
    llm = make_llm(config_only, load_format="dummy")
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert attn.sinks.dtype == torch.float32 and torch.all(attn.sinks == 0)
    outs = llm.generate(random_prompts(2, (10, 20), seed=3), SP)
    for out in outs:
        assert len(out.outputs[0].token_ids) == NUM_NEW
        lps = _logprobs_of(out.outputs[0].logprobs, out.outputs[0].token_ids)
        assert torch.isfinite(lps).all()


def test_gpt_oss_fp8_at_load_time(gpt_oss_dir):
    """--quantization fp8 on a bf16 gpt-oss checkpoint (whole expert stacks, transposed and
    interleaved): attention and experts in FP8, each the bf16 weight loaded as usual and
    then quantized; the router (as in the published MXFP4 checkpoint) in bf16; it
    generates."""
    from loraplex.ops.formats import Fp8Weight
    from loraplex.ops.reference.quant import dequantize, quantize_fp8

    llm = make_llm(gpt_oss_dir, quantization="fp8")
    layer = llm.engine.runner.model.model.layers[0]
    experts = layer.mlp.experts
    assert isinstance(experts.gate_up_proj, Fp8Weight) and isinstance(experts.down_proj, Fp8Weight)
    assert isinstance(layer.self_attn.o_proj.weight, Fp8Weight)
    assert isinstance(layer.mlp.router.weight, torch.nn.Parameter)
    # The checkpoint's float32 values are what gets quantized (a bf16 model would round
    # them first: one bf16 step apart in places); bit for bit on the weights' device.
    f32 = make_llm(gpt_oss_dir, dtype="float32").engine.runner.model.model.layers[0].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        want = dequantize(quantize_fp8(getattr(f32, name).detach(), 128)).to(getattr(experts, name).dtype)
        assert torch.equal(dequantize(getattr(experts, name)), want), name
    out = llm.generate(random_prompts(1, (10, 12), seed=4), SP)[0].outputs[0]
    assert len(out.token_ids) == NUM_NEW


def test_gpt_oss_adapters_match_peft(gpt_oss_dir, tmp_path):
    """LoRA on attention and every expert (PEFT target_parameters on the
    transposed, gate/up-interleaved experts) against PEFT; in a batch with the base."""
    from conftest import make_peft_adapter

    from loraplex import LoRARequest

    adapter = make_peft_adapter(gpt_oss_dir, tmp_path / "a", seed=5, r=4, lora_alpha=8,
                                target_modules=["q_proj", "o_proj"],
                                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    lora = LoRARequest("a", 1, str(adapter))
    llm = make_llm(gpt_oss_dir)
    prompts = random_prompts(2, (12, 30), seed=3)
    outs = llm.generate(prompts, SP, [lora, None])
    oracles = (HFOracle(gpt_oss_dir, adapter), HFOracle(gpt_oss_dir))
    for p, out, oracle in zip(prompts, outs, oracles):
        got = torch.tensor([x[t].logprob for x, t in zip(out.prompt_logprobs[1:], p[1:])])
        diff = (got - oracle.prompt_logprobs(p)).abs()
        # bf16: a router near a tie picks another expert (as in the base-model test above)
        assert (diff.max() if DTYPE == "float32" else diff.median()) <= tolerance(), diff
    with_adapter = HFOracle(gpt_oss_dir, adapter).prompt_logprobs(prompts[1])
    assert (with_adapter - oracles[1].prompt_logprobs(prompts[1])).abs().max() > 0.05  # it matters


def test_speculation_changes_no_greedy_token(gpt_oss_dir, monkeypatch):
    """n-gram speculation with sinks and sliding windows of 8 tokens: plain decoding's
    greedy tokens, with proposals partly kept (this random model's text never repeats
    itself, so proposals come from plain decoding's output: two right, then wrong)."""
    from conftest import assert_same_greedy_tokens
    from speculation import AlwaysSeen, oracle_on_device

    import loraplex.engine.scheduler as scheduler_module
    from loraplex.runner import ngram_drafts

    prompts = [([7 + i, 40 + i, 90, 13 + 2 * i] * 6)[: 12 + 3 * i] for i in range(3)]
    prompts += random_prompts(2, (5, 20), seed=4)
    want = make_llm(gpt_oss_dir).generate(prompts, SamplingParams(
        temperature=0, max_tokens=32, ignore_eos=True, logprobs=5))
    monkeypatch.setattr(scheduler_module, "SeenSuffix", AlwaysSeen)
    sequences = [p + w.outputs[0].token_ids for p, w in zip(prompts, want)]
    real = ngram_drafts.ops.ngram_inputs
    monkeypatch.setattr(ngram_drafts.ops, "ngram_inputs", oracle_on_device(real, sequences, VOCAB))
    llm = make_llm(gpt_oss_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for g, w in zip(got, want):
        assert_same_greedy_tokens(g.outputs[0], w.outputs[0])
    stats = llm.engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
