"""Trials inside any training script: a step hook measures a schedule of strategies in flight.

The zoo's trial worker (``hybridsync.trials.worker``) knows its model; a user's
``train.py`` is known only through its ``hybridsync.DistributedOptimizer``. When the trial
runner starts a script with ``HYBRIDSYNC_TRIALS=<schedule.jsonl>`` (and
``HYBRIDSYNC_TRIALS_RESULTS``, ``_WARMUP``, ``_STEPS``, ``_SETTLE_S``), the first optimizer of each rank
drives the trials from ``step()``, whatever loop the script runs:

- rank 0 reads the schedule and broadcasts it; the optimizer switches to the first
  strategy with ``set_strategy`` (collective, at a step boundary);
- every ``step()`` ends one timed interval (end of the previous step to the end of this
  one: data, forward, backward, synchronization and update); after ``warmup + timed``
  intervals the slowest rank's times are written as a ``trial`` event and the next
  strategy is switched in;
- before the first trial every rank waits ``_SETTLE_S`` seconds, while the job's other
  processes (parameter servers) finish starting: a job's first seconds run slow;
- a strategy the optimizer refuses (``ValueError`` on every rank) is a failed trial;
- a script may build several optimizers (a sparse and a dense one; one rebuilt for a new
  phase): each gets its own hook (``ScriptTrials.hook_for``), the newest one times the steps,
  and every other one takes its part of the trial's strategy at the end of its own step (its
  gradients may be in flight while the timing one switches); one that refuses it fails the trial;
- after the last trial rank 0 writes ``done`` and the hook ends the run (the front end
  ends the process with exit code 0).

The events are those of the zoo worker (``ready``, ``trial``, ``done``; written by
``ResultsFile``, shared with it), so one runner follows both. A script that ends before the
schedule does (it trains fewer steps than the trials need) writes ``exhausted`` at exit:
the runner then starts it again for the rest. A schedule entry whose strategy is null
measures the optimizer with no strategy (every variable ring all-reduced through Horovod,
with Horovod's fusion: the drop-in default).
"""
from __future__ import annotations

import atexit
import datetime
import json
import os
import socket
import time
from typing import Any

from hybridsync import envvars
from hybridsync.frameworks import versions
from hybridsync.hooks.base import StepHook
from hybridsync.strategy import Strategy


def from_environment(optimizer: Any, hvd: Any) -> "ScriptTrials | None":
    """Started ``ScriptTrials`` for ``optimizer`` if ``HYBRIDSYNC_TRIALS`` is set, else ``None``."""
    schedule = os.environ.get(envvars.TRIALS)
    if not schedule:
        return None
    results = os.environ.get(envvars.TRIALS_RESULTS)
    if not results:
        raise ValueError(f"{envvars.TRIALS} is set but {envvars.TRIALS_RESULTS} is not: the trial runner sets both")
    settle_s = envvars.seconds_from_env(envvars.TRIALS_SETTLE_S, 0.0)
    return ScriptTrials(optimizer, hvd, schedule, results, warmup=_count(envvars.TRIALS_WARMUP, 0),
                        timed=_count(envvars.TRIALS_STEPS, 1), settle_s=settle_s)


def _count(name: str, minimum: int) -> int:
    raw = os.environ.get(name, "")
    if not raw.isdigit() or int(raw) < minimum:
        raise ValueError(f"{name}={raw!r}: expected an integer >= {minimum} (set by the trial runner)")
    return int(raw)


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


class ResultsFile:
    """Appends JSON lines that survive this process dying right after ``write`` returns."""

    def __init__(self, path: str) -> None:
        self.path = path

    def write(self, event: dict[str, Any]) -> None:
        line = json.dumps(event, separators=(",", ":")) + "\n"
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())


def slowest_rank_times(hvd: Any, times: list[float], name: str) -> list[float]:
    """Per step, the slowest rank's time (a step ends for the job when its last rank ends it)."""
    everyone = hvd.allgather_object(times, name=name)
    return [max(rank_times[i] for rank_times in everyone) for i in range(len(times))]


