"""`hybridsync-run --autotune` end to end on the emulated 2 x 2 cluster, on a small budget: profile,
search, trials in one job per round (the script's own optimizer switching), confirmation, then
training with the winner. Needs root; skips cleanly without it. No namespace may be left."""
from __future__ import annotations

import json
import re
import sys

import pytest

from conftest import IS_ROOT, REPO, cluster_tags, run_job, small_autotune

pytestmark = [pytest.mark.emulated,
              pytest.mark.skipif(not IS_ROOT, reason="network namespaces and tc need root and iproute2")]


def test_autotune_picks_measures_and_trains_with_a_winner(tmp_path):
    from hybridsync.cluster.netns import NAMESPACE_PREFIX, leftovers
    from hybridsync.description import load_description
    from hybridsync.strategy import Strategy
    from hybridsync.trials.store import TrialStore
    before = cluster_tags(leftovers(NAMESPACE_PREFIX))
    autotune, report, store = small_autotune(tmp_path, trial_budget=13)  # 9 rivals (fp16 twins included) + 4
    # 500 steps per run: every trial job (up to 20 trials of 13 steps) and the confirmation (24) end in one run
    argv = autotune + [sys.executable, str(REPO / "tests" / "workers" / "tiny_train.py"), "--steps", "500"]
    proc = run_job(argv, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]

    doc = json.loads((report / "report.json").read_text())
    assert doc["cluster"]["nodes"] == 2 and doc["best_rival"]["kind"].startswith("baseline:")
    assert doc["speedups"][doc["winner"]["kind"]] == 1.0
    assert min(doc["confirmed_s"].values()) == doc["winner"]["step_s"]  # the fastest of the confirmation wins
    if "fp16" not in doc["winner"]["levers"]:
        assert not doc["best_rival"]["kind"].endswith("-fp16"), "an fp16 twin is no fair rival of an exact winner"
    assert any(kind.endswith("-fp16") for kind in doc["confirmed_s"]), "the fp16 twins are confirmed too"
    assert doc["kendall_tau"]["strategies"] >= 3 and -1.0 <= doc["kendall_tau"]["tau"] <= 1.0
    assert {t["job"] for t in doc["trials"]} <= set(doc["job_levels"])  # and the last round's recheck job
    assert (report / "report.png").stat().st_size > 10_000 and (report / "report.md").exists()
    assert doc["seconds"]["calibrate"] > 0 and "calibration failed" not in proc.stdout  # measured before the search
    assert "Simulator accuracy on these trials" in (report / "report.md").read_text()
    variables = load_description(report / "model.json").variables
    Strategy.load(report / "strategy.json").validate_for(variables)

    with TrialStore(store) as trials:
        records = trials.trials()
    distinct = {r.fingerprint for r in records}
    assert len(distinct) == 13, "the budget counts distinct strategies, rivals included"
    assert sum(r.kind.startswith("search:") for r in records) >= 3
    assert all(r.status == "ok" for r in records), [(r.kind, r.reason) for r in records if r.status != "ok"]
    jobs = {r.job for r in records}
    assert len(jobs) >= 2, "one job per round"
    for job in jobs:  # every job re-measured its controls before its first candidate and after its last
        kinds = [r.kind for r in records if r.job == job]
        assert kinds[0].startswith("control:") and kinds[-1].startswith("control:"), kinds
    # the winner trained: the script's own output, one line from rank 0, loss well below the start (~5)
    loss = float(re.findall(r"final loss (\d+\.\d+)", proc.stdout)[-1])
    assert loss < 0.5
    assert "won (" in proc.stdout and "done in" in proc.stdout
    assert cluster_tags(leftovers(NAMESPACE_PREFIX)) <= before  # no cluster of ours left (others' may run meanwhile)

