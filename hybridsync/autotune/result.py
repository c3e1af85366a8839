"""What an autotune found, and the verdict against fair rivals.

A speedup counts only over the best *fair* rival: the hand-made strategies (plain Horovod,
every baseline) plus, when the winner uses fp16 compression, Horovod with
``Compression.fp16`` and the baselines' fp16 twins, since a user can turn fp16 on too, and when
it sends a dense embedding's rows, the baselines' rows twins (a user can make it sparse).
Every number of the verdict comes from the confirmation job (one job, interleaved repeats).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from hybridsync.cluster.spec import ClusterSpec
from hybridsync.strategy import Strategy
from hybridsync.trials.candidates import is_rival, rival_levers

TAU_TARGET = 0.8
"""Kendall tau between the trials' ranking and the confirmation job's that the loop aims for."""
RESOLVED_P = 0.05
"""Significance at which the confirmation job's repeats tell two strategies apart (``resolved_pairs``)."""
MIN_RUNOFF_PASSES = 6
"""Fewest runoff passes at which a two-sided Wilcoxon signed-rank test can reach ``RESOLVED_P``
(every pass one way: p = 2 / 2**6 = 0.031; five passes cannot go below 0.0625)."""
MIN_RESOLVING_REPEATS = 3
"""Repeats a kind needs in the confirmation job before its pairs can count as resolved."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialOutcome:
    """One measured trial of the loop, with what the simulator predicted for it beforehand."""

    round: int
    kind: str
    fingerprint: str
    predicted_s: float | None
    measured_s: float | None
    """Median of the timed steps, as its job measured it; ``None`` for a failed trial."""
    reason: str | None = None
    job: str | None = None
    """The trial job that measured it."""
    normalized_s: float | None = None
    """``measured_s`` at an average job's level (``hybridsync.trials.levels``, fit on every trial of
    the autotune): what the loop ranks by."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutotuneResult:
    """What the autotuner found: the winner, every trial, and the confirmation job's verdict."""

    model: str
    cluster: ClusterSpec
    winner_kind: str
    winner: Strategy
    """The strategy to train with (when plain Horovod wins: the empty strategy, every variable ring
    all-reduced through Horovod, which is what hybridsync does without a strategy)."""
    winner_levers: frozenset[str] = frozenset()
    """What the winner uses beyond plain Horovod's numerics (``hybridsync.baselines.levers``)."""
    trials: list[TrialOutcome]
    confirmed_s: dict[str, float]
    """Kind -> median step time in the confirmation job (all repeats' timed steps)."""
    confirmed_repeats_s: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """Kind -> each confirmation repeat's median step time, in the order measured: what tells a
    difference the confirmation job resolves from one inside its noise (``resolved_pairs``)."""
    trial_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Kind -> the trials' step time of the same strategy (normalized), for those the trials measured."""
    not_runnable: dict[str, str] = dataclasses.field(default_factory=dict)
    """Rivals that cannot run on this model (kind -> why), e.g. Horovod's fp16 with sparse gradients."""
    job_levels: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    """Trial job -> its level and drift per minute (``hybridsync.trials.levels.JobLevel``)."""
    exact: bool = False
    unresolved_lead: dict[str, Any] | None = None
    """A search strategy the confirmation job measured faster than the winner, a rival, but within
    the job's noise, so not taken (``{"kind", "step_s", "over", "p"}``; ``hybridsync.autotune.loop``)."""
    runoff: dict[str, Any] | None = None
    """The second job that measured such a lead again, pass by pass beside its rival
    (``{"kind", "over", "passes", "ratio", "p", "taken", "step_s"}``, or ``{"kind", "over", "skipped"}``
    when it would have run past the time limit); ``taken``: the lead held, and the search strategy won."""
    rivals_only: str | None = None
    """Set when the trial budget was spent on the rivals alone (no hand-made mix or search strategy
    measured): why, and the budget that would measure a round of them."""
    rounds_cut: dict[str, Any] | None = None
    """Set when ``AutotuneSettings.time_limit_s`` stopped the rounds short of the trial budget:
    ``measured`` strategies of the ``budget``, and ``why`` (the seconds the loop expected)."""
    seconds: dict[str, float]
    """Wall time of each phase (search, trials, refit, confirm) and the total."""

    @property
    def fair_rivals(self) -> dict[str, float]:
        """Confirmed step time of every rival that uses no lever the winner does not use."""
        return fair_rivals(self.confirmed_s, self.winner_levers)

    @property
    def best_rival(self) -> tuple[str, float] | None:
        """The fastest fair rival in the confirmation job: what the winner's speedup is over."""
        rivals = self.fair_rivals
        return min(rivals.items(), key=lambda item: item[1]) if rivals else None

    @property
    def runner_up_rival(self) -> tuple[str, float] | None:
        """The fastest fair rival that is not the winner itself: ``best_rival``, or when a rival won
        the confirmation job, the next one (what a side-by-side run of the winner should face)."""
        rivals = {kind: s for kind, s in self.fair_rivals.items() if kind != self.winner_kind}
        return min(rivals.items(), key=lambda item: item[1]) if rivals else None

    @property
    def speedup(self) -> float | None:
        """Best fair rival's confirmed step time over the winner's (> 1: the winner is faster)."""
        best = self.best_rival
        return None if best is None else self.speedup_over(best[0])

    def speedup_over(self, kind: str) -> float | None:
        """Confirmed step time of ``kind`` over the winner's (> 1: the winner is faster)."""
        if kind not in self.confirmed_s:
            return None
        return self.confirmed_s[kind] / self.confirmed_s[self.winner_kind]

    @property
    def kendall_tau(self) -> float | None:
        """Kendall tau (tau-b) of the trials' ranking against the confirmation job's, over the
        strategies measured in both (``None`` for fewer than 3)."""
        return kendall_tau_between(self.confirmed_s, self.trial_s)

    def resolved_pairs(self) -> list[tuple[str, str]]:
        """Pairs ``(faster, slower)`` of kinds measured in the trials and the confirmation job whose
        confirmation repeats separate them beyond the job's noise (Mann-Whitney U on the repeats'
        medians, two-sided p < ``RESOLVED_P``: with four repeats each, every repeat of one faster than
        every repeat of the other). Pairs inside the noise have no order a ranking could reproduce."""
        kinds = sorted(kind for kind in self.confirmed_s if kind in self.trial_s
                       and len(self.confirmed_repeats_s.get(kind, ())) >= MIN_RESOLVING_REPEATS)
        pairs = []
        for i, a in enumerate(kinds):
            for b in kinds[i + 1:]:
                p = repeats_p(self.confirmed_repeats_s[a], self.confirmed_repeats_s[b])
                if p is not None and p < RESOLVED_P:
                    pairs.append((a, b) if self.confirmed_s[a] < self.confirmed_s[b] else (b, a))
        return pairs

    @property
    def resolved_tau(self) -> float | None:
        """Kendall tau over the ``resolved_pairs`` only: (pairs the trials order as the confirmation
        does - pairs they order the other way) / resolved pairs; ``None`` when there are none."""
        pairs = self.resolved_pairs()
        if not pairs:
            return None
        agree = sum(1 if self.trial_s[fast] < self.trial_s[slow] else -1 if self.trial_s[fast] > self.trial_s[slow]
                    else 0 for fast, slow in pairs)
        return agree / len(pairs)

    def best_so_far(self) -> list[float]:
        """Fastest (normalized) step time measured after each trial, in the order measured (seconds)."""
        out, best = [], float("inf")
        for trial in self.trials:
            value = trial.normalized_s if trial.normalized_s is not None else trial.measured_s
            if value is not None:
                best = min(best, value)
            out.append(best)
        return out

    def verdict(self) -> str:
        """One line: the winner, its speedup and the rival it is over (and why that rival is the fair one).
        A rival that won is its own best fair rival: the line then names the next one it beat, as the
        report does (it read "winner X ...; best fair rival X ...: 1.00x", naming nothing it beat)."""
        best, runner_up = self.best_rival, self.runner_up_rival
        winner_s = self.confirmed_s[self.winner_kind]
        line = f"winner {self.winner_kind}, {winner_s * 1e3:.1f} ms per step"
        if best is not None and best[0] == self.winner_kind and runner_up is not None and runner_up != best:
            line += (f" (a rival: nothing measured beat it); next fair rival {runner_up[0]} "
                     f"{runner_up[1] * 1e3:.1f} ms: {runner_up[1] / winner_s:.2f}x")
        elif best is not None:
            line += f"; best fair rival {best[0]} {best[1] * 1e3:.1f} ms: {self.speedup:.2f}x"
        line += f" ({rival_rule(self)})"
        line += f"; {lead_text(self.unresolved_lead)}" if self.unresolved_lead else ""
        return line + (f"; {runoff_text(self.runoff)}" if self.runoff else "")


