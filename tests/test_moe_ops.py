"""The Triton MoE kernels against the plain-torch oracle: pair alignment, fused_experts on
awkward shapes (every activation, biases, per-token adapters on experts), the tuned
config files and the tuner's search space."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import DEVICE

from loraplex import ops
from loraplex.ops.metadata import MoELoRA
from loraplex.ops.reference import moe as reference

pytest.importorskip("triton")
from loraplex.bench import tune_moe  # noqa: E402
from loraplex.ops.triton import fused_moe, moe_align, moe_configs, moe_epilogue, moe_lora_gemv  # noqa: E402

REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("t,e,k,h,bias,renorm", [
    (1, 8, 2, 40, False, True),      # one program a token holds the row
    (5, 32, 4, 2880, True, True),    # gpt-oss's router: K in chunks, 4 programs a token
    (7, 20, 3, 100, True, False),    # experts not a multiple of the block, K not of the chunk
    (3, 128, 8, 64, False, True),    # Qwen3-MoE's expert count
    (0, 8, 2, 16, False, True),
])
def test_route_tokens(t, e, k, h, bias, renorm, monkeypatch):
    """The router's logits and routing in one kernel against the router's GEMM and the
    torch routing: float32 exactly (the same experts, weights to 1e-5); bf16 within the
    logits' rounding (each chosen expert's logit at least the best unchosen one less an
    ulp, weights the softmax of the reference logits at the chosen experts). Twice, so the
    second launch finds every ticket at zero again."""
    from loraplex.ops.triton import moe_route_gemv

    monkeypatch.setattr(moe_route_gemv, "BLOCK_K", 32 if h < 100 else 1024)
    gen = torch.Generator().manual_seed(t * 7 + e)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(t, h, generator=gen).to(dtype)
        w = (torch.randn(e, h, generator=gen) * h ** -0.5).to(dtype)
        b = (torch.randn(e, generator=gen) * 0.1).to(dtype) if bias else None
        logits = torch.nn.functional.linear(x, w, b).float()
        want_w, want_ids = reference.route_tokens(x, w, b, k, renorm)
        for _ in range(2):
            with ops.using_backend("triton"):
                got_w, ids = ops.route_tokens(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE) if bias else None, k,
                                              renorm)
            assert ids.dtype == torch.int32 and got_w.dtype == torch.float32 and ids.shape == (t, k)
            assert int(moe_route_gemv._tickets_for(ids.device).abs().sum()) == 0
            got_w, ids = got_w.cpu(), ids.cpu().long()
            if dtype == torch.float32:
                assert torch.equal(ids.sort(-1).values, want_ids.long().sort(-1).values)
                torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
                continue
            assert all(len(set(row)) == k for row in ids.tolist())
            chosen = logits.gather(-1, ids)
            others = logits.scatter(-1, ids, -float("inf")).amax(-1, keepdim=True)
            ulp = logits.abs().amax(-1, keepdim=True) * 2 ** -7
            assert (chosen >= others - ulp).all(), "a chosen expert's logit is below an unchosen one"
            p = logits.softmax(-1).gather(-1, ids)
            want = p / p.sum(-1, keepdim=True) if renorm else p
            torch.testing.assert_close(got_w, want, rtol=2e-2, atol=1e-3)
    # Past the kernel's token count, the GEMM and the routing kernel: the same routing.
    x = torch.randn(moe_route_gemv.MAX_TOKENS + 1, 16, generator=gen)
    w = torch.randn(8, 16, generator=gen)
    with ops.using_backend("triton"):
        got_w, ids = ops.route_tokens(x.to(DEVICE), w.to(DEVICE), None, 2, True)
    want_w, want_ids = reference.route_tokens(x, w, None, 2, True)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(got_w.cpu(), want_w)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_route_tokens_of_a_quantized_router(backend):
    """A quantized router (FP8 blocks) routes through its own GEMM, then route_experts, on
    either backend: the routing of its dequantized logits."""
    from loraplex.ops.formats import Fp8Weight
    from loraplex.ops.reference.quant import quantize_fp8

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 256, generator=gen)
    values = torch.randn(16, 256, generator=gen) * 256 ** -0.5
    w = quantize_fp8(values, 128, out=Fp8Weight((16, 256), 128, torch.float32))
    want_w, want_ids = reference.route_experts(torch.nn.functional.linear(x, ops.dequantize(w)), 4, True)
    with ops.using_backend(backend):
        got_w, ids = ops.route_tokens(x.to(DEVICE), w.to(DEVICE), None, 4, True)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(got_w.cpu(), want_w, rtol=1e-5, atol=1e-6)


def check_alignment(al, keys: torch.Tensor, num_groups: int):
    sorted_ids, groups = al.sorted_ids.cpu(), al.block_groups.cpu()
    p, bm, valid = keys.numel(), al.block_m, int(al.num_valid.item())
    counts = torch.bincount(keys[keys >= 0], minlength=num_groups)
    assert valid == int(((counts + bm - 1) // bm * bm).sum()), "segments padded to whole blocks"
    assert sorted_ids.numel() == al.num_blocks * bm >= valid
    placed = sorted_ids[sorted_ids < p]
    assert sorted(placed.tolist()) == [i for i in range(p) if keys[i] >= 0]  # each pair once
    assert (sorted_ids[valid:] == p).all() and (groups[valid // bm:] == -1).all()
    for b in range(valid // bm):
        block = sorted_ids[b * bm:(b + 1) * bm]
        real = block[block < p]
        assert real.numel() > 0, "a valid block holds a pair"
        assert (keys[real.long()] == groups[b]).all(), "blocks are single-group"
        assert (block[: real.numel()] == real).all(), "padding only at a segment's end"
    seg = groups[: valid // bm].tolist()
    assert seg == sorted(seg) and set(seg) == set(keys[keys >= 0].tolist())


@pytest.mark.parametrize("form", ["one_program", "parallel"])
@pytest.mark.parametrize("t,e,k,bm", [(1, 4, 1, 16), (3, 8, 3, 16), (17, 8, 2, 4), (40, 4, 3, 16)])
def test_moe_align(t, e, k, bm, form, monkeypatch):
    # Chunks of 16 pairs: several per loop of the one program, or several programs.
    monkeypatch.setattr(moe_align, "CHUNK", 16)
    monkeypatch.setattr(moe_align, "ONE_PROGRAM_MAX_PAIRS", 1 << 20 if form == "one_program" else 0)
    gen = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).int()
    ids[ids == e - 1] = 0  # an expert no token hits
    stats = torch.tensor([5.0, 2.0], device=DEVICE)  # counts are added to what is there
    check_alignment(moe_align.align_experts(ids.to(DEVICE), e, bm, stats), ids.flatten(), e)
    assert stats.tolist() == [5.0 + ids.unique().numel(), 3.0]
    # By (slot, expert), 3 slots: tokens in slot -1 are left out.
    slots = torch.randint(-1, 3, (t + 2,), generator=gen, dtype=torch.int32)
    keys = torch.where(slots[:t, None] >= 0, slots[:t, None] * e + ids, -1).flatten()
    check_alignment(moe_align.align_lora(ids.to(DEVICE), slots.to(DEVICE), e, 3, bm), keys, 3 * e)
    # Slot 1's adapter adapts no expert here: its tokens are left out too.
    mask = torch.tensor([1, 0, 1], dtype=torch.int32)
    adapted = (slots[:t, None] >= 0) & (slots[:t, None] != 1)
    keys = torch.where(adapted, slots[:t, None] * e + ids, -1).flatten()
    check_alignment(moe_align.align_lora(ids.to(DEVICE), slots.to(DEVICE), e, 3, bm, mask.to(DEVICE)),
                    keys, 3 * e)


def make_lora(e, h, i, t, gen, with_ranks: bool = True) -> MoELoRA:
    """Slots: 0 full rank, 1 rank 3 (zero tails), 2 empty (adapts no expert), 3 rank 5;
    tokens in every slot and in none (-1). Ranks 16 (gate/up) and 8 (down, < a tl.dot).
    with_ranks: the per-slot ranks the kernels may stop reading at, as slots keep them."""
    r_gu, r_d, ranks = 16, 8, [16, 3, 0, 5]
    a_gu, b_gu = torch.zeros(4, e, r_gu, h), torch.zeros(4, e, 2 * i, r_gu)
    a_d, b_d = torch.zeros(4, e, r_d, i), torch.zeros(4, e, h, r_d)
    for s, r in enumerate(ranks):
        a_gu[s, :, :r] = torch.randn(e, r, h, generator=gen) / h**0.5
        b_gu[s, :, :, :r] = torch.randn(e, 2 * i, r, generator=gen) / (r or 1) ** 0.5
        a_d[s, :, : min(r, r_d)] = torch.randn(e, min(r, r_d), i, generator=gen) / i**0.5
        b_d[s, :, :, : min(r, r_d)] = torch.randn(e, h, min(r, r_d), generator=gen) / 4
    slots = torch.tensor([(-1, 0, 1, 2, 3)[j % 5] for j in range(t)], dtype=torch.int32)
    mask = torch.tensor([int(r > 0) for r in ranks], dtype=torch.int32)  # slot 2: skipped
    ranks = torch.tensor([ranks, [min(r, r_d) for r in ranks]], dtype=torch.int32) if with_ranks else None
    return MoELoRA(a_gu, b_gu, a_d, b_d, slots[torch.randperm(t, generator=gen)], mask, ranks)


def pair_terms(terms: torch.Tensor, top_k: int) -> torch.Tensor:
    """fused_experts' unsummed terms [T, K, H] as one per pair, [T, top_k, H] (float32): K
    = 2 top_k where each pair's GEMM row is followed by its down delta."""
    if terms.shape[1] == 2 * top_k:
        return terms[:, 0::2].float() + terms[:, 1::2].float()
    assert terms.shape[1] == top_k
    return terms.float()


