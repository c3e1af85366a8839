"""The parameter-server process: ``python -m hybridsync.backends.ps.server`` (``hybridsync-server``).

Configured by BytePS's variables (``DMLC_ROLE=server``, ``DMLC_SERVER_ID``,
``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER``, ``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``).
It joins the RPC group, answers push-pulls of the keys placed on it, and exits
- with status 0 once every worker has said goodbye (``PSClient.shutdown``), or
- with status 1 and a message naming the worker as soon as a worker stops answering
  pings (waiting for its pushes would hang every other worker).

With ``--supervise`` the process is a supervisor (``supervisor.py``) that runs the server
and starts a replacement when it dies. A replacement learns its keys back from the workers
(``rpc_restore``) before it answers any push: a *restore barrier* waits for every worker
still in the group, so an ASP/SSP value starts from the freshest pull any worker had.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import threading
import time
from typing import Any, Sequence

from torch.distributed import rpc
from torch.futures import Future

from hybridsync import envvars
from hybridsync.backends import peer_lost
from hybridsync.backends.ps import group
from hybridsync.backends.ps.config import PSConfig
from hybridsync.backends.ps.coordinator import Schedule, SwitchCoordinator
from hybridsync.backends.ps.store import KeyStore, RestoreState, SparsePayload
from hybridsync.backends.ps.watchdog import SERVER_QUITS, PeerFailure, Watchdog

log = logging.getLogger("hybridsync.ps.server")


class Server:
    """One server's state: its keys, the workers still attached, and how it ends."""

    def __init__(self, config: PSConfig, incarnation: int = 0) -> None:
        self.config = config
        self.incarnation = incarnation
        self.name = config.name if incarnation == 0 else f"{config.name} (replacement {incarnation})"
        self.store = KeyStore(num_workers=config.num_workers)
        self.coordinator = SwitchCoordinator(config.num_workers, config.name)
        self._attached = set(range(config.num_workers))
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self.failure: str | None = None
        self.barrier = RestoreBarrier(self.name) if incarnation else None
        """A replacement's wait for the workers' restores (restores may come as soon as it joined)."""
        # Workers only: a sibling server's death is its replacement's business, not a reason to stop.
        self.watchdog = Watchdog(self._watched, self._on_watchdog)

    def _watched(self) -> list[str]:
        with self._lock:
            return [group.worker_name(w) for w in sorted(self._attached)]

    def attach_only(self, workers: set[int]) -> None:
        """A replacement serves the workers still in the group (others finished before it came)."""
        with self._lock:
            self._attached &= workers
            if not self._attached:
                self._finished.set()  # nobody left to serve: leave with the others
        for worker in set(range(self.config.num_workers)) - workers:
            self.store.detach(worker)

    def goodbye(self, worker: int) -> dict[str, int]:
        """``worker`` is done: stop watching it; the last goodbye ends the server."""
        self.store.detach(worker)
        if self.barrier is not None:
            self.barrier.arrive(worker)
        with self._lock:
            self._attached.discard(worker)
            if not self._attached:
                self._finished.set()
        return self.store.counters.as_dict()

    def restore(self, worker: int, state: RestoreState) -> Future:
        """``worker``'s part of a replacement's keys; the answer waits for every worker's part."""
        barrier = self.barrier
        keys = self.store.restore(worker, state, parameters=barrier is None or not barrier.is_open)
        for job, (policy, schedule, step) in state.schedules.items():
            self.coordinator.restore(job, policy, schedule, step)
        log.info("%s: worker%d restored %d keys", self.name, worker, keys)
        if barrier is None:
            done: Future = Future()
            done.set_result(None)
            return done
        return barrier.arrive(worker)

    def _on_watchdog(self, failures: list[PeerFailure]) -> None:
        self.fail(", ".join(f.peer for f in failures), "; ".join(f.error for f in failures))

    def fail(self, peer: str, error: str) -> None:
        """A worker stopped answering: fail pending pulls and end the server."""
        self.failure = f"hybridsync PS {self.config.name}: {peer} stopped answering ({error}){SERVER_QUITS}"
        self.store.fail_all(self.failure)
        self._finished.set()

    def run(self) -> int:
        """Serve until every worker said goodbye (0) or one died (1)."""
        self.watchdog.start()
        self._finished.wait()
        self.watchdog.stop()
        if self.failure is not None:
            group.abandon(1, self.failure)
        log.info("%s: all %d workers said goodbye; counters %s", self.name,
                 self.config.num_workers, self.store.counters.as_dict())
        return 0


