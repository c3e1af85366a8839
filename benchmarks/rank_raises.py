"""How long a 2-rank job on this host takes to end after one rank's code raises.

Runs ``tests/workers/out_of_step.py`` (case ``raise_in_step``: rank 1 raises between
``backward()`` and ``step()``; ``user_error``: where rank 0 calls ``set_strategy()``) under
``horovodrun --gloo`` and ``mpirun`` with the given strategy, ``--repeats`` times each, and
prints per job: what rank 0 raised and how long after rank 1's error (epoch clocks of one
host), and how long after rank 1's error the launcher exited (the job's end).

    .venv/bin/python benchmarks/rank_raises.py --route hierarchical --repeats 5
    .venv/bin/python benchmarks/rank_raises.py --route ps --repeats 5      # through hybridsync-run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hybridsync.run import procs  # noqa: E402

BIN = Path(sys.executable).parent
WORKER = REPO / "tests" / "workers" / "out_of_step.py"
STRATEGIES = {
    "ring": None,
    "hierarchical": {"version": 1, "default": {"route": "allreduce", "algorithm": "hierarchical"}},
    "ps": {"version": 1, "default": {"route": "ps", "protocol": "bsp"}},
}
JOB_TIMEOUT_S = 240


def launcher(name: str, strategy: Path | None, ps: bool) -> list[str]:
    """horovodrun (Gloo) or mpirun for 2 ranks; through hybridsync-run when the strategy uses servers."""
    if ps:
        return [str(BIN / "hybridsync-run"), "-np", "2", "-H", "localhost:2",
                *(["--gloo"] if name == "gloo" else []), "--strategy", str(strategy)]
    if name == "gloo":
        return [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo"]
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "2",
            "-x", "PATH", "-x", "PYTHONPATH", "-x", "SLOW_EXIT_S", *(["-x", "HYBRIDSYNC_STRATEGY"] if strategy else [])]


def one_job(name: str, case: str, route: str, tmp: Path, slow_exit_s: float = 0.0) -> dict:
    """Runs one job; rank 0's error and the launcher's exit, in seconds after rank 1's error."""
    strategy = None
    if STRATEGIES[route] is not None:
        strategy = tmp / "s.json"
        strategy.write_text(json.dumps(STRATEGIES[route]))
    prefix = tmp / f"{name}-{case}-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           **({"HYBRIDSYNC_STRATEGY": str(strategy)} if strategy and route != "ps" else {}),
           "SLOW_EXIT_S": str(slow_exit_s)}
    argv = launcher(name, strategy, route == "ps") + [sys.executable, str(WORKER), case, str(prefix)]
    proc = procs.start(argv, env=env, cwd=str(REPO))
    try:
        output, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        procs.stop(proc, grace=1)
    ended = time.time()
    records = [json.loads(Path(f"{prefix}.rank{r}.json").read_text())
               if Path(f"{prefix}.rank{r}.json").exists() else {} for r in range(2)]
    raised = records[1].get("at")
    if raised is None:
        return {"launcher": name, "exit": proc.returncode, "problem": output[-2000:]}
    return {"launcher": name, "exit": proc.returncode, "rank0": records[0].get("type"),
            "rank0_message": records[0].get("message", "")[:160],
            "rank0_after_s": records[0]["at"] - raised if "at" in records[0] else None,
            "ended_after_s": ended - raised}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--route", choices=sorted(STRATEGIES), default="hierarchical")
    parser.add_argument("--case", choices=("raise_in_step", "user_error"), default="raise_in_step")
    parser.add_argument("--launchers", default="gloo,mpirun")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--slow-exit", type=float, default=0.0,
                        help="seconds rank 1's own exit handlers take (SLOW_EXIT_S of the worker)")
    args = parser.parse_args()
    print(os.popen("uptime").read().strip(), "|", " ".join(sys.argv[1:]))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for name in args.launchers.split(","):
                result = one_job(name, args.case, args.route, Path(tmp), args.slow_exit)
                results.append(result)
                print(json.dumps(result), flush=True)
    print(os.popen("uptime").read().strip())
    for name in args.launchers.split(","):
        ends = [r["ended_after_s"] for r in results if r["launcher"] == name and "ended_after_s" in r]
        errs = [r["rank0_after_s"] for r in results if r["launcher"] == name and r.get("rank0_after_s") is not None]
        if ends:
            print(f"{args.route} {args.case} {name}: rank 0's error after {min(errs, default=0):.1f}-"
                  f"{max(errs, default=0):.1f} s, job ended after {min(ends):.1f}-{max(ends):.1f} s "
                  f"(median {statistics.median(ends):.1f}) in {len(ends)} jobs")


if __name__ == "__main__":
    main()
