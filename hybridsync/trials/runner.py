"""The trial runner: measure many strategies of one model on one cluster, in as few jobs as possible.

One job (``hybridsync.trials.worker`` on every rank) measures the candidates one after the
other, switching strategies in flight. The runner follows the job's results file and
writes each trial to the store as soon as it is measured (one transaction per trial), so an
interrupted run loses at most the trial in flight and resumes where it stopped: candidates
whose fingerprint the store already holds for this (model, cluster) are skipped.

A trial that fails is recorded as failed, with its reason, and the run goes on:
- refused by the optimizer (a ``ValueError`` on every rank): the job itself goes on;
- a rank raised, crashed or the trial outlived ``trial_timeout``: the job is stopped, the
  trial recorded with the error, the exit codes or the timeout, and a new job takes the
  remaining candidates.
A job that dies before its first trial (twice in a row) is not a trial's fault: the run
stops with the job's log, rather than recording every candidate as failed.

Given controls, every job re-measures them in passes between blocks of candidates
(``blocked_schedule``), as ``control:<kind>`` trials of that job: one command's step time moves
from job to job on shared cores, and ``hybridsync.trials.levels`` uses the controls to put the
jobs on one level.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from hybridsync import envvars

from hybridsync.trials.candidates import Candidate
from hybridsync.trials.jobs import JobTarget, LineFollower, RunningJob
from hybridsync.trials.store import TrialRecord, TrialStore, is_control
from hybridsync.trials.worker import utc_now

POLL_S = 0.2
SETTLE_S = 1.0
"""After a rank's error or exit, time for the rest of the job's errors and exits to show."""
LOG_TAIL_CHARS = 3000


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialProtocol:
    """How each trial is measured (AutoSync's reproducibility card: 10 warm-up, then 40 timed steps)."""

    warmup_steps: int = 10
    """Steps after the switch that are recorded but not timed (buffers, keys, groups being made)."""
    timed_steps: int = 40
    """Steps whose median is the trial's step time."""
    trial_timeout_s: float = 180.0
    """A trial not finished this long after the previous one is recorded as failed (hung)."""
    start_timeout_s: float = 300.0
    """Time a new job gets to start its ranks and servers and build the model."""
    settle_s: float = 6.0
    """Seconds every rank waits, once ready, before a job's first trial. A job's first seconds run
    slow while its other processes (parameter servers: more of them on more hosts) finish starting:
    the controls of a job's first 10 s measured 1.21x their job's median on the 4 x 1 cluster and
    1.04x on 2 x 2 (1.00x after), so whatever ran first looked slower than it is."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.timed_steps < 1 or self.settle_s < 0:
            raise ValueError(f"need warmup_steps >= 0, timed_steps >= 1 and settle_s >= 0, got {self.warmup_steps}, "
                             f"{self.timed_steps} and {self.settle_s}")
        if self.trial_timeout_s <= 0 or self.start_timeout_s <= 0:
            raise ValueError("timeouts must be positive")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSummary:
    """What one ``TrialRunner.run`` did: candidates measured (ok) and failed, candidates the store
    already held, control trials measured, jobs started, wall time."""

    measured: int
    failed: int
    skipped: int
    jobs: int
    seconds: float
    controls: int = 0


DEFAULT_BLOCK_SIZE = 5
"""Candidates between two passes over the controls: short enough that the controls follow a job's
drift, long enough that they cost less than half of its trials (two controls per pass)."""


def blocked_schedule(candidates: Sequence[Candidate], controls: Sequence[Candidate],
                     block_size: int = DEFAULT_BLOCK_SIZE, rechecks: Sequence[Candidate] = ()) -> list[Candidate]:
    """A job's schedule: a pass over the controls, ``block_size`` candidates, a pass, ... and a last
    pass (control trials have kind ``control:<kind>``). Without controls: the candidates as they are.

    ``rechecks`` (strategies measured before, in other jobs) are measured once each, as control
    trials too, spread over the passes: a strategy measured once is as likely to have been lucky as
    fast, and a second measurement in another job tells which."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not controls and not rechecks:
        return list(candidates)
    blocks = [list(candidates[start:start + block_size]) for start in range(0, len(candidates), block_size)]
    if not blocks:
        if not rechecks:
            return []
        blocks = [[]]
    one_pass = [control.as_control() for control in controls]
    checks = [candidate.as_control() for candidate in rechecks]
    schedule: list[Candidate] = []
    for index, block in enumerate(blocks):
        schedule += one_pass + checks[index::len(blocks)] + block
    return schedule + one_pass


def shuffled_passes(lineup: Sequence[Candidate], repeats: int, rng: np.random.Generator) -> list[Candidate]:
    """``repeats`` passes over ``lineup`` in one job, each pass in its own random order: a side-by-side
    comparison (the autotune's confirmation job) in which no strategy always follows the same
    neighbour, so that what one strategy leaves behind (buffers, caches, a server's state) does not
    always land on the same other one."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    return [lineup[index] for _ in range(repeats) for index in rng.permutation(len(lineup))]


class Workload(Protocol):
    """What a trial job runs on every rank: the command and its environment."""

    def job(self, schedule: str, results: str, protocol: TrialProtocol, seed: int) -> tuple[list[str], dict[str, str]]:
        ...


@dataclasses.dataclass(frozen=True)
class ZooWorkload:
    """A zoo model's trial worker (``hybridsync.trials.worker``), which also measures plain Horovod."""

    model: str

    def job(self, schedule: str, results: str, protocol: TrialProtocol, seed: int) -> tuple[list[str], dict[str, str]]:
        command = [sys.executable, "-m", "hybridsync.trials.worker", "--model", self.model, "--schedule", schedule,
                   "--results", results, "--warmup-steps", str(protocol.warmup_steps),
                   "--timed-steps", str(protocol.timed_steps), "--settle-s", str(protocol.settle_s),
                   "--seed", str(seed)]
        return command, {"PYTHONPATH": _package_root(), "OMP_NUM_THREADS": "1"}


@dataclasses.dataclass(frozen=True)
class ScriptWorkload:
    """Any training script whose optimizer is ``hybridsync.DistributedOptimizer``: its optimizer
    measures the schedule in flight (``hybridsync.hooks.trials``). The script must train at least
    one trial's steps per run; a run that ends early is restarted for the rest."""

    command: tuple[str, ...]

    def job(self, schedule: str, results: str, protocol: TrialProtocol, seed: int) -> tuple[list[str], dict[str, str]]:
        path = os.pathsep.join(p for p in (_package_root(), os.environ.get("PYTHONPATH", "")) if p)
        return list(self.command), {"PYTHONPATH": path, envvars.TRIALS: schedule, envvars.TRIALS_RESULTS: results,
                                    envvars.TRIALS_WARMUP: str(protocol.warmup_steps),
                                    envvars.TRIALS_STEPS: str(protocol.timed_steps),
                                    envvars.TRIALS_SETTLE_S: str(protocol.settle_s)}


@dataclasses.dataclass(frozen=True)
class EnvWorkload:
    """Another workload whose every rank also gets ``env`` (e.g. Horovod's tuned settings)."""

    inner: Workload
    env: tuple[tuple[str, str], ...]

    def job(self, schedule: str, results: str, protocol: TrialProtocol, seed: int) -> tuple[list[str], dict[str, str]]:
        command, env = self.inner.job(schedule, results, protocol, seed)
        return command, {**env, **dict(self.env)}


class _Follower(LineFollower):
    """The results file's events, as the ranks append them."""

    def new_events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.new_lines() if line.strip()]


