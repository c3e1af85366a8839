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

The strategy is a file, never an inline mapping: every rank reads it from
``HYBRIDSYNC_STRATEGY``, and ``hybridsync explain`` and the search read and write files.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from hybridsync.strategy import Strategy

_KEYS = {"strategy", "num_servers", "partition_bytes", "cluster"}


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
                     partition_bytes=_integer(section, "partition_bytes", 1, path), cluster=cluster)


def _integer(section: dict, key: str, minimum: int, path: str) -> int | None:
    value = section.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{path}: hybridsync.{key} must be an integer >= {minimum}, got {value!r}")
    return value
