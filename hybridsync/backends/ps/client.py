"""The worker side of the parameter-server route.

``PSClient`` joins the RPC group, places keys, and runs BSP push-pulls: every chunk of a
message goes to its server as one RPC whose answer is the sum over all workers.
``PSBackend`` adapts it to the router's ``Backend`` protocol. A watchdog pings every
server; a server that dies or hangs is replaced if a supervisor restarts it (every call
is resent to the replacement, ``recovery.py``), else it fails ``wait`` with its name
instead of hanging.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.futures import Future

from hybridsync import envvars
from hybridsync.backends import peer_lost
from hybridsync.backends.base import KeyedBackend, Reduction, SparseBackend, wire_of
from hybridsync.backends.ps import group
from hybridsync.backends.ps.config import PSConfig
from hybridsync.backends.ps.notice import WaitNotice, store_state
from hybridsync.backends.ps.recovery import Call, Links, PSServerError, Recovery  # noqa: F401 - re-exported
from hybridsync.backends.ps.store import WireCounters, payload_bytes
from hybridsync.backends.ps.watchdog import Watchdog
from hybridsync.placement import Chunk, Declaration, KeyTable, Layout, WireTensor, namespaced, part_key

DEFAULT_PING_TIMEOUT_S = 10.0
DEFAULT_JOIN_TIMEOUT_S = 120.0


class PSClient:
    """One worker's connection to the servers: placement, push-pull, counters, shutdown."""

    def __init__(self, config: PSConfig, *, join_timeout_s: float | None = None, ping_interval_s: float = 1.0,
                 ping_timeout_s: float | None = None) -> None:
        """``join_timeout_s``: how long joining may take in all (default ``HYBRIDSYNC_PS_JOIN_TIMEOUT``,
        else 120 s); ``ping_timeout_s``: how long a server may leave a ping unanswered before it
        counts as hung (default ``HYBRIDSYNC_PS_PING_TIMEOUT``, else 10 s)."""
        if config.role != "worker":
            raise ValueError(f"DMLC_ROLE must be 'worker' for a PS client, got {config.role!r}")
        self.config = config
        self.counters = WireCounters()
        self.keys = KeyTable(config.num_servers, config.partition_bytes)
        """Every key's server: placed by ``hybridsync.placement``, as ``RoutingPlan.ps_keys`` predicts."""
        self._released: set[str] = set()
        """Namespaces (``"<namespace>/"``) this worker released: their keys are never sent again."""
        self._steps: dict[str, int] = {}
        self._closed = False
        # a primary loss shows within a ping round (a dead server refuses the ping); two, and a second to spare
        self._links = Links(self, secondary_grace_s=2 * ping_interval_s + 1.0)
        self._store = None
        self._watchdog: Watchdog | None = None
        if join_timeout_s is None:
            join_timeout_s = envvars.seconds_from_env(envvars.PS_JOIN_TIMEOUT, DEFAULT_JOIN_TIMEOUT_S)
        self._connect(join_timeout_s, ping_interval_s, _ping_timeout(ping_timeout_s))

    def _connect(self, join_timeout_s: float, ping_interval_s: float, ping_timeout_s: float) -> None:
        """Join the RPC group, wait for every server and watch them (with ``transport``, the client's
        only network code: an in-process test replaces both, ``tests/test_router_inprocess.py``).

        The three waits (store, group, servers) share one deadline, ``join_timeout_s``, and say on
        stderr what they await while they wait (``notice.WaitNotice``)."""
        config = self.config
        at = f"{config.root_uri}:{config.root_port}"
        store_host = f"the rendezvous store at {at} (hosted by server0, or by its supervisor)"
        with WaitNotice(config.name, join_timeout_s, lambda: f"{store_host}: {store_state(config.root_uri, config.root_port)}") as waiting:
            try:
                self._store = group.reach_store(config, waiting.remaining())
            except Exception as e:  # noqa: BLE001 - torch's DistStoreError names neither server nor variable
                raise RuntimeError(group.join_failure(config, join_timeout_s, f"{store_host} did not answer "
                                                      f"({store_state(config.root_uri, config.root_port)}; "
                                                      f"{str(e).splitlines()[0]})")) from e
            self._links.attach_store(self._store)
            group.check_shape(self._store, config)
            waiting.awaited = lambda: f"the RPC group at {at} to let {config.name} join"
            group.join(config, timeout_s=waiting.remaining())
            group.count_join(self._store, config.name)
            missing: list[int] = []
            waiting.awaited = lambda: "servers to join: " + ", ".join(group.server_name(s) for s in missing)
            self._wait_for_servers(join_timeout_s, waiting.remaining(), missing)
        self._watchdog = Watchdog(self._links.watched, self._links.on_watchdog,
                                  interval_s=ping_interval_s, timeout_s=ping_timeout_s).start()

    def _wait_for_servers(self, timeout_s: float, remaining_s: float, missing: list[int]) -> None:
        """Every server (its latest incarnation) has joined; a clear error after ``remaining_s``
        (of ``timeout_s`` in all). ``missing`` is kept up to date for the notice."""
        deadline = time.monotonic() + remaining_s
        missing[:] = range(self.config.num_servers)
        while missing:
            missing[:] = [s for s in missing if not group.joined(self._store, self._links.adopt_latest(s, self._store))]
            if missing and (refused := group.misfit(self._store)) is not None:
                raise ValueError(refused)
            if missing and time.monotonic() > deadline:
                raise RuntimeError(group.join_failure(self.config, timeout_s, "servers never joined: " + ", ".join(
                    group.server_name(s) for s in missing)))
            time.sleep(0.05 if missing else 0)

    @property
    def num_workers(self) -> int:
        return self.config.num_workers

    def declare(self, name: str, tensors: Sequence[torch.Tensor | WireTensor], *,
                server: int | None = None) -> list[Chunk]:
        """Fix the keys of one message and their server(s) before its first push (see ``declare_all``)."""
        self.declare_all([(name, tensors, server)])
        return self.layout(name, tensors).chunks

    def declare_all(self, messages: Sequence[tuple[str, Sequence[torch.Tensor | WireTensor], int | None]]) -> None:
        """Place the keys of ``(name, tensors, server)`` messages: on ``server`` where given, the
        rest balanced by bytes over all of them at once (largest first, least-loaded server).

        ``tensors`` may be tensors or their ``WireTensor`` descriptions. Call it on every
        worker with the same messages in the same order (the routing plan's); messages never
        declared are placed by a hash of their key names.
        """
        self.keys.declare_all([(name, wire_of(tensors), server) for name, tensors, server in messages])

    def release(self, namespace: str) -> None:
        """This worker is done with every key of ``namespace`` (``"<namespace>/..."``): forget their
        placement, load, layouts and step counters here, and tell every server, which drops the
        keys once every worker has released them. Idempotent; a namespace is never used again."""
        prefix = f"{namespace}/"
        if not namespace or prefix in self._released:
            return
        self.check_usable()
        self._released.add(prefix)
        self.keys.release(prefix)
        for key in [k for k in self._steps if k.startswith(prefix)]:
            del self._steps[key]
        self._links.forget_prefix(prefix)
        releases = [self.request(s, "rpc_release", (prefix, self.config.index), timeout=30)
                    for s in range(self.config.num_servers)]
        self.wait_all(releases, f"the release of {namespace}")

    def released_prefixes(self) -> tuple[str, ...]:
        """Namespaces (``"<namespace>/"``) this worker released, sorted."""
        return tuple(sorted(self._released))

    def server_key_names(self) -> list[list[str]]:
        """Every server's keys (one call to each), by server index."""
        calls = [self.request(s, "rpc_key_names", (), timeout=10) for s in range(self.config.num_servers)]
        return self.wait_all(calls, "rpc_key_names")

    @property
    def loads(self) -> list[int]:
        """Bytes of declared keys per server (what placement balances); a copy."""
        return self.keys.loads

    @property
    def placement(self) -> dict[str, int]:
        """Server of every key placed so far (a copy)."""
        return self.keys.placement

    def server_of(self, key: str) -> int:
        """The server holding ``key``: declared placement, else the hash fallback."""
        return self.keys.server_of(key)

    @property
    def pushes(self) -> dict[str, int]:
        """Pushes sent so far, per key (a copy): the keys this worker's traffic used."""
        return dict(self._steps)

    @property
    def recoveries(self) -> list[Recovery]:
        """Servers replaced under this worker so far: which, when, how long it took (a copy)."""
        return list(self._links.recoveries)

    def push_pull_async(self, name: str, tensors: Sequence[torch.Tensor],
                        reduction: Reduction = Reduction()) -> PSHandle:
        """Start a BSP push-pull of message ``name``; after ``wait()`` ``tensors`` hold the result."""
        self.check_usable()
        layout = self.layout(name, tensors)
        flats = [_flat([tensors[i] for i in members]) for members in layout.groups]
        calls = []
        for chunk in layout.chunks:
            payload = _payload(flats[chunk.group][chunk.start:chunk.stop], reduction.prescale_factor)
            calls.append((chunk, self.send(chunk.key, "rpc_push_pull", payload)))
        return PSHandle(self, tensors, layout, flats, calls, reduction)

    def push_pull_sparse_async(self, name: str, grad: torch.Tensor, reduction: Reduction = Reduction(), *,
                               home: str | None = None) -> SparseHandle:
        """Push the touched rows of sparse ``grad``; ``wait()`` returns the summed sparse tensor.

        ``home``: a declared message whose server this key joins when it has no place yet
        (a sparse gradient travels as one key, on the server of its message's first key).
        """
        self.check_usable()
        if home is not None:
            self.keys.follow(home, name)
        grad = grad.coalesce()
        values = grad.values() * reduction.prescale_factor if reduction.prescale_factor != 1 else grad.values()
        payload = (grad.indices(), values, tuple(grad.shape))
        return SparseHandle(self, name, self.send(name, "rpc_push_pull_sparse", payload), reduction)

    def server_counters(self) -> list[dict[str, int]]:
        """Every server's byte counters (a synchronous RPC to each)."""
        calls = [self.request(s, "rpc_counters", (), timeout=10) for s in range(self.config.num_servers)]
        return self.wait_all(calls, "rpc_counters")

    def shutdown(self, *, timeout_s: float = 300.0) -> None:
        """Say goodbye to every server and leave the group (servers exit after the last worker).

        Like ``hvd.shutdown``, leaving waits for every other process to leave too (up to
        ``timeout_s``); after a failure it closes at once instead.
        """
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._links.failure() is not None:
            _close_quietly()
            return
        try:
            group.mark_finished(self._store, self.config.index)
            goodbyes = [self.request(s, "rpc_goodbye", (self.config.index,), timeout=10)
                        for s in range(self.config.num_servers)]
            self.wait_all(goodbyes, "goodbye")
            group.leave(timeout_s=timeout_s, store=self._store)
        except Exception as e:  # noqa: BLE001 - cleanup (often at exit): report, close, go on
            print(f"hybridsync PS {self.config.name}: could not leave the group cleanly ({_first_line(e)}); "
                  f"closing", file=sys.stderr, flush=True)
            _close_quietly()

    def send(self, key: str, function: str, payload: Any) -> Call:
        """Send one push of ``key`` to its server; no RPC timeout (the watchdog bounds waits)."""
        if self._released and f"{key.split('/', 1)[0]}/" in self._released:
            raise RuntimeError(f"key {key!r} belongs to a released namespace (a replaced routing plan)")
        index = self.server_of(key)
        step = self._steps.get(key, 0)
        self._steps[key] = step + 1
        self.counters.pushed_bytes += payload_bytes(payload)
        self.counters.push_pulls += 1
        return self._links.submit(index, function, (key, self.config.index, step, payload))

    def request(self, index: int, function: str, args: tuple, *, timeout: float = 0) -> Call:
        """Send ``function(*args)`` to server ``index``, resent to its replacement if it dies
        (``wait_all`` gets the answer). ``timeout``: seconds per attempt (0: none)."""
        return self._links.submit(index, function, args, timeout=timeout)

    def call(self, index: int, function: str, args: tuple, *, timeout: float = 0) -> PendingCall:
        """``request`` and an object whose ``wait()`` returns the answer (or raises ``PSServerError``)."""
        return PendingCall(self, self.request(index, function, args, timeout=timeout), function)

    def transport(self, index: int, function: str, args: tuple, *, timeout: float = 0) -> Future:
        """Call ``function`` (a name in ``server.py``) on server ``index``'s current incarnation:
        the network, and nothing else."""
        from torch.distributed import rpc
        from hybridsync.backends.ps import server
        return rpc.rpc_async(self._links.name(index), getattr(server, function), args=args, timeout=timeout)

    def layout(self, name: str, tensors: Sequence[torch.Tensor | WireTensor]) -> Layout:
        """The dtype groups and keys of message ``name`` (fixed at its first use)."""
        return self.keys.layout(name, wire_of(tensors))

    def check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("the PS client was shut down")
        self._links.check()

    def wait_all(self, calls: Sequence[Call], what: str) -> list[Any]:
        """Results of ``calls`` in order, across server replacements; raises ``PSServerError``
        naming the server if one is lost for good or refuses a call."""
        results = self._links.wait(calls, what)
        self.counters.pulled_bytes += sum(payload_bytes(r) for c, r in zip(calls, results) if c.function in _PUSHES)
        return results


