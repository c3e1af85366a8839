"""Trial jobs measured again (``hybridsync.trials.remeasure``, ``hybridsync dataset remeasure``).

Unit: which jobs a window selects, a job's lineup (candidates, controls, protocol), replacing a job's
trials in one transaction, refusing a description with other variables. Multiprocess: a real job
(``hybridsync trials run -H localhost:2``) measured again by the command, its trials replaced.
"""
from __future__ import annotations

import dataclasses
import json
import sqlite3
import uuid
from pathlib import Path

import pytest

from conftest import BIN, REPO, run_job
from hybridsync.cli import main as cli_main
from hybridsync.cluster.spec import ClusterSpec
from hybridsync.description import description_id, load_description
from hybridsync.strategy import Strategy
from hybridsync.trials.remeasure import description_for, jobs_started_between
from hybridsync.trials.store import TrialRecord, TrialStore

CLUSTER = {"nodes": 2, "workers_per_node": 2, "inter_node_bandwidth": "1gbit", "servers_per_node": 1}
STRATEGY = {"version": 1, "default": {"route": "allreduce"}, "variables": {}}


def record(job: str, kind: str, started: str, *, model: str = "ncf", desc: str = "old-desc", fingerprint: str = "",
           status: str = "ok", strategy: dict | None = STRATEGY) -> TrialRecord:
    """A trial of ``job`` (2 warm-up, 3 timed steps of 0.1 s) that started at ``started`` (UTC)."""
    uid = uuid.uuid4().hex
    return TrialRecord(uid=uid, model=model, description_id=desc, cluster=dict(CLUSTER), kind=kind, strategy=strategy,
                       fingerprint=fingerprint or uid[:16], status=status, reason=None if status == "ok" else "hung",
                       warmup_steps=2, step_times=[0.5, 0.3, 0.1, 0.1, 0.1] if status == "ok" else [],
                       versions={}, started=f"2026-11-25T{started}:00.000+00:00",
                       finished=f"2026-11-25T{started}:30.000+00:00", host="h", job=job)


def windowed_store(url: str) -> dict[str, list[TrialRecord]]:
    """Three jobs: ncf at 16:10 (a control re-measured twice, one candidate failed), vgg at 17:00, ncf at 22:00."""
    jobs = {
        "ncf-loaded": [record("ncf-loaded", "horovod", "16:10", fingerprint="horovod", strategy=None),
                       record("ncf-loaded", "control:baseline:allreduce", "16:11", fingerprint="allreduce"),
                       record("ncf-loaded", "random", "16:12", fingerprint="r1"),
                       record("ncf-loaded", "control:baseline:allreduce", "16:13", fingerprint="allreduce"),
                       record("ncf-loaded", "random", "16:14", fingerprint="r2", status="failed")],
        "vgg-loaded": [record("vgg-loaded", "horovod", "17:00", model="vgg", desc="vgg-desc", strategy=None,
                              fingerprint="horovod")],
        "ncf-quiet": [record("ncf-quiet", "random", "22:00", desc="other-desc")],
    }
    ncf = load_description(REPO / "data" / "descriptions" / "ncf.json").to_dict()
    with TrialStore(url) as store:
        for desc in ("old-desc", "other-desc", "vgg-desc"):
            store.add_description(desc, "vgg" if desc == "vgg-desc" else "ncf", ncf)
        for records in jobs.values():
            for r in records:
                store.add(r)
    return jobs


