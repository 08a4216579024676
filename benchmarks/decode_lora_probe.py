"""Adapter kernels of a decode step, isolated: many layers of distinct weights in one CUDA
graph (so weights come from HBM, as in the model), us per layer, variants side by side.

    python benchmarks/decode_lora_probe.py [--part moe dense] [--out probe.json]

moe: one MoE layer's experts (Qwen3-30B-A3B, gpt-oss-20b shapes), 16 tokens, 16 adapters
on every expert: base, expert adapters per pair (GEMV form, n_split swept) and aligned
by (slot, expert), and their kernels alone.
dense: Llama-3.1-8B's four projections per layer, 32 tokens of 32 adapters: base GEMMs,
LoRA GEMV shrink beside the GEMM (as decode graphs run it) or after it, or split over rank
rows instead of K (no zero fill, no atomics), and the shrink
folded into the base GEMM (A stacked under W: one cuBLAS call) or as its own cuBLAS call,
each with the GEMV expand reading its token's slot columns.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

ROWS = []


def timed(label, fn, per):
    fn()
    torch.cuda.synchronize()
    us = triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3 / per
    ROWS.append(dict(case=label, us=us))
    print(f"{label:70s} {us:8.2f} us", flush=True)
    return us


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---------------------------------------------------------------- MoE
MOE = {"qwen3-30b-a3b": (128, 2048, 768, 8), "gpt-oss-20b": (32, 2880, 2880, 4)}


def moe(layers=6, t=16, slots=16, rank=16):
    for name, shape in MOE.items():
        moe_case(name, *shape, layers, t, slots, rank)
        torch.cuda.empty_cache()


def moe_case(name, e, h, i, k, layers, t, slots, rank):
    from loraplex import ops
    from loraplex.ops.metadata import MoELoRA
    from loraplex.ops.triton import fused_moe, moe_lora_gemv
    from loraplex.ops.triton.moe_align import align_lora
    from loraplex.ops.triton.moe_lora import moe_lora

    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(dev).manual_seed(0)
    w_gu = [(torch.randn(e, 2 * i, h, device=dev, generator=gen) * 0.02).to(dt) for _ in range(layers)]
    w_d = [(torch.randn(e, h, i, device=dev, generator=gen) * 0.02).to(dt) for _ in range(layers)]
    loras = [MoELoRA(torch.randn(slots, e, 2 * rank, h, device=dev, dtype=dt) * 0.02,
                     torch.randn(slots, e, 2 * i, 2 * rank, device=dev, dtype=dt) * 0.02,
                     torch.randn(slots, e, rank, i, device=dev, dtype=dt) * 0.02,
                     torch.randn(slots, e, h, rank, device=dev, dtype=dt) * 0.02,
                     torch.arange(t, device=dev, dtype=torch.int32) % slots,
                     torch.ones(slots, device=dev, dtype=torch.int32),
                     torch.full((2, slots), rank, device=dev, dtype=torch.int32).mul_(
                         torch.tensor([[2], [1]], device=dev, dtype=torch.int32)))
             for _ in range(layers)]
    x = torch.randn(t, h, device=dev, generator=gen).to(dt)
    weights, ids = ops.route_experts(torch.randn(t, e, device=dev, generator=gen), k, True)

    def run(with_lora):
        for j in range(layers):
            fused_moe.fused_experts(x, weights, ids, w_gu[j], w_d[j],
                                    lora=loras[j] if with_lora else None)

    timed(f"{name} base", lambda: run(False), layers)
    out_gemv = fused_moe.fused_experts(x, weights, ids, w_gu[0], w_d[0], lora=loras[0])
    timed(f"{name} + adapters, per pair (auto n_split)", lambda: run(True), layers)
    orig = moe_lora_gemv.splits_per_pair
    for ns in (1, 2):
        moe_lora_gemv.splits_per_pair = lambda *a, ns=ns: ns
        timed(f"{name} + adapters, per pair, n_split {ns}", lambda: run(True), layers)
    moe_lora_gemv.splits_per_pair = orig
    gemv_max = fused_moe.GEMV_MAX_TOKENS
    fused_moe.GEMV_MAX_TOKENS = 0
    out_aligned = fused_moe.fused_experts(x, weights, ids, w_gu[0], w_d[0], lora=loras[0])
    timed(f"{name} + adapters, aligned by (slot, expert)", lambda: run(True), layers)
    fused_moe.GEMV_MAX_TOKENS = gemv_max
    print(f"  per pair vs aligned: rel diff {rel(out_gemv, out_aligned):.2e}")
    # Kernels alone, gate/up projection.
    p = t * k
    delta = torch.empty(p, 2 * i, device=dev, dtype=torch.float32)
    timed(f"{name}   align_lora alone",
          lambda: [align_lora(ids, lo.token_slot, e, slots, 16, lo.slot_mask) for lo in loras], layers)
    al = align_lora(ids, loras[0].token_slot, e, slots, 16, loras[0].slot_mask)
    timed(f"{name}   moe_lora gate_up (aligned) alone",
          lambda: [moe_lora(x, lo.a_gate_up, lo.b_gate_up, delta, al, k, lo.ranks[0]) for lo in loras],
          layers)
    # The per-pair kernel's tunables, on the gate/up and down projections alone.
    h_in = torch.randn(p, i, device=dev, dtype=dt)
    delta_d = torch.empty(p, h, device=dev, dtype=torch.float32)
    knobs = ("A_TILE", "B_TILE", "NUM_WARPS", "NUM_STAGES", "splits_per_pair")
    orig = {kn: getattr(moe_lora_gemv, kn) for kn in knobs}
    for bk, bn, warps, stages, ns in [(16384, 8192, 8, 3, None), (16384, 8192, 8, 4, None),
                                      (16384, 4096, 8, 3, None), (8192, 8192, 8, 3, None),
                                      (16384, 16384, 8, 3, None), (32768, 8192, 8, 2, None),
                                      (16384, 8192, 4, 3, None), (16384, 8192, 8, 3, 2)]:
        for kn, v in zip(knobs, (bk, bn, warps, stages, orig["splits_per_pair"] if ns is None else
                                 (lambda *a, ns=ns: ns))):
            setattr(moe_lora_gemv, kn, v)
        tag = f"A{bk} B{bn} w{warps} stages {stages} split {ns or 'auto'}"
        try:
            timed(f"{name}   moe_lora_gemv gate_up alone {tag}",
                  lambda: [moe_lora_gemv.moe_lora_gemv(x, ids, lo.token_slot, lo.slot_mask, lo.ranks[0],
                                                       lo.a_gate_up, lo.b_gate_up, delta, k) for lo in loras],
                  layers)
            timed(f"{name}   moe_lora_gemv down alone {tag}",
                  lambda: [moe_lora_gemv.moe_lora_gemv(h_in, ids, lo.token_slot, lo.slot_mask, lo.ranks[1],
                                                       lo.a_down, lo.b_down, delta_d, 1) for lo in loras],
                  layers)
        except Exception as exc:  # e.g. out of shared memory
            print(name, tag, type(exc).__name__, exc)
    for kn, v in orig.items():
        setattr(moe_lora_gemv, kn, v)


# ---------------------------------------------------------------- dense
DENSE = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
         "down": (14336, (4096,))}


@triton.jit
def _expand_slot_cols_kernel(
    buf_ptr, b_ptr, y_ptr, token_slot_ptr, slice_starts_ptr,
    stride_bs, stride_bm, stride_bl, stride_wl, stride_wn, stride_ym,
    N_BLOCKS_PER_SLICE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """lora_expand_gemv reading shrink values at buf[s, t, slot(t)] (a slot stride): the
    layout a GEMM against every slot's stacked A produces."""
    pid_sn = tl.program_id(0)
    t = tl.program_id(1)
    s = pid_sn // N_BLOCKS_PER_SLICE
    col_end = tl.multiple_of(tl.load(slice_starts_ptr + s + 1), 16)
    n0 = tl.multiple_of(tl.load(slice_starts_ptr + s), 16) + (pid_sn % N_BLOCKS_PER_SLICE) * BLOCK_N
    if n0 >= col_end:
        return
    slot = tl.load(token_slot_ptr + t)
    if slot < 0:
        return
    r = tl.arange(0, BLOCK_R)
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < col_end
    v = tl.load(buf_ptr + s * stride_bs + t * stride_bm + slot * stride_bl + r).to(tl.float32)
    w = tl.load(b_ptr + slot * stride_wl + n[:, None] * stride_wn + r[None, :], mask=n_mask[:, None],
                other=0.0)
    delta = tl.sum(w.to(tl.float32) * v[None, :], axis=1)
    y = y_ptr + t * stride_ym + n
    tl.store(y, (tl.load(y, mask=n_mask, other=0.0).to(tl.float32) + delta).to(y_ptr.dtype.element_ty),
             mask=n_mask)


