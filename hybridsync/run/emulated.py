"""Starting Horovod jobs across the hosts of an ``EmulatedCluster``.

Three ways to start ranks, all ending in ``local_size == workers_per_node`` and
``cross_size == nodes`` (plus ``launch_servers`` for parameter-server processes):

- ``launch_gloo``: starts every rank itself with the environment horovodrun's Gloo mode
  sets (``horovod/runner/gloo_run.py``), against a ``RendezvousServer`` running on host 0.
- ``mpirun_argv`` / ``launch_mpirun``: Open MPI's ``mpirun`` on host 0, reaching the other
  hosts through an ssh stand-in script (``--mca plm_rsh_agent``).
- ``launch_horovodrun``: the real ``horovodrun`` on host 0, with the same stand-in on
  ``PATH`` as ``ssh``; ``launch_horovodrun_elastic`` the same in elastic mode.

Host names are the nodes' addresses (``10.77.0.1`` ...), which is what both launchers need
to tell the local host from remote ones inside a namespace.
"""
from __future__ import annotations

import dataclasses
import os
import select
import subprocess
import sys
import time
from typing import Any, Mapping, Sequence

from hybridsync import envvars
from hybridsync.cluster.netns import NODE_IFACE, EmulatedCluster, kill_pids
from hybridsync.run.ps_servers import ps_environment, server_command, server_environment

_RENDEZVOUS_START_TIMEOUT_S = 30.0
DEFAULT_PS_ROOT_PORT = 9000
_REAP_TIMEOUT_S = 1.0


