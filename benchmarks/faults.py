"""Parameter servers killed (or stopped) mid-training on an emulated 2 x 2 cluster (root): what it costs.

    sudo .venv/bin/python benchmarks/faults.py             # BSP and ASP, kill / stop a server every 25 steps, a worker once
    sudo .venv/bin/python benchmarks/faults.py --protocols bsp --faults kill --steps 250 --every 50

Brings up 2 hosts (network namespaces, uplinks shaped to ``--bandwidth``) with 2 Horovod
Gloo ranks and 1 supervised parameter server (``hybridsync-server --supervise``) each, and
trains a small MLP whose every variable is on the PS route, once per protocol without
faults and once per fault kind, in this invocation: the controller strikes the serving
process of server 0, 1, 0, ... whenever rank 0 has done another ``--every`` steps.

- ``kill``: SIGKILL; the workers see the connection break, the supervisor starts its spare.
- ``stop``: SIGSTOP (a hang, or a host cut off); found by the workers' pings
  (``HYBRIDSYNC_PS_PING_TIMEOUT``, 10 s by default), the supervisor kills it on their verdict.
- ``worker``: rank 3 SIGKILLed once (not recoverable without Elastic Horovod): how long until
  the other ranks are stopped, the servers exit on their own, and whether any process is left.

Per fault: detection (strike -> the first worker notices), recovery (notice -> the workers
resume on the replacement) and outage (strike -> resumed), from every worker's
``PSClient.recoveries``. Per job: mean step time and the ratio to the undisturbed job of
this invocation, and whether the final parameters equal the undisturbed run's bitwise (BSP;
"what was lost"). Under ASP the workers run apart, so equality is not expected: the tests
check that every delta reaches the servers exactly once (``tests/test_ps_recovery.py``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from provenance import print_header, uptime  # noqa: E402


# -- worker side (every rank, inside the emulated hosts) ----------------------------------------
def worker(out_dir: str, steps: int) -> None:
    """Train; rank 0 writes its progress after each step; every rank reports at the end."""
    import torch
    import horovod.torch as hvd

    import hybridsync as hs
    from hybridsync.backends.ps import client as ps_client
    hs.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 1))  # 1.3 M parameters, 5.2 MB
    optimizer = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                        named_parameters=model.named_parameters())
    hs.broadcast_parameters(model.state_dict(), root_rank=0)
    generator = torch.Generator().manual_seed(hs.rank())
    x = torch.randn(64, 256, generator=generator)
    y = x[:, :1] - x[:, 1:2]
    times = []
    for step in range(steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
        if hs.rank() == 0:
            with open(os.path.join(out_dir, "step.tmp"), "w") as handle:
                handle.write(str(step + 1))
            os.replace(os.path.join(out_dir, "step.tmp"), os.path.join(out_dir, "step"))
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    recoveries = [{"server": r.server, "lost_at": r.lost_at, "recovered_at": r.recovered_at, "keys": r.keys,
                   "resent": r.resent} for r in (ps_client.get_client().recoveries if ps_client.initialized() else [])]
    report = {"rank": hs.rank(), "times": times, "digest": digest, "recoveries": recoveries}
    reports = hvd.allgather_object(report, name="faults.report")
    if hs.rank() == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as handle:
            json.dump(reports, handle)


# -- controller (root, outside the namespaces) --------------------------------------------------
def serving(supervisor_pid: int):
    """A supervisor's serving child (its oldest: the spare starts after it has joined)."""
    import psutil
    children = sorted(psutil.Process(supervisor_pid).children(), key=lambda c: c.create_time())
    return children[0] if children else None


