"""``hybridsync-run``: horovodrun plus what hybridsync needs around it.

    hybridsync-run [hybridsync and horovodrun flags, in any order] command...
    hybridsync-run -np 2 -H localhost:2 --num-servers 2 --strategy s.json python train.py
    hybridsync-run --autotune --cluster spec.yaml -np 4 python train.py   # hybridsync.autotune.launch

hybridsync's own flags may stand anywhere before the command; every other word goes to
horovodrun unchanged, in order, and everything from the command on is the command's.
With horovodrun's ``--config-file``, the file's ``hybridsync:`` section (``strategy``,
relative to the file, ``num_servers``, ``partition_bytes``) supplies what the command line
does not set; the flags win. The launcher sets ``HYBRIDSYNC_STRATEGY`` for every rank, starts K
parameter servers (BytePS's ``DMLC_*`` settings) beside the workers when the strategy
routes anything through the PS, each under a supervisor that replaces it if it dies or
hangs (``hybridsync-server --supervise``), and stops them when the job ends, however it ends.

An elastic job (horovodrun's ``--min-np``/``--max-np``/``--host-discovery-script``) gets no
servers (its PS variables go by ring all-reduce, ``hybridsync.world``), a discovery script
that cannot run is an error at once, and a job without ``--network-interface`` is told why
it may wait for a second host.

Where the servers run: on the hosts of ``--server-hosts`` (one server per entry), else
colocated with the workers, round-robin over the job's hosts (``-H``/``--hostfile``), else
on this host. Servers on this host alone are plain child processes; otherwise a second
horovodrun (Gloo mode, the job's ssh settings) starts them, so they reach other hosts
exactly as the workers do.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Mapping, Sequence

from hybridsync import envvars
from hybridsync.run import procs
from hybridsync.run.horovodrun import horovodrun_command
from hybridsync.run.ps_servers import any_worker_joined, ps_environment, server_command, server_environment
from hybridsync.strategy import Strategy

_OWN_FLAGS = ("--strategy", "--num-servers", "--server-hosts", "--partition-bytes", "--ps-root-port",
              "--trial-budget", "--store", "--cluster", "--autotune-report")
"""hybridsync-run's own flags that take one value (``--flag V`` or ``--flag=V``), spelled in full."""
_OWN_SWITCHES = ("--autotune",)
"""hybridsync-run's own flags without a value. ``--autotune`` is hybridsync's autotuner; Horovod's
own stays reachable through the config file's ``autotune:`` section or ``HOROVOD_AUTOTUNE=1``."""

