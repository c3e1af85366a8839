"""The runtime simulator: the analytic cost model corrected by XGBoost, fit on measured trials.

    sim = Simulator(constants=CostConstants(cores=2)).fit(load_samples("sqlite:///data/trials.db"))
    seconds = sim.predict(description, cluster, strategies)      # one number per strategy
    sim.save("simulator.json"); sim = Simulator.load("simulator.json")
    tuned = Simulator.load("simulator.json").fit(new_samples, base=sim)   # warm start, k trials

As AutoTVM's cost models: ``fit`` on (input, measured time) pairs, batched ``predict``.
Three kinds, to compare what each part brings:

- ``analytic``: the alpha-beta model alone, its constants fit by least squares;
- ``xgboost``: gradient-boosted trees on the features without the analytic terms,
  regressing log step time;
- ``both`` (default): trees regress log(measured / analytic) on every feature, so they
  learn what the analytic model misses (contention for the cores, densifying, mixing
  routes) and fall back to it where they know nothing. By default (``BoosterParams.target``)
  that log ratio is centered within each trial job before the fit: the trees learn how
  strategies of one job differ, not how far off the analytic level of each training job
  was, which does not carry over to another model or job; the level is the analytic model's.

Warm start (``fit(..., base=...)``): keeps the base's constants and adds ``warm_rounds``
trees fit to the new trials on top of the base's (xgboost's ``xgb_model=`` continuation).
Torch-free; xgboost with one thread (the machine's cores belong to measurements).
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence

import numpy as np

from hybridsync.cluster.spec import ClusterSpec
from hybridsync.description import ModelDescription, description_id, parse_description
from hybridsync.model.analytic import (CostConstants, Problem, analytic_terms, fit_constants_and_compute, job_residuals,
                                       reference_terms, with_compute_factor)
from hybridsync.model.encoding import (ModelArrays, StrategyBatch, Units, as_run_on, from_strategies, model_arrays,
                                      units)
from hybridsync.model.features import ANALYTIC_FEATURES, FEATURE_NAMES, feature_matrix
from hybridsync.model.links import LinkConstants, mean_deviation, nominal_links, relative_links
from hybridsync.strategy import Strategy
from hybridsync.trials.revisions import outdated
from hybridsync.trials.store import is_local

Kind = Literal["both", "xgboost", "analytic"]
Target = Literal["centered", "log_ratio"]
KINDS: tuple[str, ...] = ("both", "xgboost", "analytic")
FORMAT = "hybridsync-simulator"
FORMAT_VERSION = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """One measured trial, as the simulator learns from it."""

    model: str
    """The model's name (leave-one-model-out splits by it)."""
    description: ModelDescription
    """Profiled description of the model the trial ran."""
    cluster: ClusterSpec
    strategy: Strategy | None
    """``None``: plain Horovod (every variable ring all-reduced)."""
    step_s: float
    """Measured median step time in seconds."""
    timed_steps: int = 0
    """How many timed steps the median is taken over (0: unknown)."""
    noise_s: float = 0.0
    """Standard error of ``step_s`` estimated from the timed steps (``median_standard_error``;
    0: unknown): how far apart two trials must be before their order means anything."""
    job: str = ""
    """The trial job that measured it: times of different jobs are not comparable (a job has
    a level of its own), so fits and metrics compare trials within a job ("": one job per
    model and cluster)."""
    kind: str = ""
    """The trial's kind (``horovod``, ``baseline:<name>``, ``random``, ``search:r<k>``...):
    plain Horovod and the baselines are a job's controls."""
    job_position: float = 0.0
    """When in its job the trial ran: 0 for the job's first trial, 1 for its last (by start
    time). Step times drift within a job; a fit can take that out of its targets."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BoosterParams:
    """XGBoost settings of the learned part."""

    rounds: int = 200
    """Trees of a fresh fit."""
    warm_rounds: int = 40
    """Trees added by a warm start."""
    max_depth: int = 4
    learning_rate: float = 0.05
    subsample: float = 0.8
    """Rows per tree (randomness from ``seed``)."""
    colsample_bytree: float = 0.8
    min_child_weight: float = 2.0
    reg_lambda: float = 1.0
    seed: int = 0
    """xgboost's seed: equal seeds and data give equal models."""
    target: Target = "centered"
    """``both`` only: ``centered`` takes each trial job's level (and drift, ``Sample.job_position``)
    out of log(measured / analytic) before the trees see it (``analytic.job_residuals``), fresh
    fits and warm starts alike: a job's level is its own, and an autotune's next round runs in
    a new job; ``log_ratio`` keeps it."""

    def __post_init__(self) -> None:
        if self.target not in ("centered", "log_ratio"):
            raise ValueError(f"BoosterParams.target must be 'centered' or 'log_ratio', got {self.target!r}")

    def xgboost(self) -> dict[str, Any]:
        """The parameter dictionary of ``xgboost.train`` (one thread, squared error on logs)."""
        return {"objective": "reg:squarederror", "max_depth": self.max_depth, "eta": self.learning_rate,
                "subsample": self.subsample, "colsample_bytree": self.colsample_bytree,
                "min_child_weight": self.min_child_weight, "lambda": self.reg_lambda, "seed": self.seed,
                "nthread": 1, "tree_method": "hist"}


