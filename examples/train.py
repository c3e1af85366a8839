"""A Horovod-style training script with one changed import: ``import hybridsync as hs``.

    hybridsync-run --strategy examples/strategies/demo.json -np 2 -H localhost:2 --gloo python examples/train.py
    horovodrun -np 2 -H localhost:2 --gloo python examples/train.py --strategy S.json   # S without route "ps"

Trains a small classifier (embedding bag of tokens -> MLP) on synthetic data whose labels
come from a hidden linear rule, so accuracy shows whether synchronized training works.
``--sparse`` gives the embedding sparse gradients (only the rows a batch touched travel) and
trains with Adagrad, which takes them, instead of Adam.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn

import hybridsync as hs

VOCAB, DIM, CLASSES = 400, 32, 4


class Classifier(nn.Module):
    def __init__(self, *, sparse: bool = False) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, DIM, mode="mean", sparse=sparse)
        self.fc1 = nn.Linear(DIM, 256)
        self.fc2 = nn.Linear(256, 256)
        self.head = nn.Linear(256, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(self.emb(tokens))))))


def batches(rank: int, steps: int, batch: int = 64):
    """Each rank draws its own shard of the synthetic task (labels from a fixed hidden rule)."""
    rule = torch.randn(VOCAB, CLASSES, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (batch, 12), generator=gen)
        yield tokens, rule[tokens].sum(dim=1).argmax(dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategy", default=None, help="strategy file (default: $HYBRIDSYNC_STRATEGY or none)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sparse", action="store_true", help="sparse embedding gradients (and Adagrad)")
    args = parser.parse_args()

    hs.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Classifier(sparse=args.sparse)
    if args.sparse:  # Adagrad builds sparse tensors; say that it skips their checks (default), or torch warns
        torch.sparse.check_sparse_tensor_invariants.disable()
    opt = (torch.optim.Adagrad(model.parameters(), lr=5e-2) if args.sparse
           else torch.optim.Adam(model.parameters(), lr=1e-2))
    opt = hs.DistributedOptimizer(opt, named_parameters=model.named_parameters(), strategy=args.strategy)
    hs.broadcast_parameters(model.state_dict(), root_rank=0)
    hs.broadcast_optimizer_state(opt, root_rank=0)
    if hs.rank() == 0:
        print(f"{hs.size()} ranks; {len(opt.plan.var_names)} variables sent as {len(opt.plan.messages)} messages "
              f"per step:")
        for message in opt.plan.messages:
            pieces = ", ".join(f"{p.var_name}[{p.start}:{p.stop}]" if not p.whole else p.var_name
                               for p in message.pieces)
            config = message.config
            variant = config.algorithm if config.route == "allreduce" else config.protocol
            print(f"  {message.name:<28} {config.route + '/' + variant:<23} "
                  f"{message.config.compression or '-':<5} <- {pieces}")

    window = min(30, args.steps)  # the steps the accuracy is measured over: the last 30, or all of a short run
    start, correct, seen = time.perf_counter(), 0, 0
    for step, (tokens, labels) in enumerate(batches(hs.rank(), args.steps)):
        opt.zero_grad()
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits, labels)
        loss.backward()
        opt.step()
        if step >= args.steps - window:
            correct += int((logits.argmax(dim=1) == labels).sum())
            seen += len(labels)
        if hs.rank() == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}")
    elapsed = time.perf_counter() - start
    accuracy = hs.allreduce(torch.tensor(correct / seen), name="demo.accuracy").item()
    if hs.rank() == 0:
        print(f"{args.steps} steps in {elapsed:.1f} s ({elapsed / args.steps * 1e3:.1f} ms/step); "
              f"training accuracy over the last {window} steps: {accuracy:.1%}")


if __name__ == "__main__":
    main()
