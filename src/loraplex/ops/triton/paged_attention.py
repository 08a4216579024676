"""Attention over the paged KV cache for prefill chunks and decodes alike (flash style).

Each program owns one KV head and a block of query rows of one sequence. A row is one
(query token, query head) pair of that KV head's group, so with grouped-query attention
a decode token brings all its query heads (e.g. 4) into one tile and each key/value page
is read once for the whole group. The program walks the sequence's block table over the
visible keys (causal, optionally a sliding window), keeping a running max and sum
(online softmax), so no score matrix is ever materialised. New tokens' keys/values are
already in the cache (write_kv_cache runs first): a chunk appended to a cached prefix
and a single decode token are the same case. Steps of short chunks (decodes, verified
speculation: at most SHORT_QUERY_MAX tokens a sequence) give each sequence one tile; where
their contexts may span several partitions they go to the split-KV kernels of
paged_decode.py instead, which spread each context over several programs (and, in front
of a W8A8 o_proj, write the output's e4m3 rows in their merge: fp8_block).

Steps with longer chunks number their (sequence, query block) tiles sequence after
sequence, and each program finds its own from query_start_loc on the device
(`find_tile`): the launch depends only on the token and sequence counts, so one CUDA
graph serves any split of a step's tokens into chunks. A sequence whose context is
shorter than its query (the padding of such a graph: seq_lens 0) sees no key: its rows
come out zero.

Attention sinks (gpt-oss) start each row's online softmax as if one key with logit
sinks[head] and a zero value had been seen: running max = sink, sum = 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.formats import Fp8Rows
from loraplex.ops.metadata import SHORT_QUERY_MAX, AttentionBatch
from loraplex.ops.triton.attention_common import attend_tile
from loraplex.ops.triton.fp8_activations import quantize_activations
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.paged_decode import num_splits, paged_decode
from loraplex.ops.triton.precision import dot_settings
from loraplex.ops.triton.segment_tiles import find_tile, max_tiles


def attention_config(max_query_len: int, group: int, row_bytes: int = 256, windowed: bool = False) -> dict:
    """row_bytes: one head's q/k/v row in memory (head_dim x element size). Rows over 512
    bytes (float32 with Gemma 3's head_dim 256) get half-size, single-stage tiles: the
    bf16 tiles would need 288 KB of shared memory there, past an H100/H200's 227 KB.
    Decode walks whole contexts in 128-key tiles where rows are <= 256 bytes (72 KB of
    shared memory; Llama-3.1-8B's decode 27.8 -> 24.8 us per layer against 64-key tiles),
    64-key ones under a sliding window (fewer keys before the window's start). Short
    chunks (verification) tile the same way, one sequence's tokens and heads per tile."""
    wide = row_bytes > 512
    if max_query_len <= SHORT_QUERY_MAX:  # decode or short chunks: a sequence's heads per tile
        block_n = 32 if wide else 128 if row_bytes <= 256 and not windowed else 64
        return dict(BLOCK_M=max(16, triton.next_power_of_2(group * max_query_len)), BLOCK_N=block_n,
                    num_warps=4, num_stages=1 if wide else 2)
    if wide:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)


@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, sinks_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, num_seqs,
    scale, window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, ONE_TILE: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    kv_head = tl.program_id(1)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP  # query tokens per tile
    if ONE_TILE:  # short chunks: program i is sequence i's tokens
        seq = tl.program_id(0)
        q_block = 0
    else:
        seq, first = find_tile(tl.program_id(0), query_start_loc_ptr, num_seqs, BLOCK_Q)
        if seq >= num_seqs:
            return
        q_block = (first - tl.load(query_start_loc_ptr + seq)) // BLOCK_Q

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP  # query token index within the sequence
    head = kv_head * GROUP + rows % GROUP
    row_mask = (rows // GROUP < BLOCK_Q) & (tok < q_len)
    pos = ctx_len - q_len + tok  # absolute position of each row's query token
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    if USE_SINKS:
        m_i = tl.load(sinks_ptr + head).to(tl.float32)
        l_i = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
    else:
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    last_pos = ctx_len - q_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1
    kv_end = last_pos + 1
    kv_begin = 0
    if USE_WINDOW:
        first_pos = ctx_len - q_len + q_block * BLOCK_Q
        kv_begin = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq * stride_bt
    for n0 in range(kv_begin, kv_end, BLOCK_N):
        n = n0 + offs_n
        n_mask = n < kv_end
        visible = (n[None, :] <= pos[:, None]) & n_mask[None, :]
        if USE_WINDOW:
            visible = visible & (n[None, :] > pos[:, None] - window)
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, n, n_mask, visible, table, k_cache_ptr, v_cache_ptr, kv_head, offs_d, d_mask,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd, scale,
            PAGE, DOT_PRECISION, UPCAST)

    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(
        out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
        + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
    fp8_block: int = 0,
):
    """See loraplex.ops.paged_attention. fp8_block: the output's e4m3 rows too, written by
    the split-KV merge where the blocks are heads (decode steps), else quantized after."""
    num_tokens, num_heads, head_dim = q.shape
    short = batch.max_query_len <= SHORT_QUERY_MAX
    splits = num_splits(batch, k_cache.shape[1], k_cache.shape[2], sliding_window) if short else 1
    fused = None  # the output's rows, where the split-KV merge writes them
    if splits > 1:  # split long contexts over programs (host-known bound)
        if fp8_block == head_dim:
            fused = Fp8Rows.empty(num_tokens, num_heads * head_dim, fp8_block, q.device)
        out = paged_decode(q, k_cache, v_cache, batch, scale, sliding_window, splits, sinks, fused)
    else:
        out = _attention(q, k_cache, v_cache, batch, scale, sliding_window, sinks)
    if not fp8_block:
        return out
    return out, fused or quantize_activations(out.view(num_tokens, -1), fp8_block)


def _attention(q, k_cache, v_cache, batch, scale, sliding_window, sinks) -> torch.Tensor:
    """The single-pass kernel: one program per (query tile, KV head)."""
    num_tokens, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    short = batch.max_query_len <= SHORT_QUERY_MAX
    out = torch.empty_like(q)
    cfg = attention_config(batch.max_query_len, group, triton.next_power_of_2(head_dim) * q.element_size(),
                           windowed=sliding_window is not None)
    block_q = cfg["BLOCK_M"] // group
    assert block_q >= 1, "a tile must hold at least one token's query heads"
    num_seqs = batch.seq_lens.shape[0]
    tiles = num_seqs if short else max_tiles(num_tokens, num_seqs, block_q)
    _paged_attention_kernel[(tiles, num_kv_heads)](
        q, k_cache, v_cache, out, q if sinks is None else sinks,  # q: a pointer never read
        batch.block_tables, batch.seq_lens, batch.query_start_loc, num_seqs,
        scale, sliding_window or 0,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        batch.block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PAGE=page, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        USE_WINDOW=sliding_window is not None, USE_SINKS=sinks is not None,
        **dot_settings(q.dtype), ONE_TILE=short,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl(),
    )
    return out
