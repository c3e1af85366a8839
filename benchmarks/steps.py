"""The timed training step every benchmark measures (zero_grad, forward, MSE loss, backward, step),
and several runs of it interleaved."""
from __future__ import annotations

import time
from typing import Any, Mapping, Sequence


def timed_steps(optimizer: Any, model: Any, batches: Sequence[tuple[Any, Any]], count: int | None = None) -> list[float]:
    """Seconds of each of ``count`` steps (default: one per batch), cycling through ``batches``."""
    import torch
    times = []
    for step in range(len(batches) if count is None else count):
        inputs, target = batches[step % len(batches)]
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), target).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def interleaved_times(runs: Mapping[str, tuple[Any, Any, Sequence[tuple[Any, Any]]]], blocks: int,
                      steps_per_block: int) -> dict[str, list[float]]:
    """Per run (``(optimizer, model, batches)`` by name), the seconds of its timed steps: a warm-up
    block, then ``blocks`` blocks of ``steps_per_block`` steps each, the runs in an order rotated at
    every block (each goes first in turn), so that all of them see the same machine."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for block in range(blocks + 1):  # block 0: warm-up
        for name in names[block % len(names):] + names[:block % len(names)]:
            taken = timed_steps(*runs[name], steps_per_block)
            if block:
                times[name] += taken
    return times