SMALL_BLOCKS = (  # gate/up, down: several row and column blocks, grouped ordering, and
    # BLOCK_M differing between the GEMMs (each gets its own alignment)
    dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=3, num_warps=4, num_stages=2),
    dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2),
)


# (tokens, experts, top_k, hidden, intermediate, activation, biases, block configs)
CASES = [
    (1, 8, 2, 40, 24, "silu", True, "default"),
    (3, 4, 3, 128, 24, "silu", False, "small"),
    (17, 8, 3, 40, 24, "gelu_tanh", False, "default"),
    (3, 8, 1, 48, 20, "gelu_tanh", True, "small"),
    (17, 4, 2, 40, 24, "swiglu_oai", True, "small"),
    (1, 4, 3, 128, 36, "swiglu_oai", False, "default"),
    (40, 4, 3, 40, 24, "gelu_tanh", True, "small"),  # several blocks per expert
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_lora", [None, "gemv", "aligned"], ids=["base", "lora_gemv", "lora_aligned"])
@pytest.mark.parametrize("t,e,k,h,i,act,bias,blocks", CASES)
def test_fused_experts(monkeypatch, t, e, k, h, i, act, bias, blocks, with_lora, dtype):
    """Both expert-LoRA forms: per pair (decode-sized steps) and (slot, expert)-aligned."""
    monkeypatch.setattr(fused_moe, "GEMV_MAX_TOKENS", 64 if with_lora == "gemv" else 0)
    # 17 tokens: the grouped GEMMs load every epilogue operand after their main loop (a
    # benchmarks' switch; otherwise those without a dependent chain come before it).
    monkeypatch.setattr(moe_epilogue, "OPERANDS_BEFORE_LOOP", t != 17)
    if blocks == "small":  # w_gate_up is [E, 2I, H], w_down [E, H, I]
        monkeypatch.setattr(fused_moe, "gemm_config",
                            lambda w, *_: dict(SMALL_BLOCKS[w.shape[1] != 2 * i]))
    gen = torch.Generator().manual_seed(t * 100 + e * 10 + k)
    x = torch.randn(t, h, generator=gen)
    logits = torch.randn(t, e, generator=gen)
    logits[:, e - 1] = -torch.inf  # an expert no token hits
    weights, ids = reference.route_experts(logits, k, renormalize=bool(bias))
    w_gu = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    w_d = torch.randn(e, h, i, generator=gen) / i**0.5
    b_gu = torch.randn(e, 2 * i, generator=gen) if bias else None
    b_d = torch.randn(e, h, generator=gen) if bias else None
    lora = make_lora(e, h, i, t, gen, with_ranks=t % 2 == 1) if with_lora else None
    if lora is not None and t == 3:  # no slot mask: empty slots' (zero) weights are read
        lora = dataclasses.replace(lora, slot_mask=None)
    limit = 3.0 if act == "swiglu_oai" else None

    def cast(v, to, dev="cpu"):  # the oracle sees the same (rounded) values in fp32
        if isinstance(v, MoELoRA):
            return MoELoRA(*(cast(f, to, dev) for f in (v.a_gate_up, v.b_gate_up, v.a_down, v.b_down)),
                           v.token_slot.to(dev), None if v.slot_mask is None else v.slot_mask.to(dev),
                           None if v.ranks is None else v.ranks.to(dev))
        return None if v is None else v.to(dtype).to(dev, to)

    args = (x, w_gu, w_d, b_gu, b_d, lora)
    ref_args = xe, wgu, wd, bgu, bd, lo = tuple(cast(v, torch.float32) for v in args)
    stats_ref = torch.tensor([1.0, 2.0])  # routing stats (experts hit, calls) add up
    expected = reference.fused_experts(xe, weights, ids, wgu, wd, act, bgu, bd, lo, limit, stats_ref)
    xg, wgu, wd, bgu, bd, lo = (cast(v, dtype, DEVICE) for v in args)
    stats = torch.tensor([1.0, 2.0], device=DEVICE)
    # On a GPU, odd token counts run the gate/up adapter deltas on a side stream.
    side = torch.cuda.Stream() if str(DEVICE).startswith("cuda") and t % 2 else None
    with ops.using_backend("triton"):
        out = ops.fused_experts(xg, weights.to(DEVICE), ids.to(DEVICE), wgu, wd, act, bgu, bd, lo, limit,
                                stats, side)
    assert stats.cpu().tolist() == stats_ref.tolist() == [1 + len(ids.unique()), 3]
    assert out.dtype == dtype and out.shape == (t, h)
    if t == 3:  # unsummed: each token's top_k terms, as the model's next norm sums them
        with ops.using_backend("triton"):
            terms = ops.fused_experts(xg, weights.to(DEVICE), ids.to(DEVICE), wgu, wd, act, bgu, bd, lo,
                                      limit, sum_topk=False)
        xe, wgu, wd, bgu, bd, lo = ref_args
        terms_ref = reference.fused_experts(xe, weights, ids, wgu, wd, act, bgu, bd, lo, limit,
                                            sum_topk=False)
        assert terms.shape == (t, 2 * k if with_lora == "gemv" else k, h)
        terms = pair_terms(terms, k)
        assert terms.shape == terms_ref.shape == (t, k, h)
        assert (terms.cpu().float() - terms_ref).norm() / terms_ref.norm() <= REL_TOL[dtype]
        assert (terms_ref.sum(1) - expected).norm() / expected.norm() <= 1e-5
    err = (out.cpu().float() - expected).norm() / expected.norm()
    assert err <= REL_TOL[dtype], err


def test_tuned_config_files(tmp_path, monkeypatch):
    name = moe_configs.config_file_name("NVIDIA_H200", 128, 1536, 2048, torch.bfloat16)
    assert name == "moe_gemm_NVIDIA_H200_E128_N1536_K2048_bfloat16.json"
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
    table = {1: cfg, 64: {**cfg, "BLOCK_M": 32}, 512: {**cfg, "BLOCK_M": 64, "GROUP_M": 16}}
    moe_configs.save_configs(tmp_path / name, table)
    assert json.loads((tmp_path / name).read_text())["64"]["BLOCK_M"] == 32
    monkeypatch.setenv(moe_configs.ENV_VAR, str(tmp_path))
    moe_configs.load_configs.cache_clear()
    loaded = moe_configs.load_configs(name)
    assert loaded == table
    # A later run for other token counts keeps these entries; the same count is replaced.
    moe_configs.save_configs(tmp_path / name, {64: cfg, 4096: {**cfg, "BLOCK_M": 128}})
    moe_configs.load_configs.cache_clear()
    assert moe_configs.load_configs(name) == {**table, 64: cfg, 4096: {**cfg, "BLOCK_M": 128}}
    (tmp_path / name).unlink()
    moe_configs.save_configs(tmp_path / name, table)
    moe_configs.load_configs.cache_clear()
    loaded = moe_configs.load_configs(name)
    assert moe_configs.nearest(loaded, 20)["BLOCK_M"] == 16
    assert moe_configs.nearest(loaded, 40)["BLOCK_M"] == 32
    assert moe_configs.nearest(loaded, 10_000)["GROUP_M"] == 16
    assert moe_configs.load_configs("moe_gemm_none.json") is None
    moe_configs.load_configs.cache_clear()
    # CPU weights never read tuned files: the default table by pairs per expert.
    w = torch.empty(8, 48, 40)
    assert moe_configs.tuned_config(w, 4) is None
    assert fused_moe.gemm_config(w, 4, 2)["BLOCK_M"] == 16
    assert fused_moe.gemm_config(w, 1000, 2)["BLOCK_M"] == 64


@pytest.mark.parametrize("bad,named", [
    ({"SPLIT_K": 0}, "SPLIT_K = 0"), ({"BLOCK_N": 48}, "BLOCK_N = 48"), ({"num_warps": 64}, "num_warps = 64"),
    ({"num_stages": -1}, "num_stages = -1"), ({"GROUP_M": "x"}, "GROUP_M")])
def test_tuned_config_values_are_checked_at_load(tmp_path, monkeypatch, bad, named):
    """A config file with a value no kernel can run fails as it loads (the engine's warm-up,
    at startup), naming the file and the value, not later as a division by zero or a
    compile error in a step."""
    from loraplex.errors import ModelLoadError
    from loraplex.ops.triton import fp8_configs

    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3, SPLIT_K=2)
    name = "fp8_gemm_NVIDIA_H200_N64_K128_bfloat16.json"
    (tmp_path / name).write_text(json.dumps({"16": cfg, "32": {**cfg, **bad}}))
    monkeypatch.setenv(moe_configs.ENV_VAR, str(tmp_path))
    moe_configs.load_configs.cache_clear()
    try:
        with pytest.raises(ModelLoadError, match=named) as e:
            moe_configs.load_configs(name, fp8_configs.KEYS, fp8_configs.OPTIONAL)
        assert name in str(e.value)
        (tmp_path / name).write_text(json.dumps({"0": cfg}))
        moe_configs.load_configs.cache_clear()
        with pytest.raises(ModelLoadError, match="token count 0"):
            moe_configs.load_configs(name, fp8_configs.KEYS, fp8_configs.OPTIONAL)
    finally:
        moe_configs.load_configs.cache_clear()


