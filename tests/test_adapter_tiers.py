"""The tiered adapter store: many adapters through few slots, content ids, the registry
and hot swap, remote sources and their faults, DoRA and mixed adapters in one batch."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import socket
import threading
from pathlib import Path

import pytest
import torch
from conftest import ADAPTERS, DTYPE, HFOracle, make_llm, random_prompts, tolerance

from loraplex import AdapterNotFound, LoRARequest, SamplingParams
from loraplex.adapters.registry import Registry
from loraplex.bench.synthetic import LINEAR_TARGETS, write_random_adapter
from loraplex.entrypoints.cli import main
from loraplex.errors import AdapterUnavailable

SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
TARGET_SETS = [LINEAR_TARGETS, ("q_proj", "v_proj"), ("gate_proj", "up_proj", "down_proj"), ("o_proj",)]


def _projections(llm):
    return {k: (p.in_features, p.out_features) for k, p in llm.engine.runner.projections.items()}


def _adapter(llm, path, i, **kw):
    kw = {"rank": 1 + i % 8, "targets": TARGET_SETS[i % 4], "use_rslora": i % 3 == 0,
          "b_std": 0.3, "seed": i, **kw}
    return write_random_adapter(path, _projections(llm), **kw)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _run_engine(engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.fixture(scope="module")
def llm(model_dirs, tmp_path_factory):
    return make_llm(model_dirs["qwen3"], max_loras=4, max_lora_rank=8, max_cpu_loras=8,
                    lora_cache_dir=str(tmp_path_factory.mktemp("lora-cache")), lora_load_timeout=3)


def test_hundreds_of_adapters_through_four_slots(llm, tmp_path):
    """200 adapters of mixed rank, targets and scaling through 4 GPU slots and 8 host
    entries: every output equals that adapter served alone, under constant eviction."""
    loras = [LoRARequest(f"a{i}", i + 1, str(_adapter(llm, tmp_path / f"a{i}", i))) for i in range(200)]
    per_prompt = loras + [None] * 10 + loras[:30]
    prompts = random_prompts(len(per_prompt), (4, 12), seed=1)
    before = llm.engine.stats()
    together = llm.generate(prompts, SP, per_prompt)
    stats = llm.engine.stats()
    assert stats["adapter_host_evictions"] - before["adapter_host_evictions"] > 150
    assert stats["adapter_slot_evictions"] - before["adapter_slot_evictions"] > 150
    assert stats["adapters_in_host"] <= 8 and stats["adapters_loading"] == 0
    _assert_each_as_alone(llm, prompts, per_prompt, together)
    assert len({tuple(t) for t in _tokens(together)}) > 150, "adapters must change outputs"
    for out, lora in zip(together, per_prompt):
        m = out.metrics
        if lora is None:
            assert m.adapter_content_id is None and m.adapter_source is None
        else:
            assert m.adapter_content_id.startswith("sha256:")
            assert m.adapter_source in ("device", "host", "disk")
            assert m.adapter_source != "disk" or m.adapter_load_time > 0


def test_slow_slot_copies_change_no_output(llm, tmp_path, monkeypatch):
    """A large adapter's slot copy takes milliseconds, and the step that needs it queues
    its input copies behind it while the host already fills the next step's inputs.
    Slot copies made slower still (on a GPU the copy stream first sleeps ~10 ms): every
    output equals that adapter served alone."""
    runner = llm.engine.runner
    load = runner._load_slots

    def slow(loads, timed):
        if runner.copy_stream is not None:
            with torch.cuda.stream(runner.copy_stream):
                torch.cuda._sleep(20_000_000)
        return load(loads, timed)

    loras = [LoRARequest(f"s{i}", 500 + i, str(_adapter(llm, tmp_path / f"s{i}", i))) for i in range(12)]
    per_prompt = loras + [None] * 4
    prompts = random_prompts(len(per_prompt), (4, 12), seed=7)
    monkeypatch.setattr(runner, "_load_slots", slow)
    together = llm.generate(prompts, SP, per_prompt)
    monkeypatch.undo()
    _assert_each_as_alone(llm, prompts, per_prompt, together)


def test_loads_past_the_pinned_pool_read_pageable_memory(model_dirs, tmp_path):
    """A host tier whose byte budget holds one pool buffer: on a GPU most loads find the
    pool spent and read into pageable memory (nothing page-locked while serving); their
    slot copies are synchronous then, and every output still equals the adapter alone."""
    llm = make_llm(model_dirs["qwen3"], max_loras=2, max_lora_rank=8, max_cpu_loras=1,
                   max_cpu_lora_bytes=3 << 20)
    loras = [LoRARequest(f"p{i}", 700 + i, str(_adapter(llm, tmp_path / f"p{i}", i))) for i in range(6)]
    per_prompt = loras + [None, loras[0]]
    prompts = random_prompts(len(per_prompt), (4, 12), seed=9)
    together = llm.generate(prompts, SP, per_prompt)
    pool = llm.engine.adapters.pool
    if pool is not None:  # CUDA: loads past the pool's one buffer, read into pageable memory
        assert pool.misses > 0
    _assert_each_as_alone(llm, prompts, per_prompt, together)


def test_identical_content_shares_one_copy(llm, tmp_path):
    src = _adapter(llm, tmp_path / "src", 3)
    copy = shutil.copytree(src, tmp_path / "copy")
    cfg = json.loads((copy / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "elsewhere"  # does not change the math
    (copy / "adapter_config.json").write_text(json.dumps(cfg, indent=4))
    changed = _adapter(llm, tmp_path / "changed", 3, b_std=0.31)
    prompt = random_prompts(1, (6, 7), seed=2)[0]
    a, b, c = (LoRARequest(n, 900 + i, str(p)) for i, (n, p) in
               enumerate([("src", src), ("copy", copy), ("changed", changed)]))
    outs = llm.generate([prompt] * 3, SP, [a, b, c])
    ids = [o.metrics.adapter_content_id for o in outs]
    assert ids[0] == ids[1] != ids[2]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    engine = llm.engine
    slots = [engine.scheduler.slots.slot_of(cid) for cid in ids]
    assert slots[0] == slots[1] is not None, "one GPU slot for identical content"


def test_files_changed_in_place_are_new_content(llm, tmp_path):
    """A path names what its files hold now: rewritten in place, they are new content
    under a new name; the name that loaded the old weights keeps them while they are in
    host memory, and fails clearly once they must be read again."""
    from loraplex.errors import AdapterInvalid

    path = _adapter(llm, tmp_path / "a", 2)
    prompt = random_prompts(1, (6, 7), seed=12)[0]
    a = LoRARequest("inplace-a", 1200, str(path))
    before = llm.generate([prompt], SP, a)[0]
    fresh = _adapter(llm, tmp_path / "next", 2, b_std=0.6)  # the same shapes, other weights
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (path / f).write_bytes((fresh / f).read_bytes())
    after = llm.generate([prompt], SP, LoRARequest("inplace-b", 1201, str(path)))[0]
    alone = llm.generate([prompt], SP, LoRARequest("fresh", 1202, str(fresh)))[0]
    old_id = before.metrics.adapter_content_id
    assert after.metrics.adapter_content_id == alone.metrics.adapter_content_id != old_id
    assert torch.equal(_prompt_lps(after, prompt), _prompt_lps(alone, prompt))
    assert not torch.equal(_prompt_lps(after, prompt), _prompt_lps(before, prompt))
    again = llm.generate([prompt], SP, a)[0]
    assert again.metrics.adapter_content_id == old_id, "in host memory: what `a` loaded"
    llm.engine.adapters.host.forget(old_id)  # evicted: `a` would have to be read again
    with pytest.raises(AdapterInvalid, match="changed since"):
        llm.generate([prompt], SP, a)
    assert not llm.engine.has_unfinished_requests()


def test_registry_versions_and_hot_swap(model_dirs, tmp_path, capsys):
    registry = Registry(str(tmp_path / "registry"))
    llm = make_llm(model_dirs["qwen3"], max_loras=2, max_lora_rank=8,
                   lora_registry=str(tmp_path / "registry"))
    v1 = _adapter(llm, tmp_path / "v1", 0)
    v2 = _adapter(llm, tmp_path / "v2", 1)
    assert registry.publish("support", v1, owner=None)[0] == "1"
    with pytest.raises(AdapterNotFound):
        llm.generate([[5, 6, 7]], SP, LoRARequest("support@9", 1))
    long_sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = random_prompts(1, (8, 9), seed=3)[0]
    expect_v1 = llm.generate([prompt], long_sp, LoRARequest("support@1", 1))[0]
    engine = llm.engine
    engine.add_request("old", prompt, long_sp, LoRARequest("support", 1))
    while not engine.scheduler.requests["old"].output_token_ids:
        engine.step()
    version, cid2 = registry.publish("support", v2, owner=None)  # while "old" is running
    assert version == "2" and registry.publish("support", v2, owner=None)[1] == cid2
    engine.add_request("new", prompt, long_sp, LoRARequest("support", 1))
    done = _run_engine(engine)
    expect_v2 = llm.generate([prompt], long_sp, LoRARequest("support@2", 1))[0]
    assert done["old"].outputs[0].token_ids == expect_v1.outputs[0].token_ids
    assert done["new"].outputs[0].token_ids == expect_v2.outputs[0].token_ids
    assert done["old"].outputs[0].token_ids != done["new"].outputs[0].token_ids
    assert done["old"].metrics.adapter_content_id == expect_v1.metrics.adapter_content_id
    assert done["new"].metrics.adapter_content_id == cid2
    assert registry.names() == ["support"]
    main(["registry", str(tmp_path / "registry"), "publish", "other", str(v1), "--owner", "acme"])
    main(["registry", str(tmp_path / "registry"), "list"])
    listing = capsys.readouterr().out.splitlines()
    assert listing[-1] == f"support@2 {cid2} (public, latest)"
    published, listed_other = listing[0], listing[1]  # publish prints the version it wrote
    assert listed_other == f"{published} (owner acme, latest)" and published.startswith("other@1 sha256:")
    assert len(list((tmp_path / "registry" / "blobs").iterdir())) == 2, "v2 published twice, stored once"


def test_finiteness_is_checked_at_publish_not_at_each_load(model_dirs, tmp_path, monkeypatch):
    """A registry blob was checked for NaN / inf when published: loading it reads no
    byte twice (the check would stream the whole file beside the engine thread), while an
    adapter from a plain directory is checked at every load."""
    from safetensors.torch import load_file, save_file

    from loraplex.adapters import peft
    from loraplex.errors import AdapterInvalid

    registry = Registry(str(tmp_path / "registry"))
    llm = make_llm(model_dirs["llama"], max_loras=2, max_lora_rank=8,
                   lora_registry=str(tmp_path / "registry"))
    good = _adapter(llm, tmp_path / "good", 0)
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    weights = load_file(bad / "adapter_model.safetensors")
    next(t for k, t in weights.items() if k.endswith("lora_A.weight"))[0, 0] = float("inf")
    save_file(weights, bad / "adapter_model.safetensors")
    with pytest.raises(AdapterInvalid, match="NaN or infinite"):
        registry.publish("bad", bad, owner=None)
    assert registry.names() == [] and not (tmp_path / "registry" / "blobs").exists()

    registry.publish("good", good, owner=None)
    old = _adapter(llm, tmp_path / "old", 1)
    _, old_cid = registry.publish("old", old, owner=None)
    # As a build that did not check at publish left it: no mark, so loads check it.
    (Path(registry.blob_uri(old_cid)) / peft.FINITE_MARK).unlink()
    checks = []
    finite_bytes = peft._finite_bytes
    monkeypatch.setattr(peft, "_finite_bytes", lambda *a: checks.append(1) or finite_bytes(*a))
    llm.generate([[5, 6, 7]], SP, LoRARequest("good", 1))
    assert not checks, "a published blob is not checked again"
    llm.generate([[5, 6, 7]], SP, LoRARequest("old", 2))
    assert checks, "a blob without the mark is checked at load"
    checks.clear()
    llm.generate([[5, 6, 7]], SP, LoRARequest("dir", 3, str(good)))
    assert checks, "a plain directory is checked at load"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_root(tmp_path):
    """A static HTTP server over a directory; yields (root dir, base URL)."""
    root = tmp_path / "www"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def hanging_url():
    """A server that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/adapter"
    sock.close()


