"""What a trial run measures: the reference rows, every baseline and its twins, and random strategies.

Torch-free: candidates are built from a model description and a cluster spec, so a
trial list can be written (``--list``) and checked anywhere.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable, Mapping

import numpy as np

from hybridsync import baselines
from hybridsync.cluster.spec import ClusterSpec
from hybridsync.strategy_space import bounds_for, random_strategy
from hybridsync.strategy import Strategy
from hybridsync.trials.store import (BASELINE_PREFIX, CONTROL_PREFIX, HOROVOD_FP16_KIND, HOROVOD_KIND, LOCAL_KIND,
                                     base_kind)
from hybridsync.variables import VariableInfo

HOROVOD_FINGERPRINT = "horovod"
RANDOM_ATTEMPTS_PER_SAMPLE = 20
"""Draws tried per wanted random strategy before giving up (duplicates are redrawn)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One strategy to measure and how it was chosen (``kind``: horovod, baseline:NAME, random, ...)."""

    kind: str
    strategy: Strategy | None
    """``None`` only for the reference rows: plain Horovod (any other kind), ``horovod-fp16`` and
    ``local-no-sync``."""

    @property
    def fingerprint(self) -> str:
        if self.strategy is not None:
            return self.strategy.fingerprint()
        kind = base_kind(self.kind)
        return kind if kind in (HOROVOD_FP16_KIND, LOCAL_KIND) else HOROVOD_FINGERPRINT

    def as_control(self) -> "Candidate":
        """This strategy, re-measured as a control between a job's candidates (``control:<kind>``)."""
        return dataclasses.replace(self, kind=CONTROL_PREFIX + base_kind(self.kind))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "strategy": None if self.strategy is None else self.strategy.to_dict()}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "Candidate":
        strategy = doc.get("strategy")
        return cls(kind=str(doc["kind"]), strategy=None if strategy is None else Strategy.from_dict(strategy))


def baseline_candidates(variables: Mapping[str, VariableInfo], spec: ClusterSpec, *,
                        fp16_twins: bool = False, rows: frozenset[str] = frozenset()) -> list[Candidate]:
    """Every baseline builder's strategy, with ``fp16_twins`` every runnable fp16 twin
    (``baseline:<name>-fp16``), with ``rows`` (the model's dense embeddings) every rows twin
    (``baseline:<name>-rows``, and with both ``<name>-rows-fp16``); PS builders only if the
    cluster has servers.

    Builders that produce the same strategy for this model share one candidate, whose kind
    names them all (``baseline:ps-lb+ps-partitioned``); so do builders whose strategies run alike
    on the cluster: with one rank per node hierarchical all-reduce runs as the ring
    (``ClusterSpec.hierarchical_is_ring``: ``baseline:allreduce+hierarchical``), and one trial measures both.
    """
    names = list(baselines.BUILDERS) + baselines.twin_names(fp16=fp16_twins, rows=bool(rows))
    by_fingerprint: dict[str, tuple[list[str], Strategy]] = {}
    for name in names:
        if baselines.split_twin(name)[0] in baselines.NEEDS_SERVERS and spec.num_servers == 0:
            continue
        try:
            strategy = baselines.build_baseline(name, variables, spec.num_servers, rows=rows)
        except ValueError:  # a twin that cannot run on this model (rivals() says why)
            continue
        as_run = strategy.with_ring_for_hierarchical() if spec.hierarchical_is_ring else strategy
        by_fingerprint.setdefault(as_run.fingerprint(), ([], strategy))[0].append(name)
    return [Candidate(kind=BASELINE_PREFIX + "+".join(names), strategy=strategy)
            for names, strategy in by_fingerprint.values()]


