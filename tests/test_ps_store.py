"""The server's key logic in-process (no RPC): BSP rounds, sparse union, the SSP bound; and which
lost server a worker names."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from hybridsync import envvars
from hybridsync.backends.base import Reduction
from hybridsync.backends.ps.client import PSBackend, PSClient
from hybridsync.backends.ps.config import PSConfig
from hybridsync.backends.ps.recovery import PSServerError
from hybridsync.backends.ps.server import Server
from hybridsync.backends.ps.store import KeyStore, Pulled, RestoreState
from test_router_inprocess import InProcessClient

pytestmark = pytest.mark.unit


def test_bsp_answers_only_when_every_worker_pushed():
    store = KeyStore(num_workers=3)
    futures = [store.push_pull("k", w, 0, torch.full((4,), float(w + 1))) for w in (2, 0)]
    assert not any(f.done() for f in futures)
    futures.append(store.push_pull("k", 1, 0, torch.full((4,), 2.0)))
    assert all(torch.equal(f.wait(), torch.full((4,), 6.0)) for f in futures)
    assert store.counters.pushed_bytes == 3 * 16 and store.counters.pulled_bytes == 3 * 16


def test_bsp_rejects_a_step_from_the_wrong_round():
    store = KeyStore(num_workers=2)
    store.push_pull("k", 0, 0, torch.ones(2))
    with pytest.raises(RuntimeError, match="worker1 pushed step 1 of key 'k' but the server is at step 0"):
        store.push_pull("k", 1, 1, torch.ones(2)).wait()


def test_a_round_a_finished_worker_can_no_longer_complete_fails_naming_it():
    """A rank whose script ran fewer steps says goodbye at exit; the others' BSP rounds would wait for
    its push forever (its goodbye then waits for them to leave: a hang of both). The open round
    fails at the goodbye, and a later push at once, naming the worker that left."""
    store = KeyStore(num_workers=3)
    for w in range(3):
        store.push_pull("k", w, 0, torch.ones(2))
    waiting = store.push_pull("k", 0, 1, torch.ones(2))
    store.detach(2)
    assert waiting.done()
    expected = "worker2 left the job .* while worker0 waited for its push in step 1 of key 'k'.* different numbers"
    with pytest.raises(RuntimeError, match=expected):
        waiting.wait()
    with pytest.raises(RuntimeError, match="worker2 left the job .* while worker1 waited for its push in step 1"):
        store.push_pull("k", 1, 1, torch.ones(2)).wait()


def test_a_member_started_with_other_counts_is_refused_at_once_and_the_waiting_ones_learn_why():
    """A server started by hand with DMLC_NUM_WORKER=3 in a 2-rank job made every BSP round wait for a
    third push until its 120 s join timeout, and the workers' error named no count."""
    import datetime

    import torch.distributed as dist

    from hybridsync.backends.ps import group
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    shape = {"num_servers": 1, "root_uri": "127.0.0.1", "root_port": store.port}
    group.check_shape(store, PSConfig(role="worker", index=0, num_workers=2, **shape))
    group.check_shape(store, PSConfig(role="worker", index=1, num_workers=2, **shape))
    assert group.misfit(store) is None
    with pytest.raises(ValueError, match="server0 was started with DMLC_NUM_SERVER=1, DMLC_NUM_WORKER=3, "
                                         "but .* has 1 servers, 2 workers .*alike on every server and worker"):
        group.check_shape(store, PSConfig(role="server", index=0, num_workers=3, **shape))
    assert "DMLC_NUM_WORKER=3" in group.misfit(store)


@pytest.mark.parametrize("dtype, big", [(torch.float16, 2048.0), (torch.bfloat16, 256.0)])
def test_half_precision_is_summed_in_float32(dtype, big):
    """At ``big`` the type's spacing is 2: ``big + 1`` rounds back to ``big``, so a sum kept in
    the half type (in worker order) loses both ones; summed in float32 it is ``big + 2``,
    which the half type holds exactly."""
    assert float(torch.tensor(big, dtype=dtype) + torch.tensor(1.0, dtype=dtype)) == big  # the trap is real
    store = KeyStore(num_workers=3)
    pushes = [torch.tensor([big], dtype=dtype), torch.tensor([1.0], dtype=dtype), torch.tensor([1.0], dtype=dtype)]
    futures = [store.push_pull("h", worker, 0, tensor) for worker, tensor in enumerate(pushes)]
    for future in futures:
        total = future.wait()
        assert total.dtype == dtype
        assert total.tolist() == [big + 2]


