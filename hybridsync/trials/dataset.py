"""What a trial store says, per model and cluster: counts, baselines, the best trial, plots.

``summarize`` groups trial records (``TrialStore.trials()``) by model x cluster;
``format_table`` renders the summaries as the ``hybridsync dataset stats`` table and
``plot_summaries`` draws one PNG per summary (matplotlib, imported only there).
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

from hybridsync.trials.store import (BASELINE_PREFIX, HOROVOD_KIND, TrialRecord, base_kind, cluster_label, is_local,
                                     quantile)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Summary:
    """The trials of one model on one cluster, reduced to what a reader compares."""

    model: str
    cluster: str
    """``cluster_label`` of the cluster, e.g. ``2x2@1gbit``."""
    ok: int
    failed: int
    medians_s: tuple[float, ...]
    """Median step time of every successful trial, ascending."""
    baselines_s: dict[str, float]
    """Baseline name -> its best successful median (several runs of one baseline: the fastest)."""
    horovod_s: float | None
    """Plain Horovod's best successful median (``None``: not measured or failed)."""
    best_kind: str | None
    """``kind`` of the fastest successful trial (may be a baseline, or ``horovod``)."""
    best_s: float | None

    @property
    def best_baseline(self) -> tuple[str, float] | None:
        """(name, median) of the fastest baseline."""
        return min(self.baselines_s.items(), key=lambda item: item[1]) if self.baselines_s else None

    @property
    def speedup_over_baseline(self) -> float | None:
        """Best baseline's median / best trial's median (>= 1: the best trial includes baselines)."""
        best_baseline = self.best_baseline
        return best_baseline[1] / self.best_s if best_baseline and self.best_s else None

    @property
    def speedup_over_horovod(self) -> float | None:
        return self.horovod_s / self.best_s if self.horovod_s and self.best_s else None

    @property
    def medians_p90_p10(self) -> float | None:
        """How far apart the strategies are: p90 / p10 of the successful trials' medians."""
        if not self.medians_s:
            return None
        return quantile(list(self.medians_s), 0.9) / quantile(list(self.medians_s), 0.1)


def summarize(records: Iterable[TrialRecord]) -> list[Summary]:
    """One summary per (model, cluster), sorted by model then cluster label. Local-step rows
    (``LOCAL_KIND``) are left out: a step that synchronizes nothing is no strategy, and would
    always be the "best trial"."""
    groups: dict[tuple[str, str], list[TrialRecord]] = defaultdict(list)
    for record in records:
        if not is_local(record.kind):
            groups[record.model, cluster_label(record.cluster)].append(record)
    return [_summary(model, cluster, groups[model, cluster]) for model, cluster in sorted(groups)]


def _summary(model: str, cluster: str, records: Sequence[TrialRecord]) -> Summary:
    timed = [r for r in records if r.status == "ok" and r.median_s is not None]
    baselines: dict[str, float] = {}
    for record in timed:
        if base_kind(record.kind).startswith(BASELINE_PREFIX):  # a control's re-measurements count too
            name = base_kind(record.kind)[len(BASELINE_PREFIX):]
            baselines[name] = min(baselines.get(name, record.median_s), record.median_s)
    horovod = [r.median_s for r in timed if base_kind(r.kind) == HOROVOD_KIND]
    best = min(timed, key=lambda r: r.median_s, default=None)
    return Summary(model=model, cluster=cluster, ok=sum(r.status == "ok" for r in records),
                   failed=sum(r.status != "ok" for r in records),
                   medians_s=tuple(sorted(r.median_s for r in timed)), baselines_s=baselines,
                   horovod_s=min(horovod) if horovod else None,
                   best_kind=base_kind(best.kind) if best else None, best_s=best.median_s if best else None)


COLUMNS = ("model", "cluster", "ok", "failed", "best baseline", "ms", "horovod ms", "best trial", "ms",
           "x baseline", "x horovod", "p90/p10")


def format_table(summaries: Sequence[Summary]) -> str:
    """The ``dataset stats`` table: one row per model x cluster, columns aligned."""
    rows = [COLUMNS] + [_row(summary) for summary in summaries]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.rjust(width) if _numeric(cell) else cell.ljust(width)
                       for cell, width in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines[:1] + ["-" * len(lines[0])] + lines[1:])


def _row(summary: Summary) -> tuple[str, ...]:
    best_baseline = summary.best_baseline
    return (summary.model, summary.cluster, str(summary.ok), str(summary.failed),
            best_baseline[0] if best_baseline else "-", _ms(best_baseline[1] if best_baseline else None),
            _ms(summary.horovod_s), summary.best_kind or "-", _ms(summary.best_s),
            _ratio(summary.speedup_over_baseline), _ratio(summary.speedup_over_horovod),
            _ratio(summary.medians_p90_p10))


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _numeric(cell: str) -> bool:
    return bool(re.fullmatch(r"[\d.]+x?|-", cell))


def plot_summaries(summaries: Sequence[Summary], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Writes one PNG per summary into ``out_dir`` (made if missing): a histogram of the
    successful trials' medians with a rug of each one, every baseline and plain Horovod
    marked by a labelled vertical line. Returns the files, in the order of ``summaries``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for summary in summaries:
        figure = Figure(figsize=(8, 4.5), layout="constrained")
        FigureCanvasAgg(figure)
        _draw(figure.add_subplot(), summary)
        path = out / f"{_file_name(summary.model)}_{_file_name(summary.cluster)}.png"
        figure.savefig(path, dpi=110)
        paths.append(path)
    return paths


LOG_SCALE_RATIO = 3.0
"""Step times spread wider than this (max/min) are drawn on a log axis, with log-spaced bins."""


def _draw(axes, summary: Summary) -> None:
    import numpy as np
    medians_ms = [m * 1000 for m in summary.medians_s]
    marks = [(f"baseline {name}", seconds * 1000, "#c0392b") for name, seconds in summary.baselines_s.items()]
    if summary.horovod_s is not None:
        marks.append(("horovod", summary.horovod_s * 1000, "#27ae60"))
    values = medians_ms + [ms for _, ms, _ in marks]
    log = bool(values) and max(values) / min(values) > LOG_SCALE_RATIO
    if medians_ms:
        count = min(40, max(5, len(medians_ms) // 5))
        bins = np.geomspace(min(values), max(values), count + 1) if log else count
        axes.hist(medians_ms, bins=bins, color="#9bb7d4", label="all trials")
        axes.plot(medians_ms, [0] * len(medians_ms), "|", color="#2b4c6f", markersize=12)
    if log:
        axes.set_xscale("log")
    for i, (label, ms, color) in enumerate(sorted(marks, key=lambda mark: mark[1])):
        axes.axvline(ms, color=color, linestyle="--", linewidth=1)
        axes.annotate(label, (ms, 1 - 0.3 * (i % 3)), xycoords=("data", "axes fraction"), rotation=90,
                      ha="right", va="top", fontsize=7, color=color,
                      bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1})
    axes.set_xlabel("median step time of a trial (ms" + (", log scale)" if log else ")"))
    axes.set_ylabel("trials")
    axes.set_title(f"{summary.model} on {summary.cluster}: {summary.ok} ok, {summary.failed} failed, "
                   f"{len(summary.baselines_s)} baselines")


def _file_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", text)
