"""The routing plan as a torch-free description: wire bytes, PS keys and servers, valid configs.

A simulator reads the plan without torch, Horovod or a cluster; ``test_plan_without_torch.py``
holds it to that (a subprocess where importing torch or horovod fails); these check what it predicts.
(``tests/test_router_inprocess.py`` checks the prediction against a running PS client.)
"""
from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from hybridsync import baselines
from hybridsync.placement import DEFAULT_PARTITION_BYTES, KeyTable, LeastLoaded, WireTensor
from hybridsync.router.plan import build_plan, shard_bounds
from hybridsync.strategy import Strategy, VarConfig
from hybridsync.variables import VariableInfo

pytestmark = pytest.mark.unit

VARIABLES = {
    "emb": VariableInfo(name="emb", shape=(1000, 16), sparse=True),
    "w": VariableInfo(name="w", shape=(64, 32)),
    "b": VariableInfo(name="b", shape=(32,)),
    "d": VariableInfo(name="d", shape=(10, 10), dtype="float64"),
    "steps": VariableInfo(name="steps", shape=(), dtype="int64"),
}


def strategy(default: dict, variables: dict | None = None) -> Strategy:
    return Strategy.from_dict({"version": 1, "default": default, "variables": variables or {}})


# --------------------------------------------------------------- VarConfig is always valid
@pytest.mark.parametrize("fields, named", [
    ({"partitions": 0}, "partitions"), ({"partitions": True}, "partitions"), ({"route": "gossip"}, "route"),
    ({"algorithm": "tree"}, "algorithm"), ({"compression": "int8"}, "compression"), ({"group": -1}, "group"),
    ({"protocol": "asp"}, "protocol"), ({"route": "ps", "algorithm": "hierarchical"}, "algorithm"),
    ({"route": "ps", "protocol": "ssp"}, "staleness"), ({"route": "ps", "staleness": 2}, "staleness"),
    ({"route": "ps", "partitions": 2, "servers": (0,)}, "servers"), ({"route": "ps", "servers": (-1,)}, "servers"),
    ({"servers": (0,)}, "servers"),
])
def test_an_invalid_var_config_is_a_value_error_naming_the_field(fields, named):
    with pytest.raises(ValueError, match=named):
        VarConfig(**fields)


def test_var_configs_from_replace_are_checked_and_lists_become_tuples():
    config = VarConfig(route="ps", partitions=2, servers=[1, 0])
    assert config.servers == (1, 0) and hash(config) == hash(VarConfig(route="ps", partitions=2, servers=(1, 0)))
    with pytest.raises(ValueError, match="partitions"):
        dataclasses.replace(config, partitions=0)


def test_variant_is_the_algorithm_or_the_protocol():
    assert VarConfig(algorithm="hierarchical").variant == "hierarchical"
    assert VarConfig(route="ps", protocol="ssp", staleness=1).route_name == "ps/ssp"


def test_strategies_key_sets_and_dicts_and_stay_values():
    a = strategy({"route": "ps"}, {"w": {"route": "allreduce", "partitions": 2}})
    b = Strategy.from_dict(json.loads(json.dumps(a.to_dict())))
    c = strategy({"route": "ps"})
    assert a == b and hash(a) == hash(b) and len({a, b, c}) == 2 and {a: 1}[b] == 1
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(TypeError, match="read-only"):
        a.variables["b"] = VarConfig()  # type: ignore[index]


def test_bad_partitions_reach_the_user_as_value_errors():
    with pytest.raises(ValueError, match="partitions"):
        shard_bounds(3, 0)
    with pytest.raises(ValueError, match="exceeds its 32 rows"):
        build_plan(VARIABLES, strategy({}, {"b": {"partitions": 33}}))


# --------------------------------------------------------------- bytes on the wire
def test_wire_bytes_follow_dtype_and_compression():
    plan = build_plan(VARIABLES, strategy({}, {"w": {"route": "allreduce", "compression": "fp16"}}))
    wire = {m.name: m.wire_bytes for m in plan.messages}
    assert wire == {"emb": 64000, "w": 64 * 32 * 2, "b": 128, "d": 800, "steps": 8}
    fp16 = build_plan(VARIABLES, strategy({}, {"b": {"route": "allreduce", "compression": "none"}}),
                      compression="fp16")
    wire = {m.name: (m.wire_bytes, {t.dtype for t in m.wire}) for m in fp16.messages}
    assert wire == {"emb": (32000, {"float16"}), "w": (4096, {"float16"}), "b": (128, {"float32"}),
                    "d": (200, {"float16"}), "steps": (8, {"int64"})}  # integers are never cast
    with pytest.raises(ValueError, match="compression"):
        build_plan(VARIABLES, None, compression="int8")


def test_partitions_and_groups_split_the_bytes_exactly():
    plan = build_plan(VARIABLES, strategy({}, {"emb": {"partitions": 3, "group": 1}, "b": {"group": 1},
                                              "w": {"partitions": 5}}))
    total = sum(v.nbytes for v in VARIABLES.values())
    assert sum(m.wire_bytes for m in plan.messages) == total
    grouped = [m for m in plan.messages if m.name.startswith("hybridsync.group1")]
    assert [len(m.pieces) for m in grouped] == [2, 1, 1] and all(m.sparse for m in grouped)
    assert not any(m.sparse for m in plan.messages if m not in grouped)


