"""Host-side plumbing of the emulated cluster: ``ip``/``tc`` calls, finding what is left, killing by pid.

Everything here acts only on namespaces whose name starts with a given prefix (``hs-`` for
every cluster, ``hs-<job>-`` for one), so it never touches networking it did not create.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from typing import Sequence

NAMESPACE_PREFIX = "hs-"
"""Every namespace this module creates starts with this; ``leftovers()`` looks for it."""
_IP_TIMEOUT_S = 20.0
NETNS_ETC = "/etc/netns"
"""``ip netns exec NS`` bind-mounts ``/etc/netns/NS/*`` over ``/etc``: our per-host ``hosts`` file."""


def require_root() -> None:
    """Raises ``PermissionError`` unless we are root and ``ip``/``tc`` exist."""
    if os.geteuid() != 0:
        raise PermissionError(
            "the emulated cluster requires root: creating network namespaces, veth links, a "
            "bridge and tc qdiscs needs CAP_SYS_ADMIN and CAP_NET_ADMIN. Run as root (sudo), or "
            "for tests without namespaces use `horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo`."
        )
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"the emulated cluster needs iproute2 and util-linux; not found on PATH: {missing}")


def sh(argv: Sequence[str], *, check: bool = True, timeout: float = _IP_TIMEOUT_S) -> str:
    """Runs a short admin command (``ip``/``tc``) and returns its stdout.

    Raises ``RuntimeError`` with the command and its stderr when ``check`` and it fails.
    """
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout


def list_namespaces(prefix: str = NAMESPACE_PREFIX) -> list[str]:
    """Names of the network namespaces whose name starts with ``prefix``."""
    names = [line.split()[0] for line in sh(["ip", "netns", "list"]).splitlines() if line.strip()]
    return sorted(name for name in names if name.startswith(prefix))


def namespace_pids(namespace: str) -> list[int]:
    """Pids of every process living in a network namespace (empty if it is gone)."""
    out = sh(["ip", "netns", "pids", namespace], check=False)
    return [int(token) for token in out.split() if token.isdigit()]


def leftovers(prefix: str = NAMESPACE_PREFIX) -> list[str]:
    """Everything with our prefix still present: namespaces, root-namespace links, processes.

    Tests assert this is empty after teardown; pass a cluster's own ``prefix`` to ignore
    clusters that other tests run concurrently.
    """
    found = [f"netns {name}" for name in list_namespaces(prefix)]
    for line in sh(["ip", "-o", "link", "show"]).splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(prefix):
            found.append(f"link {name}")
    for name in list_namespaces(prefix):
        found += [f"pid {pid} in {name}" for pid in namespace_pids(name)]
    if os.path.isdir(NETNS_ETC):
        found += [f"dir {NETNS_ETC}/{name}" for name in sorted(os.listdir(NETNS_ETC)) if name.startswith(prefix)]
    return found


def kill_pids(pids: Sequence[int], *, grace_s: float = 3.0, groups: bool = False) -> None:
    """SIGTERM each pid, wait up to ``grace_s`` for all to exit, then SIGKILL the rest.

    With ``groups``, each pid also names a process group (a process started with
    ``start_new_session``), and the whole group is signalled along with it.
    """
    if groups:
        for pid in pids:
            _signal(-pid, signal.SIGTERM)
    alive = [pid for pid in pids if _signal(pid, signal.SIGTERM)]
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if _exists(pid)]
    for pid in alive:
        _signal(-pid if groups else pid, signal.SIGKILL)
        _signal(pid, signal.SIGKILL)


def remove_leftovers(prefix: str = NAMESPACE_PREFIX) -> list[str]:
    """Kills processes in, and deletes, every namespace with ``prefix``; returns what it removed.

    This is ``hybridsync cluster down``: the cleanup after a launcher that was SIGKILLed.
    """
    names = list_namespaces(prefix)
    if os.path.isdir(NETNS_ETC):  # also configs whose namespace is already gone
        names += [n for n in os.listdir(NETNS_ETC) if n.startswith(prefix) and n not in names]
    for name in names:
        kill_pids(namespace_pids(name))
    for name in names:
        delete_namespace(name)
    return names


def _signal(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _exists(pid: int) -> bool:
    """Whether ``pid`` is alive; zombies count as dead (their parent reaps them later)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().split(") ")[-1][:1] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def delete_namespace(name: str) -> None:
    """Kills what lives in namespace ``name``, deletes it and its ``/etc/netns`` config."""
    # Kill stragglers first: a namespace with live processes outlives `ip netns del`
    # anonymously, keeping its veth and qdiscs until they exit.
    kill_pids(namespace_pids(name), grace_s=1.0)
    sh(["ip", "netns", "del", name], check=False)
    shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
