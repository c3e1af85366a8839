"""``hybridsync-server --supervise``: keep server ``k`` of a job alive.

The supervisor runs the server as a child process and starts a replacement when the child
dies by a signal (SIGKILL, the OOM killer, a crash) or when a worker posts the verdict that
it hung (it stopped answering pings: the supervisor kills it first). The replacement joins
the group as the server's next incarnation and the workers restore its keys, so training
goes on (``recovery.py``). A server that *exits* (0: every worker said goodbye; 1: a worker
died, or the job never assembled) ends its supervisor with the same status: there is
nothing to replace.

The supervisor of server 0 hosts the job's rendezvous store, so the store outlives every
server process; it waits for every member to leave the group before it exits.
"""
from __future__ import annotations

import logging
import signal
import subprocess
import sys
from typing import Any, Mapping, Sequence

from hybridsync import envvars
from hybridsync.backends.ps import group
from hybridsync.backends.ps.config import PSConfig

log = logging.getLogger("hybridsync.ps.supervisor")

_POLL_S = 0.2
"""How often the supervisor looks at its child and at the hung verdicts."""


def supervise(config: PSConfig, env: Mapping[str, str], child_args: Sequence[str], *, max_restarts: int,
              join_timeout_s: float, leave_timeout_s: float = 30.0) -> int:
    """Run server ``config.index`` until it exits on its own; replace it when it dies or hangs."""
    hosting = config.index == 0
    store = group.open_store(config, host=hosting, timeout_s=join_timeout_s)
    store.set(group.store_key(f"server{config.index}", "supervised"), "1")
    group.supervisor_started(store)
    stopping: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        stopping.append(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    standby = _Standby([sys.executable, "-m", "hybridsync.backends.ps.server", *child_args],
                       {**env, envvars.PS_SUPERVISED: "1"})
    restarts = 0
    try:
        while True:
            incarnation = group.latest_incarnation(store, config.index) + 1
            child = standby.take()
            # A job that goes well prints only its servers' own lines: the first start is no news.
            log.log(logging.INFO if incarnation else logging.DEBUG, "supervisor of %s: started it (pid %d, "
                    "incarnation %d)", config.name, child.pid, incarnation)
            code = _watch(child, store, config.index, incarnation, stopping, standby)
            if stopping:
                return 128 + stopping[0]
            if code >= 0:
                if code != 0:
                    _give_up(store, config.index, f"the server exited with status {code} (see its log)")
                elif hosting and not group.wait_all_left(store, timeout_s=leave_timeout_s, supervisors_still_here=1):
                    log.warning("supervisor of %s: not every member left within %.0f s", config.name, leave_timeout_s)
                if not hosting:
                    _quietly(group.supervisor_done, store)
                return code
            if restarts >= max_restarts:
                log.error("supervisor of %s: it died (%s) after %d replacements; giving up (--max-restarts)",
                          config.name, _signal_name(-code), restarts)
                _give_up(store, config.index, f"it died {restarts + 1} times (--max-restarts {max_restarts})")
                return 1
            restarts += 1
            log.warning("supervisor of %s: pid %d died (%s); starting replacement %d", config.name, child.pid,
                        _signal_name(-code), restarts)
    finally:
        standby.close()


class _Standby:
    """The next server process, started ahead and waiting (imports done) until it is needed.

    Importing torch takes seconds, tens of seconds on a busy host; a standby turns a
    replacement's start-up into a join. It starts once the current server has joined (so
    the two do not compete for the CPU at the job's start) and leaves when its supervisor
    closes its stdin (or dies)."""

    def __init__(self, argv: list[str], env: Mapping[str, str]) -> None:
        self._argv, self._env = argv, dict(env)
        self._process: subprocess.Popen | None = None

    def prepare(self) -> None:
        """Start the standby if there is none (or it died)."""
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen([*self._argv, "--standby"], env=self._env, stdin=subprocess.PIPE)

    def take(self) -> subprocess.Popen:
        """The standby, told to serve now (a fresh process if none is ready)."""
        self.prepare()
        process, self._process = self._process, None
        assert process is not None and process.stdin is not None
        process.stdin.write(b"serve\n")
        process.stdin.flush()
        return process

    def close(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            process.stdin.close()  # type: ignore[union-attr]
            process.terminate()  # it may still be importing: do not wait for that
            process.wait(timeout=5.0)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()


def _give_up(store: Any, index: int, why: str) -> None:
    """Tell the workers no replacement is coming (they stop waiting for one)."""
    _quietly(store.set, group.store_key(f"server{index}", "given_up"), why)


def _quietly(operation: Any, *args: Any) -> None:
    try:
        operation(*args)
    except Exception:  # noqa: BLE001 - the store's host is gone: the others find that out themselves
        pass


def _watch(child: subprocess.Popen, store: Any, index: int, incarnation: int, stopping: list[int],
           standby: _Standby) -> int:
    """Wait for ``child`` to end; kill it on a hung verdict, or pass on a stop; prepare the
    standby once it has joined. Its exit status."""
    hung_key = group.store_key(f"server{index}", "hung")
    joined_key = group.store_key("members", group.server_name(index, incarnation))
    prepared = False
    while True:
        try:
            return child.wait(timeout=_POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if stopping:
            _stop(child, stopping[0])
            continue
        try:
            verdict = store.get(hung_key).decode() if store.check([hung_key]) else ""
        except Exception:  # noqa: BLE001 - the store's host is gone: the job is over, the child will see
            verdict = ""
        if verdict == str(incarnation):
            log.warning("a worker found server%d (pid %d) hung: killing it", index, child.pid)
            child.kill()
        if not prepared and _joined(store, joined_key):
            standby.prepare()
            prepared = True


def _joined(store: Any, key: str) -> bool:
    try:
        return store.check([key])
    except Exception:  # noqa: BLE001 - the store's host is gone: no replacement will be needed
        return False


def _stop(child: subprocess.Popen, signum: int) -> None:
    """Pass the launcher's stop on to the child; kill it if it lingers."""
    try:
        child.send_signal(signum)
        child.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        child.kill()
    except ProcessLookupError:
        pass


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
