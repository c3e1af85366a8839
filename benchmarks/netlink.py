"""Measures the TCP rate an emulated cluster's shaped links deliver (needs root).

    .venv/bin/python benchmarks/netlink.py                      # 2 hosts at 1gbit, 250 MB each way
    .venv/bin/python benchmarks/netlink.py --bandwidth 100mbit --megabytes 25

Prints host0->host1 and host1->host0 goodput, then a fan-in run on 3 hosts (hosts 0 and 2
send to host 1 at once: the switch-to-host1 link must cap their sum at the set rate, which
checks that both ends of each uplink are shaped). TCP payload is ~96% of the wire rate
(Ethernet/IP/TCP headers), so "within 10%" is the pass mark. Exit status 1 if any misses it.
"""
from __future__ import annotations

import argparse
import sys

from hybridsync.cluster.linkrate import measure_concurrent, measure_tcp_rate
from hybridsync.cluster.netns import EmulatedCluster
from hybridsync.cluster.spec import ClusterSpec

TOLERANCE = 0.10


def report(label: str, bits_per_second: float, target: float) -> bool:
    """Prints one result line; returns whether it is within TOLERANCE of ``target``."""
    ratio = bits_per_second / target
    ok = abs(ratio - 1) <= TOLERANCE
    print(f"{label:<28} {bits_per_second / 1e6:8.1f} Mbit/s  {ratio:6.1%} of set  {'ok' if ok else 'MISS'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bandwidth", default="1gbit", help="tc-style uplink rate (default 1gbit)")
    parser.add_argument("--megabytes", type=float, default=250.0, help="payload per transfer")
    args = parser.parse_args(argv)
    nbytes = int(args.megabytes * 1e6)
    spec = ClusterSpec(nodes=2, workers_per_node=1, inter_node_bandwidth=args.bandwidth)
    target = spec.inter_node_bits_per_second
    print(f"set rate {target / 1e6:.0f} Mbit/s, {args.megabytes:g} MB per transfer")
    ok = True
    with EmulatedCluster(spec) as cluster:
        for src, dst in ((0, 1), (1, 0)):
            result = measure_tcp_rate(cluster, src=src, dst=dst, nbytes=nbytes)
            ok &= report(f"host{src} -> host{dst}", result.bits_per_second, target)
    fan_in = ClusterSpec(nodes=3, workers_per_node=1, inter_node_bandwidth=args.bandwidth)
    with EmulatedCluster(fan_in) as cluster:
        results = measure_concurrent(cluster, pairs=[(0, 1), (2, 1)], nbytes=nbytes // 2)
        total = sum(r.nbytes for r in results) * 8 / max(r.seconds for r in results)
        ok &= report("host0 + host2 -> host1", total, target)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
