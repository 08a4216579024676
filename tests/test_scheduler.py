"""Scheduler, block manager and slot table as pure Python: no model involved."""

from __future__ import annotations

import pytest

from loraplex.adapters.manager import AdapterTicket
from loraplex.adapters.slot_table import SlotTable
from loraplex.adapters.sources import AdapterSource
from loraplex.config import SchedulerConfig
from loraplex.engine.block_manager import BlockManager
from loraplex.engine.request import Request
from loraplex.engine.scheduler import Scheduler
from loraplex.types import LoRARequest, SamplingParams, StepResult


def test_block_manager_free_list_and_ref_counts():
    bm = BlockManager(num_blocks=4, block_size=4)
    a: list[int] = []
    assert bm.can_grow(a, 16) and not bm.can_grow(a, 17)
    bm.grow(a, 5)
    assert len(a) == 2 and bm.num_free_blocks == 2
    bm.grow(a, 8)  # still fits in two pages
    assert len(a) == 2
    shared = bm.share(a)
    bm.free(a)
    assert a == [] and bm.num_free_blocks == 2, "shared pages stay allocated"
    bm.free(shared)
    assert bm.num_free_blocks == 4
    with pytest.raises(AssertionError):
        bm.free([0])


def test_slot_table_reuse_and_lru():
    st = SlotTable(2)
    assert st.acquire("a") == (0, True)
    assert st.acquire("a") == (0, False)
    assert st.acquire("b") == (1, True)
    assert not st.can_acquire("c"), "both slots referenced"
    st.release(0)
    st.release(0)
    st.release(1)
    assert st.acquire("a") == (0, False), "idle slot keeps its adapter"
    st.release(0)
    # LRU among idle slots: b (released before a's last use) goes first.
    assert st.acquire("c") == (1, True) and st.slot_of("b") is None
    assert not st.forget("c") and st.forget("a") and st.slot_of("a") is None


def _request(rid, n_prompt, max_tokens=4, lora=None):
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(3, 3 + n_prompt)),
        sampling=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        lora_request=lora,
    )


def _run(sched, plan, token=7):
    """Pretend the runner sampled `token` for every chunk that samples."""
    result = StepResult(
        [token if c.sample else None for c in plan.chunks],
        [None] * len(plan.chunks),
        [None] * len(plan.chunks),
    )
    return sched.update(plan, result)


def _scheduler(num_blocks=64, block_size=4, slots=2, **kw):
    cfg = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 16, "max_model_len": 64, **kw})
    return Scheduler(cfg, BlockManager(num_blocks, block_size), SlotTable(slots))


def test_token_budget_chunks_prefill_and_mixes_decodes():
    sched = _scheduler()
    sched.add(_request("a", 10))
    sched.add(_request("b", 20))
    plan = sched.schedule()
    assert [(c.request_id, c.num_tokens, c.sample) for c in plan.chunks] == [
        ("a", 10, True), ("b", 6, False)
    ]
    assert plan.chunks[1].start_pos == 0
    _run(sched, plan)
    plan = sched.schedule()  # a decodes one token; b continues its prefill
    assert [(c.request_id, c.num_tokens, c.start_pos) for c in plan.chunks] == [
        ("a", 1, 10), ("b", 14, 6)
    ]
    assert plan.chunks[0].token_ids == [7]


def test_preemption_frees_pages_and_recomputes_newest_first():
    sched = _scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_model_len=24)
    sched.add(_request("old", 8, max_tokens=12))
    sched.add(_request("new", 8, max_tokens=12))
    _run(sched, sched.schedule())  # 2 pages each, 2 free
    for _ in range(8):
        plan = sched.schedule()
        _run(sched, plan)
    new = next(r for r in [*sched.running, *sched.waiting] if r.request_id == "new")
    assert new.metrics.num_preemptions >= 1
    assert sched.requests["old"].metrics.num_preemptions == 0
    # The preempted request comes back with prompt + its output so far as its prefill.
    while new not in sched.running:
        _run(sched, sched.schedule())
    assert new.num_computed_tokens > 8


def _ticket(name: str, state: str = "ready") -> AdapterTicket:
    lora = LoRARequest(name, abs(hash(name)) % 1000 + 1, f"/{name}")
    return AdapterTicket(lora, AdapterSource(name, f"/{name}", remote=False), state=state,
                         content_id=f"sha256:{name}", tier="host")


def _adapted(rid, ticket, n_prompt=4):
    req = _request(rid, n_prompt, lora=ticket.lora)
    req.adapter = ticket
    return req


