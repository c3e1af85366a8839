"""The strategy space's random sampler, the trial candidates and the added baselines (unit tier)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from hybridsync import baselines
from hybridsync.cluster.spec import ClusterSpec
from hybridsync.router.plan import build_plan
from hybridsync.strategy_space import SpaceBounds, random_strategy
from hybridsync.trials.candidates import (HOROVOD_FP16_KIND, HOROVOD_KIND, Candidate, is_rival, load_candidates,
                                          random_candidates, rival_levers, rivals, trial_candidates)
from hybridsync.trials.runner import _Follower
from hybridsync.variables import VariableInfo

pytestmark = pytest.mark.unit

VARIABLES = {f"layer{i}.weight": VariableInfo(name=f"layer{i}.weight", shape=(128 * (i + 1), 64)) for i in range(12)}
VARIABLES["emb.weight"] = VariableInfo(name="emb.weight", shape=(20000, 32), sparse=True)
CLUSTER = ClusterSpec(nodes=2, workers_per_node=2, inter_node_bandwidth="1gbit", servers_per_node=1)


def test_random_strategies_are_valid_varied_and_reproducible():
    draws = [random_strategy(VARIABLES, SpaceBounds(num_servers=2), np.random.default_rng(7)) for _ in range(2)]
    assert draws[0] == draws[1]
    rng = np.random.default_rng(0)
    strategies = [random_strategy(VARIABLES, SpaceBounds(num_servers=2), rng) for _ in range(200)]
    # by-class draws repeat now and then (equal strategies are equal: merge groups in canonical form)
    assert len({s.fingerprint() for s in strategies}) >= 160
    by_class = [s for s in strategies if len({s.config_for(n).route_name for n in VARIABLES if n != "emb.weight"}) == 1
                and s.config_for("emb.weight").route_name != s.config_for("layer0.weight").route_name]
    assert len(by_class) >= 10, "some strategies route the sparse embedding apart from the dense layers"
    routes = {strategy.config_for(name).route_name for strategy in strategies for name in VARIABLES}
    assert routes >= {"allreduce/ring", "allreduce/hierarchical", "ps/bsp", "ps/asp", "ps/ssp"}
    configs = [strategy.config_for(name) for strategy in strategies for name in VARIABLES]
    assert any(c.partitions > 1 for c in configs) and any(c.group is not None for c in configs)
    assert any(c.compression == "fp16" for c in configs) and any(c.servers is not None for c in configs)
    for strategy in strategies:  # every one builds a routing plan
        assert build_plan(VARIABLES, strategy).messages


def test_random_strategies_respect_the_bounds():
    rng = np.random.default_rng(1)
    for _ in range(100):
        strategy = random_strategy(VARIABLES, SpaceBounds(num_servers=0, hierarchical=False, max_partitions=3), rng)
        for name in VARIABLES:
            config = strategy.config_for(name)
            assert config.route_name == "allreduce/ring" and config.partitions <= 3


def test_trial_candidates_start_with_horovod_and_every_fair_rival_without_duplicates():
    candidates = trial_candidates(VARIABLES, CLUSTER, sample=20, seed=3)
    assert candidates[0].kind == HOROVOD_KIND and candidates[0].strategy is None
    names = {name for c in candidates if c.kind.startswith("baseline:")
             for name in c.kind.removeprefix("baseline:").split("+")}
    runnable_twins = set(baselines.twin_names(fp16=True, rows=False)) - {"allreduce-fp16"}
    assert names == set(baselines.BUILDERS) | runnable_twins  # VARIABLES has a sparse embedding
    assert HOROVOD_FP16_KIND not in {c.kind for c in candidates}  # Horovod's fp16 fails on sparse gradients
    dense = {name: info for name, info in VARIABLES.items() if not info.sparse}
    assert HOROVOD_FP16_KIND in {c.kind for c in trial_candidates(dense, CLUSTER)}
    assert sum(c.kind == "random" for c in candidates) == 20
    assert len({c.fingerprint for c in candidates}) == len(candidates)
    assert [c.fingerprint for c in trial_candidates(VARIABLES, CLUSTER, sample=20, seed=3)] == \
        [c.fingerprint for c in candidates]


def test_without_servers_no_candidate_uses_the_ps():
    spec = ClusterSpec(nodes=2, workers_per_node=2, inter_node_bandwidth="1gbit")
    for candidate in trial_candidates(VARIABLES, spec, sample=30):
        if candidate.strategy is not None:
            assert all(candidate.strategy.config_for(n).route == "allreduce" for n in VARIABLES), candidate.kind


def test_random_candidates_exclude_what_is_already_listed():
    first = random_candidates(VARIABLES, CLUSTER, 5, seed=0)
    again = random_candidates(VARIABLES, CLUSTER, 5, seed=0, exclude={first[0].fingerprint})
    assert first[0].fingerprint not in {c.fingerprint for c in again}


def test_horovod_hierarchical_fuses_dense_variables_in_backward_order_and_keeps_sparse_on_ring():
    fusion = VARIABLES["layer11.weight"].nbytes + VARIABLES["layer10.weight"].nbytes
    strategy = baselines.horovod_hierarchical(VARIABLES, fusion_bytes=fusion)
    assert strategy.config_for("emb.weight").route_name == "allreduce/ring"
    assert strategy.config_for("emb.weight").group is None
    assert strategy.config_for("layer11.weight").group == strategy.config_for("layer10.weight").group == 0
    assert strategy.config_for("layer9.weight").group == 1
    assert {strategy.config_for(f"layer{i}.weight").algorithm for i in range(12)} == {"hierarchical"}
    whole = baselines.horovod_hierarchical(VARIABLES)  # 64 MB fusion buffer: one group
    assert {whole.config_for(f"layer{i}.weight").group for i in range(12)} == {0}


def test_build_baseline_names_the_known_builders():
    with pytest.raises(ValueError, match="unknown baseline 'nope'.*horovod-hierarchical"):
        baselines.build_baseline("nope", VARIABLES, 1)
    assert baselines.build_baseline("hierarchical", VARIABLES, 0).default.route == "allreduce"


def test_load_candidates_reads_a_strategy_a_list_and_kind_entries(tmp_path):
    one = {"version": 1, "default": {"route": "allreduce", "algorithm": "hierarchical"}}
    (tmp_path / "one.json").write_text(json.dumps(one))
    (tmp_path / "many.json").write_text(json.dumps([one, {"kind": "horovod", "strategy": None}]))
    assert [c.kind for c in load_candidates(str(tmp_path / "one.json"))] == ["file"]
    many = load_candidates(str(tmp_path / "many.json"))
    assert [c.kind for c in many] == ["file", "horovod"] and many[1].strategy is None
    (tmp_path / "bad.json").write_text(json.dumps([one, {"default": {"route": "carrier-pigeon"}}]))
    with pytest.raises(ValueError, match="(?s)entry 1.*carrier-pigeon"):
        load_candidates(str(tmp_path / "bad.json"))
    assert Candidate.from_dict(many[0].to_dict()) == many[0]


def test_results_follower_returns_only_complete_lines(tmp_path):
    path = tmp_path / "results.jsonl"
    follower = _Follower(str(path))
    assert follower.new_events() == []
    path.write_text('{"event": "ready"}\n{"event": "tri')
    assert follower.new_events() == [{"event": "ready"}]
    with open(path, "a") as handle:
        handle.write('al", "index": 0}\n')
    assert follower.new_events() == [{"event": "trial", "index": 0}]
    assert follower.new_events() == []


def test_sparse_gradients_stay_sparse_unless_allowed():
    def densified(strategy) -> bool:
        config = strategy.config_for("emb.weight")
        return config.route == "allreduce" and (config.algorithm != "ring" or config.partitions > 1
                                                 or config.group is not None or config.compression is not None)
    rng = np.random.default_rng(5)
    strategies = [random_strategy(VARIABLES, SpaceBounds(num_servers=2), rng) for _ in range(300)]
    assert not any(densified(s) for s in strategies)
    assert {s.config_for("emb.weight").route for s in strategies} == {"allreduce", "ps"}
    allowed = [random_strategy(VARIABLES, SpaceBounds(num_servers=2, densify_sparse=True), rng) for _ in range(300)]
    assert any(densified(s) for s in allowed)


def test_fp16_twins_add_fp16_to_the_dense_gradients_and_name_what_cannot_run():
    dense = {name: info for name, info in VARIABLES.items() if not info.sparse}
    for name in baselines.TWINS:
        twin = baselines.build_baseline(name + baselines.FP16_SUFFIX, dense, 1)
        plain = baselines.build_baseline(name, dense, 1)
        assert all(twin.config_for(n).compression == "fp16" and
                   twin.config_for(n).route_name == plain.config_for(n).route_name for n in dense)
        assert baselines.levers(twin, dense) == {"fp16"} and baselines.levers(plain, dense) == set()
    with pytest.raises(ValueError, match="not runnable.*sparse gradients"):
        baselines.build_baseline("allreduce-fp16", VARIABLES, 1)
    with pytest.raises(ValueError, match="has no twins"):
        baselines.fp16_twin("ps", VARIABLES, 1)
    hierarchical = baselines.build_baseline("horovod-hierarchical-fp16", VARIABLES, 1)
    assert hierarchical.config_for("emb.weight").compression is None  # a sparse gradient keeps its config


def test_rivals_are_the_reference_rows_the_baselines_and_where_fp16_runs_their_twins():
    exact, none_missing = rivals(VARIABLES, CLUSTER, horovod=True, fp16=False)
    assert none_missing == {} and all(not rival_levers(c.kind) for c in exact)
    fair, not_runnable = rivals(VARIABLES, CLUSTER, horovod=True, fp16=True)
    assert [c.kind for c in fair] == [c.kind for c in trial_candidates(VARIABLES, CLUSTER)]
    kinds = {c.kind for c in fair}
    assert {"baseline:horovod-hierarchical-fp16", "baseline:parallax-fp16"} <= kinds
    assert set(not_runnable) == {HOROVOD_FP16_KIND, "baseline:allreduce-fp16"} and not kinds & set(not_runnable)
    dense = {name: info for name, info in VARIABLES.items() if not info.sparse}
    fair, not_runnable = rivals(dense, CLUSTER, horovod=True, fp16=True)
    assert not_runnable == {} and {HOROVOD_FP16_KIND, "baseline:allreduce-fp16"} <= {c.kind for c in fair}
    horovod_fp16 = next(c for c in fair if c.kind == HOROVOD_FP16_KIND)
    assert horovod_fp16.fingerprint == HOROVOD_FP16_KIND != Candidate(kind=HOROVOD_KIND, strategy=None).fingerprint
    assert horovod_fp16.as_control().fingerprint == HOROVOD_FP16_KIND
    assert rival_levers("control:baseline:parallax-fp16") == {"fp16"} and rival_levers("horovod") == set()
    assert is_rival("control:horovod") and not is_rival("search:r1")


def test_rows_twins_send_the_dense_embeddings_rows_where_the_baseline_sends_a_sparse_gradient():
    dense = {name: info for name, info in VARIABLES.items() if not info.sparse}
    dense["tok.weight"] = VariableInfo(name="tok.weight", shape=(8000, 64))
    rows = frozenset({"tok.weight"})
    for name in baselines.TWINS:
        plain = baselines.build_baseline(name, dense, 2)
        twin = baselines.build_baseline(name + baselines.ROWS_SUFFIX, dense, 2, rows=rows)
        config = twin.config_for("tok.weight")
        assert config.rows and config.route == ("ps" if name == "parallax" else "allreduce")
        if config.route == "allreduce":  # Horovod's sparse all-gather: a ring, alone
            assert config.route_name == "allreduce/ring" and config.group is None
        assert all(twin.config_for(n).route_name == plain.config_for(n).route_name for n in dense if n not in rows)
        assert baselines.levers(twin, dense) == {"rows"}
        assert build_plan(dense, twin).messages
        if name != "allreduce":
            both = baselines.build_baseline(name + baselines.ROWS_SUFFIX + baselines.FP16_SUFFIX, dense, 2, rows=rows)
            assert baselines.levers(both, dense) == {"rows", "fp16"}
            assert both.config_for("tok.weight").compression is None and both.config_for("tok.weight").rows
            assert all(both.config_for(n).compression == "fp16" for n in dense if n not in rows)
    with pytest.raises(ValueError, match="not runnable.*sparse gradients"):  # Horovod's fp16 on a sparse embedding
        baselines.build_baseline("allreduce-rows-fp16", dense, 2, rows=rows)
    with pytest.raises(ValueError, match="dense embeddings"):
        baselines.build_baseline("parallax-rows", dense, 2)
    with pytest.raises(ValueError, match="not variables of the model: nope"):
        baselines.build_baseline("parallax-rows", dense, 2, rows=frozenset({"nope"}))


def test_rivals_have_rows_twins_only_for_a_model_with_dense_embeddings():
    from hybridsync.autotune.result import fair_rivals
    dense = {name: info for name, info in VARIABLES.items() if not info.sparse}
    dense["tok.weight"] = VariableInfo(name="tok.weight", shape=(8000, 64))
    fair, not_runnable = rivals(dense, CLUSTER, horovod=True, fp16=True, rows=frozenset({"tok.weight"}))
    kinds = {c.kind for c in fair}
    assert {"baseline:parallax-rows", "baseline:horovod-hierarchical-rows-fp16", HOROVOD_FP16_KIND} <= kinds
    assert "baseline:allreduce-rows-fp16" in not_runnable and not kinds & set(not_runnable)
    assert rival_levers("control:baseline:parallax-rows-fp16") == {"rows", "fp16"}
    assert rival_levers("baseline:allreduce-rows") == {"rows"}
    step_s = {kind: 1.0 for kind in kinds}
    assert all("rows" not in rival_levers(k) for k in fair_rivals(step_s, frozenset({"fp16"})))
    assert "baseline:parallax-rows" in fair_rivals(step_s, frozenset({"rows"}))
    exact, _ = rivals(dense, CLUSTER, horovod=True, fp16=False, rows=frozenset({"tok.weight"}))
    assert {rival_levers(c.kind) for c in exact} == {frozenset(), frozenset({"rows"})}
    without, _ = rivals(dense, CLUSTER, horovod=True, fp16=True)
    assert not any("rows" in rival_levers(c.kind) for c in without)


def test_with_one_rank_per_node_hierarchical_baselines_share_the_ring_ones_trial():
    """On 4x1 hierarchical all-reduce runs as the ring (``ClusterSpec.hierarchical_is_ring``): the
    ``hierarchical`` baseline and its twins are measured by their ring twins' trials, not again."""
    one_per_node = ClusterSpec(nodes=4, workers_per_node=1, inter_node_bandwidth="500mbit", servers_per_node=1)
    dense = {name: info for name, info in VARIABLES.items() if not info.sparse}
    kinds = {c.kind for c in rivals(dense, one_per_node, horovod=True, fp16=True)[0]}
    assert {"baseline:allreduce+hierarchical", "baseline:allreduce-fp16+hierarchical-fp16"} <= kinds
    # horovod-hierarchical's merge groups on the ring: parallax's strategy for a dense model
    assert "baseline:horovod-hierarchical+parallax" in kinds
    names = [kind.removeprefix("baseline:").split("+") for kind in kinds if kind.startswith("baseline:")]
    assert not [n for n in names if all("hierarchical" in name for name in n)], "a trial of hierarchical alone"
    kinds_2x2 = {c.kind for c in rivals(dense, CLUSTER, horovod=True, fp16=True)[0]}
    assert {"baseline:allreduce", "baseline:hierarchical"} <= kinds_2x2