def expand_slot_cols(buf, strides, b, y, sizes, token_slot, rank):
    from loraplex.ops.triton.lora_common import slice_starts

    n_blocks = triton.cdiv(max(sizes), 256)
    _expand_slot_cols_kernel[(len(sizes) * n_blocks, y.shape[0])](
        buf, b, y, token_slot, slice_starts(tuple(sizes), y.device), *strides,
        b.stride(0), b.stride(1), y.stride(0), N_BLOCKS_PER_SLICE=n_blocks, BLOCK_N=256, BLOCK_R=rank)


@triton.jit
def _shrink_rows_kernel(x_ptr, a_ptr, out_ptr, token_slot_ptr, slot_ranks_ptr, K,
                        stride_xm, stride_as, stride_al, stride_ar, stride_os, stride_om,
                        R_SPLIT: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The shrink GEMV split over rank rows instead of K: each program owns ROWS of the
    token's A over all of K and stores them (no zero fill, no atomics; x read R_SPLIT
    times, from L2)."""
    s = tl.program_id(0) // R_SPLIT
    r0 = (tl.program_id(0) % R_SPLIT) * ROWS
    t = tl.program_id(1)
    slot = tl.load(token_slot_ptr + t)
    if slot < 0:
        return
    rank = tl.load(slot_ranks_ptr + slot)
    if r0 >= rank:
        return
    r = r0 + tl.arange(0, ROWS)
    r_mask = r < rank
    k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + s * stride_as + slot * stride_al + r[:, None] * stride_ar
    acc = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + t * stride_xm + k0 + k).to(tl.float32)
        a = tl.load(a_rows + k0 + k[None, :], mask=r_mask[:, None], other=0.0)
        acc += a.to(tl.float32) * x[None, :]
    tl.store(out_ptr + s * stride_os + t * stride_om + r, tl.sum(acc, axis=1), mask=r_mask)


def shrink_rows(x, a, batch, r_split):
    s, _, rank, k = a.shape
    t = x.shape[0]
    out = torch.empty(s, t, rank, dtype=torch.float32, device=x.device)
    _shrink_rows_kernel[(s * r_split, t)](
        x, a, out, batch.token_slot, batch.slot_ranks, k, x.stride(0), a.stride(0), a.stride(1),
        a.stride(2), out.stride(0), out.stride(1), R_SPLIT=r_split, ROWS=rank // r_split, BLOCK_K=512,
        num_warps=4)
    return out


def dense(layers=32, t=32, slots=32, rank=16):
    from loraplex.ops.metadata import make_lora_batch
    from loraplex.ops.triton.lora_expand_gemv import lora_expand_gemv
    from loraplex.ops.triton.lora_shrink_gemv import lora_shrink_gemv

    dev, dt = "cuda", torch.bfloat16
    batch = make_lora_batch(list(range(t)), [rank] * slots, slots, dev)
    aux = torch.cuda.Stream()
    projs = []
    for _ in range(layers):
        for name, (k, sizes) in DENSE.items():
            n, s = sum(sizes), len(sizes)
            # W with every slot's A stacked under it: rows [0, n) base, then [S, L, R].
            w_ext = torch.randn(n + s * slots * rank, k, device=dev, dtype=dt) * k**-0.5
            projs.append(dict(name=name, k=k, sizes=sizes, w=w_ext[:n], w_ext=w_ext,
                              a=w_ext[n:].view(s, slots, rank, k),
                              b=torch.randn(slots, n, rank, device=dev, dtype=dt) * 0.02))
    xs = {k: torch.randn(t, k, device=dev, dtype=dt) for k in (4096, 14336)}
    ys = {p["name"]: torch.empty(t, sum(p["sizes"]), device=dev, dtype=dt) for p in projs[:4]}
    ext = {p["name"]: torch.empty(t, p["w_ext"].shape[0], device=dev, dtype=dt) for p in projs[:4]}
    shr = {p["name"]: torch.empty(t, p["a"].shape[0] * slots * rank, device=dev, dtype=dt) for p in projs[:4]}

    def base():
        for p in projs:
            torch.mm(xs[p["k"]], p["w"].T, out=ys[p["name"]])

    def gemv(side, shrink=lora_shrink_gemv):
        for p in projs:
            x, y = xs[p["k"]], ys[p["name"]]
            if side:
                main = torch.cuda.current_stream()
                aux.wait_stream(main)
                with torch.cuda.stream(aux):
                    buf = shrink(x, p["a"], batch)
                torch.mm(x, p["w"].T, out=y)
                main.wait_stream(aux)
            else:
                buf = lora_shrink_gemv(x, p["a"], batch)
                torch.mm(x, p["w"].T, out=y)
            lora_expand_gemv(buf, p["b"], y, p["sizes"], batch)

    def stacked(fold):
        for p in projs:
            x, n = xs[p["k"]], sum(p["sizes"])
            if fold:  # one GEMM: [y | x A^T for every slot]
                out = ext[p["name"]]
                torch.mm(x, p["w_ext"].T, out=out)
                y, buf = out[:, :n], out[:, n:]
            else:
                y, buf = ys[p["name"]], shr[p["name"]]
                torch.mm(x, p["w"].T, out=y)
                torch.mm(x, p["a"].view(-1, p["k"]).T, out=buf)
            strides = (slots * rank, buf.stride(0), rank)  # slice, token, slot
            expand_slot_cols(buf, strides, p["b"], y, p["sizes"], batch.token_slot, rank)

    timed("llama base GEMMs (4 per layer)", base, layers)
    timed("llama + LoRA GEMV, shrink on a side stream (decode graphs now)", lambda: gemv(True), layers)
    timed("llama + LoRA GEMV, one stream", lambda: gemv(False), layers)
    for r_split in (2, 4, 8, 16):
        timed(f"llama + LoRA GEMV, shrink split over rank ({r_split}), side stream",
              lambda: gemv(True, lambda x, a, b: shrink_rows(x, a, b, r_split)), layers)
    for p in projs[:4]:
        x = xs[p["k"]]
        want = lora_shrink_gemv(x, p["a"], batch)
        diff = rel(shrink_rows(x, p["a"], batch, 4), want)
        print(f"  {p['name']}: shrink over rank vs split-K rel diff {diff:.2e}")
    timed("llama + every slot's A stacked under W (one GEMM) + expand", lambda: stacked(True), layers)
    timed("llama + shrink as its own cuBLAS GEMM over every slot + expand", lambda: stacked(False), layers)
    # Correctness of the stacked forms against the GEMV path, on layer 0's projections.
    for p in projs[:4]:
        x, n = xs[p["k"]], sum(p["sizes"])
        y = torch.mm(x, p["w"].T)
        lora_expand_gemv(lora_shrink_gemv(x, p["a"], batch), p["b"], y, p["sizes"], batch)
        out = torch.mm(x, p["w_ext"].T)
        expand_slot_cols(out[:, n:], (slots * rank, out.stride(0), rank), p["b"], out[:, :n], p["sizes"],
                         batch.token_slot, rank)
        print(f"  {p['name']}: stacked vs GEMV rel diff {rel(out[:, :n], y):.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", nargs="+", default=["moe", "dense"])
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    if "moe" in args.part:
        moe()
    if "dense" in args.part:
        dense()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(ROWS, f, indent=1)


if __name__ == "__main__":
    main()
