"""Trials on the emulated 2 x 2 cluster: the sweep command end to end (store, export, stats).

Needs root (namespaces, tc); skips cleanly without it. The sweep runs as a child process
bounded by a timeout; afterwards no namespace of ours may be left.
"""
from __future__ import annotations

import json
import sys

import pytest

from conftest import BIN, IS_ROOT, cluster_tags, run_job

pytestmark = [pytest.mark.emulated,
              pytest.mark.skipif(not IS_ROOT, reason="network namespaces and tc need root and iproute2")]


def test_sweep_measures_every_candidate_on_the_emulated_cluster_and_exports(tmp_path):
    from hybridsync.cluster.netns import NAMESPACE_PREFIX, leftovers
    from hybridsync.trials.store import TrialStore
    before = cluster_tags(leftovers(NAMESPACE_PREFIX))
    spec = tmp_path / "cluster.yaml"
    spec.write_text("nodes: 2\nworkers_per_node: 2\ninter_node_bandwidth: 1gbit\nservers_per_node: 1\n")
    store, export = f"sqlite:///{tmp_path / 'trials.db'}", tmp_path / "trials.jsonl"
    argv = [str(BIN / "hybridsync"), "trials", "sweep", "--models", "ncf", "--clusters", str(spec),
            "--sample", "2", "--warmup", "1", "--steps", "3", "--store", store, "--export", str(export),
            "--workdir", str(tmp_path)]
    proc = run_job(argv, timeout=400)
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert cluster_tags(leftovers(NAMESPACE_PREFIX)) <= before  # none of ours left (others' may run meanwhile)
    with TrialStore(store) as trials:
        records = trials.trials()
    kinds = [r.kind for r in records]
    assert "horovod" in kinds and kinds.count("random") == 2 and any(k.startswith("baseline:") for k in kinds)
    assert all(r.status == "ok" for r in records), [(r.kind, r.reason) for r in records if r.status != "ok"]
    assert all(r.cluster["nodes"] == 2 and len(r.step_times) == 4 for r in records)
    lines = [json.loads(line) for line in export.read_text().splitlines()]
    assert sorted(line["uid"] for line in lines if line["type"] == "trial") == sorted(r.uid for r in records)
    assert [line["model"] for line in lines if line["type"] == "description"] == ["ncf"]
    stats = run_job([str(BIN / "hybridsync"), "dataset", "stats", "--store", store], timeout=60)
    assert stats.returncode == 0 and "ncf" in stats.stdout, stats.stdout
