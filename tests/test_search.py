"""The evolutionary search on ``StrategyBatch`` arrays: constraints and repair on every zoo model,
exact round trips, reproducibility, seeds, and that it beats random search (unit tier)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from hybridsync import baselines
from hybridsync.cluster.spec import ClusterSpec
from hybridsync.description import load_description, parse_description
from hybridsync.model.encoding import HIER, PS, RING, StrategyBatch, from_strategies, model_arrays
from hybridsync.router.plan import build_plan
from hybridsync import strategy_space as space
from hybridsync.search import operators
from hybridsync.search.evolution import EvolutionarySearch, EvolutionSettings, auto_batch, bounds_for, run_search
from hybridsync.strategy_space import SpaceBounds

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
ZOO = ("ncf", "bert", "vgg", "resnet")
CLUSTER = ClusterSpec(nodes=2, workers_per_node=2, inter_node_bandwidth="250mbit", servers_per_node=1)
ONE_PER_NODE = ClusterSpec(nodes=4, workers_per_node=1, inter_node_bandwidth="100mbit")


def zoo(model: str):
    description = load_description(ROOT / "data" / "descriptions" / f"{model}.json")
    return description, model_arrays(description)


def random_children(arrays, bounds: SpaceBounds, rng: np.random.Generator, count: int) -> StrategyBatch:
    """Samples, crossed and mutated (several moves each), then repaired: what ``ask`` proposes."""
    parents = space.sample(arrays, bounds, rng, 64)
    a, b = parents.take(rng.integers(64, size=count)), parents.take(rng.integers(64, size=count))
    children = operators.mutate(operators.crossover(a, b, rng), arrays, bounds, rng, max_mutations=4)
    return space.repair(children, arrays, bounds)


@pytest.mark.parametrize("model", ZOO)
@pytest.mark.parametrize("cluster,bounds", [
    (CLUSTER, bounds_for(CLUSTER)),
    (CLUSTER, bounds_for(CLUSTER, max_partitions=4, server_memory_bytes=2_000_000)),
    (CLUSTER, bounds_for(CLUSTER, densify_sparse=True)),
    (ONE_PER_NODE, bounds_for(ONE_PER_NODE)),
], ids=["2x2", "2x2-bounded", "2x2-densify", "4x1-no-servers"])
def test_repaired_children_are_valid_strategies_within_bounds(model, cluster, bounds):
    description, arrays = zoo(model)
    rng = np.random.default_rng(0)
    batch = random_children(arrays, bounds, rng, 600)
    most = np.minimum(arrays.rows, bounds.max_partitions)
    assert (batch.partitions >= 1).all() and (batch.partitions <= most).all()
    assert bounds.hierarchical or not (batch.route == HIER).any()
    assert bounds.num_servers or not (batch.route == PS).any()
    assert not (batch.fp16 & ~arrays.floating).any()
    if not bounds.densify_sparse:  # sparse gradients all-reduced only as Horovod's all-gather
        gather = arrays.sparse & (batch.route != PS)
        assert (batch.route[gather] == RING).all() and (batch.partitions[gather] == 1).all()
        assert (batch.group[gather] == -1).all() and not batch.fp16[gather].any()
    if bounds.server_memory_bytes:
        assert (np.where(batch.route == PS, arrays.nbytes, 0).sum(axis=1)
                <= bounds.server_memory_bytes * bounds.num_servers).all()
    assert (batch.route == PS).any() == (bounds.num_servers > 0)  # the space is explored, not collapsed
    strategies = [batch.to_strategy(i, arrays.names) for i in range(len(batch))]
    for strategy in strategies:
        strategy.validate_for(description.variables)
    for strategy in strategies[:50]:
        build_plan(description.variables, strategy)
    # exact round trip: the strategy a search returns is the candidate it scored
    again = from_strategies(arrays, strategies, cluster)
    width = batch.server_share.shape[2]
    for name in ("route", "protocol", "staleness", "partitions", "group", "fp16", "rows"):
        np.testing.assert_array_equal(getattr(again, name), getattr(batch, name), err_msg=name)
    assert batch.rows.any() == (model == "bert"), "rows moves only where a profile counted few rows"
    np.testing.assert_array_equal(again.server_share[:, :, :width], batch.server_share)


def test_repair_splits_mixed_groups_dissolves_singletons_and_numbers_groups_by_first_member():
    _, arrays = zoo("ncf")
    batch = space.empty_batch(1, arrays.num_variables, 2)
    dense = np.nonzero(~arrays.sparse)[0]
    batch.group[0, dense] = 5
    batch.route[0, dense[:3]] = PS  # three on the PS, the rest ring: two groups
    batch.group[0, 0], batch.route[0, 0] = 7, HIER  # a sparse variable hierarchical in a group of its own
    batch.server_share[0, dense[0]] = [0.5, 0.5]  # one shard cannot be split in halves
    repaired = space.repair(batch, arrays, bounds_for(CLUSTER))
    assert repaired.group[0, dense[:3]].tolist() == [0, 0, 0] and (repaired.group[0, dense[3:]] == 1).all()
    assert (repaired.route[0, 0], repaired.group[0, 0]) == (RING, -1)
    assert not repaired.server_share.any()
    keys = operators.row_keys(StrategyBatch.concatenate([repaired, space.repair(repaired, arrays,
                                                                                   bounds_for(CLUSTER))]))
    assert keys[0] == keys[1]  # repair is idempotent


def test_stage_moves_cut_and_join_merged_messages_in_ready_order():
    """``stages``: one fused message (every resnet gradient, hierarchical fp16) cut at a member
    in ready order, or joined with the message ready next; the stages stay runs in ready order."""
    _, arrays = zoo("resnet")
    start = space.empty_batch(400, arrays.num_variables, 2)
    start.route[:], start.fp16[:], start.group[:] = HIER, True, 0
    rng = np.random.default_rng(0)
    cut = start.take(np.arange(400))
    operators.MUTATIONS["stages"](cut, np.arange(400), rng.integers(arrays.num_variables, size=400), arrays,
                                  bounds_for(CLUSTER), rng)
    joined = cut.take(np.arange(400))
    operators.MUTATIONS["stages"](joined, np.arange(400), rng.integers(arrays.num_variables, size=400), arrays,
                                  bounds_for(CLUSTER), rng)
    counts = {}
    for batch, most in ((cut, 2), (joined, 3)):
        for row in space.repair(batch, arrays, bounds_for(CLUSTER)).group:
            in_order = row[arrays.ready_order]
            in_order = np.where(in_order >= 0, in_order, -1 - np.arange(len(in_order)))  # a message of one: no group
            stages = 1 + int((np.diff(in_order) != 0).sum())
            assert stages == len(set(in_order.tolist())) <= most  # each stage a run in ready order
            counts[stages] = counts.get(stages, 0) + 1
    assert {1, 2, 3} <= set(counts)
    assert (cut.route == HIER).all() and cut.fp16.all()


def test_server_memory_bound_moves_the_largest_ps_variables_off():
    _, arrays = zoo("vgg")
    batch = space.empty_batch(1, arrays.num_variables, 2)
    batch.route[:] = PS
    capacity = int(arrays.nbytes.sum() / 4)
    repaired = space.repair(batch, arrays, bounds_for(CLUSTER, server_memory_bytes=capacity))
    on_ps = repaired.route[0] == PS
    assert arrays.nbytes[on_ps].sum() <= 2 * capacity and on_ps.any()
    assert arrays.nbytes[~on_ps].min() >= arrays.nbytes[on_ps].max()


def test_seeds_come_first_and_come_back_as_given():
    description, arrays = zoo("bert")
    seeds = [None] + [baselines.build_baseline(name, description.variables, CLUSTER.num_servers)
                      for name in ("horovod-hierarchical", "parallax", "ps-partitioned")]
    search = EvolutionarySearch(arrays, CLUSTER, bounds_for(CLUSTER), np.random.default_rng(0), seeds=seeds)
    first = search.ask(len(seeds))
    np.testing.assert_array_equal(first.route, from_strategies(arrays, seeds, CLUSTER).route)
    search.tell(first, np.array([4.0, 1.0, 2.0, 3.0]))
    ranked = search.ranked(3, exclude={seeds[2].fingerprint()})
    assert [cost for cost, _ in ranked] == [1.0, 3.0, 4.0]
    assert ranked[0][1].fingerprint() == seeds[1].fingerprint()  # its own group numbering, not the canonical one
    assert ranked[1][1].fingerprint() == seeds[3].fingerprint()
    assert ranked[2][1] == baselines.all_allreduce(description.variables)  # None: plain Horovod
    assert [(c, s.fingerprint()) for c, s in search.iter_ranked(exclude={seeds[2].fingerprint()})][:3] == \
        [(c, s.fingerprint()) for c, s in ranked]
    with pytest.raises(ValueError, match="a seed does not fit"):
        EvolutionarySearch(arrays, ONE_PER_NODE, bounds_for(ONE_PER_NODE), np.random.default_rng(0),
                           seeds=[seeds[3]])


def test_ask_never_repeats_and_tell_keeps_the_latest_cost():
    description, arrays = zoo("ncf")
    search = EvolutionarySearch(arrays, CLUSTER, bounds_for(CLUSTER), np.random.default_rng(1),
                                settings=EvolutionSettings(population=8, elite=2, initial=8))
    seen: set[bytes] = set()
    for _ in range(20):
        batch = search.ask(40)
        keys = operators.row_keys(batch)
        assert len(batch) == 40 and not seen & set(keys) and len(set(keys)) == len(keys)
        seen |= set(keys)
        search.tell(batch, known_cost(arrays)(batch))
    best_cost, best = search.best
    row = from_strategies(arrays, [best], CLUSTER)
    search.tell(row, np.array([best_cost + 1.0]))  # a measurement replacing the prediction
    assert search.best[0] < best_cost + 1.0 and best.fingerprint() not in {s.fingerprint() for _, s in search.ranked(1)}
    fused = from_strategies(arrays, [baselines.horovod_hierarchical(description.variables)], CLUSTER)
    mixed = space.copy_batch(fused)
    mixed.group[:] = np.where(fused.group >= 0, 10 - fused.group, -1)  # other group numbers, same strategy
    search.tell(mixed, np.array([-1.0]))
    told = from_strategies(arrays, [search.best[1]], CLUSTER)
    assert search.best[0] == -1.0 and operators.row_keys(told) == operators.row_keys(fused)
    search.tell(mixed, np.array([np.inf]))  # it failed when measured
    assert search.best[0] >= 0
    with pytest.raises(ValueError, match="40 candidates but 1 costs"):
        search.tell(batch, np.array([1.0]))


# --- a known objective --------------------------------------------------------------------------
def synthetic_arrays():
    """16 dense layers of growing size and a sparse embedding."""
    variables = [{"name": f"layer{i}.weight", "shape": [64 * (i + 1), 64], "ready_s": 0.001 * (16 - i),
                  "ready_order": 16 - i} for i in range(16)]
    variables.append({"name": "emb.weight", "shape": [5000, 16], "sparse": True, "ready_s": 0.0005, "ready_order": 0})
    doc = {"version": 1, "name": "synthetic", "variables": variables,
           "timing": {"forward_s": 0.01, "backward_s": 0.02, "optimizer_s": 0.001, "step_s": 0.04, "steps": 10}}
    return model_arrays(parse_description(doc))


def known_cost(arrays):
    """A cost with a known optimum that no single knob reaches: each dense variable has its own
    best route and shard count (random search must hit all of them at once; evolution improves
    one at a time); every message costs a little, so fusing helps."""
    dense = np.nonzero(~arrays.sparse)[0]
    target_route = np.array([RING, HIER, PS])[dense % 3]
    target_parts = 1 + dense % 4

    def cost(batch: StrategyBatch) -> np.ndarray:
        messages = np.where(batch.group < 0, batch.partitions, 0).sum(axis=1) + batch.group.max(axis=1) + 1
        return (1e-3 * (batch.route[:, dense] != target_route).sum(axis=1)
                + 1e-4 * np.abs(batch.partitions[:, dense] - target_parts).sum(axis=1) + 1e-5 * messages)
    return cost


def test_search_is_reproducible_for_a_seed():
    arrays = synthetic_arrays()

    def run(seed: int) -> tuple[float, str]:
        search = EvolutionarySearch(arrays, CLUSTER, bounds_for(CLUSTER), np.random.default_rng(seed),
                                    settings=EvolutionSettings(population=16, elite=4, initial=32))
        cost, strategy = run_search(search, known_cost(arrays), budget=600, batch=40, progress=False)
        return cost, strategy.fingerprint()
    assert run(3) == run(3)
    assert run(3) != run(4)


def test_search_beats_random_search_at_equal_budget():
    arrays = synthetic_arrays()
    cost, wins = known_cost(arrays), 0
    for seed in range(5):
        search = EvolutionarySearch(arrays, CLUSTER, bounds_for(CLUSTER), np.random.default_rng(seed))
        evolved, _ = run_search(search, cost, budget=1500, progress=False)
        randomly = cost(space.sample(arrays, bounds_for(CLUSTER), np.random.default_rng(seed), 1500)).min()
        wins += evolved < randomly
    assert wins == 5


def test_run_search_draws_its_bar_on_a_terminal_only(capsys, monkeypatch):
    """Piped to a log, ``hybridsync search`` printed its bar as 32 carriage-return redraws (2.7 KB for
    a 4 s search) before its result line; on a terminal the bar stays."""
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    arrays = synthetic_arrays()

    def search() -> EvolutionarySearch:
        return EvolutionarySearch(arrays, CLUSTER, bounds_for(CLUSTER), np.random.default_rng(0))
    run_search(search(), known_cost(arrays), budget=200, progress=True)
    assert capsys.readouterr().err == ""  # pytest's capture is no terminal
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    run_search(search(), known_cost(arrays), budget=200, progress=True)
    assert "200/200" in terminal.getvalue()


def test_run_search_checks_its_arguments_and_sizes_batches():
    arrays = synthetic_arrays()
    search = EvolutionarySearch(arrays, CLUSTER, bounds_for(CLUSTER), np.random.default_rng(0))
    with pytest.raises(ValueError, match="budget and batch must be >= 1"):
        run_search(search, known_cost(arrays), budget=0)
    assert auto_batch(2000) == 62 and auto_batch(100) == 32 and auto_batch(10**6) == 2048
    with pytest.raises(ValueError, match="max_partitions"):
        SpaceBounds(max_partitions=0)
    assert bounds_for(ONE_PER_NODE) == SpaceBounds(num_servers=0, hierarchical=False)
