"""Every op of every available backend against a naive per-token loop, on awkward shapes
and over adapter popularity: distinct, uniform, Zipf, identical, none."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DEVICE

from loraplex import ops
from loraplex.ops import reference
from loraplex.ops.metadata import AttentionBatch, LoRABatch, QKNorm, make_lora_batch
from loraplex.ops.reference.quant import quantize_activations
from loraplex.ops.triton.precision import INTERPRETED

BACKENDS = ["torch", "triton"]
POPULARITY = ["distinct", "uniform", "zipf", "identical", "none", "mixed-with-base"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    prev = ops.backend_name()
    ops.use_backend(request.param)
    yield request.param
    ops.use_backend(prev)


def token_slots(kind: str, num_tokens: int, num_slots: int, gen: torch.Generator) -> list[int]:
    if kind == "distinct":
        return [i % num_slots for i in range(num_tokens)]
    if kind == "uniform":
        return torch.randint(0, num_slots, (num_tokens,), generator=gen).tolist()
    if kind == "zipf":
        w = 1.0 / torch.arange(1, num_slots + 1, dtype=torch.float64)
        return torch.multinomial(w, num_tokens, replacement=True, generator=gen).tolist()
    if kind == "identical":
        return [num_slots - 1] * num_tokens
    if kind == "none":
        return [-1] * num_tokens
    return torch.randint(-1, num_slots, (num_tokens,), generator=gen).tolist()


def lora_batch(slots: list[int], ranks: list[int], max_loras: int) -> LoRABatch:
    return make_lora_batch(slots, ranks, max_loras, DEVICE)


LORA_SHAPES = [(1, 64, (48,)), (37, 72, (40, 24, 24)), (130, 33, (17, 51)), (300, 24, (16, 8))]
# Relative error allowed against a float64 loop: float32 math, or bf16 operands.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("num_tokens,in_f,sizes", LORA_SHAPES)
def test_lora_shrink_expand(backend, popularity, num_tokens, in_f, sizes):
    check_lora_shrink_expand(popularity, num_tokens, in_f, sizes)


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("num_tokens,in_f,sizes", LORA_SHAPES)
@pytest.mark.parametrize("form", ["gemv", "sgmv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_kernel_forms(popularity, num_tokens, in_f, sizes, form, dtype):
    """Each Triton form on every shape, whichever the dispatcher would pick: per-token
    GEMV and segmented GEMM (whose tiles are found on the device)."""
    from loraplex.ops import triton as kernels

    shrink = kernels.lora_shrink_gemv if form == "gemv" else kernels.lora_shrink_sgmv
    expand = kernels.lora_expand_gemv if form == "gemv" else kernels.lora_expand_sgmv
    check_lora_shrink_expand(popularity, num_tokens, in_f, sizes, shrink, expand, dtype)


def check_lora_shrink_expand(popularity, num_tokens, in_f, sizes, shrink=None, expand=None,
                             dtype=torch.float32):
    shrink = shrink or ops.lora_shrink
    expand = expand or ops.lora_expand
    gen = torch.Generator().manual_seed(num_tokens * 7 + len(sizes))
    max_loras, max_rank = 5, 16
    ranks = [16, 8, 3, 1, 12]
    slots = token_slots(popularity, num_tokens, max_loras, gen)
    a = torch.zeros(len(sizes), max_loras, max_rank, in_f)
    b = torch.zeros(max_loras, sum(sizes), max_rank)
    for s, r in enumerate(ranks):  # columns past an adapter's rank stay zero, as in slots
        a[:, s, :r] = torch.randn(len(sizes), r, in_f, generator=gen)
        b[s, :, :r] = torch.randn(sum(sizes), r, generator=gen)
    x = torch.randn(num_tokens, in_f, generator=gen)
    y0 = torch.randn(num_tokens, sum(sizes), generator=gen)
    a, b, x, y0 = (t.to(dtype) for t in (a, b, x, y0))  # the oracle sees the same values

    expected = y0.clone().double()
    for t, slot in enumerate(slots):
        if slot >= 0:
            for s in range(len(sizes)):
                rows = slice(sum(sizes[:s]), sum(sizes[: s + 1]))
                delta = (x[t].double() @ a[s, slot].double().T) @ b[slot, rows].double().T
                expected[t, rows] += delta

    dev = dict(device=DEVICE)
    batch = lora_batch(slots, ranks, max_loras)
    y = y0.clone().to(**dev)  # a copy on CPU too: y0 stays the original
    buf = shrink(x.to(**dev), a.to(**dev), batch)
    assert buf.shape == (len(sizes), num_tokens, max_rank) and buf.dtype == torch.float32
    expand(buf, b.to(**dev), y, sizes, batch)
    err = (y.double().cpu() - expected).norm() / expected.norm()
    assert err <= REL_TOL[dtype], err
    base = torch.tensor([s < 0 for s in slots])
    assert torch.equal(y.cpu()[base], y0[base]), "tokens without an adapter must not change"


def slot_b(ranks: list[int], rows: int, max_rank: int, gen: torch.Generator) -> torch.Tensor:
    """B of one slot per rank, [slots, rows, max_rank], random up to each slot's rank and
    zero past it, as adapter slots keep it."""
    b = torch.zeros(len(ranks), rows, max_rank)
    for s, r in enumerate(ranks):
        b[s, :, :r] = torch.randn(rows, r, generator=gen)
    return b


ACT_SHAPES = [(1, 48, "silu"), (37, 40, "gelu_tanh"), (130, 24, "silu"), (300, 16, "gelu_tanh")]


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("num_tokens,width,activation", ACT_SHAPES)
def test_lora_act_and_mul(backend, popularity, num_tokens, width, activation):
    check_lora_act_and_mul(popularity, num_tokens, width, activation)


@pytest.mark.parametrize("popularity", ["distinct", "zipf", "mixed-with-base", "none"])
@pytest.mark.parametrize("num_tokens,width,activation", ACT_SHAPES)
@pytest.mark.parametrize("form", ["gemv", "sgmv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_act_kernel_forms(popularity, num_tokens, width, activation, form, dtype):
    """Both Triton forms of the expand fused into the gated activation, on every shape:
    per-token GEMV, and tiles of adapter groups followed by the base tokens' tiles."""
    from loraplex.ops import triton as kernels

    fused = kernels.lora_act_gemv if form == "gemv" else kernels.lora_act_sgmv
    check_lora_act_and_mul(popularity, num_tokens, width, activation, fused, dtype)


