"""Which learned part transfers to model families (or models) the fit never saw? Variants scored on one split.

    .venv/bin/python benchmarks/simulator_variants.py [--jsonl data/trials.jsonl.gz | --store URL] --workers 2 \
        [--split family|model] [--select]

For each held-out family (``evaluate.family_of``; ``--split model``: each model) the analytic
constants and the training descriptions' compute factors are fit once on the rest, as
``evaluate.cross_validate`` fits them (the costly part, ``--workers`` processes); then every
variant of the learned part is fit on the same rows (``Simulator.training_frame``: features,
log(measured / analytic) centered within each trial job) and scored on the held-out trials,
within jobs, as ``benchmarks/simulator.py`` scores them (``shipped`` is its ``both``). The
variants shrink the trees' correction toward the analytic model in several ways
(``_variants``). The ``in-sample`` line fits the shipped learner on every trial and scores it
on the same trials (with 200 trees it underfits them: 1000 reach far closer, benchmarks/RESULTS.md
s27; so it is what these trees learn at all, not what the features can express). ``--frames`` keeps
each fold's analytic constants, so an attempt at other features costs minutes, not a fit per fold.

Honest selection: ``--select`` adds ``selected``, per held-out set the variant that an inner
leave-one-family-out over the training families alone scores best (``selection_loss``); the
held-out set's trials take no part in that choice. Rows are printed for the generated families
and the zoo models apart. One xgboost thread per process. (Earlier learners, scored in
benchmarks/RESULTS.md 2026-11-26: XGBoost's rank:pairwise, pseudo-Huber, noise weights, depth 6,
500 rounds, ridge: none transferred better.)
"""
from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from provenance import print_header  # noqa: E402