class TrialRunner:
    """Measures candidates of one model on one target, writing every trial to ``store``.

    ``workload`` is what the jobs run: by default the zoo worker of ``model`` (a zoo name);
    for a user's script, a ``ScriptWorkload`` (``model`` is then the name its trials are stored under).
    """

    def __init__(self, *, model: str, description_id: str, target: JobTarget, store: TrialStore,
                 protocol: TrialProtocol = TrialProtocol(), workdir: str | None = None, seed: int = 0,
                 workload: Workload | None = None) -> None:
        self.model, self.description_id, self.target, self.store = model, description_id, target, store
        self.workload = workload or ZooWorkload(model)
        self.protocol, self.seed = protocol, seed
        self.workdir = workdir or tempfile.mkdtemp(prefix="hybridsync-trials-")
        os.makedirs(self.workdir, exist_ok=True)  # `trials run --workdir new/dir` failed at its first job
        self.cluster = target.spec.to_dict()
        self.host = socket.gethostname()
        self.versions: dict[str, str] = {}

    def pending(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """The candidates the store does not hold yet for this model and cluster."""
        done = self.store.done_fingerprints(self.model, self.cluster)
        return [c for c in candidates if c.fingerprint not in done]

    def run(self, candidates: Sequence[Candidate], on_trial: Callable[[TrialRecord], None] = lambda r: None,
            *, controls: Sequence[Candidate] = (), block_size: int = DEFAULT_BLOCK_SIZE,
            rechecks: Sequence[Candidate] = ()) -> RunSummary:
        """Measures every pending candidate; ``on_trial`` sees each candidate's record once it is stored.

        With ``controls``, every job re-measures them in passes between blocks of ``block_size``
        candidates (``blocked_schedule``), stored as ``control:<kind>`` trials of that job, so that
        ``hybridsync.trials.levels`` can put the jobs' step times on one level. ``rechecks`` are
        strategies measured once more each, also as control trials (a job runs for them alone if no
        candidate is pending). A control or recheck that fails is recorded and left out of the run's
        later jobs.
        """
        start, remaining = time.monotonic(), self.pending(candidates)
        controls = list(controls)
        rechecks = [c for c in rechecks if c.fingerprint not in {control.fingerprint for control in controls}]
        skipped, records, jobs, false_starts, control_trials = len(candidates) - len(remaining), [], 0, 0, 0
        while remaining or rechecks:
            jobs += 1
            job_id = uuid.uuid4().hex[:12]
            schedule = blocked_schedule(remaining, controls, block_size, rechecks)
            measured, failure, started = self._run_job(job_id, schedule, on_trial)
            mine = [r for _, r in measured if not is_control(r.kind)]
            control_trials += len(measured) - len(mine)
            records += mine
            remaining = remaining[len(mine):]  # the schedule keeps the candidates' order
            done = {c.fingerprint for c, r in measured if is_control(r.kind)}
            rechecks = [c for c in rechecks if c.fingerprint not in done]
            if failure is None or not (remaining or rechecks):
                continue
            if not started:
                false_starts += 1
                if false_starts >= MAX_FALSE_STARTS:
                    raise RuntimeError(f"trial jobs failed {false_starts} times before their first trial "
                                       f"(logs in {self.workdir}): {failure}")
                continue
            false_starts = 0
            culprit = schedule[len(measured)]
            failed = self._record(job_id, culprit, status="failed", reason=failure, step_times=[],
                                  started=measured[-1][1].finished if measured else utc_now())
            self.store.add(failed)
            if is_control(culprit.kind):
                controls = [c for c in controls if c.fingerprint != culprit.fingerprint]
                rechecks = [c for c in rechecks if c.fingerprint != culprit.fingerprint]
                continue
            on_trial(failed)
            records.append(failed)
            remaining = remaining[1:]
        ok = sum(r.status == "ok" for r in records)
        return RunSummary(measured=ok, failed=len(records) - ok, skipped=skipped, jobs=jobs,
                          seconds=time.monotonic() - start, controls=control_trials)

    def _run_job(self, job_id: str, schedule: Sequence[Candidate], on_trial: Callable[[TrialRecord], None],
                 ) -> tuple[list[tuple[Candidate, TrialRecord]], str | None, bool]:
        """One job over ``schedule``: each entry it measured with its record (in schedule order), why
        the job ended early (or None), and whether it got as far as its first trial."""
        base = os.path.join(self.workdir, job_id)
        with open(f"{base}.schedule.jsonl", "w", encoding="utf-8") as handle:
            for index, candidate in enumerate(schedule):
                handle.write(json.dumps({"index": index, **candidate.to_dict()}) + "\n")
        command, env = self.workload.job(f"{base}.schedule.jsonl", f"{base}.results.jsonl", self.protocol, self.seed)
        with open(f"{base}.log", "a", encoding="utf-8") as log:
            job = self.target.start(command, env, log,
                                    servers=any(c.strategy is not None and c.strategy.uses_ps for c in schedule))
            try:
                return self._follow(job, job_id, schedule, _Follower(f"{base}.results.jsonl"), f"{base}.log",
                                    on_trial)
            finally:
                job.stop()

    def _follow(self, job: RunningJob, job_id: str, schedule: Sequence[Candidate], results: _Follower,
                log_path: str, on_trial: Callable[[TrialRecord], None],
                ) -> tuple[list[tuple[Candidate, TrialRecord]], str | None, bool]:
        records: list[tuple[Candidate, TrialRecord]] = []
        errors: list[str] = []
        started, last_finished = False, utc_now()
        deadline = time.monotonic() + self.protocol.start_timeout_s
        while True:
            ended = _ended(job.exit_codes())
            for event in results.new_events():
                if event["event"] == "ready":
                    started, self.versions = True, event["versions"]
                    last_finished = event["time"]
                elif event["event"] == "trial":
                    entry = schedule[event["index"]]
                    record = self._record(job_id, entry, status=event["status"], reason=event["reason"],
                                          step_times=event["step_times"], started=event["started"],
                                          finished=event["finished"])
                    self.store.add(record)
                    if not is_control(entry.kind):
                        on_trial(record)
                    records.append((entry, record))
                    last_finished = record.finished
                elif event["event"] == "error":
                    errors.append(f"rank {event['rank']}: {event['reason']}")
                elif event["event"] == "done":
                    return records, None, True
                elif event["event"] == "exhausted":  # a script that trains fewer steps than the schedule needs
                    if any(not is_control(entry.kind) for entry, _ in records):
                        return records, None, True  # not a trial's fault: a new run takes the rest
                    first = next(i for i, entry in enumerate(schedule) if not is_control(entry.kind))
                    steps = (first + 1) * (self.protocol.warmup_steps + self.protocol.timed_steps)
                    controls = f", {first} control trial(s) first" if first else ""
                    raise RuntimeError(f"the training script ended after {event['steps']} steps, before its first "
                                       f"trial was measured: each run must train at least {steps} steps "
                                       f"(warm-up + timed steps per trial{controls}); train it longer")
                deadline = time.monotonic() + self.protocol.trial_timeout_s
            if errors or ended:
                time.sleep(SETTLE_S)  # the other ranks' exits and error lines, for the reason
                errors += [f"rank {e['rank']}: {e['reason']}" for e in results.new_events() if e["event"] == "error"]
                codes = f"exit codes {job.exit_codes()}"
                reason = f"{'; '.join(errors)} ({codes})" if errors else f"job ended, {codes}: {_log_tail(log_path)}"
                return records, reason, started
            if time.monotonic() > deadline:
                what = "trial" if started else "job start"
                limit = self.protocol.trial_timeout_s if started else self.protocol.start_timeout_s
                return records, f"timed out: the {what} did not finish within {limit:.0f} s", started
            time.sleep(POLL_S)

    def _record(self, job_id: str, candidate: Candidate, *, status: str, reason: str | None,
                step_times: list[float], started: str, finished: str | None = None) -> TrialRecord:
        return TrialRecord(
            uid=uuid.uuid4().hex, model=self.model, description_id=self.description_id, cluster=self.cluster,
            kind=candidate.kind, strategy=None if candidate.strategy is None else candidate.strategy.to_dict(),
            fingerprint=candidate.fingerprint, status=status, reason=reason,
            warmup_steps=self.protocol.warmup_steps, step_times=list(step_times), versions=dict(self.versions),
            started=started, finished=finished or utc_now(), host=self.host, job=job_id)


MAX_FALSE_STARTS = 2
"""Jobs in a row that may die before their first trial before the run gives up."""


def _ended(codes: list[int | None]) -> bool:
    """A process failed, or the first one (a worker or the launcher) exited: a clean exit
    without ``done`` is a failure too."""
    return any(code not in (None, 0) for code in codes) or codes[0] is not None


def _log_tail(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as handle:
        lines = [line for line in handle.read()[-4 * LOG_TAIL_CHARS:].splitlines() if "tensorpipe" not in line]
    return "\n".join(lines)[-LOG_TAIL_CHARS:]


def _package_root() -> str:
    """The directory holding the ``hybridsync`` package this runner imports (the workers use the same)."""
    import hybridsync
    return os.path.dirname(os.path.dirname(os.path.abspath(hybridsync.__file__)))
