"""A held-out model: a word-level LSTM language model, as a user's Horovod-style training script.

    sudo hybridsync-run --autotune --cluster horovodrun_configs/cluster_2x2_1gbit.yaml -np 4 \\
        --trial-budget 30 python examples/heldout/lstm_lm.py --steps 600
    horovodrun -np 2 -H localhost:2 --gloo python examples/heldout/lstm_lm.py --optimizer horovod

Built outside the zoo and the model generator (no family of it has a recurrent layer), as a
user wrote it on 2026-11-27 to try the autotune on a model it has never seen. What it asks of
the drop-in, beyond the other held-out models:

- tied weights: the decoder *is* the embedding table (one parameter, two uses), so the
  table's gradient is dense and summed over both uses before it is synchronized;
- gradient clipping between synchronization and update (``synchronize()``, then
  ``clip_grad_norm_``, then ``step()`` under ``skip_synchronize()``), as Horovod documents it;
- Adam, whose state the update reads, so a wrong gradient would not stay hidden.

Data are synthetic: each next token follows from the last by a fixed rule, which the model learns.
"""
from __future__ import annotations

import torch
import torch.nn as nn

import harness

VOCAB, DIM, LAYERS, SEQUENCE = 10_000, 200, 2, 20


class LSTMLanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.lstm = nn.LSTM(DIM, DIM, LAYERS, batch_first=True, dropout=0.1)
        self.decoder = nn.Linear(DIM, VOCAB)
        self.decoder.weight = self.embedding.weight  # weight tying: one parameter, two uses

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits for ``tokens`` (batch, sequence)."""
        hidden, _ = self.lstm(self.embedding(tokens))
        return self.decoder(hidden)


def token_source(rank: int, size: int):
    """The rank's batches: random first tokens, each next one ``(7 * previous + 3) mod VOCAB``."""
    generator = torch.Generator().manual_seed(3000 + rank)

    def batch(batch_size: int) -> tuple[torch.Tensor]:
        tokens = torch.empty(batch_size, SEQUENCE + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (batch_size,), generator=generator)
        for position in range(1, SEQUENCE + 1):
            tokens[:, position] = (tokens[:, position - 1] * 7 + 3) % VOCAB
        return (tokens,)
    return batch


def train_step(model: LSTMLanguageModel, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor]) -> float:
    (tokens,) = batch
    optimizer.zero_grad()
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.synchronize()  # the averaged gradients, before clipping them
    nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    with optimizer.skip_synchronize():
        optimizer.step()
    return loss.item()


def main() -> None:
    args = harness.parse_args(__doc__.split("\n")[0], batch_size=16, lr=0.004)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = LSTMLanguageModel()
    harness.train("lstm_lm", args, model, torch.optim.Adam(model.parameters(), lr=args.lr), token_source,
                  train_step)


if __name__ == "__main__":
    main()