SHIPPED = Path(__file__).with_name("simulator.json")
"""The simulator fit on the runtime dataset shipped with hybridsync (``benchmarks/simulator.py --save``)."""


def shipped_simulator() -> "Simulator":
    """The simulator that ships with the package: fit on every trial of the runtime dataset
    (the emulated clusters of ``make dataset``, ``cores=2``); warm-start it with trials of
    your own model and cluster (``fit(samples, base=shipped_simulator())``)."""
    if not SHIPPED.exists():
        raise ValueError(f"no trained simulator ships with this installation ({SHIPPED} is missing); "
                         f"fit one: benchmarks/simulator.py --store URL --save PATH")
    return Simulator.load(SHIPPED)


def load_samples(store: Any, *, model: str | None = None, cluster: Any = None) -> list[Sample]:
    """Every successful trial of a ``TrialStore`` (or a store URL) with its description."""
    from hybridsync.trials.store import TrialStore

    if isinstance(store, str):
        with TrialStore(store, create=False) as opened:
            return load_samples(opened, model=model, cluster=cluster)
    descriptions = {did: parse_description(entry["doc"], where=f"description {did} ({entry['model']})")
                    for did, entry in store.descriptions().items()}
    return samples_from_records(store.trials(model=model, cluster=cluster, status="ok"), descriptions)


def samples_from_records(records: Iterable[Any], descriptions: Mapping[str, ModelDescription]) -> list[Sample]:
    """``Sample``s of trial records (``TrialRecord``) that have timed steps; ``ValueError`` for a
    record whose description is missing. Local-step rows (``LOCAL_KIND``) are left out: they
    synchronize nothing, so they are no strategy's step time (their null strategy would read as
    plain Horovod's). So are trials a later runtime revision outdates (``revisions.outdated``: they
    measured what no longer runs); a trial's place in its job counts every trial it ran among."""
    kept = [record for record in records if record.status == "ok" and record.median_s and not is_local(record.kind)]
    for record in kept:
        if record.description_id not in descriptions:
            raise ValueError(f"trial {record.uid} ({record.model}): its description {record.description_id} "
                             f"is not in the store")
    return [Sample(model=record.model, description=descriptions[record.description_id],
                   cluster=ClusterSpec.from_dict(record.cluster), step_s=float(record.median_s),
                   strategy=None if record.strategy is None else Strategy.from_dict(record.strategy),
                   timed_steps=len(record.timed_steps), noise_s=median_standard_error(record.timed_steps),
                   job=record.job or "", kind=record.kind, job_position=position)
            for record, position in zip(kept, _job_positions(kept)) if outdated(record) is None]


def _job_positions(records: Sequence[Any]) -> list[float]:
    """Each record's place in its job by start time, from 0 (first) to 1 (last; a lone trial: 0)."""
    by_job: dict[str, list[int]] = defaultdict(list)
    for i, record in enumerate(records):
        by_job[record.job or ""].append(i)
    out = [0.0] * len(records)
    for members in by_job.values():
        ordered = sorted(members, key=lambda i: records[i].started)
        for rank, i in enumerate(ordered):
            out[i] = rank / max(len(ordered) - 1, 1)
    return out


