"""The Triton backend: one kernel per file, each with its block configs beside it.

Same names and signatures as `loraplex.ops.reference`, which is every kernel's oracle.
Runs on CUDA GPUs, and on CPU tensors under TRITON_INTERPRET=1 (tests).
"""

from loraplex.ops.triton.activation import silu_and_mul
from loraplex.ops.triton.kv_cache import write_kv_cache
from loraplex.ops.triton.lora_expand import lora_expand
from loraplex.ops.triton.lora_shrink import lora_shrink
from loraplex.ops.triton.paged_attention import paged_attention
from loraplex.ops.triton.rms_norm import add_rms_norm, rms_norm
from loraplex.ops.triton.rotary import rotary_embedding

__all__ = [
    "add_rms_norm",
    "lora_expand",
    "lora_shrink",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv_cache",
]
