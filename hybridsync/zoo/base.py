"""What every zoo model is: a builder, a deterministic synthetic data source and a loss.

A zoo model is small enough that, on the emulated cluster (2 cores for 4 ranks), the
gradient synchronization and not the compute dominates a step; its data come from a fixed
random "teacher" so that the loss visibly falls within a few dozen steps, with no download.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
import zlib
from typing import Any

import torch

from hybridsync.variables import variables_from_model

TEACHER_SEED = 20201
"""Seed of every teacher (prototypes, latent factors): the same task on every rank and run."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZooModel:
    """A benchmark model: subclasses define ``build``, ``make_batch`` and ``loss``."""

    name: str
    """Short name, as ``--model`` takes it."""
    summary: str
    """One line: what the model resembles and why its synchronization differs from the others'."""
    batch_size: int
    """Default per-rank batch size (what the compute-time targets were measured with)."""
    learning_rate: float
    """SGD learning rate at which the loss falls within ~50 steps."""
    momentum: float = 0.0
    """SGD momentum (0 where gradients are sparse: a momentum buffer would densify them)."""

    def build(self) -> torch.nn.Module:
        """A fresh model; deterministic given ``torch.manual_seed``."""
        raise NotImplementedError

    def make_batch(self, generator: torch.Generator, batch_size: int | None = None) -> tuple[Any, torch.Tensor]:
        """``(inputs, target)`` drawn from ``generator`` only: the same generator state gives the same batch."""
        raise NotImplementedError

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Classification loss; subclasses with other targets override it."""
        return torch.nn.functional.cross_entropy(output, target)

    def optimizer(self, model: torch.nn.Module, learning_rate: float | None = None) -> torch.optim.Optimizer:
        """The plain SGD this model trains with (wrap it in a ``DistributedOptimizer`` for a job)."""
        lr = self.learning_rate if learning_rate is None else learning_rate
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=self.momentum)

    def _batch_size(self, batch_size: int | None) -> int:
        size = self.batch_size if batch_size is None else batch_size
        if size < 1:
            raise ValueError(f"{self.name}: batch_size must be >= 1, got {size}")
        return size


def teacher(name: str) -> torch.Generator:
    """A fresh generator in ``name``'s teacher state: draw that model's fixed task tensors from it."""
    return torch.Generator().manual_seed(TEACHER_SEED + zlib.crc32(name.encode()))


def popular_ids(n: int, size: int, generator: torch.Generator, popularity: float) -> torch.Tensor:
    """``size`` ids in ``[0, n)`` drawn as ``floor(n * u**popularity)``: a few popular ids occur in
    most batches (as in real logs), so their embeddings learn within tens of steps, and a step's
    sparse gradient touches far fewer rows than the batch has samples."""
    return (n * torch.rand(size, generator=generator) ** popularity).long().clamp_(max=n - 1)


def model_stats(model: torch.nn.Module, top: int = 3) -> dict[str, Any]:
    """Parameter count, bytes (all, and in dense-gradient variables), tensor counts, and the share
    of the bytes held by the ``top`` largest tensors: what decides how a model synchronizes."""
    variables = variables_from_model(model)
    sizes = sorted((v.nbytes for v in variables.values()), reverse=True)
    total = sum(sizes)
    return {"parameters": sum(v.numel for v in variables.values()),
            "bytes": total,
            "dense_bytes": sum(v.nbytes for v in variables.values() if not v.sparse),
            "tensors": len(variables),
            "sparse_tensors": sum(v.sparse for v in variables.values()),
            "largest_tensors": [name for name, _ in sorted(variables.items(), key=lambda kv: -kv[1].nbytes)[:top]],
            "largest_share": sum(sizes[:top]) / total if total else 0.0}


def forward(model: torch.nn.Module, inputs: Any) -> torch.Tensor:
    """``model(inputs)``; a tuple of inputs is passed as positional arguments."""
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


def train_step(zoo_model: ZooModel, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               batch: tuple[Any, torch.Tensor]) -> float:
    """One step: zero_grad, forward, loss, backward, step; returns the loss before the update."""
    inputs, target = batch
    optimizer.zero_grad()
    loss = zoo_model.loss(forward(model, inputs), target)
    loss.backward()
    optimizer.step()
    return loss.item()


def compute_ms(zoo_model: ZooModel, steps: int = 20, warmup: int = 5, batch_size: int | None = None) -> float:
    """Median milliseconds of forward + backward at the default batch size, in this process
    (its torch thread count as it is): the compute a step pays besides synchronization."""
    model = zoo_model.build()
    generator = torch.Generator().manual_seed(0)
    times = []
    for step in range(warmup + steps):
        inputs, target = zoo_model.make_batch(generator, batch_size)
        started = time.perf_counter()
        model.zero_grad()
        zoo_model.loss(forward(model, inputs), target).backward()
        if step >= warmup:
            times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)
