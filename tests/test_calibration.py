"""Calibrating the simulator for a cluster: the collective micro-benchmark and its fit
(``hybridsync.trials.calibration_worker``, ``hybridsync.model.calibration``)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from hybridsync.cluster.spec import ClusterSpec
from hybridsync.model.calibration import fit_links, load_calibrations, run_calibration, save_calibration
from hybridsync.model.links import LinkConstants, nominal_links

TWO_BY_TWO = ClusterSpec(nodes=2, workers_per_node=2, inter_node_bandwidth="1gbit", servers_per_node=1)
SIZES = (4, 65536, 1048576, 4194304)


def worker_output(*, alpha: dict[str, float], slope: dict[str, float], per_key: float, noise: float = 0.0,
                  world: dict | None = None) -> dict:
    """What the worker writes for paths that take alpha + bytes x slope (rank 0's document)."""
    rng = np.random.default_rng(0)

    def times(seconds: float) -> list[float]:
        return list(seconds * (1 + noise * rng.random(5)))
    paths = {path: {str(n): times(alpha[path] + n * slope[path]) for n in SIZES} for path in alpha}
    if "ps" in alpha:
        paths["ps_burst"] = {"65536": times(alpha["ps"] + 4096 * slope["ps"] + 15 * per_key)}
    return {"world": world or {"size": 4, "local_size": 2, "cross_size": 2, "num_servers": 2}, "repeats": 5,
            "burst": {"keys": 16, "bytes": 4096}, "paths": paths, "cpu": {"bytes": 4194304, "seconds": 0.004}}


@pytest.mark.unit
def test_fit_links_recovers_each_paths_latency_and_bandwidth():
    alpha = {"ring": 0.005, "hier": 0.008, "ps": 0.007}
    slope = {"ring": 1.2e-8, "hier": 8e-9, "ps": 3e-8}
    links = fit_links(worker_output(alpha=alpha, slope=slope, per_key=0.002, noise=0.3), TWO_BY_TWO)
    assert links.source == "calibrated"
    for path in alpha:
        assert getattr(links, f"{path}_s_per_byte") == pytest.approx(slope[path], rel=0.35), path
    assert links.ring_alpha_s == pytest.approx(alpha["ring"], rel=0.35)
    assert links.hier_alpha_s == pytest.approx(alpha["hier"], rel=0.35)
    assert links.ps_alpha_s == pytest.approx(0.002, rel=0.5)  # one more key in flight, not a key alone
    assert links.cpu_s_per_byte == pytest.approx(0.004 / (4194304 / 2))
    # a path the job could not measure keeps the spec's value
    partial = fit_links(worker_output(alpha={"ring": 0.005}, slope={"ring": 1.2e-8}, per_key=0.0), TWO_BY_TWO)
    assert partial.hier_s_per_byte == nominal_links(TWO_BY_TWO).hier_s_per_byte
    assert partial.ring_s_per_byte == pytest.approx(1.2e-8, rel=0.01)


@pytest.mark.unit
def test_fit_links_refuses_a_measurement_of_another_cluster_and_files_keep_calibrations(tmp_path):
    doc = worker_output(alpha={"ring": 0.005}, slope={"ring": 1e-8}, per_key=0.0,
                        world={"size": 2, "local_size": 2, "cross_size": 1, "num_servers": 0})
    with pytest.raises(ValueError, match="ran on 2 ranks over 1 hosts, but the cluster spec has 4 workers on 2 nodes"):
        fit_links(doc, TWO_BY_TWO)
    with pytest.raises(ValueError, match="must be finite numbers >= 0"):
        LinkConstants(**{**nominal_links(TWO_BY_TWO).to_dict(), "ring_s_per_byte": float("nan")})
    path = tmp_path / "calibrations.json"
    assert load_calibrations(path) == {}
    links = fit_links(worker_output(alpha={"ring": 0.005}, slope={"ring": 1e-8}, per_key=0.0), TWO_BY_TWO)
    save_calibration(path, TWO_BY_TWO, links, {"paths": {}})
    assert load_calibrations(path) == {"2x2@1gbit+1ps": links}
    assert json.loads(path.read_text())["2x2@1gbit+1ps"]["cluster"] == TWO_BY_TWO.to_dict()


@pytest.mark.multiprocess
def test_the_calibration_worker_measures_a_two_rank_job_with_a_server(tmp_path):
    """The worker as the trial machinery runs it (``hybridsync-run -np 2 -H localhost:2
    --num-servers 1`` through ``trials.jobs.HostsTarget``): every path measured, constants in a
    sane range for one host's loopback, the job stopped."""
    from hybridsync.trials.jobs import HostsTarget
    cluster = ClusterSpec(nodes=1, workers_per_node=2, inter_node_bandwidth="1gbit", servers_per_node=1)
    with HostsTarget(cluster, hosts="localhost:2") as target:
        raw = run_calibration(target, workdir=str(tmp_path), repeats=3, sizes=(4, 262144, 2097152))
    assert raw["world"] == {"size": 2, "local_size": 2, "cross_size": 1, "num_servers": 1}
    assert set(raw["paths"]) == {"ring", "hier", "ps", "ps_burst"}
    links = fit_links(raw, cluster)
    for path in ("ring", "hier", "ps"):
        assert 0 <= getattr(links, f"{path}_alpha_s") < 0.5, path  # seconds per message
        assert 1e-12 < getattr(links, f"{path}_s_per_byte") < 1e-6, path  # 1 MB/s .. 1 TB/s
    assert 1e-12 < links.cpu_s_per_byte < 1e-7
