"""Calibrate the runtime simulator for a cluster: a seconds-long collective micro-benchmark on its ranks.

    links = calibrate(target, cluster)                  # a job of hybridsync.trials.calibration_worker
    simulator = simulator.calibrated(cluster, links)    # prices this cluster's paths as measured

The analytic model prices each message from the cluster's ``LinkConstants`` (latency and
seconds per byte of the ring, hierarchical and parameter-server paths, and the CPU cost of
fp16 casts) times software constants fitted on many models and clusters. ``calibrate``
measures the former on the real job's ranks, through the same job targets the trials use
(``trials.jobs``: the emulated cluster, or real hosts through ``hybridsync-run``), so that a
new cluster is a new set of a few measured numbers, not a new world; ``fit_links`` turns
the worker's output into constants by least squares (time = alpha + bytes x slope, per path).

``python -m hybridsync.model.calibration --cluster spec.yaml [-H a:2,b:2] [--out FILE]``
calibrates a cluster by hand and adds it to a calibrations file (``load_calibrations``):
``data/calibrations.json`` holds those of the runtime dataset's clusters, which the
shipped simulator was fit with.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Mapping, Sequence

import numpy as np

from hybridsync.cluster.spec import ClusterSpec
from hybridsync.model.links import LinkConstants, nominal_links

POLL_S = 0.2
TIMEOUT_S = 240.0
"""A calibration job's bound: starting the ranks and servers (~20-30 s) plus seconds of collectives."""
CALIBRATIONS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "data", "calibrations.json")
"""The runtime dataset's clusters as calibrated (a source checkout's ``data/``)."""


def calibration_job(results: str, *, repeats: int = 5, sizes: Sequence[int] | None = None,
                    ) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a calibration job writing ``results``."""
    import hybridsync
    command = [sys.executable, "-m", "hybridsync.trials.calibration_worker", "--results", results,
               "--repeats", str(repeats)]
    if sizes:
        command += ["--sizes", *map(str, sizes)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(hybridsync.__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return command, {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def run_calibration(target: Any, *, workdir: str | None = None, repeats: int = 5, sizes: Sequence[int] | None = None,
                    timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """Runs the calibration worker on every rank of an entered job target (``trials.jobs``) and
    returns rank 0's document; ``RuntimeError`` with the job's log tail if it fails or outlives
    ``timeout_s``. The job is stopped, whole, in every case; a temporary ``workdir`` (none given)
    is removed once read, and kept, with the log the error names, when the job failed."""
    if workdir is None:
        folder = tempfile.mkdtemp(prefix="hybridsync-calibration-")
        document = run_calibration(target, workdir=folder, repeats=repeats, sizes=sizes, timeout_s=timeout_s)
        shutil.rmtree(folder, ignore_errors=True)
        return document
    os.makedirs(workdir, exist_ok=True)
    results, log_path = os.path.join(workdir, "calibration.json"), os.path.join(workdir, "calibration.log")
    command, env = calibration_job(results, repeats=repeats, sizes=sizes)
    deadline = time.monotonic() + timeout_s
    with open(log_path, "a", encoding="utf-8") as log:
        job = target.start(command, env, log)
        try:
            while True:
                codes = job.exit_codes()
                if any(code not in (None, 0) for code in codes) or time.monotonic() > deadline:
                    why = (f"exit codes {codes}" if time.monotonic() <= deadline
                           else f"not done within {timeout_s:.0f} s")
                    raise RuntimeError(f"the calibration job failed ({why}); its log {log_path} ends:\n"
                                       f"{_tail(log_path)}")
                if all(code == 0 for code in codes):
                    break
                time.sleep(POLL_S)
        finally:
            job.stop()
    if not os.path.exists(results):
        raise RuntimeError(f"the calibration job ended without writing {results}; its log {log_path} ends:\n"
                           f"{_tail(log_path)}")
    with open(results, encoding="utf-8") as handle:
        return json.load(handle)


def _tail(path: str, chars: int = 2000) -> str:
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read()[-chars:]


def _fastest(times: Sequence[float]) -> float:
    """A size's time: the lower quartile of its repeats. Other jobs on the machine only ever slow
    an op down, and their noise is not the cluster's; the ranks' own contention is in every repeat."""
    return float(np.quantile(times, 0.25))


def _line(by_size: Mapping[str, Sequence[float]]) -> tuple[float, float]:
    """Non-negative least squares of seconds = alpha + bytes x slope over the sizes (``_fastest``)."""
    from scipy.optimize import nnls
    sizes = np.array([float(n) for n in by_size])
    times = np.array([_fastest(t) for t in by_size.values()])
    (alpha, slope), _ = nnls(np.stack([np.ones_like(sizes), sizes], axis=1) / times[:, None], np.ones_like(sizes))
    return float(alpha), float(slope)


def fit_links(doc: Mapping[str, Any], cluster: ClusterSpec) -> LinkConstants:
    """The ``LinkConstants`` a calibration worker's output says (each path's latency and slope,
    fitted in relative error so that the 4-byte probe weighs like the 4 MiB one); a path the
    job did not measure, or whose times did not grow with the bytes beyond their noise, keeps
    its ``nominal_links`` slope. ``ValueError`` when the output was measured on another shape
    of cluster than ``cluster``."""
    world = doc["world"]
    if (world["size"], world["cross_size"]) != (cluster.num_workers, cluster.nodes):
        raise ValueError(f"the calibration ran on {world['size']} ranks over {world['cross_size']} hosts, but the "
                         f"cluster spec has {cluster.num_workers} workers on {cluster.nodes} nodes")
    nominal = nominal_links(cluster)
    paths = doc["paths"]
    values = {}
    for path in ("ring", "hier", "ps"):
        if path in paths and len(paths[path]) >= 2:
            alpha, slope = _line(paths[path])
            values[f"{path}_alpha_s"] = alpha
            if slope > 0:  # else the sizes' times did not grow beyond their noise: keep the spec's bandwidth
                values[f"{path}_s_per_byte"] = slope
    if "ps_burst" in paths and "ps" in paths:
        burst = _fastest(next(iter(paths["ps_burst"].values())))
        single = _fastest(paths["ps"][min(paths["ps"], key=int)])
        values["ps_alpha_s"] = max(burst - single, 0.0) / max(doc["burst"]["keys"] - 1, 1)
    if "cpu" in doc:
        values["cpu_s_per_byte"] = doc["cpu"]["seconds"] / (doc["cpu"]["bytes"] / 2)  # per half-precision byte
    return LinkConstants(**{**nominal.to_dict(), **values, "source": "calibrated"})


def calibrate(target: Any, cluster: ClusterSpec, **options: Any) -> LinkConstants:
    """Measure ``cluster``'s paths on an entered job target and fit them (``run_calibration`` options)."""
    return fit_links(run_calibration(target, **options), cluster)


