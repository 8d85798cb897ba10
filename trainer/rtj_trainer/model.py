"""A GPT-style decoder: the smallest model that exercises FSDP the way real LLM training does.

Pre-norm transformer blocks (causal self-attention through `scaled_dot_product_attention`, which
picks flash attention on CUDA, and a GELU MLP), learned positional embeddings and an untied output
head. Each block is its own FSDP unit (see rtj_trainer.parallel), so the block list is exposed as
`model.blocks`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        shape = (batch, seq, self.num_heads, width // self.num_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(batch, seq, width))
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm_attn = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.norm_mlp = nn.LayerNorm(cfg.d_model)
        hidden = cfg.ffn_multiplier * cfg.d_model
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, hidden, bias=False),
            nn.GELU(approximate="tanh"),
            nn.Linear(hidden, cfg.d_model, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_attn(x))
        out: torch.Tensor = x + self.mlp(self.norm_mlp(x))
        return out


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.position_embedding = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm_out = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """GPT-2 style init from an explicit generator, so every rank builds the same weights."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.num_layers)
        for name, param in self.named_parameters():
            if param.dim() == 1:  # LayerNorm
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith(("attn.proj.weight", "mlp.2.weight")):
                param.normal_(0.0, residual_std, generator=generator)
            else:
                param.normal_(0.0, 0.02, generator=generator)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm_out(x))
        return logits


def parameter_count(cfg: ModelConfig) -> int:
    """Exact number of parameters of `GPT(cfg)`, without building it."""
    d, hidden = cfg.d_model, cfg.ffn_multiplier * cfg.d_model
    per_block = 4 * d + 3 * d * d + d * d + 2 * d * hidden
    return cfg.vocab_size * d * 2 + cfg.seq_len * d + cfg.num_layers * per_block + 2 * d


def flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token (6N plus attention), for model-FLOPs utilisation."""
    attention = 12 * cfg.num_layers * cfg.d_model * cfg.seq_len
    return 6 * parameter_count(cfg) + attention