# horovodrun 0.28.1's options (horovod/runner/launch.py) -> how many values each takes. Only
# the arity matters here: it tells a flag's value from the first word of the command.
# tests/test_launcher.py checks this table against horovodrun's own parser.
_HOROVODRUN_ARITY: dict[str, int] = {
    **dict.fromkeys((
        "-np", "--num-proc", "--start-timeout", "--network-interfaces", "--network-interface",
        "--output-filename", "--config-file", "-p", "--ssh-port", "-i", "--ssh-identity-file",
        "--fusion-threshold-mb", "--cycle-time-ms", "--cache-capacity", "--autotune-log-file",
        "--autotune-warmup-samples", "--autotune-steps-per-sample", "--autotune-bayes-opt-max-samples",
        "--autotune-gaussian-process-noise", "--min-np", "--min-num-proc", "--max-np", "--max-num-proc",
        "--slots-per-host", "--elastic-timeout", "--reset-limit", "--timeline-filename",
        "--stall-check-warning-time-seconds", "--stall-check-shutdown-time-seconds", "--mpi-args",
        "--binding-args", "--num-nccl-streams", "--thread-affinity", "--gloo-timeout-seconds", "--log-level",
        "-H", "--hosts", "-hostfile", "--hostfile", "--host-discovery-script"), 1),
    "--blacklist-cooldown-range": 2,
    **dict.fromkeys((
        "-h", "--help", "-v", "--version", "-cb", "--check-build", "--disable-cache", "--verbose",
        "--hierarchical-allreduce", "--no-hierarchical-allreduce", "--hierarchical-allgather",
        "--no-hierarchical-allgather", "--torus-allreduce", "--no-torus-allreduce", "--autotune", "--no-autotune",
        "--timeline-mark-cycles", "--no-timeline-mark-cycles", "--no-stall-check", "--stall-check",
        "--mpi-threads-disable", "--no-mpi-threads-disable", "--tcp", "--log-with-timestamp", "--log-without-timestamp",
        "-prefix-timestamp", "--prefix-output-with-timestamp", "--log-hide-timestamp", "--no-log-hide-timestamp",
        "--gloo", "--mpi", "--jsrun"), 0),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """hybridsync-run's own settings."""

    strategy: str | None = None
    """Strategy file given to every rank (as ``HYBRIDSYNC_STRATEGY``)."""
    num_servers: int | None = None
    """Parameter servers to start; ``None``: one if the strategy uses the PS route, else none."""
    partition_bytes: int | None = None
    """``BYTEPS_PARTITION_BYTES`` for the servers and workers."""
    ps_root_port: int | None = None
    """Rendezvous port of server 0; ``None`` picks a free one."""
    server_hosts: tuple[str, ...] | None = None
    """Host of each server (``--server-hosts``); ``None``: colocated with the workers."""
    autotune: bool | None = None
    """Profile, search, measure trials and train with the winner (``hybridsync.autotune.launch``);
    ``None``: as the config's ``hybridsync: autotune:`` section says (off without one)."""
    trial_budget: int | None = None
    """``--autotune``: real trials to spend (default: the config's, else 50)."""
    store: str | None = None
    """``--autotune``: trial store URL (default: the config's, else ``sqlite:///trials.db``)."""
    cluster: str | None = None
    """Cluster spec YAML: what the simulator assumes, and with no ``-H``/``--hostfile`` the cluster emulated here."""
    autotune_report: str | None = None
    """``--autotune``: directory of the report and the winning strategy (default ``autotune-report``)."""


def split_argv(argv: Sequence[str]) -> tuple[LaunchOptions, list[str]]:
    """hybridsync's flags, and the rest for horovodrun. ``ValueError`` on a bad value.

    Ours may stand anywhere before the command, among horovodrun's flags, as horovodrun
    reads its own: the command starts at the first word that is neither a flag nor a
    flag's value (or after ``--``), and everything from there on is the command's, even
    a word that looks like one of our flags.
    """
    own, horovodrun_flags, command_start = _scan_flags(argv)
    return _options(own), horovodrun_flags + list(argv[command_start:])


def asks_for_help(argv: Sequence[str]) -> bool:
    """Whether ``-h``/``--help`` stands among the flags (after the command it is the command's)."""
    _, horovodrun_flags, _ = _scan_flags(argv)
    return any(_is_flag(word) and _resolve_flag(word)[0] in _HELP_FLAGS for word in horovodrun_flags)


_HELP_FLAGS = ("-h", "--help")


def _scan_flags(argv: Sequence[str]) -> tuple[dict[str, str], list[str], int]:
    """Our flags' values, horovodrun's flags (with their values) and where the command starts."""
    own: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv) and _is_flag(argv[i]):
        flag, inline = _resolve_flag(argv[i])
        if flag in _OWN_SWITCHES:
            own[flag], i = "1", i + 1
            continue
        if flag in _OWN_FLAGS:
            if inline is None and (i + 1 == len(argv) or _is_flag(argv[i + 1])):
                raise ValueError(f"{flag} needs a value")
            own[flag], i = (inline, i + 1) if inline is not None else (argv[i + 1], i + 2)
            continue
        arity = 0 if inline is not None else _HOROVODRUN_ARITY.get(flag, 0)
        taken = 0
        while taken < arity and i + 1 + taken < len(argv) and not _is_flag(argv[i + 1 + taken]):
            taken += 1  # a flag where a value should be: horovodrun reports the missing value
        rest.extend(argv[i:i + 1 + taken])
        i += 1 + taken
    return own, rest, i