def test_moe_warm_up_covers_every_config_a_step_can_pick(monkeypatch):
    """The engine compiles the expert kernels at start for one token count per distinct
    (gate/up config, down config, expert-LoRA form); every count up to the step budget
    must pick a combination one of them ran, with a multiple of 16 among them wherever
    one exists (Triton specializes on divisibility by 16)."""
    from loraplex.ops.triton import moe_gemm

    tuned = {16: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=4),
             2048: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)}
    monkeypatch.setattr(moe_gemm, "tuned_config",
                        lambda w, t, top_k: dict(tuned[m]) if (m := min(tuned, key=lambda m: abs(m - t)))
                        / 2 <= t <= 2 * m else None)
    w_gu, w_d = torch.empty(128, 1536, 2048), torch.empty(128, 2048, 768)
    max_tokens = 5000

    def choice(t):
        return (moe_gemm.gemm_config(w_gu, t, 8), moe_gemm.gemm_config(w_d, t, 8),
                fused_moe.lora_form(t, 8, w_gu.device))

    counts = fused_moe.warm_up_token_counts(w_gu, w_d, 8, max_tokens)
    assert all(1 <= t <= max_tokens for t in counts) and len(counts) < 30
    warmed = [choice(t) for t in counts]
    for t in range(1, max_tokens + 1):
        assert choice(t) in warmed, t
    for c in {str(x) for x in warmed}:
        group = [t for t in range(1, max_tokens + 1) if str(choice(t)) == c]
        if any(t % 16 == 0 for t in group):
            assert any(t % 16 == 0 for t in counts if str(choice(t)) == c)


