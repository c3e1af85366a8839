"""The zoo's NCF in Keras, autotuned and trained: `hybridsync-run --autotune` on the emulated 2 x 1
cluster profiles the Keras script, searches, measures trials inside the script (its Keras
optimizer switching strategies in flight, inside ``model.train_on_batch``'s ``tf.function``),
then trains with the winner. Needs root; skips cleanly without it."""
from __future__ import annotations

import json
import re
import sys

import pytest

from conftest import IS_ROOT, run_job, small_autotune

pytest.importorskip("tensorflow", reason="TensorFlow is not installed here (scripts/bootstrap.sh installs it)")
pytestmark = [pytest.mark.emulated,
              pytest.mark.skipif(not IS_ROOT, reason="network namespaces and tc need root and iproute2")]


def test_keras_ncf_is_autotuned_and_trains_with_the_winner(tmp_path):
    from hybridsync.description import load_description
    from hybridsync.strategy import Strategy
    from hybridsync.trials.store import TrialStore
    # exact: the baselines are the rivals (their fp16 twins would lengthen this long test; the tiny
    # script's emulated autotune measures them); 2 x 1: two TensorFlow ranks, not four, on two cores
    # (the PyTorch autotune test covers 2 x 2); 300 steps per run: each trial job and the
    # confirmation (controls included) end in one run of the script. No runoff: whether it runs hangs on
    # how close the measured lead came out (one more run of the script: 36 of this test's 200 s on
    # 2026-11-28), and a runoff job is the trial runner's schedule like every trial job
    autotune, report, store = small_autotune(tmp_path, trial_budget=9, exact=True, workers_per_node=1, runoff=False)
    argv = autotune + [sys.executable, "-m", "hybridsync.zoo.keras_ncf", "--steps", "300",
                       "--json", str(tmp_path / "train.json")]
    proc = run_job(argv, timeout=900, env={"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stdout[-6000:]

    model = load_description(report / "model.json")
    assert len(model.variables) == 12 and sum(v.sparse for v in model.variables.values()) == 4
    assert model.timing is not None and model.timing.backward_s > 0
    winner = Strategy.load(report / "strategy.json")
    winner.validate_for(model.variables)
    with TrialStore(store) as trials:
        records = trials.trials()
    assert len({r.fingerprint for r in records}) == 9
    assert all(r.status == "ok" for r in records), [(r.kind, r.reason) for r in records if r.status != "ok"]
    assert sum(r.kind.startswith("search:") for r in records) >= 2
    trained = json.loads((tmp_path / "train.json").read_text())
    assert len(set(trained["checksums"])) == 1, "the ranks' variables differ after training with the winner"
    assert trained["last_loss"] < 0.8 * trained["first_loss"]
    assert re.search(r"won \(", proc.stdout)
