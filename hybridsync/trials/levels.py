"""Job levels: step times measured in different trial jobs, made comparable.

On shared cores one command's step time moves from one job to the next (which cores the
ranks land on, what else runs) and drifts within a job. So the trial runner re-measures
controls in every job, in blocks interleaved with the candidates, and this module fits,
over the successful trials of one model on one cluster,

    log t_i = a_s(i) + b_j(i) + c_j(i) * m_i + e_i

``t_i`` a trial's median step time, ``a_s`` the strategy's own log step time, ``b_j`` the
level of job ``j``, ``c_j`` its drift per minute and ``m_i`` the trial's minute within its
job (0 at the job's mean). Strategies measured in several jobs (the controls, and any other
repeat) tie the jobs together; within a job, the controls measured before, between and after
the blocks give the drift. Huber's loss keeps one disturbed trial from moving a whole job.
A small ridge on ``b`` and ``c`` fixes what the data leave open: the levels of a set of
linked jobs average 0 (normalized times stay in seconds, at an average job's level), a job
linked to no other keeps level 0 (taken at face value), and a job without repeats keeps no drift.

Torch-free (numpy, scipy).
"""
from __future__ import annotations

import dataclasses
import datetime
import math
from collections import defaultdict
from typing import Iterable, Mapping, Sequence

import numpy as np

from hybridsync.trials.store import TrialRecord, is_local

HUBER_SCALE = 0.05
"""Residual (in log step time) beyond which a trial's weight falls: about one trial's noise
(3 + 10 steps on these machines: 4-6%, benchmarks/RESULTS.md, "Trial protocol")."""
LEVEL_RIDGE = 1e-4
"""Weight of ``b_j**2``: fixes the common shift between levels and strategies (levels average 0)."""
DRIFT_RIDGE = 1.0
"""Weight of ``c_j**2`` (``c`` per minute): a drift must be shown by controls minutes apart. Ten
controls spread over a 3-minute job keep ~90% of a true drift; in a job of a few seconds, where
a drift cannot be told from noise (and matters little), it stays ~0."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobLevel:
    """One job's level: its step times are ``level * exp(drift_per_min * minutes from center)``
    times those of an average job."""

    level: float
    drift_per_min: float
    center: float
    """Mean trial time of the job (POSIX seconds): where the drift term is 0."""
    trials: int
    """Successful trials of the job in the fit."""
    linked: bool
    """Whether a strategy measured elsewhere ties this job to others (else its level is 1 by default)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobLevels:
    """What ``fit_levels`` found: every strategy's step time at an average level, every job's level."""

    strategy_s: dict[str, float]
    """Fingerprint -> step time (seconds) at the average level of the linked jobs."""
    jobs: dict[str, JobLevel]

    def factor(self, record: TrialRecord) -> float:
        """How much slower than an average job ``record``'s job ran when it measured it (1: as fast)."""
        job = self.jobs.get(record.job)
        if job is None:
            return 1.0
        return job.level * math.exp(job.drift_per_min * (trial_time(record) - job.center) / 60.0)

    def normalized_s(self, record: TrialRecord) -> float | None:
        """``record``'s median step time at an average job's level (``None`` without timed steps)."""
        median = record.median_s
        return None if median is None else median / self.factor(record)

    def normalized(self, record: TrialRecord) -> TrialRecord:
        """``record`` with every step time divided by its job's factor: what a fit on step times
        (the simulator's) should see, with the spread of its steps kept."""
        factor = self.factor(record)
        return dataclasses.replace(record, step_times=[t / factor for t in record.step_times])

    def ranked(self, fingerprints: Iterable[str] | None = None) -> list[tuple[str, float]]:
        """(fingerprint, step time at the average level), fastest first."""
        chosen = self.strategy_s if fingerprints is None else {f: self.strategy_s[f] for f in fingerprints
                                                              if f in self.strategy_s}
        return sorted(chosen.items(), key=lambda item: item[1])


def trial_time(record: TrialRecord) -> float:
    """The middle of a trial (POSIX seconds), from its ISO start and end times (0 if unreadable)."""
    try:
        start = datetime.datetime.fromisoformat(record.started).timestamp()
        end = datetime.datetime.fromisoformat(record.finished).timestamp()
    except (TypeError, ValueError):
        return 0.0
    return (start + end) / 2


