"""The ranks of a trial job: one zoo model (or generated one), many strategies, measured one after the other.

    python -m hybridsync.trials.worker --model ncf --schedule S.jsonl --results R.jsonl

Started on every rank by the trial runner (``hybridsync.trials.runner``), under any
launcher. Rank 0 reads the schedule (one candidate per line: ``index``, ``kind``,
``strategy`` document or null for plain Horovod) and broadcasts it. For each candidate,
every rank switches its ``hybridsync.DistributedOptimizer`` to the strategy with
``set_strategy`` (so one job serves every trial), trains ``warmup + timed`` steps and times
each; the slowest rank's time of each step is the trial's. The reference rows train a copy
of the model under ``horovod.torch.DistributedOptimizer`` itself: ``horovod`` as it comes,
``horovod-fp16`` with ``compression=hvd.Compression.fp16`` (refused, as a failed trial, on a
model with sparse gradients, which Horovod 0.28.1's fp16 cannot take). ``local-no-sync`` trains a
copy under the zoo model's plain torch optimizer: no gradient leaves its rank, so it times the
step no synchronization strategy can beat (a benchmark's reference, never a strategy).

Results are appended to the results file (JSON lines, flushed and fsynced) as they come:
``ready`` (versions, host), one ``trial`` per candidate (``status`` ok or failed), ``done``.
With ``HYBRIDSYNC_TRIAL_REPLICA_SUMS=1`` each ``trial`` line also holds ``replica_sums``: every
rank's sum of the trained copy's parameters after the trial (equal when the ranks stayed in sync).
A strategy the optimizer refuses (``ValueError`` on every rank) is a failed trial and the
job goes on. Any other error is written as an ``error`` line by the rank that saw it, which
then exits at once: the runner records the trial as failed and starts a new job for the rest.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import time
from typing import Any

from hybridsync import envvars
from hybridsync.baselines import horovod_fp16_blocker
from hybridsync.frameworks import versions
from hybridsync.hooks.trials import ResultsFile, slowest_rank_times, utc_now
from hybridsync.trials.store import HOROVOD_FP16_KIND, base_kind, is_local
from hybridsync.variables import variables_from_model

BATCHES_PER_RANK = 4
"""Batches made before the first step and cycled, so that no data generation is timed."""


def timed_steps(zoo_model: Any, model: Any, optimizer: Any, batches: list, count: int) -> list[float]:
    """Seconds of each of ``count`` training steps of this rank, cycling through ``batches``."""
    from hybridsync.zoo import train_step
    times = []
    for step in range(count):
        start = time.perf_counter()
        train_step(zoo_model, model, optimizer, batches[step % len(batches)])
        times.append(time.perf_counter() - start)
    return times


class TrialWorker:
    """One rank's state across the trials of a job."""

    def __init__(self, args: argparse.Namespace) -> None:
        import horovod.torch as hvd
        import torch

        import hybridsync as hs
        from hybridsync.backends import waiting
        from hybridsync.zoo import get
        hs.init()
        waiting.use_for_horovod(hvd)  # the reference row waits as hybridsync does (HYBRIDSYNC_WAIT)
        torch.set_num_threads(1)  # ranks share the cores; intra-op threads would only fight over them
        torch.manual_seed(args.seed)
        self.hvd, self.args = hvd, args
        self.zoo_model = get(args.model)
        self.model = self.zoo_model.build()
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        generator = torch.Generator().manual_seed(args.seed * 1000 + hvd.rank())
        self.batches = [self.zoo_model.make_batch(generator) for _ in range(BATCHES_PER_RANK)]
        self.optimizer = hs.DistributedOptimizer(
            self.zoo_model.optimizer(self.model),
            named_parameters=self.model.named_parameters())
        self._horovod: dict[bool, tuple[Any, Any]] = {}
        self._local: tuple[Any, Any] | None = None

    def horovod_reference(self, fp16: bool = False) -> tuple[Any, Any]:
        """A copy of the model under plain ``horovod.torch.DistributedOptimizer``, with
        ``compression=hvd.Compression.fp16`` if ``fp16`` (each made once); ``ValueError`` for fp16
        on a model with sparse gradients, which Horovod 0.28.1 cannot run."""
        blocker = horovod_fp16_blocker(variables_from_model(self.model)) if fp16 else None
        if blocker:
            raise ValueError(f"not runnable: {blocker}")
        if fp16 not in self._horovod:
            model = copy.deepcopy(self.model)
            optimizer = self.hvd.DistributedOptimizer(
                self.zoo_model.optimizer(model), named_parameters=model.named_parameters(),
                compression=self.hvd.Compression.fp16 if fp16 else self.hvd.Compression.none)
            self._horovod[fp16] = (model, optimizer)
        return self._horovod[fp16]

    def local_reference(self) -> tuple[Any, Any]:
        """A copy of the model under the zoo model's plain torch optimizer (made once): each rank
        steps on its own gradients, nothing is synchronized."""
        if self._local is None:
            model = copy.deepcopy(self.model)
            self._local = (model, self.zoo_model.optimizer(model))
        return self._local

    def trained(self, entry: dict[str, Any]) -> tuple[Any, Any]:
        """The (model, optimizer) that trains ``entry``: a reference row's copy, or the hybridsync
        optimizer switched to the entry's strategy."""
        if is_local(entry["kind"]):
            return self.local_reference()
        if entry["strategy"] is None:
            return self.horovod_reference(fp16=base_kind(entry["kind"]) == HOROVOD_FP16_KIND)
        self.optimizer.set_strategy(entry["strategy"])
        return self.model, self.optimizer

    def measure(self, entry: dict[str, Any]) -> tuple[list[float], list[float] | None]:
        """Switch to the entry's strategy, then time warm-up + timed steps (slowest rank per step).
        Returns the times and, if ``HYBRIDSYNC_TRIAL_REPLICA_SUMS`` is ``1``, every rank's sum of
        the trained model's parameters after them."""
        steps = self.args.warmup_steps + self.args.timed_steps
        self._inject_fault(entry["kind"])
        model, optimizer = self.trained(entry)
        self.hvd.barrier()
        times = timed_steps(self.zoo_model, model, optimizer, self.batches, steps)
        times = slowest_rank_times(self.hvd, times, name=f"trial.{entry['index']}.times")
        if os.environ.get(envvars.TRIAL_REPLICA_SUMS) != "1":
            return times, None
        total = sum(float(p.detach().double().sum()) for p in model.parameters())
        return times, self.hvd.allgather_object(total, name=f"trial.{entry['index']}.sums")

    def _inject_fault(self, kind: str) -> None:
        faults = dict(item.rpartition(":")[::2] for item in os.environ.get(envvars.TRIAL_FAULT, "").split(",") if item)
        fault = faults.get(kind)
        if fault is None or self.hvd.rank() != self.hvd.size() - 1:
            return
        if fault == "crash":
            os._exit(9)
        if fault == "hang":
            time.sleep(24 * 3600)