def _is_flag(word: str) -> bool:
    """Whether argparse reads ``word`` as an option (``-5``, ``-`` and ``--`` are not options here)."""
    return word.startswith("-") and word != "-" and word != "--" and not _NEGATIVE_NUMBER.fullmatch(word)


_NEGATIVE_NUMBER = re.compile(r"-\d+|-\d*\.\d+")


def _resolve_flag(word: str) -> tuple[str, str | None]:
    """The option ``word`` names (as argparse resolves it) and its ``=``/attached value, if any.

    An unknown word is returned as is (horovodrun will reject it); an abbreviation that
    could be one of ours or another option is a ``ValueError``, as in argparse.
    """
    known = (*_OWN_FLAGS, *_OWN_SWITCHES, *_HOROVODRUN_ARITY)
    name, eq, inline = word.partition("=")
    value = inline if eq else None
    if name in known:
        return name, value
    if name.startswith("--"):
        matches = [flag for flag in known if flag.startswith(name)]
        if len(matches) == 1:
            return matches[0], value
        if any(m in _OWN_FLAGS or m in _OWN_SWITCHES for m in matches):
            raise ValueError(f"ambiguous option: {name} could match {', '.join(matches)}")
        return name, value
    if word[:2] in _HOROVODRUN_ARITY and _HOROVODRUN_ARITY[word[:2]] == 1:
        return word[:2], word[2:]  # argparse's attached short value: -Hlocalhost:2
    return name, value


def _options(own: dict[str, str]) -> LaunchOptions:
    def integer(flag: str, minimum: int) -> int | None:
        if flag not in own:
            return None
        try:
            value = int(own[flag])
        except ValueError:
            raise ValueError(f"{flag} must be an integer, got {own[flag]!r}") from None
        if value < minimum:
            raise ValueError(f"{flag} must be >= {minimum}, got {value}")
        return value
    strategy = own.get("--strategy")
    if strategy is not None:
        strategy = os.path.abspath(strategy)
        Strategy.load(strategy)  # fail here, before any process starts, if the file is bad
    server_hosts = None
    if "--server-hosts" in own:
        server_hosts = tuple(h.strip() for h in own["--server-hosts"].split(","))
        if not all(server_hosts):
            raise ValueError(f"--server-hosts must be a comma-separated list of hosts, got {own['--server-hosts']!r}")
    num_servers = integer("--num-servers", 0)
    if server_hosts is not None and num_servers is not None and num_servers != len(server_hosts):
        raise ValueError(f"--num-servers {num_servers} but --server-hosts names {len(server_hosts)} servers")
    return LaunchOptions(strategy=strategy, num_servers=len(server_hosts) if server_hosts else num_servers,
                         partition_bytes=integer("--partition-bytes", 1), ps_root_port=integer("--ps-root-port", 1),
                         server_hosts=server_hosts, autotune=True if "--autotune" in own else None,
                         trial_budget=integer("--trial-budget", 1), store=own.get("--store"),
                         cluster=os.path.abspath(own["--cluster"]) if "--cluster" in own else None,
                         autotune_report=own.get("--autotune-report"))


_OWN_OPTIONS = """\
  --strategy PATH        strategy file for every rank
  --num-servers K        parameter servers to start (default: 1 if the strategy uses the PS)
  --server-hosts H,...   host of each server (default: colocated with the workers)
  --partition-bytes N    BYTEPS_PARTITION_BYTES (default 4096000)
  --ps-root-port P       rendezvous port of server 0 (default: a free port)
  --autotune             profile, search, measure trials, then train with the winner
  --trial-budget N       --autotune: real trials to spend, baselines included (default 50)
  --store URL            --autotune: trial store (default sqlite:///trials.db)
  --cluster SPEC.yaml    the cluster (bandwidth, servers); emulated here unless -H/--hostfile
  --autotune-report DIR  --autotune: report and winning strategy (default autotune-report)"""


