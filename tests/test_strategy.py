"""Unit tests: strategy format, validation, fingerprint, baseline builders, routing plan."""
from __future__ import annotations

import json

import pytest

from hybridsync import baselines
from hybridsync.router.plan import build_plan, shard_bounds
from hybridsync.strategy import Strategy, VarConfig, resolve_strategy, unknown_variable_errors
from hybridsync.description import parse_model_description
from hybridsync.variables import VariableInfo

pytestmark = pytest.mark.unit

EXAMPLE = {"version": 1,
           "default": {"route": "allreduce", "algorithm": "ring"},
           "variables": {
               "emb.weight": {"route": "ps", "partitions": 4, "protocol": "bsp"},
               "fc1.weight": {"route": "allreduce", "partitions": 2, "group": 1, "compression": "fp16"},
               "fc1.bias": {"route": "allreduce", "group": 1, "compression": "fp16"}}}


def variables() -> dict[str, VariableInfo]:
    return parse_model_description({"variables": [
        {"name": "emb.weight", "shape": [1000, 16], "sparse": True},
        {"name": "fc1.weight", "shape": [64, 16]},
        {"name": "fc1.bias", "shape": [64]},
        {"name": "fc2.weight", "shape": [10, 64]},
        {"name": "scale", "shape": []}]})


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_round_trip_through_files(tmp_path, suffix):
    strategy = Strategy.from_dict(EXAMPLE)
    path = tmp_path / f"s{suffix}"
    strategy.save(path)
    loaded = Strategy.load(path)
    assert loaded == strategy
    assert loaded.to_dict() == strategy.to_dict()
    assert loaded.config_for("emb.weight") == VarConfig(route="ps", partitions=4, protocol="bsp")
    assert loaded.config_for("not.listed") == VarConfig()


def test_fingerprint_is_stable_and_sensitive():
    a = Strategy.from_dict(EXAMPLE)
    reordered = dict(EXAMPLE, variables=dict(reversed(list(EXAMPLE["variables"].items()))))
    assert Strategy.from_dict(reordered).fingerprint() == a.fingerprint()
    # Known value: the hash must not depend on the machine, the Python hash seed or dict order.
    assert Strategy().fingerprint() == Strategy.from_dict({"version": 1}).fingerprint()
    changed = json.loads(json.dumps(EXAMPLE))
    changed["variables"]["fc1.weight"]["partitions"] = 3
    assert Strategy.from_dict(changed).fingerprint() != a.fingerprint()


def test_fingerprint_known_value():
    # Pinned so that a change of canonical form (which would make old and new ranks disagree) is noticed.
    assert Strategy().fingerprint() == "9a91ac498090e9ed"
    assert Strategy.from_dict(EXAMPLE).fingerprint() == "3a80ccd955cf0719"


def test_every_culprit_is_named():
    bad = {"version": 2, "extra": 1, "default": {"route": "carrier-pigeon"},
           "variables": {"a": {"route": "allreduce", "partitions": -1, "protocol": "bsp"},
                         "b": {"route": "ps", "protocol": "ssp"},
                         "c": {"route": "ps", "servers": [0, 1], "partitions": 3},
                         "d": {"route": "allreduce", "group": "x", "compression": "zip"}}}
    with pytest.raises(ValueError) as info:
        Strategy.from_dict(bad)
    message = str(info.value)
    for needle in ["unknown top-level key 'extra'", "version 2 is not supported", "route 'carrier-pigeon'",
                   "variable 'a': partitions must be an integer >= 1", "variable 'a': unknown key 'protocol'",
                   "variable 'b': protocol 'ssp' needs a 'staleness'", "servers lists 2 placements but partitions is 3",
                   "variable 'd': group must be an integer", "variable 'd': compression 'zip'"]:
        assert needle in message


