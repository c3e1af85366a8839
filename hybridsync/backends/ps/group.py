"""The RPC group that servers and workers share, and the rendezvous store behind it.

The group is a *dynamic* ``torch.distributed.rpc`` group (``init_rpc`` without a world
size, TensorPipe): members join and leave one at a time, so a server that died can be
replaced by a new process while every other member keeps its connections. A static group
cannot do that: its membership is fixed at the rendezvous, and a process can never rejoin it.

The rendezvous store (a ``TCPStore`` at ``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``) is hosted
outside the group's members' RPC agents: by server 0's supervisor (``hybridsync-server
--supervise``), else by server 0 itself. Every member joins it as a client, so no member has
RPC id 0 (torch's dynamic rendezvous would make id 0 host a store of its own). Besides
torch's membership records, the store holds hybridsync's: how often each server was started
(its *incarnation*), whether a supervisor replaces it, and verdicts on servers that hung.

Each incarnation of server ``k`` is a new member: ``server<k>`` first, then ``server<k>:<r>``
with an id of its own (torch keeps a departed member's id and name reserved).
"""
from __future__ import annotations

import datetime
import os
import re
import sys
import threading
import time
import warnings
from typing import Any, Callable, Iterable, TypeVar

from hybridsync import envvars
from hybridsync.backends.ps.config import PSConfig

T = TypeVar("T")

KEY_PREFIX = "hybridsync/ps/"
"""hybridsync's keys in the rendezvous store (torch's own live under ``rpc_prefix_0/``)."""


def server_name(index: int, incarnation: int = 0) -> str:
    """RPC name of incarnation ``incarnation`` of server ``index``."""
    return f"server{index}" if incarnation == 0 else f"server{index}:{incarnation}"


def worker_name(index: int) -> str:
    return f"worker{index}"


_BACKEND_AS_PROCESS_GROUP = r"You are using a Backend <class '[\w.]*ProcessGroupGloo'> as a ProcessGroup"


def server_member(config: PSConfig, index: int, incarnation: int = 0) -> tuple[str, int]:
    """RPC name and id of incarnation ``incarnation`` of server ``index``: ids 1..K for the first
    servers (then 1+K.. for the workers), then a fresh id per replacement, after every first member."""
    if incarnation == 0:
        return server_name(index), index + 1
    return server_name(index, incarnation), config.world_size + (incarnation - 1) * config.num_servers + index + 1


def worker_member(config: PSConfig, index: int) -> tuple[str, int]:
    """RPC name and id of worker ``index``."""
    return worker_name(index), config.num_servers + index + 1


def this_member(config: PSConfig, incarnation: int = 0) -> tuple[str, int]:
    """RPC name and id of this process."""
    if config.role == "server":
        return server_member(config, config.index, incarnation)
    return worker_member(config, config.index)


def store_key(*parts: object) -> str:
    return KEY_PREFIX + "/".join(str(p) for p in parts)