@dataclasses.dataclass(kw_only=True)
class Job:
    """Processes of one launched job; ``wait`` bounds them all and kills by pid."""

    processes: list[subprocess.Popen[Any]]
    """The ranks (Gloo) or the single launcher process (mpirun, horovodrun)."""
    helpers: list[subprocess.Popen[Any]] = dataclasses.field(default_factory=list)
    """Processes that live as long as the job (the rendezvous server); stopped by ``wait``."""

    def wait(self, timeout: float) -> list[int]:
        """Waits for every process and returns their exit codes, in rank order.

        Like horovodrun, the first failure terminates the remaining processes. On timeout
        everything is killed and ``TimeoutError`` is raised.
        """
        deadline = time.monotonic() + timeout
        try:
            while any(proc.poll() is None for proc in self.processes):
                if any(proc.poll() not in (None, 0) for proc in self.processes):
                    self.kill()
                    break
                if time.monotonic() > deadline:
                    self.kill()
                    raise TimeoutError(f"job did not finish within {timeout} s; killed")
                time.sleep(0.05)
            return [proc.wait(timeout=5) for proc in self.processes]
        finally:
            self.stop_helpers()

    def kill(self) -> None:
        """SIGTERM, then SIGKILL, every process still running (by pid), and reaps them: the cluster
        keeps every ``Popen`` until its teardown, so a killed process nobody waits for stays a
        zombie that long (an autotune's trial jobs left 4-8 per job)."""
        kill_pids([proc.pid for proc in self.processes if proc.poll() is None], grace_s=2.0, groups=True)
        for proc in self.processes:
            try:
                proc.wait(timeout=_REAP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass  # SIGKILLed in uninterruptible sleep: the teardown reaps it

    def stop_helpers(self) -> None:
        """Closes the helpers' stdin (their signal to exit), then kills any that linger."""
        for helper in self.helpers:
            if helper.stdin is not None and not helper.stdin.closed:
                helper.stdin.close()
        for helper in self.helpers:
            try:
                helper.wait(timeout=3)
            except subprocess.TimeoutExpired:
                kill_pids([helper.pid], grace_s=1.0)


EMULATION_ENV = {envvars.WAIT: "sleep"}
"""Every rank on the emulated cluster: its hosts share a few cores, so waiting ranks must
sleep, not spin (``hybridsync.backends.waiting``). ``env`` arguments may override it."""


def gloo_rank_env(slot: Any, *, server_ip: str, port: int) -> dict[str, str]:
    """The variables horovodrun's Gloo mode gives one rank (``create_slot_env_vars`` and
    ``create_run_env_vars`` in ``horovod/runner/gloo_run.py``)."""
    return {
        "HOROVOD_HOSTNAME": str(slot.hostname),
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": server_ip,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": NODE_IFACE,
        "NCCL_SOCKET_IFNAME": NODE_IFACE,
        "PYTHONUNBUFFERED": "1",
    }


def start_rendezvous(cluster: EmulatedCluster, *, num_proc: int, node_index: int = 0) -> tuple[subprocess.Popen[Any], int]:
    """Starts Horovod's rendezvous server on a host; returns the process and its port."""
    proc = cluster.run(
        node_index,
        [sys.executable, "-m", "hybridsync.run.rendezvous", cluster.spec.horovod_hosts, str(num_proc)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], _RENDEZVOUS_START_TIMEOUT_S)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("port "):
        kill_pids([proc.pid], grace_s=1.0)
        raise RuntimeError(f"rendezvous server on host {node_index} did not start (got {line!r})")
    return proc, int(line.split()[1])


def launch_gloo(
    cluster: EmulatedCluster,
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    num_proc: int | None = None,
    **popen_kwargs: Any,
) -> Job:
    """Starts ``num_proc`` (default: all slots) Horovod Gloo ranks of ``command`` across the hosts.

    Ranks are placed the way horovodrun places them (fill host 0, then host 1, ...). Each
    gets our environment, then ``env``, then the Horovod variables.
    """
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    num_proc = num_proc or cluster.spec.num_workers
    plan = get_host_assignments(parse_hosts(cluster.spec.horovod_hosts), num_proc, num_proc)
    rendezvous, port = start_rendezvous(cluster, num_proc=num_proc)
    job = Job(processes=[], helpers=[rendezvous])
    try:
        for slot in plan:
            rank_env = {**os.environ, **EMULATION_ENV, **(env or {}),
                        **gloo_rank_env(slot, server_ip=cluster.ips[0], port=port)}
            node = cluster.ips.index(slot.hostname)
            job.processes.append(cluster.run(node, list(command), env=rank_env, **popen_kwargs))
    except BaseException:
        job.kill()
        job.stop_helpers()
        raise
    return job


def ps_env(cluster: EmulatedCluster, *, root_port: int = DEFAULT_PS_ROOT_PORT) -> dict[str, str]:
    """BytePS's launch vocabulary shared by servers and workers: counts and server 0's address.

    Server 0 runs on host 0; any fixed port is safe, since each cluster has its own namespaces.
    PS traffic is kept on TCP, so that it crosses the shaped links like the collectives' does.
    """
    return {envvars.PS_TRANSPORT: "tcp",
            **ps_environment(num_workers=cluster.spec.num_workers, num_servers=cluster.spec.num_servers,
                             root_uri=cluster.ips[0], root_port=root_port)}


def launch_servers(
    cluster: EmulatedCluster,
    command: Sequence[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    **popen_kwargs: Any,
) -> Job:
    """Starts ``servers_per_node`` parameter servers (``command``, default hybridsync's) on every host.

    Each gets ``ps_env`` (``env`` may override it, e.g. ``DMLC_PS_ROOT_PORT``), then
    ``DMLC_ROLE=server``, ``DMLC_SERVER_ID`` (host-major: host 0 has servers 0..k-1) and
    ``DMLC_NODE_HOST`` (its own address).
    """
    spec = cluster.spec
    argv = list(command) if command is not None else server_command()
    job = Job(processes=[])
    for node in range(spec.nodes):
        for slot in range(spec.servers_per_node):
            server_env = {**os.environ, **ps_env(cluster), **(env or {}), "PYTHONUNBUFFERED": "1",
                          **server_environment(node * spec.servers_per_node + slot, host=cluster.ips[node])}
            job.processes.append(cluster.run(node, argv, env=server_env, **popen_kwargs))
    return job


def write_remote_shell(cluster: EmulatedCluster, directory: str) -> str:
    """Writes ``DIRECTORY/ssh``: an ssh stand-in that runs its command in a host's namespace.

    It accepts ssh's calling convention (options, ``[user@]host``, command words joined
    into one shell command), so it serves as Open MPI's ``plm_rsh_agent`` and, first on
    ``PATH``, as horovodrun's ``ssh``. Hosts are known by address, ``n<i>`` or namespace.
    """
    cases = "\n".join(
        f"  {ip}|{name}|{ns}) ns={ns} name={name} ;;"
        for ip, name, ns in zip(cluster.ips, cluster.hostnames, cluster.namespaces)
    )
    script = f"""#!/bin/sh
# ssh stand-in for emulated cluster {cluster.job_id}
host=""
while [ $# -gt 0 ]; do  # like ssh, accept options before and after the host
  case "$1" in
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;  # ssh options that take a value
    -*) shift ;;
    *) if [ -n "$host" ]; then break; fi; host="${{1#*@}}"; shift ;;
  esac
done
case "$host" in
{cases}
  *) echo "ssh stand-in: unknown host $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$1" && exec sh -c "$2"' sh "$name" "$*"
"""
    path = os.path.join(directory, "ssh")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(script)
    os.chmod(path, 0o755)
    return path


def mpirun_argv(
    cluster: EmulatedCluster, command: Sequence[str], *, agent: str, env_names: Sequence[str] = ()
) -> list[str]:
    """The ``mpirun`` command line (to run on host 0) for all slots of the cluster.

    ``env_names`` are exported to every rank with ``-x``. Open MPI's out-of-band and TCP
    transports are pinned to the uplink; same-host ranks still use shared memory.
    """
    exported = ["PATH", "PYTHONPATH", "HOROVOD_GLOO_IFACE", *env_names]
    argv = [
        "mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
        "-np", str(cluster.spec.num_workers), "-H", cluster.spec.horovod_hosts,
        "--mca", "plm_rsh_agent", agent,
        "--mca", "oob_tcp_if_include", NODE_IFACE, "--mca", "btl_tcp_if_include", NODE_IFACE,
    ]
    for name in dict.fromkeys(exported):
        if name in os.environ or name in env_names or name == "HOROVOD_GLOO_IFACE":
            argv += ["-x", name]
    return [*argv, *command]


def launch_mpirun(
    cluster: EmulatedCluster,
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    **popen_kwargs: Any,
) -> Job:
    """Runs ``command`` on every slot through ``mpirun`` started on host 0."""
    agent = write_remote_shell(cluster, cluster.workdir)
    run_env = {**os.environ, **EMULATION_ENV, **(env or {}), "HOROVOD_GLOO_IFACE": NODE_IFACE}
    argv = mpirun_argv(cluster, command, agent=agent, env_names=sorted({**EMULATION_ENV, **(env or {})}))
    return Job(processes=[cluster.run(0, argv, env=run_env, **popen_kwargs)])


def launch_horovodrun(
    cluster: EmulatedCluster,
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    horovodrun_args: Sequence[str] = ("--gloo",),
    **popen_kwargs: Any,
) -> Job:
    """Runs the real ``horovodrun -np N -H <hosts>`` on host 0, with our ssh stand-in on PATH."""
    argv = [
        _horovodrun(), "-np", str(cluster.spec.num_workers), "-H", cluster.spec.horovod_hosts,
        "--network-interfaces", NODE_IFACE,  # skips horovodrun's ~10 s interface discovery
        *horovodrun_args, *command,
    ]
    return Job(processes=[cluster.run(0, argv, env=_horovodrun_env(cluster, env), **popen_kwargs)])


def launch_horovodrun_elastic(
    cluster: EmulatedCluster,
    command: Sequence[str],
    *,
    discovery_script: str,
    num_proc: int,
    max_proc: int | None = None,
    min_proc: int = 1,
    env: Mapping[str, str] | None = None,
    horovodrun_args: Sequence[str] = (),
    **popen_kwargs: Any,
) -> Job:
    """Runs the real ``horovodrun`` in elastic mode on host 0 (``--min-np``/``--max-np``, hosts from
    ``discovery_script``, which prints ``<node address>:<slots>`` lines), with the ssh stand-in on PATH.

    ``--network-interface`` is the hosts' uplink, so horovodrun needs no second host to look
    for a common interface. When the job starts the script must list a host other than host 0:
    with only its own host, horovodrun 0.28.1 looks for an interface holding 127.0.0.1 among the
    ones given and fails (docs/guides/elastic.md).
    """
    argv = [
        _horovodrun(), "-np", str(num_proc), "--min-np", str(min_proc), "--max-np", str(max_proc or num_proc),
        "--host-discovery-script", discovery_script, "--network-interface", NODE_IFACE,
        *horovodrun_args, *command,
    ]
    return Job(processes=[cluster.run(0, argv, env=_horovodrun_env(cluster, env), **popen_kwargs)])


def _horovodrun() -> str:
    return os.path.join(os.path.dirname(sys.executable), "horovodrun")


def _horovodrun_env(cluster: EmulatedCluster, env: Mapping[str, str] | None) -> dict[str, str]:
    """Our environment, ``EMULATION_ENV``, ``env``, and ``PATH`` with the ssh stand-in first."""
    directory = cluster.workdir
    write_remote_shell(cluster, directory)
    path = os.pathsep.join([directory, os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return {**os.environ, **EMULATION_ENV, **(env or {}), "PATH": path}
