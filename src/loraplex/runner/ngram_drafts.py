"""n-gram speculation planned ahead of results: the proposals are made on the device.

A step that verifies proposals adds 1 to k + 1 tokens to each of its sequences, so the
host cannot know, while that step runs, where each sequence's next step starts or which
tokens end it. The scheduler plans the next step anyway, as if every proposal were kept
(engine/scheduler.py), with k placeholder tokens after a pending one for each request
that speculates; before that step runs, one kernel (`ops.ngram_inputs`) completes its
inputs from the step before: the token each sequence added (the pending one), its
positions and KV slots moved back by the proposals not kept, and the proposals
themselves, found in a per-sequence history of its tokens on the device (a row the
scheduler assigns at admission; every step records its tokens there). Planning thus
overlaps the device's work as in plain decoding, and a proposal always reads the
sequence's newest tokens. Under tensor parallelism every rank keeps the same history and
makes the same proposals; the leader's verification tells the others where each
sequence goes on (ModelRunner._verify).
"""

from __future__ import annotations

import logging

import torch

from loraplex import ops
from loraplex.config import SpeculativeConfig
from loraplex.device import to_device
from loraplex.runner.batch_meta import StepInputs
from loraplex.types import StepPlan

logger = logging.getLogger("loraplex")


class NgramDrafts:
    def __init__(self, spec: SpeculativeConfig, max_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device):
        self.n_min, self.n_max = spec.prompt_lookup_min, spec.prompt_lookup_max
        self.block_size = block_size
        # Row r: the tokens of the request holding row r, by position (allocated before
        # the KV cache is sized, so the cache leaves room for it).
        self.history = torch.zeros(max_seqs, max_model_len, dtype=torch.int32, device=device)
        logger.info("n-gram proposals on the device: a token history of %d x %d (%.0f MiB)", max_seqs,
                    max_model_len, self.history.numel() * 4 / 2**20)
        self.no_shift = torch.zeros(max(max_seqs, 1), dtype=torch.int32, device=device)
        self._no_ids = torch.zeros(1, dtype=torch.int64, device=device)

    def complete(self, plan: StepPlan, inputs: StepInputs, last_ids: torch.Tensor | None,
                 last_shift: torch.Tensor | None) -> torch.Tensor:
        """Complete `inputs` (in place; inputs.ngram_chunks says how) from the previous
        step's device outputs: last_ids the token each of its rows added, last_shift
        (None: zeros) by how much each row's sequence fell short of the plan. Returns
        each chunk's proposal length [C] int32 (the rest of its placeholders are
        verified as no proposal)."""
        max_drafts = 0
        for chunk in plan.chunks:
            if chunk.device_drafts:
                max_drafts = max(max_drafts, len(chunk.draft_ids))
            if chunk.history_prefix:  # tokens it found cached: never fed, so recorded here
                prefix = to_device(chunk.history_prefix, torch.int32, self.history.device)
                self.history[chunk.history_row, : len(prefix)] = prefix
        attn = inputs.attn
        return ops.ngram_inputs(
            inputs.input_ids, inputs.positions, attn.slot_mapping, attn.seq_lens, attn.block_tables,
            attn.query_start_loc, inputs.ngram_chunks, self._no_ids if last_ids is None else last_ids,
            self.no_shift if last_shift is None else last_shift, self.history, self.block_size,
            self.n_min, self.n_max, max_drafts)
