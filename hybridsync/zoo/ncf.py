"""NCF-like recommender: large sparse embeddings (only touched rows travel) + a small MLP."""
from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from hybridsync.variables import sparse_parameter_names
from hybridsync.zoo.base import ZooModel, popular_ids, teacher

NUM_USERS = 100_000
NUM_ITEMS = 20_000
TEACHER_DIM = 8
POPULARITY = 10.0
"""Ids are drawn as ``floor(n * u**POPULARITY)`` (``base.popular_ids``)."""

EMBEDDING_LR_SCALE = 300.0
"""The embeddings' learning rate over the MLP's (see ``NCFModel.optimizer``)."""


class NCF(nn.Module):
    """Neural collaborative filtering: a GMF tower and an MLP tower, each with its own embeddings."""

    def __init__(self, num_users: int = NUM_USERS, num_items: int = NUM_ITEMS, dim: int = 16,
                 hidden: tuple[int, ...] = (256, 128, 64)):
        super().__init__()
        self.gmf_user = nn.Embedding(num_users, dim, sparse=True)
        self.gmf_item = nn.Embedding(num_items, dim, sparse=True)
        self.mlp_user = nn.Embedding(num_users, dim, sparse=True)
        self.mlp_item = nn.Embedding(num_items, dim, sparse=True)
        layers, width = [], 2 * dim
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        self.mlp = nn.Sequential(*layers)
        self.predict = nn.Linear(dim + width, 1)
        for emb in (self.gmf_user, self.gmf_item, self.mlp_user, self.mlp_item):
            nn.init.normal_(emb.weight, std=0.1)

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        """Logit of "user ``pairs[:, 0]`` likes item ``pairs[:, 1]``"."""
        users, items = pairs[:, 0], pairs[:, 1]
        gmf = self.gmf_user(users) * self.gmf_item(items)
        mlp = self.mlp(torch.cat([self.mlp_user(users), self.mlp_item(items)], dim=1))
        return self.predict(torch.cat([gmf, mlp], dim=1)).squeeze(1)


@functools.lru_cache(maxsize=1)
def _teacher_factors() -> tuple[torch.Tensor, torch.Tensor]:
    gen = teacher("ncf")
    # column 0 of the item factors is an item bias (users' is 1): most of the signal is in
    # popular items, so the loss falls within tens of steps; the rest needs both embeddings
    users = torch.randn(NUM_USERS, TEACHER_DIM, generator=gen)
    items = torch.randn(NUM_ITEMS, TEACHER_DIM, generator=gen)
    users[:, 0], items[:, 0] = 1.0, 2.0 * items[:, 0]
    return users, items


@dataclasses.dataclass(frozen=True, kw_only=True)
class NCFModel(ZooModel):
    """(user, item) pairs labelled by a fixed latent-factor teacher; binary cross-entropy."""

    def build(self) -> nn.Module:
        return NCF()

    def make_batch(self, generator: torch.Generator,
                   batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        size = self._batch_size(batch_size)
        users = popular_ids(NUM_USERS, size, generator, POPULARITY)
        items = popular_ids(NUM_ITEMS, size, generator, POPULARITY)
        user_factors, item_factors = _teacher_factors()
        target = ((user_factors[users] * item_factors[items]).sum(1) > 0).float()
        return torch.stack([users, items], dim=1), target

    def optimizer(self, model: nn.Module, learning_rate: float | None = None) -> torch.optim.Optimizer:
        """SGD whose embeddings learn ``EMBEDDING_LR_SCALE`` times faster: a row's gradient is one
        sample's share of the batch mean, so at the MLP's rate the embeddings would hardly move."""
        lr = self.learning_rate if learning_rate is None else learning_rate
        sparse = sparse_parameter_names(model)
        groups = [{"params": [p for n, p in model.named_parameters() if n in sparse], "lr": lr * EMBEDDING_LR_SCALE},
                  {"params": [p for n, p in model.named_parameters() if n not in sparse]}]
        return torch.optim.SGD(groups, lr=lr, momentum=self.momentum)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(output, target)
