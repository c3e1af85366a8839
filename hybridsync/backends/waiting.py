"""Waiting for a Horovod handle (or any completion) without holding a core for long.

Horovod 0.28.1's ``synchronize`` waits in a ``sched_yield`` loop, so every waiting rank
holds a core for as long as it waits: a rank stuck on a collective that never comes spun
at ~66% of a core for an hour (issue 23). Where ranks share cores (CPU jobs with more ranks
than cores, the emulated cluster) even short waits starve the ranks and the kernel doing
the actual transfer. Measured on 2 emulated hosts x 2 ranks, 2 vCPUs, 200 Mbit/s uplinks, a
64 MiB ring all-reduce: 4.6-5.1 s and 7-10 CPU-s of system time per rank over 4 ops with
Horovod's wait; 4.2 s (95% of the bandwidth bound) and 0.5-2.4 CPU-s with the sleeping wait.

Every wait here has three phases: it polls, yielding the core between polls (Horovod's own
way, so a short wait ends as soon as it can), for ``SPIN_S``; then it sleeps between polls,
backing off to ``MAX_SLEEP_S``; after ``LONG_WAIT_S`` it backs off further, to
``LONG_SLEEP_S`` (a wait that long ends at most 1% late, and a stuck rank costs ~100
wake-ups a second). A long wait is also watched (``hybridsync.backends.stalls``): ranks
that wait for each other at different points of the program fail with an error naming them.

``HYBRIDSYNC_WAIT`` picks the spin phase: ``spin`` (default: ``SPIN_S_SPINNING``, 1 s: a
step's waits are Horovod's own) or ``sleep`` (``SPIN_S_SLEEPING``; the emulated cluster's
launchers set it).

TensorFlow jobs (``hybridsync.tensorflow``) wait differently by default: Horovod's TensorFlow
ops complete through callbacks and hold no core while they wait, so the drop-in must not
spin either (``wait_like_callbacks``).
"""
from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable

from hybridsync import envvars
from hybridsync.backends import stalls

SPIN_S_SPINNING = 1.0
"""``spin``: poll and yield this long before sleeping, so every wait of a healthy step is
Horovod's own (a 20 ms spin phase made a step 1.15x slower than Horovod's wait on a loaded
2-core host: waits that outlast it pay a sleep's wake-up); a longer one is a stuck or a badly
straggling rank, and sleeps."""
SPIN_S_SLEEPING = 2e-3
"""``sleep``: a step's many small messages finish within microseconds of each other, and a
sleep's wake-up latency (~60 us) on each of them added ~3 ms to a 25 ms step of 50 messages
(benchmarks/overhead.py: 1.10-1.15 instead of ~1.0) when the wait slept at once."""
FIRST_SLEEP_S = 20e-6
MAX_SLEEP_S = 200e-6
"""Then sleep, backing off to this interval: at most ~0.2 ms late, ~5000 cheap wake-ups a second."""
LONG_WAIT_S = 1.0
LONG_SLEEP_S = 10e-3
"""Past ``LONG_WAIT_S``, sleep up to this long between polls: at most 1% late, ~100 wake-ups a second."""
CALLBACK_MAX_SLEEP_S = 1e-3
"""``wait_like_callbacks``' interval: a TensorFlow step's waits last tens of ms on a CPU cluster,
where each wake-up takes a core from a rank still computing."""


WAIT_VAR = envvars.WAIT


def _sleeping(default: str = "spin") -> bool:
    choice = os.environ.get(WAIT_VAR, default).strip().lower() or default
    if choice not in ("spin", "sleep"):
        raise ValueError(f"{WAIT_VAR} must be 'spin' or 'sleep', got {choice!r}")
    return choice == "sleep"


