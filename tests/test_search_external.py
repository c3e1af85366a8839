"""The library searchers of the head-to-head (random, Optuna TPE, nevergrad NGOpt): same space,
same repair, valid strategies, no candidate scored twice (unit tier)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from hybridsync.cluster.spec import ClusterSpec
from hybridsync.description import load_description
from hybridsync.model.encoding import PS, model_arrays
from hybridsync import strategy_space as space
from hybridsync.search import operators
from hybridsync.search.evolution import EvolutionarySearch, bounds_for, run_search
from hybridsync.search.external import make_search

pytestmark = pytest.mark.unit

CLUSTER = ClusterSpec(nodes=2, workers_per_node=2, inter_node_bandwidth="250mbit", servers_per_node=1)


@pytest.fixture(scope="module")
def ncf():
    from pathlib import Path
    description = load_description(Path(__file__).resolve().parents[1] / "data" / "descriptions" / "ncf.json")
    return description, model_arrays(description)


def ps_share(batch) -> np.ndarray:
    """A cost that the library must learn: the share of variables not on the PS."""
    return 1.0 - (batch.route == PS).mean(axis=1)


@pytest.mark.parametrize("name,budget", [("random", 300), ("tpe", 40), ("ngopt", 40)])
def test_library_searchers_propose_repaired_distinct_candidates(ncf, name, budget):
    description, arrays = ncf
    search = make_search(name, arrays, CLUSTER, bounds_for(CLUSTER), np.random.default_rng(0), budget=budget)
    seen: set[bytes] = set()

    def cost(batch):
        keys = operators.row_keys(batch)
        assert not seen & set(keys) and len(set(keys)) == len(keys)
        seen.update(keys)
        again = space.repair(batch, arrays, bounds_for(CLUSTER))
        assert operators.row_keys(again) == keys  # already repaired
        return ps_share(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        best, strategy = run_search(search, cost, budget, batch=1 if name != "random" else 100, progress=False)
    strategy.validate_for(description.variables)
    assert len(seen) == budget
    assert best < 0.5  # every searcher finds candidates with most variables on the PS


def test_make_search_names_the_searchers(ncf):
    _, arrays = ncf
    assert isinstance(make_search("evolution", arrays, CLUSTER, bounds_for(CLUSTER), np.random.default_rng(0)),
                      EvolutionarySearch)
    with pytest.raises(ValueError, match="unknown searcher 'cma'.*evolution, random, tpe, ngopt"):
        make_search("cma", arrays, CLUSTER, bounds_for(CLUSTER), np.random.default_rng(0))
