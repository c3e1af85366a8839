"""Which learned part transfers to model families the fit never saw? Variants scored on one family split.

    .venv/bin/python benchmarks/simulator_variants.py [--jsonl data/trials.jsonl.gz | --store URL] --workers 2

For each held-out family (``evaluate.family_of``) the analytic constants are fit once on the
other families (the costly part, ``--workers`` processes); then every variant of the learned
part is fit on the same rows (``Simulator.training_frame``: features, log(measured / analytic)
centered within each trial job) and scored on the held-out family's trials, within jobs, as
``benchmarks/simulator.py`` scores them. The variants: the shipped regression, XGBoost's
pairwise ranking objective with the trial job as the query group, a pseudo-Huber loss, trials
weighted per job or by their noise, shallower and deeper trees, fewer and more rounds, and a
ridge regression on the same features. The last line fits the shipped learner on every
family and scores it on the same trials: what the features can express at all, as against
what transfers.

Honest selection: the rows are printed for the generated families (where a choice may be
made) and the zoo models apart (each a family of its own, a test no choice looked at).
One xgboost thread per process.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import tempfile
import time
from typing import Callable

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from provenance import print_header  # noqa: E402

GENERATED = ("cnn", "mlp", "recsys", "transformer", "widedeep")
"""The generator's families (``zoo/generator``): the ones a choice of variant may look at."""
Learner = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]
"""(train features, train target, train job ids, train relative noise, test features) -> test correction."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--store", help="trial store URL, read only")
    source.add_argument("--jsonl", default=os.path.join(REPO, "data", "trials.jsonl.gz"), help="a dataset export")
    parser.add_argument("--calibrations", default=os.path.join(REPO, "data", "calibrations.json"))
    parser.add_argument("--cores", type=float, default=os.cpu_count())
    parser.add_argument("--workers", type=int, default=1, help="processes fitting the folds' constants")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--families", help="held-out families to score, comma-separated (default: all; a fast subset "
                                           "to iterate on)")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    from hybridsync.model.evaluate import family_of, summarize

    print_header()
    started = time.perf_counter()
    samples = _load(args)
    families = sorted({family_of(s.model) for s in samples})
    if args.families:
        unknown = sorted(set(args.families.split(",")) - set(families))
        if unknown:
            raise SystemExit(f"--families: {unknown} are not families of the dataset ({families})")
        families = args.families.split(",")
    print(f"{len(samples)} trials, families {families}")
    fold = _Fold(samples, args)
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.workers),
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
        frames = dict(zip(families, pool.map(fold, families)))
    print(f"constants fit per fold: {time.perf_counter() - started:.0f} s")
    rows = []
    for name, learner in _variants(args.seed).items():
        rows += [_score(samples, name, family, frames[family], learner) for family in families]
    rows += [_score(samples, "in-sample", family, frames[family], _xgboost(args.seed), in_sample=True)
             for family in families]
    print(f"{'variant':<14} {'held out':<10} {'test':>5} {'pairwise':>9} {'pw>noise':>9} {'tau':>6} {'MAPE':>7} "
          f"{'MAPE/job':>9} {'regret':>7} {'top-5':>6}")
    for part, keep in (("generated", lambda r: r.held_out in GENERATED), ("zoo", lambda r: r.held_out not in GENERATED),
                       ("all", lambda r: True)):
        for row in summarize([r for r in rows if keep(r)], key=lambda r: r.kind):
            m = row.metrics
            print(f"{row.kind:<14} {part:<10} {m.trials:>5} {m.pairwise:>9.3f} {m.pairwise_resolved:>9.3f} "
                  f"{m.kendall_tau:>6.3f} {m.mape:>6.1%} {m.mape_job:>8.1%} {m.top1_regret:>6.1%} "
                  f"{m.top5_regret:>5.1%}")
    print(f"took {time.perf_counter() - started:.0f} s")
    return 0


def _load(args: argparse.Namespace) -> list:
    from hybridsync.model.simulator import load_samples
    from hybridsync.trials.store import TrialStore
    if args.store:
        return load_samples(args.store)
    with tempfile.TemporaryDirectory() as tmp, TrialStore(os.path.join(tmp, "trials.db"), create=True) as store:
        store.import_jsonl(args.jsonl)
        return load_samples(store)


class _Fold:
    """One held-out family: constants fit on the others; every trial's features, target and log analytic time."""

    def __init__(self, samples: list, args: argparse.Namespace) -> None:
        self.samples, self.calibrations, self.cores, self.seed = samples, args.calibrations, args.cores, args.seed

    def __call__(self, family: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        from hybridsync.model.analytic import CostConstants
        from hybridsync.model.calibration import load_calibrations
        from hybridsync.model.evaluate import family_of, predict_samples
        from hybridsync.model.simulator import BoosterParams, Simulator

        train = [s for s in self.samples if family_of(s.model) != family]
        analytic = Simulator(kind="analytic", constants=CostConstants(cores=self.cores)).fit(
            train, calibrations=load_calibrations(self.calibrations) if self.calibrations else {})
        both = Simulator(kind="both", constants=analytic.constants, params=BoosterParams(seed=self.seed))
        features, target = both.training_frame(self.samples)
        return features, target, np.log(predict_samples(analytic, self.samples))


def _xgboost(seed: int, rounds: int = 200, weights: str = "", **overrides: object) -> Learner:
    from hybridsync.model.simulator import BoosterParams

    params = {**BoosterParams(seed=seed).xgboost(), **overrides}

    def learn(x: np.ndarray, y: np.ndarray, jobs: np.ndarray, noise: np.ndarray, test: np.ndarray) -> np.ndarray:
        import xgboost
        weight = None
        if weights == "job":
            weight = 1.0 / np.sqrt(np.bincount(jobs)[jobs])
        elif weights == "noise":
            weight = 1.0 / (noise ** 2 + 0.05 ** 2)
        booster = xgboost.train(params, xgboost.DMatrix(x, label=y, weight=weight), rounds)
        return booster.predict(xgboost.DMatrix(test))
    return learn


def _ranker(seed: int) -> Learner:
    """XGBoost's ``rank:pairwise`` with the trial job as the query; its scores are put on the
    scale of log step time by least squares on the training rows."""
    from hybridsync.model.simulator import BoosterParams

    params = {**BoosterParams(seed=seed).xgboost(), "objective": "rank:pairwise"}

    def learn(x: np.ndarray, y: np.ndarray, jobs: np.ndarray, noise: np.ndarray, test: np.ndarray) -> np.ndarray:
        import xgboost
        order = np.argsort(jobs, kind="stable")
        booster = xgboost.train(params, xgboost.DMatrix(x[order], label=-y[order], qid=jobs[order]), 200)
        fitted = _centered(-booster.predict(xgboost.DMatrix(x)), jobs)
        scale = float(fitted @ y / max(fitted @ fitted, 1e-12))
        return -scale * booster.predict(xgboost.DMatrix(test))
    return learn


def _ridge(x: np.ndarray, y: np.ndarray, jobs: np.ndarray, noise: np.ndarray, test: np.ndarray) -> np.ndarray:
    """Least squares on the within-job centered, standardized features, a small ridge."""
    centered = np.stack([_centered(column, jobs) for column in x.T.astype(float)], axis=1)
    spread = centered.std(axis=0)
    spread[spread < 1e-9] = np.inf
    z = centered / spread
    w = np.linalg.solve(z.T @ z + 1e-2 * len(z) * np.eye(z.shape[1]), z.T @ y) / spread
    return test.astype(float) @ w


def _variants(seed: int) -> dict[str, Learner]:
    return {"analytic": lambda x, y, jobs, noise, test: np.zeros(len(test)),
            "shipped": _xgboost(seed), "rank:pairwise": _ranker(seed),
            "pseudo-Huber": _xgboost(seed, objective="reg:pseudohubererror", huber_slope=0.3),
            "per-job wt": _xgboost(seed, weights="job"), "noise wt": _xgboost(seed, weights="noise"),
            "depth 2": _xgboost(seed, max_depth=2), "depth 6": _xgboost(seed, max_depth=6),
            "60 rounds": _xgboost(seed, rounds=60), "500 rounds": _xgboost(seed, rounds=500), "ridge": _ridge}


def _centered(values: np.ndarray, jobs: np.ndarray) -> np.ndarray:
    sums, counts = np.bincount(jobs, values), np.bincount(jobs)
    return values - (sums / np.maximum(counts, 1))[jobs]


def _jobs(samples: list) -> tuple[np.ndarray, np.ndarray]:
    from hybridsync.model.evaluate import group_key
    keys = [group_key(s) for s in samples]
    index = {key: i for i, key in enumerate(sorted(set(keys)))}
    noise = np.array([s.noise_s / s.step_s for s in samples])
    return np.array([index[key] for key in keys]), noise


def _score(samples: list, variant: str, family: str, frame: tuple, learner: Learner, *, in_sample: bool = False):
    """``learner`` fit on the other families' trials (``in_sample``: on every trial), scored on ``family``'s."""
    from hybridsync.model.evaluate import Row, family_of, group_key, is_control

    features, target, log_analytic = frame
    jobs, noise = _jobs(samples)
    test = np.array([family_of(s.model) == family for s in samples])
    train = np.ones(len(samples), bool) if in_sample else ~test
    correction = learner(features[train], target[train], jobs[train], noise[train], features[test])
    held = [s for s, t in zip(samples, test) if t]
    return Row.of(kind=variant, split="family", held_out=family, train_trials=int(train.sum()),
                  predicted=np.exp(log_analytic[test] + correction), measured=np.array([s.step_s for s in held]),
                  groups=[group_key(s) for s in held], timed_steps=[s.timed_steps for s in held],
                  noise=[s.noise_s for s in held], controls=[is_control(s.kind) for s in held])


if __name__ == "__main__":
    sys.exit(main())
