"""Bad and hostile adapters: every way a config, a weights file or a path can be wrong
ends in a typed adapter error with a one-line reason, before any weight is served; an
adapter's name stays bound to the content it was loaded as."""

from __future__ import annotations

import functools
import http.server
import json
import math
import shutil
import struct
import threading
from pathlib import Path

import pytest
import torch

from loraplex.adapters import peft
from loraplex.adapters.experts import ExpertShape
from loraplex.adapters.host_cache import HostCache
from loraplex.adapters.manager import AdapterManager
from loraplex.adapters.peft import AdapterTargets, read_adapter_dir, to_canonical
from loraplex.adapters.sources import resolve
from loraplex.bench.synthetic import write_random_adapter
from loraplex.errors import AdapterError, AdapterInvalid, AdapterNotFound, AdapterTooLarge
from loraplex.types import LoRARequest

PROJECTIONS = {f"model.layers.{i}.self_attn.{p}": (64, 32 if p == "v_proj" else 64)
               for i in range(2) for p in ("q_proj", "v_proj")}
EXPERTS = {"model.layers.0.mlp.experts": ExpertShape(num_experts=4, hidden_size=64, intermediate_size=32)}
TARGETS = AdapterTargets(PROJECTIONS, EXPERTS)


def _adapter(path: Path, seed: int = 0, rank: int = 4, **kw) -> Path:
    kw.setdefault("targets", ("q_proj", "v_proj"))
    return write_random_adapter(path, PROJECTIONS, rank=rank, seed=seed, experts=EXPERTS, **kw)


def _load(path: Path, max_rank: int = 8) -> peft.LoRAAdapter:
    config, tensors = read_adapter_dir("x", path)
    return to_canonical("k", "x", str(path), config, tensors, TARGETS, max_rank, torch.float32)


def _with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / peft.CONFIG_FILE).read_text())
    # (json.dumps writes NaN and Infinity as Python's json reads them)
    (dst / peft.CONFIG_FILE).write_text(json.dumps({**config, **changes}))
    return dst


def _manager(host_capacity: int = 4, max_rank: int = 8) -> AdapterManager:
    return AdapterManager(TARGETS, max_rank, torch.float32, HostCache(host_capacity), workers=1, timeout=20)


def _assert_one_line(error: AdapterError) -> None:
    text = str(error)
    assert "\n" not in text and len(text) < 400, text


# -- 1. scalings that are not finite positive numbers ------------------------------------

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("changes", [
    {"lora_alpha": NAN}, {"lora_alpha": INF}, {"lora_alpha": -INF}, {"lora_alpha": 10**400},
    {"lora_alpha": True}, {"lora_alpha": 0}, {"lora_alpha": 1e308},  # 1e308 / 4 is past float32
    {"lora_alpha": 1e39, "use_rslora": True},  # 1e39 / sqrt(4): past float32
    {"r": 4.0}, {"r": True}, {"r": NAN},
    {"alpha_pattern": {"q_proj": NAN}}, {"alpha_pattern": {"v_proj": INF}},
    {"alpha_pattern": {"q_proj": 1e308}}, {"alpha_pattern": {"q_proj": True}},
    {"alpha_pattern": {"q_proj": "8"}}, {"alpha_pattern": {"q_proj": None}},
    {"rank_pattern": {"q_proj": 4.0}}, {"rank_pattern": {"q_proj": INF}},
    {"rank_pattern": {"q_proj": -4}},
], ids=repr)
def test_non_finite_or_mistyped_scaling_is_invalid(tmp_path, changes):
    good = _adapter(tmp_path / "good")
    _load(good)
    with pytest.raises(AdapterInvalid) as info:
        _load(_with_config(good, tmp_path / "bad", **changes))
    _assert_one_line(info.value)
    assert next(iter(changes)) in str(info.value) or "scaling" in str(info.value), info.value


@pytest.mark.parametrize("changes", [{"lora_alpha": 1e308}, {"alpha_pattern": {"down_proj": 1e308}}],
                         ids=repr)
def test_expert_scaling_must_be_finite_in_float32(tmp_path, changes):
    good = _adapter(tmp_path / "good", rank=2, targets=("experts",))
    adapter = _load(good)
    assert adapter.experts and not adapter.modules
    with pytest.raises(AdapterInvalid, match="float32"):
        _load(_with_config(good, tmp_path / "bad", **changes))


