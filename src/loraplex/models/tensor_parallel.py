"""How a model is split across the ranks of a tensor-parallel group (Megatron's split).

- Attention: each rank holds num_heads / N query heads with their K/V heads (a KV head
  is replicated when there are fewer than N: rank r holds head r * kv / N); q/k/v are
  column-parallel, o row-parallel; attention sinks split with their heads.
- Dense MLPs: gate/up column-parallel, down row-parallel.
- MoE: every rank holds every expert, split by intermediate dimension (not expert by
  expert): routing and alignment are then identical everywhere, each rank's work is
  even whatever the routing's skew, and expert adapters split like a dense MLP's. The
  router is replicated.
- Embedding and LM head: vocabulary-parallel.
- Latent attention (DeepSeek): by heads; the latent projections and the latent cache are
  whole on every rank (every head reads every latent).

The model is built from `shard_config`'s ModelConfig (every size the rank's own), then
`shard_model` attaches the shards; `param_shards` gives each parameter's part of its
full checkpoint tensor, which loading and dummy weights take.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from loraplex.config import ModelConfig
from loraplex.errors import UnsupportedModel
from loraplex.layers.embedding import VocabEmbedding
from loraplex.layers.linear import LoRALinear
from loraplex.layers.moe import Experts, SparseMoE
from loraplex.layers.parallel import ExpertShard, LinearShard, Shard, TPGroup, VocabShard, split
from loraplex.models.blocks import GatedMLP, SelfAttention
from loraplex.models.deepseek_v2 import LatentSelfAttention


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The ModelConfig of one rank's shard; fails naming what does not split by `size`."""
    if cfg.quant is not None:
        raise UnsupportedModel(f"{cfg.architecture}: tensor parallelism serves bf16/float checkpoints; "
                               f"this one is {cfg.quant.method}")
    checks = {"num_attention_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size}
    if cfg.moe_layers:
        checks["moe_intermediate_size"] = cfg.moe_intermediate_size
    for name, n in checks.items():
        if n % size:
            raise UnsupportedModel(f"{cfg.architecture}: {name}={n} does not split across "
                                   f"tensor_parallel_size={size}")
    kv = cfg.num_kv_heads
    if cfg.mla is None and kv % size and size % kv:
        raise UnsupportedModel(f"{cfg.architecture}: num_key_value_heads={kv} neither splits across nor "
                               f"replicates evenly over tensor_parallel_size={size}")
    return dataclasses.replace(
        cfg, num_heads=cfg.num_heads // size, num_kv_heads=max(1, kv // size),
        intermediate_size=cfg.intermediate_size // size,
        moe_intermediate_size=cfg.moe_intermediate_size // size)


def shard_model(model: nn.Module, full: ModelConfig, group: TPGroup) -> None:
    """Attach each layer's shard (model built from shard_config(full, group.size))."""
    n, r = group.size, group.rank
    q_rows = split(full.q_size, n, r)
    kv_head = r * full.num_kv_heads // n
    kv_rows = split(full.kv_size, n, r) if full.num_kv_heads >= n else (
        kv_head * full.head_dim, (kv_head + 1) * full.head_dim)
    for m in model.modules():
        if isinstance(m, SelfAttention):
            m.qkv_proj.tp = LinearShard(group, "column", full.hidden_size,
                                        (full.q_size, full.kv_size, full.kv_size), (q_rows, kv_rows, kv_rows))
            m.o_proj.tp = LinearShard(group, "row", full.q_size, (full.hidden_size,), cols=q_rows)
        elif isinstance(m, LatentSelfAttention):
            _shard_latent_attention(m, full, group)
        elif isinstance(m, GatedMLP):  # dense, or DeepSeek's shared experts (their own size)
            i = m.gate_up_proj.output_sizes[0] * n
            rows = split(i, n, r)
            m.gate_up_proj.tp = LinearShard(group, "column", full.hidden_size, (i, i), (rows, rows))
            m.down_proj.tp = LinearShard(group, "row", i, (full.hidden_size,), cols=rows)
        elif isinstance(m, Experts):
            m.tp = ExpertShard(group, full.moe_intermediate_size, *split(full.moe_intermediate_size, n, r))
        elif isinstance(m, VocabEmbedding):
            per = -(-full.vocab_size // n)
            lo = min(r * per, full.vocab_size)
            m.tp = VocabShard(group, full.vocab_size, lo, min(lo + per, full.vocab_size), per)
            if m.weight.shape[0] != per:  # built whole (the config keeps the full vocabulary)
                w = m.weight
                m.weight = nn.Parameter(w.new_empty(per, w.shape[1]), requires_grad=False)
    routers = {id(getattr(m, m.router_name)) for m in model.modules() if isinstance(m, SparseMoE)}
    for path, m in model.named_modules():
        if isinstance(m, LoRALinear) and m.tp is None and id(m) not in routers:
            raise UnsupportedModel(f"{full.architecture}: {path} has no tensor-parallel split")


def _shard_latent_attention(m: nn.Module, full: ModelConfig, group: TPGroup) -> None:
    """MLA by heads: each rank's query heads (q_proj or q_b_proj), their kv_b_proj rows
    (keys and values per head) and o_proj columns; the latent projections (q_a_proj,
    kv_a_proj_with_mqa) and so the latent cache are whole on every rank."""
    mla, n, r = full.mla, group.size, group.rank
    heads = split(full.num_heads, n, r)
    q_dims, kv_dims = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.qk_nope_head_dim + mla.v_head_dim
    q_out = full.num_heads * q_dims
    q_rows = (heads[0] * q_dims, heads[1] * q_dims)
    whole = (0, mla.cache_dim)
    if mla.q_lora_rank is None:
        m.qkv_a_proj.tp = LinearShard(group, "column", full.hidden_size, (q_out, mla.cache_dim),
                                      (q_rows, whole))
    else:
        m.qkv_a_proj.tp = LinearShard(group, "column", full.hidden_size, (mla.q_lora_rank, mla.cache_dim),
                                      ((0, mla.q_lora_rank), whole))
        m.q_b_proj.tp = LinearShard(group, "column", mla.q_lora_rank, (q_out,), (q_rows,))
    m.kv_b_proj.tp = LinearShard(group, "column", mla.kv_lora_rank, (full.num_heads * kv_dims,),
                                 ((heads[0] * kv_dims, heads[1] * kv_dims),))
    m.o_proj.tp = LinearShard(group, "row", full.num_heads * mla.v_head_dim, (full.hidden_size,),
                              cols=(heads[0] * mla.v_head_dim, heads[1] * mla.v_head_dim))


def param_shards(model: nn.Module) -> dict[str, Shard]:
    """Parameter name -> this rank's part of its full tensor (replicated ones absent)."""
    out = {}
    for path, m in model.named_modules():
        prefix = f"{path}." if path else ""
        if isinstance(m, LoRALinear) and m.tp is not None:
            out[prefix + "weight"] = m.tp.fused(1)
            if m.bias is not None:
                out[prefix + "bias"] = m.tp.fused(0)
        elif isinstance(m, Experts) and m.tp is not None:
            out[prefix + "gate_up_proj"] = m.tp.gate_up(1)
            out[prefix + "down_proj"] = m.tp.down(2)
            if m.gate_up_proj_bias is not None:
                out[prefix + "gate_up_proj_bias"] = m.tp.gate_up(1)
                out[prefix + "down_proj_bias"] = m.tp.down_bias(m.hidden_size)
        elif isinstance(m, VocabEmbedding) and m.tp is not None:
            out[prefix + "weight"] = m.tp.rows()
        elif isinstance(m, SelfAttention) and m.sinks is not None:
            full_heads = m.qkv_proj.tp.full_sizes[0] // m.head_dim
            lo = m.qkv_proj.tp.rows[0][0] // m.head_dim
            out[prefix + "sinks"] = Shard(0, full_heads, ((lo, lo + m.num_heads),))
    return out