def run_job(cluster, protocol: str, fault: str | None, args: argparse.Namespace, logs: str) -> dict:
    """One training job; strikes the servers every ``args.every`` steps when ``fault`` is set."""
    from hybridsync.run.emulated import launch_gloo, launch_servers, ps_env
    name = f"{protocol}-{fault or 'none'}"
    out_dir = os.path.join(logs, name)
    os.makedirs(out_dir)
    strategy = os.path.join(out_dir, "strategy.json")
    with open(strategy, "w") as handle:
        json.dump({"version": 1, "default": {"route": "ps", "protocol": protocol}}, handle)
    env = {**os.environ, **ps_env(cluster), "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "BYTEPS_PARTITION_BYTES": str(args.partition_bytes), "HYBRIDSYNC_STRATEGY": strategy,
           "TP_SOCKET_IFNAME": "eth0"}
    log = open(os.path.join(logs, f"{name}.log"), "a")
    strikes: list[dict] = []
    try:
        servers = launch_servers(cluster, env=env, stdout=log, stderr=subprocess.STDOUT)
        job = launch_gloo(cluster, [sys.executable, os.path.abspath(__file__), "--worker", out_dir, str(args.steps)],
                          env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in job.processes) and time.monotonic() < deadline:
            step = _progress(out_dir)
            if fault and step >= (len(strikes) + 1) * args.every and step < args.steps - 5:
                target = len(strikes) % len(servers.processes)
                victim = serving(servers.processes[target].pid)
                if victim is not None:
                    strikes.append({"server": target, "step": step, "at": time.time(), "pid": victim.pid})
                    victim.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            time.sleep(0.1)
        try:
            codes = job.wait(timeout=max(1.0, deadline - time.monotonic()))
        except TimeoutError:
            codes = None
        try:
            servers.wait(timeout=60)
        except TimeoutError:
            pass
    finally:
        log.close()
    result_path = os.path.join(out_dir, "result.json")
    if codes is None or any(codes) or not os.path.exists(result_path):
        raise RuntimeError(f"job {name} failed (exit codes {codes}); see {logs}/{name}.log")
    with open(result_path) as handle:
        return {"name": name, "protocol": protocol, "fault": fault, "reports": json.load(handle), "strikes": strikes}


