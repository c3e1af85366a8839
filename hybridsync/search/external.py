"""Other searchers over the same space, for the head-to-head (issue 13 §2) and as a choice.

Each has ``EvolutionarySearch``'s ask/tell shape, so ``run_search`` drives any of them:

- ``random``: the strategy space's sampler (``strategy_space.sample``, which trials draw from too);
- ``tpe``: Optuna's TPE sampler;
- ``ngopt``: nevergrad's NGOpt (its own choice of algorithm for the parametrization).

The libraries are used as they are, on a parametrization of the same space: per variable a
route choice, log2 of its partitions, a merge group id (``GROUP_IDS`` of them, or none)
and fp16; per strategy the PS protocol (bsp, asp, ssp with staleness 1-3). Server placement
is left balanced. Each proposal is decoded into a ``StrategyBatch`` row and put through the
same ``repair`` as the evolutionary search. A proposal that repairs into a candidate
already scored is told its known cost and not proposed again (the libraries are not
charged for their repeats; ``repeats`` counts them). optuna and nevergrad are imported
only when their searcher is made.
"""
from __future__ import annotations

import math
from typing import Any, Literal, Sequence

import numpy as np

from hybridsync.cluster.spec import ClusterSpec
from hybridsync import knobs
from hybridsync import strategy_space as space
from hybridsync.model.encoding import ModelArrays
from hybridsync.search import operators
from hybridsync.search.evolution import EvolutionarySearch, EvolutionSettings
from hybridsync.strategy import Strategy
from hybridsync.strategy_space import SpaceBounds, StrategyBatch

SearcherName = Literal["evolution", "random", "tpe", "ngopt"]
SEARCHERS: tuple[str, ...] = ("evolution", "random", "tpe", "ngopt")
GROUP_IDS = 8
"""Merge group ids a library may give a variable (besides none)."""
PROTOCOL_CHOICES: tuple[tuple[int, int], ...] = (
    *((knobs.PROTOCOL.code(p), 0) for p in knobs.PROTOCOL.choices if p != "ssp"),
    *((knobs.PROTOCOL.code("ssp"), staleness) for staleness in knobs.STALENESS.draw))
"""(protocol code, staleness): bsp, asp, and ssp with each staleness the sampler draws (1-3 steps)."""
MAX_REPEATS_PER_ASK = 20
"""Library proposals per wanted candidate before ``ask`` returns fewer."""


def make_search(searcher: SearcherName, arrays: ModelArrays, cluster: ClusterSpec, bounds: SpaceBounds,
                rng: np.random.Generator, seeds: Sequence[Strategy | None] = (),
                settings: EvolutionSettings = EvolutionSettings(), budget: int = 2000) -> Any:
    """A searcher by name (``SEARCHERS``) for ``run_search``; the library searchers take
    their seed from ``rng`` and ignore ``seeds`` and ``settings``; NGOpt picks its algorithm
    knowing ``budget`` (the evaluations ``run_search`` will spend)."""
    if searcher == "evolution":
        return EvolutionarySearch(arrays, cluster, bounds, rng, seeds=seeds, settings=settings)
    kinds = {"random": RandomSearch, "tpe": OptunaSearch, "ngopt": NevergradSearch}
    if searcher not in kinds:
        raise ValueError(f"unknown searcher {searcher!r} (known: {', '.join(SEARCHERS)})")
    if searcher == "ngopt":
        return NevergradSearch(arrays, bounds, rng, budget=budget)
    return kinds[searcher](arrays, bounds, rng)


