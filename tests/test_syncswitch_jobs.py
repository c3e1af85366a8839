"""Sync-Switch in real jobs: 4 ranks on two "hosts" (``localhost:2,127.0.0.1:2``) and 2 parameter
servers, under ``hybridsync-run`` (``tests/workers/syncswitch_worker.py``).

- ``switch``: every rank and both servers switch to ASP after the same step; the BSP segment
  is bitwise the pure-BSP run; training goes on under ASP with the learning rate scaled 1/n.
- ``elastic``: a rank made slow for a while (it sleeps) sends the job to ASP and, once it is
  fast again, back to BSP, every rank and server after the same steps; back under BSP the
  ranks' parameters are identical again.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import BIN, WORKERS, horovodrun_args, run_job

NP = 4
_cache: dict[str, list[dict]] = {}


def _ranks(tmp_path_factory) -> list[dict]:
    if "job" not in _cache:
        out = tmp_path_factory.mktemp("syncswitch") / "out"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
        argv = [str(BIN / "hybridsync-run"), "--num-servers", "2", "--partition-bytes", "256",
                *horovodrun_args(np=NP, hosts="localhost:2,127.0.0.1:2"),
                sys.executable, str(WORKERS / "syncswitch_worker.py"), str(out), "switch", "elastic"]
        proc = run_job(argv, timeout=240, env=env)
        assert proc.returncode == 0, proc.stdout[-5000:]
        _cache["job"] = [json.loads(open(f"{out}.rank{r}.json").read()) for r in range(NP)]
        _cache["stdout"] = proc.stdout  # type: ignore[assignment]
    return _cache["job"]


@pytest.mark.multiprocess
def test_switch_every_rank_and_server_switch_after_the_same_step(tmp_path_factory):
    ranks = [rank["switch"] for rank in _ranks(tmp_path_factory)]
    for rank in ranks:
        assert [(s["step"], s["protocol"]) for s in rank["switches"]] == [(4, "asp")]
        assert rank["protocols"] == ["asp"]
        for server_log in rank["servers"]:  # every server saw every rank switch after step 4
            events = [e for e in server_log if e["reason"].startswith("policy 'switch'")]
            assert [(e["step"], e["protocol"]) for e in events] == [(4, "asp")]
            assert set(events[0]["worker_steps"].values()) == {4} and len(events[0]["worker_steps"]) == NP
    assert "switched job opt0 to asp after step 4" in _cache["stdout"]
    assert _cache["stdout"].count("PS variables switched to asp after step 4") == 1  # rank 0 says it for all


@pytest.mark.multiprocess
def test_switch_bsp_segment_equals_pure_bsp_and_asp_trains_on(tmp_path_factory):
    for rank in (r["switch"] for r in _ranks(tmp_path_factory)):
        assert rank["diffs"] == [0.0, 0.0, 0.0, 0.0]  # the same sums in the same order
        assert rank["moved_after_switch"] > 1e-3
        assert rank["lr"] == pytest.approx(0.1 / NP) and rank["momentum"] == 0.9  # the defaults: lr 1/n


@pytest.mark.multiprocess
def test_elastic_goes_asp_with_the_straggler_and_back_without_it(tmp_path_factory):
    ranks = [rank["elastic"] for rank in _ranks(tmp_path_factory)]
    switches = [[(s["step"], s["protocol"]) for s in rank["switches"]] for rank in ranks]
    assert all(s == switches[0] for s in switches), switches  # every rank, after the same steps
    (went, asp), (back, bsp) = switches[0]
    assert (asp, bsp) == ("asp", "bsp") and 6 < went <= 16 < back < 70, switches[0]
    assert "lags" in ranks[0]["switches"][0]["reason"] and "no straggler" in ranks[0]["switches"][1]["reason"]
    events = [(e["step"], e["protocol"]) for e in ranks[0]["servers"][1] if e["job"] != "opt0"]
    assert events == switches[0]  # server 1 logged the same steps (server 0 decided them)
    for rank in ranks:
        assert rank["protocols"][went - 1] == "asp" and rank["protocols"][back - 1] == "bsp"
        assert rank["lr"] == pytest.approx(0.1)  # restored after ASP
    # Back under BSP the ranks start from the servers' model and averaged momentum: identical again.
    for step in range(back - 1, len(ranks[0]["sums"])):
        assert len({rank["sums"][step] for rank in ranks}) == 1, step
