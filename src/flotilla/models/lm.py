"""A small character-level transformer language model as an ``nn.Sequential`` of pipeline layers.

Layers, in order (``depth`` blocks): ``CharEmbedding`` (token + learned position embedding),
``TransformerBlock`` x depth (pre-norm causal self-attention and a 4x MLP, residual), ``LMHead``
(final norm and the projection to the vocabulary).  Every layer maps one tensor to one tensor, so
the model can be cut between any two layers; activations between layers are ``[B, T, d]`` float32.

Invariants:

- every parameter lives in an ``nn.Linear`` and the norms have no affine parameters, so the zoo's
  deterministic initialiser (``flotilla.models.zoo``) builds it bitwise-reproducibly from a seed;
- the input is ``[B, T]`` character ids (int64, or float ids which are rounded);
- the output is ``[B, V, T]`` logits (class dimension second), so the zoo's loss
  ``cross_entropy(output, y)`` with per-position targets ``y`` of shape ``[B, T]`` is the usual
  mean next-character loss;
- the attention is causal: the output at position t depends only on inputs 0..t.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["CharEmbedding", "LMHead", "TransformerBlock", "char_transformer", "char_transformer_layers"]

DEFAULT_WIDTH = 64
DEFAULT_DEPTH = 4
HEAD_DIM = 32


class CharEmbedding(nn.Module):
    """Token plus learned position embedding; both tables are ``nn.Linear`` weights (``[d, V]``)."""

    def __init__(self, vocab_size: int, seq_len: int, width: int) -> None:
        super().__init__()
        self.tokens = nn.Linear(vocab_size, width, bias=False)
        self.positions = nn.Linear(seq_len, width, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.long()
        seq_len = ids.shape[1]
        if seq_len > self.positions.weight.shape[1]:
            raise ValueError(f"sequence of {seq_len} > the model's context {self.positions.weight.shape[1]}")
        return F.embedding(ids, self.tokens.weight.t()) + self.positions.weight.t()[:seq_len]


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; causal multi-head attention."""

    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        if width % num_heads:
            raise ValueError(f"width {width} must be divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = F.layer_norm(x, (d,))
        q, k, v = self.qkv(h).view(b, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(F.layer_norm(x, (d,)))))


class LMHead(nn.Module):
    """Final norm and projection to the vocabulary; returns ``[B, V, T]`` logits."""

    def __init__(self, width: int, vocab_size: int) -> None:
        super().__init__()
        self.out = nn.Linear(width, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.layer_norm(x, (x.shape[-1],))).transpose(1, 2)


def char_transformer_layers(
    seq_len: int, vocab_size: int, width: int = DEFAULT_WIDTH, depth: int = DEFAULT_DEPTH
) -> list[nn.Module]:
    """The layer list (embedding, ``depth`` blocks, head); parameters are NOT initialised here."""
    if seq_len < 1 or vocab_size < 2 or width < 1 or depth < 1:
        raise ValueError(
            f"need seq_len >= 1, vocab_size >= 2, width >= 1, depth >= 1; "
            f"got {seq_len}, {vocab_size}, {width}, {depth}"
        )
    num_heads = max(1, width // HEAD_DIM) if width % HEAD_DIM == 0 else 1
    return [
        CharEmbedding(vocab_size, seq_len, width),
        *(TransformerBlock(width, num_heads) for _ in range(depth)),
        LMHead(width, vocab_size),
    ]


def char_transformer(input_shape: Sequence[int], num_classes: int, width: int | None) -> list[nn.Module]:
    """Zoo factory: ``input_shape = (seq_len,)``, ``num_classes`` = vocabulary size, ``width`` = d
    (default 64); four blocks of ``width / 32`` heads (~200 k parameters at the defaults)."""
    if len(input_shape) != 1:
        raise ValueError(f"char_transformer needs input_shape (seq_len,), got {tuple(input_shape)}")
    return char_transformer_layers(int(input_shape[0]), int(num_classes), width or DEFAULT_WIDTH)
