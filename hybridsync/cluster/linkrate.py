"""Measures the TCP rate a shaped link actually delivers, with a plain-socket sender/receiver.

The receiver runs on one emulated host and times the stream from its first byte to EOF;
the sender on another host pushes a fixed number of bytes. Run as a module on a host::

    python -m hybridsync.cluster.linkrate recv            # prints "port N", later a JSON result
    python -m hybridsync.cluster.linkrate send HOST PORT NBYTES
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import select
import socket
import subprocess
import sys
import time
from typing import IO, Sequence

from hybridsync.cluster.netns import EmulatedCluster, kill_pids

_CHUNK = 256 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkMeasurement:
    """One timed transfer between two hosts."""

    nbytes: int
    """Payload bytes received."""
    seconds: float
    """From the first received byte to EOF."""

    @property
    def bits_per_second(self) -> float:
        """Achieved TCP goodput (payload only; headers make it ~3-5% below the shaped rate)."""
        return 8 * self.nbytes / self.seconds


def receive(listener: socket.socket) -> LinkMeasurement:
    """Accepts one connection and reads it to EOF, timing from the first byte."""
    conn, _ = listener.accept()
    with conn:
        buffer = bytearray(_CHUNK)
        received = conn.recv_into(buffer)
        start = time.perf_counter()
        while True:
            count = conn.recv_into(buffer)
            if count == 0:
                break
            received += count
    return LinkMeasurement(nbytes=received, seconds=time.perf_counter() - start)


def send(host: str, port: int, nbytes: int) -> None:
    """Connects to a receiver and sends ``nbytes`` zero bytes."""
    payload = bytes(_CHUNK)
    with socket.create_connection((host, port), timeout=30) as conn:
        remaining = nbytes
        while remaining > 0:
            conn.sendall(payload[: min(remaining, _CHUNK)])
            remaining -= _CHUNK


def _read_line(stream: IO[str], timeout: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout)
    if not ready:
        raise TimeoutError(f"no output within {timeout} s")
    return stream.readline()


def measure_tcp_rate(
    cluster: EmulatedCluster, *, src: int = 0, dst: int = 1, nbytes: int, timeout: float = 60.0
) -> LinkMeasurement:
    """Sends ``nbytes`` from host ``src`` to host ``dst`` over TCP and returns the timing."""
    return measure_concurrent(cluster, pairs=[(src, dst)], nbytes=nbytes, timeout=timeout)[0]


def measure_concurrent(
    cluster: EmulatedCluster, *, pairs: Sequence[tuple[int, int]], nbytes: int, timeout: float = 60.0
) -> list[LinkMeasurement]:
    """Runs one ``nbytes`` TCP stream per ``(src, dst)`` pair, all at once; one result per pair.

    Every helper process is bounded by ``timeout`` and killed by pid if it overruns.
    """
    module = [sys.executable, "-m", "hybridsync.cluster.linkrate"]
    procs: list[subprocess.Popen[str]] = []
    try:
        receivers = [cluster.run(dst, [*module, "recv"], stdout=subprocess.PIPE, text=True) for _, dst in pairs]
        procs += receivers
        ports = [int(_read_line(r.stdout, timeout=15).split()[1]) for r in receivers]  # type: ignore[arg-type]
        for (src, dst), port in zip(pairs, ports):
            procs.append(cluster.run(src, [*module, "send", cluster.ips[dst], str(port), str(nbytes)]))
        results = [json.loads(_read_line(r.stdout, timeout=timeout)) for r in receivers]  # type: ignore[arg-type]
        for proc in procs:
            proc.wait(timeout=10)
        return [LinkMeasurement(nbytes=r["nbytes"], seconds=r["seconds"]) for r in results]
    finally:
        kill_pids([proc.pid for proc in procs if proc.poll() is None])
        for proc in procs:
            if proc.stdout is not None:
                proc.stdout.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the per-host helper processes."""
    parser = argparse.ArgumentParser(prog="python -m hybridsync.cluster.linkrate")
    sub = parser.add_subparsers(dest="role", required=True)
    sub.add_parser("recv", help="listen on an ephemeral port, print it, time one stream")
    sender = sub.add_parser("send", help="send NBYTES to HOST:PORT")
    sender.add_argument("host")
    sender.add_argument("port", type=int)
    sender.add_argument("nbytes", type=int)
    args = parser.parse_args(argv)
    if args.role == "send":
        send(args.host, args.port, args.nbytes)
        return 0
    with socket.create_server(("", 0)) as listener:
        print(f"port {listener.getsockname()[1]}", flush=True)
        result = receive(listener)
    print(json.dumps({"nbytes": result.nbytes, "seconds": result.seconds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
