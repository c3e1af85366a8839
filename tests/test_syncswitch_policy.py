"""Sync-Switch policies without processes: the ``sync`` section's validation, the elastic policy's
decisions on step-report traces (stragglers, noise that must not flap it), the servers'
coordinator and log, the offline search for the switch point.
"""
from __future__ import annotations

import numpy as np
import pytest

import syncswitch_traces
from hybridsync.backends.ps.coordinator import SwitchCoordinator
from hybridsync.strategy import Strategy
from hybridsync.sync_policy import ElasticPolicy, SyncPolicy
from hybridsync.syncswitch.tune import search_switch_fraction, switch_strategy

PS = {"route": "ps"}


def _strategy(sync: dict, default: dict = PS, variables: dict | None = None) -> Strategy:
    return Strategy.from_dict({"version": 1, "default": default, "variables": variables or {}, "sync": sync})


# --- the strategy's ``sync`` section ---------------------------------------------------------------

@pytest.mark.unit
def test_policies_round_trip_and_static_is_the_absent_section():
    switch = _strategy({"policy": "switch", "switch_at": 0.25, "total_steps": 400, "momentum_scale": 0.5})
    assert Strategy.from_dict(switch.to_dict()) == switch
    assert switch.sync.switch_step() == 100 and switch.sync.scale("lr_scale", 8) == 1 / 8
    assert _strategy({"policy": "switch", "switch_at": 30}).sync.switch_step() == 30
    elastic = _strategy({"policy": "elastic", "enter_slowdown": 2.5})
    assert elastic.to_dict()["sync"] == {"policy": "elastic", "enter_slowdown": 2.5}
    static = _strategy({"policy": "static"})
    assert "sync" not in static.to_dict() and static.fingerprint() == Strategy.from_dict({"default": PS}).fingerprint()


@pytest.mark.unit
def test_the_plan_between_switches_moves_every_ps_variable_and_keeps_the_rest():
    strategy = _strategy({"policy": "elastic"}, variables={"w": {"route": "allreduce"}, "b": {"route": "ps",
                                                                                          "partitions": 2}})
    asp = strategy.with_ps_protocol("asp")
    assert asp.default.protocol == "asp" and asp.variables["b"].protocol == "asp"
    assert asp.variables["b"].partitions == 2 and asp.variables["w"].route == "allreduce" and asp.sync is None


@pytest.mark.unit
@pytest.mark.parametrize("sync, culprit", [
    ({"policy": "sometimes"}, "sync.policy 'sometimes' is not one of static, switch, elastic"),
    ({"policy": "switch"}, "sync.switch_at is required"),
    ({"policy": "switch", "switch_at": 0.5}, "sync.switch_at 0.5 is a fraction: it needs total_steps"),
    ({"policy": "switch", "switch_at": 1.5, "total_steps": 10}, "sync.switch_at as a fraction must be in (0, 1)"),
    ({"policy": "switch", "switch_at": 0}, "sync.switch_at must be >= 1"),
    ({"policy": "switch", "switch_at": "half"}, "sync.switch_at must be a step count or a fraction"),
    ({"policy": "switch", "switch_at": 5, "lr_scale": 0}, "sync.lr_scale must be a number > 0 or '1/n'"),
    ({"policy": "switch", "switch_at": 5, "momentum_scale": "x"}, "sync.momentum_scale must be a number >= 0"),
    ({"policy": "switch", "switch_at": 5, "window": 3}, "sync.window is not a key of policy 'switch'"),
    ({"policy": "elastic", "switch_at": 5}, "sync.switch_at is not a key of policy 'elastic'"),
    ({"policy": "elastic", "enter_slowdown": 0.5}, "sync.enter_slowdown must be a number >= 1"),
    ({"policy": "elastic", "exit_slowdown": 2.1}, "sync.exit_slowdown (2.1) must be below enter_slowdown (2.0)"),
    ({"policy": "elastic", "enter_after": 0}, "sync.enter_after must be an integer >= 1"),
    ("elastic", "sync: expected a mapping"),
])
def test_bad_policy_values_name_the_key(sync, culprit):
    with pytest.raises(ValueError, match="invalid strategy") as error:
        _strategy(sync)
    assert culprit in str(error.value)


