"""The environment serves TensorFlow and PyTorch at once (issue 15 §2).

``scripts/bootstrap.sh`` installs TensorFlow next to torch and builds Horovod for both.
This runs ``tests/workers/tf_horovod_check.py`` on 2 ranks under horovodrun (Gloo) and
mpirun: both frameworks import in one process, Horovod's torch and TensorFlow libraries
are built with Gloo and MPI, and Horovod's own TensorFlow wrappers average gradients.
Keras is tf_keras (``TF_USE_LEGACY_KERAS=1``): Horovod 0.28.1's Keras optimizer does not
average under Keras 3 (it trains each rank alone without an error), see README "TensorFlow".
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import WORKERS, launcher_argv, run_job

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                                reason="tensorflow is not installed in this environment (scripts/bootstrap.sh installs it)")

TF_ENV = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
"""Keras 2 (tf_keras) for Horovod's Keras wrapper; TF's start-up chatter off."""


@pytest.mark.multiprocess
def test_horovod_tensorflow_averages_like_torch(launcher: str, tmp_path: Path) -> None:
    prefix = tmp_path / "check"
    argv = launcher_argv(launcher)
    if launcher == "mpirun":
        argv += [arg for name in TF_ENV for arg in ("-x", name)]
    proc = run_job(argv + [sys.executable, str(WORKERS / "tf_horovod_check.py"), str(prefix)],
                   timeout=180, env=TF_ENV)
    assert proc.returncode == 0, proc.stdout[-6000:]
    ranks = [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(2)]
    for record in ranks:
        assert record["size"] == 2
        assert all(record["built"].values()), f"Horovod built without a framework or transport: {record['built']}"
        assert record["keras"].startswith("tf_keras"), f"tf.keras is {record['keras']}, not tf_keras"
        assert record["tape_error"] < 1e-6, f"DistributedGradientTape is not the ranks' mean: {record}"
        assert record["keras_error"] < 1e-6, f"Keras DistributedOptimizer step is not the averaged one: {record}"
    assert ranks[0]["keras_weights"] == ranks[1]["keras_weights"], "Keras weights differ between ranks"
