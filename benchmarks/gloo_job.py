"""One Gloo job of a benchmark's own worker on an emulated cluster, its result read back as JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Callable, Sequence


def run_worker(cluster: Any, script: str, worker_args: Sequence[str], env: dict[str, str], logs: str,
               timeout: float, what: str) -> Any:
    """Runs ``script --worker *worker_args OUT`` on every worker slot of the entered emulated ``cluster``
    (``hybridsync.run.emulated.launch_gloo``), the ranks' output appended to ``logs``/ranks.log, and
    returns what the worker wrote to OUT as JSON. ``RuntimeError`` naming ``what``, with the log's
    tail, if a rank failed, the job outlived ``timeout`` or nothing was written."""
    from hybridsync.run.emulated import launch_gloo
    out_path = os.path.join(logs, f"result-{time.monotonic_ns()}.json")
    log_path = os.path.join(logs, "ranks.log")
    with open(log_path, "a") as log:
        job = launch_gloo(cluster, [sys.executable, os.path.abspath(script), "--worker", *worker_args, out_path],
                          env=env, stdout=log, stderr=subprocess.STDOUT)
        codes = job.wait(timeout=timeout)
    if any(codes) or not os.path.exists(out_path):
        with open(log_path, errors="replace") as handle:
            tail = handle.read()[-3000:]
        raise RuntimeError(f"{what} failed: exit codes {codes}\n{tail}")
    with open(out_path) as handle:
        return json.load(handle)


def start_worker(config_path: str) -> dict:
    """A worker's start on every rank: the job's config (JSON), hybridsync (Horovod) initialized, one
    torch thread per rank (the ranks share the machine's cores)."""
    import torch

    import hybridsync as hs
    with open(config_path) as handle:
        config = json.load(handle)
    hs.init()
    torch.set_num_threads(1)
    return config


def finish_worker(hvd: Any, out_path: str, result: Any) -> None:
    """A worker's end on every rank: rank 0 writes ``result`` (JSON) for ``run_worker``; Horovod shuts down."""
    if hvd.rank() == 0:
        with open(out_path, "w") as handle:
            json.dump(result, handle)
    hvd.shutdown()


def print_load() -> None:
    """The benchmark's last line: the machine's load, which its side-by-side ratios should be read against."""
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


def script_main(main: Callable[[], int], worker: Callable[..., None], worker_args: int) -> None:
    """A benchmark script's ``__main__``: ``--worker`` and its ``worker_args`` arguments (as
    ``run_worker`` passes them) run ``worker`` on a rank; anything else runs ``main``."""
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:2 + worker_args])
    else:
        sys.exit(main())
