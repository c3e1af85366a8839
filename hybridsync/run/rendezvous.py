"""Horovod's Gloo rendezvous server as a standalone process, run on an emulated host.

horovodrun starts ``RendezvousServer`` inside its own process; ours must listen inside a
host's namespace, so it runs there as ``python -m hybridsync.run.rendezvous HOSTS NP``.
It prints ``port N`` once listening and serves until its stdin closes (the launcher exited
or finished), so it can never outlive the launcher by more than a teardown.
"""
from __future__ import annotations

import sys
from typing import Sequence


def serve(hosts: str, num_proc: int) -> None:
    """Serves the host allocation plan horovodrun would compute for ``-np num_proc -H hosts``."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(get_host_assignments(parse_hosts(hosts), num_proc, num_proc))
    print(f"port {port}", flush=True)
    try:
        sys.stdin.read()  # returns at EOF: the launcher closed the pipe or died
    finally:
        server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """``rendezvous HOSTS NP``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m hybridsync.run.rendezvous HOSTS NP", file=sys.stderr)
        return 2
    serve(args[0], int(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