def median_standard_error(times: Sequence[float]) -> float:
    """Standard error of the median of ``times`` (seconds; 0 for fewer than 2): 1.2533 sigma /
    sqrt(n), sigma from the median absolute deviation (1.4826 MAD), so that one stalled step
    does not make a whole trial look noisy."""
    if len(times) < 2:
        return 0.0
    values = np.asarray(times, dtype=float)
    sigma = 1.4826 * float(np.median(np.abs(values - np.median(values))))
    return 1.2533 * sigma / float(np.sqrt(len(values)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Problem:
    """The samples of one (description, cluster), encoded once."""

    arrays: ModelArrays
    cluster: ClusterSpec
    units: Units
    step_s: np.ndarray
    indices: np.ndarray
    """Positions of these samples in the list given to ``fit``."""
    links: LinkConstants
    jobs: np.ndarray
    """Each sample's job."""
    positions: np.ndarray
    """Each sample's ``job_position``."""

    def fit_problem(self) -> Problem:
        return Problem(self.arrays, self.units, self.cluster, self.step_s, self.links, self.jobs, self.positions)


class Simulator:
    """Predicts the step time of strategies for a (model description, cluster)."""

    def __init__(self, *, kind: Kind = "both", constants: CostConstants | None = None,
                 params: BoosterParams | None = None, links: Mapping[str, LinkConstants] | None = None,
                 compute_factors: Mapping[str, float] | None = None) -> None:
        """``links``: measured paths of clusters, by ``cluster_label`` (``calibrated``), priced
        relative to the calibrations of the clusters it was fit on (``links.relative_links``);
        any other cluster is priced by its spec (``nominal_links``). ``compute_factors``: training
        descriptions' compute against their profiles (``fit`` fits them with the constants; give
        them with constants fitted before and ``refit_constants=False``)."""
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
        self.kind = kind
        self.constants = constants or CostConstants()
        self.params = params or BoosterParams()
        self.links: dict[str, LinkConstants] = dict(links or {})
        self.compute_factors: dict[str, float] = dict(compute_factors or {})
        """By description name: how fast its training trials' compute ran against its profile
        (``analytic.fit_constants_and_compute``); the learned part trains on the descriptions so
        corrected. Training-time only (1 for any other model): a prediction takes the profile as is."""
        self.reference: dict[str, float] = {}
        """``links.mean_deviation`` of the training clusters' calibrations (``fit(calibrations=)``)."""
        self.booster: Any = None
        self.meta: dict[str, Any] = {}
        self._columns = [j for j, name in enumerate(FEATURE_NAMES) if kind == "both" or name not in ANALYTIC_FEATURES]

    # --- fitting ------------------------------------------------------------------------
    def fit(self, samples: Sequence[Sample], *, base: "Simulator | None" = None, refit_constants: bool = True,
            calibrations: Mapping[str, LinkConstants] | None = None) -> "Simulator":
        """Fit to measured ``samples`` (returns ``self``). With ``base``: warm start from it
        (its kind, constants, calibrations and trees, plus ``warm_rounds`` trees for these
        samples). ``refit_constants=False`` keeps the analytic constants given to the
        constructor. ``calibrations``: measured paths of (some of) the samples' clusters, by
        label: the training clusters are priced by their spec, and these become the reference
        a later calibration is read against (``links.relative_links``). ``ValueError`` for no
        samples, a description without timing, or a strategy the sample's cluster cannot run."""
        samples = list(samples)
        if not samples:
            raise ValueError("Simulator.fit: no samples (is the trial store empty, or every trial failed?)")
        bad = [i for i, s in enumerate(samples) if not (np.isfinite(s.step_s) and s.step_s > 0)]
        if bad:
            raise ValueError(f"Simulator.fit: sample {bad[0]} ({samples[bad[0]].model}) has step time "
                             f"{samples[bad[0]].step_s!r}; step times must be finite seconds > 0")
        if base is not None:
            if base.kind != self.kind:
                raise ValueError(f"warm start from a {base.kind!r} simulator into a {self.kind!r} one")
            self.constants = base.constants
            self.links, self.reference = {**base.links, **self.links}, dict(base.reference)
        elif calibrations:
            from hybridsync.trials.store import cluster_label
            clusters = {cluster_label(s.cluster.to_dict()): s.cluster for s in samples}
            self.reference = mean_deviation([(clusters[label], links) for label, links in calibrations.items()
                                             if label in clusters])
        problems = self._problems(samples)
        if self.kind != "xgboost" and base is None and refit_constants:
            self.constants, self.compute_factors = fit_constants_and_compute([p.fit_problem() for p in problems],
                                                                             self.constants)
        if self.kind != "analytic":
            self._fit_booster(problems, len(samples), base)
        self.meta = {"samples": len(samples) + (base.meta.get("samples", 0) if base else 0),
                     "models": sorted({s.model for s in samples} | set(base.meta.get("models", []) if base else [])),
                     "warm_started": base is not None,
                     "compute_factors": {name: round(f, 4) for name, f in sorted(self.compute_factors.items())},
                     "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        return self

    def _problems(self, samples: Sequence[Sample]) -> list[_Problem]:
        grouped: dict[tuple[str, str], list[int]] = defaultdict(list)
        for i, sample in enumerate(samples):
            grouped[description_id(sample.description), json.dumps(sample.cluster.to_dict(), sort_keys=True)].append(i)
        problems = []
        for indices in grouped.values():
            first = samples[indices[0]]
            arrays = model_arrays(first.description)
            batch = from_strategies(arrays, [samples[i].strategy for i in indices], first.cluster)
            problems.append(_Problem(arrays=arrays, cluster=first.cluster,
                                     units=units(arrays, batch, partition_bytes=self.constants.partition_bytes),
                                     step_s=np.array([samples[i].step_s for i in indices]),
                                     indices=np.array(indices), links=self.links_for(first.cluster),
                                     jobs=np.array([samples[i].job for i in indices]),
                                     positions=np.array([samples[i].job_position for i in indices])))
        return problems

    def links_for(self, cluster: ClusterSpec) -> LinkConstants:
        """The paths the cluster is priced by: calibrated (``calibrated``) or from its spec."""
        from hybridsync.trials.store import cluster_label
        measured = self.links.get(cluster_label(cluster.to_dict()))
        return nominal_links(cluster) if measured is None else relative_links(cluster, measured, self.reference)

    def calibrated(self, cluster: ClusterSpec, links: LinkConstants) -> "Simulator":
        """This simulator pricing ``cluster`` with measured ``links`` (``model.calibration``): a copy
        sharing its constants and trees."""
        from hybridsync.trials.store import cluster_label
        out = copy.copy(self)
        out.links = {**self.links, cluster_label(cluster.to_dict()): links}
        return out

    def training_frame(self, samples: Sequence[Sample]) -> tuple[np.ndarray, np.ndarray]:
        """What the learned part is fit on, with this simulator's constants: each sample's
        features (``feature_names``'s columns) and its target, the log step time the trees
        regress (``both``: log(measured / analytic), within-job centered by ``BoosterParams.target``).
        Lets a study fit other learners on exactly these rows (``benchmarks/simulator_variants.py``)."""
        return self._training_frame(self._problems(list(samples)), len(samples))

    def _training_frame(self, problems: Sequence[_Problem], count: int) -> tuple[np.ndarray, np.ndarray]:
        features = np.zeros((count, len(self._columns)), dtype=np.float32)
        target = np.zeros(count)
        for p in problems:
            arrays, u = with_compute_factor(p.arrays, p.units, self.compute_factors.get(p.arrays.name, 1.0))
            terms = analytic_terms(arrays, u, p.cluster, self.constants, p.links)
            reference = reference_terms(arrays, p.cluster, self.constants, p.links)
            matrix = feature_matrix(arrays, u, p.cluster, terms, reference=reference)
            features[p.indices] = matrix[:, self._columns]
            ratio = np.log(p.step_s) - (np.log(terms["step_s"]) if self.kind == "both" else 0.0)
            if self.kind == "both" and self.params.target == "centered":
                ratio = -job_residuals(-ratio, p.jobs, p.positions, level_weight=0.0)
            target[p.indices] = ratio
        return features, target

    def _fit_booster(self, problems: Sequence[_Problem], count: int, base: "Simulator | None") -> None:
        import xgboost

        features, target = self._training_frame(problems, count)
        train = xgboost.DMatrix(features, label=target, feature_names=self.feature_names)
        rounds = self.params.warm_rounds if base is not None else self.params.rounds
        start = base.booster.copy() if base is not None and base.booster is not None else None
        self.booster = xgboost.train(self.params.xgboost(), train, num_boost_round=rounds, xgb_model=start)

    @property
    def feature_names(self) -> list[str]:
        return [FEATURE_NAMES[j] for j in self._columns]

    # --- prediction ---------------------------------------------------------------------
    def predict(self, description: ModelDescription, cluster: ClusterSpec,
                strategies: Sequence[Strategy | None] | StrategyBatch) -> np.ndarray:
        """Predicted step time in seconds of each strategy (``None``: plain Horovod) on ``cluster``."""
        arrays = model_arrays(description)
        if not isinstance(strategies, StrategyBatch):
            strategies = from_strategies(arrays, list(strategies), cluster)
        return self.predict_batch(arrays, cluster, strategies)

    def predict_batch(self, arrays: ModelArrays, cluster: ClusterSpec, batch: StrategyBatch) -> np.ndarray:
        """``predict`` for an encoded model and batch: what a search calls in its loop."""
        if self.kind != "analytic" and self.booster is None:
            raise ValueError("Simulator.predict: the simulator is not fitted (call fit or load a saved one)")
        if len(batch) == 0:
            return np.zeros(0)
        u = units(arrays, as_run_on(batch, cluster), partition_bytes=self.constants.partition_bytes)
        links = self.links_for(cluster)
        terms = analytic_terms(arrays, u, cluster, self.constants, links)
        if self.kind == "analytic":
            return terms["step_s"]
        import xgboost

        reference = reference_terms(arrays, cluster, self.constants, links)
        matrix = feature_matrix(arrays, u, cluster, terms, reference=reference)
        data = xgboost.DMatrix(matrix[:, self._columns], feature_names=self.feature_names, nthread=1)
        learned = self.booster.predict(data)
        return np.exp(learned + (np.log(terms["step_s"]) if self.kind == "both" else 0.0))

    # --- persistence --------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """One JSON file: kind, constants, booster settings, feature names, provenance and the
        trees (xgboost's own JSON model); written atomically."""
        import xgboost

        import hybridsync
        doc = {"format": FORMAT, "version": FORMAT_VERSION, "kind": self.kind, "constants": self.constants.to_dict(),
               "links": {label: links.to_dict() for label, links in sorted(self.links.items())},
               "reference": self.reference,
               "params": dataclasses.asdict(self.params), "feature_names": self.feature_names,
               "meta": {**self.meta, "xgboost": xgboost.__version__, "hybridsync": hybridsync.__version__},
               "booster": None if self.booster is None else json.loads(bytes(self.booster.save_raw("json")))}
        path = os.fspath(path)
        partial = f"{path}.partial-{os.getpid()}"
        with open(partial, "w", encoding="utf-8") as handle:
            json.dump(doc, handle)
            handle.write("\n")
        os.replace(partial, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Simulator":
        """A simulator ``save`` wrote; ``ValueError`` naming the file for anything else."""
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as handle:
                doc = json.load(handle)
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read simulator {path!r}: {error}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"{path!r} is not a saved hybridsync simulator (no \"format\": \"{FORMAT}\")")
        if doc.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path!r}: simulator format version {doc.get('version')!r}; this hybridsync reads "
                             f"{FORMAT_VERSION}: refit it (benchmarks/simulator.py --store URL --save PATH)")
        simulator = cls(kind=doc["kind"], constants=CostConstants.from_dict(doc["constants"]),
                        params=BoosterParams(**doc["params"]),
                        links={label: LinkConstants.from_dict(links) for label, links in doc["links"].items()})
        simulator.reference = dict(doc["reference"])
        if doc["feature_names"] != simulator.feature_names:
            raise ValueError(f"{path!r}: saved with other features than this hybridsync computes; refit it")
        simulator.meta = dict(doc.get("meta", {}))
        if doc.get("booster") is not None:
            import xgboost

            simulator.booster = xgboost.Booster(params={"nthread": 1})
            simulator.booster.load_model(bytearray(json.dumps(doc["booster"]).encode("utf-8")))
        return simulator