class ScriptTrials:
    """One rank's progress through the schedule. Each optimizer of the script steps it through its own
    hook (``hook_for``); the newest one, ``optimizer``, times the steps and switches the strategies
    (a script that rebuilds its optimizer steps the newest only), the others follow it."""

    def __init__(self, optimizer: Any, hvd: Any, schedule_path: str, results_path: str, *,
                 warmup: int, timed: int, settle_s: float = 0.0) -> None:
        self.optimizer, self.hvd = optimizer, hvd
        self.warmup, self.timed = warmup, timed
        self.results = ResultsFile(results_path) if hvd.rank() == 0 else None
        schedule = None
        if hvd.rank() == 0:
            with open(schedule_path, encoding="utf-8") as handle:
                schedule = [json.loads(line) for line in handle if line.strip()]
        self.schedule: list[dict[str, Any]] = hvd.broadcast_object(schedule, root_rank=0, name="trials.schedule")
        self.position = 0
        """Index into the schedule of the trial being measured (== len(schedule): all done)."""
        self.running: Strategy | None = None
        """The strategy of the trial being measured, which every optimizer of the script takes."""
        self._timing: _TrialsHook | None = None
        """The hook of ``optimizer``, the one that times the steps."""
        self._refused: str | None = None
        """Why another optimizer refused ``running``: the trial fails at the timing optimizer's next step."""
        self.steps_seen = 0
        self._times: list[float] = []
        self._last = time.perf_counter()
        self._started = ""
        self._write({"event": "ready", "time": utc_now(), "host": socket.gethostname(), "size": hvd.size(),
                     "versions": versions()})
        atexit.register(self._at_exit)
        time.sleep(settle_s)  # the job's other processes (parameter servers) finish starting
        self.done = not self._begin()
        """Every trial of the schedule is over: the next ``after_step`` ends the run."""

    def hook_for(self, optimizer: Any) -> StepHook:
        """The hook of ``optimizer``: the first one's (which built this) or a newer one's, which times
        the steps from now on (it takes the running strategy now: none of its gradients is in flight
        yet); the trial under way starts its steps again with it."""
        hook = _TrialsHook(self, optimizer)
        if self._timing is not None:
            self._timing.taken = self.running
            self.optimizer = optimizer
            self._switch(hook)
            self._times, self._last = [], time.perf_counter()
        self._timing = hook
        return hook

    def after_step_of(self, hook: "_TrialsHook") -> bool:
        """``hook``'s optimizer ended a step: the timing one ends an interval, any other takes the
        running strategy if it changed. ``True`` once the schedule is done: the run is over."""
        if hook is not self._timing:
            if hook.taken is not self.running:
                self._switch(hook)
            return False
        return self._after_step()

    def _switch(self, hook: "_TrialsHook") -> None:
        """Give ``hook``'s optimizer its part of the running strategy; a refusal fails the trial."""
        hook.taken = self.running
        if self.running is None:
            return
        try:
            hook.optimizer.set_strategy(self.running)
        except ValueError as error:  # raised on every rank; this optimizer's previous plan stays
            self._refused = str(error)

    def _after_step(self) -> bool:
        """Ends one step's interval; at the end of a trial, records it and switches to the next."""
        if self.done:
            return True
        now = time.perf_counter()
        self.steps_seen += 1
        self._times.append(now - self._last)
        self._last = now
        if self._refused is not None:  # raised on every rank, as set_strategy's refusals are
            self._trial("failed", f"refused: {self._refused}", [])
            self._refused = None
        elif len(self._times) == self.warmup + self.timed:
            times = slowest_rank_times(self.hvd, self._times, name=f"trials.{self.position}.times")
            self._trial("ok", None, times)
        else:
            return False
        self.position += 1
        self.done = not self._begin()
        return self.done

    def _begin(self) -> bool:
        """Switches to the next strategy the optimizer accepts (refusals are failed trials): ``True``;
        or, with none left, writes ``done``: ``False``."""
        while self.position < len(self.schedule):
            entry = self.schedule[self.position]
            self._started = utc_now()
            strategy = Strategy.from_dict(entry["strategy"]) if entry["strategy"] is not None else Strategy(variables={})
            try:
                self.optimizer.set_strategy(strategy)
                self.running = strategy
            except ValueError as error:  # raised on every rank; the previous plan stays in force
                self._trial("failed", f"refused: {error}", [])
                self.position += 1
                continue
            self.hvd.barrier()  # every rank starts the trial's first interval together
            self._times, self._last = [], time.perf_counter()
            return True
        self._write({"event": "done", "time": utc_now()})
        self.hvd.barrier()
        return False

    def _trial(self, status: str, reason: str | None, times: list[float]) -> None:
        self._write({"event": "trial", "index": self.schedule[self.position]["index"], "status": status,
                     "reason": reason, "step_times": times, "started": self._started, "finished": utc_now()})

    def _write(self, event: dict[str, Any]) -> None:
        if self.results is not None:
            self.results.write(event)

    def _at_exit(self) -> None:
        if self.position < len(self.schedule):
            self._write({"event": "exhausted", "index": self.schedule[self.position]["index"],
                         "steps": self.steps_seen, "time": utc_now()})


class _TrialsHook(StepHook):
    """One optimizer's part in the trials: its steps reach ``ScriptTrials``, which knows it by this hook."""

    def __init__(self, trials: ScriptTrials, optimizer: Any) -> None:
        self.trials, self.optimizer = trials, optimizer
        self.taken: Strategy | None = None
        """The strategy last given to ``optimizer`` (one that does not time the steps follows ``running``)."""

    def after_step(self) -> bool:
        return self.trials.after_step_of(self)
