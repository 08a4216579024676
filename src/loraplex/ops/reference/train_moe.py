"""Plain-torch oracles of the MoE training kernels, in float32: the gated activation
with the routing weight (forward and backward), the sum of each token's expert rows and
its inverse (each token's row copied to its rows), and the LoRA expand added in place
over expert-sorted rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _padded(values: torch.Tensor, pad: int) -> torch.Tensor:
    """values [P, N] in a new [P, N + pad] tensor, its last pad columns left unwritten."""
    out = values.new_empty(values.shape[0], values.shape[1] + pad)
    out[:, : values.shape[1]] = values
    return out


def silu_mul_weighted(gate_up: torch.Tensor, weight: torch.Tensor, order: torch.Tensor,
                      pad: int = 0) -> torch.Tensor:
    """gate_up [P, 2I] (gate | up) of expert-sorted rows, weight [P] in flat pair order,
    order [P] (row i is flat pair order[i]) -> silu(gate) * up * weight[order] [P, I], in
    the first I columns of a [P, I + pad] tensor (the rest unwritten: room for a folded
    projection's LoRA intermediate, train/expert_gemm.py)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return _padded((F.silu(gate) * up * weight.float()[order][:, None]).to(gate_up.dtype), pad)


def silu_mul_weighted_backward(grad: torch.Tensor, gate_up: torch.Tensor, weight: torch.Tensor,
                               order: torch.Tensor, pad: int = 0):
    """-> (d gate_up [P, 2I] in gate_up's dtype (in a [P, 2I + pad] tensor, as the
    forward's pad), d weight [P] in flat pair order and weight's dtype)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    g = grad.float()
    d_weight = torch.empty_like(weight)
    d_weight[order] = (g * silu * up).sum(-1).to(weight.dtype)
    g = g * weight.float()[order][:, None]
    d_gate = g * up * sig * (1 + gate * (1 - sig))
    return _padded(torch.cat([d_gate, g * silu], dim=-1).to(gate_up.dtype), pad), d_weight


def sum_rows_by_token(rows: torch.Tensor, inv: torch.Tensor, top_k: int) -> torch.Tensor:
    """rows [P, D] in sorted pair order, inv [T * top_k] (flat pair -> sorted row) ->
    [T, D]: out[t] = sum_j rows[inv[t * top_k + j]], summed in float32, rounded once."""
    return rows[inv].view(-1, top_k, rows.shape[1]).sum(1, dtype=torch.float32).to(rows.dtype)


def copy_rows_to_pairs(x: torch.Tensor, inv: torch.Tensor, top_k: int, extra: int = 0) -> torch.Tensor:
    """x [T, D], inv [T * top_k] (flat pair -> sorted row) -> [P, D + extra]: sorted row
    inv[t * top_k + j] is x[t] in its first D columns (the rest unwritten)."""
    out = x.new_empty(inv.numel(), x.shape[1] + extra)
    out[inv, : x.shape[1]] = x.repeat_interleave(top_k, 0)
    return out


def grouped_lora_add(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, ends: torch.Tensor,
                     scale: float) -> None:
    """In place: y[rows of expert e] += scale * xa[rows] @ b[e], rows sorted by expert,
    expert e's rows ending at ends[e]. y [P, N], xa [P, r], b [E, r, N]."""
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            delta = xa[start:end].float() @ b[e].float()
            y[start:end] = (y[start:end].float() + scale * delta).to(y.dtype)
        start = end