def test_adapter_slots_gate_admission_and_loads_are_planned():
    sched = _scheduler(slots=1)
    a1, a2 = _ticket("a"), _ticket("b")
    sched.add(_adapted("r1", a1))
    sched.add(_adapted("r2", a2))
    sched.add(_adapted("r3", a1))
    plan = sched.schedule()
    assert [c.request_id for c in plan.chunks] == ["r1", "r3"], "r2 waits for the only slot"
    assert plan.lora_loads == {0: a1.content_id}
    _run(sched, plan)
    while "r1" in sched.requests or "r3" in sched.requests:
        _run(sched, sched.schedule())
    plan = sched.schedule()
    assert [c.request_id for c in plan.chunks] == ["r2"]
    assert plan.lora_loads == {0: a2.content_id} and plan.chunks[0].lora_slot == 0
    assert {"r1", "r3"} <= set(plan.finished_request_ids)


def test_loading_adapters_are_passed_over_not_waited_for():
    sched = _scheduler(slots=2)
    loading = _ticket("cold", state="loading")
    sched.add(_adapted("cold", loading))
    sched.add(_request("base", 4))
    sched.add(_adapted("warm", _ticket("w")))
    plan = sched.schedule()
    # warm is admitted and its adapter copied into a slot beside base's step; it runs next.
    assert [c.request_id for c in plan.chunks] == ["base"]
    assert list(plan.lora_loads.values()) == ["sha256:w"]
    loading.state = "ready"
    plan = sched.schedule()
    assert [c.request_id for c in plan.chunks if c.num_tokens > 1] == ["warm"]
    assert list(plan.lora_loads.values()) == ["sha256:cold"]
    assert [c.request_id for c in sched.schedule().chunks if c.num_tokens > 1] == ["cold"]


def test_a_step_with_nothing_else_to_run_runs_the_request_whose_adapter_it_copies():
    sched = _scheduler(slots=1)
    sched.add(_adapted("r1", _ticket("a")))
    plan = sched.schedule()
    assert [c.request_id for c in plan.chunks] == ["r1"] and plan.lora_loads == {0: "sha256:a"}


def test_a_request_starved_of_slots_stops_other_adapters(monkeypatch):
    sched = _scheduler(slots=1, max_adapter_wait=0.0)
    sched.add(_adapted("hot1", _ticket("hot")))
    _run(sched, sched.schedule())  # hot holds the only slot
    cold = _adapted("cold", _ticket("cold"))
    cold.metrics.arrival_time -= 1.0  # waited past the bound
    sched.add(cold)
    sched.add(_adapted("hot2", _ticket("hot")))  # could share hot's slot...
    sched.add(_request("base", 4))
    plan = sched.schedule()
    # ...but while cold starves only base requests get in, so the slot drains.
    assert "hot2" not in [c.request_id for c in plan.chunks]
    assert "base" in [c.request_id for c in plan.chunks]
    _run(sched, plan)
    while "hot1" in sched.requests:
        _run(sched, sched.schedule())
    plan = sched.schedule()
    # The drained slot goes to cold; its copy runs beside base's last step, and it runs next.
    assert plan.lora_loads == {0: "sha256:cold"} and [c.request_id for c in plan.chunks] == ["base"]
    _run(sched, plan)
    assert [c.request_id for c in sched.schedule().chunks] == ["cold"]


def test_stop_conditions_in_update():
    sched = _scheduler()
    req = _request("a", 4, max_tokens=3)
    req.sampling.stop_token_ids = [9]
    sched.add(req)
    _run(sched, sched.schedule(), token=5)
    _run(sched, sched.schedule(), token=9)
    assert req.finished and req.finish_reason == "stop" and req.stop_reason == 9
    assert sched.blocks.num_free_blocks == 64


def test_planning_ahead_feeds_pending_tokens():
    """Two plans before the first update: the second feeds the in-flight token
    (PENDING_TOKEN) and updates then apply in order."""
    from loraplex.types import PENDING_TOKEN

    sched = _scheduler()
    req = _request("a", 5, max_tokens=3)
    sched.add(req)
    first = sched.schedule()
    second = sched.schedule()
    assert second.chunks[0].token_ids == [PENDING_TOKEN] and second.chunks[0].start_pos == 5
    third = sched.schedule()
    assert third.chunks[0].start_pos == 6
    assert not sched.schedule().chunks, "the third token is the last one: nothing to plan"
    for plan, token in ((first, 11), (second, 12), (third, 13)):
        _run(sched, plan, token=token)
    assert req.output_token_ids == [11, 12, 13] and req.finish_reason == "length"
    assert req.num_pending == 0
