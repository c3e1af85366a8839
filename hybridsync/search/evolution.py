"""Evolutionary search over strategies, with knowledge constraints and repair.

``EvolutionarySearch`` is an ask/tell tuner (AutoTVM's ``next_batch``/``update`` shape):
``ask(n)`` proposes strategies never proposed before, ``tell(strategies, costs)`` reports
what they cost (predicted or measured seconds per step; lower is better). The population
starts from the seeds (every baseline, typically) plus random strategies; each generation
keeps the elite, and fills the rest by tournament selection, per-variable crossover and
mutation, each child repaired into a valid strategy.

Mutations are the moves a person tuning by hand would make: move a variable to another
route or algorithm, split it finer or coarser, move it into or out of a merge group, toggle
its fp16 compression, change the PS protocol of every PS variable, move a shard to another
server. ``repair`` then enforces the constraints (``SpaceBounds``): partitions within the
variable's rows and the bound, servers that exist, sparse gradients never made dense
unless allowed, merge groups only among variables that can share a message. Torch-free;
all randomness from the ``numpy.random.Generator`` given.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np

from hybridsync.search.space import SPARSE_ALLGATHER, SpaceBounds, random_strategy
from hybridsync.strategy import PROTOCOLS, Strategy, VarConfig
from hybridsync.variables import VariableInfo

MUTATIONS = ("route", "partitions", "group", "compression", "protocol", "server")
MAX_DRAWS_PER_ASK = 50
"""Children tried per wanted new strategy before ``ask`` returns fewer (the space is exhausted)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvolutionSettings:
    """How the population evolves."""

    population: int = 64
    """Strategies kept per generation."""
    elite: int = 8
    """Best strategies carried over unchanged."""
    tournament: int = 3
    """Candidates per tournament when picking a parent."""
    crossover_rate: float = 0.5
    """Share of children made by crossover of two parents (then mutated); the rest are mutants."""
    mutations_per_child: int = 2
    """Upper bound on the mutations applied to one child (at least one)."""

    def __post_init__(self) -> None:
        if self.population < 2 or not 0 <= self.elite < self.population or self.tournament < 1:
            raise ValueError(f"need population >= 2, 0 <= elite < population, tournament >= 1; got {self}")
        if not 0 <= self.crossover_rate <= 1 or self.mutations_per_child < 1:
            raise ValueError(f"need 0 <= crossover_rate <= 1 and mutations_per_child >= 1; got {self}")


class EvolutionarySearch:
    """Ask/tell evolutionary search over the strategies of one model on one cluster."""

    def __init__(self, variables: Mapping[str, VariableInfo], bounds: SpaceBounds, rng: np.random.Generator,
                 seeds: Sequence[Strategy] = (), settings: EvolutionSettings = EvolutionSettings()) -> None:
        self.variables, self.bounds, self.rng, self.settings = dict(variables), bounds, rng, settings
        self._seeds = [repair(s, self.variables, bounds) for s in seeds]
        self._proposed: set[str] = set()
        self._scored: dict[str, tuple[float, Strategy]] = {}

    @property
    def best(self) -> tuple[float, Strategy] | None:
        """The lowest cost told so far and its strategy."""
        return min(self._scored.values(), key=lambda item: item[0]) if self._scored else None

    def ask(self, n: int) -> list[Strategy]:
        """Up to ``n`` strategies never proposed before: seeds first, then random ones until the
        first costs are told, then children of the current population."""
        out: list[Strategy] = []
        for _ in range(n * MAX_DRAWS_PER_ASK):
            if len(out) == n:
                break
            candidate = self._next()
            if candidate.fingerprint() not in self._proposed:
                self._proposed.add(candidate.fingerprint())
                out.append(candidate)
        return out

    def tell(self, strategies: Sequence[Strategy], costs: Sequence[float]) -> None:
        """Reports each strategy's cost (seconds per step; ``inf`` for one that failed)."""
        if len(strategies) != len(costs):
            raise ValueError(f"{len(strategies)} strategies but {len(costs)} costs")
        for strategy, cost in zip(strategies, costs):
            self._scored[strategy.fingerprint()] = (float(cost), strategy)

    def _next(self) -> Strategy:
        if self._seeds:
            return self._seeds.pop(0)
        if len(self._scored) < self.settings.population:
            return random_strategy(self.variables, self.bounds, self.rng)
        population = sorted(self._scored.values(), key=lambda item: item[0])[:self.settings.population]
        if self.rng.random() < 0.1:  # keep some of the elite as they are: a fresh mutant of the best
            child = population[int(self.rng.integers(self.settings.elite or 1))][1]
        elif self.rng.random() < self.settings.crossover_rate:
            child = crossover(self._pick(population), self._pick(population), self.variables, self.rng)
        else:
            child = self._pick(population)
        for _ in range(int(self.rng.integers(1, self.settings.mutations_per_child + 1))):
            child = mutate(child, self.variables, self.bounds, self.rng)
        return repair(child, self.variables, self.bounds)

    def _pick(self, population: list[tuple[float, Strategy]]) -> Strategy:
        picks = self.rng.integers(len(population), size=self.settings.tournament)
        return population[int(min(picks))][1]  # the population is sorted: the lowest index is the fittest