# -- 2. malformed configs and paths ------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("text", [
    DEEP,
    '{"r": 4, "lora_alpha": 8, "notes": ' + DEEP + "}",
    '{"r": 4, "lora_alpha": 8, "notes": ' + "7" * 5000 + "}",  # past Python's int digit limit
], ids=["deep", "deep-field", "long-int"])
def test_unparseable_config_is_invalid(tmp_path, text):
    bad = shutil.copytree(_adapter(tmp_path / "good"), tmp_path / "bad")
    (bad / peft.CONFIG_FILE).write_text(text)
    with pytest.raises(AdapterInvalid, match=peft.CONFIG_FILE) as info:
        _load(bad)
    _assert_one_line(info.value)


def test_oversized_config_is_invalid(tmp_path):
    bad = shutil.copytree(_adapter(tmp_path / "good"), tmp_path / "bad")
    config = json.loads((bad / peft.CONFIG_FILE).read_text())
    (bad / peft.CONFIG_FILE).write_text(json.dumps(config) + " " * (2 << 20))
    with pytest.raises(AdapterInvalid, match="bytes"):
        _load(bad)


@pytest.mark.parametrize("changes", [
    {"rank_pattern": ["q_proj"]}, {"rank_pattern": "q_proj"}, {"rank_pattern": 4},
    {"alpha_pattern": ["q_proj", 8]}, {"alpha_pattern": "q_proj"}, {"alpha_pattern": 8.0},
    {"rank_pattern": {"(q_proj": 4}}, {"alpha_pattern": {"[": 8}}, {"alpha_pattern": {"q_proj)(": 8}},
    {"alpha_pattern": {"a{99999999999}": 8}}, {"alpha_pattern": {"(" * 50_000 + ")" * 50_000: 8}},
    {"use_dora": "false"}, {"use_rslora": 1}, {"target_parameters": 5},
], ids=lambda c: repr(c)[:60])
def test_mistyped_config_fields_are_invalid(tmp_path, changes):
    good = _adapter(tmp_path / "good", targets=("q_proj", "v_proj", "experts"))
    with pytest.raises(AdapterInvalid) as info:
        _load(_with_config(good, tmp_path / "bad", **changes))
    _assert_one_line(info.value)
    assert next(iter(changes)) in str(info.value), info.value


def test_pattern_that_backtracks_for_hours_is_invalid(tmp_path, monkeypatch):
    """PEFT's pattern keys are regexes: one that backtracks exponentially over module
    paths must not hold a loader thread (nor, through the GIL, the engine) for good."""
    monkeypatch.setattr(peft, "PATTERN_SECONDS", 0.2)
    slow = r"([\w.]|[\w.][\w.])+([\w.]|[\w.][\w.])+([\w.]|[\w.][\w.])+[^\w.]"
    with pytest.raises(AdapterInvalid, match="alpha_pattern"):
        _load(_with_config(_adapter(tmp_path / "good"), tmp_path / "bad", alpha_pattern={slow: 8}))


def test_patterns_still_match_module_suffixes(tmp_path):
    good = _adapter(tmp_path / "good")
    adapter = _load(_with_config(good, tmp_path / "p", r=4, lora_alpha=8,
                                 alpha_pattern={r"layers\.1\.self_attn\.q_proj": 2, "v_proj": 12}))
    scalings = {m: s for m, (_, _, s) in adapter.modules.items()}
    assert scalings == {"model.layers.0.self_attn.q_proj": 2.0, "model.layers.1.self_attn.q_proj": 0.5,
                        "model.layers.0.self_attn.v_proj": 3.0, "model.layers.1.self_attn.v_proj": 3.0}


def test_rank_zero_tensors_are_invalid(tmp_path):
    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{module}.lora_A.weight": torch.zeros(0, 64), f"{module}.lora_B.weight": torch.zeros(64, 0)},
              str(bad / peft.WEIGHTS_FILE))
    (bad / peft.CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA"}))
    with pytest.raises(AdapterInvalid, match="rank"):
        _load(bad)


def _safetensors(path: Path, header: bytes | dict, data: bytes = b"", header_len: int | None = None) -> Path:
    if isinstance(header, dict):
        header = json.dumps(header).encode()
    path.mkdir(parents=True, exist_ok=True)
    with open(path / peft.WEIGHTS_FILE, "wb") as f:
        f.write(struct.pack("<Q", len(header) if header_len is None else header_len) + header + data)
    (path / peft.CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    return path


_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def _entry(shape, begin, dtype="F32"):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, begin + 4 * math.prod(shape)]}


