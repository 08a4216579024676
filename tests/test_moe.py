"""Mixture-of-experts bases (Qwen3-MoE, Mixtral): parity with transformers in both
checkpoint layouts; adapters on attention, router and experts in both PEFT layouts
(PEFT for one adapter at a time, merged weights for per-expert keys), mixed batches,
and expert keys that cannot apply refused, never skipped."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import BOS, DTYPE, EOS, VOCAB, HFOracle, make_llm, make_peft_adapter, random_prompts, tolerance
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


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: every position. bf16: the median, since a router near a tie can pick another
    expert once rounded differently (then that position differs by far more)."""
    if DTYPE == "float32":
        torch.testing.assert_close(got, want, atol=tolerance(), rtol=0)
    else:
        assert (got - want).abs().median() <= tolerance(), (got - want).abs()


def _check_against(oracle, llm, prompts, lora=None):
    outs = llm.generate(prompts, SP, lora)
    for p, out in zip(prompts, outs):
        _assert_close(_prompt_lps(out, p), oracle.prompt_logprobs(p))


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


def test_attention_adapters_on_moe(moe_dir, tmp_path):
    attn = make_peft_adapter(moe_dir, tmp_path / "attn", seed=3, r=4, lora_alpha=8,
                             target_modules=["q_proj", "v_proj", "o_proj"])
    llm = make_llm(moe_dir)
    prompts = random_prompts(4, (5, 20), seed=4)
    lora = LoRARequest("attn", 1, str(attn))
    _check_against(HFOracle(moe_dir, attn), llm, prompts, lora)
    mixed = llm.generate(prompts, SP, [lora, None, lora, None])
    base = HFOracle(moe_dir)
    for p, out in zip(prompts[1::2], mixed[1::2]):
        _assert_close(_prompt_lps(out, p), base.prompt_logprobs(p))


@pytest.fixture(scope="module")
def expert_adapters(moe_dir, tmp_path_factory):
    """PEFT target_parameters adapters (all experts' gate_up and down, + attention and
    router; down only) and a per-expert-keys adapter with its merged-weights model."""
    root = tmp_path_factory.mktemp("expert-adapters")
    fused = make_peft_adapter(moe_dir, root / "fused", seed=11, r=4, lora_alpha=8,
                              target_modules=["q_proj", "gate"],
                              target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    down = make_peft_adapter(moe_dir, root / "down", seed=12, r=2, lora_alpha=2, use_rslora=True,
                             target_modules=[], target_parameters=["mlp.experts.down_proj"])
    per_expert, merged = _per_expert_adapter(moe_dir, root)
    return dict(fused=fused, down=down, per_expert=per_expert, merged=merged)


def _per_expert_adapter(moe_dir, root):
    """Per-expert keys (gate rank 2, up rank 3, down rank 2; expert 5 of layer 0 left
    out), and the base checkpoint with each delta W_e + s B_e A_e merged in."""
    import shutil

    gen = torch.Generator().manual_seed(7)
    ranks, scale = {"gate_proj": 2, "up_proj": 3, "down_proj": 2}, 1.5
    tensors = load_file(str(moe_dir / "model.safetensors"))
    adapter = {}
    for layer in (0, 2):
        for e in range(8):
            if (layer, e) == (0, 5):
                continue
            for proj, r in ranks.items():
                key = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                w = tensors[f"{key}.weight"]
                a = torch.randn(r, w.shape[1], generator=gen) * 0.3
                b = torch.randn(w.shape[0], r, generator=gen) * 0.3
                adapter[f"base_model.model.{key}.lora_A.weight"] = a
                adapter[f"base_model.model.{key}.lora_B.weight"] = b
                tensors[f"{key}.weight"] = w + scale * (b @ a)
    out = root / "per-expert"
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 2, "lora_alpha": 3.0, "target_modules": list(ranks),
        "rank_pattern": {"up_proj": 3}, "alpha_pattern": {"up_proj": 4.5}}))
    save_file(adapter, str(out / "adapter_model.safetensors"))
    merged = root / "merged"
    shutil.copytree(moe_dir, merged)
    save_file(tensors, str(merged / "model.safetensors"))
    return out, merged


def test_expert_adapters_match_peft_and_merged_weights(moe_dir, expert_adapters):
    llm = make_llm(moe_dir)
    prompts = random_prompts(3, (5, 24), seed=8)
    a = expert_adapters
    fused, down = LoRARequest("fused", 1, str(a["fused"])), LoRARequest("down", 2, str(a["down"]))
    per = LoRARequest("per-expert", 3, str(a["per_expert"]))
    _check_against(HFOracle(moe_dir, a["fused"]), llm, prompts, fused)
    _check_against(HFOracle(moe_dir, a["down"]), llm, prompts, down)
    _check_against(HFOracle(a["merged"]), llm, prompts, per)


def test_mixed_batch_with_and_without_expert_adapters(moe_dir, expert_adapters, tmp_path):
    """Expert, attention-only and no adapters in one batch: each as if served alone."""
    a = expert_adapters
    attn = make_peft_adapter(moe_dir, tmp_path / "attn", seed=3, r=4, lora_alpha=8, target_modules=["v_proj"])
    loras = [LoRARequest("fused", 1, str(a["fused"])), LoRARequest("per-expert", 2, str(a["per_expert"])),
             None, LoRARequest("attn", 3, str(attn)), LoRARequest("down", 4, str(a["down"]))]
    prompts = random_prompts(len(loras), (5, 24), seed=9)
    llm = make_llm(moe_dir, max_loras=2)  # slots are reused: later adapters evict earlier ones
    alone = [llm.generate([p], SP, lora)[0] for p, lora in zip(prompts, loras)]
    mixed = make_llm(moe_dir, max_loras=4).generate(prompts, SP, loras)
    for x, y in zip(alone, mixed):
        _assert_close(_prompt_lps(y, y.prompt_token_ids), _prompt_lps(x, x.prompt_token_ids))
        if DTYPE == "float32":
            assert x.outputs[0].token_ids == y.outputs[0].token_ids


