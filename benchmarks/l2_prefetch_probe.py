"""Decode step, Llama-3.1-8B shapes: can o_proj's weights be pulled into L2 while the
decode attention runs, so that the o_proj GEMM then reads them from L2?

    python benchmarks/l2_prefetch_probe.py

Decode attention leaves HBM bandwidth unused (~3 TB/s of its ~4.3) for ~25 us per
layer, and o_proj's weights (33.5 MB) fit in the H200's L2. Per layer, in one CUDA graph
over 32 layers' distinct caches and weights:
  - plain: attention, then o_proj (cuBLAS);
  - prefetch: a side-stream kernel bulk-prefetches o_proj's weights into L2 while the
    attention runs (fork before it, join before the GEMM).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from gemm_probe import timed
from pdl_probe import _prefetch_l2

from loraplex import ops
from loraplex.ops.metadata import AttentionBatch

SEQS, CTX, MAX_LEN, HQ, HKV, D, PAGE, LAYERS = 32, 600, 640, 32, 8, 128, 16, 32
CHUNK = 65536


@triton.jit
def _prefetch_kernel(ptr, nbytes, per_program, CHUNK: tl.constexpr, NCHUNKS: tl.constexpr):
    base = ptr.to(tl.pointer_type(tl.int8), bitcast=True) + tl.program_id(0).to(tl.int64) * per_program
    _prefetch_l2(base, tl.minimum(per_program, nbytes - tl.program_id(0).to(tl.int64) * per_program),
                 CHUNK, NCHUNKS)


def prefetch(w: torch.Tensor, programs: int):
    nbytes = w.numel() * w.element_size()
    per = triton.cdiv(nbytes, programs * CHUNK) * CHUNK
    _prefetch_kernel[(programs,)](w, nbytes, per, CHUNK=CHUNK,
                                  NCHUNKS=triton.next_power_of_2(per // CHUNK), num_warps=4)


def main():
    torch.manual_seed(0)
    torch.backends.cuda.preferred_blas_library("cublaslt")
    width = math.ceil(MAX_LEN / PAGE)
    i32 = dict(dtype=torch.int32, device="cuda")
    batch = AttentionBatch(
        slot_mapping=torch.zeros(SEQS, dtype=torch.int64, device="cuda"),
        query_start_loc=torch.arange(SEQS + 1, **i32), seq_lens=torch.full((SEQS,), CTX, **i32),
        block_tables=torch.randperm(SEQS * width, device="cuda").to(torch.int32).view(SEQS, width),
        query_start_loc_cpu=list(range(SEQS + 1)), seq_lens_cpu=[CTX] * SEQS,
        max_query_len=1, max_seq_len=CTX)
    q = torch.randn(SEQS, HQ, D, device="cuda", dtype=torch.bfloat16)
    shape = (SEQS * width, PAGE, HKV, D)
    caches = [(torch.randn(shape, device="cuda", dtype=torch.bfloat16),
               torch.randn(shape, device="cuda", dtype=torch.bfloat16)) for _ in range(LAYERS)]
    wo = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 4096**-0.5 for _ in range(LAYERS)]
    y = torch.empty(SEQS, 4096, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def step(programs: int | None, gemm: bool = True, attn: bool = True):
        for (k, v), w in zip(caches, wo):
            if programs:
                fork = torch.cuda.Event()
                fork.record()
                side.wait_event(fork)
                with torch.cuda.stream(side):
                    prefetch(w, programs)
                join = torch.cuda.Event()
                join.record(side)
            out = ops.paged_attention(q, k, v, batch, D**-0.5, None) if attn else q
            if programs:
                torch.cuda.current_stream().wait_event(join)
            if gemm:
                torch.mm(out.view(SEQS, -1), w.T, out=y)

    def per_layer(fn):
        return timed(fn, rep=200) * 1e3 / LAYERS

    with ops.using_backend("triton"):
        print(f"attention alone      {per_layer(lambda: step(None, gemm=False)):6.1f} us per layer")
        print(f"o_proj alone         {per_layer(lambda: step(None, attn=False)):6.1f} us per layer")
        print(f"prefetch + o_proj    {per_layer(lambda: step(8, attn=False)):6.1f} us per layer")
        for _ in range(2):
            print(f"attention + o_proj   {per_layer(lambda: step(None)):6.1f} us per layer")
            for programs in (1, 4, 16, 64):
                us = per_layer(lambda: step(programs))
                print(f"  + prefetch, {programs:2d} programs {us:6.1f} us per layer")


if __name__ == "__main__":
    main()