def fair_rivals(step_s: Mapping[str, float], levers: frozenset[str]) -> dict[str, float]:
    """The rivals among ``step_s`` (kind -> step time) fair to a strategy using ``levers``: those
    that use no lever it does not use."""
    return {kind: s for kind, s in step_s.items() if is_rival(kind) and rival_levers(kind) <= levers}


def repeats_p(first: Sequence[float], second: Sequence[float]) -> float | None:
    """Two-sided Mann-Whitney U p-value of two kinds' confirmation repeats (``None`` when either has
    fewer than ``MIN_RESOLVING_REPEATS``): below ``RESOLVED_P`` the job tells them apart."""
    if min(len(first), len(second)) < MIN_RESOLVING_REPEATS:
        return None
    from scipy.stats import mannwhitneyu
    return float(mannwhitneyu(first, second, alternative="two-sided").pvalue)


def paired_p(ratios: Sequence[float]) -> float | None:
    """Two-sided Wilcoxon signed-rank p-value that per-pass step-time ratios (one strategy's over
    another's, each pair measured in the same pass of one job) differ from 1 (``None`` for fewer than
    ``MIN_RESOLVING_REPEATS``). Pairing takes out the job's drift, which moves both alike within a pass."""
    if len(ratios) < MIN_RESOLVING_REPEATS:
        return None
    logs = [math.log(r) for r in ratios]
    if not any(logs):
        return 1.0  # every pass a tie
    from scipy.stats import wilcoxon
    return float(wilcoxon(logs, alternative="two-sided").pvalue)