def test_remote_sources_tiers_and_faults(model_dirs, tmp_path, http_root, hanging_url):
    root, url = http_root
    llm = make_llm(model_dirs["qwen3"], max_loras=2, max_lora_rank=8, max_cpu_loras=1,
                   lora_cache_dir=str(tmp_path / "cache"), lora_load_timeout=2)
    _adapter(llm, root / "good", 5)
    _adapter(llm, root / "other", 6)
    (root / "pickled").mkdir()
    shutil.copy(root / "good" / "adapter_config.json", root / "pickled")
    (root / "pickled" / "adapter_model.bin").write_bytes(b"not loaded")
    prompts = random_prompts(6, (5, 10), seed=4)
    local = LoRARequest("good-local", 1, str(root / "good"))
    remote = LoRARequest("good", 2, f"{url}/good")
    expected = _tokens(llm.generate(prompts[:2], SP, local))

    engine = llm.engine
    bad = {"missing": f"{url}/nope", "unreachable": "http://127.0.0.1:1/adapter",
           "hanging": hanging_url, "pickled": f"{url}/pickled"}
    engine.add_request("r0", prompts[0], SP, remote)
    for i, (name, path) in enumerate(bad.items()):
        engine.add_request(name, prompts[2 + i % 4], SP, LoRARequest(name, 10 + i, path))
    engine.add_request("base", prompts[1], SP, None)
    engine.add_request("r1", prompts[1], SP, remote)
    done = _run_engine(engine)
    assert done["r0"].outputs[0].token_ids == expected[0]
    assert done["r1"].outputs[0].token_ids == expected[1]
    assert done["r0"].metrics.adapter_source == "remote" and done["r0"].metrics.adapter_load_time > 0
    assert done["base"].outputs[0].finish_reason == "length"
    for name, error in [("missing", AdapterNotFound), ("unreachable", AdapterUnavailable),
                        ("hanging", AdapterUnavailable), ("pickled", Exception)]:
        out = done[name]
        assert out.outputs[0].finish_reason == "error" and isinstance(out.error, error), (name, out.error)
        assert out.error.adapter == name
    assert "pickled" in str(done["pickled"].error) and "not loaded within" in str(done["hanging"].error)

    # Evicted from host memory (capacity 1), the remote adapter comes back from disk.
    llm.generate(prompts[:1], SP, LoRARequest("other", 3, f"{url}/other"))
    engine.add_request("again", prompts[0], SP, remote)
    again = _run_engine(engine)["again"]
    assert again.metrics.adapter_source == "disk" and again.outputs[0].token_ids == expected[0]
    assert engine.stats()["adapter_remote_loads"] == 2


