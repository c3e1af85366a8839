"""Honest held-out scores for the simulator's settings, and drift of step times within a trial job.

    .venv/bin/python benchmarks/simulator_selection.py --store sqlite:///data/trials.db

1. Nested leave-one-model-out: for each held-out model, every candidate setting of the
   learned part (``BoosterParams``: target centered per model x cluster or not, tree depth)
   is scored by leave-one-model-out on the *other* models only; the best one there is fit on
   all of them and scored on the held-out model. The pooled result is what choosing the
   setting costs nothing to, unlike a table of settings scored on the held-out models
   themselves (printed below it, for comparison, labelled as such).
2. Drift: per trial job, the slope of log(measured / analytic) against the trial's start
   time (analytic model fit on every trial). Trials of one job run in random order, so a
   slope is the machine or the job changing, not the strategies: noise that the within-trial
   spread (``Sample.noise_s``) does not see.

One process, one xgboost thread; about 10 minutes on the 1014-trial dataset.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import os
import sys
import time
from collections import defaultdict

import numpy as np

GRID = tuple(itertools.product(("centered", "log_ratio"), (3, 4, 6)))
"""(target, max_depth) settings the nested selection chooses among."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", required=True, help="trial store URL (sqlite:///data/trials.db)")
    parser.add_argument("--cores", type=float, default=os.cpu_count(),
                        help="cores the emulated cluster's ranks shared when measured (default: this machine's)")
    args = parser.parse_args(argv)

    from hybridsync.model.analytic import CostConstants
    from hybridsync.model.evaluate import format_table, summarize
    from hybridsync.model.simulator import load_samples

    started = time.perf_counter()
    samples = load_samples(args.store)
    constants = CostConstants(cores=args.cores)
    rows, chosen = _nested(samples, constants)
    print("nested leave-one-model-out (setting chosen on the other models' folds, per held-out model):")
    for model, setting in chosen.items():
        print(f"  {model}: target={setting[0]}, max_depth={setting[1]}")
    print(format_table(rows + summarize(rows)))
    print(f"\n{_drift(args.store, samples, constants)}")
    print(f"took {time.perf_counter() - started:.1f} s")
    return 0


def _nested(samples: list, constants: object) -> tuple[list, dict]:
    """Held-out rows of the setting that inner leave-one-model-out picks, per outer model."""
    from tqdm import tqdm

    from hybridsync.model.evaluate import cross_validate, summarize
    from hybridsync.model.simulator import BoosterParams

    models = sorted({s.model for s in samples})
    outer, inner = {}, defaultdict(dict)
    with tqdm(total=len(GRID) * (1 + len(models)), desc="nested selection", unit="cross-validation") as bar:
        for target, depth in GRID:
            params = BoosterParams(target=target, max_depth=depth)
            outer[target, depth] = {row.held_out: row for row in cross_validate(
                samples, split="model", kinds=("both",), constants=constants, params=params)}
            bar.update()
            for held_out in models:
                rows = cross_validate([s for s in samples if s.model != held_out], split="model", kinds=("both",),
                                      constants=constants, params=params)
                inner[held_out][target, depth] = summarize(rows)[0].metrics.pairwise
                bar.update()
    for setting in GRID:
        pooled = summarize(list(outer[setting].values()))[0].metrics
        print(f"  (not a held-out score: every fold at target={setting[0]}, max_depth={setting[1]}) pairwise "
              f"{pooled.pairwise:.3f}, resolved {pooled.pairwise_resolved:.3f}, MAPE {pooled.mape:.1%}")
    chosen = {model: max(GRID, key=lambda setting: inner[model][setting]) for model in models}
    return [dataclasses.replace(outer[chosen[model]][model], kind="nested") for model in models], chosen


def _drift(url: str, samples: list, constants: object) -> str:
    """Per job: the slope of the analytic model's log residual over the job's wall time."""
    from hybridsync.model.evaluate import predict_samples
    from hybridsync.model.simulator import Simulator
    from hybridsync.trials.revisions import current
    from hybridsync.trials.store import TrialStore, cluster_label

    simulator = Simulator(kind="analytic", constants=constants).fit(samples)
    residual = np.log(np.array([s.step_s for s in samples]) / predict_samples(simulator, samples))
    with TrialStore(url, create=False) as store:
        records, _ = current([r for r in store.trials(status="ok") if r.median_s])
    assert len(records) == len(samples), "load_samples keeps every current successful trial, in the store's order"
    jobs: dict[str, list[int]] = defaultdict(list)
    for i, record in enumerate(records):
        jobs[record.job].append(i)
    lines = ["drift within a trial job: slope of log(measured / analytic) per minute of the job (jobs of >= 10 "
             "trials; analytic model fit on all trials)"]
    for job, members in jobs.items():
        if len(members) < 10:
            continue
        first = records[members[0]]
        minutes = np.array([datetime.datetime.fromisoformat(records[i].started).timestamp() for i in members]) / 60
        slope = np.polyfit(minutes - minutes.mean(), residual[members], 1)[0]
        span = np.ptp(minutes)
        lines.append(f"  {first.model:<7} {cluster_label(first.cluster):<16} job {job[:8]} {len(members):>3} trials "
                     f"over {span:4.1f} min: {slope:+.3f} per minute ({np.expm1(slope * span):+.0%} first to last)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