def load_calibrations(path: str | os.PathLike[str] = CALIBRATIONS) -> dict[str, LinkConstants]:
    """Calibrated links by cluster label from a calibrations file; {} when it does not exist."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        doc = json.load(handle)
    return {label: LinkConstants.from_dict(entry["links"]) for label, entry in doc.items()}


def save_calibration(path: str | os.PathLike[str], cluster: ClusterSpec, links: LinkConstants,
                     raw: Mapping[str, Any]) -> None:
    """Adds (or replaces) ``cluster``'s entry of a calibrations file: its links, the worker's output, the date."""
    from hybridsync.trials.store import cluster_label
    doc = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            doc = json.load(handle)
    doc[cluster_label(cluster.to_dict())] = {
        "cluster": cluster.to_dict(), "links": links.to_dict(), "raw": raw,
        "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average": round(os.getloadavg()[0], 1)}
    partial = f"{path}.partial-{os.getpid()}"
    with open(partial, "w", encoding="utf-8") as handle:
        json.dump(doc, handle, indent=1, sort_keys=True)
        handle.write("\n")
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridsync.model.calibration", description=__doc__.split("\n")[0])
    parser.add_argument("--cluster", required=True, help="cluster spec YAML (emulated here without -H: root)")
    parser.add_argument("-H", "--hosts", help="real hosts, as hybridsync-run -H takes them")
    parser.add_argument("--out", default=CALIBRATIONS, help=f"calibrations file to add it to (default {CALIBRATIONS})")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    from hybridsync.trials.jobs import EmulatedTarget, HostsTarget
    cluster = ClusterSpec.from_yaml(args.cluster)
    target = HostsTarget(cluster, hosts=args.hosts) if args.hosts else EmulatedTarget(cluster)
    started = time.monotonic()
    with target:
        raw = run_calibration(target, repeats=args.repeats)
    links = fit_links(raw, cluster)
    save_calibration(args.out, cluster, links, raw)
    print(f"calibrated in {time.monotonic() - started:.0f} s: {json.dumps(links.to_dict())} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