def _dora_adapter(model_dir, out_dir, seed=0):
    """A PEFT DoRA adapter with random A, B and magnitudes that differ from ||W + sBA||."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, use_dora=True, init_lora_weights=False,
                                            target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.3)
            if "magnitude" in name:
                p.mul_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return out_dir


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # qwen2: biased q/v, which DoRA rescales
def test_dora_and_mixed_adapters_in_one_batch(arch, model_dirs, adapter_dirs, tmp_path):
    model = model_dirs[arch]
    dora_dir = _dora_adapter(model, tmp_path / "dora")
    llm = make_llm(model, max_loras=4, max_lora_rank=16)
    loras = [LoRARequest("dora", 1, str(dora_dir))] + [
        LoRARequest(name, 2 + i, str(adapter_dirs[arch][name])) for i, name in enumerate(ADAPTERS)] + [None]
    prompts = random_prompts(2 * len(loras), (5, 20), seed=5)
    per_prompt = loras * 2
    n = 5
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, prompt_logprobs=0)
    together = llm.generate(prompts, sp, per_prompt)
    _assert_each_as_alone(llm, prompts, per_prompt, together, sp)
    oracle = HFOracle(model, dora_dir)
    for p, out in zip(prompts[:: len(loras)], together[:: len(loras)]):  # the DoRA requests
        torch.testing.assert_close(_prompt_lps(out, p), oracle.prompt_logprobs(p), atol=tolerance(), rtol=0)
    if DTYPE == "float32":  # bf16 rounding may flip a near-tie, so tokens only in float32
        for p, out in zip(prompts[:: len(loras)], together[:: len(loras)]):
            assert out.outputs[0].token_ids == oracle.greedy(p, n)


def _prompt_lps(out, prompt) -> torch.Tensor:
    return torch.tensor([x[t].logprob for x, t in zip(out.prompt_logprobs[1:], prompt[1:])])


def _assert_each_as_alone(llm, prompts, per_prompt, together, sp=SP) -> None:
    """Each output of a batch equals that request served alone: teacher-forced logprobs
    of every prompt token up to rounding (these adapters move logits a lot, so bf16 gets
    the oracle tolerance), and the generated tokens too in float32 (bf16 rounding may
    flip a near-tie)."""
    alone = [llm.generate([p], sp, lora)[0] for p, lora in zip(prompts, per_prompt)]
    for a, b, p in zip(together, alone, prompts):
        assert (_prompt_lps(a, p) - _prompt_lps(b, p)).abs().max().item() <= tolerance()
    if DTYPE == "float32":
        assert _tokens(together) == _tokens(alone)


def test_pinned_pool_is_bounded_and_reused():
    from loraplex.adapters.pinned_pool import PinnedPool

    pool = PinnedPool(count=10, nbytes=3000, max_bytes=4096 * 3, pinned=False)  # 3 of 4 KiB
    bufs = [pool.take(2500) for _ in range(3)]
    assert all(b is not None and b.numel() == 4096 and b.data_ptr() % 4096 == 0 for b in bufs), "whole pages"
    assert pool.take(100) is None, "spent: the caller allocates its own"
    pool.give(bufs[0], None)
    assert pool.take(5000) is None, "too big for a pool buffer"
    assert pool.take(3000).data_ptr() == bufs[0].data_ptr(), "buffers are reused"
    if torch.cuda.is_available():  # page-locked: host-to-device copies from them are asynchronous
        locked = PinnedPool(count=2, nbytes=3000)
        assert all(b.is_pinned() for b in (locked.take(3000), locked.take(3000)))


def test_converted_adapter_outlives_its_file_buffer(model_dirs, tmp_path):
    """A float32 DoRA file loaded for a bf16 model is converted out of the buffer the file
    was read into; that buffer then goes back to the pinned pool and is reused, so
    nothing of the adapter (magnitudes included) may still point into it."""
    from loraplex.adapters.peft import read_adapter_dir, to_canonical
    from loraplex.models.weights import adapter_targets

    dora = _dora_adapter(model_dirs["llama"], tmp_path / "dora")
    llm = make_llm(model_dirs["llama"])
    slab = torch.zeros(1 << 22, dtype=torch.uint8)
    config, tensors = read_adapter_dir("dora", dora, into=slab)
    adapter = to_canonical("k", "dora", str(dora), config, tensors,
                           adapter_targets(llm.engine.runner.model), 16, torch.bfloat16)
    before = {m: v.clone() for m, v in adapter.magnitudes.items()}
    slab.fill_(0xFF)  # the next load's bytes (NaN as float32)
    for m, v in adapter.magnitudes.items():
        assert torch.equal(v, before[m]), m
    assert all(torch.isfinite(t.float()).all() for a, b in adapter.weights.values() for t in (a, b))


def test_file_read_lazily_has_the_content_id_of_its_tensors(tmp_path):
    """A weights file read whole makes no tensor views until asked (TensorFile); its
    content id and finiteness check, computed from header offsets and raw bytes, agree
    with the same tensors held in memory, and views read the file's values."""
    from safetensors.torch import save_file

    from loraplex.adapters.manifest import content_id
    from loraplex.adapters.peft import _all_finite, _all_finite_named
    from loraplex.adapters.safetensors_io import TensorFile, read_safetensors

    tensors = {"b": torch.randn(3, 4).bfloat16(), "a": torch.randn(5), "c": torch.randn(2, 2).half()}
    save_file(tensors, tmp_path / "w.safetensors")
    file = read_safetensors(str(tmp_path / "w.safetensors"), pinned=False)
    assert isinstance(file, TensorFile) and not file._views
    assert content_id({"r": 4}, file) == content_id({"r": 4}, {k: v.clone() for k, v in tensors.items()})
    assert not file._views, "the content id made no views"
    assert _all_finite_named(file, list(file)) and _all_finite(list(tensors.values()))
    assert all(torch.equal(file[k], v) for k, v in tensors.items())
    tensors["c"][1, 1] = float("inf")
    assert not _all_finite(list(tensors.values())) and _all_finite([tensors["a"], tensors["b"]])
    assert not _all_finite([tensors["c"].t()]), "a non-contiguous tensor is checked too"
    save_file(tensors, tmp_path / "bad.safetensors")
    bad = read_safetensors(str(tmp_path / "bad.safetensors"), pinned=False)
    assert not _all_finite_named(bad, ["c"]) and _all_finite_named(bad, ["a", "b"])


