"""The plain-torch backend: every op, written for clarity; CPU path and test oracle."""

from loraplex.ops.reference.attention import paged_attention, rotate_and_store, write_kv_cache
from loraplex.ops.reference.elementwise import (
    add_rms_norm,
    gelu_tanh_and_mul,
    rms_norm,
    rms_norm_backward,
    rms_norm_train,
    rope_train,
    rope_train_backward,
    rotary_embedding,
    silu_and_mul,
)
from loraplex.ops.reference.lora import lora_act_and_mul, lora_expand, lora_linear, lora_shrink
from loraplex.ops.reference.mla import mla_attention, write_latent_cache
from loraplex.ops.reference.moe import fused_experts, route_experts, route_experts_grouped, route_tokens
from loraplex.ops.reference.quant import dequantize, quantize
from loraplex.ops.reference.quant import linear as quant_linear
from loraplex.ops.reference.sampling import race_sample
from loraplex.ops.reference.speculation import greedy_accept, ngram_inputs
from loraplex.ops.reference.train_moe import (
    copy_rows_to_pairs,
    grouped_lora_add,
    silu_mul_weighted,
    silu_mul_weighted_backward,
    sum_rows_by_token,
)

__all__ = [
    "copy_rows_to_pairs",
    "mla_attention",
    "write_latent_cache",
    "dequantize",
    "fused_experts",
    "quant_linear",
    "quantize",
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
    "write_kv_cache",
]
