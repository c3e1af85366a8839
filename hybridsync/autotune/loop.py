"""The autotune loop: search with the simulator, measure the most promising, refit, repeat.

One round: the evolutionary search (``hybridsync.search``) spends ``search_budget``
simulator evaluations, seeded with every baseline and the best strategies measured so
far; the ``per_round`` best predicted strategies not yet measured are run as real trials
in one job (switching in flight, ``hybridsync.trials``) and stored; the simulator is then
refit, warm-started from the shipped one with every trial of this model and cluster
(AutoSync's transfer: a few trials of a new model correct what it learned elsewhere).
The first round's job also measures the baselines and, where the workload can, plain
Horovod, so the simulator and the verdict see them from the start.

Rounds go on until ``trial_budget`` strategies have been measured (baselines included).
Then one confirmation job measures the best few measured strategies, every baseline and
plain Horovod again, interleaved and ``confirm_repeats`` times each with a longer
protocol, so the final comparison comes from one job, side by side. The winner is the
fastest of that job, baselines included: an autotuned run is never slower than the best
hand-made choice by more than that job's noise.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
import warnings
from typing import Any, Callable, Sequence

import numpy as np

from hybridsync.cluster.spec import ClusterSpec
from hybridsync.description import ModelDescription, description_id
from hybridsync.strategy import Strategy
from hybridsync.trials.candidates import Candidate, baseline_candidates
from hybridsync.trials.runner import TrialProtocol, TrialRunner
from hybridsync.trials.store import BASELINE_PREFIX, HOROVOD_KIND, TrialRecord, TrialStore

SEARCH_KIND = "search"
"""Kind of the trials the search proposed (``search:r<round>``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutotuneSettings:
    """How much the autotuner measures and searches."""

    trial_budget: int = 50
    """Distinct strategies measured as real trials, baselines and plain Horovod included."""
    per_round: int = 10
    """Search proposals measured per round (one job each round)."""
    search_budget: int = 20_000
    """Simulator evaluations the search spends per round."""
    exact: bool = False
    """Search only strategies with plain Horovod's numerics (no fp16, BSP only): ``SpaceBounds.exact``."""
    seed: int = 0
    protocol: TrialProtocol = TrialProtocol(warmup_steps=3, timed_steps=10)
    """Per search trial: the dataset's protocol, which ranks like 10 + 40 up to the noise floor."""
    confirm_top: int = 3
    """Best measured search strategies measured again in the confirmation job; as many of the
    fastest baselines (by their first measurement) join them, and plain Horovod."""
    confirm_protocol: TrialProtocol = TrialProtocol(warmup_steps=3, timed_steps=10)
    confirm_repeats: int = 4
    """Times each confirmation candidate is measured, interleaved (A B C A B C ...): on shared cores
    the step time drifts by +-15% within a job, and four short passes average that drift out
    better than two long ones for the same steps."""
    calibrate: bool = True
    """Before the first search, measure the cluster's collectives in a seconds-long job
    (``model.calibration``) so that the simulator prices its paths as measured, not as its spec says."""

    def __post_init__(self) -> None:
        if self.trial_budget < 1 or self.per_round < 1 or self.search_budget < 1:
            raise ValueError(f"trial_budget, per_round and search_budget must be >= 1; got {self.trial_budget}, "
                             f"{self.per_round}, {self.search_budget}")
        if self.confirm_top < 1 or self.confirm_repeats < 1:
            raise ValueError("confirm_top and confirm_repeats must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialOutcome:
    """One measured trial of the loop, with what the simulator predicted for it beforehand."""

    round: int
    kind: str
    fingerprint: str
    predicted_s: float | None
    measured_s: float | None
    """Median of the timed steps; ``None`` for a failed trial."""
    reason: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutotuneResult:
    """What the autotuner found: the winner, every trial, and the confirmation job's verdict."""

    model: str
    cluster: ClusterSpec
    winner_kind: str
    winner: Strategy
    """The strategy to train with (when plain Horovod wins: the empty strategy, every variable ring
    all-reduced through Horovod, which is what hybridsync does without a strategy)."""
    trials: list[TrialOutcome]
    confirmed_s: dict[str, float]
    """Kind -> median step time in the confirmation job (all repeats' timed steps)."""
    seconds: dict[str, float]
    """Wall time of each phase (search, trials, refit, confirm) and the total."""

    @property
    def best_baseline(self) -> tuple[str, float] | None:
        """The fastest hand-made strategy (a baseline or plain Horovod) in the confirmation job."""
        rivals = {k: s for k, s in self.confirmed_s.items() if k.startswith(BASELINE_PREFIX) or k == HOROVOD_KIND}
        return min(rivals.items(), key=lambda item: item[1]) if rivals else None

    def speedup_over(self, kind: str) -> float | None:
        """Confirmed step time of ``kind`` over the winner's (> 1: the winner is faster)."""
        if kind not in self.confirmed_s:
            return None
        return self.confirmed_s[kind] / self.confirmed_s[self.winner_kind]

    def best_so_far(self) -> list[float]:
        """Fastest measured step time after each trial, in the order measured (seconds)."""
        out, best = [], float("inf")
        for trial in self.trials:
            if trial.measured_s is not None:
                best = min(best, trial.measured_s)
            out.append(best)
        return out


class Autotuner:
    """Spends a trial budget on one model and cluster; ``run`` returns an ``AutotuneResult``.

    ``runner_for(protocol)`` gives a ``TrialRunner`` measuring with that protocol into a
    store (the loop's trials go to ``store``; the confirmation job to a store of its own,
    since it re-measures strategies the main store already holds). ``with_horovod``: the
    workload can measure plain ``horovod.torch.DistributedOptimizer`` (the zoo worker can).
    """

    def __init__(self, *, description: ModelDescription, cluster: ClusterSpec, store: TrialStore,
                 runner_for: Callable[[TrialProtocol, TrialStore], TrialRunner], simulator: Any = None,
                 settings: AutotuneSettings = AutotuneSettings(), with_horovod: bool = True,
                 confirm_store: TrialStore | None = None, progress: bool = True) -> None:
        from hybridsync.model.encoding import model_arrays
        from hybridsync.model.simulator import shipped_simulator
        self.description, self.cluster, self.store, self.settings = description, cluster, store, settings
        self.arrays = model_arrays(description)  # ValueError now if the description has no timing
        self.model = description.name or "model"
        self.runner_for, self.with_horovod, self.progress = runner_for, with_horovod, progress
        self.base = simulator if simulator is not None else shipped_simulator()
        self.simulator = self.base
        self.confirm_store = confirm_store
        self.rng = np.random.default_rng(settings.seed)
        self.trials: list[TrialOutcome] = []
        self.seconds = {"search": 0.0, "trials": 0.0, "refit": 0.0, "confirm": 0.0}
        check_fits(description, cluster)
        self.references = self._references()
        """Plain Horovod (when the workload can) and every baseline: measured first, and seeds of every search."""

    def run(self) -> AutotuneResult:
        start = time.monotonic()
        self.store.add_description(description_id(self.description), self.model, self.description.to_dict())
        self._calibrate()
        self._refit()  # trials of this model and cluster already in the store (a resumed run) count
        references = self.references
        round_index = 0
        while True:
            left = self.settings.trial_budget - len(self._measured())
            first = round_index == 0
            picks = self._propose(min(self.settings.per_round, left - (len(references) if first else 0)), round_index)
            batch = (references if first else []) + picks
            batch = [c for c in batch if c.fingerprint not in self._measured()]
            if not batch:
                break
            self._measure(batch, round_index)
            self._refit()
            round_index += 1
            if len(self._measured()) >= self.settings.trial_budget:
                break
        winner, confirmed = self._confirm()
        self.seconds["total"] = time.monotonic() - start
        return AutotuneResult(model=self.model, cluster=self.cluster, winner_kind=winner.kind,
                              winner=winner.strategy or Strategy(variables={}),
                              trials=list(self.trials), confirmed_s=confirmed, seconds=dict(self.seconds))

    # --- steps ------------------------------------------------------------------------------
    def _references(self) -> list[Candidate]:
        out = [Candidate(kind=HOROVOD_KIND, strategy=None)] if self.with_horovod else []
        return out + baseline_candidates(self.description.variables, self.cluster)

    def _records(self) -> list[TrialRecord]:
        return self.store.trials(model=self.model, cluster=self.cluster.to_dict())

    def _measured(self) -> set[str]:
        return {r.fingerprint for r in self._records()}

    def _propose(self, count: int, round_index: int) -> list[Candidate]:
        if count <= 0:
            return []
        started = time.monotonic()
        seeds = [c.strategy for c in self.references if c.strategy is not None]
        seeds += [s for _, s in self._best_measured(self.settings.confirm_top * 2)]
        exclude = self._measured() | {c.fingerprint for c in self.references}  # those are measured anyway
        ranked = propose(self.simulator, self.description, self.cluster, seeds=seeds, exclude=exclude,
                         count=count, budget=self.settings.search_budget, rng=self.rng, progress=self.progress,
                         exact=self.settings.exact)
        self.seconds["search"] += time.monotonic() - started
        return [Candidate(kind=f"{SEARCH_KIND}:r{round_index}", strategy=s) for _, s in ranked]

    def _measure(self, batch: list[Candidate], round_index: int) -> None:
        predicted = self.simulator.predict(self.description, self.cluster, [c.strategy for c in batch])
        started = time.monotonic()
        self.runner_for(self.settings.protocol, self.store).run(batch)
        self.seconds["trials"] += time.monotonic() - started
        by_fingerprint = {r.fingerprint: r for r in self._records()}
        for candidate, guess in zip(batch, predicted):
            record = by_fingerprint.get(candidate.fingerprint)
            ok = record is not None and record.status == "ok"
            self.trials.append(TrialOutcome(round=round_index, kind=candidate.kind, fingerprint=candidate.fingerprint,
                                            predicted_s=float(guess), measured_s=record.median_s if ok else None,
                                            reason=None if ok else (record.reason if record else "not measured")))

    def _calibrate(self) -> None:
        """The cluster's measured paths into the simulator (``settings.calibrate``); a failed
        calibration is a warning: the spec's nominal paths serve instead."""
        if not self.settings.calibrate:
            return
        from hybridsync.model.calibration import calibrate
        started = time.monotonic()
        try:
            links = calibrate(self.runner_for(self.settings.protocol, self.store).target, self.cluster)
        except RuntimeError as error:
            warnings.warn(f"calibration failed, the simulator prices the cluster from its spec: {error}",
                          RuntimeWarning, stacklevel=2)
        else:
            self.base = self.simulator = self.base.calibrated(self.cluster, links)
        self.seconds["calibrate"] = time.monotonic() - started

    def _refit(self) -> None:
        from hybridsync.model.simulator import Simulator, load_samples
        samples = load_samples(self.store, model=self.model, cluster=self.cluster.to_dict())
        if not samples:
            return
        started = time.monotonic()
        self.simulator = Simulator(kind=self.base.kind).fit(samples, base=self.base) \
            if self.base.kind != "analytic" else self.base
        self.seconds["refit"] += time.monotonic() - started

    def _best_measured(self, count: int) -> list[tuple[float, Strategy]]:
        measured = [(r.median_s, Strategy.from_dict(r.strategy)) for r in self._records()
                    if r.status == "ok" and r.strategy is not None and r.kind.startswith(SEARCH_KIND)]
        return sorted(measured, key=lambda item: item[0])[:count]

    def _confirm(self) -> tuple[Candidate, dict[str, float]]:
        """Measures the best search strategies, the baselines and Horovod again in one job; returns
        the fastest of them and every kind's median step time there."""
        contenders = [Candidate(kind=f"{SEARCH_KIND}:top{i + 1}", strategy=s)
                      for i, (_, s) in enumerate(self._best_measured(self.settings.confirm_top))]
        lineup = self._fastest_references() + contenders
        schedule = lineup * self.settings.confirm_repeats
        store = self.confirm_store or TrialStore(os.path.join(tempfile.mkdtemp(prefix="hybridsync-confirm-"), "confirm.db"))
        started = time.monotonic()
        self.runner_for(self.settings.confirm_protocol, store).run(schedule)
        self.seconds["confirm"] = time.monotonic() - started
        steps: dict[str, list[float]] = {}
        for record in store.trials(model=self.model, cluster=self.cluster.to_dict(), status="ok"):
            steps.setdefault(record.kind, []).extend(record.timed_steps)
        confirmed = {kind: statistics.median(times) for kind, times in steps.items() if times}
        if not confirmed:
            raise RuntimeError("the confirmation job measured nothing (every trial failed); see the trial logs")
        fastest = min(confirmed, key=confirmed.__getitem__)
        return next(c for c in lineup if c.kind == fastest), confirmed

    def _fastest_references(self) -> list[Candidate]:
        """Plain Horovod and the ``confirm_top`` baselines measured fastest in the first round (a
        baseline 2x slower than the best one cannot win a re-measurement; timing it would only
        lengthen the confirmation job)."""
        measured = {r.fingerprint: r.median_s for r in self._records() if r.status == "ok"}
        baselines = sorted((c for c in self.references
                            if c.kind.startswith(BASELINE_PREFIX) and c.fingerprint in measured),
                           key=lambda c: measured[c.fingerprint])
        return [c for c in self.references if c.kind == HOROVOD_KIND] + baselines[:self.settings.confirm_top]


def propose(simulator: Any, description: ModelDescription, cluster: ClusterSpec, *, seeds: Sequence[Strategy],
            exclude: set[str], count: int, budget: int, rng: np.random.Generator,
            progress: bool = True, exact: bool = False) -> list[tuple[float, Strategy]]:
    """The ``count`` strategies with the lowest predicted step time that the evolutionary search
    found in ``budget`` simulator evaluations, none of them in ``exclude`` (fingerprints);
    ``exact``: only plain Horovod's numerics (no fp16, BSP)."""
    from hybridsync.model.encoding import model_arrays
    from hybridsync.search.evolution import EvolutionarySearch, run_search, simulator_cost
    from hybridsync.search.space import bounds_for
    arrays = model_arrays(description)
    search = EvolutionarySearch(arrays, cluster, bounds_for(cluster, exact=exact), rng, seeds=seeds)
    run_search(search, simulator_cost(simulator, arrays, cluster), budget, progress=progress)
    return diverse(search.ranked(count * CANDIDATES_PER_PICK, exclude=exclude), count, list(description.variables))


CANDIDATES_PER_PICK = 20
MIN_DIFFERENT_VARIABLES = 2
"""A round's picks differ pairwise in at least this many variables' configs where the ranking
allows: the search's top strategies are mostly one-variable variations of its best, and ten
trials of nearly one strategy teach the simulator little about the rest of the space."""


def diverse(ranked: list[tuple[float, Strategy]], count: int, names: Sequence[str]) -> list[tuple[float, Strategy]]:
    """The best ``count`` of ``ranked`` (ascending cost) such that each differs from every better
    pick in ``MIN_DIFFERENT_VARIABLES`` variables; topped up in rank order if too few do."""
    picks: list[tuple[float, Strategy]] = []
    for cost, strategy in ranked:
        if len(picks) == count:
            break
        if all(sum(strategy.config_for(n) != other.config_for(n) for n in names) >= MIN_DIFFERENT_VARIABLES
               for _, other in picks):
            picks.append((cost, strategy))
    chosen = {s.fingerprint() for _, s in picks}
    picks += [(c, s) for c, s in ranked if s.fingerprint() not in chosen][:count - len(picks)]
    return sorted(picks, key=lambda item: item[0])


def check_fits(description: ModelDescription, cluster: ClusterSpec) -> None:
    """``ValueError`` now, not after a job started, if the cluster cannot run the model at all."""
    if cluster.num_workers < 2:
        raise ValueError(f"the cluster has {cluster.num_workers} worker(s); autotuning synchronization needs at "
                         f"least 2 (nodes x workers_per_node)")
    if not description.variables:
        raise ValueError(f"{description.name or 'model description'}: has no variables to synchronize")
