"""LoRA shrink for decode, one program per token (GEMV form, as Punica's BGMV):
out[s, t, :r] = x[t] @ A[s, slot(t), :r].T.

In a decode step each request brings one token and, with many adapters, its own A:
there is no matrix to multiply, only a matrix-vector product per token over weights
read once. Tensor-core tiles would be 1/16 full, so the product is a multiply and a
reduction in registers over BLOCK_K chunks of A[slot] [r, K], whose rows are contiguous
along K. Only the token's own rank is read. The grid depends on the token count alone,
so a CUDA graph serves any adapter mix.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.metadata import LoRABatch
from loraplex.ops.triton.launch import pdl, wait_for_inputs

# Tuned on H200 for Llama-3.1-8B decode (benchmarks/kernels.py; benchmarks/LOG.md).
BLOCK_K = 256
NUM_WARPS = 4
# Split K until the launch has about this many programs per SM: one token's A is a
# single long row block, and one program streaming it alone cannot fill the memory pipe.
PROGRAMS_PER_SM = 4
MAX_SPLIT_K = 32


@triton.jit
def _shrink_gemv_kernel(
    x_ptr, a_ptr, out_ptr, token_slot_ptr, slot_ranks_ptr,
    K,
    stride_xm, stride_as, stride_al, stride_ar, stride_os, stride_om,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    pid_sk = tl.program_id(0)
    t = tl.program_id(1)
    s = pid_sk // SPLIT_K
    k_split = pid_sk % SPLIT_K
    slot = tl.load(token_slot_ptr + t)
    if slot < 0:
        return
    rank = tl.load(slot_ranks_ptr + slot)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < rank
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + s * stride_as + slot * stride_al + r[:, None] * stride_ar
    # Accumulate elementwise and reduce once at the end: the loop is loads and FMAs only.
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    k_chunk = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    for k0 in range(k_split * k_chunk, tl.minimum((k_split + 1) * k_chunk, K), BLOCK_K):
        k = k0 + offs_k
        if EVEN_K:
            x = tl.load(x_ptr + t * stride_xm + k).to(tl.float32)
            a = tl.load(a_rows + k[None, :], mask=r_mask[:, None], other=0.0)
        else:
            x = tl.load(x_ptr + t * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
            a = tl.load(a_rows + k[None, :], mask=r_mask[:, None] & (k < K)[None, :], other=0.0)
        acc += a.to(tl.float32) * x[None, :]
    total = tl.sum(acc, axis=1)
    out = out_ptr + s * stride_os + t * stride_om + r
    if SPLIT_K == 1:
        tl.store(out, total, mask=r_mask)
    else:
        tl.atomic_add(out, total, mask=r_mask)



def lora_shrink_gemv(x: torch.Tensor, lora_a: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    num_slices, _, max_rank, in_features = lora_a.shape
    num_tokens = x.shape[0]
    assert lora_a.stride(3) == 1 and x.stride(1) == 1
    block_k = min(BLOCK_K, triton.next_power_of_2(in_features))
    split_k = _split_k(num_slices * num_tokens, triton.cdiv(in_features, block_k), x.device)
    out = (torch.zeros if split_k > 1 else torch.empty)(
        num_slices, num_tokens, max_rank, dtype=torch.float32, device=x.device
    )
    _shrink_gemv_kernel[(num_slices * split_k, num_tokens)](
        x, lora_a, out, batch.token_slot, batch.slot_ranks,
        in_features,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_R=triton.next_power_of_2(max_rank), BLOCK_K=block_k, SPLIT_K=split_k,
        EVEN_K=in_features % block_k == 0,
        num_warps=NUM_WARPS,
        **pdl(),
    )
    return out


def _split_k(rows: int, k_blocks: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.next_power_of_2(triton.cdiv(PROGRAMS_PER_SM * sms, rows))
    return max(1, min(want, MAX_SPLIT_K, triton.next_power_of_2(k_blocks)))


