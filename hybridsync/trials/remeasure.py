"""Trial jobs measured again (``hybridsync dataset remeasure``): each stored job's lineup in one new job
of its own, the old job's trials replaced by the new job's.

A job has a level of its own, and a job that ran on a loaded machine is off by more than a level: the
70 jobs of the runtime dataset measured while the machine ran at load 28-62 (2026-11-25) took 1.4-11.7x
longer per step than the same lineups on a quiet machine, by a different factor per model and
cluster, and every simulator fit on them learned the load (benchmarks/RESULTS.md, "2026-11-27
(s14)"). Measuring such a job again keeps the dataset's design (the same strategies and kinds, the
same controls, warm-up and timed steps, one job per lineup) and replaces only what the load
distorted.

Each job runs into a scratch store of its own (``<workdir>/<job>.db``, emptied first: the runner
skips what its store holds, and the main store holds every one of these strategies already), and
then replaces the old job in the main store in one transaction (``TrialStore.replace_job``). An
interrupted run loses at most the job in flight; run again, it finds only the jobs left, since a
replaced job's trials start after the window. Zoo and generated models only (the zoo worker runs
them; a user script's trials name no script to run again), on emulated clusters.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Callable, Iterable, Mapping

from hybridsync.cluster.spec import ClusterSpec
from hybridsync.description import ModelDescription, description_id, parse_description
from hybridsync.strategy import Strategy
from hybridsync.trials.candidates import Candidate
from hybridsync.trials.jobs import JobTarget
from hybridsync.trials.redescribe import variable_differences
from hybridsync.trials.runner import TrialProtocol, TrialRunner
from hybridsync.trials.store import TrialRecord, TrialStore, base_kind, cluster_label, is_control


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoredJob:
    """The trials one job measured, in the order it measured them (``of``), and what they share."""

    trials: tuple[TrialRecord, ...]
    job: str
    model: str
    cluster: ClusterSpec
    started: str
    """Its first trial's start (ISO-8601 UTC)."""
    description_id: str

    @classmethod
    def of(cls, trials: Iterable[TrialRecord]) -> "StoredJob":
        """The job of ``trials`` (one job's, at least one), ordered by start time."""
        ordered = tuple(sorted(trials, key=lambda r: (r.started, r.uid)))
        first = ordered[0]
        return cls(trials=ordered, job=first.job, model=first.model, cluster=ClusterSpec.from_dict(first.cluster),
                   started=first.started, description_id=first.description_id)

    def protocol(self, trial_timeout_s: float = 300.0) -> TrialProtocol:
        """The job's warm-up and timed steps (its first successful trial's; every trial of a job
        shares them)."""
        ok = [t for t in self.trials if t.status == "ok"] or list(self.trials)
        first = ok[0]
        timed = len(first.step_times) - first.warmup_steps
        if timed < 1:
            raise ValueError(f"job {self.job} ({self.model}): no trial of it holds a timed step, so its "
                             f"protocol is unknown")
        return TrialProtocol(warmup_steps=first.warmup_steps, timed_steps=timed, trial_timeout_s=trial_timeout_s)

    def candidates(self) -> list[Candidate]:
        """The job's candidates (its trials but the controls), in the order they ran."""
        return [_candidate(t.kind, t.strategy) for t in self.trials if not is_control(t.kind)]

    def controls(self) -> list[Candidate]:
        """The strategies the job re-measured as controls, once each, in the order they first ran."""
        seen: dict[str, Candidate] = {}
        for t in self.trials:
            if is_control(t.kind) and t.fingerprint not in seen:
                seen[t.fingerprint] = _candidate(base_kind(t.kind), t.strategy)
        return list(seen.values())


def _candidate(kind: str, strategy: Mapping | None) -> Candidate:
    return Candidate(kind=kind, strategy=None if strategy is None else Strategy.from_dict(strategy))


def jobs_started_between(store: TrialStore, started_from: str, started_to: str, *,
                         models: Iterable[str] | None = None) -> list[StoredJob]:
    """The jobs whose first trial started in [``started_from``, ``started_to``] (ISO-8601 UTC
    prefixes, compared as strings: ``2026-11-25T16:00``), of ``models`` if given, oldest first."""
    if started_from > started_to:
        raise ValueError(f"the window starts after it ends: {started_from} > {started_to}")
    wanted = None if models is None else set(models)
    by_job: dict[str, list[TrialRecord]] = {}
    for record in store.trials():
        if wanted is None or record.model in wanted:
            by_job.setdefault(record.job, []).append(record)
    jobs = [StoredJob.of(trials) for trials in by_job.values()]
    return sorted((j for j in jobs if started_from <= j.started and j.started[:len(started_to)] <= started_to),
                  key=lambda j: (j.started, j.job))


