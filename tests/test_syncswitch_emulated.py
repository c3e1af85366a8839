"""Stragglers on the emulated cluster (``hybridsync/cluster/stragglers.py``), switched on and off:

- a network straggler: one host's uplink rate drops while on and is restored when off
  (measured TCP rate);
- a compute straggler: a busy loop on the host runs several times slower while on
  (cgroup CPU quota) and at full speed again when off; its cgroup goes with the cluster;
- a schedule turns a straggler on and off at the given times.

Needs root (namespaces, tc, cgroups); skips cleanly without it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from conftest import IS_ROOT
from hybridsync.cluster.spec import ClusterSpec

pytestmark = [pytest.mark.emulated,
              pytest.mark.skipif(not IS_ROOT, reason="network namespaces, tc and cgroups need root"),
              pytest.mark.timeout(120)]

SPEC = ClusterSpec(nodes=2, workers_per_node=1, inter_node_bandwidth="200mbit")
_LOOP = ("import sys, time\n"
         "while True:\n"
         "    began, n = time.perf_counter(), 0\n"
         "    while time.perf_counter() - began < 0.3:\n"
         "        n += 1\n"
         "    print(n, flush=True)\n")


@pytest.mark.emulated
def test_network_straggler_lowers_the_uplink_while_on():
    from hybridsync.cluster.linkrate import measure_tcp_rate
    from hybridsync.cluster.netns import EmulatedCluster, leftovers
    from hybridsync.cluster.stragglers import LinkStraggler

    with EmulatedCluster(SPEC) as cluster:
        straggler = LinkStraggler(cluster, 1, rate_bits_per_second=20_000_000)
        before = measure_tcp_rate(cluster, src=1, dst=0, nbytes=4_000_000).bits_per_second
        straggler.on()
        during = measure_tcp_rate(cluster, src=1, dst=0, nbytes=1_500_000).bits_per_second
        # 6 MB, not 1.5: into the host, the 20 Mbit/s queue is the switch port's, one hop from a 200 Mbit/s
        # sender, and slow start's overshoot drops there (a real switch does the same), where out of it the
        # queue is the sender's own (local backpressure, no loss). Recovering those drops took one or two
        # retransmission timeouts (200 ms minimum) in 3 of 10 transfers of 1.5 MB: 14.9 Mbit/s, once 10.7. A
        # fixed stall of that size over 2.4 s of transfer stays inside the window; 8 of 8 measured 19.3 here.
        into = measure_tcp_rate(cluster, src=0, dst=1, nbytes=6_000_000).bits_per_second
        straggler.off()
        after = measure_tcp_rate(cluster, src=1, dst=0, nbytes=4_000_000).bits_per_second
        prefix = cluster.prefix
    assert 150e6 < before < 210e6 and 150e6 < after < 210e6, (before, after)
    assert 14e6 < during < 21e6 and 14e6 < into < 21e6, (during, into)  # both directions of its uplink
    assert leftovers(prefix) == []


@pytest.mark.emulated
def test_compute_straggler_slows_the_host_while_on_and_goes_with_the_cluster():
    from hybridsync.cluster.netns import EmulatedCluster
    from hybridsync.cluster.stragglers import CpuStraggler, StragglerSchedule

    with EmulatedCluster(SPEC) as cluster:
        loop = cluster.run(1, [sys.executable, "-c", _LOOP], stdout=subprocess.PIPE, text=True)
        assert loop.stdout is not None
        counts = lambda k: [int(loop.stdout.readline()) for _ in range(k)]  # noqa: E731
        free = max(counts(3))
        straggler = CpuStraggler(cluster, 1, cpu_fraction=0.05)
        schedule = StragglerSchedule(straggler, [(0.0, 2.0)]).start()
        time.sleep(0.4)
        throttled = max(counts(3)[1:])
        time.sleep(max(0.0, 2.2 - 0.4 - 0.9))
        counts(1)  # the interval the cap was lifted in
        recovered = max(counts(5))  # more samples: another process's burst on the 2 cores can fill a few
        schedule.stop()
        path = straggler.path
        assert os.path.isdir(path)
    assert throttled * 4 < free, (throttled, free)  # a 5% cap: several times slower
    assert recovered * 2 > free, (recovered, free)
    assert [what for _, what in schedule.log] == ["on", "off"]
    assert not os.path.exists(path)  # removed at teardown


@pytest.mark.emulated
def test_straggler_windows_must_be_ordered():
    from hybridsync.cluster.stragglers import StragglerSchedule

    class Noop:
        def on(self) -> None: ...

        def off(self) -> None: ...
    with pytest.raises(ValueError, match="ordered and disjoint"):
        StragglerSchedule(Noop(), [(5.0, 9.0), (8.0, 12.0)])
    with pytest.raises(ValueError, match="only the last open-ended"):
        StragglerSchedule(Noop(), [(0.0, None), (8.0, 12.0)])