def usage() -> str:
    """``hybridsync-run --help``: what it does and its own options, then horovodrun's help."""
    def heading(text: str) -> str:
        rule = "=" * 79
        return f"{rule}\n{text}\n{rule}"
    return "\n\n".join([
        __doc__.strip().replace("``", ""),
        heading("hybridsync-run options (anywhere before the command; they override the\n"
                "--config-file's hybridsync: section)") + "\n" + _OWN_OPTIONS,
        heading("horovodrun options (every other flag before the command goes to horovodrun\n"
                "unchanged; --autotune is hybridsync's: Horovod's own autotuner is\n"
                "HOROVOD_AUTOTUNE=1 or the config file's autotune: section)") + "\n" + horovodrun_help()])


def horovodrun_help() -> str:
    """horovodrun's ``--help`` text, from its own parser (nothing is launched)."""
    import contextlib
    import io
    from unittest import mock

    from horovod.runner import launch
    text = io.StringIO()
    with mock.patch.object(sys, "argv", ["horovodrun", "--help"]), contextlib.redirect_stdout(text):
        try:
            launch.parse_args()
        except SystemExit:  # argparse exits once the help is printed
            pass
    return text.getvalue().rstrip()


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobShape:
    """What hybridsync-run needs from horovodrun's arguments."""

    num_proc: int
    hosts: tuple[str, ...]
    """Host names of ``-H``/``--hostfile`` (empty: horovodrun's default, this host)."""
    ssh_args: tuple[str, ...] = ()
    """The job's ``-p``/``-i`` ssh settings, reused to start servers on other hosts."""
    config_file: str | None = None
    """horovodrun's ``--config-file``, whose ``hybridsync:`` section fills in our settings."""
    command: tuple[str, ...] = ()
    """The training command."""
    hosts_arg: str | None = None
    """``-H`` as given."""
    hostfile: str | None = None
    """``--hostfile`` as given."""
    elastic: bool = False
    """Elastic Horovod (``--min-np``/``--max-np``/``--host-discovery-script``): workers come and go."""
    discovery_script: str | None = None
    """``--host-discovery-script`` as given (a shell command)."""
    nics: tuple[str, ...] = ()
    """``--network-interface(s)`` as given."""
    gloo_timeout_s: int | None = None
    """``--gloo-timeout-seconds`` (or its config-file setting), else ``HOROVOD_GLOO_TIMEOUT_SECONDS``."""
    max_proc: int | None = None
    """``--max-np`` (``None``: no bound)."""
    ranks_per_host: tuple[tuple[str, int], ...] = ()
    """Where horovodrun puts the ranks of a job with ``-H``/``--hostfile``: (host, ranks), in
    order (empty: elastic, no hosts given, or too few slots, which horovodrun reports)."""


def ranks_per_host(hosts: str, num_proc: int, *, gloo: bool) -> dict[str, int]:
    """How horovodrun places ``num_proc`` ranks on ``hosts`` (``-H``'s form): ranks per host, filling
    each host's slots before the next. With ``gloo``, as its Gloo launcher does (0.28.1's
    ``gloo_run``): a rank on every slot, even beyond ``num_proc``; else (mpirun) ``num_proc`` ranks.
    ``ValueError`` for a malformed list or too few slots."""
    from horovod.runner.common.util import hosts as horovod_hosts
    slots = horovod_hosts.get_host_assignments(horovod_hosts.parse_hosts(hosts), num_proc,
                                               None if gloo else num_proc)
    return dict(collections.Counter(slot.hostname for slot in slots))


def _uses_gloo(args: argparse.Namespace) -> bool:
    """Whether horovodrun runs these arguments with its Gloo launcher (its own ``is_gloo_used``, which
    asks whether MPI is built, in a child process, only when neither ``--gloo`` nor ``--mpi`` decides)."""
    from horovod.runner import launch
    return bool(launch.is_gloo_used(args.use_gloo, args.use_mpi, args.use_jsrun))


def describe_os_error(error: OSError) -> str:
    """An ``OSError`` as a user reads it: ``'x.yaml': No such file or directory``, not Python's
    ``[Errno 2] No such file or directory: 'x.yaml'``."""
    if error.filename is not None and error.strerror:
        return f"{str(error.filename)!r}: {error.strerror}"
    return error.strerror or str(error)