def wait_like_callbacks() -> None:
    """This process's waits from now on: as Horovod's TensorFlow ops wait (through callbacks, no
    core held): sleeping unless ``HYBRIDSYNC_WAIT=spin`` says otherwise, without the spin phase,
    polling at most every ``CALLBACK_MAX_SLEEP_S``.

    Measured with the Keras NCF (``hybridsync.zoo.keras_ncf``), 4 ranks sharing 2 cores: on one
    host, Horovod's spinning wait made a step 243 ms against 88-116 ms for Horovod's TensorFlow
    optimizer (the sleeping wait: 130 ms); on the emulated 2 x 2 cluster at 250 Mbit/s, the
    sleeping wait with its 2 ms spin phase per handle took 147-184 ms against Horovod's 139-149 ms,
    and without the spin phase, polling at most 1 ms apart, 147-152 ms with less CPU per step.
    """
    global _SLEEPING, SPIN_S, MAX_SLEEP_S
    _SLEEPING = _sleeping(default="sleep")
    SPIN_S = 0.0 if _SLEEPING else SPIN_S_SPINNING
    MAX_SLEEP_S = CALLBACK_MAX_SLEEP_S


def wait(hvd: Any, handle: Any) -> Any:
    """``hvd.synchronize(handle)``, waiting as the module docstring says."""
    if not hvd.poll(handle):  # most handles of a step are done by the time they are waited for
        wait_until(functools.partial(hvd.poll, handle))
    try:
        return hvd.synchronize(handle)
    except Exception as e:
        verdict = stalls.verdict()  # another rank found the ranks out of step, raised, and left
        if verdict:
            raise stalls.RanksOutOfStepError(verdict) from e
        raise


def wait_until(done: Callable[[], bool], *, spin: bool = True) -> None:
    """Return once ``done()`` is true: spin for ``SPIN_S`` (unless ``spin`` is false: for work
    that progresses on threads of its own, which a spinning rank would slow), then sleep,
    backing off; a long wait is watched for ranks out of step (``stalls.RanksOutOfStepError``)."""
    start = time.perf_counter()
    spin_until = start + (SPIN_S if spin else 0.0)
    # Every step's last messages are waited for here, where Horovod's own wait is a C++ loop of
    # poll and yield: the loop keeps to local names and plain calls to stay close to it.
    clock, yield_core = time.perf_counter, os.sched_yield
    while not done():
        if clock() < spin_until:
            yield_core()  # as Horovod does: a thread on this core that has work runs first
            continue
        _sleep_until(done, start)
        return


def _sleep_until(done: Callable[[], bool], start: float) -> None:
    delay = FIRST_SLEEP_S
    long_from = start + LONG_WAIT_S
    with stalls.Watched(start) as watch:
        while not done():
            time.sleep(delay)
            if time.perf_counter() < long_from:
                delay = min(2 * delay, MAX_SLEEP_S)
                continue
            delay = min(2 * delay, LONG_SLEEP_S)
            watch.tick()


_SLEEPING = _sleeping()  # read once
SPIN_S = SPIN_S_SLEEPING if _SLEEPING else SPIN_S_SPINNING
"""This process's spin phase (``HYBRIDSYNC_WAIT``, or ``wait_like_callbacks``)."""


def barrier(hvd: Any, name: str = "hybridsync.barrier") -> None:
    """``hvd.barrier()`` that sleeps while it waits (a one-element all-reduce, waited with ``wait``)."""
    import torch
    wait(hvd, hvd.allreduce_async_(torch.zeros(1), name=name, op=hvd.Sum))


def use_for_horovod(hvd: Any) -> None:
    """Make Horovod's own ``DistributedOptimizer`` (and its sparse all-gather) wait through ``wait``.

    For measuring plain Horovod beside hybridsync under the same ``HYBRIDSYNC_WAIT``: with
    ``sleep`` on shared cores, Horovod's spinning wait would otherwise slow its own job, so a
    comparison would show the wait, not the routes. No-op with ``spin`` (Horovod's default).
    """
    if not _SLEEPING:
        return
    import horovod.torch.mpi_ops as mpi_ops
    import horovod.torch.optimizer as horovod_optimizer
    # Both modules wait through their module-level name ``synchronize``.
    horovod_optimizer.synchronize = mpi_ops.synchronize = lambda handle: wait(hvd, handle)
