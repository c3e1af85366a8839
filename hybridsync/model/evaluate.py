"""How good is the runtime simulator: ranking and error metrics, held-out evaluation, transfer, a plot.

Metrics are computed per query group, a trial job (model, cluster, job): a search only ever
compares strategies of one model on one cluster, and step times of different jobs are not
comparable (a job has a level of its own: benchmarks/RESULTS.md, "Job-to-job variation"). They are
then averaged over groups weighted by their trials:

- pairwise ranking accuracy: of the pairs of trials with different measured times, the
  share the prediction orders the same way (AutoSync's metric; ~0.84-0.92 there);
- noise-aware pairwise accuracy: the same over the pairs whose measured difference exceeds
  ``NOISE_Z`` standard errors of the difference (each trial's ``Sample.noise_s``); pairs closer
  than that are coin flips of the measurement, which no simulator can be asked to order;
- Kendall tau (scipy) of predicted vs measured;
- MAPE: mean |predicted - measured| / measured, raw, and within jobs (``mape_job``: each job's
  predictions scaled by its level, the geometric mean of measured / predicted over its
  controls, plain Horovod and the baselines, or over all its trials when it has none);
- top-1 regret: measured time of the predicted-best trial over the measured best, minus 1;
  top-5 regret the same for the best of the 5 trials predicted fastest (``TOP_K``): an
  autotune measures its best few candidates, so this is nearer what it pays.

``cross_validate`` holds out one model, one model family (``family_of``: ``gen-<family>-<k>``
for the generator's models, a family of its own for every other model) or one cluster at a
time, fits on the rest and scores the held-out trials; ``transfer`` warm-starts a simulator
with k trials of a held-out model; ``live_accuracy`` scores the predictions an autotune made
before its trials ran; ``repeatability`` measures the trials' noise from one trial to the next
(pairs of a job that the simulator cannot tell apart) and ``noise_ceiling`` what a perfect
simulator would score under it. Randomness only from explicit seeds.
"""
from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import numpy as np

from hybridsync.model.analytic import CostConstants
from hybridsync.model.links import LinkConstants
from hybridsync.model.simulator import BoosterParams, Sample, Simulator, median_standard_error
from hybridsync.trials.store import BASELINE_PREFIX, HOROVOD_KIND, cluster_label

Split = Literal["model", "family", "cluster"]
SPLITS = ("model", "family", "cluster")
TOP_K = 5
"""``Metrics.top5_regret``: how many of the trials predicted fastest count."""
NOISE_Z = 2.0
"""A pair counts for the noise-aware accuracy when |m_i - m_j| > NOISE_Z * sqrt(se_i^2 + se_j^2)
(about 95% sure of the measured order)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Metrics:
    """A simulator's scores on a set of trials."""

    pairwise: float
    kendall_tau: float
    mape: float
    top1_regret: float
    trials: int
    pairwise_resolved: float = float("nan")
    """Pairwise accuracy over the pairs the measurements resolve (``NOISE_Z``; nan without noise estimates)."""
    resolved_share: float = float("nan")
    """Share of the pairs of different measured times that the measurements resolve."""
    mape_job: float = float("nan")
    """MAPE once each group's level is taken out (module docstring); nan without groups' controls given."""
    top5_regret: float = float("nan")
    """The best measured time among the ``TOP_K`` trials predicted fastest over the measured best, minus 1."""

    def to_dict(self) -> dict[str, float | int | None]:
        """JSON-ready: nan (not computed) as ``None``."""
        return {k: None if isinstance(v, float) and not np.isfinite(v) else v
                for k, v in dataclasses.asdict(self).items()}


CONTROL_KINDS = (HOROVOD_KIND, BASELINE_PREFIX)
"""Kind prefixes of a job's controls: plain Horovod and the hand-made baselines."""


def group_key(sample: Sample) -> tuple[str, str, str]:
    """A sample's query group, its trial job: (model, cluster label, job)."""
    return sample.model, cluster_label(sample.cluster.to_dict()), sample.job


