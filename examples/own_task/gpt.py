"""A user task whose model is written the way the transformers library writes GPT-2 -- not an
``nn.Sequential``: token and position embeddings, a ``ModuleList`` of pre-norm blocks looped in
``forward``, a final norm, and an output head tied to the token embedding.

flotilla pipelines it by tracing it and cutting it at named modules (``strategy.split_points``,
e.g. ``["transformer.h.2"]``; ``docs/pipeline.md``); ``model.safetensors`` holds this class's own
``state_dict`` (``GPT2LMHead`` loads it with ``strict=True``).  The data: arithmetic sequences
modulo ``vocab`` (each token is the one before plus a stride of 1 to 3), generated from a seed.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

import flotilla


class Attention(nn.Module):
    """Causal multi-head self-attention (one fused q/k/v projection, a causal mask buffer)."""

    def __init__(self, dim: int, heads: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool)).view(1, 1, seq_len, seq_len)
        self.register_buffer("bias", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(n, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        scores = scores.masked_fill(~self.bias[:, :, :t, :t], float("-inf"))
        y = self.attn_dropout(scores.softmax(dim=-1)) @ v
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(n, t, c)))


class MLP(nn.Module):
    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.c_proj = nn.Linear(4 * dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    """``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, dim: int, heads: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, seq_len, dropout)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, vocab: int, seq_len: int, dim: int, layers: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq_len, dim)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(dim, heads, seq_len, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(input_ids.size(1), device=input_ids.device)
        hidden = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        for block in self.h:
            hidden = block(hidden)
        return self.ln_f(hidden)


class GPT2LMHead(nn.Module):
    """The language model: ``lm_head`` shares its weight with ``transformer.wte`` when ``tied``."""

    def __init__(
        self,
        vocab: int = 16,
        seq_len: int = 12,
        dim: int = 32,
        layers: int = 4,
        heads: int = 4,
        dropout: float = 0.0,
        tied: bool = True,
    ) -> None:
        super().__init__()
        self.transformer = GPT2Model(vocab, seq_len, dim, layers, heads, dropout)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.transformer(input_ids))


class TinyGPT(flotilla.Task):
    """Next-token prediction on arithmetic sequences with :class:`GPT2LMHead`.

    ``task_args``: vocab, seq_len, dim, layers, heads, dropout, tied, num_samples, seed."""

    target = ("accuracy", 0.9, "max")

    def __init__(
        self,
        vocab: int = 16,
        seq_len: int = 12,
        dim: int = 32,
        layers: int = 4,
        heads: int = 4,
        dropout: float = 0.0,
        tied: bool = True,
        num_samples: int = 4000,
        seed: int = 0,
    ) -> None:
        self.shape = dict(vocab=vocab, seq_len=seq_len, dim=dim, layers=layers, heads=heads)
        self.dropout, self.tied, self.vocab = dropout, tied, vocab
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (num_samples, 1), generator=g)
        stride = torch.randint(1, 4, (num_samples, 1), generator=g)
        ids = (start + stride * torch.arange(seq_len + 1)) % vocab
        cut = int(0.8 * num_samples)
        self.train = (ids[:cut, :-1], ids[:cut, 1:])
        self.test = (ids[cut:, :-1], ids[cut:, 1:])

    def build_model(self) -> GPT2LMHead:
        return GPT2LMHead(**self.shape, dropout=self.dropout, tied=self.tied)

    def train_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.train

    def eval_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.test

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, self.vocab), target.reshape(-1))

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        return {"accuracy": float((output.argmax(dim=-1) == target).float().mean())}