def test_moe_warm_up_runs_and_changes_nothing():
    gen = torch.Generator().manual_seed(9)
    e, h, i, t = 4, 16, 8, 3
    w_gu = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(DEVICE)
    w_d = (torch.randn(e, h, i, generator=gen) / i**0.5).to(DEVICE)
    lora = make_lora(e, h, i, t, gen, with_ranks=True)
    lora = MoELoRA(*(f.to(DEVICE) for f in (lora.a_gate_up, lora.b_gate_up, lora.a_down, lora.b_down,
                                            lora.token_slot, lora.slot_mask, lora.ranks)))
    before = [w.clone() for w in (w_gu, w_d, lora.a_gate_up, lora.b_down)]
    with ops.using_backend("triton"):
        ops.warm_up_moe(w_gu, w_d, 2, True, "silu", None, None, lora, None, max_tokens=24)
    assert all(torch.equal(a, b) for a, b in zip(before, (w_gu, w_d, lora.a_gate_up, lora.b_down)))


def test_tuner_candidates():
    small = tune_moe.candidates(1, 8, 128, fused=True)
    large = tune_moe.candidates(4096, 8, 128, fused=True)
    assert small and large
    assert {c["BLOCK_M"] for c in small} == {16} and {c["BLOCK_M"] for c in large} == {64, 128}
    for fused, cands in ((True, small + large), (False, tune_moe.candidates(256, 2, 8))):
        for c in cands:
            assert set(c) == set(moe_configs.CONFIG_KEYS)
            assert min(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) >= 16  # tl.dot on a GPU
            tiles = c["BLOCK_M"] * c["BLOCK_K"] + c["BLOCK_K"] * c["BLOCK_N"] * (1 + fused)
            assert c["num_stages"] * tiles * 2 <= tune_moe.SMEM_BYTES  # bf16 stages fit
    assert all(c["GROUP_M"] == 1 for c in small)