def test_a_key_the_route_does_not_take_is_told_what_it_meant():
    """A near spelling of the route's own key, or another route's key: the line says which."""
    doc = {"default": {"route": "ps", "algorithm": "ring"},
           "variables": {"a": {"route": "allreduce", "partitons": 2}, "b": {"route": "ps", "xyz": 1}}}
    with pytest.raises(ValueError) as info:
        Strategy.from_dict(doc)
    lines = str(info.value).splitlines()
    assert any(line.endswith("'algorithm' is a key of route allreduce") for line in lines), lines
    assert any("'a': unknown key 'partitons'" in line and line.endswith("did you mean 'partitions'?")
               for line in lines), lines
    assert any("'b': unknown key 'xyz'" in line and line.endswith("staleness)") for line in lines), lines


def test_validation_against_model_names_every_culprit():
    doc = {"variables": {"ghost": {"route": "allreduce"}, "fc1.bias": {"route": "allreduce", "partitions": 65},
                         "scale": {"route": "allreduce", "partitions": 2},
                         "fc2.weight": {"route": "ps", "group": 1}, "fc1.weight": {"route": "allreduce", "group": 1}}}
    with pytest.raises(ValueError) as info:
        Strategy.from_dict(doc).validate_for(variables())
    message = str(info.value)
    assert "'ghost' is not in the model" in message
    assert "'fc1.bias': partitions 65 exceeds its 64 rows" in message
    assert "'scale': partitions 2 exceeds its 1 rows" in message
    assert "group 1: its variables disagree" in message


def test_an_unknown_name_is_told_the_models_name_it_means():
    """A wrapper's prefix on either side (``torch.compile``, ``DataParallel``) or a near spelling names the
    model's variable; a strategy sharing no name with the model lists the model's names instead."""
    names = ["fc1.weight", "fc1.bias", "fc2.weight"]
    assert unknown_variable_errors(["fc1.weight", "_orig_mod.fc2.weight", "fc1.bais"], ["_orig_mod." + n for n in names]
                                   + ["fc1.bias"]) == [
        "variable 'fc1.bais' is not in the model; did you mean 'fc1.bias'?",
        "variable 'fc1.weight' is not in the model; did you mean '_orig_mod.fc1.weight'?"]
    assert unknown_variable_errors(["module.fc2.weight"], names) == [
        "variable 'module.fc2.weight' is not in the model; did you mean 'fc2.weight'?"]
    assert unknown_variable_errors(["dense/kernel"], ["sequential/dense/kernel"]) == [
        "variable 'dense/kernel' is not in the model; did you mean 'sequential/dense/kernel'?"]
    assert unknown_variable_errors(["emb.weight", "head.bias"], names) == [
        "variable 'emb.weight' is not in the model", "variable 'head.bias' is not in the model",
        "the strategy names none of the model's variables (fc1.bias, fc1.weight, fc2.weight): is it for another "
        "model?"]
    assert unknown_variable_errors(["emb.weight", "fc1.bias"], names) == ["variable 'emb.weight' is not in the model"]
    assert unknown_variable_errors([], names) == []


def test_a_variable_without_rows_fits_whole_but_not_partitioned():
    """A zero-element parameter (shape (0, 4)) is one piece: the default strategy fits it, as Horovod
    all-reduces it; only a request to cut it is refused."""
    empty = parse_model_description({"variables": [{"name": "empty", "shape": [0, 4]}]})
    Strategy().validate_for(empty)
    Strategy.from_dict({"variables": {"empty": {"route": "ps"}}}).validate_for(empty)
    with pytest.raises(ValueError, match="'empty': partitions 2 exceeds its 0 rows"):
        Strategy.from_dict({"variables": {"empty": {"route": "ps", "partitions": 2}}}).validate_for(empty)


def test_an_optimizers_part_of_a_strategy_keeps_its_variables_and_the_default():
    """A script that splits its model between optimizers (sparse and dense) gives each the whole
    strategy; each routes its own part. A dynamic sync policy stays with the part that has PS variables."""
    doc = {"default": {"route": "allreduce", "algorithm": "hierarchical"},
           "variables": {"emb": {"route": "ps", "protocol": "bsp"}, "fc.weight": {"route": "allreduce", "partitions": 2}},
           "sync": {"policy": "switch", "switch_at": 10}}
    whole = Strategy.from_dict(doc)
    sparse, dense = whole.restricted_to(["emb"]), whole.restricted_to(iter(["fc.weight", "fc.bias"]))
    assert sparse.variables == {"emb": whole.variables["emb"]} and sparse.sync == whole.sync
    assert dense.variables == {"fc.weight": whole.variables["fc.weight"]} and dense.sync is None
    assert sparse.default == dense.default == whole.default
    assert whole.restricted_to(["emb", "fc.weight", "other"]) is whole