def test_sparse_sum_covers_the_union_of_rows():
    store = KeyStore(num_workers=2)
    a = (torch.tensor([[1, 5]]), torch.tensor([[1.0, 1.0], [2.0, 2.0]]), (10, 2))
    b = (torch.tensor([[5, 7]]), torch.tensor([[3.0, 3.0], [4.0, 4.0]]), (10, 2))
    futures = [store.push_pull("e", 0, 0, a), store.push_pull("e", 1, 0, b)]
    indices, values, size = futures[1].wait()
    assert indices.tolist() == [[1, 5, 7]] and values[:, 0].tolist() == [1.0, 5.0, 4.0] and size == (10, 2)


def test_ssp_holds_a_worker_more_than_staleness_ahead():
    store = KeyStore(num_workers=2)
    store.init_async("p", torch.zeros(2), staleness=1)
    first = store.push_delta("p", 0, 0, torch.ones(2))  # lead 1: allowed
    assert first.done() and first.wait().value.tolist() == [1.0, 1.0]
    second = store.push_delta("p", 0, 1, torch.ones(2))  # lead 2: held
    assert not second.done()
    store.push_delta("p", 1, 0, torch.ones(2))  # slowest advances to 1: lead 1 again
    assert second.done() and second.wait().value.tolist() == [3.0, 3.0]
    counters = store.staleness_counters["ssp1"]
    assert counters.delayed == 1 and counters.max_lead_answered == 1


def test_asp_never_holds_and_goodbye_releases_ssp():
    store = KeyStore(num_workers=2)
    store.init_async("a", torch.zeros(1), staleness=None)
    assert all(store.push_delta("a", 0, c, torch.ones(1)).done() for c in range(5))
    store.init_async("s", torch.zeros(1), staleness=0)
    held = store.push_delta("s", 0, 0, torch.ones(1))
    assert not held.done()
    store.detach(1)  # worker 1 left: it no longer holds worker 0 back
    assert held.done()


def test_first_workers_value_wins_and_staleness_must_agree():
    store = KeyStore(num_workers=2)
    assert store.init_async("p", torch.ones(2), staleness=2).value.tolist() == [1.0, 1.0]
    assert store.init_async("p", torch.zeros(2), staleness=2).value.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="workers disagree on the staleness of key 'p'"):
        store.init_async("p", torch.zeros(2), staleness=3)


def test_a_push_of_another_kind_is_refused_naming_the_key_and_both_kinds():
    """A sparse push into a key first pushed dense (e.g. two optimizers sharing key names) is
    refused with a readable error, and the key's round is untouched. (Errors answered through
    futures surface as RuntimeError, as RPC delivers them to the worker.)"""
    store = KeyStore(num_workers=2)
    first = store.push_pull("emb", 0, 0, torch.ones(4, 2))
    sparse = (torch.tensor([[1]]), torch.ones(1, 2), (4, 2))
    with pytest.raises(RuntimeError, match=r"worker1 pushed sparse float32 \[4, 2\] to key 'emb', "
                                         r"which holds dense float32 \[4, 2\]"):
        store.push_pull("emb", 1, 0, sparse).wait()
    with pytest.raises(RuntimeError, match=r"pushed dense float64 \[4, 2\] to key 'emb', which holds dense float32"):
        store.push_pull("emb", 1, 0, torch.ones(4, 2, dtype=torch.float64)).wait()
    with pytest.raises(RuntimeError, match=r"pushed dense float32 \[8\] to key 'emb'"):
        store.push_pull("emb", 1, 0, torch.ones(8)).wait()
    assert not first.done()
    store.push_pull("emb", 1, 0, torch.ones(4, 2))  # the valid push still completes the round
    assert torch.equal(first.wait(), torch.full((4, 2), 2.0))


