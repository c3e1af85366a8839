"""What a trial run measures: the reference row, every baseline, and random strategies.

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
from hybridsync.trials.store import BASELINE_PREFIX, HOROVOD_KIND
from hybridsync.variables import VariableInfo

HOROVOD_FINGERPRINT = "horovod"
RANDOM_ATTEMPTS_PER_SAMPLE = 20
"""Draws tried per wanted random strategy before giving up (duplicates are redrawn)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One strategy to measure and how it was chosen (``kind``: horovod, baseline:NAME, random, ...)."""

    kind: str
    strategy: Strategy | None
    """``None`` only for the plain-Horovod reference row."""

    @property
    def fingerprint(self) -> str:
        return HOROVOD_FINGERPRINT if self.strategy is None else self.strategy.fingerprint()

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "strategy": None if self.strategy is None else self.strategy.to_dict()}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "Candidate":
        strategy = doc.get("strategy")
        return cls(kind=str(doc["kind"]), strategy=None if strategy is None else Strategy.from_dict(strategy))


def baseline_candidates(variables: Mapping[str, VariableInfo], spec: ClusterSpec) -> list[Candidate]:
    """Every baseline builder's strategy; PS builders only if the cluster has servers.

    Builders that produce the same strategy for this model share one candidate, whose kind
    names them all (``baseline:ps-lb+ps-partitioned``).
    """
    by_fingerprint: dict[str, tuple[list[str], Strategy]] = {}
    for name in baselines.BUILDERS:
        if name in baselines.NEEDS_SERVERS and spec.num_servers == 0:
            continue
        strategy = baselines.build_baseline(name, variables, spec.num_servers)
        by_fingerprint.setdefault(strategy.fingerprint(), ([], strategy))[0].append(name)
    return [Candidate(kind=BASELINE_PREFIX + "+".join(names), strategy=strategy)
            for names, strategy in by_fingerprint.values()]


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
                     seed: int = 0, include_baselines: bool = True, include_horovod: bool = True) -> list[Candidate]:
    """The reference row, the baselines, then ``sample`` random strategies, without duplicates."""
    out = [Candidate(kind=HOROVOD_KIND, strategy=None)] if include_horovod else []
    if include_baselines:
        out += baseline_candidates(variables, spec)
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
