"""The Triton backend: one kernel per file, each with its block configs beside it.

Same names and signatures as `loraplex.ops.reference`, which is every kernel's oracle.
Runs on CUDA GPUs, and on CPU tensors under TRITON_INTERPRET=1 (tests).
"""

import torch
import torch.nn.functional as F

from loraplex.ops import reference
from loraplex.ops.formats import Fp8Rows, Fp8Weight, Int4Weight, QuantizedWeight
from loraplex.ops.metadata import make_lora_batch
from loraplex.ops.side_streams import beside, join
from loraplex.ops.triton.activation import gelu_tanh_and_mul, silu_and_mul
from loraplex.ops.triton.dequantize import dequantize as _dequantize
from loraplex.ops.triton.fp8_gemm import fp8_fuses_expand, fp8_linear
from loraplex.ops.triton.fused_moe import fused_experts, warm_up_moe
from loraplex.ops.triton.greedy_accept import greedy_accept
from loraplex.ops.triton.grouped_lora_add import grouped_lora_add
from loraplex.ops.triton.int4_gemm import int4_dequantize, int4_fuses_expand, int4_linear
from loraplex.ops.triton.kv_cache import write_kv_cache, write_latent_cache
from loraplex.ops.triton.lora_act_gemv import lora_act_gemv
from loraplex.ops.triton.lora_act_sgmv import lora_act_sgmv
from loraplex.ops.triton.lora_common import GEMV_MAX_TOKENS
from loraplex.ops.triton.lora_expand_gemv import lora_expand_gemv
from loraplex.ops.triton.lora_expand_sgmv import lora_expand_sgmv
from loraplex.ops.triton.lora_shrink_gemv import lora_shrink_gemv
from loraplex.ops.triton.lora_shrink_sgmv import lora_shrink_sgmv
from loraplex.ops.triton.mla_decode import mla_decode_attention
from loraplex.ops.triton.mla_prefill import mla_prefill_attention
from loraplex.ops.triton.moe_route import route_experts
from loraplex.ops.triton.moe_route_gemv import MAX_TOKENS as ROUTE_GEMV_MAX_TOKENS
from loraplex.ops.triton.moe_route_gemv import route_tokens_gemv
from loraplex.ops.triton.ngram_inputs import ngram_inputs
from loraplex.ops.triton.paged_attention import paged_attention
from loraplex.ops.triton.pair_rows import copy_rows_to_pairs
from loraplex.ops.triton.rms_norm import add_rms_norm, rms_norm, rms_norm_backward, rms_norm_train
from loraplex.ops.triton.rope_train import rope_train, rope_train_backward
from loraplex.ops.triton.rotary import rotary_embedding
from loraplex.ops.triton.rotate_and_store import rotate_and_store
from loraplex.ops.triton.sample import race_sample
from loraplex.ops.triton.silu_mul_weighted import silu_mul_weighted, silu_mul_weighted_backward
from loraplex.ops.triton.split_k_sum import FusedExpand
from loraplex.ops.triton.token_sum import sum_rows_by_token

route_experts_grouped = reference.route_experts_grouped  # a few torch ops, no host sync (graph safe)


def mla_attention(q_nope, q_pe, cache, w_uk, w_uv, batch, scale, lora=None):
    """Decode steps: the split kernel over the latents (graph safe); steps with longer
    chunks (prefill, verification; always eager): keys and values expanded, sequence by
    sequence."""
    if batch.max_query_len == 1:
        return mla_decode_attention(q_nope, q_pe, cache, w_uk, w_uv, batch, scale, lora)
    return mla_prefill_attention(q_nope, q_pe, cache, w_uk, w_uv, batch, scale, lora)


def lora_shrink(x, lora_a, batch):
    if x.shape[0] <= GEMV_MAX_TOKENS:
        return lora_shrink_gemv(x, lora_a, batch)
    return lora_shrink_sgmv(x, lora_a, batch)


def lora_expand(buf, lora_b, y, slice_sizes, batch):
    if buf.shape[1] <= GEMV_MAX_TOKENS:
        return lora_expand_gemv(buf, lora_b, y, slice_sizes, batch)
    return lora_expand_sgmv(buf, lora_b, y, slice_sizes, batch)