def _horovodrun_args(horovodrun_argv: Sequence[str]) -> argparse.Namespace:
    """horovodrun's parse of ``horovodrun_argv`` (it also reads ``--config-file``), or ``ValueError``
    with its one-line error: its parser would print its 40-line usage before that line, and name
    horovodrun, on a mistake the user made on hybridsync-run's command line (an unknown flag)."""
    import contextlib
    import io
    from unittest import mock

    from horovod.runner import launch
    errors = io.StringIO()
    with mock.patch.object(sys, "argv", ["horovodrun", *horovodrun_argv]), contextlib.redirect_stderr(errors):
        try:
            return launch.parse_args()
        except OSError as e:
            raise ValueError(f"cannot read --config-file {describe_os_error(e)}") from None
        except SystemExit as exit:
            if not exit.code:  # --version answered: horovodrun's own exit
                raise
            lines = errors.getvalue().strip().splitlines() or ["horovodrun refused its arguments"]
            raise ValueError(f"{lines[-1].removeprefix('horovodrun: error: ')} "
                             "(hybridsync-run --help lists its own flags and horovodrun's)") from None


def horovodrun_job(horovodrun_argv: Sequence[str]) -> JobShape:
    """The ``-np`` and hosts horovodrun will use, read with horovodrun's own parser."""
    from horovod.runner.common.util import hosts as horovod_hosts
    args = _horovodrun_args(horovodrun_argv)
    if not args.command:
        raise ValueError("no training command given (e.g. hybridsync-run -np 2 python train.py)")
    if args.num_proc is not None and int(args.num_proc) < 1:  # mpirun would say so only after 15 s, unclearly
        raise ValueError(f"-np {args.num_proc}: a job needs at least one rank")
    spec = args.hosts or (horovod_hosts.parse_host_files(args.hostfile) if args.hostfile else "")
    names = tuple(h.hostname for h in horovod_hosts.parse_hosts(spec)) if spec else ()
    ssh_args = (("-p", str(args.ssh_port)) if args.ssh_port else ()) + (
        ("-i", args.ssh_identity_file) if args.ssh_identity_file else ())
    # horovodrun's own test for elastic mode (launch._is_elastic)
    elastic = args.host_discovery_script is not None or args.min_num_proc is not None
    placed: dict[str, int] = {}
    if spec and not elastic:
        num_proc = int(args.num_proc)
        try:
            placed = ranks_per_host(spec, num_proc, gloo=True)
        except ValueError:
            pass  # horovodrun refuses the job itself, naming the problem
        if sum(placed.values()) > num_proc:
            if _uses_gloo(args):
                slots = ", ".join(f"{count} on {host}" for host, count in placed.items())
                raise ValueError(f"-np {num_proc}, but Horovod's Gloo launcher starts a rank on each of the "
                                 f"{sum(placed.values())} slots ({slots}) that -H/--hostfile give, whatever -np "
                                 f"says (Horovod 0.28.1); give exactly -np slots, e.g. -H host:{num_proc}")
            placed = ranks_per_host(spec, num_proc, gloo=False)
    return JobShape(num_proc=int(args.num_proc), hosts=names, ssh_args=ssh_args, config_file=args.config_file,
                    command=tuple(args.command), hosts_arg=args.hosts, hostfile=args.hostfile, elastic=elastic,
                    discovery_script=args.host_discovery_script, nics=tuple(args.nics or ()),
                    gloo_timeout_s=args.gloo_timeout_seconds or _int_or_none(os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS")),
                    max_proc=args.max_num_proc, ranks_per_host=tuple(placed.items()))


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text else None
    except ValueError:
        return None


def elastic_notes(job: JobShape, num_servers: int) -> list[str]:
    """What to tell the user before an elastic job starts; ``ValueError`` for a discovery script
    horovodrun could not run (it fails on it too, but after starting up)."""
    if job.discovery_script is not None:
        words = shlex.split(job.discovery_script)
        program = words[0] if words else ""
        found = shutil.which(program) if os.sep not in program else program
        if not found or not os.path.isfile(found):
            raise ValueError(f"--host-discovery-script {job.discovery_script!r}: {program!r} is not a file "
                             f"(give a path, e.g. ./discover.sh)")
        if not os.access(found, os.X_OK):
            raise ValueError(f"--host-discovery-script {job.discovery_script!r}: {found} is not executable "
                             f"(chmod +x {found})")
    notes = []
    if not job.nics:
        notes.append("an elastic job without --network-interface waits (up to --elastic-timeout, 600 s by "
                     "default) until the discovery script lists 2 hosts, which horovodrun 0.28.1 needs to find "
                     "a common interface; on one host pass --network-interface lo")
    may_grow = job.max_proc is None or job.max_proc > job.num_proc
    if may_grow and (job.gloo_timeout_s or 30) < 60:
        notes.append(f"when workers join, the running ones wait for them only {job.gloo_timeout_s or 30} s "
                     f"(Horovod's Gloo timeout), then abort; a worker's start-up can take longer on a busy "
                     f"host: pass --gloo-timeout-seconds 120 (it also bounds a survivor's wait on a dead rank)")
    if num_servers:
        notes.append("no parameter servers are started for an elastic job: the strategy's PS variables go by "
                     "ring all-reduce (docs/guides/elastic.md)")
    return notes


def with_run_config(options: LaunchOptions, config_file: str | None) -> LaunchOptions:
    """``options`` with what the command line left unset taken from the config's ``hybridsync:``
    section (``strategy``, ``num_servers``, ``partition_bytes``, ``autotune``): the command line wins."""
    if config_file is None:
        return options
    from hybridsync.run.config import load_run_config
    config = load_run_config(config_file)
    if options.strategy and config.strategy_path and options.strategy != config.strategy_path:
        print(f"hybridsync-run: --strategy {options.strategy} replaces {config_file}'s strategy "
              f"{config.strategy_path}", file=sys.stderr)
    strategy = options.strategy or config.strategy_path
    if strategy != options.strategy:
        Strategy.load(strategy)  # fail here, before any process starts, if the file is bad
    return dataclasses.replace(
        options, strategy=strategy,
        num_servers=options.num_servers if options.num_servers is not None else config.num_servers,
        partition_bytes=options.partition_bytes or config.partition_bytes,
        autotune=options.autotune if options.autotune is not None else config.autotune.get("enabled"))


def server_placement(options: LaunchOptions, job: JobShape, num_servers: int) -> tuple[str, ...] | None:
    """Host of every server in id order, or ``None`` when they all run here as child processes.

    Ids follow horovodrun's rank order (host by host, in order of first appearance), so
    server 0, which hosts the rendezvous, is on the first host named.
    """
    hosts = options.server_hosts
    if hosts is None:
        if all(_is_this_host(h) for h in job.hosts):
            return None
        hosts = tuple(job.hosts[i % len(job.hosts)] for i in range(num_servers))
    order = list(dict.fromkeys(hosts))
    return tuple(sorted(hosts, key=order.index))


def rendezvous_address(hosts: Sequence[str]) -> str:
    """Server 0's address as the workers must dial it: loopback when every host is this one,
    else this host's address on the route towards the first remote host (no packet is sent)."""
    remote = [h for h in hosts if not _is_this_host(h)]
    if not remote:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((remote[0], 9))
        except OSError as e:
            raise ValueError(f"cannot find this host's address towards {remote[0]} ({e}); the parameter "
                             f"servers run here and every worker must reach them") from None
        return probe.getsockname()[0]


def _is_this_host(host: str) -> bool:
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def check_hierarchical_fits(strategy: Strategy | None, job: JobShape, strategy_path: str | None) -> None:
    """``ValueError`` when the strategy (read from ``strategy_path``) routes variables through hierarchical all-reduce but the job
    puts different numbers of ranks on its hosts: that route needs equal nodes, and every rank would
    fail building its optimizer (``RouteUnavailableError``), after start-up, in a traceback each.
    (An elastic job's optimizer falls back to ring instead: ``hybridsync.world``.)"""
    counts = {count for _, count in job.ranks_per_host}
    if strategy is None or len(counts) < 2:
        return
    if strategy.uses_hierarchical:
        placed = ", ".join(f"{count} on {host}" for host, count in job.ranks_per_host)
        names = strategy.hierarchical_variables()
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "") or "its default"
        raise ValueError(f"the job places the {job.num_proc} ranks {placed}, but strategy {strategy_path} routes "
                         f"{shown} through hierarchical all-reduce, which needs every host to hold as many "
                         f"ranks: give the hosts equal slots, or route those variables 'ring'")


