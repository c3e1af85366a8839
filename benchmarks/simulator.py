"""How well does the runtime simulator predict trials of models (families, clusters) it never saw?

    .venv/bin/python benchmarks/simulator.py [--jsonl data/trials.jsonl.gz | --store URL] \
        [--save hybridsync/model/simulator.json] [--png sim.png] [--splits model,family,cluster]

The one command that refits the shipped simulator: reads the successful trials of the shipped
dataset (default: ``data/trials.jsonl.gz``, loaded into a temporary store; or a store URL,
read only; but not those a later runtime revision outdates, ``hybridsync.trials.revisions``) and the
calibrations of its clusters (``data/calibrations.json``, ``python -m hybridsync.model.calibration``: the reference an
autotune's calibration of a new cluster is read against; the training clusters themselves are
priced by their spec), then prints, for the analytic model alone, XGBoost alone and
both: leave-one-model-out, leave-one-family-out (``evaluate.family_of``: ``gen-<family>-<k>``;
skipped while every model is a family of its own; by default family and cluster once the
dataset has families, model and cluster before) and leave-one-cluster-out pairwise ranking
accuracy, Kendall tau, MAPE (raw, and within a job: each job's level taken out by its
controls) and top-1 regret, every metric within trial jobs (times of different jobs are not
comparable); warm-start transfer to each held-out zoo model (not the generator's) with k = 0, 5,
10, 20 of its trials;
how many candidate strategies per second a fitted simulator scores; and, with ``--save``,
fits on every trial and writes the simulator. For scale, the measurements' own repeatability:
how well the median of each trial's odd steps ranks trials as the median of its even steps
does, and from trial to trial (``evaluate.repeatability``: trials of one job the simulator
cannot tell apart) with what a perfect simulator would score under that noise
(``evaluate.noise_ceiling``). ``pw>noise``: pairwise accuracy over the pairs whose measured difference exceeds twice
its standard error (``evaluate.NOISE_Z``), the pairs the measurements resolve.
Targets on models the fit never saw: pairwise >= 0.90, top-1 regret <= 5%, MAPE <= 10%.
One process, one xgboost thread: minutes, growing with the dataset (``--splits`` to choose).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATASET = os.path.join(REPO, "data", "trials.jsonl.gz")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--store", help="trial store URL (sqlite:///data/trials.db), read only")
    source.add_argument("--jsonl", help="a dataset export, loaded into a temporary store (default: the shipped one)")
    parser.add_argument("--calibrations", default=os.path.join(REPO, "data", "calibrations.json"),
                        help="calibrated clusters (python -m hybridsync.model.calibration); '' for none")
    parser.add_argument("--cores", type=float, default=os.cpu_count(),
                        help="cores the emulated cluster's ranks shared when measured (default: this machine's)")
    parser.add_argument("--splits", help="held-out evaluations to run, of model,family,cluster (default: family "
                                         "and cluster once the dataset has families, else model and cluster); "
                                         "'none': no held-out evaluation (with --save: the refit alone)")
    parser.add_argument("--kinds", default="analytic,xgboost,both", help="simulator kinds to evaluate")
    parser.add_argument("--png", help="write the predicted-vs-measured plot (first split) here")
    parser.add_argument("--save", help="fit on every trial and save the simulator here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1,
                        help="processes fitting the held-out sets at once (default 1; each fit uses one thread)")
    parser.add_argument("--no-transfer", action="store_true", help="skip the warm-start rows")
    parser.add_argument("--predictions", help="write every held-out trial's prediction here (JSON lines: split, held "
                                              "out, kind, model, cluster, job, trial kind, strategy, measured and "
                                              "predicted seconds): where the errors are")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)

    from hybridsync.model.simulator import load_samples
    from hybridsync.trials.store import TrialStore

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        url = args.store or os.path.join(tmp, "trials.db")
        with TrialStore(url, create=not args.store) as store:
            if not args.store:
                path = args.jsonl or DATASET
                store.import_jsonl(path)
                print(f"dataset {path}")
            samples = load_samples(store)
            print(_outdated(store))
            print(_repeatability(store))
    print(_noise_ceiling(samples, args.seed))
    evaluate(samples, args)
    print(f"took {time.perf_counter() - started:.1f} s")
    return 0


def evaluate(samples: list, args: argparse.Namespace) -> None:
    """Every table the module docstring lists, for ``samples``."""
    from hybridsync.model.analytic import CostConstants
    from hybridsync.model.calibration import load_calibrations
    from hybridsync.model.evaluate import SPLITS, cross_validate, family_of, format_table, plot_predictions, summarize
    from hybridsync.model.simulator import BoosterParams
    from hybridsync.trials.store import cluster_label

    constants, params = CostConstants(cores=args.cores), BoosterParams(seed=args.seed)
    links = load_calibrations(args.calibrations) if args.calibrations else {}
    models = sorted({s.model for s in samples})
    families = sorted({family_of(m) for m in models})
    clusters = sorted({cluster_label(s.cluster.to_dict()) for s in samples})
    print(f"{len(samples)} successful trials, {len(models)} models in {len(families)} families, clusters {clusters}; "
          f"{len({s.job for s in samples})} jobs; cores {args.cores:g}; calibrated: {sorted(links) or 'none'}")
    rows = []
    splits = args.splits or ("family,cluster" if len(families) < len(models) else "model,cluster")
    for split in [s for s in splits.split(",") if s and splits != "none"]:
        if split not in SPLITS:
            raise SystemExit(f"--splits: {split!r} is not one of {', '.join(SPLITS)}")
        if split == "family" and len(families) == len(models):
            print("leave-one-family-out skipped: every model is a family of its own (the same as leave-one-model-out)")
            continue
        try:
            rows += cross_validate(samples, split=split, kinds=args.kinds.split(","), constants=constants,
                                   params=params, links=links, workers=args.workers)
        except ValueError as error:
            print(f"leave-one-{split}-out skipped: {error}")
    if not rows and splits == "none":
        _refit(samples, constants, params, links, args)
        return
    print(format_table(rows))
    pooled = summarize(rows)
    print("\npooled over held-out sets (metrics within each trial job):")
    print(format_table(pooled))
    print("\nthe same per cluster:")
    print(format_table(_per_cluster(pooled, clusters)))
    if args.predictions:
        _write_predictions(rows, samples, args.predictions)
        print(f"\nheld-out predictions: {args.predictions}")
    if not args.no_transfer:  # to the models that are a family of their own (the zoo's): a few fits each
        _transfer(samples, [m for m in models if family_of(m) == m], constants, params, links, args.seed)
    if args.png and pooled:
        plot_predictions([r for r in pooled if r.split == pooled[0].split], args.png)
        print(f"\nplot: {args.png}")
    print()
    _refit(samples, constants, params, links, args)


def _refit(samples: list, constants: object, params: object, links: dict, args: argparse.Namespace) -> None:
    """Fits the simulator on every trial, prints its scoring speed and, with ``--save``, writes it."""
    from hybridsync.model.simulator import Simulator

    simulator = Simulator(constants=constants, params=params).fit(samples, calibrations=links)
    print(_scoring_speed(simulator, samples))
    if args.save:
        simulator.save(args.save)
        print(f"saved: {args.save} (fit on all {len(samples)} trials)")


def _per_cluster(pooled: list, clusters: list[str]) -> list:
    """Each pooled row scored on each cluster's trials (``held out``: the cluster)."""
    import dataclasses

    out = []
    for row in pooled:
        for label in clusters:
            mask = np.array([group[1] == label for group in row.groups])
            if mask.any():
                out.append(dataclasses.replace(row.where(mask), held_out=label))
    return out