@pytest.mark.parametrize("num_tokens", [7, 130])
def test_lora_act_and_mul_rounds_as_the_unfused_kernels(num_tokens):
    """In bf16 the fused op returns exactly what expand-into-y then the activation kernel
    return (each form against its own expand): switching to it changes no token."""
    from loraplex.ops import triton as kernels

    gen = torch.Generator().manual_seed(num_tokens)
    width, ranks = 40, [16, 8, 3]
    slots = token_slots("mixed-with-base", num_tokens, len(ranks), gen)
    b = slot_b(ranks, 2 * width, 16, gen)
    buf = torch.randn(2, num_tokens, 16, generator=gen).to(DEVICE)
    gate_up = torch.randn(num_tokens, 2 * width, generator=gen).to(DEVICE, torch.bfloat16)
    b = b.to(DEVICE, torch.bfloat16)
    batch = lora_batch(slots, ranks, len(ranks))
    y = gate_up.clone()
    kernels.lora_expand(buf, b, y, (width, width), batch)
    assert torch.equal(kernels.lora_act_and_mul(gate_up, buf, b, batch, "silu"), kernels.silu_and_mul(y))


def check_lora_act_and_mul(popularity, num_tokens, width, activation, fused=None, dtype=torch.float32):
    fused = fused or ops.lora_act_and_mul
    gen = torch.Generator().manual_seed(num_tokens * 5 + width)
    max_loras, max_rank = 5, 16
    ranks = [16, 8, 3, 1, 12]
    slots = token_slots(popularity, num_tokens, max_loras, gen)
    b = slot_b(ranks, 2 * width, max_rank, gen)
    # The shrink's rows past a token's rank, and of tokens without an adapter, are
    # unspecified: random here, and they must not count.
    buf = torch.randn(2, num_tokens, max_rank, generator=gen)
    gate_up = torch.randn(num_tokens, 2 * width, generator=gen) * 2
    b, gate_up = b.to(dtype), gate_up.to(dtype)

    y = gate_up.double()
    for t, slot in enumerate(slots):
        if slot >= 0:
            r = ranks[slot]
            for s in range(2):
                cols = slice(s * width, (s + 1) * width)
                y[t, cols] += buf[s, t, :r].double() @ b[slot, cols, :r].double().T
    y = y.to(dtype).double()  # the sum is rounded to the projection's dtype, as lora_expand stores it
    g, u = y[:, :width], y[:, width:]
    if activation == "silu":
        expected = g * torch.sigmoid(g) * u
    else:
        expected = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u

    dev = dict(device=DEVICE)
    gate_up_dev = gate_up.to(**dev)
    out = fused(gate_up_dev, buf.to(**dev), b.to(**dev), lora_batch(slots, ranks, max_loras), activation)
    assert out.shape == (num_tokens, width) and out.dtype == dtype
    err = (out.double().cpu() - expected).norm() / expected.norm()
    # The Triton interpreter converts to bf16 by truncation, not rounding: the kernels'
    # two conversions (the rounded sum, the output) then err up to twice as much as on a GPU.
    tol = 2e-2 if dtype == torch.bfloat16 and INTERPRETED else REL_TOL[dtype]
    assert err <= tol, err
    assert torch.equal(gate_up_dev.cpu(), gate_up), "the projection's output is an input only"


