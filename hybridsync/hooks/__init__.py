"""Step hooks: everything that rides along a training step inside ``DistributedOptimizer``.

``base.py`` is the interface (``StepHook``, and ``end_run`` for the front ends). The hooks:
``profiler.py`` (``HYBRIDSYNC_PROFILE``: the model description's timing), ``trials.py``
(``HYBRIDSYNC_TRIALS``: a schedule of strategies measured in flight) and ``syncswitch.py``
(a strategy's dynamic ``sync`` policy: BSP <-> ASP). ``StepHookBuilder`` below is the one
place they are made; this process's builder is ``BUILDER``.
"""
from __future__ import annotations

import warnings
from typing import Any, Sequence

from hybridsync import envvars
from hybridsync.hooks import profiler, syncswitch, trials
from hybridsync.hooks.base import StepHook, end_run
from hybridsync.strategy import Strategy

__all__ = ["BUILDER", "StepHook", "StepHookBuilder", "end_run"]


class StepHookBuilder:
    """Makes the step hooks of a process's optimizers: those the environment switches on, at most
    one of each per process and for the first optimizer that asks, and a strategy's controller."""

    def __init__(self) -> None:
        self._profiler: profiler.Profiler | None = None
        self._trials: trials.ScriptTrials | None = None

    def profiler_from_environment(self, named_parameters: Sequence[tuple[str, Any]], num_ranks: int,
                                  torch_hooks: bool = True) -> profiler.Profiler | None:
        """A started profiler if ``HYBRIDSYNC_PROFILE`` is set and no other runs (one closed makes
        room), else ``None``: the running one then profiles this optimizer's variables too (the newest
        optimizer times the steps: ``profile_hook``). ``torch_hooks=False``: the front end reports each
        backward pass."""
        if self._profiler is not None and not self._profiler.closed:
            clashing = self._profiler.add_variables(named_parameters)
            if clashing:
                warnings.warn(f"{envvars.PROFILE}: this DistributedOptimizer's variables {', '.join(clashing)} are "
                              f"not profiled: another optimizer's have the same names (pass named_parameters)")
            return None
        made = profiler.from_environment(named_parameters, num_ranks, torch_hooks=torch_hooks)
        self._profiler = made or self._profiler
        return made

    def profile_hook(self) -> StepHook | None:
        """The newest optimizer's hook into the running profile (it times the steps from now on), or ``None``."""
        return None if self._profiler is None or self._profiler.closed else self._profiler.hook()

    def trials_from_environment(self, optimizer: Any, hvd: Any) -> StepHook | None:
        """If ``HYBRIDSYNC_TRIALS`` is set, ``optimizer``'s hook in the trial schedule (one schedule per
        process, started by the first optimizer; the newest one times it: ``ScriptTrials``), else ``None``."""
        if self._trials is None:
            self._trials = trials.from_environment(optimizer, hvd)
        return None if self._trials is None else self._trials.hook_for(optimizer)

    @staticmethod
    def sync_controller(optimizer: Any, strategy: Strategy | None, job: str) -> syncswitch.SyncController | None:
        """The controller of ``strategy``'s dynamic ``sync`` policy, or ``None`` (static or no policy)."""
        if strategy is None or strategy.sync is None or not strategy.sync.dynamic:
            return None
        return syncswitch.SyncController(optimizer, strategy, job=job)


BUILDER = StepHookBuilder()
"""This process's builder: its state is which optimizer got the profiler and the trials."""