def lora_act_and_mul(gate_up, buf, lora_b, batch, activation):
    if gate_up.shape[0] <= GEMV_MAX_TOKENS:
        return lora_act_gemv(gate_up, buf, lora_b, batch, activation)
    return lora_act_sgmv(gate_up, buf, lora_b, batch, activation)


def route_tokens(x, weight, bias, top_k, renormalize):
    """Decode-sized steps: logits and routing in one kernel; else the router's GEMM, then
    route_experts."""
    if x.shape[0] <= ROUTE_GEMV_MAX_TOKENS:
        return route_tokens_gemv(x, weight, bias, top_k, renormalize)
    return route_experts(F.linear(x, weight, bias), top_k, renormalize)


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """One kernel per format (int4: 2-D weights, as dense layers hold them)."""
    if isinstance(w, Int4Weight):
        return int4_dequantize(w) if w.data.dim() == 2 else reference.dequantize(w)
    return _dequantize(w)


def quant_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None,
                 x_fp8: Fp8Rows | None = None) -> torch.Tensor:
    """ops.linear of a quantized weight: one kernel per format (ops/formats)."""
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w, bias, x_fp8=x_fp8)
    if isinstance(w, Int4Weight):
        return int4_linear(x, w, bias)
    return reference.quant_linear(x, w, bias)


def lora_linear(x, weight, bias, lora_a, lora_b, slice_sizes, batch, side_stream=None, x_fp8=None):
    """The shrink first (beside the base matmul on side_stream: it reads only x), then the
    base matmul and the expand: in one kernel where the base matmul ends in a kernel of
    its own (int4 and FP8 GEMMs whose config splits K: the split-K sum), else
    lora_expand on its output."""
    with beside(side_stream):
        buf = lora_shrink(x, lora_a, batch)

    def joined():
        join(side_stream)

    if isinstance(weight, Int4Weight) and int4_fuses_expand(x, weight):
        return int4_linear(x, weight, bias, lora=FusedExpand(buf, lora_b, tuple(slice_sizes), batch, joined))
    if isinstance(weight, Fp8Weight) and fp8_fuses_expand(x, weight):
        return fp8_linear(x, weight, bias, lora=FusedExpand(buf, lora_b, tuple(slice_sizes), batch, joined),
                          x_fp8=x_fp8)
    if isinstance(weight, torch.Tensor):
        y = F.linear(x, weight, bias)
    else:
        y = quant_linear(x, weight, bias, x_fp8)
    joined()
    lora_expand(buf, lora_b, y, slice_sizes, batch)
    return y


def warm_up_lora(lora_a, lora_b, slice_sizes, max_tokens):
    """The GEMV kernels' split-K (and a stride or two) follow the token count, so each
    count up to GEMV_MAX_TOKENS may be its own compiled variant: run them all once, with
    no token on an adapter (decode graphs cover their batch sizes; an eager step of 33-64
    tokens otherwise compiled one mid-serving, ~1 s for every request in flight)."""
    max_loras, dev = lora_a.shape[1], lora_a.device
    for n in range(1, min(max_tokens, GEMV_MAX_TOKENS) + 1):
        batch = make_lora_batch([-1] * n, [0] * max_loras, max_loras, dev)
        x = torch.zeros(n, lora_a.shape[3], dtype=lora_a.dtype, device=dev)
        y = torch.zeros(n, sum(slice_sizes), dtype=lora_a.dtype, device=dev)
        lora_expand(lora_shrink(x, lora_a, batch), lora_b, y, slice_sizes, batch)


__all__ = [
    "copy_rows_to_pairs",
    "mla_attention",
    "write_latent_cache",
    "dequantize",
    "fused_experts",
    "quant_linear",
    "route_experts",
    "route_experts_grouped",
    "route_tokens",
    "add_rms_norm",
    "gelu_tanh_and_mul",
    "grouped_lora_add",
    "lora_act_and_mul",
    "lora_expand",
    "lora_linear",
    "lora_shrink",
    "paged_attention",
    "race_sample",
    "ngram_inputs",
    "greedy_accept",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_train",
    "rope_train",
    "rope_train_backward",
    "rotary_embedding",
    "rotate_and_store",
    "silu_and_mul",
    "silu_mul_weighted",
    "silu_mul_weighted_backward",
    "sum_rows_by_token",
    "warm_up_lora",
    "warm_up_moe",
    "write_kv_cache",
]
