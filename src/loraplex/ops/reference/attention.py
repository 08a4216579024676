"""Plain-torch attention over the paged KV cache: the CPU path and the kernels' oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.ops.formats import Fp8Rows
from loraplex.ops.metadata import AttentionBatch
from loraplex.ops.reference.elementwise import rotary_embedding
from loraplex.ops.reference.quant import quantize_activations


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_kv_heads, head_dim = k_cache.shape[-2:]
    keep = slot_mapping >= 0  # negative slots mark padding tokens
    k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def rotate_and_store(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, qk_norm=None):
    """rotary_embedding, then write_kv_cache, as the two ops run them."""
    q, k = rotary_embedding(q, k, positions, cos_sin, qk_norm)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return q


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
    out = _paged_attention(q, k_cache, v_cache, batch, scale, sliding_window, sinks)
    if not fp8_block:
        return out
    return out, Fp8Rows(*quantize_activations(out.reshape(out.shape[0], -1), fp8_block))


def _paged_attention(q, k_cache, v_cache, batch, scale, sliding_window, sinks) -> torch.Tensor:
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    out = torch.empty_like(q)
    qsl = batch.query_start_loc_cpu
    for b, ctx_len in enumerate(batch.seq_lens_cpu):
        q_start, q_end = qsl[b], qsl[b + 1]
        n = q_end - q_start
        if ctx_len == 0:  # padding: no key to attend to
            out[q_start:q_end] = 0
            continue
        pages = batch.block_tables[b, : -(-ctx_len // block_size)]
        k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:ctx_len]
        v = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:ctx_len]
        q_pos = torch.arange(ctx_len - n, ctx_len, device=q.device)[:, None]
        k_pos = torch.arange(ctx_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        qb, k, v = q[q_start:q_end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if sinks is None:
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            o = _attention_with_sinks(qb, k, v, mask, scale, sinks)
        # Rows with no visible key (a context shorter than the query: padding) are zero.
        out[q_start:q_end] = o.transpose(0, 1).masked_fill(~mask.any(-1)[:, None, None], 0)
    return out


def _attention_with_sinks(q, k, v, mask, scale, sinks):
    """SDPA has no sinks: scores in float32, each head's sink logit as one more column
    of the softmax, dropped before multiplying by V. q [Hq, n, D], k/v [Hkv, L, D]."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0).float(), v.repeat_interleave(group, 0).float()
    scores = (q.float() @ k.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
    sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
    probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
    return (probs @ v).to(q.dtype)