@pytest.mark.parametrize("case", [
    "deep", "list", "entry-not-object", "negative-dims", "float-dims", "bool-offset",
    "overlap", "gap", "trailing-bytes", "huge-header-length", "unknown-dtype",
])
def test_malformed_weights_header_is_invalid(tmp_path, case):
    a, b = _entry((4, 64), 0), _entry((64, 4), 1024)
    data = bytes(2048)
    _load(_safetensors(tmp_path / "good", {_A: a, _B: b}, data))
    header: bytes | dict = {_A: a, _B: b}
    header_len = None
    if case == "deep":
        header = ('{"x": ' + DEEP + "}").encode()
    elif case == "list":
        header = b"[1, 2]"
    elif case == "entry-not-object":
        header = {_A: "F32", _B: b}
    elif case == "negative-dims":  # (-16) x (-16) x 4 bytes: the byte count fits
        header = {_A: {**a, "shape": [-16, -16]}, _B: b}
    elif case == "float-dims":
        header = {_A: {**a, "shape": [4.0, 64]}, _B: b}
    elif case == "bool-offset":
        header = {_A: a, _B: {**b, "shape": [1], "data_offsets": [1024, 1028]},
                  "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight":
                      {"dtype": "F32", "shape": [], "data_offsets": [True, 5]}}
    elif case == "overlap":  # B reads A's bytes
        header = {_A: a, _B: {**b, "data_offsets": [0, 1024]}}
        data = bytes(1024)
    elif case == "gap":
        data = bytes(2048 + 64)
        header = {_A: a, _B: _entry((64, 4), 1024 + 64)}
    elif case == "trailing-bytes":
        data = bytes(2048 + 100)
    elif case == "huge-header-length":
        header_len = 1 << 62
    elif case == "unknown-dtype":
        header = {_A: {**a, "dtype": "I64"}, _B: b}
    bad = _safetensors(tmp_path / case, header, data, header_len)
    with pytest.raises(AdapterInvalid, match=peft.WEIGHTS_FILE) as info:
        _load(bad)
    _assert_one_line(info.value)


@pytest.mark.parametrize("path", [
    "a" * 100_000, "/tmp/" + "b" * 300 + "/adapter", "http://[::1", "file://" + "c" * 100_000,
])
def test_unusable_paths_fail_typed_and_short(path):
    lora = LoRARequest("x", 1, path)
    with pytest.raises((AdapterNotFound, AdapterInvalid)) as info:
        resolve(lora, None)
    _assert_one_line(info.value)
    manager = _manager()
    with pytest.raises((AdapterNotFound, AdapterInvalid)):
        manager.submit(lora)


# -- 3. sizes checked before the data is read -------------------------------------------

