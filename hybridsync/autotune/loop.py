"""The autotune loop: search with the simulator, measure the most promising, refit, repeat.

One round: the evolutionary search (``hybridsync.search``) spends ``search_budget``
simulator evaluations, seeded with every baseline, the hand-made mixes of
``hybridsync.search.seeds`` and the best strategies measured so far; the ``per_round`` best
predicted strategies not yet measured are run as real trials in one job (switching in flight, ``hybridsync.trials``) and stored; the simulator is then
refit, warm-started from the shipped one with every trial of this model and cluster
(AutoSync's transfer: a few trials of a new model correct what it learned elsewhere).
The first round's job also measures the rivals (``hybridsync.trials.candidates.rivals``:
every baseline, unless ``exact`` their fp16 twins, for a model with dense embeddings their rows
twins, and where the workload can, plain Horovod and Horovod with fp16) and the hand-made mixes
(``search:seed-<recipe>``: embeddings on the PS, dense layers merged, fp16 on the dense class...),
so the simulator and the verdict see them from the start, measured in the same jobs.

Step times of different jobs are not comparable on shared cores, so every trial job
re-measures controls between blocks of ``block_size`` candidates: the best rival so far and
the incumbent best (in the first round, the rival the simulator expects to be fastest). The
loop ranks strategies by ``hybridsync.trials.levels`` (each job's level and drift taken out),
and the simulator is refit on those normalized times. The best of many strategies measured once
is mostly the luckiest, so each job also measures again the best few search strategies measured
only once (``recheck``), and one short job after the last round does so for that round's finds
and for the rivals the confirmation may take (every trial job first waits ``TrialProtocol.settle_s``).

Rounds go on until ``trial_budget`` strategies have been measured (rivals included), or until
another round would leave too little of ``time_limit_s`` for what must follow it.
Then one confirmation job measures the best few search strategies, plain Horovod and the
fastest rivals of each kind again, ``confirm_repeats`` times each in passes of shuffled order, so the
final comparison comes from one job, side by side. The winner is the fastest of that job,
rivals included: an autotuned run is never slower than the best hand-made choice by more
than that job's noise. A search strategy beats its best fair rival only on a lead the job's
repeats resolve, or, when they do not, that a runoff job (the two alone, pass by pass) confirms;
otherwise the rival wins, and the report names the lead not taken. The
result (``hybridsync.autotune.result``) names the best fair rival and the Kendall tau of the
trials' ranking against the confirmation job's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import tempfile
import time
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from hybridsync import baselines
from hybridsync.autotune.progress import AutotuneProgress
from hybridsync.autotune.result import (MIN_RUNOFF_PASSES, RESOLVED_P, AutotuneResult, TrialOutcome, fair_rivals,
                                        paired_p, repeats_p)
from hybridsync.cluster.spec import ClusterSpec
from hybridsync.description import ModelDescription, description_id
from hybridsync.strategy import Strategy
from hybridsync.trials.candidates import Candidate, is_rival, rival_levers, rivals
from hybridsync.trials.levels import JobLevels, fit_levels
from hybridsync.trials.runner import DEFAULT_BLOCK_SIZE, TrialProtocol, TrialRunner, shuffled_passes
from hybridsync.trials.store import HOROVOD_FP16_KIND, HOROVOD_KIND, TrialRecord, TrialStore, is_control

__all__ = ["AutotuneResult", "AutotuneSettings", "Autotuner", "TrialOutcome", "propose"]

SEARCH_KIND = "search"
"""Kind of the trials the search proposed (``search:r<round>``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutotuneSettings:
    """How much the autotuner measures and searches."""

    trial_budget: int = 50
    """Distinct strategies measured as real trials, rivals and plain Horovod included."""
    per_round: int = 10
    """Search proposals measured per round (one job each round)."""
    search_budget: int = 20_000
    """Simulator evaluations the search spends per round."""
    exact: bool = False
    """Search only strategies with plain Horovod's numerics (no fp16, BSP only): ``SpaceBounds.exact``;
    the rivals are then plain Horovod and the baselines, without their fp16 twins."""
    seed: int = 0
    protocol: TrialProtocol = TrialProtocol(warmup_steps=3, timed_steps=10)
    """Per search trial: the dataset's protocol, which ranks like 10 + 40 up to the noise floor."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Candidates between two passes over the controls in a trial job."""
    recheck: int = 3
    """Best search strategies measured only once that each later job measures again (and one short
    job after the last round, before the confirmation, with the rivals it may take measured once):
    the best of ~30 trials measured once is mostly the luckiest (a trial's noise is ~10% on shared
    cores); a second measurement in another job tells lucky from fast."""
    confirm_top: int = 2
    """Best measured search strategies measured again in the confirmation job; as many of the
    fastest baselines, and of their fp16 twins (by the trials), join them (with rows twins too, the
    four kinds share twice as many places), and the reference rows.
    Each costs ``confirm_repeats`` trials: at 3 the confirmation job held about a third of an
    autotune's trials, while the third-fastest of a kind by the trials never won it."""
    confirm_protocol: TrialProtocol = TrialProtocol(warmup_steps=3, timed_steps=10)
    confirm_repeats: int = 4
    """Times each confirmation candidate is measured, in passes over the lineup (each pass in its own
    random order, ``trials.runner.shuffled_passes``): on shared cores the step time drifts by +-15%
    within a job, and four short passes average that drift out better than two long ones for the
    same steps."""
    runoff_passes: int = 8
    """When a search strategy leads the confirmation job within its noise, one more job measures it and
    its best fair rival in up to this many passes (each pass both, in random order); it wins only if
    the per-pass ratios there favour it beyond the noise (``result.paired_p`` < ``RESOLVED_P``): a
    lead must hold in a second job. Pairs within a pass share the job's drift, so eight passes resolve
    a few percent where four unpaired repeats did not. 0: no runoff; else >= ``MIN_RUNOFF_PASSES``."""
    time_limit_s: float | None = 600.0
    """Wall time of the whole autotune; ``None``: no limit, the budgets alone bound it. Rounds after the
    first stop, short of ``trial_budget``, when another round, the recheck job, the
    confirmation and a runoff's fewest passes would not fit (estimated from the trial jobs' seconds per
    trial); the runoff runs as many passes as fit (its passes estimated from the confirmation job's
    seconds per trial), and none if fewer than ``MIN_RUNOFF_PASSES`` fit. On a slow model or machine a
    budget of strategies overran it, and left a lead without the runoff that could resolve it."""
    calibrate: bool = True
    """Before the first search, measure the cluster's collectives in a seconds-long job
    (``model.calibration``) so that the simulator prices its paths as measured, not as its spec says."""

    def __post_init__(self) -> None:
        if self.trial_budget < 1 or self.per_round < 1 or self.search_budget < 1:
            raise ValueError(f"trial_budget, per_round and search_budget must be >= 1; got {self.trial_budget}, "
                             f"{self.per_round}, {self.search_budget}")
        if self.confirm_top < 1 or self.confirm_repeats < 1 or self.block_size < 1:
            raise ValueError("confirm_top, confirm_repeats and block_size must be >= 1")
        if self.recheck < 0:
            raise ValueError(f"recheck must be >= 0, got {self.recheck}")
        if 0 < self.runoff_passes < MIN_RUNOFF_PASSES or self.runoff_passes < 0:
            raise ValueError(f"runoff_passes must be 0 (no runoff) or >= {MIN_RUNOFF_PASSES}, the fewest passes "
                             f"that can resolve a lead at p < {RESOLVED_P}; got {self.runoff_passes}")
        check_time_limit(self.time_limit_s)


def check_time_limit(seconds: float | None) -> None:
    """``ValueError`` unless ``seconds`` is a valid ``AutotuneSettings.time_limit_s``: None (no limit) or a
    finite number >= 1 (the runoff sizes its passes from it: NaN or infinity cannot be)."""
    if seconds is not None and not (math.isfinite(seconds) and seconds >= 1):
        raise ValueError(f"time_limit_s must be None (no limit) or a finite number of seconds >= 1, got {seconds!r}")


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
        self.runner_for, self.with_horovod = runner_for, with_horovod
        self.progress = AutotuneProgress(settings.trial_budget, enabled=progress)
        """The bar over the budget and a line per phase (the search's own bars stay off inside it)."""
        self.base = simulator if simulator is not None else shipped_simulator()
        self.simulator = self.base
        self.confirm_store = confirm_store
        self.rng = np.random.default_rng(settings.seed)
        self.trials: list[TrialOutcome] = []
        self.seconds = {"search": 0.0, "trials": 0.0, "refit": 0.0, "confirm": 0.0}
        check_fits(description, cluster)
        self.references, self.not_runnable = rivals(description.variables, cluster, horovod=with_horovod,
                                                    fp16=not settings.exact, rows=embeddings(description))
        """The rivals: measured first, controls of every job after the first, seeds of every search."""
        self.seeds = seed_candidates(description, cluster, exact=settings.exact,
                                     exclude={c.fingerprint for c in self.references})
        """The hand-made mixes (``search.seeds``), in the recipes' order: seeds of every search; the first
        round measures them beside the rivals, as many as half the budget the rivals leave, and as
        many fewer search proposals."""
        self.levels = JobLevels(strategy_s={}, jobs={})
        self.trials_run = 0
        """Trials the round jobs ran (controls and rechecks included): with ``seconds["trials"]``, what a
        trial costs on this model and cluster."""

    def run(self) -> AutotuneResult:
        with self.progress:
            return self._run()

    def _run(self) -> AutotuneResult:
        start = time.monotonic()
        self.store.add_description(description_id(self.description), self.model, self.description.to_dict())
        self._calibrate()
        self._refit()  # trials of this model and cluster already in the store (a resumed run) count
        references = self.references
        rivals_only = self._rivals_only()
        if rivals_only is not None:
            self.progress.line(rivals_only)
        round_index, cut_by_time = 0, None
        while True:
            left = self.settings.trial_budget - len(self._measured())
            first = round_index == 0
            seeds = self.seeds[:max(0, (self.settings.trial_budget - len(references)) // 2)] if first else []
            first_batch = references + seeds if first else []
            wanted = self.settings.per_round - len(seeds)  # the hand mixes are the first round's proposals
            picks = self._propose(min(wanted, left - len(first_batch)), round_index)
            batch = first_batch + picks
            batch = [c for c in batch if c.fingerprint not in self._measured()]
            if not batch:
                break
            self._measure(batch, round_index)
            self._refit()
            self._report_round(round_index, len(batch))
            round_index += 1
            if len(self._measured()) >= self.settings.trial_budget:
                break
            cut_by_time = self._out_of_time(time.monotonic() - start, round_index)
            if cut_by_time is not None:
                self.progress.line(f"stopping the rounds at {len(self._measured())} of {self.settings.trial_budget} "
                                   f"strategies: {cut_by_time}")
                break
        self._recheck_last(round_index)
        confirmed, repeats, lineup = self._confirm()
        winner, unresolved_lead = self._winner(lineup, confirmed, repeats)
        runoff = None
        if unresolved_lead is not None and self.settings.runoff_passes:
            winner, unresolved_lead, runoff = self._runoff(lineup, unresolved_lead, time.monotonic() - start)
        self.seconds["total"] = time.monotonic() - start
        return AutotuneResult(
            model=self.model, cluster=self.cluster, winner_kind=winner.kind, winner=self._training_strategy(winner),
            winner_levers=self._levers(winner), trials=self._normalized(self.trials),
            confirmed_s=confirmed, confirmed_repeats_s=repeats, unresolved_lead=unresolved_lead, runoff=runoff,
            trial_s={c.kind: self.levels.strategy_s[c.fingerprint] for c in lineup if c.fingerprint in self.levels.strategy_s},
            not_runnable=dict(self.not_runnable), exact=self.settings.exact, seconds=dict(self.seconds),
            rivals_only=rivals_only, rounds_cut=None if cut_by_time is None else {"measured": len(self._measured()),
                                                         "budget": self.settings.trial_budget, "why": cut_by_time},
            job_levels={job: {"level": level.level, "drift_per_min": level.drift_per_min, "trials": level.trials}
                        for job, level in self.levels.jobs.items()})

    def _rivals_only(self) -> str | None:
        """Why the trial budget leaves nothing to tune (``None``: it does not). The rivals count against
        the budget and are measured first: a budget of 10 with 10 rivals picked the fastest baseline and
        said nothing about the hand-made mixes and search strategies it never measured."""
        rivals, budget = len(self.references), self.settings.trial_budget
        if budget > rivals:
            return None
        return (f"the trial budget ({budget}) measures only the {rivals} rivals: no hand-made mix or search "
                f"strategy will be; a budget of at least {rivals + self.settings.per_round} measures a round of them")

    # --- steps ------------------------------------------------------------------------------
    def _records(self) -> list[TrialRecord]:
        return self.store.trials(model=self.model, cluster=self.cluster.to_dict())

    def _measured(self) -> set[str]:
        return {r.fingerprint for r in self._records()}

    def _propose(self, count: int, round_index: int) -> list[Candidate]:
        if count <= 0:
            return []
        started = time.monotonic()
        seeds = [c.strategy for c in self.references + self.seeds if c.strategy is not None]
        seeds += [s for _, s in self._best_measured(self.settings.confirm_top * 2)]
        records = self._records()
        exclude = {r.fingerprint for r in records} | {c.fingerprint for c in self.references}  # measured anyway
        measured = {c.fingerprint: c.strategy for c in self.references if c.strategy is not None}
        measured.update({r.fingerprint: Strategy.from_dict(r.strategy) for r in records
                         if r.strategy is not None and r.fingerprint not in measured})
        ranked = propose(self.simulator, self.description, self.cluster, seeds=seeds, exclude=exclude,
                         count=count, budget=self.settings.search_budget, rng=self.rng, progress=False,
                         exact=self.settings.exact, measured=list(measured.values()))
        self.seconds["search"] += time.monotonic() - started
        return [Candidate(kind=f"{SEARCH_KIND}:r{round_index}", strategy=s) for _, s in ranked]

    def _measure(self, batch: list[Candidate], round_index: int) -> None:
        """Measures ``batch`` in one round's job, with its controls and rechecks."""
        predicted = self.simulator.predict(self.description, self.cluster, [self._as_simulated(c) for c in batch])
        started = time.monotonic()
        controls = self._controls(round_index)
        self.progress.phase(f"round {round_index + 1}", expected=len(batch))
        summary = self.runner_for(self.settings.protocol, self.store).run(
            batch, self.progress.trial, controls=controls, block_size=self.settings.block_size,
            rechecks=self._rechecks(controls))
        self.seconds["trials"] += time.monotonic() - started
        self.trials_run += summary.measured + summary.failed + summary.controls
        by_fingerprint = {r.fingerprint: r for r in self._records() if not is_control(r.kind)}
        for candidate, guess in zip(batch, predicted):
            record = by_fingerprint.get(candidate.fingerprint)
            ok = record is not None and record.status == "ok"
            self.trials.append(TrialOutcome(round=round_index, kind=candidate.kind, fingerprint=candidate.fingerprint,
                                            predicted_s=float(guess), measured_s=record.median_s if ok else None,
                                            reason=None if ok else (record.reason if record else "not measured"),
                                            job=record.job if record else None))

    def _out_of_time(self, elapsed_s: float, rounds: int) -> str | None:
        """Why another round would not fit ``settings.time_limit_s`` (``None``: it fits, or no limit).

        Every job is priced at the round jobs' seconds per trial so far (job start-up included): the next
        round (its proposals, a pass over the controls around each block of them, its rechecks), then
        the recheck job as it would run after ``rounds`` rounds (its rechecks between two passes over the
        controls), the confirmation (its lineup ``confirm_repeats`` times) and, with runoffs on, a
        runoff's ``MIN_RUNOFF_PASSES`` passes of two."""
        limit = self.settings.time_limit_s
        if limit is None or not self.trials_run:
            return None
        per_trial_s = self.seconds["trials"] / self.trials_run
        controls = self._controls(rounds)
        proposals = min(self.settings.per_round, self.settings.trial_budget - len(self._measured()))
        round_s = per_trial_s * (proposals + (math.ceil(proposals / self.settings.block_size) + 1) * len(controls)
                                 + self.settings.recheck)
        rechecks = self._last_rechecks(controls)
        recheck_job = 2 * len(controls) + len(rechecks) if rechecks else 0
        lineup = len(self._fastest_references()) + self.settings.confirm_top
        runoff = 2 * MIN_RUNOFF_PASSES if self.settings.runoff_passes else 0
        after_s = per_trial_s * (recheck_job + lineup * self.settings.confirm_repeats + runoff)
        if elapsed_s + round_s + after_s <= limit:
            return None
        return (f"{elapsed_s:.0f} s gone, another round (~{round_s:.0f} s) and what follows it (rechecks, "
                f"confirmation{' and a runoff' if runoff else ''}: ~{after_s:.0f} s) would pass the {limit:.0f} s limit")

    def _report_round(self, round_index: int, measured: int) -> None:
        """One line after a round: what it measured, and the fastest search strategy and rival so far at
        an average job's level (raw milliseconds of different jobs do not compare)."""
        kinds = {r.fingerprint: r.kind for r in self._records() if r.status == "ok" and not is_control(r.kind)}
        fastest: dict[str, str] = {}
        for fingerprint, seconds in self.levels.ranked():
            if fingerprint in kinds:
                side = "rival" if is_rival(kinds[fingerprint]) else "search strategy"
                fastest.setdefault(side, f"fastest {side} {kinds[fingerprint]} {seconds * 1e3:.1f} ms")
        failed = f", {self.progress.failed} failed" if self.progress.failed else ""
        self.progress.line(f"round {round_index + 1}: {measured} strategies measured{failed} "
                           f"({self.progress.phase_s:.0f} s); {'; '.join(fastest.values()) or 'none ran'}")

    def _confirmation_trial(self, record: TrialRecord) -> None:
        """A confirmation or runoff trial stored: progress within the phase, no new strategy."""
        self.progress.trial(record, new_strategy=False)

    def _rechecks(self, controls: Sequence[Candidate]) -> list[Candidate]:
        """The ``settings.recheck`` fastest search strategies (at an average job's level) measured in one
        trial only, less this job's ``controls`` (they are measured in every pass anyway)."""
        if self.settings.recheck == 0:
            return []
        records = self._records()
        counts, search = self._measurements(records), self._search_records(records)
        skip = {c.fingerprint for c in controls}
        once = [f for f, _ in self.levels.ranked(search) if counts[f] == 1 and f not in skip]
        return [Candidate(kind=search[f].kind, strategy=Strategy.from_dict(search[f].strategy))
                for f in once[:self.settings.recheck]]

    @staticmethod
    def _measurements(records: list[TrialRecord]) -> dict[str, int]:
        """Successful trials per fingerprint among ``records`` (controls and rechecks included)."""
        counts: dict[str, int] = {}
        for record in records:
            if record.status == "ok":
                counts[record.fingerprint] = counts.get(record.fingerprint, 0) + 1
        return counts

    def _recheck_last(self, rounds: int) -> None:
        """After the last round: one short job re-measures what the confirmation may take and the trials
        measured once: the best search strategies (that round's own finds) and the rivals within one of
        the confirmation's cut of each kind, so that its lineup is chosen, and the trials' ranking of it
        judged, on two measurements in two jobs (a rival measured once in round 0 carries that trial's
        ~10% noise: ncf's rivals, all within 17%, ranked near chance)."""
        controls = self._controls(rounds)
        rechecks = self._last_rechecks(controls)
        if not rechecks:
            return
        started = time.monotonic()
        self.progress.phase(f"rechecking {len(rechecks)} strategies measured once")
        self.runner_for(self.settings.protocol, self.store).run([], controls=controls, rechecks=rechecks)
        self.seconds["trials"] += time.monotonic() - started
        self._refit()
        self.progress.line(f"rechecked {len(rechecks)} strategies measured once ({time.monotonic() - started:.0f} s)")

    def _last_rechecks(self, controls: Sequence[Candidate]) -> list[Candidate]:
        """``_recheck_last``'s list: ``_rechecks`` and the rivals measured once among one more of each
        kind than the confirmation takes (``_fastest_references``), less ``controls``."""
        rechecks = self._rechecks(controls)
        counts, skip = self._measurements(self._records()), {c.fingerprint for c in [*controls, *rechecks]}
        return rechecks + [c for c in self._fastest_references(extra=1)
                           if counts.get(c.fingerprint) == 1 and c.fingerprint not in skip]

    def _controls(self, round_index: int) -> list[Candidate]:
        """What a round's job re-measures between its blocks: the best rival so far and the incumbent
        best (the next best if they coincide); in the first round, the rival predicted fastest."""
        ranked = [fingerprint for fingerprint, _ in self.levels.ranked()]
        if round_index == 0 or not ranked:
            runnable = [c for c in self.references if c.strategy is not None]
            predicted = self.simulator.predict(self.description, self.cluster, [c.strategy for c in runnable])
            return [runnable[int(np.argmin(predicted))]] if runnable else []
        known = {c.fingerprint: c for c in self.references}
        known.update({r.fingerprint: Candidate(kind=r.kind, strategy=None if r.strategy is None
                                               else Strategy.from_dict(r.strategy))
                      for r in self._records() if r.status == "ok" and not is_control(r.kind)})
        best_rival = next((f for f in ranked if f in known and is_rival(known[f].kind)), None)
        others = [f for f in ranked if f in known and f != best_rival]
        chosen = ([best_rival] if best_rival else []) + others[:1 if best_rival else 2]
        return [known[f] for f in chosen]

    def _calibrate(self) -> None:
        """The cluster's measured paths into the simulator (``settings.calibrate``); a failed
        calibration is a warning: the spec's nominal paths serve instead."""
        if not self.settings.calibrate:
            return
        from hybridsync.model.calibration import calibrate
        started = time.monotonic()
        self.progress.phase("calibrating the cluster's paths")
        try:
            links = calibrate(self.runner_for(self.settings.protocol, self.store).target, self.cluster)
        except RuntimeError as error:
            warnings.warn(f"calibration failed, the simulator prices the cluster from its spec: {error}",
                          RuntimeWarning, stacklevel=2)
        else:
            self.base = self.simulator = self.base.calibrated(self.cluster, links)
        self.seconds["calibrate"] = time.monotonic() - started

    def _refit(self) -> None:
        from hybridsync.description import parse_description
        from hybridsync.model.simulator import Simulator, samples_from_records
        records = [r for r in self._records() if r.status == "ok"]
        if not records:
            return
        started = time.monotonic()
        self.levels = fit_levels(records)
        descriptions = {did: parse_description(entry["doc"], where=f"description {did}")
                        for did, entry in self.store.descriptions().items()}
        samples = samples_from_records([self.levels.normalized(r) for r in records], descriptions)
        self.simulator = Simulator(kind=self.base.kind).fit(samples, base=self.base) \
            if self.base.kind != "analytic" else self.base
        self.seconds["refit"] += time.monotonic() - started

    def _normalized(self, trials: list[TrialOutcome]) -> list[TrialOutcome]:
        """``trials`` with their step times at an average job's level (the last fit's)."""
        records = {(r.job, r.fingerprint): r for r in self._records() if r.status == "ok" and not is_control(r.kind)}
        return [dataclasses.replace(t, normalized_s=self.levels.normalized_s(records[t.job, t.fingerprint]))
                if (t.job, t.fingerprint) in records else t for t in trials]

    def _best_measured(self, count: int) -> list[tuple[float, Strategy]]:
        """The ``count`` search strategies fastest at an average job's level."""
        search = self._search_records(self._records())
        return [(s, Strategy.from_dict(search[f].strategy)) for f, s in self.levels.ranked(search)][:count]

    @staticmethod
    def _search_records(records: list[TrialRecord]) -> dict[str, TrialRecord]:
        """The search's successful trials among ``records`` (hand mixes included), by fingerprint."""
        return {r.fingerprint: r for r in records
                if r.status == "ok" and r.strategy is not None and r.kind.startswith(SEARCH_KIND)}

    def _confirm(self) -> tuple[dict[str, float], dict[str, list[float]], list[Candidate]]:
        """Measures the best search strategies, the fastest rivals and the reference rows again in one
        job; returns every kind's median step time there, each repeat's median per kind, and the lineup."""
        seeds = {c.fingerprint: c.kind.removeprefix(SEARCH_KIND + ":") for c in self.seeds}
        contenders = [Candidate(kind=f"{SEARCH_KIND}:top{i + 1}" + (f":{seeds[s.fingerprint()]}"
                                                                    if s.fingerprint() in seeds else ""), strategy=s)
                      for i, (_, s) in enumerate(self._best_measured(self.settings.confirm_top))]
        lineup = self._fastest_references() + contenders
        schedule = shuffled_passes(lineup, self.settings.confirm_repeats, self.rng)
        with contextlib.ExitStack() as stack:  # without a confirm_store: a temporary one, removed once read
            store = self.confirm_store or stack.enter_context(TrialStore(os.path.join(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="hybridsync-confirm-")), "confirm.db")))
            started = time.monotonic()
            self.progress.phase(f"confirmation of {len(lineup)}", expected=len(schedule))
            self.runner_for(self.settings.confirm_protocol, store).run(schedule, self._confirmation_trial)
            self.seconds["confirm"] = time.monotonic() - started
            records = store.trials(model=self.model, cluster=self.cluster.to_dict(), status="ok")
        steps: dict[str, list[float]] = {}
        repeats: dict[str, list[float]] = {}
        for record in records:
            if record.timed_steps:
                steps.setdefault(record.kind, []).extend(record.timed_steps)
                repeats.setdefault(record.kind, []).append(statistics.median(record.timed_steps))
        confirmed = {kind: statistics.median(times) for kind, times in steps.items()}
        if not confirmed:
            raise RuntimeError("the confirmation job measured nothing (every trial failed); see the trial logs")
        fastest = min(confirmed, key=confirmed.__getitem__)
        self.progress.line(f"confirmation: {len(lineup)} strategies x {self.settings.confirm_repeats} passes in one "
                           f"job ({self.seconds['confirm']:.0f} s); fastest there {fastest} "
                           f"{confirmed[fastest] * 1e3:.1f} ms")
        return confirmed, repeats, lineup

    def _winner(self, lineup: list[Candidate], confirmed: dict[str, float],
                repeats: dict[str, list[float]]) -> tuple[Candidate, dict[str, Any] | None]:
        """The confirmation job's fastest, except that a search strategy replaces its best fair rival
        only on a lead the job's repeats resolve (``repeats_p`` < ``RESOLVED_P``); otherwise that
        rival wins, and the lead is returned to be reported. A lead inside one job's noise did not
        hold in the next: in 3 of 5 runs the search's winner was 0.94-0.95x its rival in a second job
        of the same lineup (benchmarks/RESULTS.md), and a user must not train slower than by hand."""
        by_kind = {c.kind: c for c in lineup}
        fastest = by_kind[min(confirmed, key=confirmed.__getitem__)]
        if is_rival(fastest.kind):
            return fastest, None
        fair = fair_rivals(confirmed, self._levers(fastest))
        if not fair:
            return fastest, None
        rival = min(fair, key=fair.__getitem__)
        p = repeats_p(repeats.get(fastest.kind, []), repeats.get(rival, []))
        if p is not None and p < RESOLVED_P:
            return fastest, None
        return by_kind[rival], {"kind": fastest.kind, "step_s": confirmed[fastest.kind], "over": rival, "p": p}

    def _runoff(self, lineup: list[Candidate], lead: dict[str, Any],
                elapsed_s: float) -> tuple[Candidate, dict[str, Any] | None, dict[str, Any]]:
        """Measures an unresolved lead against its rival again in a job of their own, pass by pass;
        returns the winner, the lead still not taken (``None`` once taken) and what the runoff found."""
        by_kind = {c.kind: c for c in lineup}
        leader, rival = by_kind[lead["kind"]], by_kind[lead["over"]]
        pass_s = self.seconds["confirm"] / (len(lineup) * self.settings.confirm_repeats) * 2
        passes, limit = self.settings.runoff_passes, self.settings.time_limit_s
        if limit is not None:  # as many passes as fit, down to the fewest that can resolve a lead
            passes = min(passes, int((limit - elapsed_s) / pass_s))
        record: dict[str, Any] = {"kind": leader.kind, "over": rival.kind, "passes": passes}
        if passes < MIN_RUNOFF_PASSES:
            record.update(passes=MIN_RUNOFF_PASSES, skipped=f"its {MIN_RUNOFF_PASSES} passes, about "
                          f"{pass_s * MIN_RUNOFF_PASSES:.0f} s, would pass the {limit:.0f} s limit")
            return rival, lead, record
        schedule = shuffled_passes([leader, rival], passes, self.rng)
        started = time.monotonic()
        self.progress.phase(f"runoff {leader.kind} vs {rival.kind}", expected=len(schedule))
        with tempfile.TemporaryDirectory(prefix="hybridsync-runoff-") as folder, \
                TrialStore(os.path.join(folder, "runoff.db")) as store:  # read here, then removed
            self.runner_for(self.settings.confirm_protocol, store).run(schedule, self._confirmation_trial)
            records = store.trials(model=self.model, cluster=self.cluster.to_dict())
        self.seconds["runoff"] = time.monotonic() - started
        steps = pass_medians(records, schedule)
        ratios = [by[rival.kind] / by[leader.kind] for by in steps if len(by) == 2]
        p = paired_p(ratios)
        ratio = statistics.median(ratios) if ratios else None
        taken = ratio is not None and ratio > 1 and p is not None and p < RESOLVED_P
        self.progress.line(f"runoff: {leader.kind} {'-' if ratio is None else f'{ratio:.3f}x'} {rival.kind} over "
                           f"{len(ratios)} passes (p = {'-' if p is None else f'{p:.3f}'}): "
                           f"{'taken' if taken else 'not taken, the rival keeps the win'}")
        record.update(ratio=ratio, p=p, taken=taken,
                      step_s={kind: [by[kind] for by in steps if kind in by] for kind in (leader.kind, rival.kind)})
        return (leader, None, record) if taken else (rival, lead, record)

    def _levers(self, candidate: Candidate) -> frozenset[str]:
        """What ``candidate`` uses beyond plain Horovod's numerics (its strategy's levers, or a rival's)."""
        return baselines.levers(candidate.strategy, self.description.variables) | rival_levers(candidate.kind)

    def _fastest_references(self, extra: int = 0) -> list[Candidate]:
        """The reference rows, and of each lever set the rivals use (none, fp16, rows, both) the
        ``confirm_top`` fastest baselines by the trials, or with more than two sets ``2 * confirm_top``
        places shared among them, at least one each; ``extra`` more per set. A baseline 2x slower than
        the best one cannot win a re-measurement, timing it would only lengthen the confirmation job:
        with rows twins it holds as many rivals as without."""
        speed = self.levels.strategy_s
        measured = [c for c in self.references if c.fingerprint in speed]
        rows = [c for c in measured if c.kind in (HOROVOD_KIND, HOROVOD_FP16_KIND)]
        groups: dict[frozenset[str], list[Candidate]] = {}
        for candidate in measured:
            if candidate not in rows:
                groups.setdefault(rival_levers(candidate.kind), []).append(candidate)
        places = max(1, 2 * self.settings.confirm_top // max(2, len(groups))) + extra
        out = []
        for levers in sorted(groups, key=lambda levers: (len(levers), sorted(levers))):
            out += sorted(groups[levers], key=lambda c: speed[c.fingerprint])[:places]
        return rows + out

    def _as_simulated(self, candidate: Candidate) -> Strategy | None:
        """What the simulator should predict for ``candidate`` (``None``: plain Horovod)."""
        return self._training_strategy(candidate) if candidate.kind == HOROVOD_FP16_KIND else candidate.strategy

    def _training_strategy(self, winner: Candidate) -> Strategy:
        """What to train with: the winner's strategy; for a reference row, hybridsync's equivalent
        (every variable ring all-reduced through Horovod, with fp16 for ``horovod-fp16``)."""
        if winner.strategy is not None:
            return winner.strategy
        if winner.kind == HOROVOD_FP16_KIND:
            return baselines.fp16_twin("allreduce", self.description.variables, self.cluster.num_servers)
        return Strategy(variables={})


def pass_medians(records: Sequence[TrialRecord], schedule: Sequence[Candidate]) -> list[dict[str, float]]:
    """Per pass of a job that ran ``schedule`` in passes over the same lineup: kind -> median timed
    step of the trials that succeeded there. ``records``: that job's trials in the order measured
    (one per scheduled candidate; a job that died early has fewer)."""
    size = len({c.kind for c in schedule})
    out: list[dict[str, float]] = [{} for _ in range(len(schedule) // size)]
    for index, record in enumerate(records[:len(schedule)]):
        if record.status == "ok" and record.timed_steps:
            out[index // size][record.kind] = statistics.median(record.timed_steps)
    return out


def embeddings(description: ModelDescription) -> frozenset[str]:
    """The model's dense embeddings: the variables whose profiled steps touch few of their rows
    (``search.seeds.embedding_like``); the rows seeds and the rivals' rows twins send their rows."""
    from hybridsync.search.seeds import embedding_like
    return embedding_like(description.variables, rows_touched(description))


def rows_touched(description: ModelDescription) -> dict[str, int]:
    """Variable -> the rows a profiled step touched (``VariableTiming.rows_touched``), where measured."""
    return {name: timing.rows_touched for name, timing in description.variable_timing.items()
            if timing.rows_touched is not None}


def seed_candidates(description: ModelDescription, cluster: ClusterSpec, *, exact: bool,
                    exclude: set[str]) -> list[Candidate]:
    """The structured seeds (``search.seeds``) for this model and cluster as first-round candidates
    (``search:seed-<recipe>``), less those equal to a rival (``exclude``: fingerprints)."""
    from hybridsync.search.seeds import recipe_label, structured_seeds
    from hybridsync.strategy_space import bounds_for
    return [Candidate(kind=f"{SEARCH_KIND}:seed-{recipe_label(name, description.variables)}", strategy=strategy)
            for name, strategy in structured_seeds(description.variables, bounds_for(cluster, exact=exact),
                                                   rows_touched=rows_touched(description))
            if strategy.fingerprint() not in exclude]


def propose(simulator: Any, description: ModelDescription, cluster: ClusterSpec, *, seeds: Sequence[Strategy],
            exclude: set[str], count: int, budget: int, rng: np.random.Generator,
            progress: bool = True, exact: bool = False,
            measured: Sequence[Strategy] = ()) -> list[tuple[float, Strategy]]:
    """The ``count`` strategies with the lowest predicted step time that the evolutionary search
    found in ``budget`` simulator evaluations, none of them in ``exclude`` (fingerprints), each
    materially different from the others and from ``measured`` where the ranking allows (``diverse``);
    ``exact``: only plain Horovod's numerics (no fp16, BSP)."""
    from hybridsync.model.encoding import model_arrays
    from hybridsync.search.evolution import EvolutionarySearch, run_search, simulator_cost
    from hybridsync.strategy_space import bounds_for
    arrays = model_arrays(description)
    search = EvolutionarySearch(arrays, cluster, bounds_for(cluster, exact=exact), rng, seeds=seeds)
    run_search(search, simulator_cost(simulator, arrays, cluster), budget, progress=progress)
    sizes = {name: info.nbytes for name, info in description.variables.items()}
    return diverse(search.iter_ranked(exclude=exclude), count, sizes, measured=measured)


MIN_DIFFERENT_VARIABLES = 2
"""A round's picks differ pairwise in at least this many variables' configs where the ranking
allows: the search's top strategies are mostly one-variable variations of its best, and ten
trials of nearly one strategy teach the simulator little about the rest of the space."""
MIN_DIFFERENT_SHARE = 0.05
"""... and those variables hold at least this share of the model's bytes. Configs of a few biases
(which server, which merge group) change no message a simulator or a network can tell apart: on a
held-out wide & deep model a round's ten picks differed only there, the simulator gave all ten
one step time, and the ten trials measured one strategy ten times (120-182 ms in one job: noise
that the round's ranking then took for a difference)."""


def diverse(ranked: Iterable[tuple[float, Strategy]], count: int, sizes: Mapping[str, int],
            measured: Sequence[Strategy] = ()) -> list[tuple[float, Strategy]]:
    """The best ``count`` of ``ranked`` (ascending cost) such that each differs materially from every
    better pick and every ``measured`` strategy: in ``MIN_DIFFERENT_VARIABLES`` variables holding
    ``MIN_DIFFERENT_SHARE`` of the bytes (``sizes``: bytes per variable); topped up in rank order if too
    few do. ``ranked`` is read only as far as the picks need (``EvolutionarySearch.iter_ranked``)."""
    names = list(sizes)
    least_bytes = MIN_DIFFERENT_SHARE * sum(sizes.values())

    def configs(strategy: Strategy) -> list[Any]:
        return [strategy.config_for(name) for name in names]

    def apart(mine: list[Any], other: list[Any]) -> bool:
        differ = [name for name, a, b in zip(names, mine, other) if a != b]
        return len(differ) >= MIN_DIFFERENT_VARIABLES and sum(sizes[name] for name in differ) >= least_bytes

    taken = [configs(strategy) for strategy in measured]
    picks: list[tuple[float, Strategy]] = []
    read: list[tuple[float, Strategy]] = []  # all of ``ranked`` whenever the picks fall short
    for cost, strategy in ranked if count > 0 else ():
        read.append((cost, strategy))
        mine = configs(strategy)
        if all(apart(mine, other) for other in taken):
            picks.append((cost, strategy))
            taken.append(mine)
            if len(picks) == count:
                break
    chosen = {s.fingerprint() for _, s in picks}
    picks += [(c, s) for c, s in read if s.fingerprint() not in chosen][:count - len(picks)]
    return sorted(picks, key=lambda item: item[0])


def check_cluster(cluster: ClusterSpec) -> None:
    """``ValueError`` if the cluster has no synchronization to tune: what can be checked before profiling."""
    if cluster.num_workers < 2:
        raise ValueError(f"the cluster has {cluster.num_workers} worker(s); autotuning synchronization needs at "
                         f"least 2 (nodes x workers_per_node)")


def check_fits(description: ModelDescription, cluster: ClusterSpec) -> None:
    """``ValueError`` now, not after a job started, if the cluster cannot run the model at all."""
    check_cluster(cluster)
    if not description.variables:
        raise ValueError(f"{description.name or 'model description'}: has no variables to synchronize")