def run_search(search: EvolutionarySearch, cost: Callable[[list[Strategy]], np.ndarray], budget: int,
               batch: int = 256, progress: bool = True) -> tuple[float, Strategy]:
    """Spends ``budget`` cost evaluations in batches (``cost`` scores a list at once, e.g. the
    simulator's batched predict); returns the best (cost, strategy)."""
    from tqdm import tqdm
    with tqdm(total=budget, unit="strategy", disable=not progress) as bar:
        spent = 0
        while spent < budget:
            strategies = search.ask(min(batch, budget - spent))
            if not strategies:
                break
            search.tell(strategies, cost(strategies))
            spent += len(strategies)
            bar.update(len(strategies))
            bar.set_postfix_str(f"best {search.best[0] * 1e3:.2f} ms")
    if search.best is None:
        raise ValueError("the search evaluated no strategy (budget 0?)")
    return search.best


# --- operators ----------------------------------------------------------------------------------
def mutate(strategy: Strategy, variables: Mapping[str, VariableInfo], bounds: SpaceBounds,
           rng: np.random.Generator) -> Strategy:
    """One random move (see the module docstring); the result may need ``repair``."""
    configs = {name: strategy.config_for(name) for name in variables}
    names = list(variables)
    name = names[int(rng.integers(len(names)))]
    config = configs[name]
    kind = MUTATIONS[int(rng.integers(len(MUTATIONS)))]
    if kind == "route":
        routes = bounds.routes
        route, algorithm = routes[int(rng.integers(len(routes)))]
        configs[name] = (VarConfig(route="ps", partitions=config.partitions, group=config.group,
                                   compression=config.compression) if route == "ps"
                         else VarConfig(route="allreduce", algorithm=algorithm, partitions=config.partitions,
                                        group=config.group, compression=config.compression))
    elif kind == "partitions":
        partitions = config.partitions * 2 if rng.random() < 0.5 else max(1, config.partitions // 2)
        configs[name] = dataclasses.replace(config, partitions=partitions, servers=None)
    elif kind == "group":
        groups = sorted({c.group for c in configs.values() if c.group is not None})
        choices = [None, (max(groups) + 1) if groups else 0, *groups]
        configs[name] = dataclasses.replace(config, group=choices[int(rng.integers(len(choices)))])
    elif kind == "compression":
        configs[name] = dataclasses.replace(config, compression=None if config.compression else "fp16")
    elif kind == "protocol":
        protocol = PROTOCOLS[int(rng.integers(len(PROTOCOLS)))]
        staleness = int(rng.integers(1, 4)) if protocol == "ssp" else None
        configs = {n: dataclasses.replace(c, protocol=protocol, staleness=staleness) if c.route == "ps" else c
                   for n, c in configs.items()}
    elif config.route == "ps" and bounds.num_servers > 0:  # server
        servers = list(config.servers or [0] * config.partitions)
        servers[int(rng.integers(len(servers)))] = int(rng.integers(bounds.num_servers))
        configs[name] = dataclasses.replace(config, servers=tuple(servers))
    return Strategy(variables=configs)


def crossover(a: Strategy, b: Strategy, variables: Mapping[str, VariableInfo], rng: np.random.Generator) -> Strategy:
    """Each variable's config from one parent or the other (then ``repair`` the groups)."""
    take_a = rng.random(len(variables)) < 0.5
    return Strategy(variables={name: (a if first else b).config_for(name)
                               for name, first in zip(variables, take_a)})


def repair(strategy: Strategy, variables: Mapping[str, VariableInfo], bounds: SpaceBounds) -> Strategy:
    """The nearest valid strategy within ``bounds``: fixes routes the cluster lacks, shard counts,
    servers, sparse gradients made dense, and merge groups whose members cannot share a message."""
    configs = {name: _repair_config(strategy.config_for(name), info, bounds) for name, info in variables.items()}
    configs = _split_mixed_groups(configs)
    repaired = Strategy(variables=configs)
    repaired.validate_for(variables)
    return repaired


def _repair_config(config: VarConfig, info: VariableInfo, bounds: SpaceBounds) -> VarConfig:
    rows = info.shape[0] if info.shape else 1
    partitions = max(1, min(config.partitions, rows, bounds.max_partitions))
    if config.route == "ps" and bounds.num_servers == 0:
        config = VarConfig(route="allreduce", partitions=partitions, group=config.group, compression=config.compression)
    if config.route == "allreduce" and config.algorithm == "hierarchical" and not bounds.hierarchical:
        config = dataclasses.replace(config, algorithm="ring")
    if bounds.needs_allgather(info, config.route):
        return SPARSE_ALLGATHER
    servers = config.servers
    if servers is not None and (len(servers) != partitions or max(servers) >= bounds.num_servers):
        servers = None  # balanced by bytes
    return dataclasses.replace(config, partitions=partitions, servers=servers)


def _split_mixed_groups(configs: dict[str, VarConfig]) -> dict[str, VarConfig]:
    """A group whose members differ in route/variant/compression becomes one group per kind."""
    by_group: dict[int, dict[tuple, list[str]]] = {}
    for name, config in configs.items():
        if config.group is not None:
            by_group.setdefault(config.group, {}).setdefault(config.message_key[:-1], []).append(name)
    next_group = max(by_group, default=-1) + 1
    out = dict(configs)
    for kinds in by_group.values():
        for names in list(kinds.values())[1:]:
            for name in names:
                out[name] = dataclasses.replace(configs[name], group=next_group)
            next_group += 1
    return out
