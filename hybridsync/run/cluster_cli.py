"""``hybridsync cluster ...``: bring an emulated cluster up, run a job across it, tear it down.

    hybridsync cluster up SPEC [--detach]            # hold it up until Ctrl-C (or leave it up)
    hybridsync cluster run SPEC [--launcher gloo] -- python train.py
    hybridsync cluster run SPEC --launcher gloo --servers 'python ps_server.py' -- python train.py
    hybridsync cluster down [--prefix hs-]           # remove whatever a killed launcher left
    hybridsync cluster ls                            # what is up now

Also runnable as ``python -m hybridsync.run.cluster_cli``. Needs root.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from typing import TYPE_CHECKING, Sequence

from hybridsync import envvars
from hybridsync.cli_parser import CommandParser
from hybridsync.cluster.netns import NAMESPACE_PREFIX, EmulatedCluster, leftovers, remove_leftovers
from hybridsync.cluster.spec import ClusterSpec
from hybridsync.run.launcher import describe_os_error

if TYPE_CHECKING:
    from hybridsync.run.emulated import Job

LAUNCHERS = ("none", "gloo", "mpirun", "horovodrun")
EXIT_TIMEOUT = 124


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hybridsync cluster``."""
    parser = CommandParser(
        prog="hybridsync cluster", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Bring an emulated multi-node cluster up (network namespaces joined by shaped links),\n"
                    "run a job across it, tear it down. Needs root.",
        epilog="examples:\n" + __doc__.split("\n\n")[1])
    sub = parser.add_subparsers(dest="action", required=True)

    up = sub.add_parser("up", help="bring a cluster up and hold it until interrupted")
    up.add_argument("spec", help="cluster spec YAML")
    up.add_argument("--job-id", help="namespace tag (default: random); namespaces are hs-<job-id>-*")
    up.add_argument("--detach", action="store_true",
                    help="leave it up and exit (remove later with `hybridsync cluster down`)")

    run = sub.add_parser("run", help="bring up, run `-- CMD...`, tear down however it ends")
    run.add_argument("spec", help="cluster spec YAML")
    run.add_argument("--launcher", choices=LAUNCHERS, default="none",
                     help="none: run CMD as is on --node (or every node with --all-nodes); "
                     "gloo/mpirun/horovodrun: start CMD as a Horovod job on every worker slot")
    where = run.add_mutually_exclusive_group()
    where.add_argument("--node", type=int, default=0, help="host for --launcher none (default 0)")
    where.add_argument("--all-nodes", action="store_true", help="with --launcher none: CMD on every host")
    run.add_argument("--timeout", type=float, default=3600.0, help="seconds before the job is killed")
    run.add_argument("--job-id", help="namespace tag (default: random)")
    run.add_argument("--servers", metavar="'CMD ARGS'",
                     help="also start servers_per_node copies of this command on every host "
                     "(parameter servers; servers and workers get DMLC_* set), stopped when the job ends")

    down = sub.add_parser("down", help="kill processes in and delete namespaces with a prefix")
    down.add_argument("--prefix", default=NAMESPACE_PREFIX, help=f"default {NAMESPACE_PREFIX!r}: every cluster")

    ls = sub.add_parser("ls", help="list namespaces, links and processes with a prefix")
    ls.add_argument("--prefix", default=NAMESPACE_PREFIX)
    return parser


def _describe(cluster: EmulatedCluster) -> str:
    spec = cluster.spec
    lines = [f"cluster {cluster.job_id}: {spec.nodes} hosts x {spec.workers_per_node} workers, "
             f"uplinks {spec.inter_node_bandwidth}, +{spec.inter_node_latency_ms} ms"]
    for name, ns, ip in zip(cluster.hostnames, cluster.namespaces, cluster.ips):
        lines.append(f"  {name}  {ip:<12} ip netns exec {ns} CMD")
    lines.append(f"  horovod hosts: -H {spec.horovod_hosts}")
    return "\n".join(lines)