@pytest.mark.parametrize("t,e,k,renorm", [(1, 8, 2, True), (5, 128, 8, True), (7, 32, 4, False),
                                          (3, 6, 3, True), (0, 8, 2, True)])
def test_route_experts(t, e, k, renorm):
    """Softmax, top-k and renormalisation in one kernel equal the torch reference, from
    float32 and bf16 logits."""
    gen = torch.Generator().manual_seed(t * 10 + e)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(t, e, generator=gen) * 3).to(dtype)
        want_w, want_ids = reference.route_experts(logits, k, renorm)
        with ops.using_backend("triton"):
            w, ids = ops.route_experts(logits.to(DEVICE), k, renorm)
        assert ids.dtype == torch.int32 and w.dtype == torch.float32
        # bf16 logits tie: tied experts may come in another order (the sum is the same)
        order, want_order = ids.cpu().sort(-1), want_ids.sort(-1)
        assert torch.equal(order.values, want_order.values)
        torch.testing.assert_close(w.cpu().gather(-1, order.indices), want_w.gather(-1, want_order.indices),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("p, width", [(13, 40), (9, 1100)])  # width past one column block
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_weighted_forward_backward(p, width, dtype):
    """The MoE training activation kernel against its oracle, forward and backward: rows
    read their routing weight through `order` and the weight's gradient lands back there."""
    import loraplex.ops.triton as kernel
    from loraplex.ops.reference import train_moe as ref

    gen = torch.Generator().manual_seed(p + width)
    rnd = lambda *s: (torch.randn(*s, generator=gen) * 2).to(DEVICE, dtype)  # noqa: E731
    gate_up, w, g = rnd(p, 2 * width), rnd(p).abs(), rnd(p, width)
    order = torch.randperm(p, generator=gen).to(DEVICE)
    tol = REL_TOL[dtype]
    h = kernel.silu_mul_weighted(gate_up, w, order)
    want = ref.silu_mul_weighted(gate_up, w, order)
    torch.testing.assert_close(h.float(), want.float(), rtol=tol, atol=tol)
    d_gu, d_w = kernel.silu_mul_weighted_backward(g, gate_up, w, order)
    r_gu, r_w = ref.silu_mul_weighted_backward(g, gate_up, w, order)
    assert d_w.dtype == w.dtype and not d_gu.isnan().any()
    torch.testing.assert_close(d_gu.float(), r_gu.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(d_w.float(), r_w.float(), rtol=tol, atol=tol * r_w.abs().max().item())
    # the oracle's backward is autograd's of its forward (float32)
    x, wx = gate_up.float().cpu().requires_grad_(), w.float().cpu().requires_grad_()
    ref.silu_mul_weighted(x, wx, order.cpu()).backward(g.float().cpu())
    r_gu32, r_w32 = ref.silu_mul_weighted_backward(g.float().cpu(), gate_up.float().cpu(), w.float().cpu(),
                                                   order.cpu())
    torch.testing.assert_close(r_gu32, x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r_w32, wx.grad, rtol=1e-5, atol=1e-4)
    # with pad: the same values in the first columns of wider rows, the pad left alone
    h_pad = kernel.silu_mul_weighted(gate_up, w, order, pad=8)
    d_pad, _ = kernel.silu_mul_weighted_backward(g, gate_up, w, order, pad=8)
    assert h_pad.shape == (p, width + 8) and d_pad.shape == (p, 2 * width + 8)
    assert torch.equal(h_pad[:, :width], h) and torch.equal(d_pad[:, :2 * width], d_gu)


@pytest.mark.parametrize("t, k, width", [(7, 3, 70), (5, 8, 2500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_rows_by_token(t, k, width, dtype):
    import loraplex.ops.triton as kernel
    from loraplex.ops.reference import train_moe as ref

    gen = torch.Generator().manual_seed(t * k)
    rows = torch.randn(t * k, width, generator=gen).to(DEVICE, dtype)
    inv = torch.randperm(t * k, generator=gen).to(DEVICE)
    got = kernel.sum_rows_by_token(rows, inv, k)
    tol = REL_TOL[dtype]
    torch.testing.assert_close(got.float(), ref.sum_rows_by_token(rows, inv, k).float(), rtol=tol, atol=tol)
    want = rows.float()[inv.view(t, k)].sum(1)
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("t, k, width, extra", [(7, 3, 70, 0), (5, 8, 2500, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_rows_to_pairs(t, k, width, extra, dtype):
    """Each token's row lands on its k sorted rows (the gather before the expert GEMMs),
    in rows `extra` wider; the oracle is x[tokens]."""
    import loraplex.ops.triton as kernel
    from loraplex.ops.reference import train_moe as ref

    gen = torch.Generator().manual_seed(t * k + extra)
    x = torch.randn(t, width, generator=gen).to(DEVICE, dtype)
    inv = torch.randperm(t * k, generator=gen).to(DEVICE)  # flat pair -> sorted row
    tokens = torch.empty_like(inv)
    tokens[inv] = torch.arange(t * k, device=DEVICE) // k  # sorted row -> its token
    got = kernel.copy_rows_to_pairs(x, inv, k, extra)
    assert got.shape == (t * k, width + extra)
    assert torch.equal(got[:, :width], x[tokens])
    assert torch.equal(ref.copy_rows_to_pairs(x, inv, k, extra)[:, :width], x[tokens])


@pytest.mark.parametrize("counts, n_cols, rank", [
    ([5, 0, 70, 1, 0, 20], 96, 4),  # blocks crossing experts, empty experts, a 64-row block in one
    ([0, 3, 0, 0], 300, 16),  # ragged columns, leading and trailing empty experts
    ([130], 128, 8),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_lora_add(counts, n_cols, rank, dtype):
    """y[rows of expert e] += s * xa[rows] @ b[e] in place, against the oracle; b a
    transposed view (as training passes it)."""
    import loraplex.ops.triton as kernel
    from loraplex.ops.reference import train_moe as ref

    gen = torch.Generator().manual_seed(len(counts) * n_cols + rank)
    p, e = sum(counts), len(counts)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32).to(DEVICE)
    y0 = torch.randn(p, n_cols, generator=gen).to(DEVICE, dtype)
    xa = torch.randn(p, rank, generator=gen).to(DEVICE, dtype)
    b = torch.randn(e, n_cols, rank, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    got, want = y0.clone(), y0.clone()
    kernel.grouped_lora_add(got, xa, b, ends, 0.5)
    ref.grouped_lora_add(want, xa, b, ends, 0.5)
    tol = REL_TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 4)
    start = 0
    for i, end in enumerate(ends.tolist()):  # the oracle against a plain product
        plain = y0[start:end].float() + 0.5 * xa[start:end].float() @ b[i].float()
        torch.testing.assert_close(want[start:end].float(), plain, rtol=tol, atol=tol * 4)
        start = end


def test_epilogue_operands_come_before_the_loop_in_decode_tiles_without_a_chain():
    """The grouped GEMMs load bias, routing weights and dense deltas before their main loop
    in decode-sized tiles; a sparse delta (slot -> mask -> row) and prompt-sized tiles after."""
    assert moe_epilogue.operands_first(sparse_delta=False, block_m=16)
    assert not moe_epilogue.operands_first(sparse_delta=True, block_m=16)
    assert not moe_epilogue.operands_first(sparse_delta=False, block_m=64)


def decode_case(t, e, k, h, i, seed):
    """A decode-sized MoE step on DEVICE: (generator, x, routing weights (CPU), ids (CPU),
    w_gate_up, w_down, adapters (make_lora's))."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(DEVICE)
    weights, ids = reference.route_experts(torch.randn(t, e, generator=gen), k, renormalize=True)
    w_gu = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(DEVICE)
    w_d = (torch.randn(e, h, i, generator=gen) / i**0.5).to(DEVICE)
    lora = make_lora(e, h, i, t, gen)
    lora = MoELoRA(*(getattr(lora, f.name).to(DEVICE) for f in dataclasses.fields(MoELoRA)))
    return gen, x, weights, ids, w_gu, w_d, lora


def test_down_deltas_are_terms_of_the_sum_beside_the_down_gemm(monkeypatch):
    """Decode-sized steps: the down GEMM gets no delta (its adapter kernel need not run
    first); the adapter kernel writes every pair's delta times its routing weight (zeros
    without an adapter) as a term of its own, after the pair's GEMM row; the terms add up
    to the reference's, and the sum to the epilogue form's. The gate/up delta's kernel
    writes every row too (the GEMM reads each pair's without its slot)."""
    t, e, k, h, i = 5, 4, 2, 40, 24
    gen, x, weights, ids, w_gu, w_d, lora = decode_case(t, e, k, h, i, seed=7)
    fields = [f.name for f in dataclasses.fields(MoELoRA)]
    down_deltas = []
    gemm, lora_gemv = fused_moe._expert_gemm, fused_moe.moe_lora_gemv

    def expert_gemm(a, w, *args, delta=None, **kw):
        if w is w_d:
            down_deltas.append(delta)
        return gemm(a, w, *args, delta=delta, **kw)

    def lora_kernel(inp, *args, **kw):
        args[6].fill_(float("nan"))  # every row must be written
        lora_gemv(inp, *args, **kw)

    monkeypatch.setattr(fused_moe, "_expert_gemm", expert_gemm)
    monkeypatch.setattr(fused_moe, "moe_lora_gemv", lora_kernel)
    monkeypatch.setattr(fused_moe, "GEMV_MAX_TOKENS", 64)
    args = (x, weights.to(DEVICE), ids.to(DEVICE), w_gu, w_d, "silu", None, None, lora)
    with ops.using_backend("triton"):
        terms = ops.fused_experts(*args, sum_topk=False)
        summed = ops.fused_experts(*args)
        monkeypatch.setattr(fused_moe, "DOWN_DELTA_AS_TERMS", False)
        in_epilogue = ops.fused_experts(*args)
    assert down_deltas[:2] == [None, None] and down_deltas[2] is not None
    assert terms.shape == (t, 2 * k, h) and torch.isfinite(terms).all()
    slot = lora.token_slot.cpu()
    covered = (slot >= 0) & (lora.slot_mask.cpu()[slot.clamp(min=0)] != 0)
    deltas = terms[:, 1::2].cpu()
    assert (deltas[~covered] == 0).all() and (deltas[covered] != 0).any()
    cpu_lora = MoELoRA(*(getattr(lora, f).cpu() for f in fields))
    ref_args = (x.cpu(), weights, ids, w_gu.cpu(), w_d.cpu(), "silu", None, None, cpu_lora)
    ref_terms = reference.fused_experts(*ref_args, sum_topk=False)
    assert (pair_terms(terms, k).cpu() - ref_terms).norm() / ref_terms.norm() <= REL_TOL[torch.float32]
    torch.testing.assert_close(summed, in_epilogue, rtol=1e-5, atol=1e-5)
    expected = reference.fused_experts(*ref_args)
    assert (summed.cpu() - expected).norm() / expected.norm() <= REL_TOL[torch.float32]


def test_gate_up_delta_joins_after_the_gate_up_gemm(monkeypatch):
    """Where the gate/up delta runs beside the gate/up GEMM (W8A8 experts in decode-sized
    steps; forced here for bf16 ones) the GEMM takes no delta and writes its float32 sums
    (gate | up, bias included); gated_act_rows then adds the delta and applies the
    activation. The output is the epilogue form's (the switch off), and the reference's."""
    assert not fused_moe.gate_up_delta_beside(torch.empty(4, 48, 40), 5)  # bf16 / fp32 experts: before
    monkeypatch.setattr(fused_moe, "gate_up_delta_beside",
                        lambda w, t: fused_moe.GATE_UP_DELTA_BESIDE_GEMM)
    t, e, k, h, i = 5, 4, 2, 40, 24
    gen, x, weights, ids, w_gu, w_d, lora = decode_case(t, e, k, h, i, seed=11)
    b_gu, b_d = torch.randn(e, 2 * i, generator=gen).to(DEVICE), torch.randn(e, h, generator=gen).to(DEVICE)
    fields = [f.name for f in dataclasses.fields(MoELoRA)]
    gate_up_calls = []
    gemm = fused_moe._expert_gemm

    def expert_gemm(a, w, bias, out, *args, **kw):
        if w is w_gu:
            gate_up_calls.append((out.shape, out.dtype, kw.get("delta"), kw.get("activation")))
        return gemm(a, w, bias, out, *args, **kw)

    monkeypatch.setattr(fused_moe, "_expert_gemm", expert_gemm)
    monkeypatch.setattr(fused_moe, "GEMV_MAX_TOKENS", 64)
    args = (x, weights.to(DEVICE), ids.to(DEVICE), w_gu, w_d, "swiglu_oai", b_gu, b_d, lora, 3.0)
    with ops.using_backend("triton"):
        after = ops.fused_experts(*args)
        monkeypatch.setattr(fused_moe, "GATE_UP_DELTA_BESIDE_GEMM", False)
        in_epilogue = ops.fused_experts(*args)
    assert gate_up_calls[0] == ((t * k, 2 * i), torch.float32, None, None)
    assert gate_up_calls[1][2] is not None and gate_up_calls[1][3] == "swiglu_oai"
    torch.testing.assert_close(after, in_epilogue, rtol=1e-5, atol=1e-5)
    cpu_lora = MoELoRA(*(getattr(lora, f).cpu() for f in fields))
    expected = reference.fused_experts(x.cpu(), weights, ids, w_gu.cpu(), w_d.cpu(), "swiglu_oai", b_gu.cpu(),
                                       b_d.cpu(), cpu_lora, 3.0)
    assert (after.cpu() - expected).norm() / expected.norm() <= REL_TOL[torch.float32]


@pytest.mark.parametrize("form", ["deltas", "every_row", "terms", "shrink"])
def test_expert_lora_gemv_against_torch(monkeypatch, form):
    """The decode expert-LoRA kernel against a plain-torch reference, with tiles small
    enough that each pair's K and N take several (the last one short) and two programs a
    pair split N: ranks and slot masks honoured; rows of pairs without an adapter left
    alone, or zeros (every_row; terms: times the routing weight, bf16); the shrink alone
    writes the [R] rows."""
    monkeypatch.setattr(moe_lora_gemv, "A_TILE", 16 * 16)  # rank 16: BLOCK_K 16
    monkeypatch.setattr(moe_lora_gemv, "B_TILE", 16 * 8)  # BLOCK_N 8
    monkeypatch.setattr(moe_lora_gemv, "splits_per_pair", lambda *_: 2)
    t, e, k, h, i = 6, 4, 2, 72, 36
    gen = torch.Generator().manual_seed(5)
    lora = make_lora(e, h, i, t, gen)
    x = torch.randn(t, h, generator=gen)
    _, ids = reference.route_experts(torch.randn(t, e, generator=gen), k, renormalize=True)
    weights = torch.rand(t * k, generator=gen)
    slot = lora.token_slot.long()
    covered = (slot >= 0) & (lora.slot_mask[slot.clamp(min=0)] != 0)
    pair_slot, pair_expert = slot.repeat_interleave(k).clamp(min=0), ids.flatten().long()
    a = lora.a_gate_up[pair_slot, pair_expert]  # [P, R, H]
    b = lora.b_gate_up[pair_slot, pair_expert]  # [P, 2I, R]
    shrunk = torch.einsum("ph,prh->pr", x.repeat_interleave(k, 0), a)
    expected = torch.einsum("pr,pnr->pn", shrunk, b)
    live = covered.repeat_interleave(k)
    width = 2 * i if form != "shrink" else 16
    dtype = torch.bfloat16 if form == "terms" else torch.float32
    delta = torch.full((t * k, width), 7.0, dtype=dtype)
    args = [x, ids, lora.token_slot, lora.slot_mask, lora.ranks[0], lora.a_gate_up,
            None if form == "shrink" else lora.b_gate_up]
    dev = [v.to(DEVICE) if v is not None else None for v in args]
    out = delta.to(DEVICE)
    moe_lora_gemv.moe_lora_gemv(*dev, out, k, weights.to(DEVICE) if form == "terms" else None,
                                all_rows=form == "every_row")
    out = out.cpu().float()
    if form == "shrink":
        expected = shrunk
    if form == "terms":
        expected = expected * weights[:, None]
    tol = 1e-2 if form == "terms" else 1e-5
    torch.testing.assert_close(out[live], expected[live], rtol=tol, atol=tol)
    dead = {"deltas": 7.0, "shrink": 7.0, "every_row": 0.0, "terms": 0.0}[form]
    assert (out[~live] == dead).all()
