"""Choosing the switch point offline, as Sync-Switch's offline policy does.

Sync-Switch trains a recurring job a few times and binary-searches the fraction of
training done in BSP: the smallest fraction whose converged accuracy still matches BSP's
is the fastest one that keeps BSP's accuracy. ``search_switch_fraction`` does that over
candidate fractions with any ``measure(fraction) -> (final accuracy, time to target)``;
``tune_on_digits`` measures with short runs of the digits task on an emulated cluster
(``hybridsync syncswitch tune``), and the result is written into a strategy file.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable, Sequence

from hybridsync.strategy import Strategy
from hybridsync.sync_policy import SyncPolicy

Measure = Callable[[float], tuple[float, float | None]]
"""A fraction of training in BSP (1.0: all of it) -> (final accuracy, seconds to the target or None)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TuneResult:
    """The fraction chosen and every measurement that led to it."""

    fraction: float
    reference_accuracy: float
    """BSP's final accuracy (fraction 1.0)."""
    measured: dict[float, tuple[float, float | None]]
    """Fraction -> (final accuracy, seconds to the target) of every run."""


def search_switch_fraction(fractions: Sequence[float], measure: Measure, *, tolerance: float = 0.005) -> TuneResult:
    """The smallest of ``fractions`` whose accuracy is within ``tolerance`` of BSP's, by binary search.

    Assumes accuracy does not drop as the BSP fraction grows (Sync-Switch's premise). If no
    candidate qualifies, the largest one is returned (the closest to BSP).
    """
    candidates = sorted(set(fractions))
    if not candidates or any(not 0.0 < f < 1.0 for f in candidates):
        raise ValueError(f"fractions must be in (0, 1), got {list(fractions)}")
    measured = {1.0: measure(1.0)}
    reference = measured[1.0][0]
    low, high = 0, len(candidates) - 1
    best = high
    while low <= high:
        middle = (low + high) // 2
        fraction = candidates[middle]
        measured[fraction] = measure(fraction)
        if measured[fraction][0] >= reference - tolerance:
            best, high = middle, middle - 1
        else:
            low = middle + 1
    return TuneResult(fraction=candidates[best], reference_accuracy=reference, measured=measured)


def switch_strategy(base: Strategy, fraction: float, total_steps: int, **policy: Any) -> Strategy:
    """``base`` with a ``switch`` policy: BSP for ``fraction`` of ``total_steps``, then ASP."""
    sync = SyncPolicy(policy="switch", switch_at=fraction, total_steps=total_steps, **policy)
    return Strategy(default=base.default, variables=dict(base.variables), sync=sync)


def tune_on_digits(fractions: Sequence[float], *, steps: int, seeds: Sequence[int], tolerance: float,
                   workdir: str, progress: Any = None) -> TuneResult:
    """``search_switch_fraction`` measured by runs of the digits task (mean over ``seeds``) on an
    emulated cluster (needs root). ``progress``: a tqdm bar, advanced once per run."""
    from hybridsync.cluster.netns import EmulatedCluster
    from hybridsync.syncswitch import evaluate

    with EmulatedCluster(evaluate.cluster_spec()) as cluster:
        def measure(fraction: float) -> tuple[float, float | None]:
            policy = "bsp" if fraction >= 1.0 else "switch"
            runs = [evaluate.RunSpec(policy=policy, seed=seed, steps=steps, switch_at=fraction) for seed in seeds]
            results = evaluate.run_job(cluster, runs, workdir)
            if progress is not None:
                progress.update(len(runs))
            times = [r.time_to_target_s for r in results]
            return (statistics.mean(r.final_accuracy for r in results),
                    None if None in times else statistics.mean(times))  # type: ignore[arg-type]
        return search_switch_fraction(fractions, measure, tolerance=tolerance)
