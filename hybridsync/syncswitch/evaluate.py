"""Runs of the digits task on an emulated cluster, with stragglers, and their metrics.

The cluster (``CLUSTER``): 3 hosts; 4 ranks on hosts 0 and 1 (2 each), one parameter
server alone on host 2, every uplink shaped to ``LINK_RATE``. The straggler is host 1
(ranks 2 and 3; rank 0, which measures accuracy, is never slowed):

- ``net``: host 1's uplink drops to ``STRAGGLER_RATE`` (``LinkStraggler``);
- ``cpu``: host 1's ranks share ``STRAGGLER_CPU`` of one core (``CpuStraggler``).

Straggler schedules (seconds from the first step): ``none``; ``persistent`` (on from the
start); ``intermittent`` (on for ``ON_S`` seconds every ``PERIOD_S``, starting at ``FIRST_ON_S``).

Metrics per run (``RunResult``): wall-clock seconds from the first step to the first
test accuracy >= the target (rank 0's model, every 10 of its steps), throughput (images
per second of all ranks while all of them were training), final test accuracy (under
ASP the servers' model once every rank finished) and the switches made.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any, Literal

from hybridsync.syncswitch.digits import TaskConfig

PolicyName = Literal["bsp", "asp", "ssp", "switch", "elastic"]
StragglerName = Literal["none", "persistent", "intermittent"]
POLICY_NAMES: tuple[str, ...] = ("bsp", "asp", "ssp", "switch", "elastic")
STRAGGLER_NAMES: tuple[str, ...] = ("none", "persistent", "intermittent")
LINK_RATE = "20mbit"
STRAGGLER_RATE = "4mbit"
STRAGGLER_CPU = 0.1
FIRST_ON_S, ON_S, PERIOD_S = 2.0, 4.0, 8.0
SSP_STALENESS = 3
STRAGGLER_NODE, SERVER_NODE = 1, 2


def cluster_spec() -> Any:
    from hybridsync.cluster.spec import ClusterSpec
    return ClusterSpec(nodes=3, workers_per_node=2, inter_node_bandwidth=LINK_RATE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One run: a policy, a straggler schedule, a seed."""

    policy: PolicyName
    """Static ``bsp`` / ``asp`` / ``ssp``, or the ``switch`` / ``elastic`` policy."""
    straggler: StragglerName = "none"
    """When host 1 is slow: never, from the first step, or on and off."""
    kind: Literal["net", "cpu"] = "net"
    """How the straggler is slow: its uplink (``net``) or its CPU (``cpu``)."""
    seed: int = 0
    """Initial weights and batch order."""
    steps: int = 200
    """Steps per rank."""
    switch_at: float = 0.25
    """``switch``: fraction of ``steps`` run under BSP."""
    target: float = 0.95
    """Test accuracy whose first reaching is timed."""
    timeout_s: float = 240.0
    """Bound on the run (a job's bound is the sum over its runs)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
    """What one run measured."""

    spec: RunSpec
    time_to_target_s: float | None
    """``None``: rank 0 never measured the target accuracy."""
    throughput: float
    """Images per second, all ranks, while every rank was training."""
    final_accuracy: float
    """Test accuracy of the final model."""
    wall_s: float
    """First step of any rank to last step of any rank."""
    switches: list[dict[str, Any]]
    """Rank 0's switches (``step``, ``protocol``, ``reason``)."""
    straggler_log: list[tuple[float, str]]
    """When the straggler went on and off (seconds after the first step)."""


def strategy_for(policy: PolicyName, steps: int, switch_at: float) -> dict[str, Any]:
    """The strategy document of a policy: every variable on the parameter server."""
    if policy in ("bsp", "asp"):
        return {"version": 1, "default": {"route": "ps", "protocol": policy}}
    if policy == "ssp":
        return {"version": 1, "default": {"route": "ps", "protocol": "ssp", "staleness": SSP_STALENESS}}
    sync: dict[str, Any] = {"policy": policy}
    if policy == "switch":
        sync.update(switch_at=switch_at, total_steps=steps)
    return {"version": 1, "default": {"route": "ps", "protocol": "bsp"}, "sync": sync}


def straggler_windows(straggler: StragglerName, horizon_s: float = 600.0) -> list[tuple[float, float | None]]:
    """The on/off windows (seconds from the first step) of a schedule."""
    if straggler == "none":
        return []
    if straggler == "persistent":
        return [(0.0, None)]
    starts = [FIRST_ON_S + k * PERIOD_S for k in range(int(horizon_s / PERIOD_S))]
    return [(start, start + ON_S) for start in starts]


