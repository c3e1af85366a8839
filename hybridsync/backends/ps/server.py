"""The parameter-server process: ``python -m hybridsync.backends.ps.server``.

Configured by BytePS's variables (``DMLC_ROLE=server``, ``DMLC_SERVER_ID``,
``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER``, ``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``).
It joins the RPC group, answers push-pulls of the keys placed on it, and exits
- with status 0 once every worker has said goodbye (``PSClient.shutdown``), or
- with status 1 and a message naming the worker as soon as a worker stops answering
  pings (waiting for its pushes would hang every other worker).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import threading
from typing import Any, Sequence

from torch.distributed import rpc
from torch.futures import Future

from hybridsync import envvars
from hybridsync.backends.ps import group
from hybridsync.backends.ps.config import PSConfig
from hybridsync.backends.ps.coordinator import Schedule, SwitchCoordinator
from hybridsync.backends.ps.store import KeyStore, SparsePayload
from hybridsync.backends.ps.watchdog import Watchdog

log = logging.getLogger("hybridsync.ps.server")


class Server:
    """One server's state: its keys, the workers still attached, and how it ends."""

    def __init__(self, config: PSConfig) -> None:
        self.config = config
        self.store = KeyStore(num_workers=config.num_workers)
        self.coordinator = SwitchCoordinator(config.num_workers, config.name)
        self._attached = set(range(config.num_workers))
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self.failure: str | None = None
        # Sibling servers are watched too: once one is gone the job cannot finish, so do not linger.
        peers = [group.worker_name(i) for i in range(config.num_workers)]
        peers += [group.server_name(i) for i in range(config.num_servers) if i != config.index]
        self.watchdog = Watchdog(peers, self.fail)

    def goodbye(self, worker: int) -> dict[str, int]:
        """``worker`` is done: stop watching it; the last goodbye ends the server."""
        self.watchdog.forget(group.worker_name(worker))
        self.store.detach(worker)
        with self._lock:
            self._attached.discard(worker)
            if not self._attached:
                self._finished.set()
        return self.store.counters.as_dict()

    def fail(self, peer: str, error: str) -> None:
        """A worker stopped answering: fail pending pulls and end the server."""
        why = ("pushes will never arrive" if peer.startswith("worker")
               else "the job cannot finish without that server")
        self.failure = f"hybridsync PS {self.config.name}: {peer} stopped answering ({error}); exiting, since {why}"
        self.store.fail_all(self.failure)
        self._finished.set()

    def run(self) -> int:
        """Serve until every worker said goodbye (0) or one died (1)."""
        self.watchdog.start()
        self._finished.wait()
        self.watchdog.stop()
        if self.failure is not None:
            group.abandon(1, self.failure)
        log.info("%s: all %d workers said goodbye; counters %s", self.config.name,
                 self.config.num_workers, self.store.counters.as_dict())
        return 0


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


def serve(config: PSConfig, *, join_timeout_s: float = 120.0, shutdown_timeout_s: float = 30.0) -> int:
    """Join the group as server ``config.index`` and serve until the job ends."""
    global _SERVER
    assert config.role == "server", config
    _SERVER = Server(config)
    group.join(config, timeout_s=join_timeout_s)
    log.info("%s serving (rank %d of %d) at %s", config.name, config.rank, config.world_size, config.init_method)
    code = _SERVER.run()
    try:
        group.leave(timeout_s=shutdown_timeout_s)
    except Exception as e:  # noqa: BLE001 - every worker is done; only the farewell failed
        group.abandon(code, f"hybridsync PS {config.name}: served every worker, but could not leave the "
                            f"group cleanly ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry: settings from the environment, a few timeouts from flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--join-timeout", type=float, default=120.0,
                        help="seconds to wait for every server and worker to join (default 120)")
    parser.add_argument("--id-from-launcher-rank", action="store_true",
                        help="take DMLC_SERVER_ID from HOROVOD_RANK (servers started by horovodrun, as "
                             "hybridsync-run does for servers on other hosts)")
    args = parser.parse_args(argv)
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
        return serve(config, join_timeout_s=args.join_timeout)
    except RuntimeError as e:
        group.abandon(1, f"hybridsync PS {config.name}: {e}")
        return 1


if __name__ == "__main__":
    # Run the imported module, not ``__main__``: workers' RPCs name functions (and reach
    # ``_SERVER``) by their module path ``hybridsync.backends.ps.server``.
    from hybridsync.backends.ps import server as _module
    raise SystemExit(_module.main())