def run(args: argparse.Namespace) -> None:
    worker = TrialWorker(args)
    hvd = worker.hvd
    results = ResultsFile(args.results)
    schedule = None
    if hvd.rank() == 0:
        with open(args.schedule, encoding="utf-8") as handle:
            schedule = [json.loads(line) for line in handle if line.strip()]
    schedule = hvd.broadcast_object(schedule, root_rank=0, name="trial.schedule")
    if hvd.rank() == 0:
        results.write({"event": "ready", "time": utc_now(), "host": socket.gethostname(), "size": hvd.size(),
                       "versions": versions()})
    time.sleep(args.settle_s)  # the job's other processes (parameter servers) finish starting
    for entry in schedule:
        started = utc_now()
        try:
            (times, sums), status, reason = worker.measure(entry), "ok", None
        except ValueError as error:  # refused by set_strategy on every rank; the old plan stays in force
            times, sums, status, reason = [], None, "failed", f"refused: {error}"
        except Exception as error:  # noqa: BLE001 - reported, then this rank leaves the job
            results.write({"event": "error", "index": entry["index"], "rank": hvd.rank(), "time": utc_now(),
                           "reason": f"{type(error).__name__}: {error}"})
            sys.stderr.write(f"trial worker rank {hvd.rank()}: {type(error).__name__}: {error}\n")
            sys.stderr.flush()
            os._exit(3)  # peers may be blocked in a collective: no clean shutdown is possible
        if hvd.rank() == 0:
            results.write({"event": "trial", "index": entry["index"], "status": status, "reason": reason,
                           "step_times": times, "started": started, "finished": utc_now(),
                           **({"replica_sums": sums} if sums is not None else {})})
    if hvd.rank() == 0:
        results.write({"event": "done", "time": utc_now()})
    hvd.barrier()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hybridsync.trials.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="zoo or generated model name (hybridsync.zoo.get)")
    parser.add_argument("--schedule", required=True, help="JSON lines: index, kind, strategy (null: a reference row, plain Horovod by default)")
    parser.add_argument("--results", required=True, help="JSON lines appended by the ranks")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--timed-steps", type=int, default=40)
    parser.add_argument("--settle-s", type=float, default=0.0, help="seconds every rank waits before the first "
                        "trial, while the job's other processes finish starting")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