def family_of(model: str) -> str:
    """A model's family: ``recsys`` for the generator's ``gen-recsys-7``; any other model (the
    zoo's, a user's) is a family of its own."""
    parts = model.split("-")
    return parts[1] if len(parts) >= 3 and parts[0] == "gen" else model


def is_control(kind: str) -> bool:
    """Whether a trial of this kind is one of its job's controls (``CONTROL_KINDS``)."""
    return kind.startswith(CONTROL_KINDS)


def score(predicted: np.ndarray, measured: np.ndarray, groups: Sequence[object],
          noise: np.ndarray | None = None, controls: np.ndarray | None = None) -> Metrics:
    """Metrics of ``predicted`` vs ``measured`` seconds; ``groups[i]`` is trial i's query group;
    ``noise[i]`` the standard error of ``measured[i]`` (the noise-aware pairwise accuracy; all
    zero or ``None``: not computed); ``controls[i]`` whether trial i is a control of its group
    (``mape_job``; ``None``: not computed)."""
    predicted, measured = np.asarray(predicted, float), np.asarray(measured, float)
    if predicted.shape != measured.shape or len(predicted) != len(groups) or len(predicted) == 0:
        raise ValueError(f"score: need as many predictions ({predicted.shape}), measurements ({measured.shape}) "
                         f"and groups ({len(groups)}), at least one")
    noise = None if noise is None or not np.any(noise) else np.asarray(noise, float)
    if noise is not None and noise.shape != measured.shape:
        raise ValueError(f"score: need a noise estimate per measurement, got {noise.shape} for {measured.shape}")
    leveled = None if controls is None else np.zeros_like(predicted)
    resolved_agree = resolved = 0
    by_group: dict[object, list[int]] = defaultdict(list)
    for i, group in enumerate(groups):
        by_group[group].append(i)
    agree = pairs = 0
    taus, tau_weights, regrets, top_regrets, regret_weights = [], [], [], [], []
    for members in by_group.values():
        p, m = predicted[members], measured[members]
        upper = np.triu_indices(len(members), k=1)
        dm = np.sign(m[:, None] - m[None, :])[upper]
        dp = np.sign(p[:, None] - p[None, :])[upper]
        counted = dm != 0
        agree += int((dm[counted] == dp[counted]).sum())
        pairs += int(counted.sum())
        if noise is not None:
            se = noise[members]
            clear = np.abs(m[:, None] - m[None, :])[upper] > NOISE_Z * np.hypot(se[:, None], se[None, :])[upper]
            resolved_agree += int((dm[clear] == dp[clear]).sum())
            resolved += int(clear.sum())
        if len(members) >= 2:
            taus.append(_kendall(p, m))
            tau_weights.append(len(members))
        regrets.append(m[np.argmin(p)] / m.min() - 1.0)
        top_regrets.append(m[np.argsort(p, kind="stable")[:TOP_K]].min() / m.min() - 1.0)
        regret_weights.append(len(members))
        if leveled is not None:
            mine = np.asarray(controls, bool)[members]
            basis = mine if mine.any() else np.ones(len(members), bool)
            leveled[members] = p * np.exp(np.mean(np.log(m[basis] / p[basis])))
    return Metrics(pairwise=agree / pairs if pairs else float("nan"),
                   kendall_tau=float(np.average(taus, weights=tau_weights)) if taus else float("nan"),
                   mape=float(np.mean(np.abs(predicted - measured) / measured)),
                   top1_regret=float(np.average(regrets, weights=regret_weights)), trials=len(predicted),
                   top5_regret=float(np.average(top_regrets, weights=regret_weights)),
                   pairwise_resolved=resolved_agree / resolved if resolved else float("nan"),
                   resolved_share=resolved / pairs if noise is not None and pairs else float("nan"),
                   mape_job=float("nan") if leveled is None else float(np.mean(np.abs(leveled - measured) / measured)))


