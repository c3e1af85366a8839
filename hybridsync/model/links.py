"""What one cluster's communication paths cost: latency and seconds per byte of each route.

The analytic model prices every message from two kinds of constants: these, which belong
to a *cluster* (how fast its links, collectives and parameter servers are), and
``analytic.CostConstants``, which belong to the *software* and are fitted on trials of
many models and clusters (how much slower a collective runs inside a training step than
alone, what a merged piece or an fp16 cast costs, how much channels contend). A new
cluster then needs only its ``LinkConstants``: measured at the start of an autotune by a
short collective micro-benchmark (``model.calibration``), or, without one, derived from
its spec (``nominal_links``: the spec's bandwidth and the latencies measured on the
emulated cluster, ``benchmarks/RESULTS.md`` collectives.py).

Each path's time for one message of S bytes, alone on the cluster, is
``alpha + S * seconds_per_byte``: the bytes each rank sends, not the bytes on the wire,
so the topology's factors (2(n-1)/n for a ring, 2(N-1)/N across nodes for hierarchical,
the busiest uplink and server for balanced parameter-server keys) are inside the slope.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Mapping

from hybridsync.cluster.spec import ClusterSpec

Source = Literal["nominal", "calibrated"]

NOMINAL_RING_ALPHA_S = 4.4e-3
"""Per Horovod ring op: collectives.py, 4-byte ring at 1 Gbit/s: 4.06, 4.41, 4.60 ms."""
NOMINAL_HIER_ALPHA_S = 1.5e-3
NOMINAL_HIER_HOP_S = 1.5e-3
"""Per hierarchical all-reduce: ``NOMINAL_HIER_ALPHA_S`` plus this per step of its cross-node ring,
2 (nodes - 1) of them: 4.5 ms on 2 nodes (collectives.py 4-byte hier: 3.69, 4.82 ms), and 2.3x
that on 4 nodes, as the 110-message hierarchical baseline measured per message (runtime dataset)."""
NOMINAL_PS_ALPHA_S = 7.2e-3
"""Per PS key push-pull: collectives.py 4-byte ps: 7.43, 6.30, 7.72 ms."""
NOMINAL_EFFICIENCY = {"ring": 0.93, "hier": 0.85, "ps": 0.89}
"""Share of the bandwidth bound at 64 MB: collectives.py ring 92-94%, hier 83-88%, ps 88-89% (1 Gbit/s)."""
NOMINAL_SHM_BYTES_PER_S = 1.4e9
"""Hierarchical's intra-node shared-memory steps: 64 MB hier 0.609 s vs its cross-node step alone 0.564 s."""
NOMINAL_LOOPBACK_BYTES_PER_S = 2.0e8
"""Ring on one host (no uplink): ps.py, 64 MB all-reduce of 2 loopback ranks in 0.34 s."""
NOMINAL_CPU_BYTES_PER_S = 1.0e9
"""A memory-copy rate: what casting a byte to float16 and back costs, before any fit."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkConstants:
    """One cluster's paths: per-message latency (seconds) and seconds per byte a rank sends."""

    ring_alpha_s: float
    """Horovod ring all-reduce of a 4-byte tensor."""
    ring_s_per_byte: float
    """Each further byte of a ring all-reduce."""
    hier_alpha_s: float
    """Hierarchical all-reduce (shared memory within nodes, ring across) of a 4-byte tensor."""
    hier_s_per_byte: float
    ps_alpha_s: float
    """Each further key of a parameter-server push-pull when many are in flight (BSP, one worker's view)."""
    ps_s_per_byte: float
    """Each further byte of a push-pull whose keys are balanced over the servers."""
    cpu_s_per_byte: float
    """Casting a byte to float16 and back on one rank (the CPU work fp16 compression adds)."""
    source: Source = "nominal"
    """``calibrated``: measured on the cluster (``model.calibration``); ``nominal``: from its spec."""

    def __post_init__(self) -> None:
        bad = [f.name for f in dataclasses.fields(self) if f.name != "source"
               and not (math.isfinite(getattr(self, f.name)) and getattr(self, f.name) >= 0)]
        if bad:
            raise ValueError(f"LinkConstants: {', '.join(bad)} must be finite numbers >= 0")
        if self.source not in ("nominal", "calibrated"):
            raise ValueError(f"LinkConstants.source must be 'nominal' or 'calibrated', got {self.source!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "LinkConstants":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ValueError(f"LinkConstants: unknown fields {unknown} (known: {sorted(known)})")
        return cls(**doc)


def ring_factor(cluster: ClusterSpec) -> float:
    """Bytes a rank's uplink carries per byte of a ring all-reduce: 2(n-1)/n (ranks ordered by host)."""
    workers = cluster.num_workers
    return 2 * (workers - 1) / workers


def hier_factor(cluster: ClusterSpec) -> float:
    """Bytes an uplink carries per byte of a hierarchical all-reduce: 2(N-1)/N across N nodes."""
    return 2 * (cluster.nodes - 1) / cluster.nodes


def ps_factor(cluster: ClusterSpec) -> float:
    """Bytes the busiest uplink carries per byte of a balanced push-pull (colocated servers, w
    workers per host, no local aggregation): 2 w (N-1)/N."""
    return 2 * cluster.workers_per_node * (cluster.nodes - 1) / cluster.nodes


def nominal_links(cluster: ClusterSpec) -> LinkConstants:
    """A cluster's paths as its spec says: the uplink's rate times each path's measured efficiency,
    loopback within one host, the emulated cluster's measured latencies."""
    uplink = cluster.inter_node_bytes_per_second
    if cluster.nodes > 1:
        ring = ring_factor(cluster) / (NOMINAL_EFFICIENCY["ring"] * uplink)
        ps = ps_factor(cluster) / (NOMINAL_EFFICIENCY["ps"] * uplink)
    else:
        ring = ps = ring_factor(cluster) / NOMINAL_LOOPBACK_BYTES_PER_S
    hier = hier_factor(cluster) / (NOMINAL_EFFICIENCY["hier"] * uplink)
    if cluster.workers_per_node > 1:
        hier += 1.0 / NOMINAL_SHM_BYTES_PER_S
    latency = cluster.inter_node_latency_ms * 1e-3
    return LinkConstants(ring_alpha_s=NOMINAL_RING_ALPHA_S + 2 * (cluster.num_workers - 1) * latency,
                         ring_s_per_byte=ring,
                         hier_alpha_s=NOMINAL_HIER_ALPHA_S + 2 * (cluster.nodes - 1) * (NOMINAL_HIER_HOP_S + latency),
                         hier_s_per_byte=hier, ps_alpha_s=NOMINAL_PS_ALPHA_S + 2 * latency, ps_s_per_byte=ps,
                         cpu_s_per_byte=1.0 / NOMINAL_CPU_BYTES_PER_S, source="nominal")


CALIBRATED_FIELDS = ("ring_alpha_s", "ring_s_per_byte", "hier_alpha_s", "hier_s_per_byte", "ps_alpha_s",
                     "ps_s_per_byte", "cpu_s_per_byte")
"""The fields a calibration measures."""


def deviation(cluster: ClusterSpec, measured: LinkConstants) -> dict[str, float]:
    """How a cluster's measured paths differ from its spec: measured / nominal, field by field."""
    nominal = nominal_links(cluster)
    return {f: getattr(measured, f) / getattr(nominal, f) if getattr(nominal, f) > 0 else 1.0
            for f in CALIBRATED_FIELDS}


def mean_deviation(calibrations: list[tuple[ClusterSpec, LinkConstants]]) -> dict[str, float]:
    """The geometric mean of ``deviation`` over calibrated clusters ({} for none)."""
    if not calibrations:
        return {}
    ratios = [deviation(cluster, measured) for cluster, measured in calibrations]
    return {f: math.exp(sum(math.log(max(r[f], 1e-12)) for r in ratios) / len(ratios)) for f in CALIBRATED_FIELDS}


def relative_links(cluster: ClusterSpec, measured: LinkConstants, reference: Mapping[str, float]) -> LinkConstants:
    """The paths to price ``cluster`` by: its spec's, times how much more its calibration deviates
    from the spec than the calibrations of the clusters the simulator was fit on did
    (``reference``, a ``mean_deviation``; {}: not at all). A calibration measures the software
    too (Python, Gloo, the servers' CPU, how loaded the machine is); taking out the deviation
    seen on the training clusters leaves what is this cluster's own, and a cluster like them
    is priced as they were."""
    nominal = nominal_links(cluster)
    ratio = deviation(cluster, measured)
    return dataclasses.replace(nominal, source="calibrated",
                               **{f: getattr(nominal, f) * ratio[f] / reference.get(f, 1.0) for f in CALIBRATED_FIELDS})