def check_servers_fit(strategy: Strategy | None, num_servers: int, strategy_path: str | None) -> None:
    """``ValueError`` when the strategy (read from ``strategy_path``) pins a variable to a parameter server the job will not start
    (``servers: [3]`` with 2 servers): every rank would fail building its optimizer, after start-up,
    in a traceback each."""
    missing = {} if strategy is None else strategy.servers_beyond(num_servers)
    if missing:
        name, servers = next(iter(missing.items()))
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"strategy {strategy_path} puts {name!r}{more} on server {servers[0]}, but the job starts "
                         f"{num_servers} parameter server{'s' if num_servers != 1 else ''} (numbered from 0): "
                         f"give --num-servers (or the config's num_servers) {max(max(s) for s in missing.values()) + 1}"
                         f", or change the strategy's servers")


def check_port_free(port: int) -> None:
    """``ValueError`` unless this host can listen on ``port``, where server 0 will host the rendezvous
    store: taken (another job's store), its supervisor would die at once, and the workers wait for
    the store until their join timeout."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store listens
        try:
            probe.bind(("", port))
        except OSError as error:
            raise ValueError(f"--ps-root-port {port}: this host cannot listen on it ({describe_os_error(error)}; "
                             f"another job's rendezvous?): choose another port, or leave it unset for a free one"
                             ) from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_environment(options: LaunchOptions, job: JobShape, num_servers: int,
                    placement: tuple[str, ...] | None = None) -> dict[str, str]:
    """What every rank (and server) gets on top of the launcher's own environment."""
    env = {}
    if options.strategy:
        env[envvars.STRATEGY] = options.strategy
    if num_servers:
        root = (rendezvous_address((*job.hosts, *(placement or ()))) if placement is None
                or _is_this_host(placement[0]) else placement[0])
        env.update(ps_environment(num_workers=job.num_proc, num_servers=num_servers, root_uri=root,
                                  root_port=options.ps_root_port or _free_port(),
                                  partition_bytes=options.partition_bytes))
    return env