def test_resolve_reads_environment(tmp_path, monkeypatch):
    path = tmp_path / "s.json"
    Strategy.from_dict(EXAMPLE).save(path)
    monkeypatch.delenv("HYBRIDSYNC_STRATEGY", raising=False)
    assert resolve_strategy(None) is None
    monkeypatch.setenv("HYBRIDSYNC_STRATEGY", str(path))
    assert resolve_strategy(None) == Strategy.from_dict(EXAMPLE)
    assert resolve_strategy(EXAMPLE) == Strategy.from_dict(EXAMPLE)
    with pytest.raises(ValueError, match="must be a Strategy, a dict or a path"):
        resolve_strategy(42)


def test_bad_files_are_clear(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json' is not valid"):
        Strategy.load(broken)
    with pytest.raises(ValueError, match="cannot read strategy file"):
        Strategy.load(tmp_path / "absent.yaml")


@pytest.mark.parametrize("name, text, match", [
    ("twice.json", '{"variables": {"0.weight": {"partitions": 2}, "0.weight": {"partitions": 3}}}',
     "key '0.weight' appears twice"),
    ("twice.yaml", "variables:\n  0.weight: {partitions: 2}\n  0.weight: {partitions: 3}\n",
     "key '0.weight' appears twice"),
    ("binary.json", b"\x00\x01\xff\xfe", "not UTF-8 text"),
    ("boolean.json", '{"version": true}', "version True is not supported"),
])
def test_a_file_that_parses_but_cannot_mean_what_was_written_is_refused(tmp_path, name, text, match):
    """A variable listed twice would otherwise be configured by its last entry alone (JSON and YAML
    parsers keep the last silently), a binary file would raise a bare UnicodeDecodeError naming no
    file, and ``true`` would pass for version 1 (``True == 1`` in Python)."""
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=f"(?s)strategy file '.*{name}'.*{match}"):
        Strategy.load(path)


def test_a_file_read_again_is_parsed_once_and_a_changed_file_anew(tmp_path):
    """An eager TensorFlow loop resolves ``HYBRIDSYNC_STRATEGY`` at every step: the same text gives
    the strategy already made; new text (the file rewritten, by a trial say) is read and checked."""
    path = tmp_path / "s.json"
    Strategy.from_dict(EXAMPLE).save(path)
    first = Strategy.load(path)
    assert Strategy.load(path) is first
    changed = {**EXAMPLE, "default": {"route": "allreduce", "partitions": 2}}
    Strategy.from_dict(changed).save(path)
    assert Strategy.load(path) == Strategy.from_dict(changed) != first
    path.write_text(path.read_text().replace('"partitions": 2', '"partitions": 0'))
    with pytest.raises(ValueError, match="s.json"):
        Strategy.load(path)


def test_shard_bounds_are_near_equal_and_cover():
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_bounds(1, 1) == [(0, 1)]
    for rows in range(1, 30):
        for parts in range(1, rows + 1):
            bounds = shard_bounds(rows, parts)
            assert bounds[0][0] == 0 and bounds[-1][1] == rows
            sizes = [b - a for a, b in bounds]
            assert max(sizes) - min(sizes) <= 1


