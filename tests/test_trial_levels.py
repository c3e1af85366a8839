"""Blocked measurement: the controls' schedule and the job levels fit to fake trials (unit tier)."""
from __future__ import annotations

import datetime
import uuid

import numpy as np
import pytest
from scipy.stats import kendalltau

from hybridsync.strategy import Strategy
from hybridsync.trials.candidates import Candidate
from hybridsync.trials.levels import fit_levels, fit_levels_by_group, normalize_records
from hybridsync.trials.runner import blocked_schedule, shuffled_passes
from hybridsync.trials.store import TrialRecord

pytestmark = pytest.mark.unit

CLUSTER = {"nodes": 2, "workers_per_node": 2, "inter_node_bandwidth": "1gbit", "servers_per_node": 1}
START = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
TRUE_S = {f"s{i:02d}": 0.100 + 0.003 * i for i in range(24)}
"""Each strategy's true step time: 3 ms apart, about one trial's noise (3%) at 100 ms."""
CONTROL = "s05"


def trial(fingerprint: str, job: str, minute: float, level: float, rng: np.random.Generator,
          model: str = "m", noise: float = 0.03) -> TrialRecord:
    """A fake trial of ``fingerprint`` as a job at ``level`` measures it: 3 warm-up + 10 timed steps."""
    steps = list(TRUE_S[fingerprint] * level * np.exp(rng.normal(0.0, noise, 13)))
    started = START + datetime.timedelta(minutes=minute)
    return TrialRecord(uid=uuid.uuid4().hex, model=model, description_id="d", cluster=CLUSTER, kind="search",
                       strategy=None, fingerprint=fingerprint, status="ok", reason=None, warmup_steps=3,
                       step_times=steps, versions={}, started=started.isoformat(),
                       finished=(started + datetime.timedelta(seconds=4)).isoformat(), host="h", job=job)


def blocked_job(job: str, candidates: list[str], start_minute: float, level: float, rng: np.random.Generator,
                drift_per_min: float = 0.0) -> list[TrialRecord]:
    """A job that measures the control, 4 candidates, the control, ... (as ``blocked_schedule`` orders them)."""
    order = [c.kind for c in blocked_schedule([Candidate(kind=f, strategy=None) for f in candidates],
                                              [Candidate(kind=CONTROL, strategy=None)], block_size=4)]
    return [trial(f.removeprefix("control:"), job, start_minute + i * 0.1,
                  level * np.exp(drift_per_min * i * 0.1), rng) for i, f in enumerate(order)]


def tau(ranked: list[tuple[str, float]]) -> float:
    return kendalltau([s for _, s in ranked], [TRUE_S[f] for f, _ in ranked]).statistic


def raw_ranking(records: list[TrialRecord]) -> list[tuple[str, float]]:
    best: dict[str, float] = {}
    for record in records:
        best[record.fingerprint] = min(best.get(record.fingerprint, np.inf), record.median_s)
    return sorted(best.items(), key=lambda item: item[1])


def test_the_blocked_ranking_corrects_a_job_with_a_constant_level_offset():
    rng = np.random.default_rng(0)
    names = sorted(TRUE_S)
    # round 0 measures the slower half; round 1's job runs 50% slow and measures the faster half
    records = blocked_job("round0", names[12:], 0.0, 1.0, rng) + blocked_job("round1", names[:12], 10.0, 1.5, rng)
    raw = raw_ranking(records)
    assert next(f for f, _ in raw if f != CONTROL) in names[12:], "raw ms put the slow job's faster strategies behind"
    levels = fit_levels(records)
    ranked = levels.ranked()
    assert ranked[0][0] in ("s00", "s01") and tau(ranked) > 0.85 > tau(raw)
    assert levels.jobs["round1"].level / levels.jobs["round0"].level == pytest.approx(1.5, rel=0.04)
    assert all(job.linked for job in levels.jobs.values())