def rivals(variables: Mapping[str, VariableInfo], spec: ClusterSpec, *, horovod: bool,
           fp16: bool, rows: frozenset[str] = frozenset()) -> tuple[list[Candidate], dict[str, str]]:
    """What a tuned strategy has to beat: plain Horovod (``horovod``: the workload can run it),
    every baseline, with ``fp16`` Horovod with ``Compression.fp16`` and the baselines' fp16 twins,
    with ``rows`` (the model's dense embeddings) the rows twins (and both: rows-fp16 twins).
    Returns the runnable ones and, kind -> reason, the fp16 rivals that cannot run here."""
    out = [Candidate(kind=HOROVOD_KIND, strategy=None)] if horovod else []
    not_runnable: dict[str, str] = {}
    blocker = baselines.horovod_fp16_blocker(variables)
    if fp16 and horovod:
        if blocker:
            not_runnable[HOROVOD_FP16_KIND] = blocker
        else:
            out.append(Candidate(kind=HOROVOD_FP16_KIND, strategy=None))
    for as_rows in ((False, True) if rows else (False,)) if fp16 else ():
        reason = baselines.horovod_fp16_blocker(variables, as_rows=as_rows)
        if reason:  # the allreduce fp16 twins are Horovod with Compression.fp16
            not_runnable[BASELINE_PREFIX + "allreduce" + (baselines.ROWS_SUFFIX if as_rows else "")
                         + baselines.FP16_SUFFIX] = reason
    return out + baseline_candidates(variables, spec, fp16_twins=fp16, rows=rows), not_runnable


def rival_levers(kind: str) -> frozenset[str]:
    """The levers (``baselines.levers``) a rival of this kind uses: ``fp16`` for Horovod with
    ``Compression.fp16`` and the baselines' fp16 twins, ``rows`` for their rows twins, none for
    plain Horovod and the baselines."""
    kind = base_kind(kind)
    if kind == HOROVOD_FP16_KIND:
        return frozenset({"fp16"})
    if not kind.startswith(BASELINE_PREFIX):
        return frozenset()
    return frozenset().union(*(baselines.split_twin(name)[1]
                               for name in kind.removeprefix(BASELINE_PREFIX).split("+")))


def is_rival(kind: str) -> bool:
    """Whether ``kind`` is a hand-made rival: a reference row (Horovod) or a baseline."""
    kind = base_kind(kind)
    return kind in (HOROVOD_KIND, HOROVOD_FP16_KIND) or kind.startswith(BASELINE_PREFIX)


def random_candidates(variables: Mapping[str, VariableInfo], spec: ClusterSpec, count: int, seed: int,
                      exclude: Iterable[str] = ()) -> list[Candidate]:
    """``count`` distinct random strategies (``hybridsync.strategy_space``), none in ``exclude``.

    The same (model, spec, count, seed) always gives the same list, which is what lets an
    interrupted run resume where it stopped.
    """
    rng = np.random.default_rng(seed)
    bounds = bounds_for(spec)
    seen, out = set(exclude), []
    for _ in range(count * RANDOM_ATTEMPTS_PER_SAMPLE):
        if len(out) == count:
            break
        strategy = random_strategy(variables, bounds, rng)
        if strategy.fingerprint() not in seen:
            seen.add(strategy.fingerprint())
            out.append(Candidate(kind="random", strategy=strategy))
    return out


def trial_candidates(variables: Mapping[str, VariableInfo], spec: ClusterSpec, *, sample: int = 0,
                     seed: int = 0) -> list[Candidate]:
    """Every fair rival that runs here (``rivals``: plain Horovod, Horovod with ``Compression.fp16``,
    the baselines and their fp16 twins), then ``sample`` random strategies, without duplicates. The
    random strategies use fp16 where it pays, so their rivals have it too: a dataset's "best trial
    over the best baseline" then compares like with like."""
    out, _ = rivals(variables, spec, horovod=True, fp16=True)
    return out + random_candidates(variables, spec, sample, seed, exclude={c.fingerprint for c in out})


def load_candidates(path: str) -> list[Candidate]:
    """Strategies to measure from a file: a JSON list of strategy documents or of
    ``{"kind", "strategy"}`` entries, or a single strategy document (kind ``file``)."""
    with open(path, encoding="utf-8") as handle:
        doc = json.load(handle) if path.endswith(".json") else _yaml(handle)
    entries = doc if isinstance(doc, list) else [doc]
    out = []
    for i, entry in enumerate(entries):
        try:
            if isinstance(entry, Mapping) and "kind" in entry:
                out.append(Candidate.from_dict(entry))
            else:
                out.append(Candidate(kind="file", strategy=Strategy.from_dict(entry)))
        except (KeyError, ValueError) as error:
            raise ValueError(f"{path}: entry {i}: {error}") from None
    return out


def _yaml(handle: Any) -> Any:
    import yaml
    return yaml.safe_load(handle)
