"""Plain-torch norms, rotary embedding and activation, written as Hugging Face does them
so that fp32 results match transformers to the last bit where the math allows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.ops.formats import Fp8Rows
from loraplex.ops.reference.quant import quantize_activations


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False,
             fp8_block: int = 0):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:  # Gemma: scale by (1 + w) in float32, then round
        y = (h * (1.0 + weight.float())).to(x.dtype)
    else:
        y = weight * h.to(x.dtype)  # Llama: round, then scale
    return (y, Fp8Rows(*quantize_activations(y, fp8_block))) if fp8_block else y


def rms_norm_train(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: str):
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h * rstd
    if mode == "llama":  # round, then scale (in the promoted dtype of weight and x)
        y = weight * h.to(x.dtype)
    elif mode == "fp32_weight":  # gpt-oss: scale in float32, then round
        y = (weight * h).to(x.dtype)
    elif mode == "unit_offset":  # Gemma: (1 + w) in float32, then round
        y = (h * (1.0 + weight.float())).to(x.dtype)
    else:
        raise ValueError(f"unknown RMSNorm mode {mode!r}")
    return y, rstd.squeeze(-1)


def rms_norm_backward(g: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                      mode: str) -> torch.Tensor:
    rstd = rstd.unsqueeze(-1)
    xhat = x.float() * rstd
    w = weight.float()
    gxhat = g.float() * (1.0 + w if mode == "unit_offset" else w)
    return (rstd * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True))).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    unit_offset: bool = False, fp8_block: int = 0,
):
    if x.dim() == 3:  # a MoE block's unsummed expert outputs
        x = x.float().sum(1).to(x.dtype)
    residual = x + residual
    if fp8_block:
        y, rows = rms_norm(residual, weight, eps, unit_offset, fp8_block)
        return y, residual, rows
    return rms_norm(residual, weight, eps, unit_offset), residual


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    qk_norm=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if qk_norm is not None:
        q = rms_norm(q, qk_norm.q_weight, qk_norm.eps, qk_norm.unit_offset)
        k = rms_norm(k, qk_norm.k_weight, qk_norm.eps, qk_norm.unit_offset)
    cos, sin = cos_sin[positions].to(q.dtype).chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    h, acc = x.shape[-1] // 2, torch.promote_types(x.dtype, torch.float32)  # float64 stays so (probes)
    x1, x2, c1, c2, s1, s2 = (t.to(acc) for t in (x[..., :h], x[..., h:], cos[..., :h], cos[..., h:],
                                                   sin[..., :h], sin[..., h:]))
    if backward:  # the transposed rotation
        y = torch.cat((x1 * c1 + x2 * s2, x2 * c2 - x1 * s1), dim=-1)
    else:
        y = torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)
    return y.to(x.dtype)


def rope_train(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _rotate(x, cos[:, None], sin[:, None], backward=False)


def rope_train_backward(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _rotate(g, cos[:, None], sin[:, None], backward=True)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
