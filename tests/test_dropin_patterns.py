"""Training patterns of real scripts under ``hs.DistributedOptimizer``, with no strategy and with a mixed one
(PS, hierarchical, merge groups, partitions), against ``horovod.torch.DistributedOptimizer`` (2 ranks, 2 servers).

Per pattern of ``workers/dropin_patterns.py``: where Horovod trains with its ranks in step, hybridsync
trains to the same parameters, with and without a strategy; where Horovod fails, hybridsync fails
alike or trains with its ranks in step (``channels_last``); where Horovod's ranks drift apart (a parameter
unfrozen after the optimizer was built, or added by ``add_param_group``), hybridsync's stay in step; and
the strategy changes nothing. A hang fails the job (each variant is bounded inside it).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import BIN, WORKERS, check_dropin_outcome, run_job

sys.path.insert(0, str(WORKERS))
from dropin_patterns import CASES  # noqa: E402

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5
LOOSER = {"half_model": 2e-3}
"""float16 parameters: a PS or hierarchical sum rounds once where the ring rounds per step of its own."""


_cache: list[dict] = []


def results(tmp_path_factory) -> dict:
    """Rank 0's results of one job that runs every pattern (the worker checks rank 1's parameters)."""
    if not _cache:
        prefix = tmp_path_factory.mktemp("dropin") / "results"
        argv = [str(BIN / "hybridsync-run"), "--num-servers", "2", "--partition-bytes", "400",
                "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, str(WORKERS / "dropin_patterns.py"),
                str(prefix)]
        proc = run_job(argv, timeout=600)
        assert proc.returncode == 0, proc.stdout[-6000:]
        _cache.append(json.loads(Path(f"{prefix}.rank0.json").read_text()))
    return _cache[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_pattern_trains_as_horovod_does_or_better(case, tmp_path_factory):
    check_dropin_outcome(results(tmp_path_factory)[case], LOOSER.get(case, TOLERANCE))