@pytest.mark.unit
def test_a_dynamic_policy_needs_bsp_ps_variables():
    with pytest.raises(ValueError) as error:
        _strategy({"policy": "elastic"}, variables={"w": {"route": "ps", "protocol": "ssp", "staleness": 2}})
    assert "variable 'w': protocol 'ssp' conflicts with sync.policy 'elastic'" in str(error.value)
    with pytest.raises(ValueError, match="needs PS-routed variables"):
        _strategy({"policy": "switch", "switch_at": 3}, default={"route": "allreduce"})
    _strategy({"policy": "static"}, default={"route": "ps", "protocol": "asp"})  # static: anything goes


# --- the elastic policy on traces --------------------------------------------------------------------

def _compute(slow_windows: list[tuple[float, float]], *, slowdown: float = 3.0, noise: float = 0.15,
             seed: int = 0, base_s: float = 0.05):
    """Per-step compute times: worker 2 is ``slowdown`` x slower inside the windows; uniform noise."""
    rng = np.random.default_rng(seed)

    def compute(worker: int, now: float) -> float:
        slow = worker == 2 and any(start <= now < stop for start, stop in slow_windows)
        return base_s * (slowdown if slow else 1.0) * (1.0 + noise * rng.uniform(-1, 1))
    return compute


def _decisions(compute, steps: int = 400, **policy) -> list:
    elastic = ElasticPolicy(SyncPolicy(policy="elastic", **policy), num_workers=4)
    return syncswitch_traces.run(elastic, compute, steps)


@pytest.mark.unit
def test_a_straggler_while_it_lasts_goes_asp_and_back():
    decisions = _decisions(_compute([(5.0, 12.0)]))
    assert [d.protocol for _, d in decisions] == ["asp", "bsp"]
    (went, asp), (back, bsp) = decisions
    assert 5.0 < went < 6.0 and "worker2 lags" in asp.reason  # a few steps after it began
    assert 12.0 < back < 13.5 and "no straggler" in bsp.reason
    assert bsp.step > asp.step


@pytest.mark.unit
def test_a_persistent_straggler_keeps_asp():
    decisions = _decisions(_compute([(2.0, 1e9)]))
    assert [d.protocol for _, d in decisions] == ["asp"]


@pytest.mark.unit
@pytest.mark.parametrize("seed", range(5))
def test_noise_does_not_flap(seed):
    """+-30% per-step noise on every worker, plus single 4x slow steps (each worker every 17th
    step, at staggered offsets): never a switch."""
    compute = _compute([], noise=0.3, seed=seed)
    calls = [0] * 4

    def spiky(worker: int, now: float) -> float:
        calls[worker] += 1
        return compute(worker, now) * (4.0 if calls[worker] % 17 == 3 * worker + seed else 1.0)
    assert _decisions(spiky) == []


@pytest.mark.unit
def test_a_slowdown_between_the_thresholds_changes_nothing_in_either_protocol():
    """Hysteresis: a straggler computing 2x as long is a ~1.7x slowdown with the sync time:
    below enter (2.0), so BSP stays; above exit (1.3), so ASP, once entered, stays too."""
    assert _decisions(_compute([(0.0, 1e9)], slowdown=2.0, noise=0.02)) == []
    decisions = _decisions(_two_phase(first=4.0, then=2.0, change_at=6.0))
    assert [d.protocol for _, d in decisions] == ["asp"]


def _two_phase(first: float, then: float, change_at: float):
    def compute(worker: int, now: float) -> float:
        if worker != 2 or now < 2.0:
            return 0.05
        return 0.05 * (first if now < change_at else then)
    return compute