def run_worker_death(cluster, args: argparse.Namespace, logs: str) -> dict:
    """A BSP job whose rank 3 is SIGKILLed at step ``args.every``: no recovery without Elastic
    Horovod. How long until the servers exit on their own and no process is left on any host."""
    import psutil
    from hybridsync.cluster.netns import namespace_pids
    from hybridsync.run.emulated import launch_gloo, launch_servers, ps_env
    out_dir = os.path.join(logs, "bsp-worker")
    os.makedirs(out_dir)
    strategy = os.path.join(out_dir, "strategy.json")
    with open(strategy, "w") as handle:
        json.dump({"version": 1, "default": {"route": "ps", "protocol": "bsp"}}, handle)
    env = {**os.environ, **ps_env(cluster), "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "BYTEPS_PARTITION_BYTES": str(args.partition_bytes), "HYBRIDSYNC_STRATEGY": strategy}
    with open(os.path.join(logs, "bsp-worker.log"), "a") as log:
        servers = launch_servers(cluster, env=env, stdout=log, stderr=subprocess.STDOUT)
        job = launch_gloo(cluster, [sys.executable, os.path.abspath(__file__), "--worker", out_dir, str(args.steps)],
                          env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + args.timeout
        while _progress(out_dir) < args.every and time.monotonic() < deadline:
            time.sleep(0.1)
        psutil.Process(job.processes[3].pid).kill()
        killed = time.monotonic()
        job.wait(timeout=120)  # stops the other ranks, as horovodrun does
        ranks_ended = time.monotonic() - killed
        while any(p.poll() is None for p in servers.processes) and time.monotonic() < killed + 120:
            time.sleep(0.1)
        servers_ended = time.monotonic() - killed
        left = sum(len(namespace_pids(name)) for name in cluster.namespaces)
    with open(os.path.join(logs, "bsp-worker.log")) as handle:
        text = handle.read()
    return {"ranks_ended_s": ranks_ended, "servers_ended_s": servers_ended, "processes_left": left,
            "server_codes": [p.returncode for p in servers.processes],
            "named": "worker3 stopped answering" in text, "replaced": "starting replacement" in text}


def _progress(out_dir: str) -> int:
    try:
        with open(os.path.join(out_dir, "step")) as handle:
            return int(handle.read() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def fault_rows(job: dict) -> list[dict]:
    """Per strike: detection, recovery and outage, over the workers (first to notice, last to resume)."""
    rows = []
    for strike in job["strikes"]:
        events = [r for report in job["reports"] for r in report["recoveries"]
                  if r["server"] == strike["server"] and r["lost_at"] >= strike["at"] - 1.0
                  and r["recovered_at"] is not None]
        events = [e for e in events if not any(s["at"] > strike["at"] and e["lost_at"] >= s["at"] - 1.0
                                               for s in job["strikes"])]
        if not events:
            rows.append({**strike, "detected_s": None, "recovered_s": None, "outage_s": None})
            continue
        noticed = min(e["lost_at"] for e in events)
        resumed = max(e["recovered_at"] for e in events)
        rows.append({**strike, "detected_s": noticed - strike["at"], "recovered_s": resumed - noticed,
                     "outage_s": resumed - strike["at"], "workers": len(events),
                     "keys": max(e["keys"] for e in events), "resent": sum(e["resent"] for e in events)})
    return rows


def report(jobs: list[dict], args: argparse.Namespace) -> str:
    """Two tables: per job (step times; the final parameters against the undisturbed job's), per strike.

    Step times move with the machine's load from one job to the next, so a job is judged
    against its own median step: "time above median" sums every step's excess over it, and
    a strike costs what the struck job has above its median beyond what the undisturbed job
    has above its own."""
    lines = ["", "| job | steps | median step s | vs undisturbed | time above median s | per strike s | strikes | "
             "final params |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    calm = {job["protocol"]: job for job in jobs if job["fault"] is None}
    for job in jobs:
        times = job["reports"][0]["times"][3:]  # the first steps create keys and seed parameters
        base = calm[job["protocol"]]["reports"][0]["times"][3:]
        digests = {r["digest"] for r in job["reports"]}
        same = digests == {r["digest"] for r in calm[job["protocol"]]["reports"]}
        final = ("bitwise equal to undisturbed" if same and len(digests) == 1 else
                 "ranks differ (ASP)" if job["protocol"] == "asp" else "DIFFERENT")
        above, base_above = _above_median(times), _above_median(base)
        per_strike = f"{(above - base_above) / len(job['strikes']):.2f}" if job["strikes"] else "-"
        lines.append(f"| {job['name']} | {len(times) + 3} | {statistics.median(times):.3f} | "
                     f"{statistics.median(times) / statistics.median(base):.2f}x | {above:.1f} | {per_strike} | "
                     f"{len(job['strikes'])} | {final if job['fault'] else '-'} |")
    lines += ["", "| job | strike | server | at step | detected s | recovered s | outage s | keys restored | "
              "calls resent |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for job in jobs:
        for index, row in enumerate(fault_rows(job)):
            cells = [f"{row[k]:.2f}" if row.get(k) is not None else "n/a"
                     for k in ("detected_s", "recovered_s", "outage_s")]
            lines.append(f"| {job['name']} | {index + 1} | server{row['server']} | {row['step']} | {' | '.join(cells)} | "
                         f"{row.get('keys', 'n/a')} | {row.get('resent', 'n/a')} |")
    return "\n".join(lines)


def _above_median(times: list[float]) -> float:
    median = statistics.median(times)
    return sum(t - median for t in times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bandwidth", default="1gbit", help="tc-style uplink rate (default 1gbit)")
    parser.add_argument("--protocols", nargs="+", default=["bsp", "asp"], choices=["bsp", "asp"])
    parser.add_argument("--faults", nargs="+", default=["kill", "stop", "worker"], choices=["kill", "stop", "worker"],
                        help="kill/stop: strike a server every --every steps; worker: SIGKILL rank 3 once (no recovery)")
    parser.add_argument("--steps", type=int, default=125, help="training steps per job (default 125)")
    parser.add_argument("--every", type=int, default=25, help="strike a server every N steps of rank 0 (default 25)")
    parser.add_argument("--partition-bytes", type=int, default=1 << 20, help="PS key size (default 1 MiB)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a job is killed")
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    from hybridsync.cluster import ClusterSpec, EmulatedCluster
    print_header()
    spec = ClusterSpec(nodes=2, workers_per_node=2, inter_node_bandwidth=args.bandwidth, servers_per_node=1)
    logs = tempfile.mkdtemp(prefix="hs-faults-")
    jobs, death = [], None
    with EmulatedCluster(spec) as cluster:
        for protocol in args.protocols:
            for fault in [None, *(f for f in args.faults if f != "worker")]:
                started = time.monotonic()
                jobs.append(run_job(cluster, protocol, fault, args, logs))
                print(f"{jobs[-1]['name']}: {time.monotonic() - started:.0f} s", flush=True)
        if "worker" in args.faults:
            death = run_worker_death(cluster, args, logs)
    print("uptime after:", uptime())
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"jobs": jobs, "worker_death": death}, handle, indent=1)
    print(report(jobs, args))
    if death is not None:
        print(f"\nbsp-worker: rank 3 SIGKILLed at step {args.every}: the other ranks stopped after "
              f"{death['ranks_ended_s']:.1f} s, the servers exited on their own after {death['servers_ended_s']:.1f} s "
              f"(status {death['server_codes']}, named worker3: {death['named']}, replaced: {death['replaced']}); "
              f"processes left on the hosts: {death['processes_left']}")
    print(f"\nlogs: {logs}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(main())
