"""The router's logits and their routing in one launch, for decode-sized steps:
logits = x W^T + b, rounded to x's dtype as the GEMM stores them, then route_experts'
softmax, top-k and renormalisation (moe_route.store_top_k).

Why: in a decode step the router is a GEMM of a few tokens by a few dozen experts
(gpt-oss [32, 2880], Qwen3-MoE [128, 2048]): cuBLAS runs it as a split-K GEMM and a
reduction, and the routing kernel then reads the logits: three launches in a row for a
fraction of a megabyte of weights. Here each program takes one token and BLOCK_E experts,
reduces their dot products over all of K in registers (K in a few chunks whose loads go
out together), and writes its rounded logits; the token's last program to finish (a
per-token ticket) routes the whole row and sets the ticket back to zero. The tickets are
one int32 per token row, shared by every launch on the device: launches are stream-
ordered, and each leaves them at zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.triton.launch import pdl, wait_for_inputs
from loraplex.ops.triton.moe_route import store_top_k

# Up to this many tokens the router runs here; above it, as a GEMM and route_experts.
MAX_TOKENS = 64
# Experts a program, columns of K a chunk, warps (sized for gpt-oss's and Qwen3-MoE's
# routers on an H200: benchmarks/LOG.md, "The router in one launch").
BLOCK_E, BLOCK_K, NUM_WARPS = 4, 2048, 8


@triton.jit(do_not_specialize=["num_experts"])
def _route_gemv_kernel(
    x_ptr, w_ptr, b_ptr, logits_ptr, tickets_ptr, weights_ptr, ids_ptr,
    num_experts, stride_x, stride_w,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, E_BLOCKS: tl.constexpr, ALL_E: tl.constexpr,
    TOPK_BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = e < num_experts
    acc = tl.zeros([BLOCK_E, BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: every chunk's loads in flight at once
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xv = tl.load(x_ptr + t * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + e[:, None] * stride_w + k[None, :], mask=e_mask[:, None] & k_mask[None, :],
                     other=0.0)
        acc += wv.to(tl.float32) * xv[None, :]
    logits = tl.sum(acc, axis=1)
    if HAS_BIAS:
        logits += tl.load(b_ptr + e, mask=e_mask, other=0.0).to(tl.float32)
    logits = logits.to(x_ptr.dtype.element_ty).to(tl.float32)  # as the GEMM's output is stored
    if E_BLOCKS == 1:  # the program holds the whole row
        store_top_k(tl.where(e_mask, logits, -float("inf")), e_mask, weights_ptr + t * TOP_K,
                    ids_ptr + t * TOP_K, TOP_K, RENORMALIZE, BLOCK_E, TOPK_BLOCK)
    else:
        tl.store(logits_ptr + t * ALL_E + e, logits, mask=e_mask)
        tl.debug_barrier()  # every thread's logits stored before the ticket is taken
        # acq_rel: the programs before published their logits; the last one sees them all.
        ticket = tl.atomic_add(tickets_ptr + t, 1)
        if ticket == E_BLOCKS - 1:
            row = tl.arange(0, ALL_E)
            valid = row < num_experts
            # From L2 (.cg): the other programs' logits never passed through this SM's L1.
            x = tl.load(logits_ptr + t * ALL_E + row, mask=valid, other=-float("inf"), cache_modifier=".cg")
            store_top_k(x, valid, weights_ptr + t * TOP_K, ids_ptr + t * TOP_K, TOP_K, RENORMALIZE, ALL_E,
                        TOPK_BLOCK)
            tl.store(tickets_ptr + t, 0)


_tickets: dict[str, torch.Tensor] = {}


def _tickets_for(device: torch.device) -> torch.Tensor:
    """int32 [MAX_TOKENS] zeros, one per device. Cached: the first (eager) call creates
    it, so CUDA graph replays read a stable tensor; every launch leaves it at zero."""
    key = str(device)
    if key not in _tickets:
        _tickets[key] = torch.zeros(MAX_TOKENS, dtype=torch.int32, device=device)
    return _tickets[key]


def route_tokens_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                      renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """See loraplex.ops.route_tokens; x [T, K] with T <= MAX_TOKENS, weight [E, K]."""
    t, k = x.shape
    e = weight.shape[0]
    assert t <= MAX_TOKENS and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=x.device)
    if t == 0:
        return weights, ids
    all_e = triton.next_power_of_2(e)
    block_e = min(BLOCK_E, all_e)
    e_blocks = triton.cdiv(e, block_e)
    logits = torch.empty(t, all_e, dtype=torch.float32, device=x.device) if e_blocks > 1 else weights
    _route_gemv_kernel[(t, e_blocks)](
        x, weight, bias if bias is not None else weight, logits, _tickets_for(x.device), weights, ids,
        e, x.stride(0), weight.stride(0),
        K=k, HAS_BIAS=bias is not None, TOP_K=top_k, RENORMALIZE=renormalize,
        BLOCK_E=block_e, BLOCK_K=min(BLOCK_K, triton.next_power_of_2(k)), E_BLOCKS=e_blocks,
        ALL_E=all_e, TOPK_BLOCK=triton.next_power_of_2(top_k), num_warps=NUM_WARPS,
        **pdl(),
    )
    return weights, ids
