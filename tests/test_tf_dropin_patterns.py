"""TensorFlow/Keras training patterns of real scripts under ``hybridsync.tensorflow``, with no strategy and
with a mixed one (PS, hierarchical, merge groups, partitions), against ``horovod.tensorflow`` (2 ranks, 2 servers).

Per pattern of ``workers/tf_dropin_patterns.py``, under Keras 2 (``tf_keras``) and Keras 3 (a few patterns):
where Horovod trains with its ranks in step, hybridsync trains to the same variables, with and without a
strategy; where Horovod fails (its learning-rate callbacks under either Keras, its Keras optimizer under Keras 3
or in a custom loop) or would hang (a gradient only some ranks have), hybridsync trains with its ranks in step
or fails alike; and the strategy changes nothing. A hang fails the job (each variant is bounded inside it).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import BIN, WORKERS, check_dropin_outcome, run_job

pytest.importorskip("tensorflow", reason="TensorFlow is not installed here (scripts/bootstrap.sh installs it)")
pytest.importorskip("horovod.tensorflow", reason="Horovod was built without TensorFlow")

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-6
KERAS_3_CASES = ("keras_example", "keras_fine_tune", "save_and_reload", "keras_optimizer_custom_loop",
                 "tape_function_first_batch")
"""Keras 3 changes the Keras side (optimizers, callbacks, saving); the tape's patterns run under Keras 2."""
RANKS_APART: set[str] = set()
"""Patterns whose ranks may end apart: none (``branch_on_rank0_only``, a gradient only rank 0 has, ended 0.022
apart before the ranks voted on which gradients exist: rank 1's tape returned ``None`` for it)."""

_cache: dict[int, dict] = {}


def results(keras: int, tmp_path_factory) -> dict:
    """Rank 0's results of one job running the patterns under Keras ``keras`` (the worker checks rank 1's)."""
    if keras not in _cache:
        prefix = tmp_path_factory.mktemp(f"tf-dropin-keras{keras}") / "results"
        argv = [str(BIN / "hybridsync-run"), "--num-servers", "2", "--partition-bytes", "400",
                "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(WORKERS / "tf_dropin_patterns.py"),
                str(prefix), *(KERAS_3_CASES if keras == 3 else ())]
        env = {"TF_USE_LEGACY_KERAS": "1" if keras == 2 else "0", "TF_CPP_MIN_LOG_LEVEL": "2"}
        proc = run_job(argv, timeout=420, env=env)
        assert proc.returncode == 0, proc.stdout[-6000:]
        doc = json.loads(Path(f"{prefix}.rank0.json").read_text())
        assert doc["keras"] == keras
        _cache[keras] = doc["cases"]
    return _cache[keras]


def _cases() -> list[str]:
    """The worker's pattern names, read from its source (importing it would import TensorFlow at collection)."""
    import ast
    tree = ast.parse((WORKERS / "tf_dropin_patterns.py").read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "CASES"]
    return sorted(name.id for name in node.value.generators[0].iter.elts)


@pytest.mark.parametrize("keras, case", [(2, case) for case in _cases()] + [(3, case) for case in KERAS_3_CASES])
def test_pattern_trains_as_horovod_does_or_better(keras, case, tmp_path_factory):
    check_dropin_outcome(results(keras, tmp_path_factory)[case], TOLERANCE, ranks_apart=case in RANKS_APART)
