"""Run configs: horovodrun's ``--config-file`` YAML plus a ``hybridsync:`` section.

horovodrun reads only the sections it knows (``params``, ``autotune``, ``timeline``...) and
ignores the rest, so one file configures both. The ``hybridsync:`` section names the
strategy (a path relative to the config file).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from hybridsync.strategy import Strategy

_KEYS = {"strategy"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The ``hybridsync:`` section of a run config."""

    strategy_path: str | None = None
    """Absolute path of the strategy file, or None for plain Horovod behaviour."""

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
    return RunConfig(strategy_path=strategy)
