"""Structured seeds (hand-made per-class mixes) and the class-wide mutations (unit tier)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hybridsync.cluster.spec import ClusterSpec
from hybridsync.description import load_description
from hybridsync import strategy_space as space
from hybridsync.model.encoding import PS, from_strategies, model_arrays
from hybridsync.router.plan import build_plan
from hybridsync.search import operators
from hybridsync.search.evolution import EvolutionarySearch, bounds_for
from hybridsync.search.seeds import embedding_like, structured_seeds
from hybridsync.strategy_space import LARGE_DENSE_BYTES, variable_classes
from hybridsync.trials.candidates import baseline_candidates

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ClusterSpec(nodes=2, workers_per_node=2, inter_node_bandwidth="1gbit", servers_per_node=1)
ONE_PER_NODE = ClusterSpec(nodes=4, workers_per_node=1, inter_node_bandwidth="500mbit", servers_per_node=1)
NO_SERVERS = ClusterSpec(nodes=2, workers_per_node=2, inter_node_bandwidth="1gbit")


def zoo(model: str):
    return load_description(ROOT / "data" / "descriptions" / f"{model}.json")


@pytest.mark.parametrize("model", ["ncf", "vgg", "bert", "resnet"])
@pytest.mark.parametrize("cluster", [CLUSTER, ONE_PER_NODE, NO_SERVERS], ids=["2x2", "4x1", "2x2-no-servers"])
@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
def test_seeds_validate_are_distinct_and_stay_within_bounds(model, cluster, exact):
    description = zoo(model)
    bounds = bounds_for(cluster, exact=exact)
    seeds = structured_seeds(description.variables, bounds)
    assert seeds, "every model gets hand-made mixes"
    fingerprints = [s.fingerprint() for _, s in seeds]
    assert len(set(fingerprints)) == len(seeds) and len({n for n, _ in seeds}) == len(seeds)
    for _, strategy in seeds:
        strategy.validate_for(description.variables)
        build_plan(description.variables, strategy)
        configs = [strategy.config_for(n) for n in description.variables]
        assert bounds.hierarchical or all(c.algorithm == "ring" for c in configs)
        assert cluster.num_servers or all(c.route == "allreduce" for c in configs)
        assert not exact or all(c.compression is None for c in configs)
    # the search keeps them as given: repair has nothing to change
    arrays = model_arrays(description)
    search = EvolutionarySearch(arrays, cluster, bounds, np.random.default_rng(0), seeds=[s for _, s in seeds])
    asked = search.ask(len(seeds))
    search.tell(asked, np.arange(len(seeds), dtype=float))
    assert [s.fingerprint() for _, s in search.ranked(len(seeds))] == fingerprints


def test_the_hand_mix_puts_embeddings_whole_on_the_ps_and_merges_dense_layers_but_the_largest():
    description = zoo("ncf")
    variables = description.variables
    seeds = dict(structured_seeds(variables, bounds_for(CLUSTER)))
    mix, mix_fp16 = seeds["sparse-ps-dense-merged"], seeds["sparse-ps-dense-merged-fp16"]
    dense = [n for n, info in variables.items() if not info.sparse]
    largest = max(dense, key=lambda n: variables[n].nbytes)
    for name, info in variables.items():
        config = mix.config_for(name)
        if info.sparse:
            assert config.route == "ps" and config.partitions == 1 and config.compression is None
            assert mix_fp16.config_for(name).compression is None  # fp16 never on a sparse gradient
        else:
            assert (config.route, config.algorithm) == ("allreduce", "hierarchical")
            assert (config.group is None) == (name == largest)
            assert mix_fp16.config_for(name).compression == "fp16"
    assert len({mix.config_for(n).group for n in dense if n != largest}) == 1


@pytest.mark.parametrize("cluster", [CLUSTER, ONE_PER_NODE], ids=["2x2", "4x1"])
def test_the_two_stage_mix_merges_dense_layers_into_two_halves_by_backward_order(cluster):
    """The first message holds the last layers (ready first) and about half the dense bytes, so it can
    go out while the backward pass computes the rest (PyTorch DDP's buckets)."""
    variables = zoo("resnet").variables
    seeds = dict(structured_seeds(variables, bounds_for(cluster)))
    two_stage, merged = seeds["sparse-ps-dense-two-stage-fp16"], seeds["sparse-ps-dense-merged-fp16"]
    algorithm = "hierarchical" if cluster.workers_per_node > 1 else "ring"
    names = list(variables)
    groups = [two_stage.config_for(n).group for n in names]
    assert all(two_stage.config_for(n).algorithm == algorithm for n in names)
    assert len(set(groups)) == 2 and None not in groups
    boundary = groups.index(groups[-1])  # the last variables (ready first) are the first stage
    assert set(groups[boundary:]) == {groups[-1]} and set(groups[:boundary]) == {groups[0]}
    first = sum(variables[n].nbytes for n in names[boundary:]) / sum(v.nbytes for v in variables.values())
    assert 0.3 < first < 0.7
    assert two_stage.fingerprint() != merged.fingerprint()


def test_seed_kinds_name_a_sparse_route_only_on_a_model_with_sparse_variables():
    from hybridsync.autotune.loop import seed_candidates
    for model, sparse in (("resnet", False), ("ncf", True)):
        kinds = [c.kind for c in seed_candidates(zoo(model), CLUSTER, exact=False, exclude=set())]
        assert any("dense-two-stage-fp16" in kind for kind in kinds)
        assert any(kind.startswith("search:seed-sparse-") for kind in kinds) == sparse, kinds
        assert len(set(kinds)) == len(kinds)


def test_seeds_of_a_model_without_sparse_variables_are_dense_mixes_and_not_the_baselines():
    description = zoo("vgg")
    assert not any(info.sparse for info in description.variables.values())
    seeds = structured_seeds(description.variables, bounds_for(CLUSTER))
    baselines = {c.fingerprint for c in baseline_candidates(description.variables, CLUSTER, fp16_twins=True)}
    assert len({s.fingerprint() for _, s in seeds} - baselines) >= 3  # the loop drops those equal to a baseline
    routes = {(c.route, c.algorithm) for _, s in seeds for c in (s.config_for(n) for n in description.variables)}
    assert ("allreduce", "hierarchical") in routes  # dense layers: not only sent to the servers


@pytest.mark.parametrize("model", ["ncf", "bert"])
def test_class_wide_mutations_move_a_whole_class_and_stay_valid(model):
    description = zoo(model)
    arrays = model_arrays(description)
    bounds = bounds_for(CLUSTER)
    rng = np.random.default_rng(1)
    seeds = [s for _, s in structured_seeds(description.variables, bounds)]
    base = space.repair(from_strategies(arrays, seeds * 40, CLUSTER), arrays, bounds)
    klass = variable_classes(arrays)
    assert (klass == np.where(arrays.sparse, 0, np.where(arrays.nbytes >= LARGE_DENSE_BYTES, 1, 2))).all()
    rows = np.arange(len(base))
    cols = rng.integers(arrays.num_variables, size=len(base))
    members = klass[None, :] == klass[cols][:, None]
    for move in (operators._class_route, operators._class_fp16, operators._class_group):
        batch = space.copy_batch(base)
        move(batch, rows, cols, arrays, bounds, rng)
        if move is operators._class_route:  # one new route for the whole class, different from the chosen one's
            new = batch.route[rows, cols]
            assert (new != base.route[rows, cols]).all()
            assert (np.where(members, batch.route == new[:, None], True)).all()
        if move is operators._class_fp16:
            flipped = ~base.fp16[rows, cols]
            assert (np.where(members, batch.fp16 == flipped[:, None], batch.fp16 == base.fp16)).all()
        repaired = space.repair(batch, arrays, bounds)
        for i in range(0, len(repaired), 7):
            repaired.to_strategy(i, arrays.names).validate_for(description.variables)
        if move is not operators._class_group:
            assert (repaired.route != base.route).any() or (repaired.fp16 != base.fp16).any()
    assert (base.route == PS).any()


def _bert_with_rows(touched: int | None = 450):
    """The zoo's bert as profiled today (its dense token embedding's nonzero rows measured)."""
    import dataclasses
    description = zoo("bert")
    timing = dict(description.variable_timing)
    timing["token_embedding.weight"] = dataclasses.replace(timing["token_embedding.weight"], rows_touched=touched)
    return dataclasses.replace(description, variable_timing=timing)


@pytest.mark.parametrize("cluster", [CLUSTER, NO_SERVERS], ids=["2x2", "2x2-no-servers"])
def test_measured_embedding_rows_give_rows_seeds_beside_the_merged_fp16_dense_layers(cluster):
    from hybridsync.model.simulator import Simulator
    description = _bert_with_rows()
    rows_touched = {n: t.rows_touched for n, t in description.variable_timing.items() if t.rows_touched is not None}
    bounds = bounds_for(cluster)
    seeds = dict(structured_seeds(description.variables, bounds, rows_touched=rows_touched))
    with_rows = {name: s for name, s in seeds.items() if any(s.config_for(v).rows for v in description.variables)}
    expected = {"rows-ps-dense-merged", "rows-gather-dense-merged", "rows-ps-dense-merged-fp16",
                "rows-gather-dense-merged-fp16"} if cluster.num_servers else \
        {"rows-ps-dense-merged", "rows-ps-dense-merged-fp16"}  # no servers: the PS recipes are the all-gather ones
    expected |= {"rows-gather-dense-two-stage", "rows-gather-dense-two-stage-fp16", "rows-gather-dense-four-stage-fp16"}
    assert set(with_rows) == expected
    for name, strategy in with_rows.items():
        rows = [v for v in description.variables if strategy.config_for(v).rows]
        assert rows == ["token_embedding.weight"]  # measured: the one dense table a step touches 6% of
        others = [strategy.config_for(v) for v in description.variables if v not in rows]
        compression = "fp16" if name.endswith("-fp16") else None
        assert all(c.compression == compression and c.algorithm == "hierarchical"
                   for c in others if c.route == "allreduce")
        assert sum(c.group is not None for c in others) >= len(others) - 1  # merged, the largest alone
        groups = {c.group for c in others if c.group is not None}
        assert len(groups) == (2 if "two-stage" in name else 4 if "four-stage" in name else 1)
    if cluster.num_servers:
        assert seeds["rows-ps-dense-merged-fp16"].config_for("token_embedding.weight").route == "ps"
        assert seeds["rows-gather-dense-merged-fp16"].config_for("token_embedding.weight").route == "allreduce"
    # the search keeps them as given (repair leaves rows where it holds)
    arrays = model_arrays(description)
    search = EvolutionarySearch(arrays, cluster, bounds, np.random.default_rng(0), seeds=list(with_rows.values()))
    asked = search.ask(len(with_rows))
    search.tell(asked, np.arange(len(with_rows), dtype=float))
    assert {s.fingerprint() for _, s in search.ranked(len(with_rows))} == {s.fingerprint() for s in with_rows.values()}
    # priced as rows: faster than the same mix sending the table dense
    slow = ClusterSpec(nodes=2, workers_per_node=2, inter_node_bandwidth="250mbit",
                       servers_per_node=cluster.servers_per_node)
    dense_mix = seeds["sparse-ps-dense-merged-fp16"]
    t_dense, *t_rows = Simulator(kind="analytic").predict(description, slow, [dense_mix, *with_rows.values()])
    assert max(t_rows) < t_dense


@pytest.mark.parametrize("touched", [450, 4000, None])
def test_the_search_may_send_rows_exactly_where_the_seeds_and_rivals_do(touched):
    """One rule (``strategy_space.is_embedding_like``) for the search's rows move, the rows seeds and
    the rivals' rows twins: a winner never sends rows on a variable no rival may."""
    description = _bert_with_rows(touched)
    rows_touched = {n: t.rows_touched for n, t in description.variable_timing.items() if t.rows_touched is not None}
    arrays = model_arrays(description)
    searched = {arrays.names[i] for i in np.nonzero(arrays.embedding_like)[0]}
    assert searched == set(embedding_like(description.variables, rows_touched))
    assert searched == ({"token_embedding.weight"} if touched == 450 else set())


def test_exact_mode_keeps_the_lossless_rows_seeds():
    description = _bert_with_rows()
    seeds = dict(structured_seeds(description.variables, bounds_for(CLUSTER, exact=True),
                                  rows_touched={"token_embedding.weight": 450}))
    with_rows = {name for name, s in seeds.items() if s.config_for("token_embedding.weight").rows}
    assert with_rows == {"rows-ps-dense-merged", "rows-gather-dense-merged", "rows-gather-dense-two-stage"}
    assert all(s.config_for(v).compression is None for s in seeds.values() for v in description.variables)


def test_without_measured_rows_no_seed_sends_rows():
    for rows_touched in (None, {"token_embedding.weight": 4000}):  # unprofiled, or half its rows: not worth it
        description = _bert_with_rows(None)
        seeds = structured_seeds(description.variables, bounds_for(CLUSTER), rows_touched=rows_touched)
        assert not any(s.config_for(v).rows for _, s in seeds for v in description.variables)
        assert len(seeds) == len(structured_seeds(description.variables, bounds_for(CLUSTER)))


def test_candidates_that_differ_only_in_rows_are_different_candidates():
    description = _bert_with_rows()
    arrays = model_arrays(description)
    batch = space.empty_batch(2, arrays.num_variables, CLUSTER.num_servers)
    batch.rows[1, list(arrays.names).index("token_embedding.weight")] = True
    repaired = space.repair(batch, arrays, bounds_for(CLUSTER))
    assert repaired.rows[1].sum() == 1
    keys = operators.row_keys(repaired)
    assert keys[0] != keys[1]
