"""Dense decoder-only causal LMs: Llama 3.x, Mistral, Qwen2/2.5, Qwen3.

Their differences (qkv bias, q/k norm, sliding windows, rope scaling) are ModelConfig
fields read by the shared blocks, so one class serves all four; other architectures
subclass it with their own decoder layer (models/gemma3.py).
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
    def __init__(self, cfg: ModelConfig, max_positions: int, layer_cls: type[nn.Module]):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.embed_scale)
        # One rotary table per layer type (Gemma 3 gives local and global layers their own base).
        rotary = {t: RotaryEmbedding(cfg.head_dim, max_positions, rope) for t, rope in cfg.rope.items()}
        self.layers = nn.ModuleList(
            layer_cls(cfg, i, rotary[cfg.layer_types[i]]) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma_norms)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        return self.norm(h, residual)[0]


class DenseCausalLM(nn.Module):
    layer_cls: type[nn.Module] = DecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, max_positions, self.layer_cls)
        self.lm_head = (
            self.model.embed_tokens
            if cfg.tie_word_embeddings
            else VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        )
        self.lm_head.softcap = cfg.final_logit_softcap

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head.logits(hidden)
