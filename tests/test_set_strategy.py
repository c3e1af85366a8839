"""``DistributedOptimizer.set_strategy``: swapping the routing plan at a step boundary.

Unit tests (no job): a server drops a replaced plan's keys only once every worker released
them, a router closes each backend once, the hierarchical groups go when their last user
gives them back. Jobs (``tests/workers/switching.py``): parameters after a switch equal
those of an optimizer built with the new strategy at that step (ring, hierarchical,
partitions, groups, PS under BSP and ASP), on 2 ranks under horovodrun (Gloo) and mpirun
and on 4 ranks on two "hosts"; the old plan's keys are gone from the servers; calling it
with gradients in flight, or with another strategy on one rank, is an error on every rank.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time

import pytest
import torch

from conftest import BIN, REPO, WORKERS, horovodrun_args, launcher_argv, run_job
from hybridsync.backends.hierarchical import groups as node_groups
from hybridsync.backends.ps.store import KeyStore
from hybridsync.run.procs import start, stop
from hybridsync.router import runtime
from hybridsync.router.plan import build_plan
from hybridsync.strategy import Strategy
from hybridsync.variables import variables_from_parameters


# --- unit: the server side of a release ---------------------------------------------------------------

@pytest.mark.unit
def test_released_keys_go_once_every_worker_released_them():
    store = KeyStore(num_workers=2)
    store.push_pull("opt0/w", 0, 0, torch.ones(2))
    store.push_pull("opt0/w", 1, 0, torch.ones(2))
    store.init_async("opt0/a", torch.zeros(1), staleness=None)
    store.push_pull("opt1/w", 0, 0, torch.ones(3))
    assert store.release("opt0/", 0) == 0  # worker 1 may still be finishing its last step on them
    assert store.key_names() == ["opt0/a", "opt0/w", "opt1/w"]
    assert store.release("opt0/", 1) == 2
    assert store.key_names() == ["opt1/w"]  # another router's keys stay


@pytest.mark.unit
def test_a_worker_that_left_counts_as_released():
    store = KeyStore(num_workers=2)
    store.init_async("opt0/a", torch.zeros(1), staleness=None)
    store.detach(1)
    assert store.release("opt0/", 0) == 1 and store.key_names() == []


@pytest.mark.unit
def test_releasing_worker_no_longer_holds_ssp_answers_back():
    store = KeyStore(num_workers=2)
    store.init_async("opt0/s", torch.zeros(1), staleness=0)
    held = store.push_delta("opt0/s", 0, 0, torch.ones(1))
    assert not held.done()
    store.release("opt0/", 1)
    assert held.done() and held.wait().value.tolist() == [1.0]


@pytest.mark.unit
def test_a_release_needs_a_prefix():
    with pytest.raises(ValueError, match="prefix"):
        KeyStore(num_workers=1).release("", 0)


# --- unit: the router's close -------------------------------------------------------------------------

class _FakeBackend:
    """Sums nothing; counts closes."""

    def __init__(self) -> None:
        self.closed = 0

    def submit(self, name, tensors, reduction):
        return self

    def wait(self) -> None:
        pass

    def close(self) -> None:
        self.closed += 1


def _router(strategy: dict) -> tuple[runtime.Router, list[_FakeBackend]]:
    made: list[_FakeBackend] = []

    def make_backend(route, variant, **_):
        made.append(_FakeBackend())
        return made[-1]

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    named = list(model.named_parameters())
    for _, param in named:
        param.grad = torch.ones_like(param)
    plan = build_plan(variables_from_parameters(named), Strategy.from_dict(strategy))
    from hybridsync.backends import Reduction
    from hybridsync.compression import Compression
    return runtime.Router(plan, [p for _, p in named], compression=Compression.none, reduction=Reduction(),
                          backends=make_backend), made


TWO_ROUTES = {"version": 1, "default": {"route": "allreduce", "algorithm": "ring"},
              "variables": {"0.weight": {"route": "allreduce", "algorithm": "hierarchical", "partitions": 2}}}


@pytest.mark.unit
def test_close_closes_every_backend_once_and_is_idempotent():
    router, made = _router(TWO_ROUTES)
    assert len(made) == 2  # ring and hierarchical, shared by their messages
    router.close()
    router.close()
    assert [b.closed for b in made] == [1, 1] and router.closed


@pytest.mark.unit
def test_close_refuses_while_gradients_are_in_flight():
    router, made = _router(TWO_ROUTES)
    router.mark_ready(0)
    with pytest.raises(RuntimeError, match="in flight"):
        router.close()
    assert [b.closed for b in made] == [0, 0]


@pytest.mark.unit
def test_each_router_has_its_own_namespace():
    first, _ = _router(TWO_ROUTES)
    second, _ = _router(TWO_ROUTES)
    assert second.instance == first.instance + 1 and first.namespace != second.namespace


# --- unit: hierarchical groups are shared, and dropped with their last user ---------------------------

@pytest.mark.unit
def test_hierarchical_groups_go_with_their_last_user(monkeypatch):
    monkeypatch.setattr(node_groups, "_groups", {"groups": object(), "store": None, "users": 2})
    node_groups.release_hierarchical_groups()
    assert node_groups.hierarchical_groups_in_use() == 1
    node_groups.release_hierarchical_groups()
    assert node_groups.hierarchical_groups_in_use() == 0 and node_groups._groups == {}
    node_groups.release_hierarchical_groups()  # nothing held: nothing to do
    assert node_groups._groups == {}


# --- jobs: exactness, released keys and groups, errors -----------------------------------------------

_cache: dict[str, list[dict]] = {}


def _clean_env() -> dict[str, str]:
    """No inherited PS settings; no Horovod tensor fusion, so that both copies' parameters must be
    bitwise equal: with 4 ranks, fusion may put the two copies' tensors at different offsets of
    a ring buffer, which changes the order of a sum (not its terms), ~1e-8 in float32."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    return {**env, "HOROVOD_FUSION_THRESHOLD": "0"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ranks(out, np: int) -> list[dict]:
    return [json.loads(open(f"{out}.rank{r}.json").read()) for r in range(np)]


