"""Multi-head latent attention in plain torch (float32), kv_b_proj absorbed: the oracle
of ops.mla_attention."""

from __future__ import annotations

import torch

from loraplex.ops.metadata import AttentionBatch, MLALoRA


def write_latent_cache(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0  # negative slots mark padding tokens
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping[keep], latent[keep].to(cache.dtype))


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, w_uk: torch.Tensor,
                  w_uv: torch.Tensor, batch: AttentionBatch, scale: float,
                  lora: MLALoRA | None = None) -> torch.Tensor:
    rank = w_uk.shape[-1]
    q_lat = torch.einsum("thn,hnr->thr", q_nope.float(), w_uk.float())
    groups = adapter_groups(lora)
    for slot, idx in groups:  # + A_s^T (B_k[s, h]^T q_nope): the key rows' adapter delta
        u = torch.einsum("thn,hnk->thk", q_nope[idx].float(), lora.b_k[slot].float())
        q_lat[idx] += torch.einsum("thk,kr->thr", u, lora.a[slot].float())
    o_lat = torch.zeros_like(q_lat)
    for q0, q1, rows, mask in sequence_contexts(cache, batch):
        c, k_pe = rows[:, :rank].float(), rows[:, rank:].float()
        scores = (torch.einsum("qhr,kr->hqk", q_lat[q0:q1], c)
                  + torch.einsum("qhd,kd->hqk", q_pe[q0:q1].float(), k_pe)) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        o_lat[q0:q1] = torch.einsum("hqk,kr->qhr", probs, c)
    out = torch.einsum("thr,hvr->thv", o_lat, w_uv.float())
    for slot, idx in groups:  # + B_v[s, h] (A_s o_lat): the value rows' adapter delta
        u = torch.einsum("thr,kr->thk", o_lat[idx], lora.a[slot].float())
        out[idx] += torch.einsum("thk,hvk->thv", u, lora.b_v[slot].float())
    return out.to(q_nope.dtype)


def sequence_contexts(cache: torch.Tensor, batch: AttentionBatch):
    """For each sequence with query tokens and context: its query rows [q0, q1), its
    cache rows [context, D] and the causal mask [q1 - q0, context] (a query token sees the
    keys up to its own position). Sequences without either (padding) are passed over."""
    page = cache.shape[1]
    qsl = batch.query_start_loc_cpu
    for b, ctx_len in enumerate(batch.seq_lens_cpu):
        q0, q1 = qsl[b], qsl[b + 1]
        if ctx_len == 0 or q0 == q1:
            continue
        pages = batch.block_tables[b, : -(-ctx_len // page)]
        rows = cache[pages].reshape(-1, cache.shape[-1])[:ctx_len]
        positions = torch.arange(ctx_len, device=cache.device)
        yield q0, q1, rows, positions[None, :] <= positions[ctx_len - (q1 - q0):, None]


def adapter_groups(lora: MLALoRA | None) -> list[tuple[int, torch.Tensor]]:
    """(slot, token indices) of each adapter group of the step."""
    if lora is None:
        return []
    ids = lora.batch.sorted_token_ids
    return [(g.slot, ids[g.start:g.end]) for g in lora.batch.groups if g.end > g.start]