@pytest.mark.unit
def test_decisions_are_deterministic_given_the_trace():
    runs = [[(t, d) for t, d in _decisions(_compute([(5.0, 12.0)], seed=3))] for _ in range(2)]
    assert runs[0] == runs[1] and runs[0]


@pytest.mark.unit
def test_the_switch_comes_after_a_step_no_worker_had_reported():
    elastic = ElasticPolicy(SyncPolicy(policy="elastic", window=1, enter_after=1, enter_slowdown=1.5), num_workers=2)
    decision = None
    for step in range(1, 6):
        elastic.observe(0, step, step * 1.0)
        decision = decision or elastic.observe(1, step, step * 1.0 + (0.9 if step >= 3 else 0.0))
    assert decision is not None and decision.protocol == "asp" and decision.step == 5  # worker 1 reported step 4


@pytest.mark.unit
def test_an_elastic_policy_needs_two_workers_and_known_ones():
    with pytest.raises(ValueError, match=">= 2 workers"):
        ElasticPolicy(SyncPolicy(policy="elastic"), num_workers=1)
    with pytest.raises(ValueError, match="worker 5"):
        ElasticPolicy(SyncPolicy(policy="elastic"), num_workers=2).observe(5, 1, 0.0)


# --- the servers' coordinator ------------------------------------------------------------------------

@pytest.mark.unit
def test_the_coordinator_answers_every_worker_with_the_same_schedule(monkeypatch):
    clock = {"now": 0.0}
    monkeypatch.setattr("hybridsync.backends.ps.coordinator.time.monotonic", lambda: clock["now"])
    coordinator = SwitchCoordinator(2, "server0")
    doc = {"policy": "elastic", "window": 1, "enter_after": 1, "enter_slowdown": 1.5}
    schedules = []
    for step in range(1, 6):
        for worker, lag in ((0, 0.0), (1, 0.9 if step >= 3 else 0.0)):
            clock["now"] = step + lag
            schedules.append(coordinator.report("opt0", doc, worker, step))
    assert schedules[-1] == [(5, "asp", schedules[-1][0][2])] and "worker1 lags" in schedules[-1][0][2]
    assert coordinator.report("opt1", doc, 0, 1) == []  # another job, its own policy


@pytest.mark.unit
def test_the_server_logs_a_switch_once_every_worker_made_it(capsys):
    coordinator = SwitchCoordinator(2, "server0")
    coordinator.switched("opt0", 0, 0, 7, "asp", "why")
    assert coordinator.events == []
    coordinator.switched("opt0", 1, 0, 7, "asp", "why")
    assert coordinator.events == [{"job": "opt0", "index": 0, "step": 7, "protocol": "asp", "reason": "why",
                                   "worker_steps": {0: 7, 1: 7}}]
    assert "all 2 workers switched job opt0 to asp after step 7 (why)" in capsys.readouterr().out


# --- choosing the switch point offline ---------------------------------------------------------------

@pytest.mark.unit
def test_the_search_finds_the_smallest_fraction_that_keeps_bsp_accuracy():
    accuracy = {1.0: 0.95, 0.05: 0.90, 0.1: 0.93, 0.2: 0.948, 0.3: 0.951, 0.5: 0.95}
    asked = []

    def measure(fraction: float):
        asked.append(fraction)
        return accuracy[fraction], 10 * fraction
    result = search_switch_fraction([0.5, 0.05, 0.3, 0.1, 0.2], measure, tolerance=0.005)
    assert result.fraction == 0.2 and result.reference_accuracy == 0.95
    assert len(asked) == 1 + 3  # BSP, then a binary search over 5 candidates


@pytest.mark.unit
def test_the_tuned_strategy_carries_the_switch_policy():
    strategy = switch_strategy(Strategy.from_dict({"default": PS}), 0.25, 400)
    assert strategy.to_dict()["sync"] == {"policy": "switch", "switch_at": 0.25, "total_steps": 400}
    with pytest.raises(ValueError, match="fractions must be in"):
        search_switch_fraction([1.5], lambda f: (1.0, 1.0))