class PendingCall:
    """An answer on its way (``PSClient.call``)."""

    def __init__(self, client: PSClient, call: Call, what: str) -> None:
        self._client, self._call, self._what = client, call, what

    def wait(self) -> Any:
        return self._client.wait_all([self._call], self._what)[0]


_PUSHES = ("rpc_push_pull", "rpc_push_pull_sparse", "rpc_push_delta")


def _ping_timeout(given: float | None) -> float:
    if given is not None:
        return given
    return envvars.seconds_from_env(envvars.PS_PING_TIMEOUT, DEFAULT_PING_TIMEOUT_S)


def _first_line(error: BaseException) -> str:
    """The useful line of an RPC error (torch wraps remote callback errors in a prefix)."""
    text = str(error).strip()
    text = text.split("Got the following error when running the callback: ", 1)[-1]
    return text.splitlines()[0] if text else type(error).__name__


class PSHandle:
    """An in-flight dense push-pull; ``wait`` writes the reduced values into the tensors."""

    def __init__(self, client: PSClient, tensors: Sequence[torch.Tensor], layout: Layout,
                 flats: list[torch.Tensor], calls: list[tuple[Chunk, Call]],
                 reduction: Reduction) -> None:
        self._client, self._tensors, self._layout, self._flats = client, tensors, layout, flats
        self._calls, self._reduction = calls, reduction
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        chunks = [chunk for chunk, _ in self._calls]
        what = f"push_pull of {chunks[0].key if len(chunks) == 1 else f'{len(chunks)} keys'}"
        results = self._client.wait_all([call for _, call in self._calls], what)
        factor = self._reduction.result_factor(self._client.num_workers)
        for chunk, result in zip(chunks, results):
            self._flats[chunk.group][chunk.start:chunk.stop].copy_(result.view(-1))
        for flat, members in zip(self._flats, self._layout.groups):
            if factor != 1.0:
                flat.mul_(factor)
            _scatter(flat, [self._tensors[i] for i in members])
        self._done = True