def _write_predictions(rows: list, samples: list, path: str) -> None:
    """Every held-out trial's prediction, one JSON object a line (``--predictions``)."""
    import json

    from hybridsync.model.evaluate import held_out_name
    from hybridsync.trials.store import cluster_label

    with open(path, "w", encoding="utf-8") as out:
        for row in rows:
            test = [s for s in samples if held_out_name(s, row.split) == row.held_out]  # cross_validate's order
            for sample, predicted in zip(test, row.predicted):
                out.write(json.dumps({
                    "split": row.split, "held_out": row.held_out, "kind": row.kind, "model": sample.model,
                    "cluster": cluster_label(sample.cluster.to_dict()), "job": sample.job,
                    "trial_kind": sample.kind, "strategy": None if sample.strategy is None else sample.strategy.to_dict(),
                    "measured_s": sample.step_s, "predicted_s": float(predicted), "noise_s": sample.noise_s}) + "\n")


def _transfer(samples: list, models: list[str], constants: object, params: object, links: dict, seed: int) -> None:
    from hybridsync.model.evaluate import format_table, transfer
    rows = []
    for name in models:
        try:
            rows += transfer(samples, held_out=name, split="model", seed=seed, constants=constants, params=params,
                             links=links)
        except ValueError as error:
            print(f"transfer to {name} skipped: {error}")
    if rows:
        print("\nwarm start on a held-out model with k of its trials (test: its other trials):")
        print(format_table(rows))


def _outdated(store: object) -> str:
    """How many successful trials the simulator leaves out as measured by an older runtime
    (``hybridsync.trials.revisions``), and why."""
    from hybridsync.trials.revisions import current

    _, dropped = current(store.trials(status="ok"))
    if not dropped:
        return "outdated trials: none (every trial measured what the runtime runs now)"
    return "outdated trials, left out of the fit and the scores: " + "; ".join(
        f"{count} ({change}; measured before)" for change, count in dropped.items())


