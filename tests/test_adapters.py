"""Adapter loading: every way an adapter can be broken fails only its own request with a
typed error, and more adapters than GPU slots are served correctly by reusing slots."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import ADAPTERS, assert_same_greedy_tokens, make_llm, random_prompts
from safetensors.torch import load_file, save_file

from loraplex import AdapterInvalid, AdapterNotFound, AdapterTooLarge, LoRARequest, SamplingParams
from loraplex.bench.synthetic import write_random_adapter
from loraplex.errors import LoRADisabled

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(model_dirs):
    return make_llm(model_dirs["qwen3"], max_loras=2, max_lora_rank=8)


def _projections(llm):
    return {k: (p.in_features, p.out_features) for k, p in llm.engine.runner.projections.items()}


def _edit_weights(src, dst, edit):
    shutil.copytree(src, dst)
    path = dst / "adapter_model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))
    return dst


def _broken_adapters(good, tmp_path, llm):
    """name -> (directory, expected error type)."""
    cases = {"missing-dir": (tmp_path / "nope", AdapterNotFound)}

    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(good / "adapter_config.json", no_weights)
    cases["no-weights"] = (no_weights, AdapterNotFound)

    pickle_only = tmp_path / "pickle-only"
    shutil.copytree(good, pickle_only)
    (pickle_only / "adapter_model.safetensors").rename(pickle_only / "adapter_model.bin")
    cases["pickle-only"] = (pickle_only, AdapterInvalid)

    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    data = (truncated / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    cases["truncated"] = (truncated, AdapterInvalid)

    bad_json = tmp_path / "bad-json"
    shutil.copytree(good, bad_json)
    (bad_json / "adapter_config.json").write_text("{not json")
    cases["bad-json"] = (bad_json, AdapterInvalid)

    dora = tmp_path / "dora"
    shutil.copytree(good, dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    cases["dora"] = (dora, AdapterInvalid)

    def first_a(t):
        return next(k for k in t if k.endswith("lora_A.weight"))

    def add_unknown(t):
        t["base_model.model.model.layers.0.mlp.foo_proj.lora_A.weight"] = torch.zeros(4, 64)

    def add_lm_head(t):
        t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)

    def add_layer_99(t):
        t["base_model.model.model.layers.99.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 64)

    def add_nan(t):
        t[first_a(t)][0, 0] = float("nan")

    def wrong_shape(t):
        k = first_a(t)
        t[k] = t[k][:, :-1].contiguous()

    def drop_b(t):
        del t[first_a(t).replace("lora_A", "lora_B")]

    for name, edit in [("unknown-module", add_unknown), ("lm-head", add_lm_head),
                       ("layer-99", add_layer_99), ("nan", add_nan),
                       ("wrong-shape", wrong_shape), ("a-without-b", drop_b)]:
        cases[name] = (_edit_weights(good, tmp_path / name, edit), AdapterInvalid)

    cases["rank-too-large"] = (
        write_random_adapter(tmp_path / "rank-16", _projections(llm), rank=16),
        AdapterTooLarge,
    )
    return cases


def test_broken_adapters_fail_alone(llm, adapter_dirs, tmp_path):
    good = adapter_dirs["qwen3"]["all7-r8"]
    prompts = random_prompts(3, (5, 15), seed=9)
    good_lora = LoRARequest("good", 1, str(good))
    expected = llm.generate(prompts, SP, good_lora)
    for i, (name, (path, error)) in enumerate(_broken_adapters(good, tmp_path, llm).items()):
        bad = LoRARequest(name, 100 + i, str(path))
        with pytest.raises(error) as info:
            llm.generate(prompts, SP, [good_lora, bad, None])
        assert info.value.adapter == name, info.value
        assert not llm.engine.has_unfinished_requests(), name
        # The engine serves everyone else exactly as before.
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, SP, good_lora)] == [
            o.outputs[0].token_ids for o in expected
        ], name


def test_bad_adapter_mid_flight_leaves_running_requests_intact(llm, adapter_dirs, tmp_path):
    engine = llm.engine
    good = LoRARequest("good", 1, str(adapter_dirs["qwen3"]["all7-r8"]))
    prompts = random_prompts(2, (5, 15), seed=10)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, SP, good)]
    engine.add_request("a", prompts[0], SP, good)
    engine.add_request("b", prompts[1], SP, None)
    engine.step()
    with pytest.raises(AdapterNotFound):
        engine.add_request("c", prompts[1], SP, LoRARequest("gone", 7, str(tmp_path / "gone")))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done["a"] == expected[0]
    assert set(done) == {"a", "b"}


def test_more_adapters_than_slots(llm, model_dirs, tmp_path):
    """Six adapters through two GPU slots: slots are reused, outputs match each alone."""
    loras = [
        LoRARequest(f"r{i}", 10 + i, str(write_random_adapter(
            tmp_path / f"a{i}", _projections(llm), rank=2 + i % 3, b_std=0.3, seed=i)))
        for i in range(6)
    ]
    prompts = random_prompts(12, (5, 25), seed=11)
    per_prompt = [loras[i % 6] for i in range(12)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    together = llm.generate(prompts, sp, per_prompt)
    for p, lora, out in zip(prompts, per_prompt, together):  # bf16: up to a near-tie
        assert_same_greedy_tokens(out.outputs[0], llm.generate([p], sp, lora)[0].outputs[0])
    assert len({tuple(o.outputs[0].token_ids) for o in together}) > 6


def test_lora_request_without_slots(model_dirs, adapter_dirs):
    llm = make_llm(model_dirs["qwen3"], enable_lora=False)
    lora = LoRARequest("x", 1, str(adapter_dirs["qwen3"][next(iter(ADAPTERS))]))
    with pytest.raises(LoRADisabled):
        llm.generate([[5, 6, 7]], SP, lora)
    assert llm.generate([[5, 6, 7]], SP)[0].outputs[0].finish_reason == "length"


def test_target_modules_restrict_the_slots(model_dirs, adapter_dirs, llm):
    """lora_target_modules: only the named projections get slots (the rest run no adapter
    kernels), an adapter on them serves as on an unrestricted engine, one that targets
    another module is refused by name, and a name the model lacks fails at startup."""
    narrow = make_llm(model_dirs["qwen3"], max_loras=2, max_lora_rank=8,
                      lora_target_modules=["q_proj", "v_proj", "o_proj"])
    layers = {p.layer_path.rpartition(".")[2]: p.layer for p in narrow.engine.runner.projections.values()}
    assert set(layers) == {"qkv_proj", "o_proj"}
    model = narrow.engine.runner.model
    assert all(m.lora is None for n, m in model.named_modules() if n.endswith(("gate_up_proj", "down_proj")))
    qv = LoRARequest("qv", 1, str(adapter_dirs["qwen3"]["qv-r4-rslora"]))
    prompts = random_prompts(3, (5, 15), seed=12)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    for got, want in zip(narrow.generate(prompts, sp, qv), llm.generate(prompts, sp, qv)):
        assert_same_greedy_tokens(got.outputs[0], want.outputs[0])
    with pytest.raises(AdapterInvalid, match=r"adapts only q_proj, v_proj, o_proj \(--lora-target-modules\)"):
        narrow.generate(prompts, SP, LoRARequest("all7", 2, str(adapter_dirs["qwen3"]["all7-r8"])))
    assert len(narrow.generate(prompts, SP, qv)) == 3
    with pytest.raises(ValueError, match="q_prj: this model has no such module"):
        make_llm(model_dirs["qwen3"], max_loras=2, lora_target_modules=["q_prj"])
    with pytest.raises(ValueError, match="must be a list of module names"):
        make_llm(model_dirs["qwen3"], max_loras=2, lora_target_modules="q_proj")
    with pytest.raises(ValueError, match="non-empty list of module names"):
        make_llm(model_dirs["qwen3"], max_loras=2, lora_target_modules=[])
