"""Fair rivals in a real 2-rank job: the baselines' fp16 twins and Horovod's own fp16 optimizer run
where fp16 runs, and are refused (as a failed trial, the job going on) where Horovod's cannot."""
from __future__ import annotations

import pytest

from hybridsync.cluster.spec import ClusterSpec
from hybridsync.strategy import Strategy
from hybridsync.trials.candidates import Candidate, rival_levers, rivals
from hybridsync.trials.jobs import HostsTarget
from hybridsync.trials.runner import TrialProtocol, TrialRunner, ZooWorkload
from hybridsync.trials.store import HOROVOD_FP16_KIND, HOROVOD_KIND, TrialStore
from hybridsync.zoo import describe

pytestmark = pytest.mark.multiprocess

SPEC = ClusterSpec(nodes=1, workers_per_node=2, inter_node_bandwidth="1gbit", servers_per_node=1)


def measure_fp16_rivals(tmp_path, model: str) -> tuple[dict, dict[str, str], dict]:
    """Every fp16 rival of ``model`` (plus Horovod's fp16 row even where it is known not to run, and
    plain Horovod after it), measured in one job with 1 + 3 steps each."""
    variables = describe(model)
    candidates, not_runnable = rivals(variables, SPEC, horovod=True, fp16=True)
    schedule = [c for c in candidates if rival_levers(c.kind)]
    if all(c.kind != HOROVOD_FP16_KIND for c in schedule):
        schedule.append(Candidate(kind=HOROVOD_FP16_KIND, strategy=None))
    schedule.append(Candidate(kind=HOROVOD_KIND, strategy=None))
    protocol = TrialProtocol(warmup_steps=1, timed_steps=3, trial_timeout_s=90, start_timeout_s=180)
    with TrialStore(tmp_path / "trials.db") as store, HostsTarget(SPEC, hosts="localhost:2") as target:
        runner = TrialRunner(model=model, description_id=f"{model}-0", target=target, store=store,
                             protocol=protocol, workdir=str(tmp_path), workload=ZooWorkload(model))
        summary = runner.run(schedule)
        return {r.kind: r for r in store.trials()}, not_runnable, {"summary": summary, "variables": variables}


def test_fp16_rivals_of_a_dense_model_validate_and_run(tmp_path):
    records, not_runnable, info = measure_fp16_rivals(tmp_path, "resnet")
    assert not_runnable == {}
    twins = {"baseline:allreduce-fp16", "baseline:horovod-hierarchical-fp16"}
    assert twins <= set(records) and HOROVOD_FP16_KIND in records
    for kind, record in records.items():
        assert record.status == "ok", (kind, record.reason)
        assert len(record.step_times) == 4 and record.median_s > 0
        if record.strategy is not None:
            strategy = Strategy.from_dict(record.strategy)
            strategy.validate_for(info["variables"])
            assert all(strategy.config_for(name).compression == "fp16" for name in info["variables"])
    assert info["summary"].jobs == 1


def test_fp16_rivals_of_a_sparse_model_run_where_horovod_fp16_can_and_are_refused_where_not(tmp_path):
    records, not_runnable, info = measure_fp16_rivals(tmp_path, "ncf")
    assert set(not_runnable) == {HOROVOD_FP16_KIND, "baseline:allreduce-fp16"}
    assert "sparse gradients" in not_runnable[HOROVOD_FP16_KIND]
    refused = records[HOROVOD_FP16_KIND]
    assert refused.status == "failed" and "not runnable" in refused.reason and "sparse" in refused.reason
    assert records[HOROVOD_KIND].status == "ok", "the job went on after the refusal"
    for kind in ("baseline:horovod-hierarchical-fp16", "baseline:parallax-fp16"):
        assert records[kind].status == "ok", records[kind].reason
        strategy = Strategy.from_dict(records[kind].strategy)
        strategy.validate_for(info["variables"])
        for name, variable in info["variables"].items():  # fp16 on every dense gradient, none on sparse ones
            assert (strategy.config_for(name).compression == "fp16") != variable.sparse
    assert info["summary"].jobs == 1
