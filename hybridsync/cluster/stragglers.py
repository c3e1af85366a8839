"""Real stragglers on an ``EmulatedCluster``, switchable on and off during a run.

- ``CpuStraggler``: a compute straggler. The chosen processes of one host (by default
  every process in its namespace) go into a cgroup whose CPU bandwidth is capped
  (cgroup v1 ``cpu.cfs_quota_us``, or v2 ``cpu.max``): at ``cpu_fraction=0.1`` a busy loop
  runs ~8-10x slower. Off: the cap is lifted (the processes stay in the group).
- ``LinkStraggler``: a network straggler. One host's uplink (both directions: its veth
  end and the switch's port) is re-shaped to a lower ``tbf`` rate; off: the cluster's rate.
  Both are shapers (queues that pace), not policers. What the host sends queues on the host
  itself, so a TCP sender is held back without loss; what it receives queues at the switch
  port, behind faster links, where slow start's overshoot is dropped as at a real switch:
  a short transfer into the host can pay a retransmission timeout (200 ms minimum; at
  20 Mbit/s, 3 of 10 transfers of 1.5 MB measured 14.9 instead of 20.0 Mbit/s, 6 MB ones
  19.3 every time). (This kernel has no ``sch_netem``, so added latency is not available.)

Both are registered with the cluster and undone at its teardown (the cgroup removed, once
its processes are gone). ``StragglerSchedule`` turns one on and off at given seconds after
``start()`` from a background thread, e.g. ``[(0, None)]`` (persistent) or
``[(2, 6), (10, 14)]`` (intermittent).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable, Protocol, Sequence

from hybridsync.cluster.netns import NODE_IFACE, EmulatedCluster, namespace_pids, sh, tbf_args

CGROUP_V1_CPU = "/sys/fs/cgroup/cpu"
CGROUP_V2_ROOTS = ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")
_PERIOD_US = 100_000


class Straggler(Protocol):
    """Something that makes one host slow while it is on."""

    def on(self) -> None: ...

    def off(self) -> None: ...


class CpuStraggler:
    """Caps the CPU of one host's processes (or of those ``select`` keeps) while on."""

    def __init__(self, cluster: EmulatedCluster, node: int, *, cpu_fraction: float,
                 select: Callable[[int], bool] | None = None) -> None:
        """``cpu_fraction``: CPUs the group may use in total (0.1 = a tenth of one core)."""
        if not 0.01 <= cpu_fraction <= os.cpu_count():  # type: ignore[operator]
            raise ValueError(f"cpu_fraction must be in [0.01, {os.cpu_count()}] CPUs, got {cpu_fraction}")
        self.cluster, self.node, self.cpu_fraction, self.select = cluster, node, cpu_fraction, select
        self.namespace = cluster.namespace_of(node)
        self.path, self.v2 = _make_cgroup(f"{cluster.prefix}n{node}-cpu")
        cluster.add_cleanup(self.close)

    def on(self) -> None:
        """Move the host's (selected) processes into the group, then cap it."""
        procs = "cgroup.procs"
        for pid in namespace_pids(self.namespace):
            if self.select is None or self.select(pid):
                _write_quietly(os.path.join(self.path, procs), str(pid))  # a pid may just have exited
        self._limit(int(self.cpu_fraction * _PERIOD_US))

    def off(self) -> None:
        """Lift the cap."""
        self._limit(None)

    def close(self) -> None:
        """Lift the cap, move any process left back to the root group, remove the group."""
        if not os.path.isdir(self.path):
            return
        self.off()
        root = os.path.dirname(self.path)
        with open(os.path.join(self.path, "cgroup.procs")) as handle:
            for pid in handle.read().split():
                _write_quietly(os.path.join(root, "cgroup.procs"), pid)
        try:
            os.rmdir(self.path)
        except OSError:
            pass  # a process is still exiting; the next teardown's leftovers sweep gets it

    def _limit(self, quota_us: int | None) -> None:
        if self.v2:
            _write(os.path.join(self.path, "cpu.max"), f"{quota_us or 'max'} {_PERIOD_US}")
        else:
            _write(os.path.join(self.path, "cpu.cfs_period_us"), str(_PERIOD_US))
            _write(os.path.join(self.path, "cpu.cfs_quota_us"), str(quota_us or -1))


