"""``EmulatedCluster``: a multi-node cluster on one machine, built from network namespaces.

Topology (all of it outside the root namespace, so nothing leaks into host networking)::

    hs-<job>-n0 [lo, eth0 10.77.0.1] --veth-- n0 |
    hs-<job>-n1 [lo, eth0 10.77.0.2] --veth-- n1 |-- br0   (in namespace hs-<job>-sw)
    ...                                          |

Every veth end carries a ``tbf`` qdisc at the uplink rate, so host-to-switch and
switch-to-host traffic are each limited (both directions of a host's uplink). Ranks on the
same host reach each other's ``eth0`` address through that host's loopback (unshaped, fast).
The 10.77.0.0/24 subnet exists only inside these namespaces, so concurrent clusters never
collide and no traffic can reach anything but namespaces this module created.

Teardown is idempotent and runs from ``__exit__``, ``atexit`` and SIGTERM/SIGINT handlers:
it kills every process started here (and anything else still inside our namespaces) by pid,
then deletes the namespaces, which takes the veths, bridge and qdiscs with them.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import uuid
from typing import Any, Mapping, Sequence

from hybridsync import envvars
from hybridsync.children import die_with_parent
from hybridsync.cluster.hostops import (  # re-exported: the cluster API in one place
    NAMESPACE_PREFIX,
    NETNS_ETC,
    delete_namespace,
    kill_pids,
    leftovers,
    list_namespaces,
    namespace_pids,
    remove_leftovers,
    require_root,
    sh,
)
from hybridsync.cluster.spec import SUBNET_MASK_BITS, ClusterSpec

__all__ = ["EmulatedCluster", "NODE_IFACE", "NAMESPACE_PREFIX", "check_can_emulate", "check_fits_machine", "host_cpus", "kill_pids",
           "leftovers", "list_namespaces", "namespace_pids", "remove_leftovers", "require_root", "sh", "tbf_args"]

NODE_IFACE = "eth0"
"""The uplink's name inside each node namespace (what ``HOROVOD_GLOO_IFACE`` names)."""
DEFAULT_PROCESSES_PER_CORE = 8
"""Ranks and servers per core an emulated cluster may hold by default: the largest spec here is
4 x 4 ranks on 2 cores, and at 8 per core a step is already mostly waiting for a core."""


def tbf_args(bits_per_second: int) -> list[str]:
    """``tc`` arguments of a token bucket shaping one direction of a link to ``bits_per_second``.

    burst: 2 ms of tokens (>= 64 KiB so a veth GSO super-packet fits without being split);
    limit: ~20 ms of queue (>= 4 bursts) so one TCP flow can fill the link without
    bufferbloat dominating the RTT.
    """
    bytes_per_second = bits_per_second / 8
    burst = max(64 * 1024, int(bytes_per_second * 0.002))
    limit = max(4 * burst, int(bytes_per_second * 0.020))
    return ["tbf", "rate", f"{bits_per_second}bit", "burst", str(burst), "limit", str(limit)]


def host_cpus(node: int, nodes: int, cpus: Sequence[int]) -> tuple[int, ...]:
    """The cores emulated host ``node`` (of ``nodes``) gets out of ``cpus``: an equal share of
    them, or, with more hosts than cores, one core, shared round-robin."""
    cpus = sorted(cpus)
    if nodes >= len(cpus):
        return (cpus[node % len(cpus)],)
    share = len(cpus) // nodes
    return tuple(cpus[node * share:(node + 1) * share])


def check_fits_machine(spec: ClusterSpec, cores: int) -> None:
    """``ValueError`` if ``spec``'s ranks and servers exceed ``HYBRIDSYNC_EMULATED_PROCESSES_PER_CORE``
    (default ``DEFAULT_PROCESSES_PER_CORE``) per core of the ``cores`` this process may use."""
    per_core = envvars.int_from_env(envvars.EMULATED_PROCESSES_PER_CORE, DEFAULT_PROCESSES_PER_CORE, 0)
    processes = spec.num_workers + spec.num_servers
    if per_core and processes > per_core * cores:
        raise ValueError(
            f"an emulated cluster of {processes} processes ({spec.nodes} nodes x ({spec.workers_per_node} workers "
            f"+ {spec.servers_per_node} servers)) on {cores} cores is over {per_core} per core: its step times "
            f"would measure the cores, not the links. Emulate a smaller cluster (the search and the simulator "
            f"take the full spec), or set {envvars.EMULATED_PROCESSES_PER_CORE} higher (0: no bound)")


NETEM_MISSING = ("inter_node_latency_ms > 0 needs the kernel's netem qdisc (CONFIG_NET_SCH_NETEM), which this "
                 "kernel lacks; set inter_node_latency_ms: 0")