class RestoreBarrier:
    """A replacement's wait for every worker's restore before any of them pushes again.

    BSP rounds would sort themselves out without it; ASP/SSP values would not: a push
    applied to a value that a later worker's fresher pull then replaces would be lost.
    Restores may arrive before the replacement knows whom to expect (``expect``). After
    ``timeout_s`` it opens anyway (a worker that never restores is dead or stuck, and the
    server's watchdog ends the job if it is dead), saying which workers it missed.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.is_open = False
        self._arrived: set[int] = set()
        self._expected: set[int] | None = None
        self._futures: list[Future] = []
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._timer: threading.Timer | None = None

    def expect(self, workers: set[int], *, timeout_s: float) -> None:
        """The workers to wait for; opens now if they all restored already."""
        with self._lock:
            self._expected = set(workers)
        self._timer = threading.Timer(timeout_s, self._open, args=(f"gave up waiting after {timeout_s:.0f} s",))
        self._timer.daemon = True
        self._timer.start()
        self._open_if_ready()

    def arrive(self, worker: int) -> Future:
        """``worker`` restored (or left); the future resolves once the barrier opens."""
        future: Future = Future()
        with self._lock:
            self._arrived.add(worker)
            if self.is_open:
                future.set_result(None)
                return future
            self._futures.append(future)
        self._open_if_ready()
        return future

    def _open_if_ready(self) -> None:
        with self._lock:
            ready = self._expected is not None and self._expected <= self._arrived
        if ready:
            self._open("")

    def _open(self, why: str) -> None:
        with self._lock:
            if self.is_open:
                return
            self.is_open, futures = True, self._futures
            missing = sorted((self._expected or set()) - self._arrived)
            self._futures = []
        if self._timer is not None:
            self._timer.cancel()
        if missing:
            log.warning("%s: %s; serving without the keys of %s", self.name, why,
                        ", ".join(group.worker_name(w) for w in missing))
        else:
            log.info("%s: every worker restored its keys in %.1f s; serving", self.name,
                     time.monotonic() - self._started)
        for future in futures:
            future.set_result(None)


_SERVER: Server | None = None


def _server() -> Server:
    assert _SERVER is not None, "a PS RPC reached a process that is not serving"
    return _SERVER


@rpc.functions.async_execution
def rpc_push_pull(key: str, worker: int, step: int, tensor: Any) -> Future:
    """Dense BSP push-pull of one key (called by workers over RPC)."""
    return _server().store.push_pull(key, worker, step, tensor)


@rpc.functions.async_execution
def rpc_push_pull_sparse(key: str, worker: int, step: int, payload: SparsePayload) -> Future:
    """Sparse BSP push-pull: ``payload`` is ``(indices, values, size)`` of the touched rows."""
    return _server().store.push_pull(key, worker, step, payload)


def rpc_init_async(key: str, worker: int, value: Any, staleness: int | None) -> Any:
    """Create an ASP/SSP key (first worker's value wins) and return its current value."""
    del worker  # accepted for symmetry with the other calls and for debugging
    return _server().store.init_async(key, value, staleness)


@rpc.functions.async_execution
def rpc_push_delta(key: str, worker: int, clock: int, delta: Any) -> Future:
    """ASP/SSP: add a parameter delta; the future resolves to the current parameter."""
    return _server().store.push_delta(key, worker, clock, delta)


def rpc_sync_report(job: str, policy: dict[str, Any], worker: int, step: int) -> Schedule:
    """Sync-Switch ``elastic``: ``worker`` finished computing ``step``; returns the job's switch schedule."""
    return _server().coordinator.report(job, policy, worker, step)


def rpc_sync_switched(job: str, worker: int, index: int, step: int, protocol: str, reason: str) -> None:
    """Sync-Switch: ``worker`` made its ``index``-th switch of ``job`` after ``step`` (for the server's log)."""
    _server().coordinator.switched(job, worker, index, step, protocol, reason)


def rpc_sync_events() -> list[dict[str, Any]]:
    """Sync-Switch: every switch all workers made, as this server logged it."""
    return list(_server().coordinator.events)


@rpc.functions.async_execution
def rpc_restore(worker: int, state: RestoreState) -> Future:
    """A replacement server: ``worker``'s part of its keys; answered once every worker's part is in."""
    return _server().restore(worker, state)


def rpc_goodbye(worker: int) -> dict[str, int]:
    """A worker is shutting down; returns this server's counters."""
    return _server().goodbye(worker)


def rpc_release(prefix: str, worker: int) -> int:
    """``worker`` is done with the keys under ``prefix``; they are dropped once every worker is.
    Returns how many keys this call dropped."""
    return _server().store.release(prefix, worker)


def rpc_key_names() -> list[str]:
    """Every key this server holds (for tests and diagnostics)."""
    return _server().store.key_names()


def rpc_counters() -> dict[str, Any]:
    """This server's byte counters and SSP counters."""
    store = _server().store
    modes = {mode: dataclasses.asdict(c) for mode, c in store.staleness_counters.items()}
    return {**store.counters.as_dict(), **modes}


def serve(config: PSConfig, *, join_timeout_s: float = 120.0, shutdown_timeout_s: float = 30.0,
          restore_timeout_s: float = 60.0) -> int:
    """Join the group as server ``config.index`` (a replacement, if it was started before) and serve
    until the job ends."""
    global _SERVER
    assert config.role == "server", config
    hosting = group.hosts_store(config)
    store = group.open_store(config, host=hosting, timeout_s=join_timeout_s)
    group.check_shape(store, config)
    incarnation = group.next_incarnation(store, config.index)
    _SERVER = server = Server(config, incarnation)
    group.join(config, timeout_s=join_timeout_s, incarnation=incarnation, store=store)
    group.count_join(store, group.server_name(config.index, incarnation))
    workers = [group.worker_name(w) for w in range(config.num_workers)]
    if incarnation == 0:
        missing = group.wait_joined(store, workers, timeout_s=join_timeout_s)
        if missing and not server.failure:
            raise RuntimeError(group.join_failure(config, join_timeout_s, "workers never joined: " + ", ".join(missing)))
    else:
        _take_over(server, store, restore_timeout_s)
    log.info("%s serving (rank %d of %d) at %s", server.name, config.rank, config.world_size, config.init_method)
    code = server.run()
    try:
        group.leave(timeout_s=shutdown_timeout_s, store=store)
    except Exception as e:  # noqa: BLE001 - every worker is done; only the farewell failed
        group.abandon(code, f"hybridsync PS {config.name}: served every worker, but could not leave the "
                            f"group cleanly ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    if hosting and not group.wait_all_left(store, timeout_s=shutdown_timeout_s):  # incl. others' supervisors
        log.warning("%s: not every member left the group within %.0f s; closing the rendezvous store",
                    server.name, shutdown_timeout_s)
    return code


def _take_over(server: Server, store: Any, restore_timeout_s: float) -> None:
    """A replacement: serve the workers still in the group (its predecessors never leave: stop
    counting them) and answer no push until they restored its keys (``RestoreBarrier``)."""
    config = server.config
    group.count_departed(store, [group.server_name(config.index, r) for r in range(server.incarnation)])
    workers = {w for w in range(config.num_workers)
               if group.joined(store, group.worker_name(w)) and not group.finished(store, w)}
    server.attach_only(workers)
    log.info("%s: replaces %s; waiting for %d workers to restore its keys", server.name,
             group.server_name(config.index, server.incarnation - 1), len(workers))
    server.barrier.expect(workers, timeout_s=restore_timeout_s)


USAGE = """\
A hybridsync parameter server. hybridsync-run starts these for you when a strategy routes
variables through the PS (--num-servers, --server-hosts); start one by hand only for a job you
launch yourself (mpirun, a scheduler).

It reads BytePS's settings from the environment: DMLC_ROLE=server, DMLC_SERVER_ID,
DMLC_NUM_SERVER, DMLC_NUM_WORKER, DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT. It exits with status 0
once every worker has finished, and with status 1 and a message naming the worker as soon as a
worker stops answering (waiting for its pushes would hang every other worker). With --supervise
it restarts the server when it dies or hangs; the workers give the new one its values back."""

def main(argv: Sequence[str] | None = None) -> int:
    """Console entry: settings from the environment, a few timeouts from flags."""
    # prog: its usage and errors name the command whether run as hybridsync-server, by
    # ``python -m`` (hybridsync-run's servers) or in-process (the docs' help hook, under mkdocs).
    parser = argparse.ArgumentParser(prog="hybridsync-server", description=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--join-timeout", type=float, default=120.0,
                        help="seconds to wait for every server and worker to join (default 120)")
    parser.add_argument("--id-from-launcher-rank", action="store_true",
                        help="take DMLC_SERVER_ID from HOROVOD_RANK (servers started by horovodrun, as "
                             "hybridsync-run does for servers on other hosts)")
    parser.add_argument("--supervise", action="store_true",
                        help="run the server as a child and start a replacement whenever it dies or hangs "
                             "(the workers restore its keys); the supervisor of server 0 hosts the rendezvous")
    parser.add_argument("--max-restarts", type=int, default=10,
                        help="--supervise: replacements to start at most (default 10)")
    parser.add_argument("--restore-timeout", type=float, default=60.0,
                        help="a replacement's wait for every worker to restore its keys (default 60 s)")
    parser.add_argument("--standby", action="store_true", help=argparse.SUPPRESS)  # supervisor.py's spare
    args = parser.parse_args(argv)
    if args.standby and not sys.stdin.readline():
        return 0  # the supervisor no longer needs a spare
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    env = dict(os.environ)
    if args.id_from_launcher_rank:
        if envvars.HOROVOD_RANK not in env:
            parser.exit(2, "hybridsync PS server: --id-from-launcher-rank needs HOROVOD_RANK (start it with horovodrun)\n")
        env[envvars.DMLC_SERVER_ID] = env[envvars.HOROVOD_RANK]
    try:
        config = PSConfig.from_env(env, role="server")
    except ValueError as e:
        parser.exit(2, f"hybridsync PS server: {e}\n")
    if os.environ.get(envvars.DMLC_ROLE, "server") != "server":
        parser.exit(2, f"hybridsync PS server: DMLC_ROLE is {os.environ[envvars.DMLC_ROLE]!r}, expected 'server'\n")
    try:
        if args.supervise:
            from hybridsync.backends.ps.supervisor import supervise
            child = ["--join-timeout", str(args.join_timeout), "--restore-timeout", str(args.restore_timeout)]
            return supervise(config, {**env, envvars.DMLC_SERVER_ID: str(config.index)}, child,
                             max_restarts=args.max_restarts, join_timeout_s=args.join_timeout)
        return serve(config, join_timeout_s=args.join_timeout, restore_timeout_s=args.restore_timeout)
    except RuntimeError as e:
        group.abandon(1, f"hybridsync PS {config.name}: {e}")
        return 1


def exit_now(code: int) -> None:
    """End this process with ``code`` once its output is out, without the interpreter's shutdown.

    A server (or supervisor) is done once it left the group: what remains is freeing torch's
    modules and objects, which took 1-3.5 s of a loaded host's CPU per process, while the job's
    ranks end on the same cores and the launcher waits for every server (benchmarks/ps_exit.py)."""
    logging.shutdown()
    peer_lost.flush_and_exit(code)


if __name__ == "__main__":
    # Run the imported module, not ``__main__``: workers' RPCs name functions (and reach
    # ``_SERVER``) by their module path ``hybridsync.backends.ps.server``.
    from hybridsync.backends.ps import server as _module
    _module.exit_now(_module.main())
