"""A gradient that only some ranks have, under ``hybridsync.tensorflow.DistributedGradientTape`` (2 ranks).

Horovod's tape all-reduces only the gradients it has: the rank without one never joins, and the others wait
forever, eagerly and inside ``tf.function``. hybridsync all-reduces zeros for it and the ranks count, per
variable, those that have a gradient: eagerly every rank returns the reduced gradient, so all update the
variable alike (bitwise); a variable no rank has a gradient for stays ``None``. Inside ``tf.function`` a
rank's ``None`` is fixed when traced: through the bridge (a strategy) the step fails on every rank within
seconds, naming the variables (on Horovod's ops, no strategy, it still hangs as Horovod's tape does).
"""
from __future__ import annotations

import pytest

from conftest import rank_results

pytest.importorskip("tensorflow", reason="TensorFlow is not installed here (scripts/bootstrap.sh installs it)")
pytest.importorskip("horovod.tensorflow", reason="Horovod was built without TensorFlow")

pytestmark = pytest.mark.multiprocess

ROUTES = ("horovod_ops", "bridged")
FAIL_WITHIN_S = 20.0
"""The traced step's failure, from the first call (which traces it) on this shared 2-core machine."""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return rank_results("horovodrun", "tf_partial_gradients.py", tmp_path_factory, timeout=300)


@pytest.mark.parametrize("route", ROUTES)
def test_eager_ranks_update_a_partial_gradient_alike(ranks, route):
    for rank, result in enumerate(ranks):
        eager = result[route]["eager"]
        assert "error" not in eager, (rank, eager)
        assert eager["diff_across_ranks"] == 0.0, eager
        assert eager["extra_moved"], (rank, eager)  # rank 1 too: it has no gradient of its own there
        assert not eager["unused_moved"], (rank, eager)  # no rank has one: None everywhere, as Horovod


def test_traced_partial_gradient_fails_fast_naming_it(ranks):
    for rank, result in enumerate(ranks):
        traced = result["bridged"]["traced"]
        assert "error" in traced, (rank, traced)
        assert "some ranks and None on others" in traced["error"], traced["error"]
        assert "extra/kernel" in traced["error"] and "extra/bias" in traced["error"], traced["error"]
        assert "hidden/kernel" not in traced["error"], traced["error"]
        assert traced["seconds"] < FAIL_WITHIN_S, traced