def _repeatability(store: object) -> str:
    """The measurements' own ranking noise (``evaluate.split_half``): the ceiling of any simulator."""
    from hybridsync.model.evaluate import split_half
    from hybridsync.trials.store import cluster_label

    records = [r for r in store.trials(status="ok") if r.median_s]
    lines = []
    for label, kept in (("all trials", records), ("trials of most steps", [
            r for r in records if len(r.timed_steps) == max(len(x.timed_steps) for x in records)])):
        m = split_half([r.timed_steps for r in kept], [(r.model, cluster_label(r.cluster), r.job) for r in kept])
        lines.append(f"measurement repeatability, {label} ({len(kept)}; odd vs even timed steps of each trial): "
                     f"pairwise {m.pairwise:.3f} (pairs the noise resolves: {m.pairwise_resolved:.3f}), "
                     f"tau {m.kendall_tau:.3f}, MAPE {m.mape:.1%}")
    return "\n".join(lines)


def _noise_ceiling(samples: list, seed: int) -> str:
    """Trial-to-trial noise (``evaluate.repeatability``: trials of one job the simulator cannot tell
    apart) and about what a perfect simulator would score under it (``evaluate.noise_ceiling``)."""
    from collections import Counter

    from hybridsync.model.evaluate import family_of, noise_ceiling, repeat_pairs, repeatability

    repeats = repeatability(samples)
    if repeats is None:
        return "trial-to-trial repeatability: no job measured two trials of one encoded strategy"
    kinds = Counter(" = ".join(sorted((samples[i].kind, samples[j].kind))) for i, j in repeat_pairs(samples))
    lines = [f"trial-to-trial repeatability ({repeats.pairs} pairs of trials of one job the simulator cannot tell "
             f"apart: {', '.join(f'{k} ({n})' for k, n in kinds.most_common(3))}): sigma of one trial's log step time "
             f"{repeats.sigma_robust:.3f} (MAD), {repeats.sigma:.3f} (sd, with the tail); worst pair "
             f"{repeats.worst_ratio:.2f}x"]
    for label, sigma in (("MAD", repeats.sigma_robust), ("sd", repeats.sigma)):
        m = noise_ceiling(samples, sigma, seed=seed)
        lines.append(f"a perfect simulator under that noise ({label} sigma): pairwise {m.pairwise:.3f} "
                     f"(pw>noise {m.pairwise_resolved:.3f}), tau {m.kendall_tau:.3f}, MAPE {m.mape:.1%} "
                     f"({m.mape_job:.1%} within a job), top-1 regret {m.top1_regret:.1%}, top-5 {m.top5_regret:.1%}")
    families = sorted({family_of(s.model) for s in samples})
    for family in families if len(families) > 1 else ():
        mine = [s for s in samples if family_of(s.model) == family]
        low, high = (noise_ceiling(mine, sigma, seed=seed) for sigma in (repeats.sigma_robust, repeats.sigma))
        lines.append(f"  {family:<12} perfect simulator (MAD - sd sigma): pairwise {low.pairwise:.3f}-"
                     f"{high.pairwise:.3f}, MAPE within a job {low.mape_job:.1%}-{high.mape_job:.1%}, top-1 regret "
                     f"{low.top1_regret:.1%}-{high.top1_regret:.1%}")
    return "\n".join(lines)


def _scoring_speed(simulator: object, samples: list, count: int = 10_000) -> str:
    """Candidates per second of a fitted simulator on the model with most variables, from
    encoded batches (what a search mutates) and from ``Strategy`` objects."""
    from hybridsync.model.encoding import StrategyBatch, from_strategies, model_arrays
    from hybridsync.strategy_space import bounds_for, random_strategy

    largest = max(samples, key=lambda s: len(s.description.variables))
    arrays, cluster = model_arrays(largest.description), largest.cluster
    rng = np.random.default_rng(0)
    bounds = bounds_for(cluster)
    strategies = [random_strategy(largest.description.variables, bounds, rng) for _ in range(200)]
    start = time.perf_counter()
    small = from_strategies(arrays, strategies, cluster)
    encode_rate = len(strategies) / (time.perf_counter() - start)
    repeat = count // len(strategies)
    batch = StrategyBatch.concatenate([small] * repeat)
    simulator.predict_batch(arrays, cluster, batch)  # warm up
    seconds = []
    for _ in range(3):  # the best of three: other processes share the cores
        start = time.perf_counter()
        simulator.predict_batch(arrays, cluster, batch)
        seconds.append(time.perf_counter() - start)
    rate = len(batch) / min(seconds)
    return (f"scoring speed ({largest.model}, {len(arrays.names)} variables, {cluster.nodes}x"
            f"{cluster.workers_per_node}): {rate:,.0f} candidates/s from encoded batches of {len(batch)} "
            f"(units + analytic + features + XGBoost, 1 thread, best of 3; load average {os.getloadavg()[0]:.1f} on "
            f"{os.cpu_count()} cores); encoding Strategy objects: {encode_rate:,.0f}/s")


if __name__ == "__main__":
    sys.exit(main())
