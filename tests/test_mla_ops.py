"""ops.mla_attention (latent attention, kv_b_proj absorbed) against the plain expansion it
stands for: every context latent through kv_b_proj (+ its adapter) into per-head keys and
values, then softmax attention. The reference op, and the Triton decode kernel (under
TRITON_INTERPRET on CPU) with splits, padding sequences and adapters mixed with base rows."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DEVICE

from loraplex import ops
from loraplex.ops.metadata import AttentionBatch, MLALoRA, make_lora_batch

H, NOPE, ROPE, V, RANK, R = 4, 16, 8, 12, 32, 4  # heads, dims, latent, adapter rank


def _naive(q_nope, q_pe, latents, kpes, w_kv_b, scale, a=None, b=None):
    """One token's heads over its context: keys/values expanded from the latents."""
    w = w_kv_b if a is None else w_kv_b + b @ a  # [H * (NOPE + V), RANK]
    kv = (latents @ w.T).view(-1, H, NOPE + V)
    k_nope, v = kv.split((NOPE, V), -1)
    scores = (torch.einsum("hn,khn->hk", q_nope, k_nope) + torch.einsum("hd,kd->hk", q_pe, kpes)) * scale
    return torch.einsum("hk,khv->hv", scores.softmax(-1), v)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("max_splits", [1, 3])