def test_sparse_keys_check_size_and_malformed_payloads():
    store = KeyStore(num_workers=2)
    store.push_pull("e", 0, 0, (torch.tensor([[1]]), torch.ones(1, 2), (10, 2)))
    with pytest.raises(RuntimeError, match=r"sparse float32 \[12, 2\] to key 'e', which holds sparse float32 "
                                           r"\[10, 2\]"):
        store.push_pull("e", 1, 0, (torch.tensor([[1]]), torch.ones(1, 2), (12, 2))).wait()
    with pytest.raises(RuntimeError, match="malformed payload to key 'e': sparse indices outside size"):
        store.push_pull("e", 1, 0, (torch.tensor([[10]]), torch.ones(1, 2), (10, 2))).wait()
    with pytest.raises(RuntimeError, match="malformed payload to key 'x': a list, neither a tensor"):
        store.push_pull("x", 1, 0, [torch.ones(2)]).wait()


def test_bsp_and_async_keys_do_not_mix():
    store = KeyStore(num_workers=2)
    store.init_async("p", torch.zeros(3), staleness=None)
    with pytest.raises(RuntimeError, match="BSP dense float32 \\[3\\] payload to key 'p', which holds an ASP/SSP"):
        store.push_pull("p", 0, 0, torch.ones(3)).wait()
    with pytest.raises(RuntimeError, match=r"pushed dense float32 \[4\] to key 'p', which holds dense float32 \[3\]"):
        store.push_delta("p", 0, 0, torch.ones(4)).wait()
    store.push_pull("g", 0, 0, torch.ones(3))
    with pytest.raises(ValueError, match="key 'g' holds BSP dense float32 \\[3\\] gradients"):
        store.init_async("g", torch.zeros(3), staleness=None)
    with pytest.raises(RuntimeError, match="ASP/SSP delta to key 'g', which holds BSP"):
        store.push_delta("g", 0, 0, torch.ones(3)).wait()


# -- a replacement server rebuilt from the workers (issue 23) ------------------------------------

def test_a_replacement_replays_a_round_one_worker_received_and_the_other_lost():
    """Worker 0 got round 3's sum from the dead server, worker 1's answer was lost: worker 1's
    resent push of step 3 is answered with that very sum, and round 4 runs as usual."""
    store = KeyStore(num_workers=2)
    lost_sum = torch.tensor([0.1, 0.2, 0.3])
    store.restore(0, RestoreState(rounds={"k": (3, lost_sum)}))
    store.restore(1, RestoreState(rounds={"k": (2, torch.zeros(3))}))
    replay = store.push_pull("k", 1, 3, torch.ones(3))
    assert replay.done() and torch.equal(replay.wait(), lost_sum)
    futures = [store.push_pull("k", w, 4, torch.full((3,), float(w))) for w in (0, 1)]
    assert all(torch.equal(f.wait(), torch.ones(3)) for f in futures)
    with pytest.raises(RuntimeError, match="pushed step 4 of key 'k' but the server is at step 5"):
        store.push_pull("k", 0, 4, torch.ones(3)).wait()  # replays end with the round after


def test_a_restore_answers_a_round_already_pushed_to_the_replacement():
    """Worker 1 restored and resent its push of step 3 before worker 0, who had received round
    3's sum, restored: that push is answered with the sum, never summed again."""
    store = KeyStore(num_workers=2)
    store.restore(1, RestoreState(rounds={"k": (2, torch.zeros(2))}))
    pending = store.push_pull("k", 1, 3, torch.ones(2))
    assert not pending.done()
    store.restore(0, RestoreState(rounds={"k": (3, torch.full((2,), 7.0))}))
    assert torch.equal(pending.wait(), torch.full((2,), 7.0))
    assert store.key_names() == ["k"]


def test_an_asp_replacement_takes_the_freshest_pull_and_applies_no_push_twice():
    """The value that includes the most pushes wins; a resent push that value already includes
    is answered without being applied; the next ones are applied."""
    store = KeyStore(num_workers=2)
    stale, fresh = Pulled(torch.full((2,), 10.0), (3, 2)), Pulled(torch.full((2,), 12.0), (3, 3))
    store.restore(0, RestoreState(parameters={"p": (stale, None)}))
    store.restore(1, RestoreState(parameters={"p": (fresh, None)}))
    assert store.init_async("p", torch.zeros(2), None).value.tolist() == [12.0, 12.0]
    duplicate = store.push_delta("p", 1, 2, torch.ones(2)).wait()  # its answer was lost with the server
    assert duplicate.value.tolist() == [12.0, 12.0] and duplicate.clocks == (3, 3)
    answers = [store.push_delta("p", w, 3, torch.ones(2)).wait() for w in (0, 1)]
    assert answers[-1].value.tolist() == [14.0, 14.0] and answers[-1].clocks == (4, 4)


