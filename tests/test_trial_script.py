"""Trials inside a user's script (hybridsync.hooks.trials) under a real 2-rank job."""
from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO
from hybridsync.cluster.spec import ClusterSpec
from hybridsync.strategy import Strategy
from hybridsync.trials.candidates import Candidate
from hybridsync.trials.jobs import HostsTarget
from hybridsync.trials.runner import ScriptWorkload, TrialProtocol, TrialRunner
from hybridsync.trials.store import TrialStore

pytestmark = pytest.mark.multiprocess

SPEC = ClusterSpec(nodes=1, workers_per_node=2, inter_node_bandwidth="1gbit", servers_per_node=1)
SCRIPT = str(REPO / "tests" / "workers" / "tiny_train.py")
STRATEGIES = {
    "ring": {"version": 1, "default": {"route": "allreduce"}},
    "ps": {"version": 1, "default": {"route": "ps"}},
    "refused": {"version": 1, "variables": {"no_such.weight": {"route": "ps"}}},
    "grouped": {"version": 1, "default": {"route": "allreduce", "group": 0}},
    "mixed": {"version": 1, "default": {"route": "allreduce"}, "variables": {"0.weight": {"route": "ps"}}},
}


def run_script_trials(tmp_path, steps_per_run: int, controls: tuple[str, ...] = (), strategies: dict = STRATEGIES,
                      script_args: tuple[str, ...] = (), script: tuple[str, ...] = (SCRIPT,)) -> tuple[dict, object]:
    candidates = [Candidate(kind="drop-in", strategy=None)] + [
        Candidate(kind=kind, strategy=Strategy.from_dict(doc)) for kind, doc in strategies.items()]
    # settle_s=0: these tests compare no step time (the settle has its own test below)
    protocol = TrialProtocol(warmup_steps=1, timed_steps=3, trial_timeout_s=60, start_timeout_s=120, settle_s=0.0)
    with TrialStore(tmp_path / "trials.db") as store, HostsTarget(SPEC, hosts="localhost:2") as target:
        runner = TrialRunner(model="tiny", description_id="tiny-0", target=target, store=store, protocol=protocol,
                             workdir=str(tmp_path), workload=ScriptWorkload((sys.executable, *script, "--steps",
                                                                             str(steps_per_run), *script_args)))
        summary = runner.run(candidates, controls=[c for c in candidates if c.kind in controls], block_size=3)
        if controls:
            return {"kinds": sorted(r.kind for r in store.trials() if r.status == "ok" or r.kind == "refused"),
                    "schedules": [[json.loads(line)["kind"] for line in path.read_text().splitlines()]
                                  for path in sorted(tmp_path.glob("*.schedule.jsonl"))]}, summary
        return {r.kind: r for r in store.trials()}, summary


def test_the_optimizer_measures_every_strategy_of_the_schedule_in_one_run(tmp_path):
    records, summary = run_script_trials(tmp_path, steps_per_run=1000)
    assert set(records) == {"drop-in", *STRATEGIES}
    for kind in ("drop-in", "ring", "ps", "grouped", "mixed"):
        assert records[kind].status == "ok", records[kind].reason
        assert len(records[kind].step_times) == 4 and records[kind].median_s > 0
    assert records["refused"].status == "failed" and "no_such.weight" in records["refused"].reason
    assert summary.jobs == 1 and summary.measured == 5 and summary.failed == 1


def test_a_script_with_two_optimizers_runs_each_trials_strategy_in_both(tmp_path):
    """A trial's strategy is for the whole model: the optimizer of the second layer (built last,
    stepped first) takes its part at its own step's end, PS included; a part only it refuses (more
    shards than its bias has rows) fails that trial, and the next trials still run."""
    strategies = {"ps-both": {"version": 1, "variables": {"0.weight": {"route": "ps"}, "2.weight": {"route": "ps"}}},
                  "refused-by-second": {"version": 1, "variables": {"2.bias": {"route": "allreduce", "partitions": 2}}},
                  "mixed": STRATEGIES["mixed"] | {"variables": {"0.weight": {"route": "ps"},
                                                               "2.weight": {"route": "allreduce", "compression": "fp16"}}}}
    records, summary = run_script_trials(tmp_path, steps_per_run=1000, strategies=strategies,
                                         script_args=("--two-optimizers",))
    assert {kind: r.status for kind, r in records.items()} == {"drop-in": "ok", "ps-both": "ok",
                                                               "refused-by-second": "failed", "mixed": "ok"}
    assert "'2.bias': partitions 2 exceeds its 1 rows" in records["refused-by-second"].reason
    assert summary.jobs == 1 and summary.measured == 3 and summary.failed == 1


