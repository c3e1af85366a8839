"""Evolutionary search over strategies, with knowledge constraints and repair.

``EvolutionarySearch`` is an ask/tell tuner (AutoTVM's ``next_batch``/``update`` shape):
``ask(n)`` proposes candidates never proposed before, ``tell(batch, costs)`` reports what
they cost (predicted or measured seconds per step; lower is better). The population
starts from the seeds (every baseline, typically) plus random candidates; each generation
keeps the elite, and fills the rest by tournament selection, per-variable crossover and
mutation, each child repaired into a valid strategy.

Mutations are the moves a person tuning by hand would make: move a variable to another
route or algorithm, split it finer or coarser, move it into or out of a merge group, toggle
its fp16 compression, change the PS protocol of every PS variable, move a shard to another
server; and for a whole class of variable at once (sparse, large dense, small dense), move it
to another route, turn its fp16 on or off, fuse it or split it up. Repair then enforces the constraints (``SpaceBounds``): partitions within the
variable's rows and the bound, servers that exist (and their memory), sparse gradients
never made dense unless allowed, merge groups only among variables that can share a message.

Candidates live as ``StrategyBatch`` arrays from ask to tell (drawn and repaired by the
strategy space, ``hybridsync.strategy_space``; mutated and crossed by ``search.operators``), so
the search keeps up with the simulator's batched predict: more than 10,000 candidates a
second end to end (``benchmarks/search.py``). Only the winners become ``Strategy``
objects (``best``, ``ranked``). Torch-free; all randomness from the ``numpy.random.Generator``
given.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Callable, Collection, Iterator, Protocol, Sequence

import numpy as np

from hybridsync import strategy_space as space
from hybridsync.cluster.spec import ClusterSpec
from hybridsync.model.encoding import ModelArrays, from_strategies
from hybridsync.search import operators
from hybridsync.strategy import Strategy
from hybridsync.strategy_space import SpaceBounds, StrategyBatch, bounds_for

if TYPE_CHECKING:
    from hybridsync.model.simulator import Simulator

__all__ = ["EvolutionSettings", "EvolutionarySearch", "Searcher", "auto_batch", "bounds_for", "run_search", "simulator_cost"]

MAX_DRAWS_PER_ASK = 20
"""Rounds of children per ``ask`` before it returns fewer than asked (the space is exhausted)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvolutionSettings:
    """How the population evolves."""

    population: int = 32
    """Best candidates told so far that parents are picked from."""
    initial: int = 128
    """Random candidates proposed after the seeds, before any child."""
    elite: int = 4
    """Best candidates that 10% of the children are mutants of (and that always stay in the population)."""
    tournament: int = 3
    """Candidates per tournament when picking a parent."""
    crossover_rate: float = 0.3
    """Share of children made by crossover of two parents (then mutated); the rest are mutants."""
    mutations_per_child: int = 2
    """Upper bound on the mutations applied to one child (at least one)."""
    archive: int = 1024
    immigrants: float = 0.05
    """Share of each ask's children that are fresh random candidates (keeps the population diverse)."""
    """Best told candidates kept for ``ranked`` and ``best`` (the others are only remembered as proposed)."""

    def __post_init__(self) -> None:
        if self.population < 2 or not 0 <= self.elite < self.population or self.tournament < 1:
            raise ValueError(f"need population >= 2, 0 <= elite < population, tournament >= 1; got {self}")
        if not 0 <= self.crossover_rate <= 1 or self.mutations_per_child < 1 or self.initial < 0:
            raise ValueError(f"need 0 <= crossover_rate <= 1, mutations_per_child >= 1, initial >= 0; got {self}")
        if self.archive < self.population:
            raise ValueError(f"archive ({self.archive}) must hold at least the population ({self.population})")


class Searcher(Protocol):
    """What ``run_search`` drives: this module's search and the library ones (``search.external``)."""

    def ask(self, n: int) -> StrategyBatch: ...

    def tell(self, batch: StrategyBatch, costs: np.ndarray) -> None: ...

    @property
    def best(self) -> tuple[float, Strategy] | None: ...