def _oversized(path: Path, nbytes: int) -> Path:
    """A PEFT adapter whose q_proj A claims `nbytes` of float32 values (a sparse file)."""
    rows = nbytes // (4 * 64)
    header = json.dumps({_A: _entry((rows, 64), 0), _B: _entry((64, rows), 4 * 64 * rows)}).encode()
    path.mkdir(parents=True)
    with open(path / peft.WEIGHTS_FILE, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 2 * 4 * 64 * rows)
    (path / peft.CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": rows, "lora_alpha": 8}))
    return path


def test_oversized_weights_are_refused_before_they_are_read(tmp_path, monkeypatch):
    big = _oversized(tmp_path / "big", 1 << 30)  # 2 GiB of data in all
    empty = torch.empty

    def small_empty(*size, **kw):  # the whole file must never be allocated
        n = math.prod(size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size)
        assert n < 64 << 20, f"allocated {n} elements"
        return empty(*size, **kw)

    monkeypatch.setattr(torch, "empty", small_empty)
    manager = _manager()
    with pytest.raises(AdapterTooLarge, match="max_lora_rank") as info:
        manager.load(LoRARequest("big", 1, str(big)))
    _assert_one_line(info.value)


def test_largest_adapter_of_max_rank_fits(tmp_path):
    """The bound is not tighter than the model: an adapter of max_lora_rank on every
    projection and both expert layouts' parts, with DoRA magnitudes, loads."""
    limits = TARGETS.file_limits(8)
    dense = _adapter(tmp_path / "dense", rank=8, targets=("q_proj", "v_proj", "experts"))
    config, tensors = read_adapter_dir("dense", dense, limits=limits)
    values = sum(math.prod(shape) for _, shape in peft.tensor_meta(tensors).values())
    assert values + sum(o for _, o in PROJECTIONS.values()) <= limits.values


class _CountingHandler(http.server.SimpleHTTPRequestHandler):
    gets: list[str] = []

    def do_GET(self):
        self.gets.append(self.path)
        super().do_GET()

    def log_message(self, *args):
        pass


def test_oversized_remote_weights_are_not_downloaded(tmp_path):
    root = tmp_path / "www"
    _oversized(root / "big", 32 << 20)
    handler = type("Handler", (_CountingHandler,), {"gets": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(handler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        manager = _manager()
        url = f"http://127.0.0.1:{server.server_address[1]}/big"
        with pytest.raises(AdapterTooLarge):
            manager.load(LoRARequest("big", 1, url))
    finally:
        server.shutdown()
    assert not any(p.endswith(peft.WEIGHTS_FILE) for p in handler.gets), handler.gets


# -- 4. identity from content ------------------------------------------------------------

def _rewrite(path: Path, seed: int) -> None:
    """Other weights of the same shapes, written over the files in place."""
    staged = _adapter(path.with_name(path.name + "-next"), seed=seed)
    for f in (peft.CONFIG_FILE, peft.WEIGHTS_FILE):
        with open(path / f, "r+b") as out:
            out.truncate(0)
            out.write((staged / f).read_bytes())
    shutil.rmtree(staged)


def test_changed_files_are_new_content(tmp_path):
    path = _adapter(tmp_path / "a", seed=0)
    manager = _manager()
    first = manager.load(LoRARequest("a", 1, str(path)))
    _rewrite(path, seed=1)
    second = manager.load(LoRARequest("b", 2, str(path)))
    assert first.content_id != second.content_id
    expected = _manager().load(LoRARequest("b", 2, str(path))).content_id
    assert second.content_id == expected
    # Deleted and written again (perhaps on the same inode): new content again.
    shutil.rmtree(path)
    _adapter(path, seed=2)
    third = manager.load(LoRARequest("c", 3, str(path)))
    assert third.content_id not in (first.content_id, second.content_id)


def _cid(manager: AdapterManager, lora: LoRARequest) -> str:
    ticket = manager.load(lora)
    manager.release(ticket)
    return ticket.content_id


def test_a_name_stays_bound_to_what_it_loaded(tmp_path):
    path = _adapter(tmp_path / "a", seed=0)
    manager = _manager()
    a, b = LoRARequest("a", 1, str(path)), LoRARequest("b", 2, str(path))
    old = _cid(manager, a)
    _rewrite(path, seed=1)
    assert _cid(manager, a) == old, "in host memory: still what was loaded as `a`"
    new = _cid(manager, b)
    assert new != old
    manager.host.forget(old)  # evicted: `a` must be read again, and its files changed
    with pytest.raises(AdapterInvalid, match="changed since") as info:
        manager.load(a)
    _assert_one_line(info.value)
    assert _cid(manager, b) == new
    shutil.rmtree(path)
    assert _cid(manager, b) == new, "files gone, content still in host memory"
    manager.host.forget(new)
    with pytest.raises(AdapterNotFound):
        manager.load(b)


def test_evicted_adapter_with_unchanged_files_loads_again(tmp_path):
    """Eviction alone changes nothing: a name whose files still hold its content is read
    again; unloading a name frees it to load what its files hold now."""
    paths = [_adapter(tmp_path / f"a{i}", seed=i) for i in range(2)]
    manager = _manager(host_capacity=1)
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    ids = []
    for lora in loras:
        ticket = manager.load(lora)
        manager.release(ticket)
        ids.append(ticket.content_id)
    assert ids[0] not in manager.host
    again = manager.load(loras[0])
    assert again.content_id == ids[0] and again.tier == "disk"
    manager.release(again)
    _rewrite(paths[0], seed=5)
    manager.load(loras[1])  # evicts a0's content
    with pytest.raises(AdapterInvalid, match="changed since"):
        manager.load(loras[0])
    manager.forget(loras[0])  # unloaded: the name is free again
    assert manager.load(loras[0]).content_id not in ids
