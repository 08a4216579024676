"""Store a step's keys and values (or latent-attention rows) into their KV cache slots.

One program per token copies its [Hkv, D] key and value rows (or its one latent row) to
slot slot_mapping[t] = page * PAGE + offset. A negative slot marks padding (tokens a CUDA
graph runs for a batch smaller than it was captured for) and is skipped on the device,
so the write replays from a graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.ops.triton.launch import pdl, wait_for_inputs


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    page, off = slot // PAGE, slot % PAGE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV) & (d < HEAD_DIM)
    dst = page * stride_cb + off * stride_cs + h * stride_ch + d
    tl.store(kc_ptr + dst, tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask), mask=mask)
    tl.store(vc_ptr + dst, tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask), mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_kv, head_dim = k.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV=num_kv, HEAD_DIM=head_dim, PAGE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
        **pdl(),
    )


@triton.jit
def _write_rows_kernel(src_ptr, cache_ptr, slot_ptr, stride_t, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    d = tl.arange(0, BLOCK)
    mask = d < WIDTH
    row = tl.load(src_ptr + t * stride_t + d, mask=mask)
    tl.store(cache_ptr + slot * WIDTH + d, row.to(cache_ptr.dtype.element_ty), mask=mask)


def write_latent_cache(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """ops.write_latent_cache: latent [T, D] rows into cache [pages, PAGE, D] (contiguous)."""
    assert cache.is_contiguous() and latent.stride(-1) == 1
    width = cache.shape[-1]
    _write_rows_kernel[(latent.shape[0],)](
        latent, cache, slot_mapping, latent.stride(0), WIDTH=width, BLOCK=triton.next_power_of_2(width),
        num_warps=4,
        **pdl(),
    )