def test_direct_reads_give_the_file(tmp_path, monkeypatch):
    """With LORAPLEX_DIRECT_READS a file is read with O_DIRECT into a page-aligned pool
    buffer (or, where the file system refuses, as before): the same tensors either way."""
    from safetensors.torch import save_file

    from loraplex.adapters import safetensors_io
    from loraplex.adapters.pinned_pool import PinnedPool

    tensors = {"a": torch.randn(1000, 37), "b": torch.randn(3).bfloat16()}
    save_file(tensors, tmp_path / "w.safetensors")
    monkeypatch.setattr(safetensors_io, "DIRECT_READS", True)
    pool = PinnedPool(count=2, nbytes=200_000, pinned=False)
    file = safetensors_io.read_safetensors(str(tmp_path / "w.safetensors"), False, pool.take(150_000))
    assert all(torch.equal(file[k], v) for k, v in tensors.items())


def test_staged_slot_copy_places_and_scales_every_tensor(tmp_path, monkeypatch):
    """The GPU slot copy's arithmetic, run on CPU tensors: the span of a file holding an
    adapter goes to one staging buffer, each tensor lands in its (strided) slot view
    times its scaling, and views are kept for a bounded number of file layouts."""
    from safetensors.torch import save_file

    from loraplex.adapters import slots
    from loraplex.adapters.safetensors_io import read_safetensors

    monkeypatch.setattr(slots, "MAX_LAYOUTS", 1)
    tensors = {"a": torch.randn(4, 6), "b": torch.randn(10, 4), "c": torch.randn(3, 6)}
    save_file(tensors, tmp_path / "w.safetensors")
    file = read_safetensors(str(tmp_path / "w.safetensors"), pinned=False)
    stage = slots.Staging()
    for scales in ([1.0, 0.5, 2.0], [3.0, 1.0, 1.0]):
        slot_a, slot_b = torch.zeros(2, 8, 6), torch.zeros(2, 10, 8)  # [slots, cap, in], [slots, out, cap]
        dsts = [slot_a[1, :4], slot_b[1, :, :4], slot_a[0, :3]]
        spans = [(file.entries[n].begin, file.entries[n].shape, None) for n in "abc"]
        stage._staged(dsts, file.buffer, spans, torch.float32, scales)
        for d, n, s in zip(dsts, "abc", scales):
            assert torch.equal(d, tensors[n] * s)
        assert slot_a[1, 4:].abs().sum() == 0 and slot_b[1, :, 4:].abs().sum() == 0, "only the views"
    other = [(file.entries["b"].begin, file.entries["b"].shape, None)]  # a second layout
    stage._staged([torch.zeros(10, 4)], file.buffer, other, torch.float32, [1.0])
    assert len(stage._views) == 1
