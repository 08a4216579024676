"""Split-KV ("flash-decoding") attention over the paged KV cache for steps of short
chunks: decodes, and the verification of speculated tokens (at most SHORT_QUERY_MAX
query tokens per sequence).

Such a step has a token or a few per sequence, so the single-pass kernel
(paged_attention.py) runs only sequences x KV heads programs, each walking a whole
context: 32 x 8 = 256 programs on a 132-SM GPU leave memory bandwidth unused. Here a
sequence's visible keys are cut into partitions of PARTITION_SIZE tokens, and program
(split, sequence, KV head) reduces its span of partitions to a partial result, for all
of the sequence's query tokens and all query heads of the KV head in one tile (row =
(token, head), as in the single-pass kernel), so each key is read once per sequence: the
unnormalised output and its running max and sum, in float32 scratch. A second kernel
merges each (token, query head)'s partials with the log-sum-exp trick. A token sees the
keys up to its own position (causal within the chunk); a split past all of a token's
keys leaves it an empty partial.

CUDA graphs: a captured decode step is replayed for any context lengths, so launches
depend on host-known bounds only, never on seq_lens. The split count comes from the
block table's width (no context outgrows its table row; a graph's rows span
max_model_len), the window, and the batch size; both kernels derive each sequence's
spans from seq_lens on the device, so programs past a context exit at once and the merge
reads only partials that were written. Scratch is one grow-only buffer per device.
Attention sinks (gpt-oss) join in the merge, once per head: one more partial with max
sinks[head], sum 1 and no output. In front of a W8A8 o_proj whose activation blocks are
heads (act_block == head_dim), the merge also writes each (token, head)'s e4m3 row and
scale (Fp8Rows of o [T, Hq * D]): o_proj's quantization launch, gone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.formats import Fp8Rows
from loraplex.ops.metadata import SHORT_QUERY_MAX, AttentionBatch
from loraplex.ops.triton.attention_common import attend_tile
from loraplex.ops.triton.fp8_activations import e4m3_rows
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.precision import INTERPRETED, dot_settings

# Keys per partition: a split covers whole partitions of its sequence's context, so a
# 600-token context splits at most 3 ways. A multiple of BLOCK_N.
PARTITION_SIZE = 256
# Split up to about this many programs (8 per SM on an H200). Measured there
# (`benchmarks/attention_sweep.py`, bf16, contexts of 1,650 tokens in a 2,200-token table,
# us per call): Qwen3-30B-A3B (16 seqs x 4 KV heads, D 128) 25.7 -> 21.5, gpt-oss-20b's
# full layers (16 x 8, D 64) 34.7 -> 20.1 with 264 programs and 64-key tiles before;
# Llama-3.1-8B (32 x 8, 600 tokens) 27.1 unsplit, 27.0 in 4 splits. Each model's best
# was within ~1 us of these (4 splits of ~400 keys for both MoE shapes).
TARGET_PROGRAMS = 1056
# ...unless the batch alone gives this many (sequence, KV head) programs: then one pass
# over each context with 128-key tiles (paged_attention.attention_config) wins. Measured
# (`benchmarks/attention_layout_probe.py`, 32 layers' caches in one graph, us per layer):
# Llama-3.1-8B, 32 x 8 at 600 keys: 24.8 single pass against 27.4 in 3 splits (27.8
# single pass with 64-key tiles). The MoE shapes above have 64 and 128 pairs.
SINGLE_PASS_PAIRS = 256
MAX_SPLITS = 64  # the merge holds one head's partials in one [MAX_SPLITS, BLOCK_D] tile
# The split kernel's key tile and launch: 128-key tiles halve the loop trips of 64
# (Qwen3 25.7 -> 20.1 us at 264 programs); more warps or stages gained nothing. Tiles
# of wider rows (float32, head_dim 256) are cut to TILE_BYTES so they fit in shared memory.
BLOCK_N, NUM_WARPS, NUM_STAGES, TILE_BYTES = 128, 4, 2, 32768


def decode_config(group: int, row_bytes: int, query_len: int = 1) -> dict:
    """row_bytes: one key's head vector (padded head_dim x element size); query_len: the
    most query tokens a sequence has (a tile holds them all, with all their heads)."""
    block_n = min(BLOCK_N, PARTITION_SIZE, max(16, TILE_BYTES // row_bytes))
    return dict(BLOCK_M=max(16, triton.next_power_of_2(group * query_len)), BLOCK_N=block_n,
                num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def num_splits(batch: AttentionBatch, page: int, num_kv_heads: int, sliding_window: int | None) -> int:
    """Programs per (sequence, KV head), from host-known values only (graph safe)."""
    span = batch.block_tables.shape[1] * page  # bounds every context of the batch
    if sliding_window is not None:  # visible keys start at most BLOCK_N - 1 before the first token's window
        span = min(span, sliding_window + batch.max_query_len - 1 + min(BLOCK_N, PARTITION_SIZE) - 1)
    pairs = batch.num_seqs * num_kv_heads
    if pairs >= SINGLE_PASS_PAIRS:
        return 1
    fill = TARGET_PROGRAMS // max(1, pairs)
    return max(1, min(triton.cdiv(span, PARTITION_SIZE), fill, MAX_SPLITS))


_scratch: dict[torch.device, torch.Tensor] = {}
_retired: list[torch.Tensor] = []  # outgrown buffers: graphs captured on them still use them


def _scratch_buffer(numel: int, device: torch.device) -> torch.Tensor:
    buf = _scratch.get(device)
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _retired.append(buf)  # sizes double, so all retired ones sum to less than buf
        buf = torch.empty(triton.next_power_of_2(numel), dtype=torch.float32, device=device)
        _scratch[device] = buf
    return buf[:numel]


@triton.jit
def _spans(ctx_len, q_len, window, splits, PARTITION: tl.constexpr, BLOCK_N: tl.constexpr,
           USE_WINDOW: tl.constexpr):
    """First key any of the sequence's q_len tokens sees, and the keys one split covers."""
    kv_begin = ctx_len * 0
    if USE_WINDOW:  # the first token's window, aligned down as the single-pass kernel does
        kv_begin = tl.maximum(ctx_len - q_len + 1 - window, 0) // BLOCK_N * BLOCK_N
    parts = tl.cdiv(ctx_len - kv_begin, PARTITION)
    return kv_begin, tl.cdiv(parts, splits) * PARTITION


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, acc_ptr, max_ptr, sum_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale, window, splits, num_heads,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    GROUP: tl.constexpr, QUERY_LEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    split = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    ctx_len = tl.load(seq_lens_ptr + seq)
    first_token = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - first_token
    kv_begin, span = _spans(ctx_len, q_len, window, splits, PARTITION, BLOCK_N, USE_WINDOW)
    start = kv_begin + split * span
    if start >= ctx_len:  # past this context (or a padding sequence: ctx_len 0)
        return
    end = tl.minimum(start + span, ctx_len)

    rows = tl.arange(0, BLOCK_M)  # row r: token r // GROUP of the chunk, query head r % GROUP
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_mask = (tok < QUERY_LEN) & (tok < q_len)
    limit = ctx_len - q_len + tok + 1  # keys before each row's token and the token itself
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (first_token + tok)[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    offs_n = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + offs_n
        n_mask = n < end
        visible = n_mask[None, :] & (n[None, :] < limit[:, None])
        if USE_WINDOW:
            visible = visible & (n[None, :] >= limit[:, None] - window)
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, n, n_mask, visible, table, k_cache_ptr, v_cache_ptr, kv_head,
            offs_d, d_mask, stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
            stride_vd, scale, PAGE, DOT_PRECISION, UPCAST)

    slot = ((seq * QUERY_LEN + tok) * num_heads + head) * splits + split  # scratch: [B, Q, Hq, splits, (D)]
    tl.store(acc_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], acc,
             mask=row_mask[:, None] & d_mask[None, :])
    tl.store(max_ptr + slot, m_i, mask=row_mask)
    tl.store(sum_ptr + slot, l_i, mask=row_mask)