def _under_hybridsync_run(tmp_path_factory, key: str, np: int, hosts: str, cases: list[str]) -> list[dict]:
    """The worker under ``hybridsync-run --num-servers 2`` (horovodrun, Gloo), once per key."""
    if key not in _cache:
        out = tmp_path_factory.mktemp("switching") / "out"
        argv = [str(BIN / "hybridsync-run"), "--num-servers", "2", "--partition-bytes", "256",
                *horovodrun_args(np=np, hosts=hosts),
                sys.executable, str(WORKERS / "switching.py"), str(out), *cases]
        proc = run_job(argv, timeout=400, env=_clean_env())
        assert proc.returncode == 0, proc.stdout[-4000:]
        assert "stopped answering" not in proc.stdout and "could not leave" not in proc.stdout, proc.stdout[-3000:]
        _cache[key] = _ranks(out, np)
    return _cache[key]


def _under_mpirun(tmp_path_factory, cases: list[str]) -> list[dict]:
    """The worker under plain ``mpirun -np 2`` with two ``hybridsync-server`` processes beside it."""
    if "mpirun" not in _cache:
        out = tmp_path_factory.mktemp("switching-mpi") / "out"
        env = {**_clean_env(), "PYTHONPATH": str(REPO), "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "2",
               "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(_free_port()),
               "BYTEPS_PARTITION_BYTES": "256"}
        servers = [start([str(BIN / "hybridsync-server")], env={**env, "DMLC_ROLE": "server", "DMLC_SERVER_ID": str(i)},
                         cwd=str(REPO)) for i in range(2)]
        try:
            argv = launcher_argv("mpirun") + [arg for name in ("DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "DMLC_PS_ROOT_URI",
                                                               "DMLC_PS_ROOT_PORT", "BYTEPS_PARTITION_BYTES",
                                                               "HOROVOD_FUSION_THRESHOLD")
                                              for arg in ("-x", name)]
            proc = run_job(argv + [sys.executable, str(WORKERS / "switching.py"), str(out), *cases], timeout=400,
                           env=env)
            assert proc.returncode == 0, proc.stdout[-4000:]
            for server in servers:
                server.wait(timeout=30)  # they leave on their own once both workers said goodbye
            assert [s.returncode for s in servers] == [0, 0]
            _cache["mpirun"] = _ranks(out, 2)
        finally:
            for server in servers:
                if server.poll() is None:
                    stop(server, grace=2.0)
    return _cache["mpirun"]


