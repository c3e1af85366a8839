"""Faults that cross nodes, on the emulated 2 x 2 cluster (root): what a user sees, and when.

    sudo .venv/bin/python benchmarks/netfault.py                       # every route x every fault
    sudo .venv/bin/python benchmarks/netfault.py --routes hierarchical --faults down

Brings up 2 hosts (network namespaces, 1 Gbit/s uplinks) with 2 Horovod Gloo ranks each (one
PS server per host for the ``ps`` route) and trains a small MLP, one job per route x fault:

- routes: ``horovod`` (plain ``hvd.DistributedOptimizer``: the reference), ``ring``
  (hybridsync without a strategy), ``hierarchical`` and ``ps`` (every variable on that route);
- faults, once rank 0 has done ``--fault-at`` steps: ``down`` (host 1's switch port set down and
  left down: the link between the nodes is cut), ``flap`` (the same for ``--flap-s`` seconds,
  then up again), ``node`` (every process of host 1, its ranks and its server, SIGKILLed),
  ``stop`` (every process of host 1 SIGSTOPped: hung processes whose host still answers; SIGCONT
  once the job is over).

The job runs the way ``hybridsync cluster run`` runs it (``launch_gloo``: the first rank to fail
stops the others, as horovodrun does). Per job: each rank's first error (type, first line,
seconds after the fault, on the ranks' own clock: one machine), when the job ended, and what was
left: processes in the hosts, ``/dev/shm`` segments of the job. A job still running
``--give-up`` seconds after the fault is reported as a hang and killed.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from provenance import print_header, uptime  # noqa: E402

ROUTES = ("horovod", "ring", "hierarchical", "ps")
FAULTS = ("down", "flap", "node", "stop")


# -- worker side (every rank, inside the emulated hosts) ----------------------------------------
def worker(out_dir: str, route: str, steps: int) -> None:
    """Train; every rank writes its last step (and the time) and, if it fails, its error."""
    import torch
    import horovod.torch as hvd

    import hybridsync as hs
    (hvd if route == "horovod" else hs).init()
    rank = hvd.rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    wrap = hvd.DistributedOptimizer if route == "horovod" else hs.DistributedOptimizer
    optimizer = wrap(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank))
    y = x[:, :1]
    try:
        for step in range(steps):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            _write(os.path.join(out_dir, f"rank{rank}.step"), {"step": step + 1, "at": time.time()})
            time.sleep(0.05)
    except BaseException as error:
        _write(os.path.join(out_dir, f"rank{rank}.error"), {"type": type(error).__name__, "at": time.time(),
                                                            "message": str(error)})
        raise


def _write(path: str, record: dict) -> None:
    with open(path + ".tmp", "w") as handle:
        json.dump(record, handle)
    os.replace(path + ".tmp", path)


def _read(path: str) -> dict | None:
    try:
        with open(path) as handle:
            return json.load(handle)
    except (FileNotFoundError, ValueError):
        return None


# -- controller (root, outside the namespaces) --------------------------------------------------
def strike(cluster, fault: str, up: bool = False) -> None:
    """Cut (or, ``up``, restore) host 1's link to the switch, kill every process of host 1, or stop
    (``up``: continue) every process of host 1."""
    from hybridsync.cluster.netns import kill_pids, namespace_pids
    if fault == "node":
        kill_pids(namespace_pids(cluster.namespaces[1]), grace_s=0.0)
    elif fault == "stop":
        for pid in namespace_pids(cluster.namespaces[1]):
            try:
                os.kill(pid, signal.SIGCONT if up else signal.SIGSTOP)
            except ProcessLookupError:
                pass
    else:
        cluster.set_uplink(1, up)


def run_job(cluster, route: str, fault: str, args: argparse.Namespace, logs: str) -> dict:
    """One job: train, strike at step ``args.fault_at`` of rank 0, watch until it ends (or give up)."""
    from hybridsync.cluster.netns import namespace_pids
    from hybridsync.run.emulated import launch_gloo, launch_servers, ps_env
    name = f"{route}-{fault}"
    out_dir = os.path.join(logs, name)
    os.makedirs(out_dir)
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if route in ("hierarchical", "ps"):
        strategy = os.path.join(out_dir, "strategy.json")
        default = {"route": "ps"} if route == "ps" else {"route": "allreduce", "algorithm": "hierarchical"}
        with open(strategy, "w") as handle:
            json.dump({"version": 1, "default": default}, handle)
        env["HYBRIDSYNC_STRATEGY"] = strategy
    if route == "ps":
        env.update(ps_env(cluster))
    shm_before = set(glob.glob("/dev/shm/hybridsync-*"))
    log = open(os.path.join(logs, f"{name}.log"), "a")
    servers = launch_servers(cluster, env=env, stdout=log, stderr=subprocess.STDOUT) if route == "ps" else None
    job = launch_gloo(cluster, [sys.executable, os.path.abspath(__file__), "--worker", out_dir, route,
                                str(args.steps)], env=env, stdout=log, stderr=subprocess.STDOUT)
    result: dict = {"name": name, "route": route, "fault": fault}
    try:
        deadline = time.monotonic() + args.timeout
        while (_read(os.path.join(out_dir, "rank0.step")) or {"step": 0})["step"] < args.fault_at:
            if time.monotonic() > deadline or any(p.poll() is not None for p in job.processes):
                raise RuntimeError(f"job {name} did not reach step {args.fault_at}; see {logs}/{name}.log")
            time.sleep(0.05)
        struck, struck_mono = time.time(), time.monotonic()
        strike(cluster, fault)
        restored = False
        at_strike = _read(os.path.join(out_dir, "rank0.step"))["step"]
        while any(p.poll() is None for p in job.processes):
            if fault == "flap" and not restored and time.monotonic() - struck_mono >= args.flap_s:
                strike(cluster, fault, up=True)
                restored = True
            step = (_read(os.path.join(out_dir, "rank0.step")) or {"step": 0})["step"]
            if restored and "resumed_s" not in result and step > at_strike:
                result["resumed_s"] = time.monotonic() - struck_mono  # the first step done since the strike
            if restored and step >= at_strike + 20:
                result["trained_on"] = step - at_strike
                break
            if any(p.poll() not in (None, 0) for p in job.processes) and fault != "node":
                break  # horovodrun's rule: the first failure stops the others
            if fault == "node" and any(p.poll() not in (None, 0, -9) for p in job.processes[:2]):
                break
            if time.monotonic() - struck_mono > args.give_up:
                result["hang"] = True
                break
            time.sleep(0.05)
        result["first_exit_s"] = time.monotonic() - struck_mono
        job.kill()
        result["ended_s"] = time.monotonic() - struck_mono
        if fault == "stop":
            strike(cluster, fault, up=True)  # host 1's server may now see its workers gone, and exit
        if fault == "flap" and not restored:
            strike(cluster, fault, up=True)
        result["codes"] = [p.returncode for p in job.processes]
        if servers is not None:
            try:
                result["server_codes"] = servers.wait(timeout=30)
            except TimeoutError:
                result["server_codes"] = "killed after 30 s"
            result["servers_ended_s"] = time.monotonic() - struck_mono
        result["errors"] = {r: _relative(_read(os.path.join(out_dir, f"rank{r}.error")), struck) for r in range(4)}
        result["last_steps"] = {r: (_read(os.path.join(out_dir, f"rank{r}.step")) or {}).get("step") for r in range(4)}
        job.stop_helpers()
        time.sleep(1.0)
        result["processes_left"] = [_cmdline(pid) for ns in cluster.namespaces for pid in namespace_pids(ns)]
        result["shm_left"] = sorted(set(glob.glob("/dev/shm/hybridsync-*")) - shm_before)
    finally:
        job.kill()
        if servers is not None:
            servers.kill()
        log.close()
        if fault == "stop":
            strike(cluster, fault, up=True)  # before the kill: a stopped process's SIGTERM waits for SIGCONT
        if fault != "node":
            strike(cluster, "down", up=True)
    return result


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return f"pid {pid} (gone)"


def _relative(record: dict | None, struck: float) -> dict | None:
    if record is None:
        return None
    return {"type": record["type"], "after_s": round(record["at"] - struck, 2),
            "message": record["message"].strip().splitlines()[0][:300] if record["message"].strip() else ""}


def table(results: list[dict]) -> str:
    lines = ["| route | fault | first error (rank: type after s) | job ends s | servers end s | left |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        errors = "; ".join(f"{rank}: {e['type']} {e['after_s']:.1f}" for rank, e in r["errors"].items() if e)
        ends = (f">{r['first_exit_s']:.0f} (hang, killed)" if r.get("hang") else
                f"trains on: next step after {r['resumed_s']:.1f}" if r.get("trained_on") else
                f"{r['first_exit_s']:.1f}")
        servers = f"{r['servers_ended_s']:.1f}" if "servers_ended_s" in r else "-"
        left = f"{len(r['processes_left'])} processes, {len(r['shm_left'])} shm files"
        lines.append(f"| {r['route']} | {r['fault']} | {errors or 'none'} | {ends} | {servers} | {left} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--routes", nargs="+", default=list(ROUTES), choices=ROUTES)
    parser.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    parser.add_argument("--steps", type=int, default=100000, help="steps per job (the fault ends it first)")
    parser.add_argument("--fault-at", type=int, default=20, help="strike once rank 0 has done N steps (default 20)")
    parser.add_argument("--flap-s", type=float, default=5.0, help="how long the link stays down in 'flap'")
    parser.add_argument("--give-up", type=float, default=120.0,
                        help="seconds after the fault before a hang is declared")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for a job to reach --fault-at")
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    from hybridsync.cluster import ClusterSpec, EmulatedCluster
    print_header()
    spec = ClusterSpec(nodes=2, workers_per_node=2, inter_node_bandwidth="1gbit", servers_per_node=1)
    logs = tempfile.mkdtemp(prefix="hs-netfault-")
    results = []
    with EmulatedCluster(spec) as cluster:
        for fault in args.faults:
            for route in args.routes:
                results.append(run_job(cluster, route, fault, args, logs))
                print(json.dumps(results[-1]), flush=True)
    print("uptime after:", uptime())
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    print(table(results))
    print(f"\nlogs: {logs}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(main())
