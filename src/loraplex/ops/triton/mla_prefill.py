"""Multi-head latent attention for steps with longer chunks (prefill, verification):
keys and values expanded from the latents, then attention in the model's dtype (torch's
scaled_dot_product_attention, flash kernels on a GPU), sequence by sequence (eager steps:
the loop reads the batch on the host).

A prefill chunk has many query tokens per sequence, so expanding each context latent into
per-head keys and values once (one GEMM through kv_b_proj, plus the sequence's adapter
delta (c A^T) B^T) costs less than absorbing kv_b_proj into every query (each score then
spans kv_lora_rank + rope dims instead of nope + rope)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.ops.metadata import AttentionBatch, MLALoRA


def mla_prefill_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, w_uk: torch.Tensor,
                          w_uv: torch.Tensor, batch: AttentionBatch, scale: float,
                          lora: MLALoRA | None = None) -> torch.Tensor:
    """ops.mla_attention for any step (query chunks of any length)."""
    heads, nope, rank = w_uk.shape
    w = torch.cat((w_uk, w_uv), 1).reshape(-1, rank)  # kv_b_proj's weight [H * (nope + v), r]
    slot_of = _slots(lora, q_nope.shape[0])
    out = q_nope.new_zeros(q_nope.shape[0], heads, w_uv.shape[1])
    page = cache.shape[1]
    qsl = batch.query_start_loc_cpu
    for b, ctx_len in enumerate(batch.seq_lens_cpu):
        q0, q1 = qsl[b], qsl[b + 1]
        if ctx_len == 0 or q0 == q1:  # padding: no key to attend to
            continue
        pages = batch.block_tables[b, : -(-ctx_len // page)]
        rows = cache[pages].reshape(-1, cache.shape[-1])[:ctx_len]
        latent, k_pe = rows[:, :rank], rows[:, rank:]
        kv = latent @ w.T
        slot = slot_of.get(q0, -1)
        if slot >= 0:  # the sequence's adapter on kv_b_proj: + (c A^T) B^T
            b_kv = torch.cat((lora.b_k[slot], lora.b_v[slot]), 1).reshape(-1, lora.a.shape[1])
            kv = kv + (latent @ lora.a[slot].T) @ b_kv.T
        k_nope, v = kv.view(ctx_len, heads, -1).split((nope, w_uv.shape[1]), -1)
        k = torch.cat((k_nope, k_pe[:, None].expand(-1, heads, -1)), -1)
        q = torch.cat((q_nope[q0:q1], q_pe[q0:q1]), -1)
        n = q1 - q0
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= torch.arange(
            ctx_len - n, ctx_len, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=scale)
        out[q0:q1] = o.transpose(0, 1)
    return out


def _slots(lora: MLALoRA | None, num_tokens: int) -> dict[int, int]:
    """First token of each adapter group's runs -> its slot (a sequence's tokens share one)."""
    if lora is None:
        return {}
    ids = lora.batch.sorted_token_ids.tolist()
    return {t: g.slot for g in lora.batch.groups for t in ids[g.start:g.end]}
