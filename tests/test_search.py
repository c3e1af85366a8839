"""The evolutionary search: constraints, repair, reproducibility, and that it beats random search (unit tier)."""
from __future__ import annotations

import numpy as np
import pytest

from hybridsync import baselines
from hybridsync.router.plan import build_plan
from hybridsync.search.evolution import EvolutionarySearch, EvolutionSettings, crossover, mutate, repair, run_search
from hybridsync.search.space import SpaceBounds, random_strategy
from hybridsync.strategy import Strategy, VarConfig
from hybridsync.variables import VariableInfo

pytestmark = pytest.mark.unit

VARIABLES = {f"layer{i}.weight": VariableInfo(name=f"layer{i}.weight", shape=(64 * (i + 1), 64)) for i in range(16)}
VARIABLES["emb.weight"] = VariableInfo(name="emb.weight", shape=(5000, 16), sparse=True)
BOUNDS = SpaceBounds(num_servers=2, max_partitions=8)


TARGET_ROUTE = {name: ("allreduce/ring", "allreduce/hierarchical", "ps/bsp")[i % 3]
                for i, name in enumerate(VARIABLES) if not VARIABLES[name].sparse}
TARGET_PARTITIONS = {name: 1 + i % 4 for i, name in enumerate(VARIABLES)}


def known_cost(strategies: list[Strategy]) -> np.ndarray:
    """A cost with a known optimum that no single knob reaches: each dense variable has its own
    best route and shard count (random search must hit all 16 at once; evolution improves one
    at a time); every message costs a little, so fusing helps."""
    costs = []
    for strategy in strategies:
        cost = 1e-5 * len(build_plan(VARIABLES, strategy).messages)
        for name, route in TARGET_ROUTE.items():
            config = strategy.config_for(name)
            cost += 1e-3 * (config.route_name != route) + 1e-4 * abs(config.partitions - TARGET_PARTITIONS[name])
        costs.append(cost)
    return np.array(costs)


def test_operators_and_repair_always_give_valid_strategies_within_bounds():
    rng = np.random.default_rng(0)
    bounds = SpaceBounds(num_servers=2, hierarchical=False, max_partitions=3)
    strategies = [random_strategy(VARIABLES, BOUNDS, rng) for _ in range(20)]
    for i in range(300):
        child = crossover(strategies[i % 20], strategies[(i * 7) % 20], VARIABLES, rng)
        child = repair(mutate(mutate(child, VARIABLES, BOUNDS, rng), VARIABLES, BOUNDS, rng), VARIABLES, bounds)
        build_plan(VARIABLES, child)  # groups consistent, shapes fit
        for name, info in VARIABLES.items():
            config = child.config_for(name)
            assert config.partitions <= 3 and config.algorithm == "ring"
            if info.sparse and config.route == "allreduce":
                assert (config.partitions, config.group, config.compression) == (1, None, None)


def test_repair_splits_groups_whose_members_cannot_share_a_message():
    mixed = Strategy(variables={"layer0.weight": VarConfig(route="allreduce", group=0),
                                "layer1.weight": VarConfig(route="ps", group=0),
                                "emb.weight": VarConfig(route="allreduce", algorithm="hierarchical", group=0)})
    repaired = repair(mixed, VARIABLES, BOUNDS)
    assert repaired.config_for("layer0.weight").group != repaired.config_for("layer1.weight").group
    assert repaired.config_for("emb.weight") == VarConfig(route="allreduce")
    no_servers = repair(mixed, VARIABLES, SpaceBounds(num_servers=0))
    assert no_servers.config_for("layer1.weight").route == "allreduce"


def test_search_is_reproducible_for_a_seed_and_seeds_come_first():
    seeds = [baselines.build_baseline(name, VARIABLES, 2) for name in ("allreduce", "parallax")]

    def best(seed: int) -> tuple[float, str]:
        search = EvolutionarySearch(VARIABLES, BOUNDS, np.random.default_rng(seed), seeds=seeds,
                                    settings=EvolutionSettings(population=16, elite=4))
        first = search.ask(2)
        assert [s.fingerprint() for s in first] == [s.fingerprint() for s in seeds]
        search.tell(first, known_cost(first))
        cost, strategy = run_search(search, known_cost, budget=300, batch=32, progress=False)
        return cost, strategy.fingerprint()
    assert best(3) == best(3)


def test_search_beats_random_search_at_equal_budget():
    wins = 0
    for seed in range(5):
        search = EvolutionarySearch(VARIABLES, BOUNDS, np.random.default_rng(seed),
                                    settings=EvolutionSettings(population=24, elite=4))
        evolved, _ = run_search(search, known_cost, budget=600, batch=48, progress=False)
        rng = np.random.default_rng(seed)
        randomly = known_cost([random_strategy(VARIABLES, BOUNDS, rng) for _ in range(600)]).min()
        wins += evolved < randomly
    assert wins >= 4


def test_ask_never_repeats_a_strategy():
    search = EvolutionarySearch(VARIABLES, BOUNDS, np.random.default_rng(1), settings=EvolutionSettings(population=8, elite=2))
    seen: set[str] = set()
    for _ in range(10):
        batch = search.ask(16)
        fingerprints = [s.fingerprint() for s in batch]
        assert not seen & set(fingerprints) and len(set(fingerprints)) == len(fingerprints)
        seen |= set(fingerprints)
        search.tell(batch, known_cost(batch))
    with pytest.raises(ValueError, match="2 strategies but 1 costs"):
        search.tell(batch[:2], [1.0])
