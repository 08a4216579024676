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
The gathered input is copied once (one row per pair: `pair_rows`, one kernel on a GPU);
torch's grouped GEMM cannot gather.
Around the GEMMs, each pass over [pairs, width] is one kernel (`ops.backend_for`: Triton
on a GPU, plain torch elsewhere): the LoRA expand added in place, silu(gate) * up times
the routing weight (forward and backward), and the sum of each token's rows.
A projection whose frozen stack is a plain tensor (SwiGLU experts, Qwen3-MoE and Mixtral)
is folded (`FoldedStack`): its LoRA factors sit beside the base weight as r extra rows
and columns, so the expand runs inside the base GEMM forward and the A product inside
the input-gradient GEMM backward, and the in-place adds (four passes over [pairs, width]
per layer) go.
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


@dataclass
class FoldedStack:
    """A frozen expert stack with its LoRA factors folded in as extra rows and columns,
    so that no pass over the rows adds the LoRA term:
        ext [E, out + r, in + r]: [:, :out, :in] = W (the base parameter is a view of it),
                                  [:, :out, in:] = s B, [:, out:, :in] = A (copied from
                                  the float32 factors at each forward: refresh), the
                                  corner unused;
        forward   y  = [x | x A^T] @ ext[:, :out, :]^T = x W^T + s (x A^T) B^T
        backward  gx = [g | s g B] @ ext[:, :, :in]    = g W + s (g B) A
    with W [out, in], A [r, in], B [out, r] per expert. The rows x and g come with r
    spare columns (the caller's buffers) that receive x A^T and s g B. One GEMM has K
    larger by r (0.8% at rank 16 on Qwen3-30B-A3B) where a [rows, out] read and write
    were (H100, 16K tokens x top-8: ~0.3 ms a projection a pass)."""

    ext: torch.Tensor
    rank: int

    @classmethod
    def around(cls, weight: torch.Tensor, rank: int) -> FoldedStack:
        """A new stack holding weight [E, out, in]; the base parameter becomes view()."""
        e, out, inp = weight.shape
        ext = weight.new_zeros(e, out + rank, inp + rank)
        ext[:, :out, :inp] = weight
        return cls(ext, rank)

    @property
    def out_features(self) -> int:
        return self.ext.shape[1] - self.rank

    @property
    def in_features(self) -> int:
        return self.ext.shape[2] - self.rank

    def view(self) -> torch.Tensor:
        return self.ext[:, :self.out_features, :self.in_features]

    def refresh(self, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """The factors' current values: a [E, in, r] (A^T), b [E, r, out] (B^T), as views."""
        out, inp = self.out_features, self.in_features
        self.ext[:, out:, :inp] = a.transpose(1, 2)
        self.ext[:, :out, inp:] = b.transpose(1, 2) * scale

    def forward_stack(self) -> torch.Tensor:  # [E, in + r, out]
        return self.ext[:, :self.out_features].transpose(1, 2)

    def backward_stack(self) -> torch.Tensor:  # [E, out + r, in]
        return self.ext[:, :, :self.in_features]

    def a_t(self) -> torch.Tensor:  # A^T [E, in, r]
        return self.ext[:, self.out_features:, :self.in_features].transpose(1, 2)

    def scaled_b(self) -> torch.Tensor:  # s B [E, out, r]
        return self.ext[:, :self.out_features, self.in_features:]


def project_folded(rows: torch.Tensor, w: FoldedStack, groups: Groups, backend: str):
    """`project` for a folded stack: rows [N, in + r] with the inputs in [:, :in]; their
    x A^T goes into [:, in:]. -> (y [N, out], x A^T [N, r])."""
    inp = w.in_features
    xa = gmm(rows[:, :inp], w.a_t(), groups, backend)
    rows[:, inp:] = xa
    return gmm(rows, w.forward_stack(), groups, backend), xa


def project_folded_backward(g_rows: torch.Tensor, x, w: FoldedStack, xa: torch.Tensor, scale: float,
                            groups: Groups, backend: str, need_x: bool = True, need_a: bool = True,
                            need_b: bool = True):
    """`project_backward` for a folded stack: g_rows [N, out + r] with the output gradient
    in [:, :out]; s g B goes into [:, out:]. x: the rows [N, in], or TokenRows."""
    out = w.out_features
    g = g_rows[:, :out]
    gxa = gmm(g, w.scaled_b(), groups, backend)  # s g B [N, r]
    gb = outer(xa, g, groups, backend).mul_(scale) if need_b else None
    ga = _grad_a(x, gxa, groups, backend) if need_a else None
    gx = None
    if need_x:
        g_rows[:, out:] = gxa
        gx = gmm(g_rows, w.backward_stack(), groups, backend)
    return gx, ga, gb


def _with_room(t: torch.Tensor, extra: int) -> torch.Tensor:
    """t [N, M] as the first M columns of an [N, M + extra] tensor: its base where t is
    already that (a kernel wrote it so), else a padded copy."""
    base = t._base
    if (base is not None and base.dim() == 2 and base.shape == (t.shape[0], t.shape[1] + extra)
            and base.is_contiguous() and t.data_ptr() == base.data_ptr()):
        return base
    return F.pad(t, (0, extra))


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


def _grad_a(x, gxa: torch.Tensor, groups: Groups, backend: str) -> torch.Tensor:
    return x.outer(gxa, groups, backend) if isinstance(x, TokenRows) else outer(x, gxa, groups, backend)


def project_backward(g, xs, w, a, b, xa, scale: float, groups: Groups, backend: str,
                     need_x: bool = True, need_a: bool = True, need_b: bool = True):
    """Gradients of `project` for the output gradient g: (g xs, g a, g b), None where not
    needed; never one for w. xs: the rows, or TokenRows (a gathered input kept as tokens)."""
    gx = ga = gb = gxa = None
    if a is not None:
        gxa = gmm(g, b.transpose(1, 2), groups, backend).mul_(scale)  # [N, r]
        if need_b:
            gb = outer(xa, g, groups, backend).mul_(scale)
        if need_a:
            ga = _grad_a(xs, gxa, groups, backend)
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
    StackSlices, as ExpertProjection); a, b the down projection's LoRA factors (any dtype, as
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
