"""Why one command's step time moves between jobs on the emulated cluster (issue 21 section 1).

    sudo .venv/bin/python benchmarks/job_variation.py [--model ncf] [--jobs 4]
        [--cluster horovodrun_configs/cluster_2x2_1gbit.yaml] [--configs unpinned hosts rank cycle5]

Two emulated clusters of the spec live for the whole run: one as the trial runner now builds
it (``pin_hosts``: each host's processes on that host's share of the cores) and one left to
the kernel; the first job on each is the first after it was built. Round by round, each
configuration runs one job of the zoo worker (``hybridsync.trials``) measuring two strategies
alternately, A B A B A B (3 warm-up + 10 timed steps each): A is
``baseline:horovod-hierarchical``, B plain Horovod. The configurations, interleaved so that
the machine's load drifts over all of them alike:

- ``unpinned``: the kernel places every process (how trial jobs ran before issue 21);
- ``hosts``: every process of emulated host i (ranks, PS server) on host i's cores
  (``EmulatedCluster(pin_hosts=True)``, the trial runner's default now);
- ``rank``: on the unpinned cluster, rank r pinned to core r mod cores and server s to core
  s mod cores, from outside, right after the processes start (threads made later inherit it);
- ``cycle5``: ``unpinned`` with ``HOROVOD_CYCLE_TIME=5`` (Horovod's background thread wakes
  every 5 ms instead of every 1 ms; every wake-up of every rank is a small Gloo collective).

Per job it records A's and B's step time (median of their timed steps), the ratio A / B, how
much slower the first pass was than the later ones (geometric mean over A and B), the wall
time from launch to the first trial, the load average and each process kind's CPU use (CPU
seconds / wall seconds). Per configuration it prints the spread over jobs (max / min) of A,
of B and of A / B: the ratio's spread is what within-job controls leave of the job-to-job
variation. ``--out`` keeps the stores, logs and ``jobs.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hybridsync.trials.candidates import Candidate, baseline_candidates  # noqa: E402
from hybridsync.trials.jobs import EmulatedTarget  # noqa: E402
from hybridsync.trials.runner import EnvWorkload, TrialProtocol, TrialRunner, ZooWorkload  # noqa: E402
from hybridsync.trials.store import HOROVOD_KIND, TrialStore  # noqa: E402

CONFIGS = ("unpinned", "hosts", "rank", "cycle5")
PASSES = 3
PROTOCOL = TrialProtocol(warmup_steps=3, timed_steps=10)
PIN_AFTER_S = (0.0, 1.0, 5.0, 20.0)
"""When (after launch) the job's threads are pinned again: threads made by a pinned thread inherit
its affinity, but a thread made before the first pass would keep the default."""


class ObservedTarget:
    """An entered ``EmulatedTarget`` whose jobs are pinned from outside (``pin``: None or "rank") and
    whose processes' CPU use is sampled when the job stops."""

    def __init__(self, target: EmulatedTarget, pin: str | None) -> None:
        self.target, self.pin, self.spec = target, pin, target.spec
        self.observations: list[dict[str, Any]] = []

    def start(self, command, env, log, *, servers=True):
        job = self.target.start(command, env, log, servers=servers)
        roles = self._roles(job)
        started = time.monotonic()
        if self.pin:
            threading.Thread(target=self._pin_repeatedly, args=(roles,), daemon=True).start()
        outer = self

        class Observed:
            def exit_codes(self):
                return job.exit_codes()

            def stop(self):
                outer.observations.append(cpu_use(roles, time.monotonic() - started))
                job.stop()
        return Observed()

    def _roles(self, job: Any) -> list[tuple[str, int, int, int]]:
        """(role, node, index, pid) per process of ``job``: workers in rank order, then servers host-major."""
        spec, pids = self.spec, job.pids()
        out = [("worker", rank // spec.workers_per_node, rank, pid) for rank, pid in enumerate(pids["workers"])]
        out += [("server", s // spec.servers_per_node, s, pid) for s, pid in enumerate(pids["servers"])]
        return out

    def _pin_repeatedly(self, roles: list[tuple[str, int, int, int]]) -> None:
        cores = sorted(os.sched_getaffinity(0))
        start = time.monotonic()
        for at in PIN_AFTER_S:
            time.sleep(max(0.0, start + at - time.monotonic()))
            for role, node, index, pid in roles:
                pin_process(pid, cores[index % len(cores)])


def pin_process(pid: int, core: int) -> None:
    """Every thread of ``pid`` onto ``core`` (threads it makes later inherit it)."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), {core})
            except (ProcessLookupError, PermissionError):
                pass
    except FileNotFoundError:
        pass


def cpu_use(roles: list[tuple[str, int, int, int]], wall_s: float) -> dict[str, Any]:
    """CPU seconds per wall second of the job's workers and servers (``psutil``), and the cores they
    last ran on."""
    import psutil
    use: dict[str, float] = {"worker": 0.0, "server": 0.0}
    cores: dict[str, list[int]] = {"worker": [], "server": []}
    for role, _, _, pid in roles:
        try:
            process = psutil.Process(pid)
            times = process.cpu_times()
            use[role] += times.user + times.system
            cores[role].append(process.cpu_num())
        except psutil.Error:
            pass
    return {"wall_s": wall_s, "cpu_per_s": {role: seconds / wall_s for role, seconds in use.items()},
            "last_cores": cores, "load": os.getloadavg()[0]}


def run_job(target: EmulatedTarget, model: str, config: str, schedule: list[Candidate], out: str,
            number: int) -> dict[str, Any]:
    """Job ``number``, of ``config``, in a store of its own; returns its row (times in seconds)."""
    pin = "rank" if config == "rank" else None
    env = (("HOROVOD_CYCLE_TIME", "5"),) if config == "cycle5" else ()
    observed = ObservedTarget(target, pin)
    load = os.getloadavg()[0]
    with TrialStore(os.path.join(out, f"job{number:02d}-{config}.db")) as store:
        runner = TrialRunner(model=model, description_id=f"{model}-0", target=observed, store=store,
                             protocol=PROTOCOL, workdir=out, workload=EnvWorkload(ZooWorkload(model), env))
        launched = time.time()
        runner.run(schedule)
        records = store.trials(status="ok")
    by_kind: dict[str, list[float]] = {}
    passes: dict[str, list[float]] = {}
    for record in records:  # in the order measured
        by_kind.setdefault(record.kind, []).extend(record.timed_steps)
        passes.setdefault(record.kind, []).append(record.median_s)
    a, b = (statistics.median(by_kind[c.kind]) for c in schedule[:2])
    first_pass = statistics.geometric_mean(times[0] / statistics.median(times[1:]) for times in passes.values())
    start_s = min(datetime.datetime.fromisoformat(r.started).timestamp() for r in records) - launched
    return {"config": config, "cluster": "pinned" if target.pin_hosts else "unpinned", "job": records[0].job,
            "number": number, "a_s": a, "b_s": b, "ratio": a / b,
            "first_pass": first_pass, "passes_ms": {k: [round(t * 1e3, 1) for t in v] for k, v in passes.items()},
            "load_before": load, "start_s": start_s, **(observed.observations[-1] if observed.observations else {})}


def spread(values: list[float]) -> float:
    return max(values) / min(values)


def summary(rows: list[dict[str, Any]], configs: list[str]) -> str:
    lines = ["config   jobs  A ms per job (cluster's 1st *)    A max/min  B max/min  A/B per job               "
             " A/B max/min  1st pass  start s  worker CPU/s  server CPU/s"]
    first: dict[str, int] = {}
    for row in rows:  # in the order run
        first.setdefault(row["cluster"], row["number"])
    first_jobs = {r["job"] for r in rows if r["number"] == first[r["cluster"]]}
    for config in configs:
        mine = [r for r in rows if r["config"] == config]
        if not mine:
            continue
        a = " ".join(f"{r['a_s'] * 1e3:.1f}{'*' if r['job'] in first_jobs else ''}" for r in mine)
        ratios = " ".join(f"{r['ratio']:.3f}" for r in mine)
        cpu = [r.get("cpu_per_s", {}) for r in mine]
        worker = statistics.median(c.get("worker", 0.0) for c in cpu)
        server = statistics.median(c.get("server", 0.0) for c in cpu)
        spreads = [spread([r[key] for r in mine]) for key in ("a_s", "b_s", "ratio")]
        lines.append(f"{config:<8} {len(mine):>4}  {a:<34} {spreads[0]:>9.3f}  {spreads[1]:>9.3f}  {ratios:<26} "
                     f"{spreads[2]:>11.3f}  {statistics.median(r['first_pass'] for r in mine):>8.2f}  "
                     f"{statistics.median(r['start_s'] for r in mine):>7.0f}  {worker:>12.2f}  {server:>12.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="ncf")
    parser.add_argument("--cluster", default=os.path.join(REPO, "horovodrun_configs", "cluster_2x2_1gbit.yaml"))
    parser.add_argument("--jobs", type=int, default=4, help="jobs per configuration")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="hybridsync-job-variation-"))
    args = parser.parse_args()
    from hybridsync.autotune.session import load_cluster
    from hybridsync.zoo import describe
    cluster = load_cluster(args.cluster)
    variables = describe(args.model)
    a = next(c for c in baseline_candidates(variables, cluster) if c.kind == "baseline:horovod-hierarchical")
    schedule = [a, Candidate(kind=HOROVOD_KIND, strategy=None)] * PASSES
    os.makedirs(args.out, exist_ok=True)
    print(f"{args.model} on {args.cluster}: {args.jobs} jobs x {args.configs}; load {os.getloadavg()}", flush=True)
    rows: list[dict[str, Any]] = []
    with EmulatedTarget(cluster, pin_hosts=True) as pinned, EmulatedTarget(cluster, pin_hosts=False) as unpinned:
        for round_index in range(args.jobs):
            order = args.configs[round_index % len(args.configs):] + args.configs[:round_index % len(args.configs)]
            for config in order:
                target = pinned if config == "hosts" else unpinned
                rows.append(run_job(target, args.model, config, schedule, args.out, len(rows)))
                print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "jobs.json"), "w", encoding="utf-8") as handle:
        json.dump(rows, handle, indent=1)
    print(summary(rows, args.configs))
    print(f"load {os.getloadavg()}; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