class EvolutionarySearch:
    """Ask/tell evolutionary search over the strategies of one model on one cluster."""

    def __init__(self, arrays: ModelArrays, cluster: ClusterSpec, bounds: SpaceBounds, rng: np.random.Generator,
                 seeds: Sequence[Strategy | None] = (), settings: EvolutionSettings = EvolutionSettings()) -> None:
        if bounds.num_servers > cluster.num_servers:
            raise ValueError(f"bounds allow {bounds.num_servers} servers but the cluster has {cluster.num_servers}")
        self.arrays, self.cluster, self.bounds, self.rng, self.settings = arrays, cluster, bounds, rng, settings
        self._proposed: set[bytes] = set()
        self._originals: dict[bytes, Strategy] = {}
        self._queue = self._encode_seeds(seeds)
        self._random_left = settings.initial
        self._archive = space.empty_batch(0, arrays.num_variables, bounds.num_servers)
        self._archive_costs = np.zeros(0)
        self._archive_keys: list[bytes] = []
        self._untold: StrategyBatch | None = None  # parents before the first costs arrive
        self._asked: tuple[StrategyBatch, list[bytes]] | None = None
        self._fresh_share = 0.8  # of children never proposed before (the rest repeat)

    def _encode_seeds(self, seeds: Sequence[Strategy | None]) -> StrategyBatch | None:
        """The seeds as repaired rows; a seed that repair leaves unchanged is returned as given
        by ``best``/``ranked`` (its fingerprint, group numbers and all)."""
        if not seeds:
            return None
        try:
            raw = from_strategies(self.arrays, list(seeds), self.cluster)
        except ValueError as error:
            raise ValueError(f"EvolutionarySearch: a seed does not fit: {error}") from None
        raw = _with_width(raw, max(self.bounds.num_servers, 1))
        repaired = space.repair(raw, self.arrays, self.bounds)
        canonical = raw.take(np.arange(len(raw)))
        canonical.group[:] = space.canonical_groups(raw)
        for key, seed, before, after in zip(operators.row_keys(repaired), seeds, operators.row_keys(canonical),
                                            operators.row_keys(repaired)):
            if seed is not None and before == after:
                self._originals.setdefault(key, seed)
        return repaired

    # --- ask / tell ---------------------------------------------------------------------------
    def ask(self, n: int) -> StrategyBatch:
        """Up to ``n`` candidates never proposed before (repaired): the seeds first, then
        ``settings.initial`` random ones, then children of the population (fewer than ``n``
        only when the space seems exhausted)."""
        parts, keys, wanted = [], [], n
        for _ in range(MAX_DRAWS_PER_ASK):
            if wanted <= 0:
                break
            drawn, from_children = self._draw(wanted)
            fresh, fresh_keys, share = self._fresh(drawn, wanted)
            if from_children:  # oversample the next children by the share of repeats seen
                self._fresh_share = 0.5 * self._fresh_share + 0.5 * max(share, 0.05)
            parts.append(fresh)
            keys += fresh_keys
            wanted -= len(fresh)
        out = (parts[0] if len(parts) == 1 else StrategyBatch.concatenate(parts) if parts
               else self._archive.take(np.zeros(0, np.int64)))
        self._asked = (out, keys)  # tell of this very batch reuses its keys
        if self._archive_costs.size == 0:
            self._untold = out if self._untold is None else StrategyBatch.concatenate([self._untold, out])
        return out

    def _draw(self, count: int) -> tuple[StrategyBatch, bool]:
        """Up to ``count`` candidates (seeds, random ones, or more children than that: some repeat)
        and whether they are children."""
        if self._queue is not None and len(self._queue):
            taken, self._queue = self._queue.take(np.arange(min(count, len(self._queue)))), \
                self._queue.take(np.arange(min(count, len(self._queue)), len(self._queue)))
            return taken, False
        if self._random_left > 0:
            count = min(count, self._random_left)
            self._random_left -= count
            return space.sample(self.arrays, self.bounds, self.rng, count), False
        return self._children(int(count / self._fresh_share * 1.1) + 8), True

    def _fresh(self, batch: StrategyBatch, most: int) -> tuple[StrategyBatch, list[bytes], float]:
        """Up to ``most`` candidates of ``batch`` never proposed (the first of each duplicate), now
        marked proposed, their keys, and the share of new ones among those looked at."""
        keep, keys, looked = [], [], 0
        for i, key in enumerate(operators.row_keys(batch)):
            if len(keep) == most:
                break
            looked += 1
            if key not in self._proposed:
                self._proposed.add(key)
                keep.append(i)
                keys.append(key)
        return batch.take(np.array(keep, dtype=np.int64)), keys, len(keep) / max(looked, 1)

    def _children(self, count: int) -> StrategyBatch:
        parents = self._parents()
        size, settings, rng = len(parents), self.settings, self.rng
        picks = rng.integers(size, size=(count, settings.tournament)).min(axis=1)  # sorted: lower is fitter
        from_elite = rng.random(count) < 0.1
        picks[from_elite] = rng.integers(max(min(settings.elite, size), 1), size=from_elite.sum())
        children = parents.take(picks)
        crossed = np.nonzero(rng.random(count) < settings.crossover_rate)[0]
        if len(crossed):
            mates = parents.take(rng.integers(size, size=(len(crossed), settings.tournament)).min(axis=1))
            mixed = operators.crossover(children.take(crossed), mates, rng)
            for field in dataclasses.fields(StrategyBatch):
                getattr(children, field.name)[crossed] = getattr(mixed, field.name)
        children = operators.mutate(children, self.arrays, self.bounds, rng, settings.mutations_per_child)
        children = space.repair(children, self.arrays, self.bounds)
        immigrants = int(rng.binomial(count, settings.immigrants))
        if immigrants:
            fresh = space.sample(self.arrays, self.bounds, rng, immigrants)
            children = StrategyBatch.concatenate([children.take(np.arange(count - immigrants)), fresh])
        return children

    def _parents(self) -> StrategyBatch:
        """The population sorted best first (before any cost: everything proposed, equally fit)."""
        if self._archive_costs.size:
            return self._archive.take(np.arange(min(self.settings.population, len(self._archive))))
        if self._untold is None or len(self._untold) == 0:  # nothing proposed yet and no random start
            return space.sample(self.arrays, self.bounds, self.rng, self.settings.population)
        return self._untold

    def tell(self, batch: StrategyBatch, costs: np.ndarray) -> None:
        """Reports each candidate's cost (seconds per step; ``inf`` for one that failed). A candidate
        told again keeps its latest cost (a measurement replacing a prediction)."""
        costs = np.asarray(costs, dtype=np.float64).reshape(-1)
        if len(batch) != len(costs):
            raise ValueError(f"{len(batch)} candidates but {len(costs)} costs")
        if len(batch) == 0:
            return
        costs = np.where(np.isnan(costs), np.inf, costs)
        if self._asked is not None and self._asked[0] is batch:
            keys = self._asked[1]
        else:  # rows made elsewhere (e.g. measured strategies): this search's server columns and group numbers
            batch = space.copy_batch(_with_width(batch, self._archive.server_share.shape[2]))
            batch.group[:] = space.canonical_groups(batch)
            keys = operators.row_keys(batch)
        self._proposed.update(keys)
        if len(self._archive_costs) >= self.settings.archive:  # only what can enter the archive (or replace a cost)
            known = set(self._archive_keys)
            enter = (costs < self._archive_costs[-1]) | np.array([key in known for key in keys])
            if not enter.any():
                return
            batch, costs, keys = batch.take(np.nonzero(enter)[0]), costs[enter], [k for k, e in zip(keys, enter) if e]
        latest = {key: i for i, key in enumerate(keys)}  # within the batch, the last cost of a key wins
        index = np.array(sorted(latest.values()), dtype=np.int64)
        told = set(latest)
        stay = np.array([i for i, key in enumerate(self._archive_keys) if key not in told], dtype=np.int64)
        merged = StrategyBatch.concatenate([self._archive.take(stay), batch.take(index)])
        merged_costs = np.concatenate([self._archive_costs[stay], costs[index]])
        merged_keys = [self._archive_keys[i] for i in stay] + [keys[i] for i in index]
        order = np.argsort(merged_costs, kind="stable")[:self.settings.archive]
        self._archive, self._archive_costs = merged.take(order), merged_costs[order]
        self._archive_keys = [merged_keys[i] for i in order]
        self._untold = None

    # --- results ------------------------------------------------------------------------------
    @property
    def best(self) -> tuple[float, Strategy] | None:
        """The lowest finite cost told so far and its strategy."""
        ranked = self.ranked(1)
        return ranked[0] if ranked else None

    def ranked(self, k: int, exclude: Collection[str] = ()) -> list[tuple[float, Strategy]]:
        """The ``k`` best distinct candidates told with a finite cost (of the ``settings.archive``
        best kept), best first, skipping strategies whose fingerprint is in ``exclude``."""
        return list(itertools.islice(self.iter_ranked(exclude), k))

    def iter_ranked(self, exclude: Collection[str] = ()) -> Iterator[tuple[float, Strategy]]:
        """``ranked`` built one strategy at a time, for a caller that stops early: turning the whole
        archive (1024) into strategies costs about a second on a model of a few hundred variables."""
        for i, key in enumerate(self._archive_keys):
            if not np.isfinite(self._archive_costs[i]):
                return
            strategy = self._originals.get(key) or self._archive.to_strategy(i, self.arrays.names)
            if strategy.fingerprint() not in exclude:
                yield float(self._archive_costs[i]), strategy