class SparseHandle:
    """An in-flight sparse push-pull; ``wait`` returns the reduced sparse tensor."""

    def __init__(self, client: PSClient, name: str, call: Call, reduction: Reduction) -> None:
        self._client, self._name, self._call, self._reduction = client, name, call, reduction

    def wait(self) -> torch.Tensor:
        (indices, values, size), = self._client.wait_all([self._call], f"sparse push_pull of {self._name}")
        factor = self._reduction.result_factor(self._client.num_workers)
        # A copy either way: the answer itself is kept for a replacement server (recovery.py).
        return torch.sparse_coo_tensor(indices.clone(), values * factor if factor != 1.0 else values.clone(), size,
                                       check_invariants=False)


class PSBackend(KeyedBackend, SparseBackend):
    """The router's backend for ``route: "ps"`` (BSP): one push-pull per message.

    A ``KeyedBackend`` (the router declares every message up front, so keys are placed
    alike on every worker) and a ``SparseBackend`` (touched rows only, both ways).

    ``namespace`` prefixes every key name this backend sends (``"<namespace>/<message>"``),
    so the messages of two optimizers in one job (a new training phase, an optimizer
    re-created after a checkpoint) never share keys on the servers, even when their
    names, shapes or sparsity coincide.
    """

    def __init__(self, client: PSClient | None = None, namespace: str = "") -> None:
        self.client = client if client is not None else get_client()
        self.namespace = namespace

    def key(self, name: str) -> str:
        """The server-side name of message ``name``."""
        return namespaced(self.namespace, name)

    def declare(self, name: str, tensors: Sequence[torch.Tensor | WireTensor], server: int | None = None) -> None:
        """Place message ``name``'s keys (balanced by bytes, or on ``server``) before the first step."""
        self.client.declare(self.key(name), tensors, server=server)

    def declare_all(self, messages: Sequence[Declaration]) -> None:
        """Place every PS message of a routing plan at once: ``(name, wire tensors, server or None)``."""
        self.client.declare_all([(self.key(name), wire, server) for name, wire, server in messages])

    def submit(self, name: str, tensors: Sequence[torch.Tensor], reduction: Reduction) -> PSHandle:
        return self.client.push_pull_async(self.key(name), tensors, reduction)

    def close(self) -> None:
        """Release this backend's keys (its namespace) here and, once every worker did, on the servers."""
        if self.namespace:
            self.client.release(self.namespace)

    def submit_sparse(self, name: str, grad: torch.Tensor, reduction: Reduction) -> Callable[[], torch.Tensor]:
        """Touched rows only, both ways; the callable waits and returns the reduced sparse gradient."""
        key = self.key(name)
        return self.client.push_pull_sparse_async(key, grad, reduction, home=key).wait

    def submit_parts(self, name: str, parts: Sequence[tuple[str, torch.Tensor]],
                     reduction: Reduction) -> Callable[[], list[torch.Tensor | None]]:
        """A message holding sparse gradients (a row shard, a merge group): each ``(part, tensor)``
        travels under its own key ``<message>.<part>`` (a lone part: ``<message>``) on the server of
        the message's first key,
        sparse tensors as their touched rows, dense ones in place.

        The callable waits and returns, per part, the reduced sparse tensor (``None`` for dense).
        """
        home = self.key(name)
        handles: list[Any] = []
        for part, tensor in parts:
            key = part_key(home, part, len(parts))
            if tensor.is_sparse:
                handles.append(self.client.push_pull_sparse_async(key, tensor, reduction, home=home))
            else:  # on home's server (its bytes were counted with home's); else by the hash
                self.client.keys.follow(home, key, wire_of([tensor]))
                handles.append(self.client.push_pull_async(key, [tensor], reduction))
        return lambda: [handle.wait() for handle in handles]


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D buffer: a view of a lone contiguous tensor, else a concatenated copy."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].view(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def _scatter(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` unless it already is their memory."""
    if len(tensors) == 1 and tensors[0].is_contiguous() and tensors[0].data_ptr() == flat.data_ptr():
        return
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def _payload(chunk: torch.Tensor, prescale: float) -> torch.Tensor:
    """The tensor sent for one chunk; a copy when RPC would otherwise ship the whole storage."""
    if prescale != 1.0:
        return chunk * prescale
    if chunk.nbytes != chunk.untyped_storage().nbytes():
        return chunk.clone()
    return chunk


