"""Step-report traces for the elastic policy's unit tests: a small discrete-event model of
BSP and ASP workers, fed to the policy as the servers would feed it (no processes, no clocks).

``compute(worker, now)`` is a worker's compute time for a step starting at ``now``; BSP
rounds end ``sync_s`` after the last report, an ASP worker's next step starts ``sync_s``
after its own report. The simulation follows the policy's decisions, switching protocol
after ``Decision.step`` as the workers do.
"""
from __future__ import annotations

from typing import Callable

from hybridsync.sync_policy import Decision, ElasticPolicy


def run(policy: ElasticPolicy, compute: Callable[[int, float], float], steps: int,
        sync_s: float = 0.02) -> list[tuple[float, Decision]]:
    """Run every worker ``steps`` steps; returns (wall time, decision) of each switch."""
    n = policy.num_workers
    protocol, switch_after = "bsp", None
    pending: list[Decision] = []
    decisions: list[tuple[float, Decision]] = []
    clock = [0.0] * n  # when each worker starts its next step
    step = [1] * n
    while min(step) <= steps:
        if protocol == "bsp":
            start = max(clock)
            s = step[0]
            reports = sorted((start + compute(w, start), w) for w in range(n))
            for t, w in reports:
                _feed(policy, w, s, t, pending, decisions)
            clock = [reports[-1][0] + sync_s] * n
            step = [s + 1] * n
        else:
            w = min(range(n), key=lambda v: (clock[v] + compute(v, clock[v]), v))
            if step[w] > steps or (switch_after is not None and step[w] > switch_after):
                # this worker waits at the switch (or is done): let the others run
                w = min((v for v in range(n) if step[v] <= min(steps, switch_after or steps)),
                        key=lambda v: (clock[v] + compute(v, clock[v]), v), default=None)
                if w is None:
                    break
            t = clock[w] + compute(w, clock[w])
            _feed(policy, w, step[w], t, pending, decisions)
            clock[w] = t + sync_s
            step[w] += 1
        if pending and all(s > pending[0].step for s in step):
            # every worker finished the switch step: they meet and go on in the new protocol
            decision = pending.pop(0)
            protocol, switch_after = decision.protocol, (pending[0].step if pending else None)
            clock = [max(clock)] * n
            step = [decision.step + 1] * n
        elif pending and protocol == "asp":
            switch_after = pending[0].step
    return decisions


def _feed(policy: ElasticPolicy, worker: int, step: int, time: float, pending: list[Decision],
          decisions: list[tuple[float, Decision]]) -> None:
    decision = policy.observe(worker, step, time)
    if decision is not None:
        pending.append(decision)
        decisions.append((time, decision))