def test_plan_partitions_and_merges_shardwise():
    strategy = Strategy.from_dict({"variables": {
        "fc1.weight": {"route": "allreduce", "partitions": 2, "group": 1},
        "fc1.bias": {"route": "allreduce", "group": 1},
        "fc2.weight": {"route": "allreduce", "partitions": 3}}})
    v = dict(variables())
    v.pop("emb.weight")
    plan = build_plan(v, strategy)
    by_name = {m.name: [(p.var_name, p.start, p.stop) for p in m.pieces] for m in plan.messages}
    assert by_name == {
        "hybridsync.group1.shard0": [("fc1.weight", 0, 32), ("fc1.bias", 0, 64)],
        "hybridsync.group1.shard1": [("fc1.weight", 32, 64)],
        "fc2.weight.shard0of3": [("fc2.weight", 0, 4)], "fc2.weight.shard1of3": [("fc2.weight", 4, 7)],
        "fc2.weight.shard2of3": [("fc2.weight", 7, 10)], "scale": [("scale", 0, 1)]}
    assert plan.messages_of_var[0] == (0, 1)  # fc1.weight feeds both group messages


def test_default_plan_is_horovods():
    plan = build_plan(variables(), None)
    assert [m.name for m in plan.messages] == list(variables())
    assert all(len(m.pieces) == 1 and m.pieces[0].whole for m in plan.messages)
    assert plan.fingerprint() == build_plan(variables(), Strategy()).fingerprint()


def test_builders():
    v = variables()
    assert {c.route for c in baselines.all_allreduce(v).variables.values()} == {"allreduce"}
    ps = baselines.all_ps(v, num_servers=2)
    assert [ps.config_for(n).servers for n in v] == [(0,), (1,), (0,), (1,), (0,)]
    lb = baselines.load_balanced_ps(v, num_servers=2)
    load = [0, 0]
    for name, info in v.items():
        load[lb.config_for(name).servers[0]] += info.nbytes
    assert load[1] >= 64 * 16 * 4  # the big embedding alone on server 0, the rest on server 1
    part = baselines.partitioned_ps(v, num_servers=2, partition_bytes=16_000)
    assert part.config_for("emb.weight").partitions == 4  # 64,000 bytes / 16,000
    assert sorted(part.config_for("emb.weight").servers) == [0, 0, 1, 1]
    par = baselines.parallax(v, num_servers=1, num_groups=2)
    assert par.config_for("emb.weight").route == "ps"
    assert {par.config_for(n).group for n in v if n != "emb.weight"} == {0, 1}
    with pytest.raises(ValueError, match="num_servers"):
        baselines.all_ps(v, num_servers=0)


def sparse_model():
    import torch.nn as nn

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(1000, 16, sparse=True)
            self.bag = nn.EmbeddingBag(100, 16, sparse=False)
            self.fc1 = nn.Linear(16, 64)
            self.fc2 = nn.Linear(64, 10)
    return Model()


def test_variables_from_model_marks_sparse_embeddings():
    from hybridsync.variables import variables_from_model, variables_from_parameters
    model = sparse_model()
    found = variables_from_model(model)
    assert list(found) == [name for name, _ in model.named_parameters()]
    assert {name for name, info in found.items() if info.sparse} == {"emb.weight"}
    assert found["emb.weight"].shape == (1000, 16) and found["emb.weight"].dtype == "float32"
    assert not any(info.sparse for info in variables_from_parameters(model.named_parameters()).values())


def test_model_description_round_trip_keeps_sparsity(tmp_path):
    from hybridsync.description import load_model_description, save_model_description
    from hybridsync.variables import variables_from_model
    save_model_description(variables_from_model(sparse_model()), tmp_path / "m.json")
    assert load_model_description(tmp_path / "m.json") == variables_from_model(sparse_model())


def test_baselines_on_a_sparse_model_route_the_embedding_to_the_servers():
    from hybridsync.variables import variables_from_model
    found = variables_from_model(sparse_model())
    parallax = baselines.parallax(found, num_servers=2, num_groups=2)
    assert parallax.config_for("emb.weight").route == "ps"
    assert {parallax.config_for(n).route for n in found if n != "emb.weight"} == {"allreduce"}
    partitioned = baselines.partitioned_ps(found, num_servers=2, partition_bytes=16_000)
    emb = partitioned.config_for("emb.weight")
    assert emb.route == "ps" and emb.partitions == 4 and sorted(emb.servers) == [0, 0, 1, 1]
    for strategy in (parallax, partitioned):  # both plan: a shard of a sparse variable is a PS message
        plan = build_plan(found, strategy)
        assert {m.config.route for m in plan.messages if "emb.weight" in m.name} == {"ps"}