def fit_levels(records: Iterable[TrialRecord], *, drift: bool = True) -> JobLevels:
    """Fits strategy times and job levels (module docstring) to the successful trials of
    ``records``, which must all be of one model on one cluster (``ValueError`` otherwise). Local-step
    rows (``LOCAL_KIND``) are no strategy: they get no time here, so nothing ranks them."""
    timed = [r for r in records if r.status == "ok" and r.median_s and not is_local(r.kind)]
    if len({(r.model, r.cluster_id) for r in timed}) > 1:
        raise ValueError("fit_levels: the records mix models or clusters; fit each (model, cluster) apart "
                         "(fit_levels_by_group)")
    if not timed:
        return JobLevels(strategy_s={}, jobs={})
    strategies = sorted({r.fingerprint for r in timed})
    jobs = sorted({r.job for r in timed})
    times = np.array([trial_time(r) for r in timed])
    centers = {job: float(np.mean([t for t, r in zip(times, timed) if r.job == job])) for job in jobs}
    minutes = np.array([(t - centers[r.job]) / 60.0 for t, r in zip(times, timed)]) if drift else np.zeros(len(timed))
    design, target = _design(timed, strategies, jobs, minutes)
    solution = _huber_fit(design, target)
    a, b, c = np.split(solution, [len(strategies), len(strategies) + len(jobs)])
    linked = _linked_jobs(timed)
    counts = defaultdict(int)
    for record in timed:
        counts[record.job] += 1
    return JobLevels(
        strategy_s={s: float(np.exp(a[i])) for i, s in enumerate(strategies)},
        jobs={job: JobLevel(level=float(np.exp(b[i])), drift_per_min=float(c[i]), center=centers[job],
                            trials=counts[job], linked=job in linked) for i, job in enumerate(jobs)})


def fit_levels_by_group(records: Iterable[TrialRecord], *, drift: bool = True) -> dict[tuple[str, str], JobLevels]:
    """``fit_levels`` for every (model, cluster id) of ``records`` (e.g. a whole store)."""
    groups: dict[tuple[str, str], list[TrialRecord]] = defaultdict(list)
    for record in records:
        groups[record.model, record.cluster_id].append(record)
    return {key: fit_levels(group, drift=drift) for key, group in sorted(groups.items())}


def normalize_records(records: Sequence[TrialRecord], *, drift: bool = True) -> list[TrialRecord]:
    """Every record with its step times at an average job's level of its (model, cluster): what a
    dataset or the simulator should learn from when its trials come from several jobs."""
    fits = fit_levels_by_group(records, drift=drift)
    return [fits[r.model, r.cluster_id].normalized(r) if r.status == "ok" else r for r in records]


def _design(timed: Sequence[TrialRecord], strategies: list[str], jobs: list[str],
            minutes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The least-squares system: one row per trial, then one ridge row per level and drift."""
    column = {s: i for i, s in enumerate(strategies)}
    job_column = {j: len(strategies) + i for i, j in enumerate(jobs)}
    width = len(strategies) + 2 * len(jobs)
    rows = np.zeros((len(timed) + 2 * len(jobs), width))
    target = np.zeros(len(rows))
    for i, record in enumerate(timed):
        rows[i, column[record.fingerprint]] = 1.0
        rows[i, job_column[record.job]] = 1.0
        rows[i, job_column[record.job] + len(jobs)] = minutes[i]
        target[i] = math.log(record.median_s)
    for k in range(len(jobs)):
        rows[len(timed) + k, len(strategies) + k] = math.sqrt(LEVEL_RIDGE)
        rows[len(timed) + len(jobs) + k, len(strategies) + len(jobs) + k] = math.sqrt(DRIFT_RIDGE)
    return rows, target


def _huber_fit(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    from scipy.optimize import least_squares
    start, *_ = np.linalg.lstsq(design, target, rcond=None)
    fit = least_squares(lambda x: design @ x - target, start, jac=lambda x: design, loss="huber",
                        f_scale=HUBER_SCALE, method="trf")
    return fit.x


def _linked_jobs(timed: Sequence[TrialRecord]) -> set[str]:
    """Jobs that share a strategy with another job."""
    jobs_of: Mapping[str, set[str]] = defaultdict(set)
    for record in timed:
        jobs_of[record.fingerprint].add(record.job)
    return {job for jobs in jobs_of.values() if len(jobs) > 1 for job in jobs}
