"""Which stored trials still measure what the runtime runs now.

The runtime sometimes starts to send a strategy differently on some clusters (a new backend, a
route sent another way). A trial measured before such a change measured behaviour the runtime no
longer has: the simulator must neither learn from it nor be scored on it. Every trial records the
runtime revision that measured it (``versions["runtime"]``, ``hybridsync.version.RUNTIME_REVISION``);
a trial stored before revisions were recorded is dated by its start against ``REVISIONS``.
``REVISIONS`` says, for every revision, which (strategy, cluster) pairs it changed; ``outdated``
tells a trial of an older revision that such a change covers.
"""
from __future__ import annotations

import dataclasses
import datetime
from typing import Callable

from hybridsync.cluster.spec import ClusterSpec
from hybridsync.strategy import Strategy
from hybridsync.trials.store import TrialRecord
from hybridsync.version import RUNTIME_REVISION


def _hierarchical_with_one_rank_per_node(strategy: Strategy | None, cluster: ClusterSpec) -> bool:
    return strategy is not None and strategy.uses_hierarchical and cluster.hierarchical_is_ring


@dataclasses.dataclass(frozen=True, kw_only=True)
class Revision:
    """One change of how the runtime sends strategies."""

    number: int
    """The ``RUNTIME_REVISION`` from which it runs so."""
    since: str
    """ISO-8601 UTC of the commit that made it: trials that record no revision and started before
    this ran an older one."""
    commit: str
    change: str
    """What runs differently, for the reader of a report."""
    changes: Callable[[Strategy | None, ClusterSpec], bool]
    """Whether a trial of this strategy on this cluster measured something else before it."""


REVISIONS: tuple[Revision, ...] = (
    Revision(number=2, since="2026-11-29T01:23:54+00:00", commit="1c96d87",
             change="with one rank per node, hierarchical all-reduce runs as the ring (backends.make_backend)",
             changes=_hierarchical_with_one_rank_per_node),
)
assert max(r.number for r in REVISIONS) == RUNTIME_REVISION, "a new RUNTIME_REVISION needs its REVISIONS entry"


def revision_of(record: TrialRecord) -> int:
    """The runtime revision that measured ``record``: the one it records, else the last whose
    ``since`` its start is not before (1 before any)."""
    recorded = record.versions.get("runtime")
    if recorded is not None:
        return int(recorded)
    started = datetime.datetime.fromisoformat(record.started)
    return max((r.number for r in REVISIONS if started >= datetime.datetime.fromisoformat(r.since)), default=1)


def outdated(record: TrialRecord) -> Revision | None:
    """The first later revision that changed what ``record`` measured (``None``: it measures what
    the runtime runs now)."""
    measured_by = revision_of(record)
    later = [r for r in REVISIONS if r.number > measured_by]
    if not later:
        return None
    strategy = None if record.strategy is None else Strategy.from_dict(record.strategy)
    cluster = ClusterSpec.from_dict(record.cluster)
    return next((r for r in sorted(later, key=lambda r: r.number) if r.changes(strategy, cluster)), None)


def current(records: list[TrialRecord]) -> tuple[list[TrialRecord], dict[str, int]]:
    """``records`` without the outdated ones, and how many each revision left out (by its ``change``)."""
    kept: list[TrialRecord] = []
    dropped: dict[str, int] = {}
    for record in records:
        revision = outdated(record)
        if revision is None:
            kept.append(record)
        else:
            dropped[revision.change] = dropped.get(revision.change, 0) + 1
    return kept, dropped