def split_half(step_times: Sequence[Sequence[float]], groups: Sequence[object]) -> Metrics:
    """How well the measurements agree with themselves: the median of each trial's odd timed
    steps "predicting" the median of its even ones. No simulator can rank measured trials much
    better than their own halves rank each other (trials with fewer than 2 steps are skipped).
    Its noise-aware accuracy takes the even halves' standard errors as the noise."""
    kept = [i for i, times in enumerate(step_times) if len(times) >= 2]
    odd = np.array([np.median(step_times[i][1::2]) for i in kept])
    even = np.array([np.median(step_times[i][0::2]) for i in kept])
    noise = np.array([median_standard_error(step_times[i][0::2]) for i in kept])
    return score(odd, even, [groups[i] for i in kept], noise)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Repeats:
    """Trial-to-trial noise, from pairs of trials of one job that the simulator cannot tell apart."""

    pairs: int
    """Pairs of trials of one job with the same encoded strategy (``repeat_pairs``)."""
    sigma_robust: float
    """Standard deviation of one trial's log step time, from the median absolute deviation of
    the pairs' log ratios (1.4826 MAD / sqrt 2): the typical trial's noise."""
    sigma: float
    """The same from the plain standard deviation (sd / sqrt 2): with the heavy tail of disturbed trials."""
    worst_ratio: float
    """The largest ratio of step times within one pair."""