def runoff_text(runoff: Mapping[str, Any]) -> str:
    """``runoff`` said plainly."""
    if "skipped" in runoff:
        return f"no runoff of {runoff['kind']} against {runoff['over']}: {runoff['skipped']}"
    if runoff["ratio"] is None:
        return f"runoff job: no pass measured both {runoff['kind']} and {runoff['over']}: not taken"
    p = "too few passes to tell" if runoff["p"] is None else f"p = {runoff['p']:.3f}"
    held = "the lead held: taken" if runoff["taken"] else "the lead did not hold: not taken"
    return (f"runoff job, {runoff['passes']} passes: {runoff['kind']} {runoff['ratio']:.2f}x as fast as "
            f"{runoff['over']} ({p}): {held}")


def lead_text(lead: Mapping[str, Any]) -> str:
    """``unresolved_lead`` said plainly."""
    p = "too few repeats to tell" if lead["p"] is None else f"p = {lead['p']:.2f}"
    return (f"{lead['kind']} measured {lead['step_s'] * 1e3:.1f} ms, faster than {lead['over']} but within the "
            f"confirmation job's noise ({p}): not taken")


def kendall_tau_between(first: Mapping[str, float], second: Mapping[str, float]) -> float | None:
    """Kendall tau (tau-b) of two measurements' rankings (step time per kind) over the kinds both
    hold (``None`` for fewer than 3, or when one side is constant)."""
    kinds = [kind for kind in first if kind in second]
    if len(kinds) < 3:
        return None
    from scipy.stats import kendalltau
    tau = kendalltau([first[k] for k in kinds], [second[k] for k in kinds]).statistic
    return None if tau != tau else float(tau)  # NaN when one side is constant


def rival_rule(result: AutotuneResult | dict[str, Any]) -> str:
    """Which rivals count for this result's winner, said plainly."""
    exact = result["exact"] if isinstance(result, dict) else result.exact
    levers = set(result["winner"]["levers"] if isinstance(result, dict) else result.winner_levers)
    twins = [twin for lever, twin in (("fp16", "Horovod with fp16 and the baselines' fp16 twins"),
                                      ("rows", "the baselines' rows twins (dense embeddings sent as rows)"))
             if lever in levers]
    if exact and not twins:
        return "exact mode: rivals are plain Horovod and the baselines"
    if not twins:
        return "the winner uses no fp16 and no rows: rivals are plain Horovod and the baselines"
    uses = " and ".join(lever for lever in ("fp16", "rows") if lever in levers)
    both = "; with both, their rows-fp16 twins" if len(twins) == 2 else ""
    return f"{'exact mode; ' if exact else ''}the winner uses {uses}: rivals include {' and '.join(twins)}{both}"