def _jobs(tmp_path_factory, job: str) -> list[dict]:
    if job == "horovodrun":
        return _under_hybridsync_run(tmp_path_factory, "two", 2, "localhost:2", ["all_routes", "errors"])
    if job == "mpirun":
        return _under_mpirun(tmp_path_factory, ["all_routes", "errors"])
    return _under_hybridsync_run(tmp_path_factory, "four", 4, "localhost:2,127.0.0.1:2", ["all_routes"])


JOBS = ["horovodrun", "mpirun", "four_ranks"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("job", JOBS)
def test_switched_parameters_equal_a_fresh_optimizer_with_the_new_strategy(job, tmp_path_factory):
    ranks = _jobs(tmp_path_factory, job)
    assert ranks[0]["_world"]["size"] == len(ranks)
    if job == "four_ranks":
        assert ranks[0]["_world"]["local_size"] == 2  # two "hosts": hierarchical really crosses nodes
    for rank in ranks:
        result = rank["all_routes"]
        assert result["moved"] > 1e-3
        assert [p["strategy"] for p in result["phases"]] == ["ring", "hier", "ps_bsp", "ring_parts_groups",
                                                             "ring_regrouped", "asp", "ps_bsp", "hier", "asp",
                                                             "ring"]
        for phase in result["phases"]:
            assert phase["max_abs_diff"] == 0.0, phase  # the same sums in the same order
            assert phase.get("switch_s", 0) < 30, phase


@pytest.mark.multiprocess
@pytest.mark.parametrize("job", JOBS)
def test_old_keys_leave_the_servers_and_new_ones_arrive(job, tmp_path_factory):
    for phase in _jobs(tmp_path_factory, job)[0]["all_routes"]["phases"]:
        if "servers_after_switch" in phase:
            assert not set(phase["closed_namespaces"]) & set(phase["servers_after_switch"]), phase
            assert set(phase["servers_after_switch"]) <= set(phase["ps_namespaces"]), phase
            if not phase["ps_namespaces"]:  # placement starts from empty servers, as in a fresh job
                assert phase["placed_bytes_after_switch"] == [0, 0], phase
        # ASP keys are made at the first step, seeded with the parameters' current values.
        assert phase["servers_after_steps"] == phase["ps_namespaces"], phase
        assert bool(phase["ps_namespaces"]) == (phase["strategy"] in ("ps_bsp", "asp")), phase


@pytest.mark.multiprocess
@pytest.mark.parametrize("job", JOBS)
def test_hierarchical_groups_exist_only_while_a_plan_uses_them(job, tmp_path_factory):
    for rank in _jobs(tmp_path_factory, job):
        users = [(p["strategy"], p["hierarchical_group_users"]) for p in rank["all_routes"]["phases"]]
        assert users == [(name, 2 if name == "hier" else 0) for name, _ in users]  # copies A and B


@pytest.mark.multiprocess
@pytest.mark.parametrize("job", ["horovodrun", "mpirun"])
def test_switch_errors_reach_every_rank_and_keep_the_plan(job, tmp_path_factory):
    ranks = [rank["errors"] for rank in _jobs(tmp_path_factory, job)]
    for errors in ranks:
        assert "in flight" in errors["in_flight"]
        assert "ranks disagree on the strategy passed to set_strategy()" in errors["disagree"]
        assert errors["disagree_s"] < 10
        assert errors["after_error_step"]
    assert len({errors["kept_plan"] for errors in ranks}) == 1
