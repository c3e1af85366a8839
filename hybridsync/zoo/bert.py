"""BERT-like encoder: a dense-gradient token embedding + a few transformer blocks written out,
so there are many mid-size tensors (attention q/k/v/o, layer norms, feed-forward)."""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch import nn

from hybridsync.zoo.base import ZooModel, teacher

VOCAB = 8000
SEQ_LEN = 32
NUM_CLASSES = 4
TOPIC_TOKENS = 50
"""Each class owns this many tokens; a sentence is a mix of its class's tokens and common noise tokens."""
TOPIC_FRACTION = 0.5


class EncoderBlock(nn.Module):
    """Post-norm transformer encoder block with separate q/k/v/o projections."""

    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value, self.output = (nn.Linear(dim, dim) for _ in range(4))
        self.attention_norm = nn.LayerNorm(dim)
        self.ffn_in = nn.Linear(dim, ffn)
        self.ffn_out = nn.Linear(ffn, dim)
        self.ffn_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = (proj(x).view(batch, seq, self.heads, -1).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dim // self.heads), dim=-1)
        attended = (weights @ v).transpose(1, 2).reshape(batch, seq, dim)
        x = self.attention_norm(x + self.output(attended))
        return self.ffn_norm(x + self.ffn_out(nn.functional.gelu(self.ffn_in(x))))


class Bert(nn.Module):
    """Token + position embeddings, encoder blocks, and a classifier on the first token."""

    def __init__(self, vocab: int = VOCAB, seq_len: int = SEQ_LEN, dim: int = 128, heads: int = 4,
                 ffn: int = 512, blocks: int = 2, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, dim)
        self.position_embedding = nn.Embedding(seq_len, dim)
        self.embedding_norm = nn.LayerNorm(dim)
        self.blocks = nn.ModuleList(EncoderBlock(dim, heads, ffn) for _ in range(blocks))
        self.classifier = nn.Linear(dim, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding_norm(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.classifier(x.mean(dim=1))


@functools.lru_cache(maxsize=None)
def _topics(name: str, vocab: int) -> torch.Tensor:
    """``[class, TOPIC_TOKENS]``: the tokens that give each class away (disjoint)."""
    return torch.randperm(vocab, generator=teacher(name))[:NUM_CLASSES * TOPIC_TOKENS].view(NUM_CLASSES, -1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BertModel(ZooModel):
    """Sentences whose class shows in some of their tokens; cross-entropy over the classes.
    The fields after ``momentum`` shape the encoder (defaults: the zoo's ``bert``)."""

    vocab: int = VOCAB
    seq_len: int = SEQ_LEN
    dim: int = 128
    heads: int = 4
    ffn: int = 512
    blocks: int = 2

    def build(self) -> nn.Module:
        return Bert(vocab=self.vocab, seq_len=self.seq_len, dim=self.dim, heads=self.heads, ffn=self.ffn,
                    blocks=self.blocks)

    def make_batch(self, generator: torch.Generator,
                   batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        size, seq = self._batch_size(batch_size), self.seq_len
        target = torch.randint(0, NUM_CLASSES, (size,), generator=generator)
        tokens = torch.randint(0, self.vocab, (size, seq), generator=generator)
        picks = torch.randint(0, TOPIC_TOKENS, (size, seq), generator=generator)
        topical = torch.rand(size, seq, generator=generator) < TOPIC_FRACTION
        tokens = torch.where(topical, _topics(self.name, self.vocab)[target.unsqueeze(1), picks], tokens)
        return tokens, target