def naive_attention(q, k, v, scale, window, sinks=None):
    """q [n, Hq, D] at the last n of L positions; k, v [L, Hkv, D]; sinks [Hq]: one more
    softmax logit per head, without a value."""
    n, num_heads, _ = q.shape
    length, num_kv = k.shape[:2]
    group = num_heads // num_kv
    out = torch.empty(n, num_heads, v.shape[-1], dtype=torch.float64)
    for i in range(n):
        p = length - n + i
        visible = [j for j in range(length) if j <= p and (window is None or j > p - window)]
        for h in range(num_heads):
            kk, vv = k[visible, h // group].double(), v[visible, h // group].double()
            scores = scale * kk @ q[i, h].double()
            if sinks is not None:
                scores = torch.cat((scores, sinks[h : h + 1].double()))
            w = torch.softmax(scores, dim=0)[: len(visible)]
            out[i, h] = w @ vv
    return out


@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_attention(backend, window, dtype, sinks):
    # (cached tokens, new tokens): decodes, fresh prefills, chunks on a cached prefix.
    seqs = [(0, 1), (9, 1), (0, 7), (5, 6), (12, 1), (3, 13)]
    check_paged_attention(seqs, window, dtype, num_heads=6, num_kv=2, head_dim=8, sinks=sinks)


def test_paged_attention_many_sequences_and_padding(backend):
    """More sequences than one scan of the device-side tile search covers (64), and the
    padding of a CUDA graph for mixed steps: a sequence of tokens with no context
    (zero rows) and empty sequences after it."""
    gen = torch.Generator().manual_seed(3)
    seqs = [(int(c), int(n)) for c, n in zip(torch.randint(0, 9, (70,), generator=gen),
                                              torch.randint(1, 4, (70,), generator=gen))]
    seqs[5], seqs[40] = (2, 20), (0, 17)  # chunks spanning several query blocks
    seqs += [(None, 9), (None, 0), (None, 0)]
    check_paged_attention(seqs, None, torch.float32, num_heads=4, num_kv=2, head_dim=8)


# (GQA group, head_dim, window, MAX_SPLITS): 2 splits make a program cover several partitions.
DECODE_SHAPES = [(1, 64, None, 64), (4, 128, None, 64), (8, 80, None, 2), (4, 64, 21, 64),
                 (8, 128, 40, 64), (1, 80, 37, 2)]


@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("group,head_dim,window,max_splits", DECODE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_decode_split(backend, monkeypatch, group, head_dim, window, max_splits, dtype, sinks):
    """Decode batches through the split-KV kernels, with 16-token partitions so that small
    contexts split: shorter than, equal to and several partitions long, mixed in one
    batch, beside padding sequences in a table as wide as a CUDA graph's."""
    from loraplex.ops.triton import paged_decode

    monkeypatch.setattr(paged_decode, "PARTITION_SIZE", 16)
    monkeypatch.setattr(paged_decode, "MAX_SPLITS", max_splits)
    seqs = [(4, 1), (15, 1), (0, 1), (70, 1), (31, 1), (47, 1), None, None]
    batch = check_paged_attention(seqs, window, dtype, num_heads=2 * group, num_kv=2,
                                  head_dim=head_dim, table_width=30, sinks=sinks)
    splits = paged_decode.num_splits(batch, 4, 2, window)
    assert splits == min(max_splits, math.ceil(min(30 * 4, (window or 999) + 15) / 16)) > 1


@pytest.mark.parametrize("split", [True, False], ids=["split", "single-pass"])
@pytest.mark.parametrize("head_dim,fp8_block", [(64, 64), (32, 64)], ids=["heads", "other-blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_writes_the_rows_a_w8a8_o_proj_reads(backend, monkeypatch, split, head_dim, fp8_block,
                                                       dtype):
    """In front of a W8A8 o_proj attention returns its output's e4m3 rows too: written by
    the split-KV merge where the activation blocks are heads, else quantized after; the
    same rows either way."""
    from loraplex.ops.triton import paged_decode

    if split:
        monkeypatch.setattr(paged_decode, "PARTITION_SIZE", 16)
    seqs = [(4, 1), (15, 1), (0, 1), (70, 1), (31, 1), None]
    batch = check_paged_attention(seqs, None, dtype, num_heads=8, num_kv=2, head_dim=head_dim,
                                  table_width=30 if split else None, fp8_block=fp8_block)
    assert (paged_decode.num_splits(batch, 4, 2, None) > 1) == split


# Short chunks (decodes, verified proposals), padding after them: one-token sequences of no
# context (a CUDA graph's) and an empty sequence.
SHORT_CHUNKS = [(4, 5), (15, 1), (0, 3), (70, 5), (31, 2), (47, 8), (11, 4), None, None, (None, 0)]


@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("group,head_dim,window,max_splits", [(1, 64, None, 64), (4, 128, None, 64),
                                                              (8, 80, 21, 2), (4, 64, 37, 64)])
@pytest.mark.parametrize("split", [True, False], ids=["split", "single-pass"])
def test_paged_attention_short_chunks(backend, monkeypatch, split, group, head_dim, window, max_splits,
                                      sinks):
    """Steps whose chunks have at most SHORT_QUERY_MAX tokens (speculative verification)
    take the decode kernels with a sequence's tokens and heads in one tile: through the
    split-KV kernels (16-token partitions, so that contexts split, each token seeing its
    own causal span of them) and through the single-pass kernel, one tile a sequence."""
    from loraplex.ops.triton import paged_decode

    if split:
        monkeypatch.setattr(paged_decode, "PARTITION_SIZE", 16)
        monkeypatch.setattr(paged_decode, "MAX_SPLITS", max_splits)
    batch = check_paged_attention(SHORT_CHUNKS, window, torch.float32, num_heads=2 * group, num_kv=2,
                                  head_dim=head_dim, table_width=30 if split else None, sinks=sinks)
    assert batch.max_query_len == paged_decode.SHORT_QUERY_MAX
    assert (paged_decode.num_splits(batch, 4, 2, window) > 1) == split


def check_paged_attention(seqs, window, dtype, num_heads, num_kv, head_dim, block_size=4,
                          table_width=None, sinks=False, fp8_block=0) -> AttentionBatch:
    """Write each sequence's new keys/values into scattered pages, run paged_attention,
    compare every sequence with the naive loop. seqs: (cached tokens, new tokens);
    padding of a CUDA graph: None (a decode graph's: one token, no context, no KV slot)
    or (None, n) (a mixed-step graph's: n tokens, no context, no KV slots). sinks:
    random per-head sink logits (gpt-oss), large enough to take much of each softmax.
    fp8_block: also the output's e4m3 rows (a W8A8 o_proj's), quantize_activations of the
    output bit for bit, the output as without them."""
    seqs = [(None, 1) if s is None else s for s in seqs]
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(math.ceil((c + n) / block_size) for c, n in seqs if c is not None) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv, head_dim, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered pages
    tables, slot_mapping, qsl, seq_lens = [], [], [0], []
    for cached, new in seqs:
        length = cached + new if cached is not None else 0
        pages = [free.pop() for _ in range(math.ceil(length / block_size))]
        tables.append(pages)
        slot_mapping += ([pages[p // block_size] * block_size + p % block_size
                          for p in range(cached, length)] if cached is not None else [-1] * new)
        qsl.append(qsl[-1] + new)
        seq_lens.append(length)
    width = table_width or max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    num_tokens = qsl[-1]
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k_new = torch.randn(num_tokens, num_kv, head_dim, generator=gen)
    v_new = torch.randn(num_tokens, num_kv, head_dim, generator=gen)
    q, k_new, v_new, k_cache, v_cache = (t.to(dtype) for t in (q, k_new, v_new, k_cache, v_cache))
    sink = 2 * torch.randn(num_heads, generator=gen) if sinks else None

    dev = dict(device=DEVICE)
    batch = AttentionBatch(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, **dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, **dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, **dev),
        block_tables=table.to(**dev),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        max_query_len=max(qsl[b + 1] - qsl[b] for b in range(len(seqs))),
        max_seq_len=max(seq_lens),
    )
    kc, vc = k_cache.clone().to(**dev), v_cache.clone().to(**dev)
    ops.write_kv_cache(k_new.to(**dev), v_new.to(**dev), kc, vc, batch.slot_mapping)
    scale = head_dim**-0.5
    out = ops.paged_attention(q.to(**dev), kc, vc, batch, scale, window,
                              None if sink is None else sink.to(**dev)).cpu()
    if fp8_block:
        again, rows = ops.paged_attention(q.to(**dev), kc, vc, batch, scale, window,
                                          None if sink is None else sink.to(**dev), fp8_block)
        assert torch.equal(again.cpu(), out)
        # (plain torch on a GPU quantizes there: its division by 448 is a multiply)
        o = again if ops.backend_name() == "torch" else out
        want_q, want_scale = quantize_activations(o.reshape(num_tokens, -1), fp8_block)
        assert torch.equal(rows.q.cpu().view(torch.uint8), want_q.cpu().view(torch.uint8))
        assert torch.equal(rows.scale.cpu(), want_scale.cpu())

    flat_k = kc.cpu().view(-1, num_kv, head_dim)
    flat_v = vc.cpu().view(-1, num_kv, head_dim)
    real = batch.slot_mapping.cpu() >= 0
    assert torch.equal(flat_k[batch.slot_mapping.cpu()[real]], k_new[real])
    for b, length in enumerate(seq_lens):
        rows = slice(qsl[b], qsl[b + 1])
        if seqs[b][0] is None:  # padding: no key to attend to
            assert torch.equal(out[rows], torch.zeros_like(out[rows])), b
            continue
        slots = [tables[b][p // block_size] * block_size + p % block_size for p in range(length)]
        ref = naive_attention(q[rows], flat_k[slots], flat_v[slots], scale, window, sink)
        err = (out[rows].double() - ref).norm() / ref.norm()
        assert err <= REL_TOL[dtype], (b, err)
    return batch


def test_rms_norm_rotary_silu(backend):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 48, generator=gen).to(DEVICE)
    w = torch.randn(48, generator=gen).to(DEVICE)
    ref = w.double() * x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    assert torch.allclose(ops.rms_norm(x, w, 1e-6).double(), ref, rtol=1e-5, atol=1e-6)

    # q and k as views of a fused q/k/v output, as the model passes them.
    qkv = torch.randn(7, (4 + 2 + 2) * 16, generator=gen)
    q, k = qkv[:, :64].view(7, 4, 16), qkv[:, 64:96].view(7, 2, 16)
    positions = torch.tensor([0, 3, 1, 9, 9, 2, 15])
    inv = 1.0 / 10000 ** (torch.arange(0, 16, 2).double() / 16)
    ang = torch.arange(20).double()[:, None] * inv
    cos_sin = torch.cat((ang.cos(), ang.sin()), -1).float()
    rq, rk = ops.rotary_embedding(q.to(DEVICE), k.to(DEVICE), positions.to(DEVICE), cos_sin.to(DEVICE))
    rq, rk = rq.cpu(), rk.cpu()
    for t, p in enumerate(positions.tolist()):  # rotate pairs (i, i + D/2) by p * inv[i]
        c, s = ang[p].cos(), ang[p].sin()
        for src, got in ((q, rq), (k, rk)):
            x1, x2 = src[t, :, :8].double(), src[t, :, 8:].double()
            want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
            assert torch.allclose(got[t].double(), want, atol=1e-5)

    h = torch.randn(5, 2 * 24, generator=gen)
    g, u = h[:, :24].double(), h[:, 24:].double()
    got = ops.silu_and_mul(h.to(DEVICE)).double().cpu()
    assert torch.allclose(got, g * torch.sigmoid(g) * u, atol=1e-6)


@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama_norm", "gemma_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qk_norm_in_rotary_equals_norm_then_rotary(backend, unit_offset, dtype):
    """Qwen3 / Gemma 3: the rotary op's fused per-head RMSNorm gives what rms_norm then
    rotary give (same backend, same roundings), and in fp32 what the reference gives."""
    gen = torch.Generator().manual_seed(3)
    t, hq, hk, d = 5, 4, 2, 32
    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=gen) * 3).to(dtype).to(DEVICE)
    q, k = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    wq, wk = ((torch.randn(d, generator=gen) * 0.5).to(dtype).to(DEVICE) for _ in range(2))
    positions = torch.tensor([0, 7, 3, 3, 11], device=DEVICE)
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).double() / d)
    ang = torch.arange(16).double()[:, None] * inv
    cos_sin = torch.cat((ang.cos(), ang.sin()), -1).float().to(DEVICE)
    norm = QKNorm(wq, wk, 1e-6, unit_offset)
    got = ops.rotary_embedding(q, k, positions, cos_sin, norm)
    unfused = ops.rotary_embedding(ops.rms_norm(q, wq, 1e-6, unit_offset),
                                   ops.rms_norm(k, wk, 1e-6, unit_offset), positions, cos_sin)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # a sum in another order: one bf16 ulp
    for g, u in zip(got, unfused):
        assert g.dtype == dtype and torch.allclose(g.float(), u.float(), rtol=tol, atol=tol)
    if dtype == torch.float32:
        want = reference.rotary_embedding(q.cpu(), k.cpu(), positions.cpu(), cos_sin.cpu(),
                                          QKNorm(wq.cpu(), wk.cpu(), 1e-6, unit_offset))
        for g, w in zip(got, want):
            assert torch.allclose(g.cpu(), w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,hq,hk,d", [(5, 4, 2, 32), (3, 6, 3, 16), (4, 8, 2, 128)])
@pytest.mark.parametrize("norm", [False, True], ids=["", "qk_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotate_and_store_equals_rotary_then_write(backend, t, hq, hk, d, norm, dtype):
    """ops.rotate_and_store gives what the rotary op then the KV write give on the same
    backend, from q/k/v views of one projection's output: the q/k norm, the rotation, k
    and v in their cache slots (a padding token's stored nowhere, other slots untouched),
    the rotated q returned; its inputs unchanged."""
    gen = torch.Generator().manual_seed(t * 100 + hq * 10 + d)
    sizes = (hq * d, hk * d, hk * d)
    qkv = (torch.randn(t, sum(sizes), generator=gen) * 2).to(dtype).to(DEVICE)
    before = qkv.clone()
    q, k, v = qkv.split(sizes, -1)
    q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
    positions = torch.tensor([0, 7, 3, 15, 11][:t], device=DEVICE)
    ang = torch.arange(16).double()[:, None] / 10000 ** (torch.arange(0, d, 2).double() / d)
    cos_sin = torch.cat((ang.cos(), ang.sin()), -1).float().to(DEVICE)
    cache_slots = torch.tensor([5, -1, 14, 3, 9][:t], device=DEVICE)
    qk_norm = None
    if norm:
        wq, wk = ((torch.randn(d, generator=gen) * 0.5).to(dtype).to(DEVICE) for _ in range(2))
        qk_norm = QKNorm(wq, wk, 1e-6)
    caches = [torch.full((4, 4, hk, d), 7.0, dtype=dtype, device=DEVICE) for _ in range(4)]
    got = ops.rotate_and_store(q, k, v, positions, cos_sin, caches[0], caches[1], cache_slots, qk_norm)
    assert torch.equal(qkv, before)
    want_q, want_k = ops.rotary_embedding(q, k, positions, cos_sin, qk_norm)
    ops.write_kv_cache(want_k, v, caches[2], caches[3], cache_slots)
    assert got.shape == (t, hq, d) and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want_q, **tol)
    torch.testing.assert_close(caches[0], caches[2], **tol)
    assert torch.equal(caches[1], caches[3])  # v is copied
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[cache_slots[cache_slots >= 0].cpu()] = False
    assert (caches[0].view(16, -1)[untouched.to(DEVICE)] == 7).all()


def test_add_rms_norm_and_strided_heads(backend):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 40, generator=gen).to(DEVICE)
    res = torch.randn(6, 40, generator=gen).to(DEVICE)
    w = torch.randn(40, generator=gen).to(DEVICE)
    out, new_res = ops.add_rms_norm(x, res, w, 1e-5)
    s = (x + res).double()
    ref = w.double() * s / (s.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    assert torch.equal(new_res, x + res)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6)
    # A MoE block's unsummed expert outputs [T, K, N] are summed in the same launch.
    terms = torch.randn(6, 3, 40, generator=gen).to(DEVICE)
    out3, res3 = ops.add_rms_norm(terms, res, w, 1e-5)
    s3 = (terms.double().sum(1) + res.double())
    ref3 = w.double() * s3 / (s3.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    assert out3.shape == res3.shape == (6, 40)
    assert torch.allclose(res3.double(), s3, rtol=1e-5, atol=1e-5)
    assert torch.allclose(out3.double(), ref3, rtol=1e-4, atol=1e-5)
    # q/k norm reads the heads of a fused projection output: a strided [T, H, D] view.
    qkv = torch.randn(5, 3 * 4 * 16, generator=gen).to(DEVICE)
    heads = qkv[:, 64:128].view(5, 4, 16)
    wq = torch.randn(16, generator=gen).to(DEVICE)
    got = ops.rms_norm(heads, wq, 1e-6)
    h = heads.double()
    want = wq.double() * h / (h.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)


def test_gemma_norm_and_gelu(backend):
    """(1 + w) norms scale before rounding; GELU is PyTorch's tanh approximation."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 40, generator=gen).to(DEVICE)
    res = torch.randn(6, 40, generator=gen).to(DEVICE)
    w = torch.randn(40, generator=gen).to(DEVICE) * 0.1
    s = (x + res).double()
    ref = (1 + w.double()) * s / (s.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    out, new_res = ops.add_rms_norm(x, res, w, 1e-6, unit_offset=True)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(new_res, x + res)
    h = (x + res).double()
    ref1 = (1 + w.double()) * h / (h.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    assert torch.allclose(ops.rms_norm(x + res, w, 1e-6, True).double(), ref1, rtol=1e-5, atol=1e-6)

    g = torch.randn(5, 2 * 24, generator=gen).to(DEVICE) * 3
    gate, up = g[:, :24].double(), g[:, 24:].double()
    inner = (2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)
    want = 0.5 * gate * (1 + torch.tanh(inner)) * up
    assert torch.allclose(ops.gelu_tanh_and_mul(g).double(), want, rtol=1e-5, atol=1e-5)


def test_write_kv_cache_skips_padding(backend):
    gen = torch.Generator().manual_seed(3)
    kc = torch.zeros(4, 4, 2, 8, device=DEVICE)
    vc = torch.zeros(4, 4, 2, 8, device=DEVICE)
    k = torch.randn(3, 2, 8, generator=gen).to(DEVICE)
    v = torch.randn(3, 2, 8, generator=gen).to(DEVICE)
    slots = torch.tensor([5, -1, 14], device=DEVICE)
    ops.write_kv_cache(k, v, kc, vc, slots)
    assert torch.equal(kc.view(-1, 2, 8)[5], k[0]) and torch.equal(vc.view(-1, 2, 8)[14], v[2])
    assert int((kc.view(-1, 2, 8).abs().sum((1, 2)) > 0).sum()) == 2


def test_unknown_backend_lists_known():
    with pytest.raises(ValueError, match="known: torch"):
        ops.use_backend("cuda-magic")


def test_warm_up_lora_runs_the_small_batch_kernels_and_changes_nothing(monkeypatch):
    """ops.warm_up_lora launches the LoRA kernels for each small token count (no token
    on an adapter), so serving compiles nothing new; the slot tensors stay as they were."""
    import loraplex.ops.triton as backend

    counts = []
    shrink = backend.lora_shrink_gemv
    monkeypatch.setattr(backend, "lora_shrink_gemv", lambda x, *a: counts.append(x.shape[0]) or shrink(x, *a))
    torch.manual_seed(0)
    lora_a = torch.randn(2, 3, 8, 48, device=DEVICE)
    lora_b = torch.randn(3, 40, 8, device=DEVICE)
    a, b = lora_a.clone(), lora_b.clone()
    with ops.using_backend("triton"):
        ops.warm_up_lora(lora_a, lora_b, (24, 16), max_tokens=3)
    with ops.using_backend("torch"):
        ops.warm_up_lora(lora_a, lora_b, (24, 16), max_tokens=3)  # nothing to compile
    assert torch.equal(lora_a, a) and torch.equal(lora_b, b)
    assert counts == [1, 2, 3]


def test_race_sample_greedy_rows_and_seeds(backend):
    """Greedy rows are the argmax (whatever their seed); a sampled row's token is a
    function of its logits, temperature and seed alone, not of the rows beside it; the
    logits are not modified. A vocabulary of several blocks and programs per row."""
    gen = torch.Generator().manual_seed(3)
    vocab = 20000
    logits = (torch.randn(6, vocab, generator=gen) * 3).to(DEVICE)
    before = logits.clone()
    temperature = torch.tensor([0.0, 1.0, 0.7, 1e-6, 2.0, 1.0], device=DEVICE)
    seeds = torch.tensor([5, 11, 12, 13, 2**62 + 7, 11], dtype=torch.int64, device=DEVICE)
    ids = ops.race_sample(logits, temperature, seeds)
    assert torch.equal(logits, before)
    assert ids.dtype == torch.int64 and ids.shape == (6,)
    argmax = logits.argmax(-1)
    assert ids[0] == argmax[0] and ids[3] == argmax[3]
    again = ops.race_sample(logits[[4, 2, 1]], temperature[[4, 2, 1]], seeds[[4, 2, 1]])
    assert again.tolist() == ids[[4, 2, 1]].tolist()
    other = ops.race_sample(logits[1:2], temperature[1:2], seeds[1:2] + 1)
    draws = [ops.race_sample(logits[1:2], temperature[1:2], seeds[1:2] + s).item() for s in range(8)]
    assert len(set(draws)) > 1, "different seeds draw different tokens"
    assert other.item() == draws[1]
    bf16 = ops.race_sample(logits.to(torch.bfloat16), temperature, seeds)
    assert bf16[0] == logits.to(torch.bfloat16).argmax(-1)[0]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_race_sample_draws_softmax_frequencies(backend, temperature):
    """Many rows of the same logits with distinct seeds: token frequencies follow
    softmax(logits / T) (the exponential race is exact, not an approximation)."""
    rows, vocab = 3000, 7
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5])
    ids = ops.race_sample(logits.expand(rows, vocab).contiguous().to(DEVICE),
                          torch.full((rows,), temperature, device=DEVICE),
                          torch.arange(rows, dtype=torch.int64, device=DEVICE) * 7919 + 1)
    freq = torch.bincount(ids.cpu(), minlength=vocab).double() / rows
    want = torch.softmax(logits.double() / temperature, -1)
    # binomial standard error <= sqrt(0.25 / 3000) ~ 0.009: 4 sigma
    assert (freq - want).abs().max() < 0.037, (freq, want)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ngram_inputs(backend, seed):
    """Speculation planned ahead of results: pending tokens fed, positions and KV slots
    moved by the previous step's rejections, tokens recorded in each sequence's history,
    and n-gram proposals equal to the host proposer's (engine/speculative.py)."""
    from loraplex.engine.speculative import propose_ngram

    gen = torch.Generator().manual_seed(seed)
    bs, max_len, vocab, n_min, n_max = 4, 96, 5, 1, 3  # a small vocabulary: many matches
    # (known tokens, drafts k, fed from the previous step?, history row) per chunk.
    layout = [(1, 3, True, 0), (6, 0, False, 1), (1, 2, True, 2), (1, 0, True, -1), (4, 4, False, 3)]
    histories = torch.randint(0, vocab, (4, max_len), generator=gen).to(torch.int32)
    last_ids = torch.randint(0, vocab, (6,), generator=gen)
    last_shift = -torch.randint(0, 3, (6,), generator=gen).to(torch.int32)
    ids, pos, tables, qsl, lens, meta = [], [], [], [0], [], []
    for c, (known, k, fed, row) in enumerate(layout):
        src = c if fed else -1
        start = int(torch.randint(8, 60, (1,), generator=gen))  # the host's (optimistic) start
        n = known + k
        # The last chunk's known tokens repeat one token (n_max + 1 of them): its longest
        # match is at the end, and its proposal repeats it (the sequence's period).
        repeats = c == len(layout) - 1
        known_ids = [2] * known if repeats else torch.randint(0, vocab, (known,), generator=gen).tolist()
        ids += known_ids + [0] * k
        pos += list(range(start, start + n))
        tables.append(torch.randperm(40, generator=gen)[:32].tolist())
        qsl.append(qsl[-1] + n)
        lens.append(start + n)
        meta.append((src, row, k))
    slots = [tables[c][p // bs] * bs + p % bs for c in range(len(layout)) for p in pos[qsl[c]: qsl[c + 1]]]
    dev = dict(device=DEVICE)
    inputs = dict(
        input_ids=torch.tensor(ids, **dev), positions=torch.tensor(pos, **dev),
        slot_mapping=torch.tensor(slots, **dev), seq_lens=torch.tensor(lens, dtype=torch.int32, **dev),
        block_tables=torch.tensor(tables, dtype=torch.int32, **dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, **dev),
        chunks=torch.tensor(meta, dtype=torch.int64, **dev), last_ids=last_ids.to(DEVICE),
        last_shift=last_shift.to(DEVICE), history=histories.clone().to(DEVICE))
    found = ops.ngram_inputs(**inputs, block_size=bs, n_min=n_min, n_max=n_max, max_drafts=4).cpu()

    hist = histories.clone()
    for c, (known, k, fed, row) in enumerate(layout):
        a, b = qsl[c], qsl[c + 1]
        shift = int(last_shift[c]) if fed else 0
        want_ids = list(ids[a:b])
        if fed:
            want_ids[0] = int(last_ids[c])
        want_pos = [p + shift for p in pos[a:b]]
        assert inputs["positions"][a:b].tolist() == want_pos
        assert inputs["seq_lens"][c].item() == lens[c] + shift
        assert inputs["slot_mapping"][a:b].tolist() == [tables[c][p // bs] * bs + p % bs for p in want_pos]
        if row < 0:
            assert found[c] == 0 and inputs["input_ids"][a:b].tolist() == want_ids
            continue
        for p, tok in zip(want_pos[:known], want_ids[:known]):
            hist[row, p] = tok
        length = want_pos[known - 1] + 1
        proposal = propose_ngram(hist[row, :length].tolist(), k, n_min, n_max) if k else []
        assert found[c].item() == len(proposal), (c, proposal)
        want_ids[known: known + len(proposal)] = proposal
        assert inputs["input_ids"][a:b].tolist() == want_ids
        hist[row, length: length + len(proposal)] = torch.tensor(proposal, dtype=torch.int32)
        end = length + len(proposal)
        assert inputs["history"][row, :end].tolist() == hist[row, :end].tolist()
    assert sum(found.tolist()) > 0  # the layout makes some proposals
    assert inputs["input_ids"][qsl[-1] - 4:].tolist() == [2, 2, 2, 2]  # past the end, the period


@pytest.mark.parametrize("k", [1, 4, 7])
def test_greedy_accept(backend, k):
    """Greedy verification: proposals read from the input ids kept while each equals the
    argmax before it (up to each sequence's count), then the argmax after them."""
    gen = torch.Generator().manual_seed(k)
    s, vocab = 9, 3  # a tiny vocabulary: proposals often agree
    best = torch.randint(0, vocab, (s, k + 1), generator=gen)
    input_ids = torch.randint(0, vocab, (s * (k + 2),), generator=gen)
    firsts = [i * (k + 2) + int(torch.randint(0, 2, (1,), generator=gen)) for i in range(s)]
    slots = [int(torch.randint(0, k + 1, (1,), generator=gen)) for _ in range(s)]
    found = torch.tensor([int(torch.randint(0, n + 1, (1,), generator=gen)) for n in slots] + [0],
                         dtype=torch.int32)
    spec = torch.tensor([[f, n, i] for i, (f, n) in enumerate(zip(firsts, slots))])
    verified, added, shift = ops.greedy_accept(best.to(DEVICE), input_ids.to(DEVICE), spec.to(DEVICE),
                                               found.to(DEVICE))
    verified, added, shift = verified.cpu(), added.cpu(), shift.cpu()
    for i in range(s):
        a = 0
        while a < found[i] and input_ids[firsts[i] + 1 + a] == best[i, a]:
            a += 1
        want = input_ids[firsts[i] + 1: firsts[i] + 1 + a].tolist() + [int(best[i, a])] + [-1] * (k - a)
        assert verified[i].tolist() == want + [a, int(found[i])], i
        assert added[i] == best[i, a] and shift[i] == a - slots[i], i
    assert verified[:, k + 1].sum() > 0
