"""What the measurements allow a simulator to score: trial-to-trial noise, the perfect simulator's
ceiling under it, and the learned part's training rows (``Simulator.training_frame``)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hybridsync.model.analytic import CostConstants
from hybridsync.model.evaluate import noise_ceiling, repeat_pairs, repeatability, score
from hybridsync.model.simulator import Sample, Simulator
from hybridsync.strategy import Strategy, VarConfig
from test_simulator import CLUSTER, FAST_PARAMS, describe, synthetic_samples

pytestmark = pytest.mark.unit


def test_repeat_pairs_are_the_trials_of_one_job_a_simulator_cannot_tell_apart():
    desc = describe("m", [(256, 64), (64,), (128, 128)])
    ring = Strategy(variables={name: VarConfig(route="allreduce") for name in desc.variables})
    hier = Strategy(variables={name: VarConfig(route="allreduce", algorithm="hierarchical") for name in desc.variables})
    fp16 = Strategy(variables={name: VarConfig(route="allreduce", compression="fp16") for name in desc.variables})

    def trial(strategy, step_s, job):
        return Sample(model="m", description=desc, cluster=CLUSTER, strategy=strategy, step_s=step_s, job=job)
    samples = [trial(None, 0.10, "a"), trial(ring, 0.12, "a"), trial(hier, 0.20, "a"), trial(hier, 0.25, "a"),
               trial(fp16, 0.09, "a"), trial(None, 0.30, "b")]
    # plain Horovod encodes as every variable on the ring; a strategy measured twice is a repeat;
    # the same strategy in another job is not (jobs have levels of their own)
    assert sorted(repeat_pairs(samples)) == [(0, 1), (2, 3)]
    repeats = repeatability(samples)
    logs = np.log([0.10 / 0.12, 0.20 / 0.25])
    assert repeats.pairs == 2 and repeats.sigma == pytest.approx(logs.std() / np.sqrt(2))
    assert repeats.worst_ratio == pytest.approx(1.25)
    assert repeatability([samples[i] for i in (0, 2, 4, 5)]) is None


def test_a_perfect_simulators_ceiling_falls_as_the_noise_grows():
    samples = [dataclasses.replace(s, job=f"job{i % 4}") for i, s in enumerate(synthetic_samples(seed=3, per_model=12))]
    exact = noise_ceiling(samples, 0.0)
    assert exact.pairwise == 1.0 and exact.top1_regret == 0.0 and exact.mape == 0.0
    small, large = noise_ceiling(samples, 0.05, seed=1), noise_ceiling(samples, 0.3, seed=1)
    assert 1.0 > small.pairwise > large.pairwise and small.mape < large.mape
    assert large.top1_regret > 0.0 and large.trials == len(samples)
    assert noise_ceiling(samples, 0.3, seed=1).to_dict() == large.to_dict()  # seeded
    with pytest.raises(ValueError, match="sigma"):
        noise_ceiling(samples, -0.1)


def test_training_frame_is_what_the_trees_are_fit_on():
    import xgboost

    samples = [dataclasses.replace(s, job=f"job{i % 3}") for i, s in enumerate(synthetic_samples(seed=5, per_model=10))]
    simulator = Simulator(constants=CostConstants(cores=2), params=FAST_PARAMS).fit(samples, refit_constants=False)
    features, target = simulator.training_frame(samples)
    assert features.shape == (len(samples), len(simulator.feature_names))
    jobs = np.array([(s.model, s.cluster.nodes, s.job) for s in samples], dtype=object)
    for key in {tuple(j) for j in jobs}:  # centered within each job (of one model and cluster)
        mine = np.array([tuple(j) == key for j in jobs])
        assert abs(target[mine].mean()) < 1e-9
    again = xgboost.train(FAST_PARAMS.xgboost(), xgboost.DMatrix(features, label=target), FAST_PARAMS.rounds)
    data = xgboost.DMatrix(features, feature_names=simulator.feature_names)
    assert np.allclose(again.predict(xgboost.DMatrix(features)), simulator.booster.predict(data))


def test_top5_regret_is_the_best_of_the_five_trials_predicted_fastest():
    measured = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    best_sixth = np.array([6.0, 1.0, 2.0, 3.0, 4.0, 5.0, 7.0])  # the fastest trial predicted 6th of 7
    m = score(best_sixth, measured, ["g"] * 7)
    assert m.top1_regret == pytest.approx(1.0) and m.top5_regret == pytest.approx(1.0)
    best_third = score(np.array([3.0, 1.0, 2.0, 4.0, 5.0, 6.0, 7.0]), measured, ["g"] * 7)
    assert best_third.top1_regret == pytest.approx(1.0) and best_third.top5_regret == 0.0
    # per job, weighted by its trials, like top-1: a 2-trial job's top 5 holds its best
    two_jobs = score(np.concatenate([best_sixth, [2.0, 1.0]]), np.concatenate([measured, [1.0, 2.0]]),
                     ["a"] * 7 + ["b"] * 2)
    assert two_jobs.top1_regret == pytest.approx(1.0) and two_jobs.top5_regret == pytest.approx(7 / 9)