@pytest.mark.unit
def test_a_window_selects_jobs_by_their_first_trial_and_a_job_keeps_its_lineup(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/t.db"
    windowed_store(url)
    with TrialStore(url) as store:
        jobs = jobs_started_between(store, "2026-11-25T16:00", "2026-11-25T21:30")
        assert [j.job for j in jobs] == ["ncf-loaded", "vgg-loaded"]
        assert [j.job for j in jobs_started_between(store, "2026-11-25T16:00", "2026-11-25T21:30", models=["ncf"])] \
            == ["ncf-loaded"]
        assert [j.job for j in jobs_started_between(store, "2026-11-25T16:11", "2026-11-25T22:00")] \
            == ["vgg-loaded", "ncf-quiet"]  # a job that started before the window is not in it
        with pytest.raises(ValueError, match="starts after it ends"):
            jobs_started_between(store, "2026-11-26", "2026-11-25")
    job = jobs[0]
    candidates = job.candidates()  # the failed one too: the lineup as it ran, but the controls
    assert [c.kind for c in candidates] == ["horovod", "random", "random"]
    assert candidates[0].strategy is None and candidates[1].strategy == Strategy.from_dict(STRATEGY)
    assert [c.kind for c in job.controls()] == ["baseline:allreduce"]  # once, though measured twice
    protocol = job.protocol()
    assert (protocol.warmup_steps, protocol.timed_steps) == (2, 3)  # from a trial that succeeded
    assert job.cluster == ClusterSpec.from_dict(CLUSTER) and job.model == "ncf" and job.description_id == "old-desc"


@pytest.mark.unit
def test_replacing_a_job_swaps_its_trials_in_one_transaction(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/t.db"
    jobs = windowed_store(url)
    new = [record("ncf-again", "horovod", "23:00", desc="new-desc", fingerprint="horovod", strategy=None),
           record("ncf-again", "random", "23:01", desc="new-desc", fingerprint="r1")]
    with TrialStore(url) as store:
        store.add_description("new-desc", "ncf", {"variables": []})
        assert store.replace_job("ncf-loaded", new) == 5
        assert {r.job for r in store.trials()} == {"ncf-again", "vgg-loaded", "ncf-quiet"}
        assert sorted(r.uid for r in store.trials() if r.job == "ncf-again") == sorted(r.uid for r in new)
        assert set(store.descriptions()) == {"new-desc", "other-desc", "vgg-desc"}  # no trial names old-desc now
        with pytest.raises(ValueError, match="no trial of job 'ncf-loaded'"):
            store.replace_job("ncf-loaded", new)
        before = sorted(r.uid for r in store.trials())
        clash = [record("vgg-again", "horovod", "23:05", model="vgg", desc="vgg-desc"), jobs["ncf-quiet"][0]]
        with pytest.raises(ValueError, match="already in the store"):
            store.replace_job("vgg-loaded", clash)
        assert sorted(r.uid for r in store.trials()) == before  # rolled back: the vgg job is still there


@pytest.mark.unit
def test_a_new_description_must_describe_the_variables_the_job_ran_with(tmp_path: Path, capsys) -> None:
    url = f"sqlite:///{tmp_path}/t.db"
    windowed_store(url)
    ncf = load_description(REPO / "data" / "descriptions" / "ncf.json")
    first = next(iter(ncf.variables.values()))
    wider = dataclasses.replace(ncf, variables={**ncf.variables, first.name: dataclasses.replace(
        first, shape=(first.shape[0] + 1, *first.shape[1:]))})
    with TrialStore(url) as store:
        job = jobs_started_between(store, "2026-11-25T16:00", "2026-11-25T16:30")[0]
        assert description_for(store, job, None)[0] == "old-desc"
        assert description_for(store, job, ncf) == (description_id(ncf), ncf.to_dict())
        with pytest.raises(ValueError, match=f"variable '{first.name}': shape"):
            description_for(store, job, wider)
    assert cli_main(["dataset", "remeasure", "--from", "2026-11-25T16:00", "--to", "2026-11-25T21:30", "--store", url,
                     "--workdir", str(tmp_path / "w"), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1:3] for line in lines] == [["ncf-loaded", "ncf"], ["vgg-loaded", "vgg"]]
    assert lines[0].endswith("5 trials -> description old-desc")


@pytest.mark.multiprocess
def test_remeasure_runs_a_stored_jobs_lineup_again_and_replaces_its_trials(tmp_path: Path) -> None:
    """A real job of ncf on this host (2 ranks, 1 server; a control between the candidates), then
    ``dataset remeasure`` over its window: one new job with the same lineup, the old trials gone,
    and the window empty when run again."""
    spec = tmp_path / "cluster.yaml"
    spec.write_text("nodes: 1\nworkers_per_node: 2\ninter_node_bandwidth: 1gbit\nservers_per_node: 1\n")
    strategies = tmp_path / "candidates.json"
    strategies.write_text(json.dumps([
        {"kind": "horovod", "strategy": None},
        {"kind": "ring", "strategy": {"version": 1, "default": {"route": "allreduce"}}},
        {"kind": "mixed", "strategy": {"version": 1, "default": {"route": "allreduce"},
                                       "variables": {"gmf_user.weight": {"route": "ps"}}}}]))
    store = f"sqlite:///{tmp_path / 'trials.db'}"
    first = run_job([str(BIN / "hybridsync"), "trials", "run", "--model", "ncf", "--cluster", str(spec), "-H",
                     "localhost:2", "--strategies", str(strategies), "--store", store, "--warmup", "1", "--steps", "3",
                     "--controls", "1", "--trial-timeout", "60", "--settle-s", "0", "--workdir", str(tmp_path / "first")],
                    timeout=300)
    assert first.returncode == 0, first.stdout[-4000:]
    with TrialStore(store) as trials:
        old = trials.trials()
    window = (min(r.started for r in old), max(r.finished for r in old))
    argv = [str(BIN / "hybridsync"), "dataset", "remeasure", "--from", window[0], "--to", window[1], "--store", store,
            "-H", "localhost:2", "--trial-timeout", "60", "--workdir", str(tmp_path / "again")]
    again = run_job(argv, timeout=300)
    assert again.returncode == 0, again.stdout[-4000:]
    with TrialStore(store) as trials:
        new = trials.trials()
    assert len({r.job for r in old}) == 1 and len({r.job for r in new}) == 1 and new[0].job != old[0].job
    assert sorted((r.kind, r.fingerprint) for r in new if not r.kind.startswith("control:")) == \
        sorted((r.kind, r.fingerprint) for r in old if not r.kind.startswith("control:"))
    assert {r.fingerprint for r in new if r.kind.startswith("control:")} == {"horovod"}
    assert all(r.status == "ok" and r.warmup_steps == 1 and len(r.step_times) == 4 for r in new)
    assert min(r.started for r in new) > window[1]
    assert f"ncf on 1x2@1gbit+1ps: job {old[0].job} -> {new[0].job}" in again.stdout
    for job, line in ((first, "trials: 3/3 trials"), (again, "remeasure: 3/3 trials")):  # a log: lines, no redraws
        assert line in job.stdout and "\r" not in job.stdout, job.stdout[-2000:]
    assert sqlite3.connect(tmp_path / "trials.db").execute("SELECT count(*) FROM descriptions").fetchone() == (1,)
    rerun = run_job(argv, timeout=60)
    assert rerun.returncode == 0 and "no job of" in rerun.stdout, rerun.stdout