def open_store(config: PSConfig, *, host: bool = False, timeout_s: float = 60.0) -> Any:
    """The rendezvous store: hosted by this process (``host``) or reached as a client (retrying
    until ``timeout_s``: its host may start after us). A host that cannot listen (the port taken by
    another job) raises ``RuntimeError`` saying so in one sentence, not torch's socket report."""
    import torch.distributed as dist
    try:
        return dist.TCPStore(config.root_uri, config.root_port, is_master=host, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except dist.DistNetworkError as error:
        if not host:
            raise
        reason = re.search(r"message: (.+)$", str(error))
        raise RuntimeError(f"cannot host the rendezvous store on port {config.root_port}: "
                           f"{reason.group(1) if reason else error} (set another port with --ps-root-port or "
                           f"DMLC_PS_ROOT_PORT, or leave it unset for a free one)") from None


def reach_store(config: PSConfig, timeout_s: float) -> Any:
    """``open_store`` as a client, given up after ``timeout_s`` (``Unanswered``).

    torch's client retries past its own timeout (a store host that accepts but never answers
    kept it 60+ s with a 12 s timeout; refused connections, 27 s with 8 s), so it runs in a
    thread we stop waiting on (``within``), as ``join`` does."""
    return within(lambda: open_store(config, timeout_s=timeout_s), timeout_s, "hybridsync-ps-store")


class Unanswered(TimeoutError):
    """``within``'s call did not return in time (it may still be running, in its daemon thread)."""


def within(call: Callable[[], T], timeout_s: float, thread_name: str) -> T:
    """``call()`` in a daemon thread that we stop waiting on after ``timeout_s`` (``Unanswered``); what it
    raised is raised here. For torch's store and RPC joins, which retry past their own timeouts."""
    results: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(call())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            errors.append(e)

    thread = threading.Thread(target=run, name=thread_name, daemon=True)
    thread.start()
    thread.join(timeout=timeout_s)
    if errors:
        raise errors[0]
    if not results:
        raise Unanswered(f"no answer within {timeout_s:.0f} s")
    return results[0]


def hosts_store(config: PSConfig) -> bool:
    """Whether this server process hosts the rendezvous store: server 0, unless its supervisor does."""
    return config.role == "server" and config.index == 0 and not os.environ.get(envvars.PS_SUPERVISED)


def next_incarnation(store: Any, server: int) -> int:
    """Count one more start of ``server``; its incarnation (0 for the first start)."""
    return int(store.add(store_key(f"server{server}", "starts"), 1)) - 1


def latest_incarnation(store: Any, server: int) -> int:
    """The newest incarnation of ``server`` started so far (-1: none)."""
    return int(store.add(store_key(f"server{server}", "starts"), 0)) - 1


def join(config: PSConfig, *, timeout_s: float, incarnation: int = 0, store: Any = None) -> None:
    """``rpc.init_rpc`` as a member of the dynamic group; fails clearly after ``timeout_s``.

    A replacement (``incarnation > 0``) first takes its predecessors off torch's member list
    (under torch's membership token): a dead member never left, and a joiner greets every
    listed member. The join runs in a daemon thread that we stop waiting on after ``timeout_s``
    (the store connection alone retries for torch's 30-minute default).
    """
    from torch.distributed import rpc
    options = rpc.TensorPipeRpcBackendOptions(init_method=config.init_method, rpc_timeout=timeout_s,
                                              num_worker_threads=16, **_transport_options(os.environ))
    name, member = this_member(config, incarnation)

    def init() -> None:
        if incarnation > 0:
            _unlist(store, [server_member(config, config.index, r) for r in range(incarnation)])
        rpc.init_rpc(name, rank=member, world_size=None, rpc_backend_options=options)

    with warnings.catch_warnings():
        # torch's own init_rpc hands its Gloo backend to all_gather_object, which warns on every
        # member that this usage is deprecated (torch/distributed/rpc/backend_registry.py):
        # nothing the user or we can change. Only that message is dropped, only while joining.
        warnings.filterwarnings("ignore", message=_BACKEND_AS_PROCESS_GROUP, category=UserWarning)
        try:
            within(init, timeout_s, "hybridsync-ps-join")
        except Unanswered:
            raise RuntimeError(join_failure(config, timeout_s, "timed out")) from None
        except BaseException as e:  # noqa: BLE001 - torch's errors name neither the group nor the settings
            raise RuntimeError(join_failure(config, timeout_s, str(e).splitlines()[0])) from None


def join_failure(config: PSConfig, timeout_s: float, why: str) -> str:
    return (f"{config.name} could not join the parameter-server group at {config.init_method} "
            f"({config.num_servers} servers + {config.num_workers} workers) within {timeout_s:.0f} s: "
            f"{why}; check DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT, DMLC_NUM_SERVER, "
            f"DMLC_NUM_WORKER and that every server and worker was started")


def _unlist(store: Any, members: Iterable[tuple[str, int]]) -> None:
    """Remove ``(name, id)`` members from torch's list of the group's members.

    torch 2.13 keeps that list in the store as ``rpc_prefix_0/names/_ALL_WORKER_INFOS``
    (``"name-id,"`` entries; ``rpc.shutdown`` removes a leaver's the same way), guarded by
    the token of ``_group_membership_management``. The prefix is ``rpc_prefix_<n>`` for a
    process's n-th ``init_rpc``: every member joins exactly once, so it is 0 everywhere.
    """
    import torch.distributed as dist
    from torch.distributed.rpc._utils import _group_membership_management
    rpc_store = dist.PrefixStore("rpc_prefix_0", store)
    names = dist.PrefixStore("names", rpc_store)
    with _group_membership_management(rpc_store, "hybridsync_unlist", True):
        if not names.check(["_ALL_WORKER_INFOS"]):
            return
        listed = names.get("_ALL_WORKER_INFOS").decode()
        kept = listed
        for name, member in members:
            kept = kept.replace(f"{name}-{member},", "")
        if kept != listed:
            names.set("_ALL_WORKER_INFOS", kept)


def joined(store: Any, name: str) -> bool:
    """Whether member ``name`` has joined the group and can be called from here.

    Seeing the name (``rpc.get_worker_info``) is not enough: a joiner greets the members one
    by one, and each learns its name before its address, so a call in between fails
    ("could not find destination url") and would take the joiner down with it. A member
    counts once ``count_join`` marked it in the store, after its greetings were all answered.
    """
    from torch.distributed import rpc
    if not store.check([store_key("members", name)]):
        return False
    try:
        rpc.get_worker_info(name)
        return True
    except RuntimeError:
        return False


def wait_joined(store: Any, names: Iterable[str], *, timeout_s: float) -> list[str]:
    """Wait until every one of ``names`` has joined; returns those still missing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    missing = [n for n in names if not joined(store, n)]
    while missing and time.monotonic() < deadline:
        time.sleep(0.05)
        missing = [n for n in missing if not joined(store, n)]
    return missing


TRANSPORT_VAR = envvars.PS_TRANSPORT


def _transport_options(env) -> dict[str, list[str]]:
    """TensorPipe transports from ``HYBRIDSYNC_PS_TRANSPORT``: ``tcp`` (default) or ``auto``.

    ``tcp`` keeps every byte on TCP (TensorPipe's ``uv`` transport, ``basic`` channel).
    ``auto`` lets TensorPipe pick, which between processes of one machine means its shared
    memory transport and CMA channel. Two reasons for the default: on the emulated cluster,
    whose hosts share one kernel, ``auto`` moved tensors between "hosts" with CMA
    (``process_vm_readv``), so not a byte crossed the shaped links; and with ``auto`` a process
    that had joined the servers kept paying for it where ranks share cores: ring steps after a
    switch away from the PS, and BSP push-pulls, were several times slower than on TCP
    (benchmarks/switching.py; benchmarks/RESULTS.md, "switching.py").
    """
    choice = env.get(TRANSPORT_VAR, "tcp").strip().lower() or "tcp"
    if choice == "auto":
        return {}
    if choice == "tcp":
        return {"_transports": ["uv"], "_channels": ["basic"]}
    raise ValueError(f"{TRANSPORT_VAR} must be 'tcp' or 'auto', got {choice!r}")


def check_shape(store: Any, config: PSConfig) -> None:
    """The first member to reach the store records the group's shape (servers, workers); a member
    started with other counts fails at once. Without this a server expecting one worker more
    made every BSP round wait for it, until its join timeout (120 s) ended the job naming no count."""
    shape = f"{config.num_servers} servers, {config.num_workers} workers"
    recorded = store.compare_set(store_key("shape"), "", shape).decode()
    if recorded != shape:
        message = (f"{config.name} was started with DMLC_NUM_SERVER={config.num_servers}, "
                   f"DMLC_NUM_WORKER={config.num_workers}, but the parameter-server group at "
                   f"{config.init_method} has {recorded} (set by the member that came first): "
                   f"set DMLC_NUM_SERVER and DMLC_NUM_WORKER alike on every server and worker")
        store.set(store_key("misfit"), message)  # for the members already waiting for this one
        raise ValueError(message)


def misfit(store: Any) -> str | None:
    """The error of a member that ``check_shape`` refused, if one was."""
    key = store_key("misfit")
    return store.get(key).decode() if store.check([key]) else None


def count_join(store: Any, name: str) -> None:
    """``name`` joined the group: one more member to wait for at the end (``leave``)."""
    store.set(store_key("members", name), "1")
    store.add(store_key("joined"), 1)


def any_worker_joined(store: Any, num_workers: int) -> bool:
    """Whether any of the job's ``num_workers`` workers ever joined (``count_join``): once the job's
    workers are gone, servers that none joined have nothing to wait for."""
    return any(store.check([store_key("members", worker_name(w))]) for w in range(num_workers))


def count_departed(store: Any, names: Iterable[str]) -> None:
    """Members that died (a replacement's predecessors) will never leave: stop counting them."""
    for name in names:
        if store.delete_key(store_key("members", name)):
            store.add(store_key("departed"), 1)


def mark_finished(store: Any, worker: int) -> None:
    """``worker`` said goodbye: a replacement server that joins from now on needs nothing from it."""
    store.set(store_key("finished", worker_name(worker)), "1")


def finished(store: Any, worker: int) -> bool:
    return store.check([store_key("finished", worker_name(worker))])


def _members(store: Any) -> int:
    return int(store.add(store_key("joined"), 0)) - int(store.add(store_key("departed"), 0))


def _meet(store: Any, phase: str, timeout_s: float) -> bool:
    """Count this member at ``phase``; wait until every live member got there (False after ``timeout_s``)."""
    store.add(store_key(phase), 1)
    deadline = time.monotonic() + timeout_s
    while store.add(store_key(phase), 0) < _members(store):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def leave(*, timeout_s: float, store: Any) -> None:
    """Leave the group once every member is done, without a word in anyone's log.

    torch's graceful leave of a dynamic group greets every member it lists (a dead server
    that was replaced is still listed, and the greeting would fail) and closes while the
    others still run, each of which logs the closed connection (a TensorPipe warning per
    peer, at every job end). Here, as in a static group, the members first wait for each
    other (like ``hvd.shutdown``, up to ``timeout_s``); then each one's agent leaves the
    group (``join(shutdown=True)``: its own calls finished, its name off the list, closed
    connections expected from now on), they wait again, and only then close.
    ``RuntimeError`` if the others do not come, or closing does not end in time (it runs in
    a thread we stop waiting on: leaving must never hang a job's end).
    """
    from torch.distributed import rpc
    if not _meet(store, "finishing", timeout_s):
        raise RuntimeError(f"not every member of the group finished within {timeout_s:.0f} s")
    errors: list[BaseException] = []

    def close() -> None:
        try:
            rpc.api._get_current_rpc_agent().join(shutdown=True, timeout=timeout_s)
            _meet(store, "closing", _CLOSING_S)
            rpc.shutdown(graceful=False)
            store.add(store_key("left"), 1)
        except BaseException as e:  # noqa: BLE001 - handed to the leaving thread
            errors.append(e)

    closer = threading.Thread(target=close, name="hybridsync-ps-leave", daemon=True)
    closer.start()
    closer.join(timeout=2 * _CLOSING_S)
    if closer.is_alive() or errors:
        raise RuntimeError(f"closing the connections failed: {errors[0] if errors else 'timed out'}")


_CLOSING_S = 30.0
"""Bound on the members' second meeting when they leave, and half the bound on closing."""


def wait_all_left(store: Any, *, timeout_s: float, supervisors_still_here: int = 0) -> bool:
    """The store's host, before it exits: wait until every live member has left, and every
    supervisor but ``supervisors_still_here`` is done with the store (``supervisor_done``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = (store.add(store_key("left"), 0) >= _members(store) and store.add(store_key("supervisors_done"), 0)
                >= store.add(store_key("supervisors"), 0) - supervisors_still_here)
        if done:
            return True
        time.sleep(0.1)
    return False


def supervisor_started(store: Any) -> None:
    store.add(store_key("supervisors"), 1)


def supervisor_done(store: Any) -> None:
    """A supervisor will not use the store again (its host may close it)."""
    store.add(store_key("supervisors_done"), 1)


def abandon(code: int, message: str) -> None:
    """Print ``message`` and exit now: a peer is gone, so a graceful shutdown could only hang."""
    print(message, file=sys.stderr, flush=True)

    def close() -> None:
        from torch.distributed import rpc
        try:
            rpc.shutdown(graceful=False)
        except Exception:  # noqa: BLE001 - we are exiting anyway
            pass

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(timeout=3.0)
    os._exit(code)