def _with_width(batch: StrategyBatch, servers: int) -> StrategyBatch:
    """``batch`` with ``servers`` server columns (the bounds' servers, which may be fewer than the cluster's)."""
    if batch.server_share.shape[2] == servers:
        return batch
    share = np.zeros(batch.route.shape + (servers,))
    kept = min(servers, batch.server_share.shape[2])
    share[:, :, :kept] = batch.server_share[:, :, :kept]
    return dataclasses.replace(batch, server_share=share)


def run_search(search: Searcher, cost: Callable[[StrategyBatch], np.ndarray], budget: int, batch: int | None = None,
               progress: bool = True) -> tuple[float, Strategy]:
    """Spends ``budget`` cost evaluations in batches (``cost`` scores a batch at once, e.g.
    ``simulator_cost``); returns the best (cost, strategy). ``batch`` (default: ``auto_batch``)
    is a generation of the evolutionary search. ``progress``: a bar on stderr while it is a terminal
    (in a log, a bar is tens of carriage-return redraws of a search that lasts seconds; the caller
    prints the result)."""
    from tqdm import tqdm

    batch = auto_batch(budget) if batch is None else batch
    if budget < 1 or batch < 1:
        raise ValueError(f"run_search: budget and batch must be >= 1, got budget {budget}, batch {batch}")
    with tqdm(total=budget, unit="strategy", disable=None if progress else True) as bar:  # None: a TTY only
        spent = 0
        while spent < budget:
            candidates = search.ask(min(batch, budget - spent))
            if len(candidates) == 0:
                break
            search.tell(candidates, cost(candidates))
            spent += len(candidates)
            bar.update(len(candidates))
            if search.best is not None:
                bar.set_postfix_str(f"best {search.best[0] * 1e3:.2f} ms", refresh=False)
    if search.best is None:
        raise ValueError("the search found no strategy with a finite cost (did every candidate fail?)")
    return search.best


def auto_batch(budget: int) -> int:
    """Candidates per ask for ``budget``: about 32 generations, 32 to 2,048 candidates each (small
    batches evolve more often; large ones keep the simulator's batched predict fast)."""
    return int(min(2048, max(32, budget // 32)))


def simulator_cost(simulator: "Simulator", arrays: ModelArrays,
                   cluster: ClusterSpec) -> Callable[[StrategyBatch], np.ndarray]:
    """The simulator's predicted seconds per step of a batch, as ``run_search``'s ``cost``."""
    servers = max(cluster.num_servers, 1)

    def cost(batch: StrategyBatch) -> np.ndarray:
        return simulator.predict_batch(arrays, cluster, _with_width(batch, servers))
    return cost
