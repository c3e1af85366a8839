"""The torch-free plan's PS keys against a real job: ``hybridsync-run --num-servers 2`` (horovodrun,
Gloo), two optimizers in one job (``tests/workers/ps_placement.py``). Every key a worker pushed
must be one ``RoutingPlan.ps_keys`` predicted, on the predicted server, and every predicted
key must have been pushed once per step. (``test_router_inprocess.py`` checks the same in
process, with the RPC replaced.)
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import BIN, WORKERS, run_job
from hybridsync.router.plan import build_plan
from hybridsync.strategy import Strategy
from hybridsync.description import parse_model_description

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]


def test_every_pushed_key_is_where_the_plan_predicted(tmp_path):
    pytest.importorskip("horovod.torch")
    out = tmp_path / "placement.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    argv = [str(BIN / "hybridsync-run"), "--num-servers", "2", "--partition-bytes", "400", "-np", "2",
            "-H", "localhost:2", "--gloo", sys.executable, str(WORKERS / "ps_placement.py"), str(out)]
    proc = run_job(argv, timeout=180, env=env)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:]
    job = json.loads(out.read_text())
    variables = parse_model_description({"variables": job["variables"]})
    assert any(v.sparse for v in variables.values())
    for phase in job["phases"]:
        plan = build_plan(variables, Strategy.from_dict(phase["strategy"]), compression=phase["compression"])
        predicted = {key.name: key for keys in plan.ps_keys(num_servers=job["num_servers"],
                                                            partition_bytes=job["partition_bytes"],
                                                            namespace=phase["namespace"],
                                                            loads=phase["loads"]).values() for key in keys}
        assert phase["pushes"] == {name: job["steps"] for name in predicted}, phase["namespace"]
        assert {name: phase["placement"][name] for name in predicted} == {n: k.server for n, k in predicted.items()}
    assert job["phases"][1]["loads"] is not None and sum(job["phases"][1]["loads"]) > 0  # the second saw the first's
