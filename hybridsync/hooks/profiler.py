"""Profiling a training script from a step hook of ``DistributedOptimizer``: the model description's timing.

When ``HYBRIDSYNC_PROFILE=<path>`` is set, the first ``hybridsync.DistributedOptimizer`` of a
single-process job (with the variables of any other the script builds, ``add_variables``; the
newest optimizer times the steps, ``hook``) records, for ``HYBRIDSYNC_PROFILE_STEPS`` steps
after ``HYBRIDSYNC_PROFILE_WARMUP`` warm-up steps:

- forward: from the first module forward call of a step (torch's global module
  forward pre-hook) to the start of the backward pass, so the loss is included;
- backward: the ``torch.autograd.backward`` call (``loss.backward()`` goes through it;
  wrapped for the duration of the profile);
- each parameter's gradient-ready time from the backward start
  (``register_post_accumulate_grad_hook``), hence its ready order;
- rows touched by sparse gradients (distinct indices of the step's gradient), and by dense
  floating ones (rows with a nonzero element: an ``nn.Embedding(sparse=False)``'s gradient is
  zero but for the rows its batch looked up), kept for a dense one only when its median is
  fewer than all its rows; counted before ``step()``'s clock starts and left out of the step;
- the wrapped optimizer's ``step()``, and the whole step (end of one ``step()`` to the next).

It then writes the description (``hybridsync.description``), prints
``hybridsync profile: wrote PATH after N steps`` on stderr and ends the run (the front end
exits with code 0), so a script that would train for hours stops after a few steps.
Nothing it installs changes a gradient or an update: every hook only reads a clock.
With several gradient accumulation passes per step, forward and backward times add up
over them and ready times are those of the last pass. More than one rank is refused:
profile on one process (``hybridsync profile``), where no synchronization distorts the timing.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import shlex
import socket
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import torch

from hybridsync import envvars
from hybridsync.compression import nonzero_row_indices
from hybridsync.description import (ComputeTiming, ModelDescription, VariableTiming, save_description,
                                    variables_from_parameters)
from hybridsync.hooks.base import StepHook

_SECONDS_DIGITS = 7  # 0.1 us: finer than a clock read costs, short enough to keep files readable


def from_environment(named_parameters: Sequence[tuple[str, Any]], num_ranks: int,
                     torch_hooks: bool = True) -> "Profiler | None":
    """A started ``Profiler`` if ``HYBRIDSYNC_PROFILE`` is set, else None (one per process:
    ``hybridsync.hooks.StepHookBuilder`` asks). ``torch_hooks=False``: the frontend reports each
    backward pass (``record_backward``)."""
    path = os.environ.get(envvars.PROFILE)
    if not path:
        return None
    if num_ranks > 1:
        raise ValueError(f"{envvars.PROFILE} is set but this job has {num_ranks} ranks: profiling runs on one "
                         f"process, without a launcher (hybridsync profile -o {path} -- python train.py ...)")
    steps = envvars.int_from_env(envvars.PROFILE_STEPS, envvars.PROFILE_STEPS_DEFAULT, minimum=1)
    warmup = envvars.int_from_env(envvars.PROFILE_WARMUP, envvars.PROFILE_WARMUP_DEFAULT, minimum=0)
    return Profiler(path, named_parameters, steps=steps, warmup=warmup, torch_hooks=torch_hooks)


@dataclasses.dataclass
class _StepRecord:
    """What one training step measured (times in seconds)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    step_s: float = 0.0
    backward_passes: int = 0
    ready_s: dict[str, float] = dataclasses.field(default_factory=dict)
    rows_touched: dict[str, int] = dataclasses.field(default_factory=dict)
    """Sparse gradients: distinct rows; dense ones (floating, dim >= 1): rows with a nonzero element."""
    counting_s: float = 0.0
    """Time spent counting rows: not the training's, taken out of ``step_s``."""