def cmd_up(args: argparse.Namespace) -> int:
    """Brings a cluster up; holds it until SIGINT/SIGTERM unless ``--detach``."""
    cluster = EmulatedCluster(ClusterSpec.from_yaml(args.spec), job_id=args.job_id)
    cluster.up()
    print(_describe(cluster), flush=True)
    if args.detach:
        cluster.detach()
        print(f"left up; remove with: hybridsync cluster down --prefix {cluster.prefix}")
        return 0
    print("up; Ctrl-C tears it down", flush=True)
    try:
        signal.pause()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        cluster.teardown()
    return 0


def _start(cluster: EmulatedCluster, args: argparse.Namespace, command: list[str]) -> "Job":
    """Starts the job's processes; with ``--servers``, the servers first and PS settings for all."""
    from hybridsync.run import emulated

    env: dict[str, str] = {}
    if args.servers:
        emulated.launch_servers(cluster, shlex.split(args.servers))  # teardown stops them
        env = {**emulated.ps_env(cluster), envvars.DMLC_ROLE: "worker"}
    if args.launcher == "gloo":
        return emulated.launch_gloo(cluster, command, env=env)
    if args.launcher == "mpirun":
        return emulated.launch_mpirun(cluster, command, env=env)
    if args.launcher == "horovodrun":
        return emulated.launch_horovodrun(cluster, command, env=env)
    nodes = range(cluster.spec.nodes) if args.all_nodes else [args.node]
    return emulated.Job(processes=[cluster.run(node, command, env={**os.environ, **env}) for node in nodes])


def cmd_run(args: argparse.Namespace) -> int:
    """Runs a command on the cluster; returns the first non-zero exit code (124: timeout)."""
    command = list(args.command)
    if not command:
        raise ValueError("run: no command given (usage: run SPEC [options] -- CMD [ARGS...])")
    spec = ClusterSpec.from_yaml(args.spec)
    if not 0 <= args.node < spec.nodes:
        raise ValueError(f"--node must be in [0, {spec.nodes}), got {args.node}")
    if args.servers and spec.servers_per_node == 0:
        raise ValueError("--servers given but the spec has servers_per_node: 0")
    with EmulatedCluster(spec, job_id=args.job_id) as cluster:
        print(_describe(cluster), file=sys.stderr, flush=True)
        job = _start(cluster, args, command)
        try:
            codes = job.wait(timeout=args.timeout)
        except TimeoutError as error:
            print(f"hybridsync cluster run: {error}", file=sys.stderr)
            return EXIT_TIMEOUT
    failed = [code for code in codes if code != 0]
    return (failed[0] if failed[0] > 0 else 128 - failed[0]) if failed else 0


def cmd_down(args: argparse.Namespace) -> int:
    """Removes every namespace (and its processes) with the prefix."""
    removed = remove_leftovers(args.prefix)
    print("removed: " + (", ".join(removed) if removed else "nothing"))
    remaining = leftovers(args.prefix)
    if remaining:
        print("still present: " + ", ".join(remaining), file=sys.stderr)
        return 1
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    """Prints what exists with the prefix, one item a line."""
    for item in leftovers(args.prefix):
        print(item)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; user mistakes and missing root end with a one-line message and status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" is the job's command, never our options.
    split = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:split])
    args.command = argv[split + 1:]
    actions = {"up": cmd_up, "run": cmd_run, "down": cmd_down, "ls": cmd_ls}
    try:
        return actions[args.action](args)
    except (ValueError, PermissionError, FileNotFoundError) as error:
        message = describe_os_error(error) if isinstance(error, OSError) else error
        print(f"hybridsync cluster {args.action}: error: {message}", file=sys.stderr)
        return 2
    except (RuntimeError, subprocess.SubprocessError) as error:
        print(f"hybridsync cluster {args.action}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"hybridsync cluster {args.action}: interrupted; torn down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