def test_router_lora_runs_only_for_adapters_that_adapt_a_router(moe_dir, expert_adapters, tmp_path):
    """Steps whose adapters leave the routers alone skip the routers' LoRA (their slots
    are zero there); a step with one router-adapting token runs it for the whole batch.
    Outputs match the oracle either way (test_mixed_batch_... checks the mixes)."""
    attn = make_peft_adapter(moe_dir, tmp_path / "attn", seed=3, r=4, lora_alpha=8, target_modules=["v_proj"])
    fused = LoRARequest("fused", 1, str(expert_adapters["fused"]))  # adapts the routers ("gate")
    plain = LoRARequest("attn", 2, str(attn))
    # One slot: each load replaces the last adapter. Eager steps (on a GPU too), so that
    # every forward's choice is seen.
    llm = make_llm(moe_dir, max_loras=1, cudagraph_mode="NONE")
    runner = llm.engine.runner
    routers = [m for m in runner.model.modules() if getattr(m, "is_router", False)]
    assert routers and all(r.lora is not None for r in routers)
    runs = []

    def count(router):
        inner = router.lora_batch

        def counted():
            batch = inner()
            if batch is not None:  # the router's LoRA runs in this forward
                runs.append(router)
            return batch
        return counted

    for r in routers:
        r.lora_batch = count(r)
    prompt = random_prompts(1, (6, 7), seed=21)
    out = llm.generate(prompt, SP, plain)
    assert runs == [] and runner.lora_slots.router_slots == set()
    _assert_close(_prompt_lps(out[0], prompt[0]), HFOracle(moe_dir, attn).prompt_logprobs(prompt[0]))
    llm.generate(prompt, SP, fused)
    assert len(runs) >= len(routers) and runner.lora_slots.router_slots == {0}
    runs.clear()
    out = llm.generate(prompt, SP, plain)  # the slot is reloaded: its router weights zeroed
    assert runs == [] and runner.lora_slots.router_slots == set()
    _assert_close(_prompt_lps(out[0], prompt[0]), HFOracle(moe_dir, attn).prompt_logprobs(prompt[0]))


def _write_adapter(path, config, tensors):
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def test_expert_adapter_keys_are_never_skipped(moe_dir, tmp_path):
    llm = make_llm(moe_dir)
    pre = "base_model.model.model.layers"
    cases = {
        # expert 8 of 8 does not exist
        "experts.8.gate_proj": ({"r": 2, "lora_alpha": 4},
                                {f"{pre}.0.mlp.experts.8.gate_proj.lora_A.weight": torch.zeros(2, 64),
                                 f"{pre}.0.mlp.experts.8.gate_proj.lora_B.weight": torch.zeros(32, 2)}),
        # fused-layout keys with no target_parameters to say what they adapt
        "target_parameters": ({"r": 2, "lora_alpha": 4},
                              {f"{pre}.0.mlp.experts.lora_A.weight": torch.zeros(16, 64),
                               f"{pre}.0.mlp.experts.lora_B.weight": torch.zeros(64, 16)}),
        # layer 1 is dense: it has no experts
        "layers.1.mlp.experts": ({"r": 2, "lora_alpha": 4},
                                 {f"{pre}.1.mlp.experts.0.down_proj.lora_A.weight": torch.zeros(2, 32),
                                  f"{pre}.1.mlp.experts.0.down_proj.lora_B.weight": torch.zeros(64, 2)}),
        # gate_up lora_B of the wrong size
        "do not fit": ({"r": 2, "lora_alpha": 4, "target_parameters": ["mlp.experts.gate_up_proj"]},
                       {f"{pre}.0.mlp.experts.lora_A.weight": torch.zeros(16, 64),
                        f"{pre}.0.mlp.experts.lora_B.weight": torch.zeros(32, 16)}),
    }
    for i, (match, (config, tensors)) in enumerate(cases.items()):
        path = _write_adapter(tmp_path / f"bad{i}", config, tensors)
        with pytest.raises(AdapterInvalid, match=match):
            llm.generate([[BOS, 5, 6]], SP, LoRARequest(f"bad{i}", i + 1, path))
    assert llm.generate([[BOS, 5, 6]], SP)[0].outputs[0].token_ids  # the engine goes on


def test_bench_with_expert_adapters_reports_experts_touched(moe_dir, tmp_path, capsys):
    """`loraplex bench` writes random adapters on attention and every expert (PEFT
    target_parameters layout) and reports how many experts a decode step touches."""
    from loraplex.entrypoints.cli import main as cli

    out = tmp_path / "result.json"
    code = cli(["bench", "--model", str(moe_dir), "--num-prompts", "6", "--input-len", "10",
                "--output-len", "5", "--max-concurrency", "3", "--num-adapters", "0", "3",
                "--lora-rank", "4", "--lora-targets", "q_proj", "experts", "--dtype", "float32",
                "--cache-dir", str(tmp_path / "cache"), "--result-json", str(out)])
    assert code == 0
    assert "distinct experts per MoE layer" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [r["num_requests"] - r["num_failed"] for r in rows] == [6, 6]
    for r in rows:  # 3 sequences x top-2 over 8 experts: 2 to 6 distinct per layer
        assert 2 <= r["extra"]["moe_experts_per_layer_decode"] <= 6
    config = json.loads(next((tmp_path / "cache").rglob("adapter_config.json")).read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
