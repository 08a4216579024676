"""Multi-head latent attention for decode steps (one query token per sequence), kv_b_proj
absorbed (ops.mla_attention's semantics).

Around the kernel, batched GEMMs absorb kv_b_proj: q_lat = W_uk^T q_nope per head before,
o = W_uv o_lat after; an adapter on kv_b_proj adds its two rank-R terms per token
(mla_lora.py: each token's slot read on the device, so decode steps replay from CUDA
graphs). The kernel reads the paged latent cache: program (split, sequence, head block)
scores a span of the sequence's context against all the block's heads at once (row =
head: every head reads the same latent rows, which is what makes MLA's cache small) with
score = q_lat . c + q_pe . k_pe, and keeps an online softmax's max, sum and unnormalised
sum of latents in float32 scratch; a merge over the splits (log-sum-exp, in torch)
gives o_lat. The split count depends on host-known bounds only (the block table's width,
the batch size), so a captured step is right for any context lengths; a split past its
sequence's context leaves an empty partial, and a sequence with no context gets zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.metadata import AttentionBatch, MLALoRA
from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.mla_lora import add_key_delta, add_value_delta
from loraplex.ops.triton.precision import dot_settings

PARTITION_SIZE = 256  # keys per split at least (a multiple of BLOCK_N)
TARGET_PROGRAMS = 528  # split until about this many programs (4 per SM on an H200)
MAX_SPLITS = 32
BLOCK_H, BLOCK_N = 16, 32  # heads per program (tl.dot's least M); keys per tile


def mla_decode_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, w_uk: torch.Tensor,
                         w_uv: torch.Tensor, batch: AttentionBatch, scale: float,
                         lora: MLALoRA | None = None) -> torch.Tensor:
    """ops.mla_attention for a step of one query token per sequence."""
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, r]
    if lora is not None:
        add_key_delta(q_lat, q_nope, lora)
    o_lat = latent_attention(q_lat.to(cache.dtype), q_pe.to(cache.dtype), cache, batch, scale)
    out = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
    if lora is not None:
        add_value_delta(out, o_lat, lora)
    return out.to(q_nope.dtype)


def num_splits(batch: AttentionBatch, page: int, num_heads: int) -> int:
    """Programs per (sequence, head block), from host-known values only (graph safe)."""
    span = batch.block_tables.shape[1] * page
    programs = batch.num_seqs * triton.cdiv(num_heads, BLOCK_H)
    fill = max(1, TARGET_PROGRAMS // max(1, programs))
    return max(1, min(triton.cdiv(span, PARTITION_SIZE), fill, MAX_SPLITS))


def latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, batch: AttentionBatch,
                     scale: float) -> torch.Tensor:
    """q_lat [S, H, r], q_pe [S, H, d] (one token per sequence) over cache
    [pages, page, r + d] -> o_lat [S, H, r] (the softmax-weighted sum of latents)."""
    seqs, heads, rank = q_lat.shape
    rope = q_pe.shape[-1]
    page = cache.shape[1]
    splits = num_splits(batch, page, heads)
    acc = torch.empty(seqs, splits, heads, rank, dtype=torch.float32, device=q_lat.device)
    stats = torch.empty(seqs, splits, heads, 2, dtype=torch.float32, device=q_lat.device)
    grid = (splits, seqs, triton.cdiv(heads, BLOCK_H))
    _mla_split[grid](
        q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, acc, stats, scale,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0), cache.stride(1),
        batch.block_tables.stride(0), heads, splits, rank, rope,
        R_PAD=max(16, triton.next_power_of_2(rank)), D_PAD=max(16, triton.next_power_of_2(rope)),
        PAGE=page, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, **dot_settings(cache.dtype), num_warps=4, **pdl(),
    )
    # Merge: each split's sum of exp(s - m_split); empty splits have m = -inf and sum 0.
    m, total = stats[..., 0], stats[..., 1]
    top = m.amax(1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp(m - top)  # [S, splits, H]
    den = (w * total).sum(1).clamp(min=1e-30)
    return ((w[..., None] * acc).sum(1) / den[..., None]).to(q_lat.dtype)


@triton.jit
def _mla_split(q_lat, q_pe, cache, block_tables, seq_lens, acc_out, stats_out, scale,
               stride_qt, stride_qh, stride_pt, stride_ph, stride_cp, stride_cs, stride_bt,
               H, NUM_SPLITS, R, D, R_PAD: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
               BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
               DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    split, seq, hb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    per = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per
    end = tl.minimum(start + per, seq_len)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    r = tl.arange(0, R_PAD)
    d = tl.arange(0, D_PAD)
    rmask, dmask = r < R, d < D
    q = tl.load(q_lat + seq * stride_qt + heads[:, None] * stride_qh + r[None, :],
                mask=hmask[:, None] & rmask[None, :], other=0.0)
    qp = tl.load(q_pe + seq * stride_pt + heads[:, None] * stride_ph + d[None, :],
                 mask=hmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q, qp = q.to(tl.float32), qp.to(tl.float32)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        pages = tl.load(block_tables + seq * stride_bt + pos // PAGE, mask=valid, other=0)
        rows = cache + pages.to(tl.int64) * stride_cp + (pos % PAGE) * stride_cs
        c = tl.load(rows[:, None] + r[None, :], mask=valid[:, None] & rmask[None, :], other=0.0)
        k = tl.load(rows[:, None] + R + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        if UPCAST:
            c, k = c.to(tl.float32), k.to(tl.float32)
        s = (tl.dot(q, tl.trans(c), input_precision=DOT_PRECISION)
             + tl.dot(qp, tl.trans(k), input_precision=DOT_PRECISION)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m = m_new
    out = ((seq * NUM_SPLITS + split) * H + heads).to(tl.int64)
    tl.store(acc_out + out[:, None] * R + r[None, :], acc, mask=hmask[:, None] & rmask[None, :])
    tl.store(stats_out + out * 2, m, mask=hmask)
    tl.store(stats_out + out * 2 + 1, total, mask=hmask)
