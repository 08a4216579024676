"""The offline API's surface: model loading (sharded, dummy, broken), prompt forms, and
typed errors for invalid requests."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from conftest import VOCAB, build_tiny_model, make_llm, random_prompts
from safetensors.torch import load_file, save_file

from loraplex import InvalidRequest, PromptTooLong, SamplingParams
from loraplex.bench.synthetic import word_prompt
from loraplex.errors import ModelLoadError, UnsupportedModel

SP = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=0)


def _generate(llm, prompts):
    return [(o.outputs[0].token_ids, o.prompt_logprobs) for o in llm.generate(prompts, SP)]


def test_sharded_checkpoint_equals_single_file(model_dirs, tmp_path):
    sharded = build_tiny_model(tmp_path / "sharded", "llama", max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    prompts = random_prompts(3)
    assert _generate(make_llm(sharded), prompts) == _generate(make_llm(model_dirs["llama"]), prompts)


def test_load_reports_one_line(model_dirs, caplog):
    with caplog.at_level(logging.INFO, logger="loraplex"):
        make_llm(model_dirs["qwen3"])
    lines = [r.getMessage() for r in caplog.records if "parameters" in r.getMessage()]
    assert len(lines) == 1
    assert "GiB" in lines[0] and " in " in lines[0] and lines[0].endswith(" s")


def test_dummy_weights_need_only_a_config(model_dirs, tmp_path):
    d = tmp_path / "config-only"
    d.mkdir()
    for f in model_dirs["qwen3"].iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, d)
    with pytest.raises(ModelLoadError, match="dummy"):
        make_llm(d)
    a = make_llm(d, load_format="dummy", seed=3)
    b = make_llm(d, load_format="dummy", seed=3)
    c = make_llm(d, load_format="dummy", seed=4)
    prompts = random_prompts(2)
    assert _generate(a, prompts) == _generate(b, prompts) != _generate(c, prompts)
    w = a.engine.runner.model.model.layers[0].self_attn.qkv_proj.weight
    assert abs(w.std().item() - 0.08) < 0.01  # trained scale: config.initializer_range
    assert torch.all(a.engine.runner.model.model.norm.weight == 1)


def _copy_with(src, dst, edit):
    shutil.copytree(src, dst)
    path = next(dst.glob("*.safetensors"))
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))
    return dst


def test_broken_checkpoints(model_dirs, tmp_path):
    src = model_dirs["qwen3"]
    missing = _copy_with(src, tmp_path / "missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match="lacks 1 weights"):
        make_llm(missing)
    extra = _copy_with(src, tmp_path / "extra", lambda t: t.update({"model.foo": torch.zeros(2)}))
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.foo'"):
        make_llm(extra)
    # On a projection: a tensor kind it does not take (a scale in a checkpoint with no
    # quantization_config), a bias it does not have.
    q = "model.layers.0.self_attn.q_proj"
    for kind, said in (("weight_scale", "quantization_config"), ("bias", "no bias")):
        name = f"{q}.{kind}"
        extra = _copy_with(src, tmp_path / f"extra-{kind}", lambda t, n=name: t.update({n: torch.ones(4)}))
        with pytest.raises(ModelLoadError, match=f"unexpected tensor '{name}'.*{said}"):
            make_llm(extra)

    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1]

    with pytest.raises(ModelLoadError, match="shape"):
        make_llm(_copy_with(src, tmp_path / "shape", shrink))

    other = tmp_path / "other-arch"
    shutil.copytree(src, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match="supported: LlamaForCausalLM"):
        make_llm(other)


def test_prompt_forms(model_dirs):
    llm = make_llm(model_dirs["qwen2"])
    ids = random_prompts(1)[0]
    text = word_prompt(ids)
    forms = [text, ids, {"prompt_token_ids": ids}, {"prompt": text}]
    outs = [llm.generate(f, SP)[0] for f in forms]
    assert all(o.prompt_token_ids == ids for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert outs[0].prompt == text and outs[1].prompt is None
    many = llm.generate([text, ids], [SP, SP])
    assert [o.outputs[0].token_ids for o in many] == [outs[0].outputs[0].token_ids] * 2
    assert many[0].outputs[0].text == " " + word_prompt(many[0].outputs[0].token_ids)


def test_invalid_requests_raise_typed_errors(model_dirs):
    llm = make_llm(model_dirs["qwen2"], max_model_len=32, max_logprobs=5)
    ok = [5, 6, 7]
    cases = [
        ([list(range(3, 40))], SP, PromptTooLong),
        ([[]], SP, InvalidRequest),
        ([[VOCAB + 1]], SP, InvalidRequest),
        ([ok], SamplingParams(logprobs=6), InvalidRequest),
        ([ok, ok], [SP], InvalidRequest),
    ]
    for prompts, sp, error in cases:
        with pytest.raises(error):
            llm.generate(prompts, sp)
        assert not llm.engine.has_unfinished_requests()
    for bad in [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                dict(max_tokens=0), dict(min_tokens=5, max_tokens=2), dict(logprobs=-1),
                dict(stop=[""]), dict(n=0), dict(n=2, best_of=1)]:
        with pytest.raises(InvalidRequest):
            SamplingParams(**bad)
    assert llm.generate([ok], SP)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("bad", [dict(cudagraph_mode="PIECEWISE"), dict(max_cudagraph_capture_size=0)])
def test_invalid_cuda_graph_settings_are_refused(model_dirs, bad):
    with pytest.raises(ValueError, match="cudagraph"):
        make_llm(model_dirs["qwen2"], **bad)


def test_cli_generate(model_dirs, adapter_dirs, capsys):
    from loraplex.entrypoints.cli import main

    adapter = adapter_dirs["qwen3"]["all7-r8"]
    code = main(["generate", str(model_dirs["qwen3"]), "--prompt", "t5 t6 t7", "--max-tokens", "4",
                 "--max-model-len", "64", "--lora-modules", f"style={adapter}"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert [line.split("]")[0] for line in lines] == ["[base", "[style"]
    assert all(len(line.split("] ")[1].split()) == 4 for line in lines)


@pytest.mark.parametrize("limits", [dict(max_num_batched_tokens=100, max_num_seqs=2, max_model_len=64),
                                    dict(max_num_batched_tokens=512, max_num_seqs=16, max_model_len=48),
                                    dict(max_num_batched_tokens=40, max_num_seqs=4, max_model_len=128)])
def test_largest_step_respects_every_limit(model_dirs, limits):
    """The memory-profiling step is a plan the scheduler could make, and it runs."""
    from loraplex.runner.model_runner import largest_step

    llm = make_llm(model_dirs["qwen3"], **limits)
    plan, pages = largest_step(llm.config)
    lens = [c.num_tokens for c in plan.chunks]
    assert sum(lens) == min(limits["max_num_batched_tokens"],
                            limits["max_num_seqs"] * limits["max_model_len"])
    assert len(lens) <= limits["max_num_seqs"] and max(lens) <= limits["max_model_len"]
    assert pages == sum(len(c.block_ids) for c in plan.chunks)
    llm.engine.runner.run_largest_step()
    assert llm.generate([[5, 6, 7]], SP)[0].outputs[0].finish_reason == "length"


def test_the_default_models_stop_strings_leave_transformers_alone(model_dirs, tmp_path):
    """The default model's stop string sits under loraplex's own key: plain transformers
    generate() works on the directory (its "stop_strings" made generate() without a
    tokenizer raise), and loraplex still stops there; a cache built with the old key is
    mended."""
    from transformers import AutoModelForCausalLM

    from loraplex.entrypoints.default_model import STOP_STRINGS, write_stop_strings

    d = tmp_path / "model"
    shutil.copytree(model_dirs["qwen3"], d)
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "stop_strings": STOP_STRINGS}))
    write_stop_strings(d)
    assert "stop_strings" not in json.loads((d / "generation_config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(d)
    assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False).shape == (1, 5)
    assert make_llm(d).engine.default_stop == tuple(STOP_STRINGS)
