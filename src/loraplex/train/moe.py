"""Grouped expert GEMMs for MoE LoRA training.

The (token, expert) pairs of a step are sorted by expert, so the rows routed to expert e
form one contiguous block of the gathered input. Every expert projection is then
`y_e = x_e W_e + s (x_e A_e) B_e` on its block: base plus LoRA through the rank-r
intermediate, never the [out, in] product B_e A_e. `ExpertProjection` is the autograd
function of that: it returns gradients for x, A and B only; the frozen base weight never
gets one (not even computed and thrown away).

Backends (one per call site, picked by `resolve_backend`, override with --moe-backend):
- "loop": one matmul per expert that has rows; any device, dtype and shape.
- "grouped_mm": torch's grouped GEMM (`torch.nn.functional.grouped_mm`, or
  `torch._grouped_mm` before 2.10), one launch for all experts, in the forward and in the
  backward (the weight gradients as its K-grouped 2d x 2d form). Auto picks it on CUDA
  (sm80+) in bf16. It needs 16-byte aligned strides; a call it refuses (e.g. rank 4 in
  bf16) runs on the loop instead, with one warning per shape.
The gathered input is copied once (one row per pair); torch's grouped GEMM cannot gather.
Around the GEMMs, each pass over [pairs, width] is one kernel (`ops.backend_for`: Triton
on a GPU, plain torch elsewhere): the LoRA expand added in place, silu(gate) * up times
the routing weight (forward and backward), and the sum of each token's rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex import ops

logger = logging.getLogger("loraplex")

BACKENDS = ("auto", "loop", "grouped_mm")


def _grouped_mm_op():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    if name not in BACKENDS:
        raise ValueError(f"moe backend {name!r}: one of {BACKENDS}")
    if name == "grouped_mm" and _grouped_mm_op() is None:
        raise ValueError(f"torch {torch.__version__} has no grouped_mm")
    if name != "auto":
        return name
    device = torch.device(device)
    if (device.type == "cuda" and dtype == torch.bfloat16 and _grouped_mm_op() is not None
            and torch.cuda.get_device_capability(device) >= (8, 0)):
        return "grouped_mm"
    return "loop"


@dataclass
class Groups:
    """Row blocks of the expert-sorted pairs: `offsets[e]` is where block e ends (int32,
    on the device, what grouped_mm takes); `ends` the same on the host, read only by the
    loop (one device -> host copy per layer)."""

    offsets: torch.Tensor
    _ends: list[int] | None = None

    @property
    def ends(self) -> list[int]:
        if self._ends is None:
            self._ends = self.offsets.tolist()
        return self._ends

    def blocks(self):
        start = 0
        for e, end in enumerate(self.ends):
            yield e, start, end
            start = end


_refused: set[tuple] = set()


def _grouped(fn, key: tuple):
    """Run fn on the grouped kernel, or return None if it refuses these shapes/strides."""
    if key in _refused:
        return None
    try:
        return fn()
    except (RuntimeError, ValueError) as err:  # shape / stride checks: on the host, before any launch
        _refused.add(key)
        logger.warning("grouped_mm refused %s (%s); those run as a per-expert loop", key, err)
        return None


@dataclass
class StackSlices:
    """A frozen expert stack [E, K, M] that is made a slice of experts at a time (a
    quantized base's, dequantized: train/quantized.py): `make(e0, e1)` gives experts
    e0..e1 - 1. gmm multiplies `chunk` experts at a time, so that only their weights
    exist at once (a gpt-oss-20b layer's whole gate/up stack is 1 GB in bf16)."""

    make: Callable[[int, int], torch.Tensor]
    shape: tuple[int, int, int]
    chunk: int

    def transpose(self, d0: int, d1: int) -> StackSlices:
        assert (d0, d1) == (1, 2)
        e, k, m = self.shape
        return StackSlices(lambda e0, e1: self.make(e0, e1).transpose(1, 2), (e, m, k), self.chunk)


def _gmm_slices(x: torch.Tensor, w: StackSlices, groups: Groups, backend: str) -> torch.Tensor:
    """gmm over a StackSlices: the row blocks of each slice of experts (the ends read on
    the host, once per layer), experts without rows never made."""
    ends, num_experts = groups.ends, w.shape[0]
    out = x.new_empty(x.shape[0], w.shape[2])
    for e0 in range(0, num_experts, w.chunk):
        e1 = min(e0 + w.chunk, num_experts)
        r0, r1 = (ends[e0 - 1] if e0 else 0), ends[e1 - 1]
        if r1 > r0:
            part = Groups(groups.offsets[e0:e1] - r0, [end - r0 for end in ends[e0:e1]])
            out[r0:r1] = gmm(x[r0:r1], w.make(e0, e1), part, backend)
    return out


def gmm(x: torch.Tensor, w: torch.Tensor | StackSlices, groups: Groups, backend: str) -> torch.Tensor:
    """x [N, K] in row blocks by expert, w [E, K, M] (any strides) -> [N, M]: block e @ w[e]."""
    if isinstance(w, StackSlices):
        return _gmm_slices(x, w, groups, backend)
    if backend == "grouped_mm":
        key = ("gmm", x.dtype, x.shape[1], w.shape[2], w.stride())
        out = _grouped(lambda: _grouped_mm_op()(x, w, offs=groups.offsets), key)
        if out is not None:
            return out
    out = x.new_empty(x.shape[0], w.shape[2])
    for e, s, t in groups.blocks():
        if t > s:
            torch.mm(x[s:t], w[e], out=out[s:t])
    return out


def outer(a: torch.Tensor, b: torch.Tensor, groups: Groups, backend: str) -> torch.Tensor:
    """a [N, Ka], b [N, Kb] in row blocks -> [E, Ka, Kb]: a_e^T b_e (a weight gradient)."""
    if backend == "grouped_mm":
        key = ("outer", a.dtype, a.shape[1], b.shape[1])
        out = _grouped(lambda: _grouped_mm_op()(a.t(), b, offs=groups.offsets), key)
        if out is not None:
            return out
    out = a.new_zeros(len(groups.ends), a.shape[1], b.shape[1])
    for e, s, t in groups.blocks():
        if t > s:
            torch.mm(a[s:t].t(), b[s:t], out=out[e])
    return out


def project(xs, w, a, b, scale: float, groups: Groups, backend: str):
    """y = xs w_e + scale (xs a_e) b_e per row block e -> (y, xs a): the expand added
    into the base GEMM's output in place (ops.grouped_lora_add; one kernel on a GPU)."""
    y = gmm(xs, w, groups, backend)
    xa = None
    if a is not None:
        xa = gmm(xs, a, groups, backend)
        ops.backend_for(y.device).grouped_lora_add(y, xa, b, groups.offsets, scale)
    return y, xa


def project_backward(g, xs, w, a, b, xa, scale: float, groups: Groups, backend: str,
                     need_x: bool = True, need_a: bool = True, need_b: bool = True):
    """Gradients of `project` for the output gradient g: (g xs, g a, g b), None where not
    needed; never one for w. xs may be a callable that returns it (regathered on demand)."""
    gx = ga = gb = gxa = None
    if a is not None:
        gxa = gmm(g, b.transpose(1, 2), groups, backend).mul_(scale)  # [N, r]
        if need_b:
            gb = outer(xa, g, groups, backend).mul_(scale)
        if need_a:
            ga = outer(xs() if callable(xs) else xs, gxa, groups, backend)
    if need_x:
        gx = gmm(g, w.transpose(1, 2), groups, backend)
        if gxa is not None:
            ops.backend_for(gx.device).grouped_lora_add(gx, gxa, a.transpose(1, 2), groups.offsets, 1.0)
    return gx, ga, gb


class ExpertProjection(torch.autograd.Function):
    """`project` as an autograd function, x's rows gathered by `pairs` if given.

    x [N, K] (or [T, K] with pairs: row i is x[pairs.tokens[i]]); w [E, K, M] frozen (a
    tensor, or StackSlices: saved as such, its slices made again in backward); a
    [E, K, r] and b [E, r, M] the LoRA factors as views (or None: base only), in any
    dtype: cast to x's here, their gradients returned in theirs (no cast nodes). Gradients:
    x, a, b; never w. With pairs, backward keeps x, not the gathered [N, K] copy (top_k
    times larger: 0.5 GB per layer at 16K tokens on Qwen3-30B-A3B's shapes), and gathers
    again when A's gradient needs it."""

    @staticmethod
    def forward(ctx, x, w, a, b, scale: float, groups: Groups, backend: str,
                pairs: SortedPairs | None = None):
        ctx.pairs, ctx.dtypes = pairs, (None if a is None else (a.dtype, b.dtype))
        a, b = (None, None) if a is None else (a.to(x.dtype), b.to(x.dtype))
        y, xa = project(x if pairs is None else x[pairs.tokens], w, a, b, scale, groups, backend)
        ctx.weight = None if isinstance(w, torch.Tensor) else w  # StackSlices: made again in backward
        ctx.save_for_backward(x, w if ctx.weight is None else None, a, b, xa)
        ctx.scale, ctx.groups, ctx.backend = scale, groups, backend
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, a, b, xa = ctx.saved_tensors
        w = w if ctx.weight is None else ctx.weight
        pairs = ctx.pairs
        need = ctx.needs_input_grad
        gx, ga, gb = project_backward(g.contiguous(), (lambda: x[pairs.tokens]) if pairs else x, w, a, b, xa,
                                      ctx.scale, ctx.groups, ctx.backend, need[0], need[2], need[3])
        if gx is not None and pairs is not None:  # each token's rows summed back onto it
            gx = sum_by_token(gx, pairs)
        if ctx.dtypes is not None:
            ga, gb = (t if t is None else t.to(d) for t, d in zip((ga, gb), ctx.dtypes))
        return gx, None, ga, gb, None, None, None, None


class GatedDown(torch.autograd.Function):
    """The rest of a SwiGLU experts module (Qwen3-MoE, Mixtral) after gate/up, as one
    autograd node: silu(gate) * up * routing weight, the down projection with its LoRA,
    and each token's rows summed back onto it.

    gate_up [P, 2I] sorted rows; top_k_weights [T, top_k] (read through the pairs' order
    inside the activation kernels: no gather, no scatter-add backward); w [E, I, H] (or
    StackSlices, as ExpertProjection); a, b the down projection's LoRA factors (any dtype, as
    ExpertProjection; None: the base alone). One node where
    eager autograd makes ~10 (casts, gather, index backward, activation, combine): at 1K
    tokens a step is bound by the host's cost per op. Two nodes per layer (this and the
    gate/up ExpertProjection) rather than one: autograd frees this node's activations
    ([P, 3I]) before the gate/up backward runs, and checkpointing manages both."""

    @staticmethod
    def forward(ctx, gate_up, top_k_weights, w, a, b, scale: float, pairs: SortedPairs, backend: str):
        ctx.dtypes = None if a is None else (a.dtype, b.dtype)
        a, b = (None, None) if a is None else (a.to(gate_up.dtype), b.to(gate_up.dtype))
        weights = top_k_weights.reshape(-1).contiguous()
        h = ops.backend_for(gate_up.device).silu_mul_weighted(gate_up, weights, pairs.order)
        y, xa = project(h, w, a, b, scale, pairs.groups, backend)
        ctx.weight = None if isinstance(w, torch.Tensor) else w
        ctx.save_for_backward(gate_up, weights, h, xa, w if ctx.weight is None else None, a, b)
        ctx.scale, ctx.pairs, ctx.backend = scale, pairs, backend
        return sum_by_token(y, pairs)

    @staticmethod
    def backward(ctx, g):
        gate_up, weights, h, xa, w, a, b = ctx.saved_tensors
        w = w if ctx.weight is None else ctx.weight
        pairs, need = ctx.pairs, ctx.needs_input_grad
        g_rows = g.contiguous()[pairs.tokens]  # each row gets its token's gradient
        gh, ga, gb = project_backward(g_rows, h, w, a, b, xa, ctx.scale, pairs.groups, ctx.backend,
                                      need_a=need[3], need_b=need[4])
        del g_rows
        d_gate_up, d_weights = ops.backend_for(g.device).silu_mul_weighted_backward(
            gh, gate_up, weights, pairs.order)
        if ctx.dtypes is not None:
            ga, gb = (t if t is None else t.to(d) for t, d in zip((ga, gb), ctx.dtypes))
        return (d_gate_up, d_weights.view(g.shape[0], -1) if need[1] else None, None, ga, gb,
                None, None, None)


@dataclass
class SortedPairs:
    """A step's (token, expert) pairs sorted by expert. Sorted pair i is flat pair
    order[i] (= token * top_k + j): token tokens[i], expert experts[i]; inv is the inverse
    permutation (flat pair p sits at sorted position inv[p])."""

    order: torch.Tensor
    tokens: torch.Tensor
    experts: torch.Tensor
    inv: torch.Tensor
    top_k: int
    groups: Groups


def sort_pairs(top_k_index: torch.Tensor, num_experts: int) -> SortedPairs:
    """No host sync: each expert's row end is a search in the sorted experts, where
    torch.bincount on a GPU reads the largest key back to the host first (a sync per
    layer, which left the GPU idle while the host queued the rest of the step)."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    ids = torch.arange(max(order.numel(), num_experts), device=order.device)
    ends = torch.searchsorted(experts, ids[:num_experts].to(experts.dtype), right=True)
    inv = torch.empty_like(order).scatter_(0, order, ids[:order.numel()])
    top_k = top_k_index.shape[1]
    return SortedPairs(order, order // top_k, experts, inv, top_k, Groups(ends.to(torch.int32)))


def sum_by_token(rows: torch.Tensor, pairs: SortedPairs) -> torch.Tensor:
    """[P, D] rows in sorted pair order -> [T, D]: each token's top_k rows summed.

    Each token gathers its k rows, not a scatter-add: on an H200 at 16K tokens x 8
    (Qwen3-30B-A3B's shapes) index_add took 2.3 ms per call (atomic adds), the gather
    and a sum ~0.5 ms, and the sum is one rounding in float32, in a fixed order. On a GPU
    one Triton kernel gathers and sums without writing the gathered copy."""
    return ops.backend_for(rows.device).sum_rows_by_token(rows.contiguous(), pairs.inv, pairs.top_k)


class CombineByToken(torch.autograd.Function):
    """sum_by_token with a gather for backward (token t's gradient to each of its rows)."""

    @staticmethod
    def forward(ctx, rows, pairs: SortedPairs):
        ctx.pairs = pairs
        return sum_by_token(rows, pairs)

    @staticmethod
    def backward(ctx, g):
        return g[ctx.pairs.tokens], None
