"""Router softmax + top-k (+ renormalisation) in one kernel: one program per token.

Why a kernel: in torch this is a cast, a softmax, a top-k, a sum, a division and an
index cast, six launches per MoE layer; a decode step of a 48-layer model spends more
time launching them than computing. The top k are found by k passes of argmax over the
row (k is small: 2-8), lowest expert index first on ties.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.triton.launch import pdl, wait_for_inputs


@triton.jit
def store_top_k(x, valid, weights_ptr, ids_ptr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token's routing from its float32 logits x [BLOCK_E] (`valid` marks the experts):
    softmax, the TOP_K largest (lowest index first on ties), renormalised if asked,
    stored at weights_ptr / ids_ptr. Shared with the fused router (moe_route_gemv.py)."""
    offs = tl.arange(0, BLOCK_E)
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(valid, p, 0.0)
    p = p / tl.sum(p, 0)
    remaining = tl.where(valid, p, -1.0)  # probabilities are >= 0: -1 marks taken / padding
    slots = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, 0)
        idx = tl.min(tl.where(remaining == best, offs, BLOCK_E), 0)  # lowest index of the max
        w = tl.where(slots == j, best, w)
        ids = tl.where(slots == j, idx, ids)
        remaining = tl.where(offs == idx, -1.0, remaining)
    if RENORMALIZE:
        w = w / tl.sum(w, 0)
    tl.store(weights_ptr + slots, w, mask=slots < TOP_K)
    tl.store(ids_ptr + slots, ids, mask=slots < TOP_K)


@triton.jit(do_not_specialize=["num_experts"])
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    x = tl.load(logits_ptr + t * stride_l + offs, mask=valid, other=-float("inf")).to(tl.float32)
    store_top_k(x, valid, weights_ptr + t * TOP_K, ids_ptr + t * TOP_K, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)


def route_experts(logits: torch.Tensor, top_k: int, renormalize: bool):
    """See loraplex.ops.route_experts."""
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, weights, ids, e, logits.stride(0), TOP_K=top_k,
                            RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(e),
                            BLOCK_K=triton.next_power_of_2(top_k), **pdl())
    return weights, ids
