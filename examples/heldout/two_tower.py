"""A held-out model: a two-tower retrieval model, as a user's Horovod-style training script.

    sudo hybridsync-run --autotune --cluster horovodrun_configs/cluster_2x2_1gbit.yaml -np 4 \\
        python examples/heldout/two_tower.py --steps 300
    hybridsync-run --num-servers 1 -np 2 -H localhost:2 --gloo --strategy s.json python examples/heldout/two_tower.py
    horovodrun -np 2 -H localhost:2 --gloo python examples/heldout/two_tower.py --optimizer horovod

Built outside the zoo and the model generator (and kept out of the runtime dataset and the
simulator's training data: ``tests/test_heldout.py`` checks), so an autotune of it shows how
hybridsync does on a model it has never seen. No generator family produces its shape:

- a user tower: user id, age, region and device tables, plus the user's recent items looked
  up in the item table and pooled by attention (the user's embedding is the query);
- an item tower over the same item table plus category and brand tables;
- in-batch softmax: each user's clicked item against the other items of the batch.

All tables have sparse gradients (the item table gets rows from both towers); the towers'
dense layers are small, so most bytes are in rows a step barely touches. Data are synthetic:
users of an age group mostly click items of one category, popular ones more often.
"""
from __future__ import annotations

import torch
import torch.nn as nn

import harness

NUM_USERS, NUM_ITEMS, NUM_CATEGORIES, NUM_BRANDS = 150_000, 80_000, 500, 10_000
AGES, REGIONS, DEVICES = 100, 1_000, 50
DIM, OUT_DIM, HISTORY = 32, 64, 20
LOYALTY = 0.8
"""Share of clicks in the user's age group's favourite category."""
TEMPERATURE = 0.1
POPULARITY = 4.0
"""Ids are ``floor(n * u**POPULARITY)``: a few users and items are in most batches, as in real logs."""


def sparse_table(rows: int, dim: int) -> nn.Embedding:
    table = nn.Embedding(rows, dim, sparse=True)
    nn.init.normal_(table.weight, std=0.1)
    return table


class AttentionPooling(nn.Module):
    """One query (the user) attends over the history's item embeddings."""

    def __init__(self, dim: int):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, query: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        scores = (self.key(history) @ self.query(query).unsqueeze(2)).squeeze(2) / DIM ** 0.5
        return (torch.softmax(scores, dim=1).unsqueeze(2) * self.value(history)).sum(1)


def tower(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, OUT_DIM))


class TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = sparse_table(NUM_USERS, DIM)
        self.age, self.region, self.device = sparse_table(AGES, 8), sparse_table(REGIONS, 8), sparse_table(DEVICES, 8)
        self.item = sparse_table(NUM_ITEMS, DIM)
        self.category, self.brand = sparse_table(NUM_CATEGORIES, DIM), sparse_table(NUM_BRANDS, 16)
        self.pool = AttentionPooling(DIM)
        self.user_tower = tower(2 * DIM + 3 * 8)
        self.item_tower = tower(2 * DIM + 16)

    def forward(self, users: torch.Tensor, history: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """In-batch logits: row i scores user i against every item of the batch."""
        user = self.user(users[:, 0])
        pooled = self.pool(user, self.item(history))
        u = self.user_tower(torch.cat([user, pooled, self.age(users[:, 1]), self.region(users[:, 2]),
                                       self.device(users[:, 3])], dim=1))
        i = self.item_tower(torch.cat([self.item(items[:, 0]), self.category(items[:, 1]), self.brand(items[:, 2])],
                                      dim=1))
        return nn.functional.normalize(u, dim=1) @ nn.functional.normalize(i, dim=1).T / TEMPERATURE


class Clicks:
    """Synthetic clicks: a user mostly clicks items of their age group's favourite category
    (a hidden, fixed map), the popular ones more often."""

    def __init__(self, seed: int) -> None:
        hidden = torch.Generator().manual_seed(4242)
        self.user_features = torch.stack([torch.randint(0, n, (NUM_USERS,), generator=hidden)
                                          for n in (AGES, REGIONS, DEVICES)], dim=1)
        self.favourite = torch.randint(0, NUM_CATEGORIES, (AGES,), generator=hidden)
        self.brand = torch.randint(0, NUM_BRANDS, (NUM_ITEMS,), generator=hidden)
        self.generator = torch.Generator().manual_seed(seed)

    def ids(self, n: int, *shape: int) -> torch.Tensor:
        return (n * torch.rand(*shape, generator=self.generator) ** POPULARITY).long().clamp_(max=n - 1)

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        users = self.ids(NUM_USERS, size)
        features = self.user_features[users]
        random = torch.randint(0, NUM_CATEGORIES, (size,), generator=self.generator)
        loyal = torch.rand(size, generator=self.generator) < LOYALTY
        category = torch.where(loyal, self.favourite[features[:, 0]], random)
        clicked = category + NUM_CATEGORIES * self.ids(NUM_ITEMS // NUM_CATEGORIES, size)  # item i is in category i % C
        history = self.ids(NUM_ITEMS, size, HISTORY)
        return (torch.cat([users.unsqueeze(1), features], dim=1), history,
                torch.stack([clicked, category, self.brand[clicked]], dim=1))


def train_step(model: TwoTower, optimizer: torch.optim.Optimizer,
               batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> float:
    optimizer.zero_grad()
    logits = model(*batch)
    loss = nn.functional.cross_entropy(logits, torch.arange(len(logits)))
    loss.backward()
    optimizer.step()
    return loss.item()


def main() -> None:
    args = harness.parse_args(__doc__.split("\n")[0], batch_size=256, lr=0.05)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TwoTower()
    harness.train("two_tower", args, model, torch.optim.Adagrad(model.parameters(), lr=args.lr),
                  lambda rank, size: Clicks(seed=1000 + rank).batch, train_step)


if __name__ == "__main__":
    main()
