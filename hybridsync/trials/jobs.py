"""Where trial jobs run: the emulated cluster, or real hosts through ``hybridsync-run``.

A target starts one job (workers plus, if the cluster has them, parameter servers) from
a worker command and stops it, whole, by pid. The trial runner sees only this interface.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from typing import IO, Any, Protocol, Sequence

from hybridsync.cluster.spec import ClusterSpec


class RunningJob(Protocol):
    def exit_codes(self) -> list[int | None]:
        """Each worker process's exit code, ``None`` while it runs."""

    def stop(self) -> None:
        """Stops every process of the job (workers, servers, helpers); safe to call twice."""


class JobTarget(Protocol):
    spec: ClusterSpec

    def start(self, command: Sequence[str], env: dict[str, str], log: IO[str], *, servers: bool = True) -> RunningJob:
        """Starts ``command`` on every worker slot and, with ``servers``, the cluster's parameter
        servers (a job whose strategies route nothing to them leaves them out: servers nobody
        joins wait out their join timeout and fail, loudly, in the job's output), output to ``log``."""


@dataclasses.dataclass
class _EmulatedJob:
    workers: Any
    servers: Any | None

    def exit_codes(self) -> list[int | None]:
        return [proc.poll() for proc in self.workers.processes]

    def pids(self) -> dict[str, list[int]]:
        """Process ids of the job: ``workers`` in rank order, ``servers`` host-major."""
        return {"workers": [proc.pid for proc in self.workers.processes],
                "servers": [proc.pid for proc in self.servers.processes] if self.servers is not None else []}

    def stop(self) -> None:
        for job in (self.workers, self.servers):
            if job is not None:
                job.kill()
                job.stop_helpers()


class EmulatedTarget:
    """Jobs on an emulated cluster (namespaces + shaped links) that lives as long as the target.

    Use as a context manager; needs root. Workers start the way horovodrun's Gloo mode
    starts them, servers on every host (``servers_per_node``). With ``pin_hosts`` (default)
    each host's processes run on that host's share of the cores (``EmulatedCluster``), so
    that every job places its ranks and servers the same way: left to the kernel, the ratio
    of two strategies measured in one job moved 1.6-2.8x from job to job here, pinned
    1.1-1.3x (benchmarks/RESULTS.md, "Job-to-job variation").
    """

    def __init__(self, spec: ClusterSpec, *, pin_hosts: bool = True) -> None:
        self.spec, self.pin_hosts = spec, pin_hosts
        self._cluster: Any = None

    def __enter__(self) -> "EmulatedTarget":
        from hybridsync.cluster import EmulatedCluster
        self._cluster = EmulatedCluster(self.spec, pin_hosts=self.pin_hosts).up()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._cluster.teardown()

    def start(self, command: Sequence[str], env: dict[str, str], log: IO[str], *, servers: bool = True) -> RunningJob:
        from hybridsync.run.emulated import launch_gloo, launch_servers, ps_env
        cluster = self._cluster
        servers = bool(servers and self.spec.servers_per_node)
        server_job = launch_servers(cluster, env=env, stdout=log, stderr=subprocess.STDOUT) if servers else None
        try:
            workers = launch_gloo(cluster, command, env={**(ps_env(cluster) if servers else {}), **env}, stdout=log,
                                  stderr=subprocess.STDOUT)
        except BaseException:
            if server_job is not None:
                server_job.kill()
            raise
        return _EmulatedJob(workers=workers, servers=server_job)


_RANK_EXIT = re.compile(r"^Process (\d+) exit with status code (-?\d+)\.", re.MULTILINE)
"""How horovodrun reports a rank's exit. It goes on waiting for the other ranks, which may be
blocked in a collective with the dead one: the runner must not wait for horovodrun to notice."""


@dataclasses.dataclass
class LineFollower:
    """Reads the complete lines appended to a file since the last call, as processes write it
    (a line still being written waits for the next call; a missing file has no lines yet)."""

    path: str
    offset: int = 0
    """Bytes of the file already returned."""

    def new_lines(self) -> list[str]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        complete = data[:data.rfind(b"\n") + 1]
        self.offset += len(complete)
        return complete.decode("utf-8", errors="replace").splitlines()