GENERATED = ("cnn", "mlp", "recsys", "transformer", "widedeep")
"""The generator's families (``zoo/generator``): the ones a choice of variant may look at."""
if TYPE_CHECKING:
    from hybridsync.model.simulator import Simulator
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
    parser.add_argument("--split", choices=("family", "model"), default="family",
                        help="hold out one family (default) or one model at a time")
    parser.add_argument("--frames", help="a directory keeping each fold's fitted analytic constants and compute "
                                         "factors (<split>-<held out>.json): a second run on the same data skips "
                                         "their fits, even after the features changed")
    parser.add_argument("--select", action="store_true",
                        help="also score 'selected': per held-out set, the variant an inner leave-one-family-out "
                             "over the training families alone picks (selection_loss)")
    parser.add_argument("--variants", help="the variants to fit, comma-separated (default: all of _variants)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.variants.split(",")) - set(_variants(args.seed))) if args.variants else []
    if unknown:
        parser.error(f"--variants: {unknown} are not variants (known: {', '.join(_variants(args.seed))})")
    sys.path.insert(0, REPO)
    from hybridsync.model.evaluate import family_of, held_out_name, summarize

    print_header()
    started = time.perf_counter()
    samples = _load(args)
    families = sorted({family_of(s.model) for s in samples})
    if args.families:
        unknown = sorted(set(args.families.split(",")) - set(families))
        if unknown:
            raise SystemExit(f"--families: {unknown} are not families of the dataset ({families})")
        families = args.families.split(",")
    held = sorted({held_out_name(s, args.split) for s in samples if family_of(s.model) in families})
    print(f"{len(samples)} trials, families {families}; held out one {args.split} at a time: {len(held)}")
    fold = _Fold(samples, args)
    rows = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.workers),
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
        for name_out, (mine, chosen) in zip(held, pool.map(fold, held)):
            print(f"{name_out}: {time.perf_counter() - started:.0f} s" + (f"; selected {chosen}" if chosen else ""),
                  flush=True)
            rows += mine
    print(f"{'variant':<14} {'held out':<10} {'test':>5} {'pairwise':>9} {'pw>noise':>9} {'tau':>6} {'MAPE':>7} "
          f"{'MAPE/job':>9} {'regret':>7} {'top-5':>6}")
    for part, keep in (("generated", lambda r: family_of(r.held_out) in GENERATED),
                       ("zoo", lambda r: family_of(r.held_out) not in GENERATED),
                       ("all", lambda r: True)):
        for row in summarize([r for r in rows if keep(r)], key=lambda r: r.kind):
            m = row.metrics
            print(f"{row.kind:<14} {part:<10} {m.trials:>5} {m.pairwise:>9.3f} {m.pairwise_resolved:>9.3f} "
                  f"{m.kendall_tau:>6.3f} {m.mape:>6.1%} {m.mape_job:>8.1%} {m.top1_regret:>6.1%} "
                  f"{m.top5_regret:>5.1%}")
    for row in rows:
        if row.kind in ("shipped", "selected", "analytic"):
            m = row.metrics
            print(f"{row.kind:<14} {row.held_out:<12} {m.trials:>5} {m.pairwise:>9.3f} {m.pairwise_resolved:>9.3f} "
                  f"{m.mape_job:>8.1%} {m.top1_regret:>6.1%} {m.top5_regret:>5.1%}")
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
    """One held-out family or model: constants (and the training descriptions' compute factors) fit
    on the others, as ``evaluate.cross_validate`` fits them, giving every trial's features, target
    and log analytic time (``frame``); then each variant fit on the rest and scored on the held-out
    trials (with ``--select``, the inner choice too)."""

    def __init__(self, samples: list, args: argparse.Namespace) -> None:
        self.samples, self.calibrations, self.cores, self.seed = samples, args.calibrations, args.cores, args.seed
        self.split, self.frames, self.select = args.split, getattr(args, "frames", None), getattr(args, "select", False)
        self.variants = args.variants.split(",") if getattr(args, "variants", None) else None

    def __call__(self, name: str) -> tuple[list, str | None]:
        """``name``'s rows, one per variant, and the variant the inner validation chose (``None``: not asked)."""
        frame = self.frame(name)
        variants = _variants(self.seed)
        if self.variants:
            variants = {name: variants[name] for name in self.variants}
        rows = [_score(self.samples, variant, self.split, name, frame, learner) for variant, learner in variants.items()]
        rows.append(_score(self.samples, "in-sample", self.split, name, frame, _xgboost(self.seed), in_sample=True))
        chosen = _select(self.samples, self.split, name, frame, variants) if self.select else None
        if chosen:
            rows.append(_score(self.samples, "selected", self.split, name, frame, variants[chosen]))
        return rows, chosen

    def frame(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``name``'s fold: its analytic constants and compute factors read from ``--frames`` if they are
        there, else fit (and kept there); the features computed from them with the current code, so a
        change of the features needs no new fit of the constants (the costly part)."""
        import json

        from hybridsync.model.analytic import CostConstants
        from hybridsync.model.evaluate import predict_samples
        from hybridsync.model.simulator import BoosterParams, Simulator

        path = os.path.join(self.frames, f"{self.split}-{name}.json") if self.frames else None
        if path and os.path.exists(path):
            with open(path, encoding="utf-8") as handle:
                kept = json.load(handle)
            analytic = Simulator(kind="analytic", constants=CostConstants.from_dict(kept["constants"]),
                                 compute_factors=kept["compute_factors"])
        else:
            analytic = self.fit(name)
            if path:
                os.makedirs(self.frames, exist_ok=True)
                with open(path, "w", encoding="utf-8") as handle:
                    json.dump({"constants": analytic.constants.to_dict(),
                               "compute_factors": analytic.compute_factors}, handle)
        both = Simulator(kind="both", constants=analytic.constants, params=BoosterParams(seed=self.seed),
                         compute_factors=analytic.compute_factors)
        features, target = both.training_frame(self.samples)
        return features, target, np.log(predict_samples(analytic, self.samples))

    def fit(self, name: str) -> "Simulator":
        """The analytic simulator fit on every trial outside ``name`` (constants and compute factors)."""
        from hybridsync.model.analytic import CostConstants
        from hybridsync.model.calibration import load_calibrations
        from hybridsync.model.evaluate import held_out_name
        from hybridsync.model.simulator import Simulator

        train = [s for s in self.samples if held_out_name(s, self.split) != name]
        return Simulator(kind="analytic", constants=CostConstants(cores=self.cores)).fit(
            train, calibrations=load_calibrations(self.calibrations) if self.calibrations else {})


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


def _variants(seed: int) -> dict[str, Learner]:
    """The shipped learner; ways of shrinking its correction toward the analytic model (which
    transfers as it is): none, half of it, a smaller step, stronger regularization, shallower
    trees, fewer rounds, and trials weighted per job; and more trees (in sample, 200 underfit:
    benchmarks/RESULTS.md s27)."""
    shipped = _xgboost(seed)
    return {"analytic": lambda x, y, jobs, noise, test: np.zeros(len(test)), "shipped": shipped,
            "half": _scaled(shipped, 0.5), "eta 0.02": _xgboost(seed, eta=0.02),
            "reg 20": _xgboost(seed, **{"lambda": 20.0, "min_child_weight": 20.0}), "depth 2": _xgboost(seed, max_depth=2),
            "60 rounds": _xgboost(seed, rounds=60), "per-job wt": _xgboost(seed, weights="job"),
            "400 rounds": _xgboost(seed, rounds=400), "1000 rounds": _xgboost(seed, rounds=1000)}


def _scaled(learner: Learner, factor: float) -> Learner:
    """``learner``'s correction times ``factor``: a prediction between the analytic model's and the learned one."""
    def learn(x: np.ndarray, y: np.ndarray, jobs: np.ndarray, noise: np.ndarray, test: np.ndarray) -> np.ndarray:
        return factor * learner(x, y, jobs, noise, test)
    return learn


def selection_loss(metrics: object) -> float:
    """What the inner validation minimizes: the three targets' shortfalls added, each a fraction
    (1 - pairwise accuracy, top-1 regret, MAPE within a job)."""
    return (1.0 - metrics.pairwise) + metrics.top1_regret + metrics.mape_job



def _select(samples: list, split: str, name_out: str, frame: tuple, variants: dict[str, Learner]) -> str:
    """The variant with the least ``selection_loss`` over an inner leave-one-family-out of the
    training families alone (``name_out``'s trials never seen: not in any inner fit or score)."""
    from hybridsync.model.evaluate import family_of, held_out_name, summarize

    outer = np.array([held_out_name(s, split) == name_out for s in samples])
    inner = sorted({family_of(s.model) for s, o in zip(samples, outer) if not o})
    rows = []
    for name, learner in variants.items():
        for family in inner:
            test = np.array([family_of(s.model) == family for s in samples]) & ~outer
            rows.append(_score_mask(samples, name, "inner", family, frame, learner, train=~outer & ~test, test=test))
    pooled = {row.kind: selection_loss(row.metrics) for row in summarize(rows, key=lambda r: r.kind)}
    return min(pooled, key=pooled.get)


def _centered(values: np.ndarray, jobs: np.ndarray) -> np.ndarray:
    sums, counts = np.bincount(jobs, values), np.bincount(jobs)
    return values - (sums / np.maximum(counts, 1))[jobs]


def _jobs(samples: list) -> tuple[np.ndarray, np.ndarray]:
    from hybridsync.model.evaluate import group_key
    keys = [group_key(s) for s in samples]
    index = {key: i for i, key in enumerate(sorted(set(keys)))}
    noise = np.array([s.noise_s / s.step_s for s in samples])
    return np.array([index[key] for key in keys]), noise


def _score(samples: list, variant: str, split: str, name_out: str, frame: tuple, learner: Learner, *,
           in_sample: bool = False):
    """``learner`` fit on the trials outside ``name_out`` (``in_sample``: on every trial), scored on ``name_out``'s."""
    from hybridsync.model.evaluate import held_out_name

    test = np.array([held_out_name(s, split) == name_out for s in samples])
    train = np.ones(len(samples), bool) if in_sample else ~test
    return _score_mask(samples, variant, split, name_out, frame, learner, train=train, test=test)


def _score_mask(samples: list, variant: str, split: str, name_out: str, frame: tuple, learner: Learner, *,
                train: np.ndarray, test: np.ndarray):
    """``learner`` fit on the ``train`` trials, scored on the ``test`` trials (boolean masks), within jobs."""
    from hybridsync.model.evaluate import Row, group_key, is_control

    features, target, log_analytic = frame
    jobs, noise = _jobs(samples)
    correction = learner(features[train], target[train], jobs[train], noise[train], features[test])
    held = [s for s, t in zip(samples, test) if t]
    return Row.of(kind=variant, split=split, held_out=name_out, train_trials=int(train.sum()),
                  predicted=np.exp(log_analytic[test] + correction), measured=np.array([s.step_s for s in held]),
                  groups=[group_key(s) for s in held], timed_steps=[s.timed_steps for s in held],
                  noise=[s.noise_s for s in held], controls=[is_control(s.kind) for s in held])


if __name__ == "__main__":
    sys.exit(main())
