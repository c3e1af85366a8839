"""A held-out model: a wide & deep click-through model, as a user's Horovod-style training script.

    sudo hybridsync-run --autotune --cluster horovodrun_configs/cluster_2x2_1gbit.yaml -np 4 \\
        python examples/heldout/wide_deep.py --steps 1000
    hybridsync-run --num-servers 1 -np 2 -H localhost:2 --gloo --strategy s.json python examples/heldout/wide_deep.py
    horovodrun -np 2 -H localhost:2 --gloo python examples/heldout/wide_deep.py --optimizer horovod

Built outside the zoo and the model generator and kept out of the runtime dataset
(``tests/test_heldout.py`` checks), the shape of the model issue 21 describes: one large sparse
embedding table and a few wide dense layers, tens of MB in all, where the bytes are split
between rows a step barely touches and dense layers every step sends whole.

- deep part: eight categorical fields looked up in **one** shared table (each field owns a
  range of its rows), concatenated with thirteen numeric features, through three wide layers;
- wide part: a one-column sparse table over hashed pairs of fields (feature crosses);
- the logit is their sum. Data are synthetic: a hidden logistic model over a few fields,
  one cross and two numeric features decides each click; ids follow a power law.
"""
from __future__ import annotations

import torch
import torch.nn as nn

import harness

FIELDS, ROWS_PER_FIELD, DIM = 8, 40_000, 32
NUMERIC = 13
CROSS_BUCKETS = 200_000
HIDDEN = (1024, 1024, 512)
POPULARITY = 3.0
"""Ids are ``floor(n * u**POPULARITY)``: a few ids are in most batches, as in real logs."""


class WideDeep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(FIELDS * ROWS_PER_FIELD, DIM, sparse=True)
        nn.init.normal_(self.embedding.weight, std=0.05)
        self.wide = nn.Embedding(CROSS_BUCKETS, 1, sparse=True)
        nn.init.zeros_(self.wide.weight)
        layers: list[nn.Module] = []
        width = FIELDS * DIM + NUMERIC
        for hidden in HIDDEN:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.dense = nn.Sequential(*layers, nn.Linear(width, 1))
        self.register_buffer("offsets", torch.arange(FIELDS) * ROWS_PER_FIELD)

    def forward(self, ids: torch.Tensor, crosses: torch.Tensor, numeric: torch.Tensor) -> torch.Tensor:
        """Click logits for a batch: ``ids`` (batch, FIELDS) per-field ids, ``crosses`` (batch, k) hashed pairs."""
        embedded = self.embedding(ids + self.offsets).flatten(1)
        deep = self.dense(torch.cat([embedded, numeric], dim=1)).squeeze(1)
        return deep + self.wide(crosses).sum(dim=(1, 2))


def cross_ids(ids: torch.Tensor) -> torch.Tensor:
    """Hashed crosses of neighbouring fields (0x1, 1x2, ...), one bucket each."""
    pairs = ids[:, :-1] * 1_000_003 + ids[:, 1:] * 7_919 + torch.arange(FIELDS - 1)
    return pairs % CROSS_BUCKETS


class Impressions:
    """Synthetic impressions: a hidden logistic model over fields 0-2, the cross of fields 0 and 1,
    and numeric features 0-1 decides the click."""

    def __init__(self, seed: int) -> None:
        hidden = torch.Generator().manual_seed(2024)
        self.field_weight = torch.randn(3, ROWS_PER_FIELD, generator=hidden)
        self.cross_weight = torch.randn(CROSS_BUCKETS, generator=hidden)
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        u = torch.rand(size, FIELDS, generator=self.generator)
        ids = (ROWS_PER_FIELD * u ** POPULARITY).long().clamp_(max=ROWS_PER_FIELD - 1)
        numeric = torch.randn(size, NUMERIC, generator=self.generator)
        crosses = cross_ids(ids)
        logit = (self.field_weight.gather(1, ids[:, :3].T).sum(0) + 1.5 * self.cross_weight[crosses[:, 0]]
                 + numeric[:, 0] - 0.5 * numeric[:, 1])
        clicks = (torch.rand(size, generator=self.generator) < torch.sigmoid(logit)).float()
        return ids, crosses, numeric, clicks


def train_step(model: WideDeep, optimizer: torch.optim.Optimizer,
               batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> float:
    ids, crosses, numeric, clicks = batch
    optimizer.zero_grad()
    loss = nn.functional.binary_cross_entropy_with_logits(model(ids, crosses, numeric), clicks)
    loss.backward()
    optimizer.step()
    return loss.item()


def main() -> None:
    args = harness.parse_args(__doc__.split("\n")[0], batch_size=256, lr=0.01)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = WideDeep()
    harness.train("wide_deep", args, model, torch.optim.Adagrad(model.parameters(), lr=args.lr),
                  lambda rank, size: Impressions(seed=2000 + rank).batch, train_step)


if __name__ == "__main__":
    main()
