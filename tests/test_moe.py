"""Mixture-of-experts bases (Qwen3-MoE, Mixtral): parity with transformers in both
checkpoint layouts, attention adapters on an MoE model, and expert adapters refused, not skipped."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import BOS, EOS, VOCAB, HFOracle, make_llm, make_peft_adapter, random_prompts, tolerance
from safetensors.torch import load_file, save_file

from loraplex import AdapterInvalid, LoRARequest, SamplingParams
from loraplex.bench.synthetic import write_random_model
from loraplex.errors import ModelLoadError

SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """Tiny Qwen3-MoE: 8 experts, top-2 renormalised, layer 1 dense (mlp_only_layers)."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        max_position_embeddings=512, bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.08)
    return write_random_model(tmp_path_factory.mktemp("moe") / "qwen3moe", cfg, 0, None)


def _prompt_lps(out, prompt) -> torch.Tensor:
    return torch.tensor([x[t].logprob for x, t in zip(out.prompt_logprobs[1:], prompt[1:])])


def _check_against(oracle, llm, prompts, lora=None):
    outs = llm.generate(prompts, SP, lora)
    for p, out in zip(prompts, outs):
        torch.testing.assert_close(_prompt_lps(out, p), oracle.prompt_logprobs(p), atol=tolerance(), rtol=0)


def test_qwen3_moe_matches_transformers(moe_dir):
    llm = make_llm(moe_dir)
    assert llm.config.model.moe_layers == (0, 2)
    _check_against(HFOracle(moe_dir), llm, random_prompts(4, (5, 30), seed=1))


def test_mixtral_matches_transformers(tmp_path):
    """Mixtral: block_sparse_moe with per-expert w1/w3/w2, top-2 renormalised."""
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512, bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.08)
    model_dir = write_random_model(tmp_path / "mixtral", cfg, 0, None)
    llm = make_llm(model_dir)
    assert llm.config.model.moe_layers == (0, 1) and llm.config.model.norm_topk_prob
    _check_against(HFOracle(model_dir), llm, random_prompts(4, (5, 30), seed=6))


def test_fused_expert_checkpoint_layout(moe_dir, tmp_path):
    """The same weights saved as fused 3D experts load to the same model."""
    import shutil

    fused = tmp_path / "fused"
    shutil.copytree(moe_dir, fused)
    tensors = load_file(str(fused / "model.safetensors"))
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp.experts"
        out[f"{p}.gate_up_proj"] = torch.stack([
            torch.cat([tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]])
            for e in range(8)])
        out[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(8)])
    save_file(out, str(fused / "model.safetensors"))
    _check_against(HFOracle(moe_dir), make_llm(fused), random_prompts(3, (5, 20), seed=2))

    del out["model.layers.2.mlp.experts.down_proj"]
    save_file(out, str(fused / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="down_proj"):
        make_llm(fused)


def test_attention_adapters_on_moe_and_expert_adapters_refused(moe_dir, tmp_path):
    attn = make_peft_adapter(moe_dir, tmp_path / "attn", seed=3, r=4, lora_alpha=8,
                             target_modules=["q_proj", "v_proj", "o_proj"])
    llm = make_llm(moe_dir)
    prompts = random_prompts(4, (5, 20), seed=4)
    lora = LoRARequest("attn", 1, str(attn))
    _check_against(HFOracle(moe_dir, attn), llm, prompts, lora)
    mixed = llm.generate(prompts, SP, [lora, None, lora, None])
    base = HFOracle(moe_dir)
    for p, out in zip(prompts[1::2], mixed[1::2]):
        torch.testing.assert_close(_prompt_lps(out, p), base.prompt_logprobs(p), atol=tolerance(), rtol=0)

    # An adapter on the experts (per-expert keys) is an error, never silently dropped.
    experts = tmp_path / "experts"
    experts.mkdir()
    (experts / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["gate_proj"]}))
    save_file({"base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight": torch.zeros(2, 64),
               "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_B.weight": torch.zeros(32, 2)},
              str(experts / "adapter_model.safetensors"))
    with pytest.raises(AdapterInvalid, match="experts.0.gate_proj"):
        llm.generate(prompts[:1], SP, LoRARequest("experts", 2, str(experts)))