def test_decode_matches_the_expanded_attention(backend, max_splits, monkeypatch):
    from loraplex.ops.triton import mla_decode

    monkeypatch.setattr(mla_decode, "PARTITION_SIZE", 32)
    monkeypatch.setattr(mla_decode, "MAX_SPLITS", max_splits)
    if max_splits > 1:  # the adapter kernels' rows in several chunks too
        from loraplex.ops.triton import mla_lora

        monkeypatch.setattr(mla_lora, "BLOCK_IN", 8)
        monkeypatch.setattr(mla_lora, "BLOCK_LAT", 16)
    gen = torch.Generator().manual_seed(0)
    page = 4
    contexts = [5, 1, 70, 0, 33, 12]  # 0: a CUDA graph's padding sequence (no context)
    slots = [0, -1, 1, -1, 0, -1]  # adapters mixed with base rows
    num_pages = sum(math.ceil(c / page) for c in contexts) + 2
    cache = torch.randn(num_pages, page, RANK + ROPE, generator=gen)
    free = torch.randperm(num_pages, generator=gen).tolist()
    tables = [[free.pop() for _ in range(math.ceil(c / page))] for c in contexts]
    width = 20  # as wide as a graph's table
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    n = len(contexts)
    q_nope, q_pe = torch.randn(n, H, NOPE, generator=gen), torch.randn(n, H, ROPE, generator=gen)
    w_kv_b = torch.randn(H * (NOPE + V), RANK, generator=gen) * 0.3
    a = torch.randn(2, R, RANK, generator=gen) * 0.3  # two slots
    b = torch.randn(2, H * (NOPE + V), R, generator=gen) * 0.3
    dev = dict(device=DEVICE)
    batch = AttentionBatch(
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, **dev),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, **dev),
        seq_lens=torch.tensor(contexts, dtype=torch.int32, **dev), block_tables=table.to(**dev),
        query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=contexts, max_query_len=1,
        max_seq_len=max(contexts))
    bv = b.view(2, H, NOPE + V, R)
    lora = MLALoRA(a.to(**dev), bv[:, :, :NOPE].to(**dev), bv[:, :, NOPE:].to(**dev),
                   make_lora_batch(slots, [R, R], 2, DEVICE))
    w = w_kv_b.view(H, NOPE + V, RANK)
    scale = 0.3
    with ops.using_backend(backend):
        out = ops.mla_attention(q_nope.to(**dev), q_pe.to(**dev), cache.to(**dev), w[:, :NOPE].to(**dev),
                                w[:, NOPE:].to(**dev), batch, scale, lora).cpu()
    for i, (ctx, slot) in enumerate(zip(contexts, slots)):
        if ctx == 0:
            assert torch.equal(out[i], torch.zeros(H, V))
            continue
        rows = cache[torch.tensor(tables[i])].reshape(-1, RANK + ROPE)[:ctx]
        adapter = (a[slot], b[slot]) if slot >= 0 else ()
        want = _naive(q_nope[i], q_pe[i], rows[:, :RANK], rows[:, RANK:], w_kv_b, scale, *adapter)
        torch.testing.assert_close(out[i], want, atol=2e-5, rtol=2e-5)
    splits = mla_decode.num_splits(batch, page, H)
    assert splits == min(max_splits, math.ceil(width * page / 32))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunks_match_the_expanded_attention(backend):
    """Steps of longer chunks (prefill after cached context, verification): each query
    token sees its context up to itself; the Triton backend expands keys and values."""
    gen = torch.Generator().manual_seed(1)
    page = 4
    seqs = [(3, 5), (0, 9), (12, 2), (0, 0)]  # (cached tokens, new tokens); an empty sequence
    slots = [1, -1, 0, -1]
    num_pages = sum(math.ceil((c + n) / page) for c, n in seqs) + 1
    cache = torch.randn(num_pages, page, RANK + ROPE, generator=gen)
    free = torch.randperm(num_pages, generator=gen).tolist()
    tables = [[free.pop() for _ in range(math.ceil((c + n) / page))] for c, n in seqs]
    table = torch.tensor([t + [0] * (8 - len(t)) for t in tables], dtype=torch.int32)
    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    t = qsl[-1]
    q_nope, q_pe = torch.randn(t, H, NOPE, generator=gen), torch.randn(t, H, ROPE, generator=gen)
    w_kv_b = torch.randn(H * (NOPE + V), RANK, generator=gen) * 0.3
    a = torch.randn(2, R, RANK, generator=gen) * 0.3
    b = torch.randn(2, H * (NOPE + V), R, generator=gen) * 0.3
    lens = [c + n for c, n in seqs]
    dev = dict(device=DEVICE)
    batch = AttentionBatch(
        slot_mapping=torch.full((t,), -1, dtype=torch.int64, **dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, **dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, **dev), block_tables=table.to(**dev),
        query_start_loc_cpu=qsl, seq_lens_cpu=lens, max_query_len=9, max_seq_len=max(lens))
    token_slots = [s for s, (_, n) in zip(slots, seqs) for _ in range(n)]
    bv = b.view(2, H, NOPE + V, R)
    lora = MLALoRA(a.to(**dev), bv[:, :, :NOPE].to(**dev), bv[:, :, NOPE:].to(**dev),
                   make_lora_batch(token_slots, [R, R], 2, DEVICE))
    w = w_kv_b.view(H, NOPE + V, RANK)
    with ops.using_backend(backend):
        out = ops.mla_attention(q_nope.to(**dev), q_pe.to(**dev), cache.to(**dev), w[:, :NOPE].to(**dev),
                                w[:, NOPE:].to(**dev), batch, 0.3, lora).cpu()
    for i, ((cached, n), slot) in enumerate(zip(seqs, slots)):
        rows = cache[torch.tensor(tables[i], dtype=torch.long)].reshape(-1, RANK + ROPE)
        adapter = (a[slot], b[slot]) if slot >= 0 else ()
        for j in range(n):  # token j of the chunk sees cached + j + 1 keys
            ctx = rows[: cached + j + 1]
            want = _naive(q_nope[qsl[i] + j], q_pe[qsl[i] + j], ctx[:, :RANK], ctx[:, RANK:], w_kv_b, 0.3,
                          *adapter)
            torch.testing.assert_close(out[qsl[i] + j], want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_latent_rows_land_in_their_slots(backend):
    """ops.write_latent_cache: each token's row at its slot (page * PAGE + offset, the cache
    in its own dtype); padding tokens (slot -1) write nothing."""
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(5, 4, RANK + ROPE, generator=gen).to(DEVICE)
    before = cache.clone()
    latent = torch.randn(6, RANK + ROPE, generator=gen).to(DEVICE)
    slots = torch.tensor([7, -1, 0, 19, -1, 12], device=DEVICE)
    with ops.using_backend(backend):
        ops.write_latent_cache(latent, cache, slots)
    want = before.view(-1, RANK + ROPE).clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[s] = latent[t]
    assert torch.equal(cache.view(-1, RANK + ROPE), want)
