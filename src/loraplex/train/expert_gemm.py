"""Grouped expert GEMMs for MoE LoRA training (train/moe.py's autograd functions run on these).

The (token, expert) pairs of a step are sorted by expert, so the rows routed to expert e
form one contiguous block. Every expert projection is `y_e = x_e W_e + s (x_e A_e) B_e`
on its block: base plus LoRA through the rank-r intermediate, never the [out, in]
product B_e A_e; backward gives gradients for x, A and B, never for the frozen W.

Backends (one per call site, picked by `resolve_backend`, override with --moe-backend):
- "loop": one matmul per expert that has rows; any device, dtype and shape.
- "grouped_mm": torch's grouped GEMM (`torch.nn.functional.grouped_mm`, or
  `torch._grouped_mm` before 2.10), one launch for all experts, in the forward and in the
  backward (the weight gradients as its K-grouped 2d x 2d form). Auto picks it on CUDA
  (sm80+) in bf16. It needs 16-byte aligned strides; a call it refuses (e.g. rank 4 in
  bf16) runs on the loop instead, with one warning per shape.
The frozen stack is a tensor; `StackSlices` (a quantized base's, made a slice of experts
at a time); or `FoldedStack`, with its LoRA factors beside the base weight as r extra
rows and columns, so the expand runs inside the base GEMM forward and the A product
inside the input-gradient GEMM backward (`project_folded`). Otherwise the expand is added
in place into the base GEMM's output (ops.grouped_lora_add, one kernel on a GPU).
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


def _grad_a(x, gxa: torch.Tensor, groups: Groups, backend: str) -> torch.Tensor:
    """A's gradient: outer(x, gxa) for the rows x, or x.outer(...) where x keeps them
    otherwise (moe.TokenRows: a gathered input kept as its token rows)."""
    return outer(x, gxa, groups, backend) if isinstance(x, torch.Tensor) else x.outer(gxa, groups, backend)


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