class _LibrarySearch:
    """Decoding, repair, dedupe and bookkeeping shared by the library searchers."""

    def __init__(self, arrays: ModelArrays, bounds: SpaceBounds, rng: np.random.Generator) -> None:
        self.arrays, self.bounds, self.rng = arrays, bounds, rng
        self.codes = operators.route_codes(bounds)
        self.log2_parts = int(math.log2(bounds.max_partitions))
        self.repeats = 0
        self._known: dict[bytes, float] = {}
        self._pending: dict[bytes, list[Any]] = {}
        self._best: tuple[float, StrategyBatch] | None = None

    def ask(self, n: int) -> StrategyBatch:
        rows, keys, tickets = [], [], []
        for _ in range(n * MAX_REPEATS_PER_ASK):
            if len(rows) == n:
                break
            ticket, choice = self._propose()
            row = space.repair(self._decode([choice]), self.arrays, self.bounds)
            key = operators.row_keys(row)[0]
            if key in self._known:
                self.repeats += 1
                self._answer(ticket, self._known[key])
            elif key in self._pending or key in keys:
                self.repeats += 1  # proposed and not yet scored: answered when it is
                self._pending.setdefault(key, []).append(ticket)
            else:
                rows.append(row)
                keys.append(key)
                tickets.append(ticket)
        for key, ticket in zip(keys, tickets):
            self._pending.setdefault(key, []).insert(0, ticket)
        return StrategyBatch.concatenate(rows) if rows else space.empty_batch(0, self.arrays.num_variables,
                                                                                   self.bounds.num_servers)

    def tell(self, batch: StrategyBatch, costs: np.ndarray) -> None:
        costs = np.asarray(costs, dtype=np.float64).reshape(-1)
        if len(batch) != len(costs):
            raise ValueError(f"{len(batch)} candidates but {len(costs)} costs")
        for i, (key, cost) in enumerate(zip(operators.row_keys(batch), costs)):
            cost = float(cost) if np.isfinite(cost) else math.inf
            self._known[key] = cost
            for ticket in self._pending.pop(key, []):
                self._answer(ticket, cost)
            if self._best is None or cost < self._best[0]:
                self._best = cost, batch.take([i])

    @property
    def best(self) -> tuple[float, Strategy] | None:
        if self._best is None:
            return None
        return self._best[0], self._best[1].to_strategy(0, self.arrays.names)

    def _decode(self, choices: Sequence[dict[str, Any]]) -> StrategyBatch:
        """Library choices (``route``, ``parts``, ``group``, ``fp16`` per variable; ``protocol``) as a batch."""
        batch = space.empty_batch(len(choices), self.arrays.num_variables, self.bounds.num_servers)
        for i, choice in enumerate(choices):
            batch.route[i] = self.codes[np.asarray(choice["route"], dtype=np.int64)]
            batch.partitions[i] = 2 ** np.asarray(choice["parts"], dtype=np.int64)
            batch.group[i] = np.asarray(choice["group"], dtype=np.int64) - 1
            batch.fp16[i] = np.asarray(choice["fp16"], dtype=bool)
            batch.protocol[i], batch.staleness[i] = PROTOCOL_CHOICES[int(choice["protocol"])]
        return batch

    def _propose(self) -> tuple[Any, dict[str, Any]]:
        raise NotImplementedError

    def _answer(self, ticket: Any, cost: float) -> None:
        raise NotImplementedError


class RandomSearch(_LibrarySearch):
    """Random search: the space's sampler, repaired; repeats skipped."""

    def ask(self, n: int) -> StrategyBatch:
        rows = space.sample(self.arrays, self.bounds, self.rng, n)
        keys = operators.row_keys(rows)
        fresh = [i for i, key in enumerate(keys) if key not in self._known and key not in keys[:i]]
        self.repeats += n - len(fresh)
        return rows.take(np.array(fresh, dtype=np.int64))


class OptunaSearch(_LibrarySearch):
    """Optuna's TPE sampler (``optuna.samplers.TPESampler``, its defaults) through ``study.ask``/``tell``."""

    def __init__(self, arrays: ModelArrays, bounds: SpaceBounds, rng: np.random.Generator) -> None:
        import optuna

        super().__init__(arrays, bounds, rng)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler = optuna.samplers.TPESampler(seed=int(rng.integers(2**31)))
        self.study = optuna.create_study(direction="minimize", sampler=sampler)

    def _propose(self) -> tuple[Any, dict[str, Any]]:
        trial, v = self.study.ask(), self.arrays.num_variables
        choice = {"route": [trial.suggest_int(f"route{j}", 0, len(self.codes) - 1) for j in range(v)],
                  "parts": [trial.suggest_int(f"parts{j}", 0, self.log2_parts) for j in range(v)],
                  "group": [trial.suggest_int(f"group{j}", 0, GROUP_IDS) for j in range(v)],
                  "fp16": [trial.suggest_int(f"fp16{j}", 0, 1) for j in range(v)],
                  "protocol": trial.suggest_int("protocol", 0, len(PROTOCOL_CHOICES) - 1)}
        return trial, choice

    def _answer(self, ticket: Any, cost: float) -> None:
        import optuna

        if math.isfinite(cost):
            self.study.tell(ticket, cost)
        else:
            self.study.tell(ticket, state=optuna.trial.TrialState.FAIL)


class NevergradSearch(_LibrarySearch):
    """nevergrad's ``NGOpt`` on a ``Dict`` of ``Choice`` arrays, one worker (sequential ask/tell)."""

    def __init__(self, arrays: ModelArrays, bounds: SpaceBounds, rng: np.random.Generator,
                 budget: int = 2000, optimizer: str = "NGOpt") -> None:
        import nevergrad as ng

        super().__init__(arrays, bounds, rng)
        v = arrays.num_variables
        parametrization = ng.p.Dict(route=ng.p.Choice(list(range(len(self.codes))), repetitions=v),
                                    parts=ng.p.Choice(list(range(self.log2_parts + 1)), repetitions=v),
                                    group=ng.p.Choice(list(range(GROUP_IDS + 1)), repetitions=v),
                                    fp16=ng.p.Choice([0, 1], repetitions=v),
                                    protocol=ng.p.Choice(list(range(len(PROTOCOL_CHOICES)))))
        parametrization.random_state = np.random.RandomState(int(rng.integers(2**31)))
        self.optimizer = ng.optimizers.registry[optimizer](parametrization=parametrization, budget=budget,
                                                           num_workers=1)

    def _propose(self) -> tuple[Any, dict[str, Any]]:
        candidate = self.optimizer.ask()
        return candidate, candidate.value

    def _answer(self, ticket: Any, cost: float) -> None:
        self.optimizer.tell(ticket, cost if math.isfinite(cost) else 1e9)
