"""Elastic Horovod (issue 23): how long a job takes to start, to grow, and to go on after losing a
worker, under Horovod's own optimizer and hybridsync's, on one host or the emulated cluster.

    .venv/bin/python benchmarks/elastic.py [--repeats N] [--where local|emulated]

Each run is ``horovodrun --min-np 1 --max-np M --network-interface IFACE --host-discovery-script S``
of ``examples/elastic_train.py`` (``--horovod`` for Horovod's optimizer; hybridsync's runs the
example's strategy, whose hierarchical variable runs where the world has 2 nodes of 2 ranks and
falls back to ring all-reduce elsewhere, and whose PS variable falls back), committing after
every step; it is stopped once measured. ``S`` prints a file this script rewrites. Times come
from rank 0's ``events.jsonl`` (the wall-clock time of every committed step):

- start: horovodrun launched -> first committed step;
- grow: the discovery script's answer changed (at step 5) -> first step committed by the
  larger world. ``local``: ``localhost:1`` -> ``localhost:2``; ``emulated``: 2 hosts x 1 ->
  2 hosts x 2 (on the emulated 2 x 2 cluster at 1 Gbit/s, through its ssh stand-in). With
  ``--gloo-timeout-seconds 120``: the running workers wait that long for the new one to start;
- lose: a worker SIGKILLed (at step 5) -> first step committed by the ranks left. ``local``:
  the one on ``127.0.0.1`` of ``localhost:2`` + ``127.0.0.1:1``; ``emulated``: one of host 1's
  two, of 2 x 2 (Horovod then drops host 1: 1 host x 2 are left). With Horovod's default
  30 s Gloo timeout, which bounds a survivor's wait in a receive from the dead rank.

Prints one markdown row per run; the machine's load (``uptime``) first, since these times are
mostly process start-up (a joining worker's imports) and move with it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, TextIO

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "elastic_train.py"
sys.path.insert(0, str(REPO))

from hybridsync.run import procs  # noqa: E402  (the repository, not an installed copy)

TIMEOUT_S = 400.0
GLOO_TIMEOUT = {"grow": ("--gloo-timeout-seconds", "120"), "lose": ()}


@contextlib.contextmanager
def local_job(argv: list[str], discovery: Path, log: TextIO, scenario: str) -> Iterator[tuple[Callable, dict]]:
    """horovodrun here; hosts ``localhost`` and ``127.0.0.1``."""
    hosts = {"grow": (["localhost:1"], ["localhost:2"], 1, 2), "lose": (["localhost:2", "127.0.0.1:1"], None, 3, 3),
             "victim": "127.0.0.1"}
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")

    def start(np: int, max_np: int) -> subprocess.Popen:
        return subprocess.Popen([horovodrun, "-np", str(np), "--min-np", "1", "--max-np", str(max_np),
                                 *GLOO_TIMEOUT[scenario],
                                 "--network-interface", "lo", "--host-discovery-script", str(discovery), *argv],
                                env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=str(REPO), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    yield start, hosts


@contextlib.contextmanager
def emulated_job(argv: list[str], discovery: Path, log: TextIO, scenario: str) -> Iterator[tuple[Callable, dict]]:
    """horovodrun on host 0 of the emulated 2 x 2 cluster (1 Gbit/s), through its ssh stand-in."""
    from hybridsync.cluster.netns import EmulatedCluster
    from hybridsync.cluster.spec import ClusterSpec
    from hybridsync.run.emulated import launch_horovodrun_elastic
    with EmulatedCluster(ClusterSpec(nodes=2, workers_per_node=2, inter_node_bandwidth="1gbit")) as cluster:
        ip0, ip1 = cluster.ips
        hosts = {"grow": ([f"{ip0}:1", f"{ip1}:1"], [f"{ip0}:2", f"{ip1}:2"], 2, 4),
                 "lose": ([f"{ip0}:2", f"{ip1}:2"], None, 4, 4), "victim": ip1}

        def start(np: int, max_np: int) -> subprocess.Popen:
            job = launch_horovodrun_elastic(cluster, argv, discovery_script=str(discovery), num_proc=np,
                                            max_proc=max_np, horovodrun_args=GLOO_TIMEOUT[scenario],
                                            env={"PYTHONPATH": str(REPO)}, stdout=log, stderr=subprocess.STDOUT)
            return job.processes[0]
        yield start, hosts


def run_once(where: str, frontend: str, scenario: str) -> dict[str, float]:
    """One elastic job; the times of its start and of its world change."""
    with tempfile.TemporaryDirectory() as tmp:
        out, hosts_file, discovery = Path(tmp, "out"), Path(tmp, "hosts"), Path(tmp, "discover.sh")
        out.mkdir()
        discovery.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
        discovery.chmod(0o755)
        argv = [sys.executable, str(EXAMPLE), "--steps", "100000", "--pause", "0.1", "--out", str(out),
                *(["--horovod"] if frontend == "horovod" else [])]
        log = open(Path(tmp, "job.log"), "w", encoding="utf-8")
        with log, (local_job if where == "local" else emulated_job)(argv, discovery, log, scenario) as (start, hosts):
            first_hosts, grown_hosts, np, max_np = hosts[scenario]
            hosts_file.write_text("\n".join(first_hosts) + "\n")
            launched = time.time()
            job = start(np, max_np)
            try:
                _wait(out, job, lambda events: any(e.get("step", 0) >= 5 for e in events), log.name)
                old_size = next(e["size"] for e in _events(out) if "step" in e)
                changed = time.time()
                if grown_hosts is not None:
                    hosts_file.write_text("\n".join(grown_hosts) + "\n")
                else:
                    victim = next(out.glob(f"pid.{hosts['victim']}.*"))
                    os.kill(int(victim.name.split(".")[-1]), signal.SIGKILL)
                events = _wait(out, job, lambda events: any("step" in e and e["time"] > changed
                                                            and e["size"] != old_size for e in events), log.name)
            finally:
                procs.stop(job, grace=3.0)
                for pid_file in out.glob("pid.*"):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid_file.name.split(".")[-1]), signal.SIGKILL)
    first = min(e["time"] for e in events if "step" in e)
    after = min((e for e in events if "step" in e and e["time"] > changed and e["size"] != old_size),
                key=lambda e: e["time"])
    return {"start_s": first - launched, "change_s": after["time"] - changed, "sizes": f"{old_size} -> {after['size']}"}


def _events(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(out: Path, job: subprocess.Popen, done: Callable[[list[dict]], bool], log: str) -> list[dict]:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        events = _events(out)
        if done(events):
            return events
        if job.poll() is not None:
            raise RuntimeError(f"the job ended early (exit {job.returncode}):\n{Path(log).read_text()[-3000:]}")
        time.sleep(0.05)
    raise TimeoutError("the elastic job did not get there in time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--where", choices=("local", "emulated"), default="local")
    args = parser.parse_args()
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print("| where | optimizer | scenario | ranks | start (s) | world change -> first step (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for _ in range(args.repeats):
        for scenario in ("grow", "lose"):
            for frontend in ("horovod", "hybridsync"):
                r = run_once(args.where, frontend, scenario)
                print(f"| {args.where} | {frontend} | {scenario} | {r['sizes']} | {r['start_s']:.1f} | "
                      f"{r['change_s']:.1f} |", flush=True)
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