def description_for(store: TrialStore, job: StoredJob, new: ModelDescription | None) -> tuple[str, dict]:
    """(id, document) of the description the job is measured with again: ``new`` (a re-profile: its
    variables must be the job's, ``ValueError`` naming what differs) or the one its trials name."""
    stored = store.descriptions()
    if job.description_id not in stored:
        raise ValueError(f"job {job.job} ({job.model}): its description {job.description_id} is not in the store")
    if new is None:
        return job.description_id, stored[job.description_id]["doc"]
    old = parse_description(stored[job.description_id]["doc"], where=f"description {job.description_id}")
    differences = variable_differences(old, new)
    if differences:
        raise ValueError(f"job {job.job} ({job.model}): the new description's variables differ from those its "
                         f"trials ran with: {'; '.join(differences)}")
    return description_id(new), new.to_dict()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Remeasured:
    """One job measured again: what it replaced, and its median step time before and after over the
    strategies that succeeded both times."""

    old_job: str
    new_job: str | None
    """``None`` when no trial of the new job was stored (the old job is kept)."""
    model: str
    cluster: str
    trials: int
    failed: int
    old_over_new: float | None
    """Median over strategies of old / new median step time (> 1: the old job ran slower)."""


def remeasure_job(store: TrialStore, job: StoredJob, target: JobTarget, *, workdir: str,
                  description: tuple[str, Mapping] | None = None, trial_timeout_s: float = 300.0,
                  on_trial: Callable[[TrialRecord], None] = lambda r: None) -> Remeasured:
    """Measures ``job``'s lineup again in one job on ``target`` (its cluster), and replaces the old
    job's trials in ``store`` by the new ones (``description``: the (id, document) the new trials name;
    default: the old job's)."""
    if target.spec != job.cluster:
        raise ValueError(f"job {job.job} ran on {cluster_label(job.cluster.to_dict())}, the target is "
                         f"{cluster_label(target.spec.to_dict())}")
    desc_id, doc = description or description_for(store, job, None)
    os.makedirs(workdir, exist_ok=True)
    scratch_path = os.path.join(workdir, f"{job.job}.db")
    for suffix in ("", "-wal", "-shm"):  # a job interrupted before runs whole again, in one job
        if os.path.exists(scratch_path + suffix):
            os.remove(scratch_path + suffix)
    with TrialStore(scratch_path) as scratch:
        scratch.add_description(desc_id, job.model, doc)
        runner = TrialRunner(model=job.model, description_id=desc_id, target=target, store=scratch,
                             protocol=job.protocol(trial_timeout_s), workdir=os.path.join(workdir, job.job))
        runner.run(job.candidates(), on_trial, controls=job.controls())
        new = scratch.trials()
    label = cluster_label(job.cluster.to_dict())
    failed = sum(r.status != "ok" for r in new)
    if not new:
        return Remeasured(old_job=job.job, new_job=None, model=job.model, cluster=label, trials=0, failed=0,
                          old_over_new=None)
    store.add_description(desc_id, job.model, doc)
    store.replace_job(job.job, new)
    return Remeasured(old_job=job.job, new_job=new[0].job, model=job.model, cluster=label, trials=len(new),
                      failed=failed, old_over_new=_old_over_new(job.trials, new))


def _old_over_new(old: Iterable[TrialRecord], new: Iterable[TrialRecord]) -> float | None:
    def medians(records: Iterable[TrialRecord]) -> dict[tuple[str, str], float]:
        by: dict[tuple[str, str], list[float]] = {}
        for r in records:
            if r.status == "ok" and r.median_s:
                by.setdefault((r.kind, r.fingerprint), []).append(r.median_s)
        return {key: statistics.median(values) for key, values in by.items()}

    before, after = medians(old), medians(new)
    ratios = [before[key] / after[key] for key in before.keys() & after.keys()]
    return statistics.median(ratios) if ratios else None