def repeat_pairs(samples: Sequence[Sample]) -> list[tuple[int, int]]:
    """Index pairs of trials of one job (``group_key``) whose strategies encode alike
    (``encoding.from_strategies``: plain Horovod and a strategy that all-reduces every variable
    on the ring, or one strategy measured twice). No simulator can order such a pair: whatever
    separates its step times is noise of the measurement, or something no input describes."""
    from hybridsync.model.encoding import from_strategies, model_arrays

    by_group: dict[tuple, list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        by_group[group_key(sample)].append(i)
    pairs = []
    for members in by_group.values():
        first = samples[members[0]]
        batch = from_strategies(model_arrays(first.description), [samples[i].strategy for i in members],
                                first.cluster)
        rows = np.concatenate([getattr(batch, name).reshape(len(members), -1).astype(float) for name in
                               ("route", "protocol", "staleness", "partitions", "group", "fp16", "rows",
                                "server_share")],
                              axis=1)
        seen: dict[bytes, list[int]] = defaultdict(list)
        for i, row in zip(members, rows):
            seen[row.tobytes()].append(i)
        pairs += [(same[a], same[b]) for same in seen.values()
                  for a in range(len(same)) for b in range(a + 1, len(same))]
    return pairs


def repeatability(samples: Sequence[Sample]) -> Repeats | None:
    """The trial-to-trial noise of ``samples`` (``Repeats``); ``None`` without a repeated strategy."""
    pairs = repeat_pairs(samples)
    if not pairs:
        return None
    ratios = np.array([np.log(samples[i].step_s / samples[j].step_s) for i, j in pairs])
    mad = float(np.median(np.abs(ratios - np.median(ratios))))
    return Repeats(pairs=len(pairs), sigma_robust=float(1.4826 * mad / np.sqrt(2)),
                   sigma=float(ratios.std() / np.sqrt(2)), worst_ratio=float(np.exp(np.abs(ratios).max())))


def noise_ceiling(samples: Sequence[Sample], sigma: float, *, seed: int = 0, draws: int = 5) -> Metrics:
    """About what a perfect simulator would score on ``samples`` if each trial's log step time
    carries independent noise of standard deviation ``sigma`` (``Repeats``): the scores of
    "predictions" that are the measured times with that noise drawn afresh (``draws`` draws from
    ``seed``, averaged). The targets a simulator is held to mean little above this line."""
    if sigma < 0 or not samples:
        raise ValueError(f"noise_ceiling: need samples and sigma >= 0, got {len(samples)} samples, sigma {sigma}")
    measured = np.array([s.step_s for s in samples])
    groups = [group_key(s) for s in samples]
    noise = np.array([s.noise_s for s in samples])
    controls = np.array([is_control(s.kind) for s in samples])
    rng = np.random.default_rng(seed)
    runs = [score(measured * np.exp(rng.normal(0.0, sigma, len(measured))), measured, groups, noise, controls)
            for _ in range(draws)]
    return Metrics(**{field.name: float(np.mean([getattr(m, field.name) for m in runs]))
                      for field in dataclasses.fields(Metrics) if field.name != "trials"}, trials=len(measured))


def _kendall(predicted: np.ndarray, measured: np.ndarray) -> float:
    from scipy.stats import kendalltau

    tau = kendalltau(predicted, measured).statistic
    return float(tau) if np.isfinite(tau) else 0.0


def predict_samples(simulator: Simulator, samples: Sequence[Sample]) -> np.ndarray:
    """The simulator's prediction of every sample, batched per (model, cluster)."""
    out = np.zeros(len(samples))
    batches: dict[tuple, list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        batches[id(sample.description), group_key(sample)].append(i)
    for indices in batches.values():
        first = samples[indices[0]]
        out[indices] = simulator.predict(first.description, first.cluster, [samples[i].strategy for i in indices])
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One held-out evaluation: which kind of simulator, what was held out, how it scored."""

    kind: str
    split: str
    held_out: str
    train_trials: int
    metrics: Metrics
    predicted: np.ndarray = dataclasses.field(repr=False)
    measured: np.ndarray = dataclasses.field(repr=False)
    groups: tuple[tuple[str, str, str], ...] = dataclasses.field(repr=False, default=())
    """Each test trial's query group (model, cluster label, job)."""
    timed_steps: tuple[int, ...] = dataclasses.field(repr=False, default=())
    """Each test trial's number of timed steps."""
    noise: tuple[float, ...] = dataclasses.field(repr=False, default=())
    """Each test trial's ``Sample.noise_s`` (empty: unknown)."""
    controls: tuple[bool, ...] = dataclasses.field(repr=False, default=())
    """Whether each test trial is a control of its job (``is_control``; empty: unknown)."""

    @classmethod
    def of(cls, *, kind: str, split: str, held_out: str, train_trials: int, predicted: np.ndarray,
           measured: np.ndarray, groups: Sequence[tuple[str, str, str]], timed_steps: Sequence[int],
           noise: Sequence[float], controls: Sequence[bool]) -> "Row":
        """A row scored on its own predictions (``score``)."""
        noise, controls = tuple(noise), tuple(controls)
        return cls(kind=kind, split=split, held_out=held_out, train_trials=train_trials, predicted=predicted,
                   measured=measured, groups=tuple(groups), timed_steps=tuple(timed_steps), noise=noise,
                   controls=controls, metrics=score(predicted, measured, groups, np.array(noise) if noise else None,
                                                    np.array(controls) if controls else None))

    def where(self, keep: np.ndarray) -> "Row":
        """This row scored on the test trials ``keep`` (a boolean mask) selects."""
        def kept(values: tuple) -> tuple:
            return tuple(v for v, k in zip(values, keep) if k)
        return Row.of(kind=self.kind, split=self.split, held_out=self.held_out, train_trials=self.train_trials,
                      predicted=self.predicted[keep], measured=self.measured[keep], groups=kept(self.groups),
                      timed_steps=kept(self.timed_steps), noise=kept(self.noise), controls=kept(self.controls))

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(group[0] for group in self.groups)


def held_out_name(sample: Sample, split: Split) -> str:
    """What a ``split`` holds out that ``sample`` belongs to: its model, family or cluster label."""
    if split == "model":
        return sample.model
    return family_of(sample.model) if split == "family" else cluster_label(sample.cluster.to_dict())


def cross_validate(samples: Sequence[Sample], *, split: Split = "model", kinds: Sequence[str] = ("analytic",
                   "xgboost", "both"), constants: CostConstants | None = None,
                   params: BoosterParams | None = None, links: Mapping[str, LinkConstants] | None = None,
                   workers: int = 1) -> list[Row]:
    """Leave-one-model-out (``split="model"``), leave-one-family-out or leave-one-cluster-out
    evaluation of each kind (``links``: calibrated clusters, ``Simulator.fit(calibrations=)``).
    ``workers`` > 1 fits the held-out sets in that many processes (the samples are sent once to
    each); the rows are the same, in the same order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if workers < 1:
        raise ValueError(f"cross_validate: workers must be >= 1, got {workers}")
    names = sorted({held_out_name(s, split) for s in samples})
    if len(names) < 2:
        raise ValueError(f"cross_validate: need trials of at least two {split}s, got {names}")
    fold = functools.partial(_held_out_rows, samples, split=split, kinds=tuple(kinds), constants=constants,
                             params=params, links=links)
    if workers == 1 or len(names) == 1:
        return [row for name in names for row in fold(name)]
    import concurrent.futures
    import multiprocessing
    # spawned, not forked: a fork after XGBoost's OpenMP threads ran can hang the child
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(workers, len(names)),
                                                mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_set_fold, initargs=(fold,)) as pool:
        return [row for rows in pool.map(_worker_fold, names) for row in rows]


_FOLD: Callable[[str], list[Row]] | None = None
"""In a ``cross_validate`` worker process: its held-out set function (sent once per worker)."""


def _set_fold(fold: Callable[[str], list[Row]]) -> None:
    global _FOLD
    _FOLD = fold


def _worker_fold(name: str) -> list[Row]:
    assert _FOLD is not None, "a cross_validate worker started without its fold"
    return _FOLD(name)


def _held_out_rows(samples: Sequence[Sample], name: str, *, split: Split, kinds: Sequence[str],
                   constants: CostConstants | None, params: BoosterParams | None,
                   links: Mapping[str, LinkConstants] | None) -> list[Row]:
    """One held-out set of ``cross_validate``: fit each kind on the rest, score on ``name``'s trials."""
    train = [s for s in samples if held_out_name(s, split) != name]
    test = [s for s in samples if held_out_name(s, split) == name]
    rows, fitted_constants, factors = [], None, None
    for kind in kinds:
        simulator = Simulator(kind=kind, constants=fitted_constants or constants, params=params, compute_factors=factors)
        simulator.fit(train, refit_constants=fitted_constants is None, calibrations=links)
        if kind != "xgboost":  # analytic and both share one least-squares fit
            fitted_constants, factors = simulator.constants, simulator.compute_factors
        rows.append(_row(simulator, kind, split, name, len(train), test))
    return rows


def _row(simulator: Simulator, kind: str, split: str, held_out: str, train_trials: int,
         test: Sequence[Sample]) -> Row:
    return Row.of(kind=kind, split=split, held_out=held_out, train_trials=train_trials,
                  predicted=predict_samples(simulator, test), measured=np.array([s.step_s for s in test]),
                  groups=[group_key(s) for s in test], timed_steps=[s.timed_steps for s in test],
                  noise=[s.noise_s for s in test], controls=[is_control(s.kind) for s in test])


def transfer(samples: Sequence[Sample], *, held_out: str, split: Split = "model", ks: Sequence[int] = (0, 5, 10, 20),
             seed: int = 0, constants: CostConstants | None = None, params: BoosterParams | None = None,
             kind: str = "both", links: Mapping[str, LinkConstants] | None = None) -> list[Row]:
    """Fit on every model (or family or cluster, by ``split``) but ``held_out``, then warm-start
    with k of its trials (drawn with ``seed``) and score on its other trials (the same test set
    for every k: those not among the largest k's draws)."""
    train = [s for s in samples if held_out_name(s, split) != held_out]
    target = [s for s in samples if held_out_name(s, split) == held_out]
    if not train or len(target) <= max(ks):
        raise ValueError(f"transfer: need other models' trials and more than {max(ks)} of {held_out!r}, "
                         f"got {len(train)} and {len(target)}")
    order = np.random.default_rng(seed).permutation(len(target))
    test = [target[i] for i in order[max(ks):]]
    base = Simulator(kind=kind, constants=constants, params=params).fit(train, calibrations=links)
    rows = []
    for k in ks:
        simulator = base if k == 0 else Simulator(kind=kind, params=params).fit(
            [target[i] for i in order[:k]], base=base)
        rows.append(_row(simulator, kind, f"{split} k={k}", held_out, len(train) + k, test))
    return rows


def live_accuracy(trials: Iterable[Any]) -> Metrics | None:
    """How well an autotune's simulator predicted its own trials, each predicted before it ran:
    ``trials`` have ``predicted_s``, ``measured_s`` (``None``: failed) and ``round`` (one trial job
    per round, so pairs and regret are taken within rounds). ``None`` when fewer than two trials
    of a round were measured. (``autotune.loop.TrialOutcome`` has these fields.)"""
    kept = [t for t in trials if t.measured_s is not None and t.predicted_s is not None]
    rounds = defaultdict(int)
    for trial in kept:
        rounds[trial.round] += 1
    kept = [t for t in kept if rounds[t.round] >= 2]
    if not kept:
        return None
    return score(np.array([t.predicted_s for t in kept]), np.array([t.measured_s for t in kept]),
                 [t.round for t in kept], controls=np.array([is_control(getattr(t, "kind", "")) for t in kept]))


def describe_live(metrics: Mapping[str, Any] | None) -> str:
    """One line for an autotune report: ``live_accuracy`` (as ``Metrics.to_dict``) in words."""
    if not metrics:
        return "Simulator accuracy on these trials: too few trials measured in one round to say."
    return (f"Simulator accuracy on these trials (each predicted before it ran; pairs within a round's job): "
            f"pairwise {metrics['pairwise']:.2f}, Kendall tau {metrics['kendall_tau']:.2f}, top-1 regret "
            f"{metrics['top1_regret']:.1%}, MAPE {metrics['mape']:.1%} ({metrics['mape_job']:.1%} within a job), "
            f"{metrics['trials']} trials.")


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width text table (``MAPE/job``: ``Metrics.mape_job``)."""
    lines = [f"{'split':<14} {'held out':<16} {'kind':<9} {'train':>6} {'test':>5} {'pairwise':>9} "
             f"{'pw>noise':>9} {'tau':>6} {'MAPE':>7} {'MAPE/job':>9} {'regret':>7} {'top-5':>6}"]
    for row in rows:
        m = row.metrics
        lines.append(f"{row.split:<14} {row.held_out:<16} {row.kind:<9} {row.train_trials:>6} {m.trials:>5} "
                     f"{m.pairwise:>9.3f} {m.pairwise_resolved:>9.3f} {m.kendall_tau:>6.3f} {m.mape:>6.1%} "
                     f"{m.mape_job:>8.1%} {m.top1_regret:>6.1%} {m.top5_regret:>5.1%}")
    return "\n".join(lines)


def summarize(rows: Sequence[Row], *, key: Callable[[Row], str] = lambda row: f"{row.split} {row.kind}") -> list[Row]:
    """One pooled row per ``key`` (e.g. per split and kind): the metrics of all its predictions
    together, jobs kept apart."""
    pooled: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        pooled[key(row)].append(row)
    out = []
    for members in pooled.values():
        def joined(field: str) -> tuple:
            return tuple(v for r in members for v in getattr(r, field)) if all(getattr(r, field) for r in members) \
                else ()
        out.append(Row.of(kind=members[0].kind, split=members[0].split, held_out="all",
                          train_trials=int(np.mean([r.train_trials for r in members])),
                          predicted=np.concatenate([r.predicted for r in members]),
                          measured=np.concatenate([r.measured for r in members]), groups=joined("groups"),
                          timed_steps=joined("timed_steps"), noise=joined("noise"), controls=joined("controls")))
    return out


def plot_predictions(rows: Sequence[Row], path: str, *, title: str = "simulator: predicted vs measured") -> None:
    """A log-log scatter of predicted vs measured step time, one panel per row, colored by model (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 4.2), squeeze=False)
    for ax, row in zip(axes[0], rows):
        for model in sorted(set(row.models)):
            mask = np.array([m == model for m in row.models])
            ax.scatter(row.measured[mask], row.predicted[mask], s=9, alpha=0.6, label=model)
        low = min(row.measured.min(), row.predicted.min()) * 0.8
        high = max(row.measured.max(), row.predicted.max()) * 1.25
        ax.plot([low, high], [low, high], color="gray", linewidth=0.8)
        ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel="measured step (s)",
               ylabel="predicted step (s)",
               title=f"{row.split} {row.kind}\npairwise {row.metrics.pairwise:.2f}, MAPE {row.metrics.mape:.0%}")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