def start_servers(num_servers: int, env: dict[str, str], placement: tuple[str, ...] | None = None,
                  ssh_args: Sequence[str] = ()) -> list[subprocess.Popen]:
    """Start the parameter servers (``DMLC_ROLE=server``): here, or where ``placement`` says."""
    server = server_command()
    if placement is None:
        return [procs.start(server, env={**env, **server_environment(i)}, capture=False) for i in range(num_servers)]
    slots = ",".join(f"{host}:{placement.count(host)}" for host in dict.fromkeys(placement))
    argv = [*horovodrun_command(), "-np", str(num_servers), "-H", slots, "--gloo", *ssh_args, *server,
            "--id-from-launcher-rank"]
    return [procs.start(argv, env={**env, **server_environment()}, capture=False)]


def _raise_on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(options: LaunchOptions, horovodrun_argv: Sequence[str], *, server_grace_s: float = 60.0) -> int:
    """Start servers (if any), run horovodrun to the end, then stop everything it started. The
    autotuner (``hybridsync.cli.run_main`` starts it for ``--autotune``) trains its winner through this."""
    job_shape = horovodrun_job(horovodrun_argv)
    options = with_run_config(options, job_shape.config_file)
    strategy = Strategy.load(options.strategy) if options.strategy else None  # read once, checked below
    uses_ps = strategy is not None and strategy.uses_ps
    num_servers = options.num_servers if options.num_servers is not None else int(uses_ps)
    if job_shape.elastic:
        for note in elastic_notes(job_shape, num_servers):
            print(f"hybridsync-run: {note}", file=sys.stderr)
        num_servers = 0
    elif num_servers == 0 and uses_ps:
        raise ValueError(f"strategy {options.strategy} routes variables through the parameter server, "
                         f"but the number of servers (--num-servers or the config's num_servers) is 0")
    check_hierarchical_fits(strategy, job_shape, options.strategy)
    if num_servers:
        check_servers_fit(strategy, num_servers, options.strategy)
    placement = server_placement(options, job_shape, num_servers) if num_servers else None
    if num_servers and options.ps_root_port and (placement is None or _is_this_host(placement[0])):
        check_port_free(options.ps_root_port)
    env = {**os.environ, **job_environment(options, job_shape, num_servers, placement)}
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    servers: list[subprocess.Popen] = []
    job = None
    try:
        servers = start_servers(num_servers, env, placement, job_shape.ssh_args)
        job = procs.start([*horovodrun_command(), *horovodrun_argv], env=env, capture=False)
        names = ([f"parameter server {i}" for i in range(num_servers)] if placement is None
                 else ["the horovodrun of the parameter servers"])
        # Watched only when the strategy routes to them, so that every worker joins them at once: servers
        # started for a later switch give up when no worker joined within their timeout, harmlessly.
        return wait_watching_servers(job, dict(zip(names, servers)) if uses_ps else {})
    except KeyboardInterrupt:
        print("hybridsync-run: interrupted; stopping the job and its servers", file=sys.stderr)
        return 130
    finally:
        if job is not None and job.poll() is None:
            procs.stop(job)
        _stop_servers(servers, server_grace_s, env)
        signal.signal(signal.SIGTERM, previous)


