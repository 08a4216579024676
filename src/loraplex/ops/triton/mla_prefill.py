"""Multi-head latent attention for steps with longer chunks (prefill, verification):
keys and values expanded from the latents, then attention in the model's dtype (torch's
scaled_dot_product_attention, flash kernels on a GPU, v padded to the query's head size),
sequence by sequence (eager steps: the loop reads the batch on the host).

A prefill chunk has many query tokens per sequence, so expanding each context latent into
per-head keys and values once (one GEMM through kv_b_proj, plus the sequence's adapter
delta (c A^T) B^T) costs less than absorbing kv_b_proj into every query (each score then
spans kv_lora_rank + rope dims instead of nope + rope)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.ops.metadata import AttentionBatch, MLALoRA
from loraplex.ops.reference.mla import sequence_contexts


def mla_prefill_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, w_uk: torch.Tensor,
                          w_uv: torch.Tensor, batch: AttentionBatch, scale: float,
                          lora: MLALoRA | None = None) -> torch.Tensor:
    """ops.mla_attention for any step (query chunks of any length)."""
    heads, nope, rank = w_uk.shape
    w = torch.cat((w_uk, w_uv), 1).reshape(-1, rank)  # kv_b_proj's weight [H * (nope + v), r]
    # Each token's adapter slot, on the host (a sequence's tokens share one).
    slots = None if lora is None else lora.batch.host_token_slot
    assert lora is None or slots is not None, "latent-attention prefill runs eagerly"
    out = q_nope.new_zeros(q_nope.shape[0], heads, w_uv.shape[1])  # padding rows stay 0
    for q0, q1, rows, mask in sequence_contexts(cache, batch):
        latent, k_pe = rows[:, :rank], rows[:, rank:]
        kv = latent @ w.T
        slot = -1 if slots is None else int(slots[q0])
        if slot >= 0:  # the sequence's adapter on kv_b_proj: + (c A^T) B^T
            b_kv = torch.cat((lora.b_k[slot], lora.b_v[slot]), 1).reshape(-1, lora.a.shape[1])
            kv = kv + (latent @ lora.a[slot].T) @ b_kv.T
        k_nope, v = kv.view(len(rows), heads, -1).split((nope, w_uv.shape[1]), -1)
        k = torch.cat((k_nope, k_pe[:, None].expand(-1, heads, -1)), -1)
        q = torch.cat((q_nope[q0:q1], q_pe[q0:q1]), -1)
        # Torch's flash kernel wants one head size for q, k and v (DeepSeek: 192, 192, 128):
        # v is zero-padded to it and the output cut back. A whole prompt (no cached context)
        # is plain causal attention, with no mask tensor; without these (and 4-D inputs), SDPA
        # falls back to its float32 math path (~70% of a V2-Lite prompt step).
        v_dim = v.shape[-1]
        if v_dim < q.shape[-1]:
            v = F.pad(v, (0, q.shape[-1] - v_dim))
        whole = q1 - q0 == len(rows)
        # [1, H, tokens, D]: the fused kernels take 4-D inputs only
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if whole else mask, is_causal=whole,
                                           scale=scale)
        out[q0:q1] = o[0].transpose(0, 1)[..., :v_dim]
    return out