@triton.jit
def _decode_merge_kernel(
    acc_ptr, max_ptr, sum_ptr, out_ptr, sinks_ptr, seq_lens_ptr, query_start_loc_ptr, q8_ptr, s8_ptr,
    window, splits, num_heads,
    stride_ot, stride_oh, stride_od,
    QUERY_LEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    PARTITION: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr, FP8: tl.constexpr = False, HAND_ROUND: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.program_id(2)
    first_token = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - first_token
    if tok >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq)
    kv_begin, span = _spans(ctx_len, q_len, window, splits, PARTITION, BLOCK_N, USE_WINDOW)
    s = tl.arange(0, BLOCK_S)
    # The split kernel's exit test (a written partial may still be empty for this token:
    # max -inf, sum 0, which weigh nothing below).
    written = (s < splits) & (kv_begin + s * span < ctx_len)
    slot = ((seq * QUERY_LEN + tok) * num_heads + head) * splits + s
    m = tl.load(max_ptr + slot, mask=written, other=float("-inf"))
    l_s = tl.load(sum_ptr + slot, mask=written, other=0.0)
    m_all = tl.max(m, axis=0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_all = tl.maximum(m_all, sink)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # padding sequence: nothing written
    w = tl.where(written, tl.exp(m - m_all), 0.0)
    total = tl.sum(l_s * w, axis=0)
    if USE_SINKS:
        total += tl.exp(sink - m_all)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    acc = tl.load(acc_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=written[:, None] & d_mask[None, :], other=0.0)
    out = (tl.sum(acc * w[:, None], axis=0) / tl.maximum(total, 1e-30)).to(out_ptr.dtype.element_ty)
    token = first_token + tok
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d * stride_od, out, mask=d_mask)
    if FP8:  # the rounded row, one activation block: o [T, Hq * D]'s e4m3 row and scale
        v, scale = e4m3_rows(out.to(tl.float32)[None, :], HAND_ROUND)
        row = token.to(tl.int64) * num_heads + head
        tl.store(q8_ptr + row * HEAD_DIM + offs_d[None, :], v.to(q8_ptr.dtype.element_ty),
                 mask=d_mask[None, :])
        tl.store(s8_ptr + row + tl.arange(0, 1), scale)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    sliding_window: int | None,
    splits: int,
    sinks: torch.Tensor | None = None,
    fp8: Fp8Rows | None = None,
) -> torch.Tensor:
    """paged_attention for a batch of at most SHORT_QUERY_MAX query tokens per sequence
    (batch.max_query_len), in `splits` pieces. fp8: filled with the output's e4m3 rows in
    blocks of head_dim (Fp8Rows [T, Hq * D], [T, Hq])."""
    num_tokens, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_seqs = batch.num_seqs
    query_len = batch.max_query_len
    assert query_len <= SHORT_QUERY_MAX, query_len
    block_d = max(16, triton.next_power_of_2(head_dim))
    cfg = decode_config(group, block_d * q.element_size(), query_len)
    assert PARTITION_SIZE % cfg["BLOCK_N"] == 0, "a partition is whole key tiles"
    out = torch.empty_like(q)
    # All attention calls on a device share the scratch: they run in stream order, and a
    # partial is dead once merged. Views of one buffer keep its address fixed for graphs.
    n = num_seqs * query_len * num_heads * splits
    buf = _scratch_buffer(n * (head_dim + 2), q.device)
    acc, m, l_s = buf[: n * head_dim], buf[n * head_dim : n * (head_dim + 1)], buf[n * (head_dim + 1) :]
    window = sliding_window or 0
    common = dict(PARTITION=PARTITION_SIZE, BLOCK_N=cfg["BLOCK_N"], USE_WINDOW=sliding_window is not None)
    _decode_split_kernel[(splits, num_seqs, num_kv_heads)](
        q, k_cache, v_cache, acc, m, l_s,
        batch.block_tables, batch.seq_lens, batch.query_start_loc,
        scale, window, splits, num_heads,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        batch.block_tables.stride(0),
        GROUP=group, QUERY_LEN=query_len, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=page,
        BLOCK_M=cfg["BLOCK_M"],
        **common, **dot_settings(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl(),
    )
    block_s = triton.next_power_of_2(splits)
    _decode_merge_kernel[(num_seqs, num_heads, query_len)](
        acc, m, l_s, out, q if sinks is None else sinks, batch.seq_lens, batch.query_start_loc,
        fp8.q if fp8 else out, fp8.scale if fp8 else out,
        window, splits, num_heads, *out.stride(),
        QUERY_LEN=query_len, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=block_s, **common,
        USE_SINKS=sinks is not None, FP8=fp8 is not None, HAND_ROUND=INTERPRETED,
        num_warps=min(8, max(1, block_s * block_d // 1024)),
        **pdl(),
    )
    return out
