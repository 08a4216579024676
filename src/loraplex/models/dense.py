"""Dense decoder-only causal LMs: Llama 3.x, Mistral, Qwen2/2.5, Qwen3.

Their differences (qkv bias, q/k norm, sliding windows, rope scaling) are ModelConfig
fields read by the shared blocks, so one class serves all four.
"""

from __future__ import annotations

import torch
from torch import nn

from loraplex.config import ModelConfig
from loraplex.layers.embedding import VocabEmbedding
from loraplex.layers.norm import RMSNorm
from loraplex.layers.rotary import RotaryEmbedding
from loraplex.models.blocks import DecoderLayer


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_parameters)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        return self.norm(h, residual)[0]


class DenseCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, max_positions)
        self.lm_head = (
            self.model.embed_tokens
            if cfg.tie_word_embeddings
            else VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head.logits(hidden)