def test_rows_is_refused_where_a_gradient_cannot_travel_as_rows():
    doc = {"variables": {"a": {"route": "allreduce", "algorithm": "hierarchical", "rows": True},
                         "b": {"route": "allreduce", "partitions": 2, "rows": True},
                         "c": {"route": "allreduce", "group": 1, "rows": True},
                         "d": {"route": "ps", "protocol": "ssp", "staleness": 1, "rows": True},
                         "e": {"route": "ps", "compression": "fp16", "rows": True},
                         "f": {"route": "ps", "rows": "yes"}}}
    with pytest.raises(ValueError) as info:
        Strategy.from_dict(doc)
    message = str(info.value)
    for name in "abc":
        assert f"variable {name!r}: rows on the all-reduce route travels as Horovod's sparse all-gather" in message
    assert "variable 'd': rows needs protocol 'bsp'" in message
    assert "variable 'e': rows sends the rows' values uncompressed: compression 'fp16' is not supported" in message
    assert "variable 'f': rows must be true or false, got 'yes'" in message


def test_rows_where_it_holds_round_trips_and_changes_the_fingerprint():
    doc = {"version": 1, "default": {"route": "allreduce", "algorithm": "ring"},
           "variables": {"fc1.weight": {"route": "ps", "protocol": "bsp", "partitions": 2, "group": 3, "rows": True},
                         "fc2.weight": {"route": "ps", "protocol": "bsp", "group": 3},
                         "fc1.bias": {"route": "allreduce", "algorithm": "ring", "rows": True}}}
    strategy = Strategy.from_dict(doc)
    assert strategy.to_dict() == doc and strategy.config_for("fc1.weight").rows
    without = Strategy.from_dict({**doc, "variables": {**doc["variables"], "fc1.bias": {"route": "allreduce",
                                                                                        "algorithm": "ring"}}})
    assert without.fingerprint() != strategy.fingerprint()
    strategy.validate_for(variables())
    # group members may differ in rows: a PS merge group sends row parts and dense parts alike
    assert strategy.config_for("fc1.weight").message_key == strategy.config_for("fc2.weight").message_key


def test_rows_is_refused_on_sparse_non_floating_and_scalar_variables():
    infos = parse_model_description({"variables": [
        {"name": "emb.weight", "shape": [1000, 16], "sparse": True},
        {"name": "ids", "shape": [10, 4], "dtype": "int64"}, {"name": "scale", "shape": []}]})
    strategy = Strategy(default=VarConfig(route="ps", rows=True))
    with pytest.raises(ValueError) as info:
        strategy.validate_for(infos)
    message = str(info.value)
    assert "variable 'emb.weight': rows is for dense gradients: this one is sparse already" in message
    assert "variable 'ids': rows is for floating gradients, not int64" in message
    assert "variable 'scale': rows needs a gradient with rows (dim 0); this one is a scalar" in message


def test_a_switch_to_asp_drops_rows_and_the_switch_back_keeps_it():
    strategy = Strategy(variables={"fc1.weight": VarConfig(route="ps", rows=True)})
    assert not strategy.with_ps_protocol("asp").config_for("fc1.weight").rows
    assert strategy.with_ps_protocol("bsp").config_for("fc1.weight").rows


def test_with_ring_for_hierarchical_changes_the_algorithm_only():
    hier = VarConfig(route="allreduce", algorithm="hierarchical", partitions=2, group=3, compression="fp16")
    strategy = Strategy(default=VarConfig(route="allreduce", algorithm="hierarchical"),
                        variables={"a": hier, "b": VarConfig(route="ps", partitions=2)})
    ring = strategy.with_ring_for_hierarchical()
    assert ring.default == VarConfig(route="allreduce")
    assert ring.variables == {"a": VarConfig(route="allreduce", partitions=2, group=3, compression="fp16"),
                              "b": strategy.variables["b"]}
    assert not ring.uses_hierarchical and strategy.uses_hierarchical