def run_job(cluster: Any, runs: list[RunSpec], workdir: str, *,
            strategies: list[dict[str, Any]] | None = None) -> list[RunResult]:
    """``runs`` one after another in one job on ``cluster`` (``cluster_spec()``'s shape), each
    with its straggler schedule; ``strategies`` overrides their strategy documents. Raises on failure."""
    from hybridsync import envvars
    from hybridsync.cluster.netns import kill_pids
    from hybridsync.run.emulated import launch_gloo
    from hybridsync.run.ps_servers import ps_environment, server_command, server_environment

    prefix = os.path.join(workdir, f"job{time.monotonic_ns()}")
    names = [f"{run.policy}-{run.straggler}-{run.kind}-{run.seed}-{i}" for i, run in enumerate(runs)]
    configs = [TaskConfig(name=name, strategy=(strategies[i] if strategies else
                                               strategy_for(run.policy, run.steps, run.switch_at)),
                          steps=run.steps, seed=run.seed) for i, (name, run) in enumerate(zip(names, runs))]
    with open(f"{prefix}.config.json", "w") as handle:
        json.dump([dataclasses.asdict(c) for c in configs], handle)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, envvars.PS_TRANSPORT: "tcp", "PYTHONPATH": repo, "OMP_NUM_THREADS": "1",
           **ps_environment(num_workers=4, num_servers=1, root_uri=cluster.ips[SERVER_NODE], root_port=9000)}
    logs: list[list[tuple[float, str]]] = []
    with open(f"{prefix}.log", "w") as log:
        server = cluster.run(SERVER_NODE, server_command(), stdout=log, stderr=subprocess.STDOUT,
                             env={**env, "PYTHONUNBUFFERED": "1", **server_environment(0, host=cluster.ips[SERVER_NODE])})
        job = launch_gloo(cluster, [sys.executable, "-m", "hybridsync.syncswitch.digits", f"{prefix}.config.json",
                                    prefix], env=env, num_proc=4, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + sum(run.timeout_s for run in runs)
        try:
            for name, run in zip(names, runs):
                schedule = _straggler_schedule(cluster, run, job)
                _wait_for_file(f"{prefix}.{name}.started", job, deadline)
                if schedule is not None:
                    schedule.start()
                try:
                    _wait_for_file(f"{prefix}.{name}.done", job, deadline)
                finally:
                    if schedule is not None:
                        schedule.stop()
                logs.append(schedule.log if schedule is not None else [])
            codes = job.wait(timeout=max(deadline - time.monotonic(), 30.0))
        finally:
            job.kill()
            job.stop_helpers()
            if server.poll() is None:
                try:
                    server.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    kill_pids([server.pid], grace_s=2.0, groups=True)
    if any(codes):
        with open(f"{prefix}.log", errors="replace") as handle:
            raise RuntimeError(f"job {prefix} failed (exit codes {codes}):\n{handle.read()[-4000:]}")
    results = []
    for name, run, log_entries in zip(names, runs, logs):
        ranks = [json.load(open(f"{prefix}.{name}.rank{r}.json")) for r in range(4)]
        results.append(_metrics(run, ranks, log_entries))
    return results


def _straggler_schedule(cluster: Any, run: RunSpec, job: Any) -> Any:
    from hybridsync.cluster.spec import parse_bandwidth
    from hybridsync.cluster.stragglers import CpuStraggler, LinkStraggler, StragglerSchedule
    windows = straggler_windows(run.straggler)
    if not windows:
        return None
    if run.kind == "net":
        straggler: Any = LinkStraggler(cluster, STRAGGLER_NODE, rate_bits_per_second=parse_bandwidth(STRAGGLER_RATE))
    else:
        ranks = {proc.pid for proc in job.processes}
        straggler = CpuStraggler(cluster, STRAGGLER_NODE, cpu_fraction=STRAGGLER_CPU, select=ranks.__contains__)
    return StragglerSchedule(straggler, windows)


def _wait_for_file(path: str, job: Any, deadline: float) -> None:
    """Wait for a rank to write ``path``; raise once a rank failed or the deadline passed."""
    while not os.path.exists(path):
        failed = any(proc.poll() not in (None, 0) for proc in job.processes)
        if failed or time.monotonic() > deadline:
            raise RuntimeError(f"no {os.path.basename(path)}: {'a rank failed' if failed else 'timed out'}")
        time.sleep(0.05)


def _metrics(run: RunSpec, ranks: list[dict[str, Any]], straggler_log: list[tuple[float, str]]) -> RunResult:
    began = min(r["began"] for r in ranks)
    window = (max(r["began"] for r in ranks), min(r["times"][-1] for r in ranks))
    images = sum(r["batch"] for r in ranks for t in r["times"] if window[0] < t <= window[1])
    reached = [t for t, accuracy in ranks[0]["curve"] if accuracy >= run.target]
    return RunResult(spec=run, time_to_target_s=reached[0] - ranks[0]["began"] if reached else None,
                     throughput=images / max(window[1] - window[0], 1e-9),
                     final_accuracy=ranks[0]["final_accuracy"],
                     wall_s=max(r["times"][-1] for r in ranks) - began,
                     switches=ranks[0].get("switches", []), straggler_log=straggler_log)
