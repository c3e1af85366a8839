"""The timed training step every benchmark measures: zero_grad, forward, MSE loss, backward, step."""
from __future__ import annotations

import time
from typing import Any, Sequence


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
