"""Tabular models for the model generator: plain MLPs, recommenders with several sparse
embedding tables, and wide & deep (a huge sparse linear part beside a deep tower).

Their shapes are fields, so ``hybridsync.zoo.generator`` can sample them; data are
synthetic and labelled by a fixed random teacher drawn from the model's name, as in the zoo.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from hybridsync.zoo.base import ZooModel, popular_ids, teacher

NOISE = 1.0
"""``mlp`` samples are a class prototype plus Gaussian noise of this standard deviation."""
CROSS_PRIME = 1_000_003
"""Crossed-feature ids are ``(a * CROSS_PRIME + b) mod wide_rows``: hashed crosses, as wide & deep's."""


def mlp(width: int, hidden: tuple[int, ...], out: int) -> nn.Sequential:
    """Linear + ReLU layers of the ``hidden`` widths, then a linear layer to ``out``."""
    layers: list[nn.Module] = []
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    return nn.Sequential(*layers, nn.Linear(width, out))


class MLP(nn.Module):
    """Fully connected layers with layer norm: few, mid-size to large, dense tensors."""

    def __init__(self, in_features: int, hidden: tuple[int, ...], num_classes: int):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for size in hidden:
            layers += [nn.Linear(width, size), nn.LayerNorm(size), nn.ReLU()]
            width = size
        self.layers = nn.Sequential(*layers, nn.Linear(width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLPModel(ZooModel):
    """Noisy copies of one fixed random prototype per class; cross-entropy."""

    in_features: int
    hidden: tuple[int, ...]
    num_classes: int

    def build(self) -> nn.Module:
        return MLP(self.in_features, self.hidden, self.num_classes)

    def make_batch(self, generator: torch.Generator,
                   batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        size = self._batch_size(batch_size)
        target = torch.randint(0, self.num_classes, (size,), generator=generator)
        noise = torch.randn(size, self.in_features, generator=generator)
        return _prototypes(self.name, self.num_classes, self.in_features)[target] + NOISE * noise, target


class Recommender(nn.Module):
    """One sparse embedding table per categorical field plus a projection of the dense
    features, concatenated into an MLP that predicts a click logit."""

    def __init__(self, tables: tuple[int, ...], dim: int, dense_features: int, hidden: tuple[int, ...]):
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(rows, dim, sparse=True) for rows in tables)
        self.dense = nn.Linear(dense_features, dim)
        self.top = mlp(dim * (len(tables) + 1), hidden, 1)
        for table in self.tables:
            nn.init.normal_(table.weight, std=0.1)

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        fields = [table(ids[:, i]) for i, table in enumerate(self.tables)]
        return self.top(torch.cat([*fields, self.dense(dense)], dim=1)).squeeze(1)


class WideDeep(nn.Module):
    """Wide & deep: a sparse linear model over hashed crosses of the fields (one huge table of
    width 1) beside a deep tower of per-field sparse embeddings and dense features."""

    def __init__(self, wide_rows: int, tables: tuple[int, ...], dim: int, dense_features: int,
                 hidden: tuple[int, ...]):
        super().__init__()
        self.wide = nn.EmbeddingBag(wide_rows, 1, mode="sum", sparse=True)
        self.tables = nn.ModuleList(nn.Embedding(rows, dim, sparse=True) for rows in tables)
        self.deep = mlp(dim * len(tables) + dense_features, hidden, 1)
        nn.init.zeros_(self.wide.weight)
        for table in self.tables:
            nn.init.normal_(table.weight, std=0.1)

    def forward(self, ids: torch.Tensor, crosses: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        fields = [table(ids[:, i]) for i, table in enumerate(self.tables)]
        deep = self.deep(torch.cat([*fields, dense], dim=1))
        return (self.wide(crosses) + deep).squeeze(1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecommenderModel(ZooModel):
    """Clicks labelled by a fixed teacher: a random bias per id of every field, plus a linear
    rule on the dense features; binary cross-entropy. ``wide_rows`` > 0 makes it wide & deep
    (the teacher then also weighs each hashed cross)."""

    tables: tuple[int, ...]
    """Rows of each field's embedding table."""
    dim: int
    dense_features: int
    hidden: tuple[int, ...]
    popularity: float
    """Ids are drawn as ``floor(rows * u**popularity)`` (``base.popular_ids``): higher, fewer rows per step."""
    wide_rows: int = 0

    def build(self) -> nn.Module:
        if self.wide_rows:
            return WideDeep(self.wide_rows, self.tables, self.dim, self.dense_features, self.hidden)
        return Recommender(self.tables, self.dim, self.dense_features, self.hidden)

    def make_batch(self, generator: torch.Generator,
                   batch_size: int | None = None) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        size = self._batch_size(batch_size)
        ids = torch.stack([popular_ids(rows, size, generator, self.popularity) for rows in self.tables], dim=1)
        dense = torch.randn(size, self.dense_features, generator=generator)
        biases, weights, wide = _click_teacher(self.name, self.tables, self.dense_features, self.wide_rows)
        logit = sum(bias[ids[:, i]] for i, bias in enumerate(biases)) + dense @ weights
        if not self.wide_rows:
            return (ids, dense), (logit > 0).float()
        crosses = _crosses(ids, self.wide_rows)
        logit = logit + wide[crosses].sum(1)
        return (ids, crosses, dense), (logit > 0).float()

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(output, target)

    def optimizer(self, model: nn.Module, learning_rate: float | None = None) -> torch.optim.Optimizer:
        """Adagrad, as recommenders are often trained (wide & deep's deep part was): it takes sparse
        gradients, and its per-row step sizes let rarely seen ids learn as fast as the dense layers.
        Its sparse steps build sparse tensors without checks, as torch does by default; saying so
        explicitly keeps torch from warning about it once per rank."""
        torch.sparse.check_sparse_tensor_invariants.disable()
        return torch.optim.Adagrad(model.parameters(), lr=self.learning_rate if learning_rate is None else learning_rate)


def _crosses(ids: torch.Tensor, wide_rows: int) -> torch.Tensor:
    """``[batch, fields - 1]`` hashed crosses of each field with the next one."""
    return (ids[:, :-1] * CROSS_PRIME + ids[:, 1:]) % wide_rows


@functools.lru_cache(maxsize=None)
def _prototypes(name: str, num_classes: int, in_features: int) -> torch.Tensor:
    return torch.randn(num_classes, in_features, generator=teacher(name))


@functools.lru_cache(maxsize=4)
def _click_teacher(name: str, tables: tuple[int, ...], dense_features: int,
                   wide_rows: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Per-field id biases, dense-feature weights and (wide & deep) a weight per hashed cross."""
    gen = teacher(name)
    # the dense features weigh most (a logit of standard deviation 2, the ids' biases 1 in all), so
    # the loss falls within tens of steps even where the ids are spread over large tables
    biases = [torch.randn(rows, generator=gen) / len(tables) ** 0.5 for rows in tables]
    weights = 2 * torch.randn(dense_features, generator=gen) / dense_features ** 0.5
    return biases, weights, torch.randn(max(wide_rows, 1), generator=gen)
