"""Attention for training, bounded by this function rather than by transformers' masks.

transformers' SDPA path builds a mask for every step: for a packed row a [tokens,
tokens] one, which moves SDPA off its fused causal kernels onto the masked
memory-efficient kernel (H100, Qwen3-30B-A3B's 32 x 128 heads, 16K tokens: 54 ms a
layer forward + backward against 14 for cuDNN's causal kernel); it reads position ids
back to the host to look for packing (a sync); and while a CUDA graph is captured it
assumes every row may be packed and builds the full mask. Registered as "loraplex" in
transformers' AttentionInterface and not among its mask functions, a model set to it gets
no mask at all, and this function bounds attention from what it knows:
- causality (a causal LM in training);
- the layer's sliding window (`sliding_window`, which transformers passes per layer;
  a query at i sees keys i - window < j <= i, as transformers' sliding mask);
- packed examples: `cu_seq_lens_q` (int32 [n + 1], where each example starts, then the
  row's length) and `max_length_q`, transformers' names for them, which it forwards from
  the model's call to each layer. `data.pack` makes them. Trailing repeats of the row
  length (empty examples) are allowed: a CUDA graph captures a fixed count.

Kernels: a whole causal row takes SDPA with cuDNN first (H100 at 16K: 14.2 ms against
24.0 for flash), packed rows and windows flash's variable-length kernel; on a CPU, SDPA
per example with an explicit mask (what the tests compare against transformers).
Attention sinks and logit softcapping are not here: `training_attention` gives those
models FlexAttention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "loraplex"

# SDPA's kernels in the order tried for a whole causal row.
_SDPA_ORDER = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None,
                      sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, Hq, S, D], key / value
    [B, Hkv, S, D] -> ([B, S, Hq, D], None)."""
    for unsupported in ("s_aux", "softcap", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"loraplex's training attention has no {unsupported}: train this model with "
                             "FlexAttention (attn_implementation='flex_attention')")
    if attention_mask is not None or is_causal is False:
        raise ValueError("loraplex's training attention is causal over whole or packed rows: "
                         "pass no attention_mask (pack the examples instead of padding them)")
    if dropout:
        raise ValueError("loraplex's training attention has no dropout")
    cu = kwargs.get("cu_seq_lens_q")
    window = sliding_window if sliding_window and sliding_window < query.shape[2] else None
    flash = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256
    if flash and (cu is not None or window is not None):
        return _flash_varlen(query, key, value, cu, kwargs.get("max_length_q"), scaling, window), None
    if query.is_cuda and cu is None and window is None:
        return _sdpa_causal_row(query, key, value, scaling), None
    return _reference(query, key, value, cu, scaling, window), None


def _sdpa_causal_row(query, key, value, scaling):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [getattr(SDPBackend, name) for name in _SDPA_ORDER]
    gqa = query.shape[1] != key.shape[1]
    with sdpa_kernel(order, set_priority=True):
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2)


def _flash_varlen(query, key, value, cu, max_len, scaling, window):
    b, hq, s, d = query.shape
    if cu is None:  # a window over whole rows: each row an example
        cu = torch.arange(0, (b + 1) * s, s, device=query.device, dtype=torch.int32)
        max_len = s
    elif b != 1:
        raise ValueError("packed examples come as one row (batch 1)")
    dv = value.shape[-1]
    if dv != d:  # DeepSeek's values are narrower than its keys: flash takes one head size
        value = F.pad(value, (0, d - dv))
    tokens = lambda t: t.transpose(1, 2).reshape(b * s, t.shape[1], d)  # noqa: E731  [T, H, D]
    cu, longest = cu.to(torch.int32), int(max_len or s)
    left, right = (window - 1, 0) if window else (-1, -1)
    out = torch.ops.aten._flash_attention_forward(
        tokens(query), tokens(key), tokens(value), cu, cu, longest, longest, 0.0, True, False,
        scale=scaling, window_size_left=left, window_size_right=right)[0]
    return out.view(b, s, hq, d)[..., :dv]


def _reference(query, key, value, cu, scaling, window):
    """SDPA per example with an explicit causal (and windowed) mask."""
    b, hq, s, d = query.shape
    rep = hq // key.shape[1]
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    bounds = [0, s] if cu is None else sorted(set(cu.tolist()))
    out = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        i = torch.arange(end - start, device=query.device)
        keep = i[:, None] >= i[None, :]
        if window:
            keep &= i[:, None] - i[None, :] < window
        out.append(F.scaled_dot_product_attention(query[:, :, start:end], key[:, :, start:end],
                                                  value[:, :, start:end], attn_mask=keep, scale=scaling))
    return torch.cat(out, dim=2).transpose(1, 2)


def in_use(model) -> bool:
    """Whether `model` attends through this function (its rows bounded by cu_seq_lens)."""
    return model.config._attn_implementation == NAME


def register() -> str:
    """Make NAME an attn_implementation transformers accepts (idempotent); returns NAME."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention_forward)
    return NAME
