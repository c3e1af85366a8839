"""Sync-Switch policies: when the parameter-server variables run BSP and when ASP.

A strategy may carry a ``sync`` section (see ``hybridsync/strategy.py``):

    "sync": {"policy": "switch", "switch_at": 0.25, "total_steps": 400}
    "sync": {"policy": "elastic", "enter_slowdown": 2.0, "exit_slowdown": 1.3}

- ``static`` (or no section): every PS variable keeps the protocol it names (``bsp``,
  ``asp``, ``ssp``), as before.
- ``switch``: BSP for the first ``switch_at`` steps (an integer step count, or a fraction
  of ``total_steps``), then ASP for the rest, as Sync-Switch's offline policy does.
- ``elastic``: BSP while no worker lags; ASP while one does (a straggler); BSP again once
  it is gone. The servers see every worker's step reports; ``ElasticPolicy`` turns that
  trace into decisions, with hysteresis so noise does not flap it.

Both dynamic policies start from BSP (every PS variable must say ``protocol: "bsp"``) and,
entering ASP, scale each parameter group's learning rate by ``lr_scale`` and its momentum
by ``momentum_scale`` (Sync-Switch's configuration policy: under ASP every worker applies
its own gradient, so ``"1/n"`` keeps the per-sample step of BSP's averaged gradient). Both
are restored exactly on returning to BSP.

This module is pure (no torch): the decisions are unit-testable on recorded traces.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Literal, Mapping

PolicyName = Literal["static", "switch", "elastic"]
POLICIES: tuple[str, ...] = ("static", "switch", "elastic")
INVERSE_WORKERS = "1/n"
"""A scale of ``1/num_workers`` (the value of ``lr_scale`` / ``momentum_scale``)."""
_KEYS_BY_POLICY: dict[str, frozenset[str]] = {
    "static": frozenset({"policy"}),
    "switch": frozenset({"policy", "switch_at", "total_steps", "lr_scale", "momentum_scale"}),
    "elastic": frozenset({"policy", "lr_scale", "momentum_scale", "enter_slowdown", "exit_slowdown",
                          "enter_after", "exit_after", "window"}),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncPolicy:
    """The ``sync`` section of a strategy: which policy drives the PS variables' protocol."""

    policy: PolicyName = "static"
    """``static`` (the variables' own protocols), ``switch`` (BSP, then ASP) or ``elastic``."""
    switch_at: int | float | None = None
    """``switch``: last BSP step (an integer >= 1), or a fraction in (0, 1) of ``total_steps``."""
    total_steps: int | None = None
    """``switch``: the training length a fractional ``switch_at`` refers to."""
    lr_scale: float | str = INVERSE_WORKERS
    """Learning-rate factor while in ASP (a number > 0, or ``"1/n"``: one over the workers)."""
    momentum_scale: float | str = 1.0
    """Momentum factor while in ASP (a number >= 0, or ``"1/n"``)."""
    enter_slowdown: float = 2.0
    """``elastic``: go ASP when the slowest worker is this much slower than the median one ...
    (above what BSP's scheduling noise alone reaches: benchmarks/RESULTS.md, "syncswitch.py")"""
    exit_slowdown: float = 1.3
    """... and back to BSP when it is at most this much slower (below ``enter_slowdown``)."""
    enter_after: int = 3
    """``elastic``: consecutive steps above ``enter_slowdown`` before going ASP."""
    exit_after: int = 5
    """``elastic``: consecutive steps at most ``exit_slowdown`` before returning to BSP."""
    window: int = 5
    """``elastic``: steps each slowdown is the median over (smooths single noisy steps)."""

    def __post_init__(self) -> None:
        raw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name in _KEYS_BY_POLICY.get(self.policy, frozenset()) or getattr(self, f.name) != f.default}
        errors = policy_errors(raw)
        if errors:
            raise ValueError("invalid sync policy: " + "; ".join(errors))

    @property
    def dynamic(self) -> bool:
        """True for the policies that change the protocol during training."""
        return self.policy != "static"

    def switch_step(self) -> int:
        """``switch``: the step after which training runs ASP (``switch_at`` resolved to steps)."""
        assert self.policy == "switch" and self.switch_at is not None
        if isinstance(self.switch_at, int):
            return self.switch_at
        assert self.total_steps is not None
        return max(1, round(self.switch_at * self.total_steps))

    def scale(self, which: Literal["lr_scale", "momentum_scale"], num_workers: int) -> float:
        """The factor ``lr_scale`` or ``momentum_scale`` stands for with ``num_workers`` workers."""
        value = getattr(self, which)
        return 1.0 / num_workers if value == INVERSE_WORKERS else float(value)

    def to_dict(self, include_defaults: bool = False) -> dict[str, Any]:
        """The document form: the keys of this policy, defaults omitted unless asked for."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _KEYS_BY_POLICY[self.policy] and (
                    field.name == "policy" or include_defaults or value != field.default):
                out[field.name] = value
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "SyncPolicy":
        """Parse and validate a ``sync`` section; ``ValueError`` naming every bad key."""
        errors = policy_errors(raw)
        if errors:
            raise ValueError("invalid sync policy: " + "; ".join(errors))
        return cls(**raw)  # type: ignore[arg-type]


def policy_errors(raw: Any, where: str = "sync") -> list[str]:
    """Every problem with a ``sync`` section, one message per key, each naming it."""
    if not isinstance(raw, Mapping):
        return [f"{where}: expected a mapping such as {{\"policy\": \"switch\", ...}}, got {type(raw).__name__}"]
    policy = raw.get("policy", "static")
    if policy not in POLICIES:
        return [f"{where}.policy {policy!r} is not one of {', '.join(POLICIES)}"]
    allowed = _KEYS_BY_POLICY[policy]
    errors = [f"{where}.{key} is not a key of policy {policy!r} (allowed: {', '.join(sorted(allowed))})"
              for key in raw if key not in allowed]
    for key in ("lr_scale", "momentum_scale"):
        if key in raw and raw[key] != INVERSE_WORKERS:
            value = raw[key]
            if not _is_number(value) or not (value > 0 if key == "lr_scale" else value >= 0):
                bound = "> 0" if key == "lr_scale" else ">= 0"
                errors.append(f"{where}.{key} must be a number {bound} or {INVERSE_WORKERS!r}, got {raw[key]!r}")
    if policy == "switch":
        errors += _switch_errors(raw, where)
    if policy == "elastic":
        errors += _elastic_errors(raw, where)
    return errors


def _switch_errors(raw: Mapping[str, Any], where: str) -> list[str]:
    switch_at, total = raw.get("switch_at"), raw.get("total_steps")
    errors = []
    if total is not None and (not _is_int(total) or total < 1):
        errors.append(f"{where}.total_steps must be an integer >= 1, got {total!r}")
    if switch_at is None:
        errors.append(f"{where}.switch_at is required for policy 'switch' (a step count, or a fraction "
                      f"of total_steps)")
    elif _is_int(switch_at):
        if switch_at < 1:
            errors.append(f"{where}.switch_at must be >= 1 (steps of BSP), got {switch_at!r}")
    elif isinstance(switch_at, float):
        if not 0.0 < switch_at < 1.0:
            errors.append(f"{where}.switch_at as a fraction must be in (0, 1), got {switch_at!r}")
        elif total is None:
            errors.append(f"{where}.switch_at {switch_at!r} is a fraction: it needs total_steps")
    else:
        errors.append(f"{where}.switch_at must be a step count or a fraction, got {switch_at!r}")
    return errors


def _elastic_errors(raw: Mapping[str, Any], where: str) -> list[str]:
    errors = []
    for key in ("enter_slowdown", "exit_slowdown"):
        if key in raw and (not _is_number(raw[key]) or raw[key] < 1.0):
            errors.append(f"{where}.{key} must be a number >= 1 (slowest / median worker), got {raw[key]!r}")
    for key in ("enter_after", "exit_after", "window"):
        if key in raw and (not _is_int(raw[key]) or raw[key] < 1):
            errors.append(f"{where}.{key} must be an integer >= 1, got {raw[key]!r}")
    enter, leave = raw.get("enter_slowdown", 2.0), raw.get("exit_slowdown", 1.3)
    if _is_number(enter) and _is_number(leave) and leave >= enter:
        errors.append(f"{where}.exit_slowdown ({leave}) must be below enter_slowdown ({enter}): the gap "
                      f"is the hysteresis that keeps noise from flapping the protocol")
    return errors


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- elastic: decisions from a step-time trace ------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
    """Switch the PS variables to ``protocol``; ``reason`` says why (it is logged)."""

    protocol: Literal["bsp", "asp"]
    reason: str
    step: int
    """The switch happens after this step (every worker's own step count): the step after the
    newest one any worker had reported, so every worker learns it before finishing that step."""


class ElasticPolicy:
    """Straggler detection on the step reports the servers receive.

    Each worker reports the moment it finished computing a step (``observe(worker, step,
    time)``; a worker's reports arrive in order). The signal is the *slowdown*: how much
    slower the slowest worker runs than the median one.

    - Under BSP every worker waits for the slowest, so step times alone do not show who
      lags; the arrival lag does. With ``I`` the median interval between reports and ``L``
      the largest lag of a worker behind the median report of a step (each worker's lag the
      median over ``window`` steps, so a straggler must be late step after step, not once),
      the slowdown is ``I / (I - L)``: the step time over what it would be without the lag.
    - Under ASP each worker runs at its own pace: the slowdown is the slowest worker's
      mean report interval (over its last ``window`` steps) over the median worker's.

    One evaluation ("tick") per step, once every worker has reported it, except in the
    first ``window`` steps of a protocol (warm-up: a new plan's first steps create keys and
    seed parameters); each slowdown is the median of the last ``window`` ticks. ``enter_after`` ticks in a row at or above
    ``enter_slowdown`` switch to ASP; ``exit_after`` ticks in a row at or below
    ``exit_slowdown`` switch back. A decision takes effect after step ``Decision.step``;
    the trace then starts afresh from there, so one protocol's trace never judges the other.
    """

    def __init__(self, config: SyncPolicy, num_workers: int) -> None:
        if config.policy != "elastic":
            raise ValueError(f"ElasticPolicy needs policy 'elastic', got {config.policy!r}")
        if num_workers < 2:
            raise ValueError(f"an elastic policy needs >= 2 workers to compare, got {num_workers}")
        self.config = config
        self.num_workers = num_workers
        self.slowdowns: list[float] = []
        """Every tick's smoothed slowdown since the last switch (for logs and tests)."""
        self._max_seen = 0
        self._reset("bsp", after_step=0)

    def _reset(self, protocol: Literal["bsp", "asp"], after_step: int) -> None:
        """Forget the trace: from step ``after_step + 1`` on the workers run ``protocol``."""
        self.protocol: Literal["bsp", "asp"] = protocol
        self._first = after_step + 1
        self._times: dict[int, dict[int, float]] = {w: {} for w in range(self.num_workers)}
        self._ticked = after_step
        self._raw: list[float] = []
        self._intervals: list[float] = []
        self._lags: dict[int, list[float]] = {w: [] for w in range(self.num_workers)}
        self._run = 0
        self.slowdowns = []

    def observe(self, worker: int, step: int, time: float) -> Decision | None:
        """Record a report; a ``Decision`` when the policy switches protocols, else ``None``."""
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"worker {worker} is not in 0..{self.num_workers - 1}")
        self._max_seen = max(self._max_seen, step)
        if step < self._first:
            return None  # still the previous protocol (or the switch step itself)
        self._times[worker][step] = time
        decision = None
        while decision is None and all(self._ticked + 1 in times for times in self._times.values()):
            self._ticked += 1
            decision = self._tick(self._ticked)
        return decision

    def resume(self, protocol: Literal["bsp", "asp"], after_step: int) -> None:
        """Start a fresh trace after ``after_step``, the workers on ``protocol``: a replaced server 0
        rebuilds its coordinator from what the workers report (``backends/ps/coordinator.py``)."""
        self._max_seen = max(self._max_seen, after_step)
        self._reset(protocol, after_step=after_step)

    def _tick(self, step: int) -> Decision | None:
        if step < self._first + self.config.window:
            return None  # warm-up: a new plan's first steps create keys and seed parameters
        measured = self._bsp_slowdown(step) if self.protocol == "bsp" else self._asp_slowdown(step)
        self._forget(step)
        if measured is None:
            return None
        slowdown, worker = measured
        self._raw.append(slowdown)
        # BSP's estimate is smoothed per worker already; ASP's rates are, over the window, too,
        # but the fastest workers' rates move with the CPU the others leave: smooth the ratio.
        smoothed = slowdown if self.protocol == "bsp" else statistics.median(self._raw[-self.config.window:])
        self.slowdowns.append(smoothed)
        if self.protocol == "bsp":
            self._run = self._run + 1 if smoothed >= self.config.enter_slowdown else 0
            if self._run >= self.config.enter_after:
                return self._decide("asp", f"worker{worker} lags: slowdown {smoothed:.2f} >= "
                                           f"{self.config.enter_slowdown} for {self._run} steps")
        else:
            self._run = self._run + 1 if smoothed <= self.config.exit_slowdown else 0
            if self._run >= self.config.exit_after:
                return self._decide("bsp", f"no straggler: slowdown {smoothed:.2f} <= "
                                           f"{self.config.exit_slowdown} for {self._run} steps")
        return None

    def _decide(self, protocol: Literal["bsp", "asp"], reason: str) -> Decision:
        step = self._max_seen + 1
        self._reset(protocol, after_step=step)
        return Decision(protocol=protocol, reason=reason, step=step)

    def _bsp_slowdown(self, step: int) -> tuple[float, int] | None:
        now = [self._times[w][step] for w in range(self.num_workers)]
        before = [self._times[w][step - 1] for w in range(self.num_workers)]
        self._intervals.append(statistics.median(b - a for a, b in zip(before, now)))
        middle = statistics.median(now)
        for worker, lags in self._lags.items():
            lags.append(now[worker] - middle)
        window = self.config.window
        interval = statistics.median(self._intervals[-window:])
        # Noise delays a different worker each step; a straggler is late step after step:
        # each worker's lag is the median of its last ``window`` lags.
        lags = [statistics.median(self._lags[w][-window:]) for w in range(self.num_workers)]
        lag = max(lags)
        if interval <= 0:
            return None
        # A lag of a whole step means the others waited all of it: cap the estimate at 20x.
        return interval / max(interval - lag, interval * 0.05), lags.index(lag)

    def _asp_slowdown(self, step: int) -> tuple[float, int] | None:
        rates = []
        for w in range(self.num_workers):
            times = self._times[w]
            newest = max(times)  # a faster worker may be ahead of ``step``
            oldest = max(step - self.config.window, min(times))
            rates.append((times[newest] - times[oldest]) / max(newest - oldest, 1))
        median = statistics.median(rates)
        if median <= 0:
            return None
        return max(rates) / median, rates.index(max(rates))

    def _forget(self, step: int) -> None:
        """Drop reports no later tick reads (older than a window before this step)."""
        keep_from = step - self.config.window
        del self._raw[:-self.config.window], self._intervals[:-self.config.window]
        for lags in self._lags.values():
            del lags[:-self.config.window]
        for times in self._times.values():
            for old in [s for s in times if s < keep_from]:
                del times[old]
