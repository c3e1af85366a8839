"""Which plans the TensorFlow front end syncs with Horovod's own ops (``horovod_ops.plan_expressed``).

Only plans Horovod's tape runs exactly: every variable ring all-reduced alone, whole, with the
optimizer's compression, and no step hook. The multi-rank behaviour (graphs on Horovod's ops, a
plan change moving a traced step off them, results equal to horovod.tensorflow's) is in
``tests/test_tensorflow.py``.
"""
from __future__ import annotations

import pytest

pytest.importorskip("tensorflow", reason="TensorFlow is not installed here (scripts/bootstrap.sh installs it)")

from hybridsync.description import VariableInfo  # noqa: E402
from hybridsync.router.plan import build_plan  # noqa: E402
from hybridsync.strategy import Strategy  # noqa: E402
from hybridsync.tensorflow.horovod_ops import plan_expressed  # noqa: E402

pytestmark = pytest.mark.unit

VARIABLES = {name: VariableInfo(name=name, shape=shape, sparse=name == "embedding")
             for name, shape in (("embedding", (50, 6)), ("hidden/kernel", (24, 32)), ("hidden/bias", (32,)),
                                 ("out/kernel", (32, 1)))}


def _plan(doc: dict | None, variables: dict = VARIABLES, compression: str = "none"):
    return build_plan(variables, None if doc is None else Strategy.from_dict({"version": 1, **doc}),
                      compression=compression)


@pytest.mark.parametrize("doc", [None, {}, {"default": {"route": "allreduce", "algorithm": "ring"}}])
def test_every_variable_on_the_ring_alone_is_horovods_plan(doc):
    assert plan_expressed(_plan(doc))
    assert plan_expressed(_plan(doc, compression="fp16"))  # the optimizer's compression: Horovod's tape has it too


@pytest.mark.parametrize("doc", [
    {"variables": {"hidden/kernel": {"route": "allreduce", "partitions": 2}}},          # a partition
    {"variables": {"hidden/bias": {"route": "allreduce", "group": 1},
                   "out/kernel": {"route": "allreduce", "group": 1}}},                  # a merge
    {"variables": {"hidden/kernel": {"route": "allreduce", "algorithm": "hierarchical"}}},
    {"variables": {"out/kernel": {"route": "ps"}}},
    {"variables": {"out/kernel": {"route": "allreduce", "compression": "fp16"}}},       # not the optimizer's
])
def test_anything_horovods_tape_does_not_do_keeps_the_bridge(doc):
    assert not plan_expressed(_plan(doc))


def test_a_step_hook_or_a_dtype_horovod_cannot_reduce_keeps_the_bridge():
    assert not plan_expressed(_plan(None), step_hooks=("a Sync-Switch controller",))
    assert not plan_expressed(_plan(None, {"w": VariableInfo(name="w", shape=(4, 4), dtype="bfloat16")}))