def _close_quietly() -> None:
    """Non-graceful RPC shutdown after a failure, bounded in time (a dead peer cannot take part).

    Skipped when a lost peer is ending the process (``peer_lost.exiting``): its exit closes every
    connection at once, where the shutdown waited its whole bound on a cut link (5 s)."""
    if peer_lost.exiting():
        return
    def close() -> None:
        from torch.distributed import rpc
        try:
            rpc.shutdown(graceful=False)
        except Exception:  # noqa: BLE001 - already failing
            pass
    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(timeout=5.0)


_CLIENT: PSClient | None = None


def init(env: Mapping[str, str] | None = None, *, worker_id: int | None = None, **options: float) -> PSClient:
    """Join the PS group as a worker, from BytePS's variables in ``env`` (default ``os.environ``).

    ``worker_id`` overrides ``DMLC_WORKER_ID`` (e.g. ``hvd.rank()``); ``options`` are
    ``PSClient``'s timeouts. Idempotent: a second call returns the same client.
    """
    global _CLIENT
    if _CLIENT is None:
        config = PSConfig.from_env(os.environ if env is None else env, role="worker", index=worker_id)
        _CLIENT = PSClient(config, **options)
        atexit.register(shutdown)  # a script that forgets shutdown() still lets the servers exit cleanly
    return _CLIENT


def initialized() -> bool:
    """True once ``init`` joined the servers (and until ``shutdown``)."""
    return _CLIENT is not None


def get_client() -> PSClient:
    """The client ``init`` created; a clear error if there is none."""
    if _CLIENT is None:
        raise ValueError("the parameter-server client is not initialized; call "
                         "hybridsync.backends.ps.init() (or hs.init() with DMLC_NUM_SERVER set) first")
    return _CLIENT


def shutdown() -> None:
    """Shut the client down (no-op if there is none)."""
    global _CLIENT
    if _CLIENT is not None:
        _CLIENT.shutdown()
        _CLIENT = None
