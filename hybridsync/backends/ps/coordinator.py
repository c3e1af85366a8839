"""The servers' side of Sync-Switch: elastic decisions (on server 0) and the switch log (every server).

Workers under an ``elastic`` policy report each step to server 0 (``report``), which feeds
an ``ElasticPolicy`` per job with the arrival times and answers every report with the
job's schedule of switches so far. A switch is scheduled after a step no worker has
reported yet, so every worker learns it in time and switches after the same step.

Every worker tells every server when it switched (``switched``); a server logs a switch
once all workers agree on its step, and logs a disagreement loudly (it would be a bug).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Mapping

from hybridsync.sync_policy import ElasticPolicy, SyncPolicy

log = logging.getLogger("hybridsync.ps.coordinator")

Schedule = list[tuple[int, str, str]]
"""``(step, protocol, reason)`` of each switch: after ``step`` the PS variables run ``protocol``."""


class SwitchCoordinator:
    """Per job (one optimizer's controller): its elastic policy, schedule and switch log."""

    def __init__(self, num_workers: int, name: str) -> None:
        self.num_workers = num_workers
        self.name = name
        self._policies: dict[str, ElasticPolicy] = {}
        self._schedules: dict[str, Schedule] = {}
        self._switches: dict[tuple[str, int], dict[int, tuple[int, str, str]]] = {}
        self._resumed: dict[str, int] = {}
        self.events: list[dict[str, Any]] = []
        """Switches every worker made, in order: job, index, step, protocol, reason, per-worker steps."""
        self._lock = threading.Lock()

    def report(self, job: str, policy: Mapping[str, Any], worker: int, step: int) -> Schedule:
        """``worker`` finished computing ``step``: feed the job's policy; returns its schedule."""
        now = time.monotonic()
        with self._lock:
            elastic = self._policy(job, policy)
            decision = elastic.observe(worker, step, now)
            if decision is not None:
                self._schedules[job].append((decision.step, decision.protocol, decision.reason))
                log.info("%s: job %s goes %s after step %d: %s", self.name, job, decision.protocol,
                         decision.step, decision.reason)
            return list(self._schedules[job])

    def _policy(self, job: str, policy: Mapping[str, Any]) -> ElasticPolicy:
        elastic = self._policies.get(job)
        if elastic is None:
            elastic = self._policies[job] = ElasticPolicy(SyncPolicy.from_dict(policy), self.num_workers)
            self._schedules.setdefault(job, [])
        return elastic

    def restore(self, job: str, policy: Mapping[str, Any], schedule: Schedule, step: int) -> None:
        """A replacement of server 0: a worker's last answer for ``job`` (its schedule, after its
        report of ``step``). The longest schedule wins; the policy's trace restarts after the latest
        step reported, on the protocol the schedule left the workers on."""
        with self._lock:
            elastic = self._policy(job, policy)
            if len(schedule) > len(self._schedules[job]):
                self._schedules[job] = [tuple(entry) for entry in schedule]  # type: ignore[misc]
            known = self._schedules[job]
            after = max(step, known[-1][0] if known else 0)
            if after > self._resumed.get(job, -1):
                self._resumed[job] = after
                elastic.resume(known[-1][1] if known else "bsp", after)  # type: ignore[arg-type]

    def switched(self, job: str, worker: int, index: int, step: int, protocol: str, reason: str) -> None:
        """``worker`` made its ``index``-th switch of ``job`` after ``step``; logged once all agree."""
        with self._lock:
            seen = self._switches.setdefault((job, index), {})
            seen[worker] = (step, protocol, reason)
            if len(seen) < self.num_workers:
                return
            del self._switches[job, index]
            steps = {w: s for w, (s, _, _) in sorted(seen.items())}
            event = {"job": job, "index": index, "step": seen[0][0], "protocol": seen[0][1], "reason": seen[0][2],
                     "worker_steps": steps}
            self.events.append(event)
        if len(set(seen.values())) > 1:
            log.error("%s: workers DISAGREE on switch %d of job %s: %s", self.name, index, job, dict(seen))
        else:
            print(f"hybridsync PS {self.name}: all {self.num_workers} workers switched job {job} to {event['protocol']} "
                  f"after step {event['step']} ({event['reason']})", flush=True)
