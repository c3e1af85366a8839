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

from conftest import BIN, REPO, WORKERS, launcher_argv, run_job
from hybridsync.backends import node_groups
from hybridsync.backends.ps.store import KeyStore
from hybridsync.procs import start, stop
from hybridsync.router import runtime
from hybridsync.router.plan import build_plan
from hybridsync.strategy import Strategy
from hybridsync.variables import variables_from_parameters


# --- unit: the server side of a release ---------------------------------------------------------------

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


def test_a_worker_that_left_counts_as_released():
    store = KeyStore(num_workers=2)
    store.init_async("opt0/a", torch.zeros(1), staleness=None)
    store.detach(1)
    assert store.release("opt0/", 0) == 1 and store.key_names() == []


def test_releasing_worker_no_longer_holds_ssp_answers_back():
    store = KeyStore(num_workers=2)
    store.init_async("opt0/s", torch.zeros(1), staleness=0)
    held = store.push_delta("opt0/s", 0, 0, torch.ones(1))
    assert not held.done()
    store.release("opt0/", 1)
    assert held.done() and held.wait().tolist() == [1.0]


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


def _router(monkeypatch, strategy: dict) -> tuple[runtime.Router, list[_FakeBackend]]:
    made: list[_FakeBackend] = []

    def make_backend(route, variant, **_):
        made.append(_FakeBackend())
        return made[-1]

    monkeypatch.setattr(runtime, "make_backend", make_backend)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    named = list(model.named_parameters())
    for _, param in named:
        param.grad = torch.ones_like(param)
    plan = build_plan(variables_from_parameters(named), Strategy.from_dict(strategy))
    from hybridsync.backends import Reduction
    from hybridsync.compression import Compression
    return runtime.Router(plan, [p for _, p in named], compression=Compression.none, reduction=Reduction()), made


TWO_ROUTES = {"version": 1, "default": {"route": "allreduce", "algorithm": "ring"},
              "variables": {"0.weight": {"route": "allreduce", "algorithm": "hierarchical", "partitions": 2}}}


def test_close_closes_every_backend_once_and_is_idempotent(monkeypatch):
    router, made = _router(monkeypatch, TWO_ROUTES)
    assert len(made) == 2  # ring and hierarchical, shared by their messages
    router.close()
    router.close()
    assert [b.closed for b in made] == [1, 1] and router.closed


def test_close_refuses_while_gradients_are_in_flight(monkeypatch):
    router, made = _router(monkeypatch, TWO_ROUTES)
    router.mark_ready(0)
    with pytest.raises(RuntimeError, match="in flight"):
        router.close()
    assert [b.closed for b in made] == [0, 0]


def test_each_router_has_its_own_namespace(monkeypatch):
    first, _ = _router(monkeypatch, TWO_ROUTES)
    second, _ = _router(monkeypatch, TWO_ROUTES)
    assert second.instance == first.instance + 1 and first.namespace != second.namespace


# --- unit: hierarchical groups are shared, and dropped with their last user ---------------------------

def test_hierarchical_groups_go_with_their_last_user(monkeypatch):
    monkeypatch.setattr(node_groups, "_groups", {"groups": object(), "store": None, "users": 2})
    node_groups.release_hierarchical_groups()
    assert node_groups.hierarchical_groups_in_use() == 1
    node_groups.release_hierarchical_groups()
    assert node_groups.hierarchical_groups_in_use() == 0 and node_groups._groups == {}
    node_groups.release_hierarchical_groups()  # nothing held: nothing to do
    assert node_groups._groups == {}
