"""Which stored trials a later runtime revision outdates (``hybridsync.trials.revisions``), and the
simulator's samples leaving them out (``model.simulator.samples_from_records``)."""
from __future__ import annotations

import dataclasses
import uuid

import pytest

from hybridsync import baselines
from hybridsync.description import parse_description
from hybridsync.frameworks import versions
from hybridsync.model.simulator import samples_from_records
from hybridsync.trials.revisions import REVISIONS, current, outdated, revision_of
from hybridsync.trials.store import TrialRecord
from hybridsync.version import RUNTIME_REVISION

pytestmark = pytest.mark.unit

FOUR_BY_ONE = {"nodes": 4, "workers_per_node": 1, "inter_node_bandwidth": "500mbit", "servers_per_node": 1}
TWO_BY_TWO = {**FOUR_BY_ONE, "nodes": 2, "workers_per_node": 2}
DOC = {"name": "m", "variables": [{"name": "a", "shape": [256, 256]}, {"name": "b", "shape": [256]}]}
DESCRIPTION = parse_description(DOC)
BEFORE, AFTER = "2026-11-28T12:00:00.000+00:00", "2026-11-29T02:00:00.000+00:00"
OLD_VERSIONS = {"torch": "2.13.0+cpu", "horovod": "0.28.1", "hybridsync": "0.1.0"}


def trial(baseline: str | None, cluster: dict, *, started: str = BEFORE, runtime: str | None = None) -> TrialRecord:
    """A successful trial of ``baseline`` (``None``: plain Horovod) in job ``j``."""
    strategy = None if baseline is None else baselines.build_baseline(baseline, DESCRIPTION.variables, 1).to_dict()
    uid = uuid.uuid4().hex
    return TrialRecord(uid=uid, model="m", description_id="d", cluster=dict(cluster),
                       kind="horovod" if baseline is None else f"baseline:{baseline}", strategy=strategy,
                       fingerprint=uid[:16], status="ok", reason=None, warmup_steps=0, step_times=[0.1, 0.1, 0.1],
                       versions={**OLD_VERSIONS, **({"runtime": runtime} if runtime else {})},
                       started=started, finished=started, host="h", job="j")


def test_the_revisions_end_at_the_runtime_s_and_every_trial_records_it():
    assert max(r.number for r in REVISIONS) == RUNTIME_REVISION
    assert versions()["runtime"] == str(RUNTIME_REVISION)


@pytest.mark.parametrize("baseline", ["hierarchical", "horovod-hierarchical"])
def test_hierarchical_with_one_rank_per_node_measured_before_the_ring_change_is_outdated(baseline):
    old = trial(baseline, FOUR_BY_ONE)
    assert revision_of(old) == 1
    assert outdated(old).commit == "1c96d87"
    # the same strategy where hierarchical is not the ring, measured since, or recording the revision
    assert outdated(trial(baseline, TWO_BY_TWO)) is None
    assert outdated(trial(baseline, FOUR_BY_ONE, started=AFTER)) is None
    assert outdated(trial(baseline, FOUR_BY_ONE, runtime=str(RUNTIME_REVISION))) is None
    # a trial that recorded revision 1 is outdated whatever its date
    assert outdated(trial(baseline, FOUR_BY_ONE, started=AFTER, runtime="1")) is not None


def test_the_ring_and_plain_horovod_are_never_outdated_by_the_ring_change():
    assert outdated(trial("allreduce", FOUR_BY_ONE)) is None
    assert outdated(trial(None, FOUR_BY_ONE)) is None


def test_the_simulator_s_samples_leave_outdated_trials_out_and_keep_the_others_places_in_their_job():
    records = [trial(name, FOUR_BY_ONE, started=f"2026-11-28T12:00:0{i}.000+00:00")
               for i, name in enumerate([None, "hierarchical", "allreduce"])]
    kept, dropped = current(records)
    assert kept == [records[0], records[2]] and list(dropped.values()) == [1]
    samples = samples_from_records(records, {"d": DESCRIPTION})
    assert [s.kind for s in samples] == ["horovod", "baseline:allreduce"]
    assert [s.job_position for s in samples] == [0.0, 1.0]
    newer = [dataclasses.replace(r, versions={**r.versions, "runtime": "2"}) for r in records]
    assert len(samples_from_records(newer, {"d": DESCRIPTION})) == 3
