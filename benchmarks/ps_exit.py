"""How long ``hybridsync-run`` takes to return once a 2-rank job on this host is over, and where it goes.

    .venv/bin/python benchmarks/ps_exit.py --repeats 3                        # this checkout
    .venv/bin/python benchmarks/ps_exit.py --repeats 3 --code /tmp/old .     # two trees, interleaved

Cases (``--cases``):
- ``normal-ps``: ``tests/workers/fault_train.py`` (20 steps) with every variable on the PS route (BSP),
  2 supervised servers; from the last rank's last step (its result file's time) to the return;
- ``normal-ring``: the same job without a strategy (no servers): the ring-only reference;
- ``raise-ps``: ``tests/workers/out_of_step.py user_error`` on the PS route: from rank 1's error;
- ``dead-worker-ps``: ``fault_train.py`` on the PS route, rank 1 SIGKILLed after 3 steps: from the kill.

Per job, while it runs, the process tree is polled (every 0.05 s) and each process's end is
noted, by role: the ranks, horovodrun, the serving servers, their standby spares and their
supervisors. Printed: seconds from the case's moment to each role's last process gone, and to
``hybridsync-run``'s return; then medians per case and tree. Jobs of every tree are interleaved
(ABAB...), as this machine's load moves from one job to the next.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hybridsync.run import procs  # noqa: E402

BIN = Path(sys.executable).parent
WORKERS = REPO / "tests" / "workers"
BSP = {"version": 1, "default": {"route": "ps", "protocol": "bsp"}}
JOB_TIMEOUT_S = 240
ROLES = ("ranks", "horovodrun", "servers", "standbys", "supervisors")


def role(proc: psutil.Process, supervisors: set[int]) -> str | None:
    """The part ``proc`` plays in the job (``None``: a shell or helper not tracked)."""
    try:
        cmdline = " ".join(proc.cmdline())
        if "--supervise" in cmdline:
            supervisors.add(proc.pid)
            return "supervisors"
        if "hybridsync.backends.ps.server" in cmdline:
            return "standbys" if "--standby" in cmdline and proc.ppid() in supervisors and _younger_sibling(proc) \
                else "servers"
        if "horovodrun" in cmdline:
            return "horovodrun"
        if "fault_train.py" in cmdline or "out_of_step.py" in cmdline:
            return "ranks" if "HOROVOD_RANK" in proc.environ() else None
    except psutil.Error:
        return None
    return None


def _younger_sibling(proc: psutil.Process) -> bool:
    """A supervisor's standby is its younger child (the serving one started first)."""
    siblings = sorted(psutil.Process(proc.ppid()).children(), key=lambda c: c.create_time())
    return len(siblings) > 1 and siblings[0].pid != proc.pid


def argv(case: str, tmp: Path, prefix: Path) -> list[str]:
    run = [str(BIN / "hybridsync-run"), "-np", "2", "-H", "localhost:2", "--gloo"]
    if case != "normal-ring":
        (tmp / "bsp.json").write_text(json.dumps(BSP))
        run += ["--strategy", str(tmp / "bsp.json"), "--num-servers", "2"]
    if case == "raise-ps":
        return run + [sys.executable, str(WORKERS / "out_of_step.py"), "user_error", str(prefix)]
    steps = "400" if case == "dead-worker-ps" else "20"
    return run + [sys.executable, str(WORKERS / "fault_train.py"), str(prefix), "--steps", steps, "--sleep", "0.05"]


def one_job(case: str, code: Path, tmp: Path) -> dict[str, float]:
    """Seconds from the case's moment to each role's end and to the launcher's return."""
    prefix = tmp / f"{case}-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update(PYTHONPATH=str(code), PYTHONUNBUFFERED="1")
    log = open(f"{prefix}.log", "w")
    launcher = psutil.Popen(argv(case, tmp, prefix), env=env, cwd=str(tmp), stdout=log, stderr=log,
                            start_new_session=True)
    last_seen: dict[str, float] = {}
    alive: dict[int, str] = {}
    supervisors: set[int] = set()
    killed_at = None
    deadline = time.time() + JOB_TIMEOUT_S
    try:
        while launcher.poll() is None and time.time() < deadline:
            now = time.time()
            try:
                children = launcher.children(recursive=True)
            except psutil.Error:
                children = []
            for proc in children:
                if proc.pid not in alive:
                    name = role(proc, supervisors)
                    if name:
                        alive[proc.pid] = name
            for pid, name in alive.items():
                if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    last_seen[name] = now
            if case == "dead-worker-ps" and killed_at is None and _steps(prefix, 1) >= 3:
                rank1 = [p for p, n in alive.items() if n == "ranks" and psutil.Process(p).environ().get("HOROVOD_RANK") == "1"]
                os.kill(rank1[0], signal.SIGKILL)
                killed_at = time.time()
            time.sleep(0.05)
        returned = time.time()
    finally:
        if launcher.poll() is None:
            procs.stop(launcher)
        log.close()
    left = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    origin = _origin(case, prefix, killed_at)
    row = {name: last_seen.get(name, origin) - origin for name in ROLES}
    row.update(returned=returned - origin, code=launcher.returncode, left=len(left))
    return row


def _steps(prefix: Path, rank: int) -> int:
    try:
        return int(Path(f"{prefix}.rank{rank}.step").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def _origin(case: str, prefix: Path, killed_at: float | None) -> float:
    if case == "dead-worker-ps":
        assert killed_at is not None, "rank 1 was never killed"
        return killed_at
    if case == "raise-ps":
        return json.loads(Path(f"{prefix}.rank1.json").read_text())["at"]
    return max(os.path.getmtime(f"{prefix}.rank{r}.json") for r in range(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default="normal-ps,normal-ring,raise-ps,dead-worker-ps")
    parser.add_argument("--code", nargs="+", default=[str(REPO)], help="checkouts to compare (PYTHONPATH of the job)")
    args = parser.parse_args()
    rows: dict[tuple[str, str], list[dict]] = {}
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for case in args.cases.split(","):
                for code in args.code:
                    row = one_job(case, Path(code).resolve(), Path(tmp))
                    rows.setdefault((case, code), []).append(row)
                    print(f"{case:15s} {code:12s} " + " ".join(f"{k} {v:5.1f}" if isinstance(v, float) else f"{k} {v}"
                                                           for k, v in row.items()), flush=True)
    print(f"\nmedians, seconds after the case's moment (load {os.getloadavg()[0]:.1f}):")
    print("| case | code | " + " | ".join(ROLES) + " | returned | exit codes | left |")
    print("| --- " * (len(ROLES) + 5) + "|")
    for (case, code), jobs in rows.items():
        medians = [statistics.median(j[k] for j in jobs) for k in (*ROLES, "returned")]
        print(f"| {case} | {code} | " + " | ".join(f"{m:.1f}" for m in medians)
              + f" | {' '.join(str(j['code']) for j in jobs)} | {sum(j['left'] for j in jobs)} |")


if __name__ == "__main__":
    main()
