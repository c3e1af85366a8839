"""``rows`` through ``hs.DistributedOptimizer`` in a real job: a dense embedding's gradient sent
as its nonzero rows, on Horovod's ring (sparse all-gather) and on two real parameter servers,
gives the parameters Horovod's plain all-reduce gives (``hybridsync-run --num-servers 2``,
horovodrun -np 2 --gloo; the launcher starts and stops the servers, the job is bounded)."""
from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import BIN, WORKERS, run_job

sys.path.insert(0, str(WORKERS))
from equivalence import ROWS_CASES  # noqa: E402

pytestmark = pytest.mark.multiprocess

_cache: dict[str, dict] = {}


def equivalence(tmp_path_factory) -> dict:
    if "eq" not in _cache:
        out = tmp_path_factory.mktemp("rows-route") / "eq.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
        argv = [str(BIN / "hybridsync-run"), "--num-servers", "2", "--partition-bytes", "400",
                "-np", "2", "-H", "localhost:2", "--gloo",
                sys.executable, str(WORKERS / "equivalence.py"), str(out), *sorted(ROWS_CASES)]
        proc = run_job(argv, timeout=240, env=env)
        assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:]
        _cache["eq"] = json.loads(out.read_text())
    return _cache["eq"]


@pytest.mark.parametrize("case", sorted(ROWS_CASES))
def test_rows_give_horovods_parameters(case, tmp_path_factory):
    result = equivalence(tmp_path_factory)[case]
    assert result["moved"] > 1e-3, "training did not change the parameters; the comparison would be vacuous"
    assert result["max_abs_diff"] <= result["tolerance"], result
    assert (result["ps_pushed_bytes"] > 0) == case.startswith("rows_ps"), result