def test_the_controls_take_out_a_drift_within_a_job():
    rng = np.random.default_rng(1)
    names = sorted(TRUE_S, reverse=True)
    # one job slowing down by 10% a minute over its 3.2 minutes, the slowest strategies measured first
    records = blocked_job("slowing", names, 0.0, 1.0, rng, drift_per_min=0.10)
    levels = fit_levels(records)
    assert levels.jobs["slowing"].drift_per_min == pytest.approx(0.10, abs=0.03)
    assert tau(levels.ranked()) > tau(raw_ranking(records))
    steady = fit_levels(records, drift=False)
    assert steady.jobs["slowing"].drift_per_min == 0.0


def test_a_job_linked_to_no_other_is_taken_at_face_value():
    rng = np.random.default_rng(2)
    records = [trial(f, "alone", i * 0.1, 1.2, rng) for i, f in enumerate(sorted(TRUE_S)[:5])]
    records += blocked_job("other", sorted(TRUE_S)[6:12], 5.0, 1.0, rng)
    levels = fit_levels(records)
    assert not levels.jobs["alone"].linked and levels.jobs["alone"].level == pytest.approx(1.0, abs=0.01)
    assert levels.normalized_s(records[0]) == pytest.approx(records[0].median_s, rel=0.01)


def test_normalized_records_keep_their_spread_and_each_group_is_fit_apart():
    rng = np.random.default_rng(3)
    records = (blocked_job("a", sorted(TRUE_S)[:8], 0.0, 1.0, rng)
               + blocked_job("b", sorted(TRUE_S)[8:16], 5.0, 1.5, rng))
    other_model = [trial(f, "c", i * 0.1, 3.0, rng, model="other") for i, f in enumerate(sorted(TRUE_S)[:4])]
    with pytest.raises(ValueError, match="mix models or clusters"):
        fit_levels(records + other_model)
    assert set(fit_levels_by_group(records + other_model)) == {("m", records[0].cluster_id),
                                                              ("other", records[0].cluster_id)}
    normalized = normalize_records(records + other_model)
    controls = [r for r in normalized if r.fingerprint == CONTROL]
    spread = max(r.median_s for r in controls) / min(r.median_s for r in controls)
    assert spread < 1.12, "both jobs' controls at one level (raw: 1.5x apart)"
    assert normalized[0].spread == pytest.approx(records[0].spread)


def test_a_blocked_schedule_brackets_every_block_with_the_controls():
    def c(kind: str) -> Candidate:
        return Candidate(kind=kind, strategy=Strategy.from_dict({"version": 1, "variables": {kind: {"route": "ps"}}}))
    schedule = blocked_schedule([c(f"x{i}") for i in range(5)], [c("a"), c("b")], block_size=2)
    assert [s.kind for s in schedule] == ["control:a", "control:b", "x0", "x1", "control:a", "control:b", "x2", "x3",
                                          "control:a", "control:b", "x4", "control:a", "control:b"]
    assert schedule[0].fingerprint == c("a").fingerprint
    assert blocked_schedule([c("x")], []) == [c("x")] and blocked_schedule([], [c("a")]) == []
    with pytest.raises(ValueError, match="block_size"):
        blocked_schedule([c("x")], [c("a")], block_size=0)