class LinkStraggler:
    """Lowers one host's uplink rate (both directions) while on."""

    def __init__(self, cluster: EmulatedCluster, node: int, *, rate_bits_per_second: int) -> None:
        if rate_bits_per_second < 1000:
            raise ValueError(f"rate_bits_per_second must be >= 1000, got {rate_bits_per_second}")
        self.cluster, self.node, self.rate = cluster, node, rate_bits_per_second
        self.namespace = cluster.namespace_of(node)
        cluster.add_cleanup(self.off)

    def on(self) -> None:
        self._shape(self.rate)

    def off(self) -> None:
        if self.cluster.is_up or self.cluster.is_closing:
            self._shape(self.cluster.spec.inter_node_bits_per_second)

    def _shape(self, rate: int) -> None:
        # The cluster's tbf is the root qdisc, or netem's child 10: when it adds latency (see netns._shape).
        where = ["root", "handle", "1:"] if self.cluster.spec.inter_node_latency_ms <= 0 else \
            ["parent", "1:1", "handle", "10:"]
        for namespace, device in ((self.namespace, NODE_IFACE), (self.cluster.switch_namespace, f"n{self.node}")):
            sh(["tc", "-n", namespace, "qdisc", "change", "dev", device, *where, *tbf_args(rate)])


class StragglerSchedule:
    """Turns a straggler on and off at given seconds after ``start()`` (a daemon thread)."""

    def __init__(self, straggler: Straggler, windows: Sequence[tuple[float, float | None]]) -> None:
        """``windows``: ``(on_at_s, off_at_s or None)`` pairs, in order, not overlapping."""
        ends = [w[1] for w in windows[:-1]]
        if any(end is None for end in ends) or any(
                b[0] < (a[1] or 0) or (b[1] is not None and b[1] <= b[0]) for a, b in zip(windows, windows[1:])):
            raise ValueError(f"straggler windows must be ordered and disjoint, only the last open-ended: {windows}")
        self.straggler, self.windows = straggler, list(windows)
        self.log: list[tuple[float, str]] = []
        """``(seconds after start, "on" | "off")`` as applied."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "StragglerSchedule":
        self._thread = threading.Thread(target=self._run, daemon=True, name="straggler-schedule")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the schedule and turn the straggler off."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.straggler.off()

    def _run(self) -> None:
        began = time.monotonic()
        events = [(on, "on") for on, _ in self.windows] + [(off, "off") for _, off in self.windows if off is not None]
        for at, what in sorted(events):
            if self._stop.wait(max(0.0, began + at - time.monotonic())):
                return
            getattr(self.straggler, what)()
            self.log.append((round(time.monotonic() - began, 2), what))


def _make_cgroup(name: str) -> tuple[str, bool]:
    """A fresh CPU cgroup ``name``: v1's cpu controller where mounted, else v2 with ``cpu`` enabled."""
    if os.path.isfile(os.path.join(CGROUP_V1_CPU, "cpu.cfs_quota_us")):
        path = os.path.join(CGROUP_V1_CPU, name)
        os.makedirs(path, exist_ok=True)
        return path, False
    for root in CGROUP_V2_ROOTS:
        controllers = os.path.join(root, "cgroup.controllers")
        if os.path.isfile(controllers) and "cpu" in open(controllers).read().split():
            path = os.path.join(root, name)
            os.makedirs(path, exist_ok=True)
            return path, True
    raise RuntimeError("no cgroup CPU controller found (cgroup v1 'cpu' at /sys/fs/cgroup/cpu, or v2 with "
                       "'cpu' in cgroup.controllers); a compute straggler needs one")


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def _write_quietly(path: str, text: str) -> None:
    try:
        _write(path, text)
    except (ProcessLookupError, OSError):
        pass
