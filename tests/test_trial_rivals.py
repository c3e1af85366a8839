"""Fair rivals in a real 2-rank job: the baselines' fp16 twins and Horovod's own fp16 optimizer run
where fp16 runs, and are refused (as a failed trial, the job going on) where Horovod's cannot; the
local step (no synchronization) is measured beside them, and really leaves the ranks apart."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridsync import envvars
from hybridsync.cluster.spec import ClusterSpec
from hybridsync.strategy import Strategy
from hybridsync.trials.candidates import Candidate, rival_levers, rivals
from hybridsync.trials.jobs import HostsTarget
from hybridsync.trials.runner import EnvWorkload, TrialProtocol, TrialRunner, ZooWorkload
from hybridsync.trials.store import HOROVOD_FP16_KIND, HOROVOD_KIND, LOCAL_KIND, TrialStore
from hybridsync.zoo import describe

pytestmark = pytest.mark.multiprocess

SPEC = ClusterSpec(nodes=1, workers_per_node=2, inter_node_bandwidth="1gbit", servers_per_node=1)


def measure_lever_rivals(tmp_path, model: str, rows: frozenset[str] = frozenset()) -> tuple[dict, dict[str, str], dict]:
    """Every fp16 rival of ``model`` (with ``rows``, its dense embeddings: the rows and rows-fp16 twins
    instead), plus Horovod's fp16 row even where it is known not to run, then the local step and plain
    Horovod, measured in one job with 1 + 3 steps each; ``info`` holds each kind's per-rank parameter
    sums after its trial (``replica_sums``)."""
    variables = describe(model)
    candidates, not_runnable = rivals(variables, SPEC, horovod=True, fp16=True, rows=rows)
    schedule = [c for c in candidates if rival_levers(c.kind) and ("rows" in rival_levers(c.kind)) == bool(rows)]
    if all(c.kind != HOROVOD_FP16_KIND for c in schedule):
        schedule.append(Candidate(kind=HOROVOD_FP16_KIND, strategy=None))
    schedule += [Candidate(kind=LOCAL_KIND, strategy=None), Candidate(kind=HOROVOD_KIND, strategy=None)]
    # settle_s=0: the rivals must run and keep the ranks equal; no step time is compared
    protocol = TrialProtocol(warmup_steps=1, timed_steps=3, trial_timeout_s=90, start_timeout_s=180, settle_s=0.0)
    with TrialStore(tmp_path / "trials.db") as store, HostsTarget(SPEC, hosts="localhost:2") as target:
        runner = TrialRunner(model=model, description_id=f"{model}-0", target=target, store=store,
                             protocol=protocol, workdir=str(tmp_path),
                             workload=EnvWorkload(ZooWorkload(model), ((envvars.TRIAL_REPLICA_SUMS, "1"),)))
        summary = runner.run(schedule)
        return {r.kind: r for r in store.trials()}, not_runnable, {"summary": summary, "variables": variables,
                                                                    "sums": replica_sums(tmp_path)}


def replica_sums(workdir: Path) -> dict[str, list[float]]:
    """Kind -> every rank's sum of the trained parameters after its trial, from the jobs' files."""
    sums = {}
    for results in Path(workdir).glob("*.results.jsonl"):
        schedule = results.with_name(results.name.replace(".results.", ".schedule."))
        kinds = [json.loads(line)["kind"] for line in schedule.read_text().splitlines() if line.strip()]
        for event in map(json.loads, results.read_text().splitlines()):
            if event["event"] == "trial" and "replica_sums" in event:
                sums[kinds[event["index"]]] = event["replica_sums"]
    return sums


def assert_only_the_local_step_leaves_the_ranks_apart(records: dict, sums: dict[str, list[float]]) -> None:
    """The local step is measured like any trial, and its copies differ across ranks after it (no
    gradient was synchronized); every synchronized copy stays equal across ranks."""
    local = records[LOCAL_KIND]
    assert local.status == "ok" and len(local.step_times) == 4 and local.median_s > 0, local.reason
    assert local.strategy is None and local.fingerprint == LOCAL_KIND
    first, second = sums[LOCAL_KIND]
    assert abs(first - second) > 1e-6 * abs(first), "the ranks' local copies are equal: something synchronized them"
    synchronized = [kind for kind, record in records.items() if record.status == "ok" and kind != LOCAL_KIND]
    assert HOROVOD_KIND in synchronized and set(synchronized) <= set(sums)
    for kind in synchronized:
        assert sums[kind][0] == pytest.approx(sums[kind][1], rel=1e-9), kind


def test_fp16_rivals_of_a_dense_model_validate_and_run(tmp_path):
    records, not_runnable, info = measure_lever_rivals(tmp_path, "resnet")
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
    assert_only_the_local_step_leaves_the_ranks_apart(records, info["sums"])


def test_fp16_rivals_of_a_sparse_model_run_where_horovod_fp16_can_and_are_refused_where_not(tmp_path):
    records, not_runnable, info = measure_lever_rivals(tmp_path, "ncf")
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
    assert_only_the_local_step_leaves_the_ranks_apart(records, info["sums"])


def test_rows_twins_of_a_model_with_a_dense_embedding_run_and_keep_the_ranks_equal(tmp_path):
    from hybridsync.autotune.loop import embeddings
    from hybridsync.description import load_description
    rows = embeddings(load_description(Path(__file__).parents[1] / "data" / "descriptions" / "bert.json"))
    assert rows == {"token_embedding.weight"}
    records, not_runnable, info = measure_lever_rivals(tmp_path, "bert", rows=rows)
    assert set(not_runnable) == {"baseline:allreduce-rows-fp16"}
    twins = {kind for kind in records if kind.startswith("baseline:")}
    assert {"baseline:allreduce-rows", "baseline:parallax-rows", "baseline:horovod-hierarchical-rows-fp16"} <= twins
    for kind in twins:
        assert records[kind].status == "ok", (kind, records[kind].reason)
        strategy = Strategy.from_dict(records[kind].strategy)
        strategy.validate_for(info["variables"])
        assert [name for name in info["variables"] if strategy.config_for(name).rows] == ["token_embedding.weight"]
    assert info["summary"].jobs == 1
    assert_only_the_local_step_leaves_the_ranks_apart(records, info["sums"])
