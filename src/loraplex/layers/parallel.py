"""Tensor parallelism as a layer sees it: the group its shards talk through, and which
part of each full tensor this rank holds (models/tensor_parallel.py decides the split).

Column-parallel layers (q/k/v, gate/up) hold some output rows of W and need no
collective; row-parallel ones (o, down) hold some input columns and sum their partial
outputs with one all-reduce. Adapters follow the same split (S-LoRA's): on a column
layer A is whole and B holds the rank's rows; on a row layer A holds the rank's input
columns and B is whole, so each rank's delta is (x_r A_r^T) B^T and the deltas add up
in the layer's own all-reduce: no second collective, exactly x A^T B^T in the sum.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch >= 2.12's name for all_gather_into_tensor (which it deprecates)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_PARTIAL = contextvars.ContextVar("loraplex_partial_sums", default=False)


@contextmanager
def partial_sums():
    """Inside, row-parallel layers and MoE layers leave their outputs as this rank's
    partial sums: a caller that adds several branches all-reduces their sum once."""
    token = _PARTIAL.set(True)
    try:
        yield
    finally:
        _PARTIAL.reset(token)


def reduce_deferred() -> bool:
    return _PARTIAL.get()


@dataclass(frozen=True)
class TPGroup:
    """This process's rank among `size` (torch.distributed's default group: NCCL on GPUs,
    gloo on CPU). Collectives are queued on the current stream and run inside CUDA graphs."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[N, c] on each rank -> [N, size * c], rank 0's columns first."""
        parts = x.new_empty(self.size * x.shape[0], x.shape[1])  # rank-major rows (gloo's form)
        _all_gather_single(parts, x.contiguous())
        return parts.view(self.size, *x.shape).permute(1, 0, 2).reshape(x.shape[0], -1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(x, src)
        return x

    def min(self, value: int, device: torch.device) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


@dataclass(frozen=True)
class Shard:
    """This rank's part of a full tensor: the `pieces` ((start, stop) ranges) along `dim`,
    concatenated, then `pad` zeros. zero: the rank holds zeros of the full shape (a bias
    of a row-parallel layer lives on rank 0 only, since the all-reduce sums the ranks)."""

    dim: int
    full: int  # the full tensor's size along dim
    pieces: tuple[tuple[int, int], ...]
    pad: int = 0
    zero: bool = False

    def full_shape(self, local: torch.Size) -> tuple[int, ...]:
        shape = list(local)
        shape[self.dim] = self.full
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        if full.shape[self.dim] != self.full:
            raise ValueError(f"expected {self.full} along dim {self.dim}, got shape {tuple(full.shape)}")
        if self.zero:
            return torch.zeros_like(full)
        parts = [full.narrow(self.dim, a, b - a) for a, b in self.pieces]
        if self.pad:
            shape = list(full.shape)
            shape[self.dim] = self.pad
            parts.append(full.new_zeros(shape))
        return parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)

    def views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """take() as views of `full`, one per piece (no copy; padding left out)."""
        return [full.narrow(self.dim, a, b - a) for a, b in self.pieces]


def split(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rank's (start, stop) of n items split evenly (n divisible by size)."""
    per = n // size
    return rank * per, (rank + 1) * per


@dataclass(frozen=True)
class LinearShard:
    """How a LoRALinear is split. column: slice i's rows `rows[i]` of its full output
    (full_sizes[i]), the whole input; row: the input columns `cols`, the whole output."""

    group: TPGroup
    parallel: str  # "column" or "row"
    full_in: int
    full_sizes: tuple[int, ...]
    rows: tuple[tuple[int, int], ...] = ()
    cols: tuple[int, int] = (0, 0)

    @property
    def reduces(self) -> bool:
        return self.parallel == "row"

    def weight(self, i: int) -> Shard:
        """Of slice i's checkpoint weight [full_sizes[i], full_in]."""
        if self.parallel == "column":
            return Shard(0, self.full_sizes[i], (self.rows[i],))
        return Shard(1, self.full_in, (self.cols,))

    def bias(self, i: int) -> Shard:
        if self.parallel == "column":
            return Shard(0, self.full_sizes[i], (self.rows[i],))
        return Shard(0, self.full_sizes[i], ((0, self.full_sizes[i]),), zero=self.group.rank != 0)

    def fused(self, dim: int) -> Shard:
        """Of the fused weight (dim 1) or bias (dim 0): the slices' shards side by side."""
        if self.parallel == "row":
            return self.weight(0) if dim == 1 else self.bias(0)
        offsets = [sum(self.full_sizes[:i]) for i in range(len(self.full_sizes))]
        return Shard(0, sum(self.full_sizes), tuple((o + a, o + b) for o, (a, b) in zip(offsets, self.rows)))

    def lora_a(self, a: torch.Tensor) -> torch.Tensor:
        """This rank's part of an adapter's A [r, full_in] (a view)."""
        return a if self.parallel == "column" else a[:, self.cols[0]:self.cols[1]]

    def lora_b(self, i: int, b: torch.Tensor) -> torch.Tensor:
        """This rank's part of slice i's B [full_sizes[i], r] (a view)."""
        return b[self.rows[i][0]:self.rows[i][1]] if self.parallel == "column" else b


@dataclass(frozen=True)
class ExpertShard:
    """Experts split by intermediate dimension: every rank holds every expert's rows
    [lo, hi) of gate and of up, and those columns of down; routing and alignment are the
    same on every rank, and the top-k sums join one all-reduce."""

    group: TPGroup
    full_intermediate: int
    lo: int
    hi: int

    def gate_up(self, dim: int) -> Shard:
        """Of a fused [.., 2I, ..] gate_up tensor along `dim` (gate rows, then up rows)."""
        i = self.full_intermediate
        return Shard(dim, 2 * i, ((self.lo, self.hi), (i + self.lo, i + self.hi)))

    def down(self, dim: int) -> Shard:
        return Shard(dim, self.full_intermediate, ((self.lo, self.hi),))

    def down_bias(self, hidden: int) -> Shard:
        return Shard(1, hidden, ((0, hidden),), zero=self.group.rank != 0)


@dataclass(frozen=True)
class VocabShard:
    """A vocabulary-parallel embedding (and LM head): rows [lo, hi) of the full table,
    padded to `per` rows (the vocabulary need not divide evenly)."""

    group: TPGroup
    vocab: int
    lo: int
    hi: int
    per: int

    def rows(self) -> Shard:
        return Shard(0, self.vocab, ((self.lo, self.hi),), pad=self.per - (self.hi - self.lo))