def check_can_emulate(spec: ClusterSpec) -> None:
    """``ValueError`` naming what would stop ``spec`` from being emulated on this machine, checked in
    well under a second, before anything slow (a profile, minutes of trials) runs: root and iproute2,
    the spec's size against this machine's cores (``check_fits_machine``), and, when the spec adds
    latency, the kernel's netem qdisc. Before, a spec with latency on a kernel without netem was
    refused only when the cluster was built, after the profile (19 s)."""
    try:
        require_root()
    except (PermissionError, RuntimeError) as error:
        raise ValueError(str(error)) from error
    check_fits_machine(spec, len(os.sched_getaffinity(0)))
    if spec.inter_node_latency_ms > 0 and not netem_available():
        raise ValueError(NETEM_MISSING)


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc: tried on the loopback of a namespace of our own (its
    name has ``NAMESPACE_PREFIX``, so ``remove_leftovers`` finds it should this process die in between)."""
    probe = f"{NAMESPACE_PREFIX}netem-{os.getpid()}"
    sh(["ip", "netns", "add", probe])
    try:
        _add_netem(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "handle", "1:"], 1.0)
        return True
    except RuntimeError as error:
        if str(error) == NETEM_MISSING:
            return False
        raise
    finally:
        delete_namespace(probe)


def _add_netem(tc_add: Sequence[str], delay_ms: float) -> None:
    """``tc_add`` a netem qdisc of ``delay_ms``; ``NETEM_MISSING`` where the kernel has none."""
    try:
        sh([*tc_add, "netem", "delay", f"{delay_ms}ms", "limit", "100000"])
    except RuntimeError as error:
        if "unknown" in str(error).lower():
            raise RuntimeError(NETEM_MISSING) from error
        raise


class EmulatedCluster:
    """A cluster of ``spec.nodes`` hosts as namespaces behind a shaped bridge.

    Use as a context manager (``with EmulatedCluster(spec) as cluster:``) or call
    ``up()``/``teardown()``. ``run()`` starts a process on a host; the returned ``Popen``
    is tracked and killed at teardown. With ``pin_hosts`` every process ``run()`` starts on
    host i is pinned (``taskset``) to that host's share of this machine's cores (``host_cpus``),
    as a real host has cores of its own: then every job places its processes the same way.
    """

    def __init__(self, spec: ClusterSpec, *, job_id: str | None = None, pin_hosts: bool = False) -> None:
        """``ValueError`` if the spec holds more processes than this machine can run as a cluster
        (``check_fits_machine``)."""
        cores = sorted(os.sched_getaffinity(0))
        check_fits_machine(spec, len(cores))
        self.spec = spec
        self.cpus: tuple[tuple[int, ...], ...] | None = (
            tuple(host_cpus(i, spec.nodes, cores) for i in range(spec.nodes)) if pin_hosts else None)
        """The cores of each host (``pin_hosts``), or ``None``: the kernel places every process."""
        self.job_id = job_id or uuid.uuid4().hex[:6]
        if not re.fullmatch(r"[a-z0-9]{1,12}", self.job_id):
            raise ValueError(f"job_id must be 1-12 lowercase letters or digits, got {self.job_id!r}")
        self.prefix = f"{NAMESPACE_PREFIX}{self.job_id}-"
        """Prefix of every namespace of this cluster (``leftovers(cluster.prefix)``)."""
        self.switch_namespace = f"{self.prefix}sw"
        self.namespaces: tuple[str, ...] = tuple(f"{self.prefix}n{i}" for i in range(spec.nodes))
        self.ips: tuple[str, ...] = spec.node_ips
        self.hostnames: tuple[str, ...] = tuple(f"n{i}" for i in range(spec.nodes))
        """What ``hostname`` says on each host; each resolves to its host's address."""
        self._processes: list[subprocess.Popen[Any]] = []
        self._cleanups: list[Any] = []
        self._created: list[str] = []
        self._workdir: str | None = None
        self._state = "new"  # new -> up -> closing -> closed
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        return self.up()

    def __exit__(self, *exc_info: object) -> None:
        self.teardown()

    def up(self) -> "EmulatedCluster":
        """Creates the namespaces, links and qdiscs; on any failure tears down and re-raises."""
        require_root()
        if self._state != "new":
            raise RuntimeError(f"cluster {self.job_id} is {self._state}; a cluster comes up once")
        self._state = "up"
        _registry.add(self)
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def teardown(self) -> None:
        """Kills every process started here, then deletes the namespaces. Safe to call twice."""
        with self._lock:
            if self._state in ("closing", "closed"):
                return
            self._state = "closing"
        try:
            # Our processes lead their own sessions: signal each group, then the stragglers
            # that still live in our namespaces (e.g. what mpirun started via the ssh shim).
            kill_pids([proc.pid for proc in self._processes if proc.poll() is None], groups=True)
            kill_pids(sorted({pid for name in self._created for pid in namespace_pids(name)}))
            for proc in self._processes:
                _wait_quietly(proc)
            for cleanup in reversed(self._cleanups):
                try:
                    cleanup()
                except Exception:  # noqa: BLE001 - teardown goes on; the namespaces must still go
                    pass
            for name in reversed(self._created):
                delete_namespace(name)
            if self._workdir is not None:
                shutil.rmtree(self._workdir, ignore_errors=True)
        finally:
            self._state = "closed"
            _registry.discard(self)

    def add_cleanup(self, cleanup: Any) -> None:
        """Run ``cleanup()`` at teardown, after the processes are gone and before the namespaces
        (e.g. removing a straggler's cgroup: ``hybridsync.cluster.stragglers``)."""
        self._cleanups.append(cleanup)

    def detach(self) -> None:
        """Leaves the cluster up past this process (no teardown at exit); ``remove_leftovers``
        with ``self.prefix`` removes it later."""
        with self._lock:
            self._state = "closed"
        _registry.discard(self)

    # -- building --------------------------------------------------------------------------
    def _add_namespace(self, name: str) -> None:
        sh(["ip", "netns", "add", name])
        self._created.append(name)
        sh(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        switch = self.switch_namespace
        self._add_namespace(switch)
        sh(["ip", "-n", switch, "link", "add", "br0", "type", "bridge"])
        sh(["ip", "-n", switch, "link", "set", "br0", "up"])
        for index, (name, ip) in enumerate(zip(self.namespaces, self.ips)):
            port = f"n{index}"
            self._add_namespace(name)
            # Both veth ends are born inside our namespaces: nothing appears in the root one.
            sh(["ip", "-n", name, "link", "add", NODE_IFACE, "type", "veth",
                "peer", "name", port, "netns", switch])
            sh(["ip", "-n", name, "addr", "add", f"{ip}/{SUBNET_MASK_BITS}", "dev", NODE_IFACE])
            sh(["ip", "-n", switch, "link", "set", port, "master", "br0"])
            self._shape(name, NODE_IFACE)
            self._shape(switch, port)
            sh(["ip", "-n", name, "link", "set", NODE_IFACE, "up"])
            sh(["ip", "-n", switch, "link", "set", port, "up"])
            self._write_hosts_file(index)

    def _write_hosts_file(self, index: int) -> None:
        """Gives host ``index`` its own ``/etc/hosts``, where every ``n<i>`` names its host.

        Code that finds its own address by resolving ``gethostname()`` then gets the node's
        address instead of 127.0.0.1 (Horovod 0.28's Gloo process sets do exactly that: they
        ignore ``HOROVOD_GLOO_IFACE``). The machine's own hostname also maps to this host.

        Every IPv4 address is also listed in its IPv4-mapped IPv6 form (``::ffff:a.b.c.d``):
        torch's ``TCPStore`` clients (our hierarchical groups, the PS route's RPC rendezvous)
        connect over an IPv6 socket to the mapped address and reverse-resolve it; glibc looks
        that form up in this file or asks DNS, and no DNS server is reachable from here, so
        without these lines every client prints ``[c10d] The hostname of the client socket
        cannot be retrieved. err=-3`` (EAI_AGAIN).
        """
        directory = os.path.join(NETNS_ETC, self.namespaces[index])
        os.makedirs(directory, exist_ok=True)
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback", "::ffff:127.0.0.1 localhost"]
        for other, ip in enumerate(self.ips):
            names = self.hostnames[other] + (f" {socket.gethostname()}" if other == index else "")
            lines += [f"{ip} {names}", f"::ffff:{ip} {names}"]
        with open(os.path.join(directory, "hosts"), "w", encoding="ascii") as handle:
            handle.write("\n".join(lines) + "\n")

    def _shape(self, namespace: str, device: str) -> None:
        """Limits ``device``'s egress to the uplink rate, plus half the one-way latency."""
        rate = tbf_args(self.spec.inter_node_bits_per_second)
        delay_ms = self.spec.inter_node_latency_ms / 2
        tc = ["tc", "-n", namespace, "qdisc", "add", "dev", device]
        if delay_ms <= 0:
            sh([*tc, "root", "handle", "1:", *rate])
            return
        _add_netem([*tc, "root", "handle", "1:"], delay_ms)  # netem delays, then tbf (its child) paces: tc-netem(8)
        sh([*tc, "parent", "1:1", "handle", "10:", *rate])

    # -- running processes -----------------------------------------------------------------
    def set_uplink(self, node_index: int, up: bool) -> None:
        """Cuts (``up=False``) or restores host ``node_index``'s link to the switch, by setting its
        switch port down or up: the fault of a cable or switch port between the nodes. Traffic within
        the host (its loopback) goes on; open connections across the link stall, as on a real cut."""
        sh(["ip", "-n", self.switch_namespace, "link", "set", f"n{node_index}", "up" if up else "down"])

    def namespace_of(self, node_index: int) -> str:
        """The namespace of host ``node_index``, validating the index."""
        if not 0 <= node_index < self.spec.nodes:
            raise ValueError(f"node_index must be in [0, {self.spec.nodes}), got {node_index}")
        return self.namespaces[node_index]

    def enter_argv(self, node_index: int) -> list[str]:
        """The prefix that runs a command on host ``node_index``: its cores (``pin_hosts``), its
        network namespace and a fresh UTS namespace whose hostname is ``n<i>``.

        Own hostnames keep tools that key state on the hostname apart (Open MPI's session
        directories and shared-memory segments collide, and crash, when all hosts say "vm").
        """
        namespace = self.namespace_of(node_index)
        pin = ["taskset", "-c", ",".join(map(str, self.cpus[node_index]))] if self.cpus is not None else []
        return [*pin, "ip", "netns", "exec", namespace, "unshare", "--uts",
                "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh", self.hostnames[node_index]]

    def run(
        self,
        node_index: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        **popen_kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Starts ``argv`` on host ``node_index`` (``ip netns exec``) and tracks it for teardown.

        ``env`` replaces the environment (default: ours). The process leads its own session,
        so a signal from the terminal reaches us, not it, and teardown decides its end; if
        this process dies without a teardown (SIGKILL), the kernel sends it SIGTERM
        (``hybridsync.children.die_with_parent``: ``ip netns exec``, ``unshare`` and ``sh``
        exec in turn, so the command itself gets it). The namespaces stay: ``hybridsync
        cluster down``.
        Teardown closes its pipes: read them before leaving the ``with`` block.
        """
        if self._state != "up":
            raise RuntimeError(f"cluster {self.job_id} is {self._state}, not up")
        command = [*self.enter_argv(node_index), *argv]
        proc = subprocess.Popen(
            command, env=dict(env) if env is not None else None, start_new_session=True,
            preexec_fn=die_with_parent(), **popen_kwargs
        )
        self._processes.append(proc)
        return proc

    def exec(
        self,
        node_index: int,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``argv`` on a host to completion within ``timeout`` s, capturing text output.

        On timeout the process is killed and ``subprocess.TimeoutExpired`` is raised.
        """
        proc = self.run(node_index, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_pids([proc.pid], grace_s=1.0, groups=True)
            _wait_quietly(proc)
            raise
        result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        if check:
            result.check_returncode()
        return result

    @property
    def workdir(self) -> str:
        """A private scratch directory (helper scripts, rank logs), removed at teardown."""
        if self._workdir is None:
            self._workdir = tempfile.mkdtemp(prefix=self.prefix)
        return self._workdir

    @property
    def processes(self) -> tuple[subprocess.Popen[Any], ...]:
        """Every process started through ``run``, in order."""
        return tuple(self._processes)

    @property
    def is_up(self) -> bool:
        """Whether the namespaces exist and ``run`` may be called."""
        return self._state == "up"

    @property
    def is_closing(self) -> bool:
        """Whether a teardown is in progress."""
        return self._state == "closing"


def _wait_quietly(proc: subprocess.Popen[Any], timeout: float = 2.0) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


class _Registry:
    """Live clusters, torn down at exit and on SIGTERM/SIGINT (then the signal proceeds)."""

    def __init__(self) -> None:
        self._clusters: set[EmulatedCluster] = set()
        self._previous: dict[int, Any] = {}
        self._atexit_registered = False

    def add(self, cluster: EmulatedCluster) -> None:
        self._clusters.add(cluster)
        if not self._atexit_registered:
            atexit.register(self.teardown_all)
            self._atexit_registered = True
        if threading.current_thread() is threading.main_thread() and not self._previous:
            for signum in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(signum) != signal.SIG_IGN:  # respect nohup and background jobs
                    self._previous[signum] = signal.signal(signum, self._on_signal)

    def discard(self, cluster: EmulatedCluster) -> None:
        self._clusters.discard(cluster)
        if not self._clusters:
            self._restore_handlers()

    def teardown_all(self) -> None:
        for cluster in list(self._clusters):
            cluster.teardown()

    def _restore_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        if any(cluster.is_closing for cluster in self._clusters):
            return  # a teardown is running on this thread right now; let it finish
        self.teardown_all()
        self._restore_handlers()
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(128 + signum)


_registry = _Registry()