class Profiler(StepHook):
    """Records steps of one process's training loop; the optimizer calls ``before_step``/``after_step``."""

    def __init__(self, path: str | os.PathLike, named_parameters: Sequence[tuple[str, Any]], *,
                 steps: int, warmup: int, clock: Callable[[], float] = time.perf_counter,
                 torch_hooks: bool = True) -> None:
        self.path = os.fspath(path)
        self.steps, self.warmup = steps, warmup
        self._named = list(named_parameters)
        self._clock = clock
        self._steps_done = 0
        self.finished = False
        """The description is written (and the hooks removed): later steps are not recorded."""
        self.closed = False
        """``close()`` ran: the torch hooks are removed (another profiler may start)."""
        self._records: list[_StepRecord] = []
        self._current = _StepRecord()
        self._forward_start: float | None = None
        """First module forward call since the last backward pass or step (None: none yet)."""
        self._step_start: float | None = None
        self._backward_start: float | None = None
        self._optimizer_start = 0.0
        self._last_backward_end = 0.0
        """End of the last pass given to ``record_backward``: the next pass's forward starts there or later."""
        self._sparse: set[str] = set()
        self._timing: _TimingHook | None = None
        """The hook of the optimizer whose steps are timed (``hook``)."""
        self._original_backward = torch.autograd.backward
        self._handles: list[Any] = []
        if torch_hooks:
            torch.autograd.backward = self._backward
            self._handles = [torch.nn.modules.module.register_module_forward_pre_hook(self._on_forward)]
            self._handles += [p.register_post_accumulate_grad_hook(self._ready_hook(name))
                              for name, p in self._named if p.requires_grad]

    def add_variables(self, named_parameters: Sequence[tuple[str, Any]]) -> list[str]:
        """Profile another optimizer's variables too (a script's sparse and dense optimizers train one
        model, and one step drives both; one rebuilt over the same parameters adds none); returns the
        names left out because another variable already profiled has them (optimizers built without
        ``named_parameters`` name theirs alike)."""
        known = dict(self._named)
        added = [(name, p) for name, p in named_parameters if name not in known]
        self._named += added
        if self._handles:  # torch hooks (the torch front end)
            self._handles += [p.register_post_accumulate_grad_hook(self._ready_hook(name))
                              for name, p in added if p.requires_grad]
        return [name for name, p in named_parameters if name in known and known[name] is not p]

    def hook(self) -> StepHook:
        """A step hook for the newest optimizer of the script, which times the steps from now on (a
        script that rebuilds its optimizer steps the newest only); older optimizers' hooks do nothing."""
        self._timing = _TimingHook(self)
        return self._timing

    # --- events ------------------------------------------------------------------------
    def _on_forward(self, module: Any, args: Any) -> None:
        if self._forward_start is None:
            self._forward_start = self._clock()
            if self._step_start is None:
                self._step_start = self._forward_start

    def _backward(self, *args: Any, **kwargs: Any) -> Any:
        start = self._clock()
        if self._forward_start is not None:
            self._current.forward_s += start - self._forward_start
            self._forward_start = None
        self._backward_start = start
        try:
            return self._original_backward(*args, **kwargs)
        finally:
            self._current.backward_s += self._clock() - start
            self._current.backward_passes += 1

    def now(self) -> float:
        """This profiler's clock, for ``record_backward``."""
        return self._clock()

    def record_backward(self, start: float | None, end: float, ready: Sequence[str]) -> None:
        """A backward pass that no torch hook saw (``hybridsync.tensorflow``), in this profiler's clock:
        it ran from ``start`` to ``end``, the forward pass from the end of the previous step (or pass)
        to ``start``, and the gradients of ``ready`` were all ready at ``end`` (nothing overlaps them).
        ``start=None`` when the frontend could not see the backward pass begin (Keras' ``fit``): the
        interval is split 1:2 between forward and backward, the ratio of their arithmetic in most
        models. Only their sum reaches the step time the simulator predicts, as every gradient is
        ready at the same moment."""
        if self.finished:
            return
        begin = end if self._step_start is None else max(self._step_start, self._last_backward_end)
        if self._step_start is None:
            self._step_start = begin
        if start is None:
            start = begin + (end - begin) / 3
        self._current.forward_s += max(0.0, start - begin)
        self._current.backward_s += end - start
        self._current.backward_passes += 1
        self._last_backward_end = end
        for name in ready:
            self._current.ready_s[name] = end - start

    def _ready_hook(self, name: str) -> Callable[[Any], None]:
        def hook(_: Any) -> None:
            if self._backward_start is not None:
                self._current.ready_s[name] = self._clock() - self._backward_start
        return hook

    def before_step(self) -> None:
        """Just before the wrapped optimizer's ``step()``: count the gradients' touched rows (sparse:
        distinct rows; dense: rows with a nonzero element), start its clock."""
        if self.finished:
            return
        counting_start = self._clock()
        recorded = self._steps_done >= self.warmup  # a warm-up step's rows are never read
        for name, p in self._named:
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                self._sparse.add(name)
                self._current.rows_touched[name] = int(grad._indices()[0].unique().numel())
            elif recorded and grad.dim() >= 1 and grad.is_floating_point():
                self._current.rows_touched[name] = nonzero_rows(grad)
        self._optimizer_start = self._clock()
        self._current.counting_s += self._optimizer_start - counting_start
        if self._step_start is None:
            self._step_start = self._optimizer_start

    def after_step(self) -> bool:
        """Just after the wrapped optimizer's ``step()``: close the step; after the last one, write the
        description and return ``True``: the run is over."""
        if self.finished:
            return False
        end = self._clock()
        self._current.optimizer_s = end - self._optimizer_start
        self._current.step_s = end - self._step_start - self._current.counting_s
        if self._steps_done >= self.warmup:
            self._records.append(self._current)
        self._steps_done += 1
        self._current, self._step_start, self._backward_start = _StepRecord(), end, None
        self._forward_start = None
        if len(self._records) == self.steps:
            self.finish()
        return self.finished

    # --- the result --------------------------------------------------------------------
    def description(self) -> ModelDescription:
        """The description of the profiled steps: the trainable variables (a parameter frozen while
        profiled, ``requires_grad=False``, sends nothing: the runtime skips it, so the simulator must
        not price it and the search need not place it; if it is unfrozen later, the strategy's
        default carries it)."""
        if not self._records:
            raise ValueError("no step was profiled yet")
        missing_backward = sum(1 for r in self._records if r.backward_passes == 0)
        if missing_backward:
            raise ValueError(f"{missing_backward} of {len(self._records)} profiled steps ran no backward pass through "
                             f"torch.autograd.backward (loss.backward() does); cannot time the backward pass")
        timing = ComputeTiming(**{field: _median_seconds([getattr(r, field) for r in self._records])
                                  for field in ("forward_s", "backward_s", "optimizer_s", "step_s")},
                               steps=len(self._records))
        trainable = [(name, p) for name, p in self._named if getattr(p, "requires_grad", True)]
        return ModelDescription(variables=variables_from_parameters(trainable, self._sparse), timing=timing,
                                variable_timing=self._variable_timing(), meta=_meta())

    def _variable_timing(self) -> dict[str, VariableTiming]:
        ready: dict[str, list[float]] = {}
        for record in self._records:
            for name, t in record.ready_s.items():
                ready.setdefault(name, []).append(t)
        medians = {name: statistics.median(times) for name, times in ready.items()}
        first_seen = {name: times[0] for name, times in ready.items()}
        order = sorted(medians, key=lambda name: (medians[name], first_seen[name]))
        all_rows = {name: p.shape[0] for name, p in self._named if p.dim() >= 1}
        out = {}
        for position, name in enumerate(order):
            rows = [r.rows_touched[name] for r in self._records if name in r.rows_touched]
            touched = statistics.median_low(rows) if rows else None
            if name not in self._sparse and touched is not None and touched >= all_rows.get(name, 0):
                touched = None  # a dense gradient records its rows only when fewer than all are nonzero
            out[name] = VariableTiming(ready_order=position, ready_s=_median_seconds(ready[name]),
                                       rows_touched=touched)
        return out

    def finish(self) -> None:
        """Write the description, undo every hook, say so on stderr."""
        desc = self.description()
        self.close()
        save_description(desc, self.path)
        self.finished = True
        total = self.warmup + len(self._records)
        print(f"hybridsync profile: wrote {self.path} after {total} steps "
              f"({self.warmup} warm-up, {len(self._records)} profiled)", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Remove the hooks and restore ``torch.autograd.backward``; training goes on unprofiled."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if torch.autograd.backward == self._backward:
            torch.autograd.backward = self._original_backward
        self.closed = True


class _TimingHook(StepHook):
    """One optimizer's profiling hook: only the newest optimizer's (``Profiler.hook``) times steps."""

    def __init__(self, profiler: Profiler) -> None:
        self.profiler = profiler

    def before_step(self) -> None:
        if self.profiler._timing is self:
            self.profiler.before_step()

    def after_step(self) -> bool:
        return self.profiler._timing is self and self.profiler.after_step()


def _median_seconds(values: Sequence[float]) -> float:
    return round(statistics.median(values), _SECONDS_DIGITS)


def _meta() -> dict[str, str]:
    """Where and with what the profile was taken."""
    from hybridsync.frameworks import versions
    meta = versions()
    meta.update(host=socket.gethostname(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=shlex.join(getattr(sys, "orig_argv", sys.argv)))
    return meta


def nonzero_rows(grad: Any) -> int:
    """Rows of a dense gradient (along dim 0) with a nonzero element: as many as ``rows`` sends."""
    return int(nonzero_row_indices(grad).numel())