# --------------------------------------------------------------- PS keys and servers
def test_ps_keys_cover_every_byte_within_the_partition_size():
    plan = build_plan(VARIABLES, strategy({"route": "ps"}, {"emb": {"route": "allreduce"}}), compression="fp16")
    keys = plan.ps_keys(num_servers=3, partition_bytes=1000, namespace="opt4")
    assert set(keys) == {m.name for m in plan.messages if m.config.route == "ps"}
    for message in plan.messages:
        if message.name in keys:
            assert sum(k.nbytes for k in keys[message.name]) == message.wire_bytes
            assert all(k.nbytes <= 1000 and k.name.startswith(f"opt4/{message.name}") for k in keys[message.name])
    loads = [sum(k.nbytes for ks in keys.values() for k in ks if k.server == s) for s in range(3)]
    assert max(loads) - min(loads) <= 1000, loads  # greedy: within one key of even


def test_ps_keys_honour_pinned_servers_and_earlier_loads():
    pinned = build_plan(VARIABLES, strategy({"route": "ps"}, {"w": {"route": "ps", "partitions": 2, "servers": [1, 1]}}))
    keys = pinned.ps_keys(num_servers=2, partition_bytes=DEFAULT_PARTITION_BYTES)
    assert {k.server for m in ("w.shard0of2", "w.shard1of2") for k in keys[m]} == {1}
    fresh = pinned.ps_keys(num_servers=2)
    busy = pinned.ps_keys(num_servers=2, loads=[10**9, 0])  # an earlier optimizer filled server 0
    assert {k.server for ks in busy.values() for k in ks} == {1}
    assert {k.server for ks in fresh.values() for k in ks} == {0, 1}


def test_sparse_and_asynchronous_messages_list_the_keys_they_travel_under():
    plan = build_plan(VARIABLES, strategy({"route": "ps"}, {
        "emb": {"route": "ps", "partitions": 2, "group": 3}, "b": {"route": "ps", "group": 3},
        "w": {"route": "ps", "protocol": "asp", "partitions": 2}}))
    keys = plan.ps_keys(num_servers=2, partition_bytes=4000, namespace="opt1")
    first = keys["hybridsync.group3.shard0"]
    assert [(k.name, k.sparse) for k in first] == [("opt1/hybridsync.group3.shard0.emb", True),
                                                    ("opt1/hybridsync.group3.shard0.b", False)]
    assert first[0].nbytes == 500 * 16 * 4 and len({k.server for k in first}) == 1  # the group's first key's server
    assert [(k.name, k.nbytes) for k in keys["w.shard0of2"]] == [("opt1/w.shard0of2@0.0", 4000),
                                                                 ("opt1/w.shard0of2@0.1", 96)]  # 32 rows x 128 B
    assert [(key, piece.var_name) for key, piece, _ in plan.parameter_syncs()[0][1]] == [
        ("w.shard0of2", "w"), ("w.shard1of2", "w")]


# --------------------------------------------------------------- placement primitives (more in test_ps.py)
def test_key_table_rejects_bad_servers_and_changed_sizes():
    table = KeyTable(2, 4000)
    wire = (WireTensor(numel=10, dtype="float32", itemsize=4),)
    with pytest.raises(ValueError, match="server 2 does not exist"):
        table.declare_all([("m", wire, 2)])
    table.declare_all([("m", wire, None)])
    with pytest.raises(ValueError, match="changed shape"):
        table.layout("m", (WireTensor(numel=11, dtype="float32", itemsize=4),))
    table.follow("m", "m.rows")
    assert table.placement["m.rows"] == table.placement["m"] and table.loads == [40, 0]
    with pytest.raises(ValueError, match="num_servers"):
        LeastLoaded(0)


def test_baselines_place_with_the_shared_balancer():
    partitioned = baselines.partitioned_ps(VARIABLES, 2, partition_bytes=20000)
    assert partitioned.config_for("emb").servers == (0, 1, 0, 1)
    balanced = baselines.load_balanced_ps(VARIABLES, 2)
    assert [balanced.config_for(n).servers for n in ("emb", "w", "d", "b", "steps")] == [(0,), (1,), (1,), (1,), (1,)]


def test_dtype_facts_agree_with_torch():
    """The torch-free dtype table (item sizes, which dtypes fp16 compression casts) is torch's."""
    torch = pytest.importorskip("torch")
    from hybridsync.compression import Compression, compression_name
    from hybridsync.variables import _ITEMSIZE, FLOATING_DTYPES
    for name, size in _ITEMSIZE.items():
        dtype = getattr(torch, name)
        assert (dtype.itemsize, dtype.is_floating_point) == (size, name in FLOATING_DTYPES), name
    assert (compression_name(Compression.fp16), compression_name(Compression.none)) == ("fp16", "none")
    hvd_compression = pytest.importorskip("horovod.torch.compression")
    assert compression_name(hvd_compression.Compression.fp16) == "fp16"