SERVER_WATCH_S = 0.5
"""How often ``wait_watching_servers`` looks at the servers while the job runs."""
FAILED_SERVER_GRACE_S = 30.0
"""How long a job may go on after a server failed, to end with its own ranks' errors, before the
launcher stops it and names the server. A worker that raised is why a server gives up on it, and the
other ranks need seconds (tens under load) to learn it from Horovod: 5 s cut their reports short.
Long against that, short against the workers' join timeout (120 s) for a store no one hosts."""


def wait_watching_servers(job: subprocess.Popen, servers: Mapping[str, subprocess.Popen]) -> int:
    """``job.wait()``, except that a server (by name) that exits with an error while the job runs stops
    the job: its workers would otherwise wait their join timeout (120 s) for a store no one hosts
    (its port taken), or their RPC timeouts for a server that gave up. ``1``, with a line naming the
    server, then."""
    failed_at = None
    while True:
        try:
            return job.wait(timeout=SERVER_WATCH_S)
        except subprocess.TimeoutExpired:
            pass
        failed = [(name, server.returncode) for name, server in servers.items() if server.poll() not in (None, 0)]
        if not failed:
            continue
        failed_at = failed_at or time.monotonic()
        if time.monotonic() - failed_at < FAILED_SERVER_GRACE_S:
            continue
        name, code = failed[0]
        print(f"hybridsync-run: error: {name} exited with status {code} while the job ran (its output above says "
              f"why); stopping the job", file=sys.stderr, flush=True)
        procs.stop(job)
        return 1


SERVERS_SETTLE_S = 3.0
"""How long the servers of a finished job get to exit on their own before the launcher asks the
rendezvous whether any worker joined them. Servers that served exit within a second or two of the
job (under load); asking costs the launcher importing torch and a store connection, 3-9 s on a
loaded host, so it is asked only of servers still running after this."""


def _stop_servers(servers: list[subprocess.Popen], grace_s: float, env: dict[str, str]) -> None:
    """Servers leave on their own once every worker said goodbye; stop the ones that do not, and at
    once when no worker ever joined them (they would wait for workers that are gone). The first
    process hosts the rendezvous that knows who joined (server 0's supervisor, or the horovodrun
    that started every server): asked only while it runs, and only once the servers had
    ``SERVERS_SETTLE_S`` to exit."""
    deadline = time.monotonic() + grace_s
    settled = procs.wait_all(servers, time.monotonic() + min(grace_s, SERVERS_SETTLE_S))
    if not settled and servers[0].poll() is None and not any_worker_joined(env):
        deadline = 0.0
    procs.wait_all(servers, deadline)
    procs.stop_all(servers)