@dataclasses.dataclass
class _LauncherJob:
    process: subprocess.Popen[Any]
    log: LineFollower
    _rank_codes: dict[int, int] = dataclasses.field(default_factory=dict)

    def exit_codes(self) -> list[int | None]:
        """The launcher's code, then that of every rank horovodrun reported as exited."""
        reported = _RANK_EXIT.findall("\n".join(self.log.new_lines()))
        self._rank_codes.update({int(rank): int(code) for rank, code in reported})
        return [self.process.poll(), *(self._rank_codes[rank] for rank in sorted(self._rank_codes))]

    def stop(self) -> None:
        from hybridsync.run import procs
        if self.process.poll() is None:
            procs.stop(self.process)


def check_hosts_fit(spec: ClusterSpec, *, hosts: str | None = None, hostfile: str | None = None) -> None:
    """``ValueError`` unless horovodrun, given ``-np spec.num_workers`` and these hosts (``-H`` or
    ``--hostfile``), places the ranks as ``spec`` describes them: ``spec.nodes`` hosts of
    ``spec.workers_per_node`` ranks each.

    The simulator prices the spec's shape, and hierarchical all-reduce needs nodes holding equal
    numbers of ranks (elsewhere every trial of it fails), so hosts that horovodrun fills otherwise
    would be tuned as a cluster they are not: ``-H a:3,b:1`` for a 2 x 2 spec, or ``-H a:4,b:4``,
    on which Horovod's Gloo launcher starts 8 ranks, whatever ``-np`` says."""
    from horovod.runner.common.util.hosts import parse_host_files

    from hybridsync.run.launcher import ranks_per_host
    given = f"-H {hosts}" if hosts is not None else f"--hostfile {hostfile}"
    try:
        per_host = ranks_per_host(hosts if hosts is not None else parse_host_files(hostfile), spec.num_workers,
                                  gloo=True)  # the trial jobs' controller (HostsTarget.start)
    except (OSError, ValueError) as error:
        raise ValueError(f"{given}: cannot place the cluster spec's {spec.num_workers} workers: {error}") from None
    if list(per_host.values()) != [spec.workers_per_node] * spec.nodes:
        placed = ", ".join(f"{count} on {host}" for host, count in per_host.items())
        raise ValueError(f"{given} places {sum(per_host.values())} ranks, {placed} (horovodrun's Gloo launcher "
                         f"fills each host's slots in order), but the cluster spec describes {spec.nodes} nodes x "
                         f"{spec.workers_per_node} workers: give the hosts that shape ({spec.nodes} of "
                         f"{spec.workers_per_node} slots each; a spec's nodes hold equal numbers of workers, "
                         f"as hierarchical all-reduce needs), or a spec that matches them")


class HostsTarget:
    """Jobs on real hosts: ``hybridsync-run -np N (-H HOSTS | --hostfile F) --gloo --num-servers S``.

    ``spec`` describes those hosts (for the trial store and the simulator); its worker
    and server counts size the job. ``hybridsync-run`` places the servers beside the workers.
    """

    def __init__(self, spec: ClusterSpec, *, hosts: str | None = None, hostfile: str | None = None,
                 launcher_args: Sequence[str] = ()) -> None:
        if (hosts is None) == (hostfile is None):
            raise ValueError("give exactly one of hosts (-H) and hostfile (--hostfile)")
        check_hosts_fit(spec, hosts=hosts, hostfile=hostfile)
        self.spec = spec
        self.placement = ["-H", hosts] if hosts is not None else ["--hostfile", str(hostfile)]
        self.launcher_args = list(launcher_args)

    def __enter__(self) -> "HostsTarget":
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def start(self, command: Sequence[str], env: dict[str, str], log: IO[str], *, servers: bool = True) -> RunningJob:
        launcher = os.path.join(os.path.dirname(sys.executable), "hybridsync-run")
        argv = [launcher, "-np", str(self.spec.num_workers), *self.placement, "--gloo",
                "--num-servers", str(self.spec.num_servers if servers else 0), *self.launcher_args, *command]
        from hybridsync.children import die_with_parent
        process = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True, preexec_fn=die_with_parent())
        return _LauncherJob(process=process, log=LineFollower(log.name))
