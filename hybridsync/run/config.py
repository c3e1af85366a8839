"""Run configs: horovodrun's ``--config-file`` YAML plus a ``hybridsync:`` section.

horovodrun reads only the sections it knows (``params``, ``autotune``, ``timeline``...) and
ignores the rest (``horovod.runner.common.util.config_parser``), so one file configures
both. The ``hybridsync:`` section holds what ``hybridsync-run`` would otherwise take as
flags, and for emulated or described clusters a ``cluster:`` spec (see
``hybridsync.cluster.spec``, read by ``hybridsync cluster``)::

    hybridsync:
      strategy: ../strategies/s.json   # a file, relative to this config (like --strategy)
      num_servers: 2                   # like --num-servers
      partition_bytes: 4096000         # like --partition-bytes
      autotune:                        # hybridsync-run --autotune with these settings
        trial_budget: 50               # like --trial-budget
        store: sqlite:///trials.db     # like --store
        report: autotune-report        # like --autotune-report (relative to the working directory)
        per_round: 10                  # trials per round
        search_budget: 20000           # simulator evaluations per round
        seed: 0
        exact: false                   # true: no fp16, BSP only (plain Horovod's numerics)
        runoff_passes: 8               # an unresolved lead: up to 8 runoff passes (0: none; else >= 6)
        time_limit_s: 600              # wall time of the whole autotune: rounds stop early, the runoff shrinks (null: none)
        enabled: true                  # default true when the section is there; false keeps it off

The strategy is a file, never an inline mapping: every rank reads it from
``HYBRIDSYNC_STRATEGY``, and ``hybridsync explain`` and the search read and write files.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from hybridsync.strategy import Strategy

SECTION_KEYS = {"strategy", "num_servers", "partition_bytes", "cluster", "autotune"}
"""The keys of the ``hybridsync:`` section (the guides name each: tests/test_docs.py)."""
AUTOTUNE_KEYS = {"enabled": bool, "trial_budget": int, "store": str, "report": str, "per_round": int,
                 "search_budget": int, "seed": int, "simulator": str, "exact": bool, "runoff_passes": int,
                 "time_limit_s": float}
"""The ``autotune:`` entries and their types (``hybridsync.autotune.launch`` reads them)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The ``hybridsync:`` section of a run config."""

    strategy_path: str | None = None
    """Absolute path of the strategy file, or None for plain Horovod behaviour."""
    num_servers: int | None = None
    """Parameter servers ``hybridsync-run`` starts (as ``--num-servers``), or None: its default."""
    partition_bytes: int | None = None
    """``BYTEPS_PARTITION_BYTES`` (as ``--partition-bytes``), or None: the default."""
    cluster: Any = None
    """The ``ClusterSpec`` of the ``cluster:`` entry, if any."""
    autotune: dict = dataclasses.field(default_factory=dict)
    """The ``autotune:`` entries, checked against ``AUTOTUNE_KEYS``; ``enabled`` is filled in
    (true when the section is present, unless it says false)."""

    def load_strategy(self) -> Strategy | None:
        return Strategy.load(self.strategy_path) if self.strategy_path else None


def load_run_config(path: str | os.PathLike) -> RunConfig:
    """Read the ``hybridsync:`` section of a horovodrun config file; ``ValueError`` on mistakes."""
    import yaml
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        doc: Any = yaml.safe_load(f) or {}
    section = doc.get("hybridsync") or {}
    if not isinstance(section, dict):
        raise ValueError(f"{path}: 'hybridsync' must be a mapping, got {type(section).__name__}")
    unknown = sorted(set(section) - SECTION_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) in 'hybridsync': {', '.join(unknown)} "
                         f"(allowed: {', '.join(sorted(SECTION_KEYS))})")
    strategy = section.get("strategy")
    if strategy is not None:
        if not isinstance(strategy, str) or not strategy:
            raise ValueError(f"{path}: hybridsync.strategy must be the path of a strategy file (relative to "
                             f"this config), got {type(strategy).__name__}")
        strategy = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), strategy))
    cluster = None
    if section.get("cluster") is not None:
        from hybridsync.cluster.spec import ClusterSpec
        try:
            cluster = ClusterSpec.from_dict(section["cluster"])
        except ValueError as e:
            raise ValueError(f"{path}: hybridsync.cluster: {e}") from e
    return RunConfig(strategy_path=strategy, num_servers=_integer(section, "num_servers", 0, path),
                     partition_bytes=_integer(section, "partition_bytes", 1, path), cluster=cluster,
                     autotune=_autotune(section, path))


def _autotune(section: dict, path: str) -> dict:
    raw = section.get("autotune")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: hybridsync.autotune must be a mapping of settings, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(AUTOTUNE_KEYS))
    if unknown:
        raise ValueError(f"{path}: unknown key(s) in 'hybridsync.autotune': {', '.join(unknown)} "
                         f"(allowed: {', '.join(sorted(AUTOTUNE_KEYS))})")
    for key, kind in AUTOTUNE_KEYS.items():
        value = raw.get(key)
        accepted = (int, float) if kind is float else kind  # 600 is a float setting's value too
        if value is not None and (not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool))):
            raise ValueError(f"{path}: hybridsync.autotune.{key} must be {kind.__name__}, got {value!r}")
        if kind is float and value is not None and not math.isfinite(value):
            raise ValueError(f"{path}: hybridsync.autotune.{key} must be a finite number, got {value!r}")
        minimum = _AUTOTUNE_MINIMUM.get(key, 1)
        if kind in (int, float) and minimum is not None and value is not None and value < minimum:
            raise ValueError(f"{path}: hybridsync.autotune.{key} must be >= {minimum}, got {value}")
    return {"enabled": True, **raw}


_AUTOTUNE_MINIMUM: dict[str, float | None] = {"seed": None, "runoff_passes": 0, "time_limit_s": 1}
"""Least value of a numeric ``autotune:`` entry when not 1 (``None``: any)."""


def _integer(section: dict, key: str, minimum: int, path: str) -> int | None:
    value = section.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{path}: hybridsync.{key} must be an integer >= {minimum}, got {value!r}")
    return value
