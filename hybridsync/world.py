"""The ranks a plan runs on, and a strategy fitted to them.

An elastic Horovod job (``horovodrun --min-np/--max-np --host-discovery-script``) re-forms
its world whenever a worker is lost or added, and the optimizer re-plans for each new one
(``DistributedOptimizer.rebuild_for_world``). A strategy written for one world may not fit
the next, and the world is not the user's to choose, so ``fit_to_world`` replaces each
route the world cannot run by the nearest one it can, and says why; the optimizer warns
and goes on:

- Hierarchical all-reduce needs two levels: 2 or more nodes holding the same number (2 or
  more) of ranks each. With one node, one rank per node, or nodes of different sizes, the
  variable is ring all-reduced instead: the same sums (with one level the hierarchy is a
  flat all-reduce anyway; nodes of different sizes have no node-by-node slices).
- The parameter-server route does not run in an elastic job: the servers are started for
  a fixed number of workers (``DMLC_NUM_WORKER``), a BSP step waits for that many pushes,
  and a process in the servers' RPC group cannot be replaced. Ring all-reduce instead:
  for BSP the same average; ASP/SSP become synchronous (and a Sync-Switch policy, which
  only switches PS variables, is dropped with them).

Partitions, merge groups and compression are kept: they fit any world. Pure data: no torch,
no Horovod (``current_world`` asks Horovod).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Sequence

from hybridsync import envvars
from hybridsync.strategy import Strategy, VarConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class World:
    """The job's ranks as every rank sees them once Horovod is initialized."""

    size: int
    local_size: int | None
    """Ranks per node; ``None`` when the nodes hold different numbers of ranks."""
    elastic: bool = False
    """An elastic Horovod job: the world may change at every reset."""

    @property
    def num_nodes(self) -> int | None:
        return None if self.local_size is None else self.size // self.local_size

    def __str__(self) -> str:
        kind = ", elastic" if self.elastic else ""
        if self.local_size is None:
            return f"{self.size} ranks on nodes of different sizes{kind}"
        nodes, ranks = self.num_nodes, self.local_size
        return f"{nodes} node{'s' if nodes != 1 else ''} x {ranks} rank{'s' if ranks != 1 else ''}{kind}"

    def hierarchical_problem(self) -> str | None:
        """Why hierarchical all-reduce does not fit this world (``None``: it does)."""
        if self.local_size is None or self.num_nodes < 2 or self.local_size < 2:
            return ("hierarchical all-reduce needs 2 or more nodes of 2 or more ranks each, every node "
                    "holding as many; ring all-reduce gives the same sums")
        return None

    def ps_problem(self) -> str | None:
        """Why the parameter-server route does not fit this world (``None``: it does)."""
        if self.elastic:
            return ("the parameter servers are started for a fixed number of workers, so the PS route "
                    "does not run in an elastic job; ring all-reduce gives BSP's average (ASP/SSP "
                    "become synchronous)")
        return None


def elastic_job(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a rank of an elastic Horovod job (horovodrun sets ``HOROVOD_ELASTIC=1``)."""
    return (os.environ if env is None else env).get(envvars.HOROVOD_ELASTIC, "") == "1"


def current_world() -> World:
    """The world of the running (initialized) Horovod job."""
    import horovod.torch as hvd
    from hybridsync.backends.hierarchical.layout import node_layout
    layout, _ = node_layout()  # None: nodes of different sizes
    return World(size=hvd.size(), local_size=None if layout is None else layout.local_size, elastic=elastic_job())


def fit_to_world(strategy: Strategy | None, variables: Sequence[str], world: World) -> tuple[Strategy | None, list[str]]:
    """``strategy`` with every route ``world`` cannot run replaced by ring all-reduce, and one
    line per replacement naming the ``variables`` (the model's, in order) it moves and why.

    The same strategy and world give the same result on every rank, so the ranks' plans agree.
    """
    if strategy is None:
        return None, []
    problems = {"hierarchical": world.hierarchical_problem(), "ps": world.ps_problem()}

    def fitted(config: VarConfig) -> VarConfig:
        if config.route == "ps" and problems["ps"]:
            return VarConfig(partitions=config.partitions, group=config.group, compression=config.compression)
        if config.hierarchical and problems["hierarchical"]:
            return dataclasses.replace(config, algorithm="ring")
        return config

    default = fitted(strategy.default)
    configs = {name: fitted(config) for name, config in strategy.variables.items()}
    result = Strategy(default=default, variables=configs)
    keeps_ps = result.uses_ps
    if keeps_ps:
        result = dataclasses.replace(result, sync=strategy.sync)
    moved: dict[tuple[str, str], list[str]] = {}
    for name in variables:
        before, after = strategy.config_for(name), result.config_for(name)
        if before != after:
            moved.setdefault((before.route_name, after.route_name), []).append(name)
    notes = [f"{_shown(names)}: {old} -> {new} ({problems['ps' if old.startswith('ps/') else 'hierarchical']})"
             for (old, new), names in moved.items()]
    if strategy.sync is not None and strategy.sync.dynamic and not keeps_ps:
        notes.append(f"sync policy {strategy.sync.policy!r} dropped: no variable is left on the PS route")
    return result, notes


def _shown(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