def test_a_recheck_in_another_job_takes_back_most_of_the_apparent_best_s_luck():
    """The best of 20 strategies measured once each (11% noise per trial, as in the autotune's trial
    jobs) looks faster than it is (the winner's curse); a second measurement in another job, as the
    autotune's rechecks do, takes most of that luck back: the levels fit pools both."""
    names = sorted(TRUE_S)[:21]
    before, after = [], []
    for seed in range(20):
        rng = np.random.default_rng(100 + seed)

        def lucky(fingerprint: str, job: str, minute: float) -> TrialRecord:
            return trial(fingerprint, job, minute, float(np.exp(rng.normal(0.0, 0.11))), rng, noise=0.0)
        order = [c.kind.removeprefix("control:") for c in blocked_schedule(
            [Candidate(kind=f, strategy=None) for f in names[1:]], [Candidate(kind=names[0], strategy=None)], 4)]
        records = [lucky(f, "round", i * 0.1) for i, f in enumerate(order)]
        apparent = [f for f, _ in fit_levels(records).ranked() if f != names[0]][:3]
        before.append(np.mean([fit_levels(records).strategy_s[f] / TRUE_S[f] for f in apparent]))
        order = [c.kind.removeprefix("control:") for c in blocked_schedule(
            [], [Candidate(kind=names[0], strategy=None)], rechecks=[Candidate(kind=f, strategy=None) for f in apparent])]
        records += [lucky(f, "recheck", 10.0 + i * 0.1) for i, f in enumerate(order)]
        after.append(np.mean([fit_levels(records).strategy_s[f] / TRUE_S[f] for f in apparent]))
    assert np.mean(before) < 0.95, "the apparent best three of a job look faster than they are"
    assert 1.0 - np.mean(after) < (1.0 - np.mean(before)) / 2, (np.mean(before), np.mean(after))


def test_rechecks_are_spread_over_the_passes_and_may_make_a_job_of_their_own():
    def c(kind: str) -> Candidate:
        return Candidate(kind=kind, strategy=Strategy.from_dict({"version": 1, "variables": {kind: {"route": "ps"}}}))
    schedule = blocked_schedule([c(f"x{i}") for i in range(4)], [c("a")], block_size=2, rechecks=[c("r0"), c("r1"), c("r2")])
    assert [s.kind for s in schedule] == ["control:a", "control:r0", "control:r2", "x0", "x1",
                                          "control:a", "control:r1", "x2", "x3", "control:a"]
    alone = blocked_schedule([], [c("a")], rechecks=[c("r0")])
    assert [s.kind for s in alone] == ["control:a", "control:r0", "control:a"]
    assert [s.kind for s in blocked_schedule([], [], rechecks=[c("r0")])] == ["control:r0"]


def test_shuffled_passes_measure_each_strategy_once_per_pass_after_varying_neighbours():
    lineup = [Candidate(kind=f"k{i}", strategy=None) for i in range(6)]
    schedule = shuffled_passes(lineup, 4, np.random.default_rng(0))
    passes = [schedule[i:i + 6] for i in range(0, 24, 6)]
    assert all(sorted(c.kind for c in one) == [c.kind for c in lineup] for one in passes)
    predecessors = {(a.kind, b.kind) for a, b in zip(schedule, schedule[1:])}
    assert len(predecessors) > 10, "a fixed order would repeat the same 5 neighbour pairs"
    with pytest.raises(ValueError, match="repeats"):
        shuffled_passes(lineup, 0, np.random.default_rng(0))


def test_both_workloads_pass_the_settle_time_on_and_a_negative_one_is_refused():
    from hybridsync import envvars
    from hybridsync.trials.runner import ScriptWorkload, TrialProtocol, ZooWorkload
    protocol = TrialProtocol(settle_s=2.5)
    command, _ = ZooWorkload("ncf").job("s.jsonl", "r.jsonl", protocol, 0)
    assert command[command.index("--settle-s") + 1] == "2.5"
    _, env = ScriptWorkload(("python", "train.py")).job("s.jsonl", "r.jsonl", protocol, 0)
    assert env[envvars.TRIALS_SETTLE_S] == "2.5"
    with pytest.raises(ValueError, match="settle_s"):
        TrialProtocol(settle_s=-1)


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_a_bad_settle_time_for_a_script_names_the_variable(monkeypatch, value):
    from hybridsync import envvars
    from hybridsync.hooks.trials import from_environment
    monkeypatch.setenv(envvars.TRIALS, "schedule.jsonl")
    monkeypatch.setenv(envvars.TRIALS_RESULTS, "results.jsonl")
    monkeypatch.setenv(envvars.TRIALS_SETTLE_S, value)
    with pytest.raises(ValueError, match=envvars.TRIALS_SETTLE_S):
        from_environment(optimizer=None, hvd=None)