def test_a_script_that_rebuilds_its_optimizer_is_measured_through_the_new_one(tmp_path):
    """The first optimizer is never stepped (the script built another over the same parameters, as
    after loading a checkpoint): the newest one times the steps, so the trials end in one job."""
    strategies = {kind: STRATEGIES[kind] for kind in ("ring", "ps", "refused")}
    records, summary = run_script_trials(tmp_path, steps_per_run=1000, strategies=strategies,
                                         script_args=("--rebuild",))
    assert {kind: r.status for kind, r in records.items()} == {"drop-in": "ok", "ring": "ok", "ps": "ok",
                                                               "refused": "failed"}
    assert summary.jobs == 1 and summary.measured == 3


def test_an_eager_tensorflow_loop_with_a_tape_per_step_is_measured_in_one_job(tmp_path, monkeypatch):
    """TensorFlow eagerly, a new ``DistributedGradientTape`` every step (as Horovod's docs show): the
    tapes share one torch optimizer, which the trials switch. Before, each step's tape built a new
    one and no trial ever ended (every hand-over restarted the trial's steps)."""
    pytest.importorskip("tensorflow", reason="TensorFlow is not installed here (scripts/bootstrap.sh installs it)")
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    strategies = {"ps": STRATEGIES["ps"],
                  "mixed": {"version": 1, "variables": {"embedding/embeddings": {"route": "ps"},
                                                        "hidden/kernel": {"route": "allreduce", "partitions": 2}}}}
    script = (str(REPO / "tests" / "workers" / "tf_train.py"), str(tmp_path / "tf"), "--impl", "hybridsync",
              "--api", "tape")
    records, summary = run_script_trials(tmp_path, steps_per_run=1000, strategies=strategies, script=script)
    assert {kind: r.status for kind, r in records.items()} == {"drop-in": "ok", "ps": "ok", "mixed": "ok"}
    assert summary.jobs == 1 and summary.measured == 3


def test_a_script_that_trains_fewer_steps_than_the_schedule_is_started_again_for_the_rest(tmp_path):
    records, summary = run_script_trials(tmp_path, steps_per_run=9)  # two trials of 4 steps per run
    assert all(records[k].status == "ok" for k in ("drop-in", "ring", "ps", "grouped", "mixed"))
    assert summary.jobs == 3, summary


def test_a_script_too_short_for_one_trial_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="ended after 3 steps.*at least 4 steps"):
        run_script_trials(tmp_path, steps_per_run=3)


def test_every_run_of_the_script_remeasures_the_controls_between_blocks(tmp_path):
    records, summary = run_script_trials(tmp_path, steps_per_run=1000, controls=("ring",))
    schedule = ["control:ring", "drop-in", "ring", "ps", "control:ring", "refused", "grouped", "mixed", "control:ring"]
    assert records["schedules"] == [schedule]
    assert records["kinds"] == sorted(schedule), "every entry measured, the controls three times"
    assert summary.jobs == 1 and summary.controls == 3 and summary.measured == 5


def test_a_script_too_short_for_the_controls_and_one_trial_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="ended after 4 steps.*at least 8 steps.*1 control trial"):
        run_script_trials(tmp_path, steps_per_run=4, controls=("ring",))


def test_the_first_trial_waits_for_the_job_to_settle(tmp_path):
    import datetime
    candidates = [Candidate(kind="ring", strategy=Strategy.from_dict(STRATEGIES["ring"]))]
    protocol = TrialProtocol(warmup_steps=1, timed_steps=3, trial_timeout_s=60, start_timeout_s=120, settle_s=3.0)
    with TrialStore(tmp_path / "trials.db") as store, HostsTarget(SPEC, hosts="localhost:2") as target:
        runner = TrialRunner(model="tiny", description_id="tiny-0", target=target, store=store, protocol=protocol,
                             workdir=str(tmp_path), workload=ScriptWorkload((sys.executable, SCRIPT, "--steps", "100")))
        assert runner.run(candidates).measured == 1
    events = [json.loads(line) for path in tmp_path.glob("*.results.jsonl") for line in path.read_text().splitlines()]
    at = {e["event"]: datetime.datetime.fromisoformat(e.get("started") or e["time"]) for e in events}
    assert (at["trial"] - at["ready"]).total_seconds() >= 3.0, "the first trial began before the job settled"
