"""MoE LoRA training: the expert projections as autograd functions over expert-sorted pairs.

The (token, expert) pairs of a step are sorted by expert (`sort_pairs`), so the rows
routed to expert e form one contiguous block of the gathered input; the grouped GEMMs
over those blocks are train/expert_gemm.py's. `ExpertProjection` is one projection (the
gate/up one gathers its rows itself and keeps only the token rows for backward);
`GatedDown` the rest of a SwiGLU experts module (activation, down projection, each
token's rows summed) as one node; `CombineByToken` the sum for other gates (gpt-oss).
The gathered input is copied once (one row per pair: `pair_rows`, one kernel on a GPU);
torch's grouped GEMM cannot gather. Around the GEMMs, each pass over [pairs, width] is
one kernel (`ops.backend_for`: Triton on a GPU, plain torch elsewhere): silu(gate) * up
times the routing weight (forward and backward) and the sum of each token's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex import ops
from loraplex.train.expert_gemm import (
    FoldedStack,
    Groups,
    outer,
    project,
    project_backward,
    project_folded,
    project_folded_backward,
)

# TokenRows.outer takes the dense token-level GEMM while E x r is at most this: its FLOPs
# grow with E r, the gather it replaces with top_k (Qwen3-30B-A3B at 16K tokens, E r = 2048).
TOKEN_OUTER_MAX_COLUMNS = 4096


@dataclass
class TokenRows:
    """A gathered projection's input kept as the token rows it came from: x [T, K], row i
    of the gathered input being x[pairs.tokens[i]] (backward keeps x, not the top_k times
    larger gather)."""

    x: torch.Tensor
    pairs: SortedPairs

    def rows(self) -> torch.Tensor:
        return pair_rows(self.x, self.pairs)

    def outer(self, gxa: torch.Tensor, groups: Groups, backend: str) -> torch.Tensor:
        """outer(rows, gxa): [E, K, r], sum over each expert's rows of x[token]^T gxa[row].
        As one dense GEMM, x^T @ M with M [T, E r] holding each row's gxa at (its token,
        its expert) and zeros elsewhere: no [P, K] gather (H100, 16K tokens x 8 of
        Qwen3-30B-A3B: 0.22 ms gather + 0.27 outer, against ~0.25 for zeros, scatter and
        GEMM)."""
        e, r = groups.offsets.numel(), gxa.shape[1]
        if e * r > TOKEN_OUTER_MAX_COLUMNS:
            return outer(self.rows(), gxa, groups, backend)
        t = self.x.shape[0]
        m = gxa.new_zeros(t, e, r)
        m[self.pairs.tokens, self.pairs.experts] = gxa
        return (self.x.t() @ m.view(t, e * r)).view(-1, e, r).transpose(0, 1)


def _with_room(t: torch.Tensor, extra: int) -> torch.Tensor:
    """t [N, M] as the first M columns of an [N, M + extra] tensor: its base where t is
    already that (a kernel wrote it so), else a padded copy."""
    base = t._base
    if (base is not None and base.dim() == 2 and base.shape == (t.shape[0], t.shape[1] + extra)
            and base.is_contiguous() and t.data_ptr() == base.data_ptr()):
        return base
    return F.pad(t, (0, extra))


class ExpertProjection(torch.autograd.Function):
    """`project` as an autograd function, x's rows gathered by `pairs` if given.

    x [N, K] (or [T, K] with pairs: row i is x[pairs.tokens[i]]); w [E, K, M] frozen (a
    tensor; StackSlices: saved as such, its slices made again in backward; or, with pairs,
    a FoldedStack that the factors are copied into, the rows gathered with room); a
    [E, K, r] and b [E, r, M] the LoRA factors as views (or None: base only), in any
    dtype: cast to x's here, their gradients returned in theirs (no cast nodes). Gradients:
    x, a, b; never w. With pairs, backward keeps x, not the gathered [N, K] copy (top_k
    times larger: 0.5 GB per layer at 16K tokens on Qwen3-30B-A3B's shapes), and takes A's
    gradient from it at token level (TokenRows.outer)."""

    @staticmethod
    def forward(ctx, x, w, a, b, scale: float, groups: Groups, backend: str,
                pairs: SortedPairs | None = None):
        ctx.pairs, ctx.dtypes = pairs, (None if a is None else (a.dtype, b.dtype))
        if isinstance(w, FoldedStack):  # the gathered rows with room for x A^T
            assert pairs is not None and a is not None
            w.refresh(a, b, scale)
            y, xa = project_folded(pair_rows(x, pairs, w.rank), w, groups, backend)
            a = b = None
        else:
            a, b = (None, None) if a is None else (a.to(x.dtype), b.to(x.dtype))
            y, xa = project(x if pairs is None else pair_rows(x, pairs), w, a, b, scale, groups, backend)
        # StackSlices (made again in backward) and FoldedStack are held as they are
        ctx.weight = None if isinstance(w, torch.Tensor) else w
        ctx.save_for_backward(x, w if ctx.weight is None else None, a, b, xa)
        ctx.scale, ctx.groups, ctx.backend = scale, groups, backend
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, a, b, xa = ctx.saved_tensors
        w = w if ctx.weight is None else ctx.weight
        pairs = ctx.pairs
        need = ctx.needs_input_grad
        rows = TokenRows(x, pairs) if pairs else x
        if isinstance(w, FoldedStack):  # g with room for s g B (GatedDown's backward leaves it)
            gx, ga, gb = project_folded_backward(_with_room(g, w.rank), rows, w, xa, ctx.scale, ctx.groups,
                                                 ctx.backend, need[0], need[2], need[3])
        else:
            gx, ga, gb = project_backward(g.contiguous(), rows, w, a, b, xa, ctx.scale, ctx.groups,
                                          ctx.backend, need[0], need[2], need[3])
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
    StackSlices or FoldedStack, as ExpertProjection); gate_up_room: the gate/up projection's
    fold rank, the spare columns its backward wants beside d gate_up; a, b the down
    projection's LoRA factors (any dtype, as
    ExpertProjection; None: the base alone). One node where
    eager autograd makes ~10 (casts, gather, index backward, activation, combine): at 1K
    tokens a step is bound by the host's cost per op. Two nodes per layer (this and the
    gate/up ExpertProjection) rather than one: autograd frees this node's activations
    ([P, 3I]) before the gate/up backward runs, and checkpointing manages both."""

    @staticmethod
    def forward(ctx, gate_up, top_k_weights, w, a, b, scale: float, pairs: SortedPairs, backend: str,
                gate_up_room: int = 0):
        ctx.dtypes = None if a is None else (a.dtype, b.dtype)
        weights = top_k_weights.reshape(-1).contiguous()
        kernels = ops.backend_for(gate_up.device)
        if isinstance(w, FoldedStack):  # h written with room for h A^T
            w.refresh(a, b, scale)
            h = kernels.silu_mul_weighted(gate_up, weights, pairs.order, pad=w.rank)
            y, xa = project_folded(h, w, pairs.groups, backend)
            h, a, b = h[:, :w.in_features], None, None
        else:
            a, b = (None, None) if a is None else (a.to(gate_up.dtype), b.to(gate_up.dtype))
            h = kernels.silu_mul_weighted(gate_up, weights, pairs.order)
            y, xa = project(h, w, a, b, scale, pairs.groups, backend)
        ctx.weight = None if isinstance(w, torch.Tensor) else w
        ctx.save_for_backward(gate_up, weights, h, xa, w if ctx.weight is None else None, a, b)
        ctx.scale, ctx.pairs, ctx.backend, ctx.gate_up_room = scale, pairs, backend, gate_up_room
        return sum_by_token(y, pairs)

    @staticmethod
    def backward(ctx, g):
        gate_up, weights, h, xa, w, a, b = ctx.saved_tensors
        w = w if ctx.weight is None else ctx.weight
        pairs, need = ctx.pairs, ctx.needs_input_grad
        if isinstance(w, FoldedStack):  # each row gets its token's gradient, with room for s g B
            gh, ga, gb = project_folded_backward(pair_rows(g, pairs, w.rank), h, w, xa, ctx.scale,
                                                 pairs.groups, ctx.backend, need_a=need[3], need_b=need[4])
        else:
            g_rows = pair_rows(g, pairs)
            gh, ga, gb = project_backward(g_rows, h, w, a, b, xa, ctx.scale, pairs.groups, ctx.backend,
                                          need_a=need[3], need_b=need[4])
            del g_rows
        # d gate_up with room for a folded gate/up projection's s g B (ExpertProjection's backward)
        d_gate_up, d_weights = ops.backend_for(g.device).silu_mul_weighted_backward(
            gh, gate_up, weights, pairs.order, pad=ctx.gate_up_room)
        d_gate_up = d_gate_up[:, :gate_up.shape[1]]
        if ctx.dtypes is not None:
            ga, gb = (t if t is None else t.to(d) for t, d in zip((ga, gb), ctx.dtypes))
        return (d_gate_up, d_weights.view(g.shape[0], -1) if need[1] else None, None, ga, gb,
                None, None, None, None)


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


def pair_rows(x: torch.Tensor, pairs: SortedPairs, extra: int = 0) -> torch.Tensor:
    """[T, D] -> [P, D (+ extra)] in sorted pair order: row i is x[pairs.tokens[i]], with
    `extra` unwritten columns after it (a folded projection's room). One kernel on a GPU
    (each token's row read once, written to its top_k rows)."""
    return ops.backend_for(x.device).copy_rows_to_pairs(x.contiguous(), pairs.inv, pairs.top_k, extra)


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
        return pair_rows(g, ctx.pairs), None
