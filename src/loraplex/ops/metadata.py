"""Per-step batch descriptions that ops consume; the model runner builds them.

Tokens of a step are flat, `T` of them, sequence after sequence. Device tensors are views
of the runner's preallocated buffers (so a decode step can be replayed from a CUDA
graph); `*_cpu` fields are host copies for the reference ops, which loop in Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

# Steps whose chunks have at most this many tokens (decodes; speculative verification,
# k + 1 tokens a sequence) attend with the decode kernels, a sequence's tokens and heads
# in one tile (ops/triton/paged_decode.py): on Gemma 3 270M the chunked-prefill kernel
# took 47 us a layer for one 5-token chunk over 600 keys, a decode token 12 (H100).
SHORT_QUERY_MAX = 8


@dataclass
class AttentionBatch:
    slot_mapping: torch.Tensor  # [T] int64: KV slot of each token (page * block_size + offset)
    query_start_loc: torch.Tensor  # [B + 1] int32: seq b owns tokens [qsl[b], qsl[b + 1])
    seq_lens: torch.Tensor  # [B] int32: seq b's context after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32: seq b's KV pages, in order
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class LoRAGroup:
    slot: int  # adapter slot shared by the group's tokens
    start: int  # the group's tokens are sorted_token_ids[start:end]
    end: int
    rank: int  # the adapter's rank: columns >= rank of its A/B slot are zero


@dataclass
class LoRABatch:
    """Tokens grouped by adapter slot; tokens without an adapter belong to no group."""

    token_slot: torch.Tensor  # [T] int32: adapter slot of each token, -1 = none
    sorted_token_ids: torch.Tensor  # [T] int64: token indices ordered by slot (groups first)
    group_slots: torch.Tensor  # [max_loras] int32: slot of group g, -1 past the last group
    group_starts: torch.Tensor  # [max_loras + 1] int32: group g is sorted ids [gs[g], gs[g+1])
    group_ranks: torch.Tensor  # [max_loras] int32: rank of group g's adapter, 0 past the last
    slot_ranks: torch.Tensor  # [max_loras] int32: rank of the adapter in each slot, 0 = empty
    groups: list[LoRAGroup]  # host copy of the groups (reference ops only)
    # Host copy of token_slot, in eager steps (None in a CUDA graph's inputs): ops that loop
    # over sequences on the host read it without a device sync.
    host_token_slot: np.ndarray | None = None
    # Some token uses an adapter. Kernels read only the device tensors above, so a CUDA
    # graph captured once serves any mix of adapters and base tokens.
    active: bool = True
    # Some token's adapter is DoRA: adapted layers rescale their rows (eager steps only).
    dora: bool = False
    # Per-step values derived by backends (e.g. kernel tilings), computed once per step.
    cache: dict = field(default_factory=dict, repr=False)


@dataclass
class QKNorm:
    """Per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3), as ops.rms_norm."""

    q_weight: torch.Tensor  # [D]
    k_weight: torch.Tensor  # [D]
    eps: float
    unit_offset: bool = False


@dataclass
class MoELoRA:
    """Adapters on the experts of one MoE layer, for one step. Slot s of each tensor
    holds that adapter's per-expert A and B (scaling folded into B), zero past its rank
    and for experts (or layers) it does not adapt. The gate_up delta is one matrix per
    expert: PEFT's fused layout has one A for gate and up; per-expert gate_proj/up_proj
    pairs stack as A = [A_gate; A_up], B = [[B_gate, 0], [0, B_up]]."""

    a_gate_up: torch.Tensor  # [max_loras, E, R_gu, H]
    b_gate_up: torch.Tensor  # [max_loras, E, 2I, R_gu]
    a_down: torch.Tensor  # [max_loras, E, R_d, I]
    b_down: torch.Tensor  # [max_loras, E, H, R_d]
    token_slot: torch.Tensor  # [T] int32: adapter slot of each token, -1 = none
    # [max_loras] int32: nonzero where the slot's adapter adapts these experts (kernels
    # skip the other slots' tokens: no work for attention-only adapters); None: all.
    slot_mask: torch.Tensor | None = None
    # [2, max_loras] int32: each slot's gate_up and down rank (A/B are zero past them, so
    # kernels may stop reading there); None: read the whole capacity.
    ranks: torch.Tensor | None = None


@dataclass
class MLALoRA:
    """Adapters on kv_b_proj of one latent-attention layer, for one step: slot s holds
    A [R, kv_lora_rank] and B split per head into its key rows [nope, R] and value rows
    [v, R] (scaling folded into B, zero past the adapter's rank)."""

    a: torch.Tensor  # [max_loras, R, kv_lora_rank]
    b_k: torch.Tensor  # [max_loras, H, qk_nope_head_dim, R]
    b_v: torch.Tensor  # [max_loras, H, v_head_dim, R]
    batch: LoRABatch  # which tokens use which slot


def group_tokens(token_slot: np.ndarray, slot_ranks: list[int], max_loras: int):
    """Token indices ordered by adapter slot, base tokens (-1) last (stable), and the
    groups of that order. Returns (order, groups)."""
    order = np.argsort(np.where(token_slot < 0, max_loras, token_slot), kind="stable")
    slots, starts, counts = np.unique(token_slot[order], return_index=True, return_counts=True)
    groups = [
        LoRAGroup(int(s), int(a), int(a + c), slot_ranks[s])
        for s, a, c in zip(slots, starts, counts)
        if s >= 0
    ]
    return order, groups


def make_lora_batch(token_slot: list[int], slot_ranks: list[int], max_loras: int,
                    device: torch.device | str) -> LoRABatch:
    """A LoRABatch in fresh tensors, for tests and benchmarks (the runner fills its
    preallocated buffers the same way)."""
    order, groups = group_tokens(np.asarray(token_slot), slot_ranks, max_loras)
    pad = max_loras - len(groups)
    end = groups[-1].end if groups else 0
    i32 = dict(dtype=torch.int32, device=device)
    return LoRABatch(
        token_slot=torch.tensor(token_slot, **i32),
        sorted_token_ids=torch.tensor(order, dtype=torch.int64, device=device),
        group_slots=torch.tensor([g.slot for g in groups] + [-1] * pad, **i32),
        group_starts=torch.tensor([g.start for g in groups] + [end] * (pad + 1), **i32),
        group_ranks=torch.tensor([g.rank for g in groups] + [0] * pad, **i32),
        slot_ranks=torch.tensor(slot_ranks[:max_loras], **i32),
        groups=groups,
        host_token_slot=np.asarray(token_slot, dtype=np.int32),
        active=bool(groups),
    )