def test_a_late_restore_never_replaces_a_value_in_use():
    store = KeyStore(num_workers=2)
    store.restore(0, RestoreState(parameters={"p": (Pulled(torch.zeros(1), (1, 1)), None)}))
    store.push_delta("p", 0, 1, torch.ones(1)).wait()
    store.restore(1, RestoreState(parameters={"p": (Pulled(torch.full((1,), 9.0), (5, 5)), None)}), parameters=False)
    assert store.init_async("p", torch.zeros(1), None).value.tolist() == [1.0]


# -- which lost server a worker names (recovery.Links, through the real client and servers' stores) ----

def _servers_and_worker(monkeypatch) -> tuple[list[Server], PSClient]:
    """Servers 0 and 1 of a 2-worker job, not serving (no RPC), and worker 1's client, whose calls go
    straight into the servers' stores (``InProcessClient``); nothing replaces a lost server."""
    monkeypatch.delenv(envvars.PS_RECOVERY_TIMEOUT, raising=False)
    shape = dict(num_workers=2, num_servers=2, root_uri="in-process", root_port=1, partition_bytes=4000)
    servers = [Server(PSConfig(role="server", index=s, **shape)) for s in range(2)]
    return servers, InProcessClient(PSConfig(role="worker", index=1, **shape), [s.store for s in servers])


def _push_both(client: PSClient) -> list:
    """Worker 1's push of a key on each server: neither round completes (worker 0 never pushes)."""
    backend = PSBackend(client)
    for s in range(2):
        backend.declare(f"key{s}", [torch.ones(4)], server=s)
    return [backend.submit(f"key{s}", [torch.ones(4)], Reduction()) for s in range(2)]


def _raised_by(wait) -> tuple[str, float]:
    started = time.monotonic()
    with pytest.raises(PSServerError) as error:
        wait()
    return str(error.value), time.monotonic() - started


def test_a_dead_server_fails_a_wait_on_another_server_at_once(monkeypatch):
    """Server 1 died under worker 1 while it waits on server 0, whose round will never complete
    (worker 0 was failed too): the wait ends now, naming server1, not once server 0 quits over
    worker 0 (the secondary loss, which would otherwise end it and be named)."""
    servers, client = _servers_and_worker(monkeypatch)
    on_server0, _ = _push_both(client)
    servers[1].store.fail_all("ECONNRESET: connection reset by peer")  # what a killed server's calls get
    quits = threading.Timer(5.0, servers[0].fail, args=("worker0", "EOF: end of file"))
    quits.start()
    try:
        message, took = _raised_by(on_server0.wait)
    finally:
        quits.cancel()
    assert message.startswith("parameter server server1 is unreachable (") and "ECONNRESET" in message, message
    assert took < 2.0, took


def test_a_server_that_quit_over_a_worker_is_named_only_if_no_server_died(monkeypatch):
    """Server 0 quits because worker 0 left (a secondary loss) just before worker 1 learns that
    server 1 died (the primary): worker 1 names server1. With no primary loss, it names server 0's
    quit after the grace (two ping rounds and a second: 3 s), never waiting longer."""
    servers, client = _servers_and_worker(monkeypatch)
    on_server0, _ = _push_both(client)
    servers[0].fail("worker0", "EOF: end of file")
    dies = threading.Timer(0.5, servers[1].store.fail_all, args=("EOF: end of file",))
    dies.start()
    message, took = _raised_by(on_server0.wait)
    assert message.startswith("parameter server server1 is unreachable (") and "EOF" in message, message
    assert 0.4 < took < 2.0, took
    with pytest.raises(PSServerError, match="server1 is unreachable"):
        client.check_usable()

    servers, client = _servers_and_worker(monkeypatch)
    on_server0, _ = _push_both(client)
    servers[0].fail("worker0", "EOF: end of file")
    message, took = _raised_by(on_server0.wait)
    assert message.startswith("parameter server server0 quit: ") and (
        "hybridsync PS server0: worker0 stopped answering (EOF: end of file); exiting" in message) and (
        message.endswith("cannot be reached from it: their processes are gone or hang, or the network between "
                         "their node and the server's is cut; their own errors, if any, say which)")), message
    assert 2.9 < took < 4.5, took
