"""Run configs: horovodrun's ``--config-file`` YAML plus a ``hybridsync:`` section.

horovodrun reads only the sections it knows (``params``, ``autotune``, ``timeline``...) and
ignores the rest, so one file configures both. The ``hybridsync:`` section names the
strategy (a path relative to the config file) and, for emulated or described clusters,
a ``cluster:`` spec (see ``hybridsync.cluster.spec``).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from hybridsync.strategy import Strategy

_KEYS = {"strategy", "cluster"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The ``hybridsync:`` section of a run config."""

    strategy_path: str | None = None
    """Absolute path of the strategy file, or None for plain Horovod behaviour."""
    cluster: Any = None
    """The ``ClusterSpec`` of the ``cluster:`` entry, if any."""

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
    unknown = sorted(set(section) - _KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) in 'hybridsync': {', '.join(unknown)} "
                         f"(allowed: {', '.join(sorted(_KEYS))})")
    strategy = section.get("strategy")
    if strategy is not None:
        strategy = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), strategy))
    cluster = None
    if section.get("cluster") is not None:
        from hybridsync.cluster.spec import ClusterSpec
        try:
            cluster = ClusterSpec.from_dict(section["cluster"])
        except ValueError as e:
            raise ValueError(f"{path}: hybridsync.cluster: {e}") from e
    return RunConfig(strategy_path=strategy, cluster=cluster)
