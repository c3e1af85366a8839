"""The analytic cost model: alpha-beta time of every message on its path, and overlap with backward.

For each candidate (vectorized over a ``StrategyBatch``'s ``Units``):

- ring all-reduce of S bytes over W ranks: each host uplink carries 2(W-1)/W * S per
  direction (ranks ordered by host, so the ring crosses each uplink once each way);
  one node: loopback instead of the uplink.
- hierarchical: intra-node reduce and gather through shared memory (S per byte rate of
  ``shm_bytes_per_s``), and the inter-node all-reduce of each slice among the ranks that
  share a local rank, all uplinks busy at once: 2(N-1)/N * S per uplink.
- Horovod's all-gather of a whole sparse gradient (ring route): (W-1) times the touched
  rows per uplink, fused with the ring all-reduces as Horovod fuses its ops.
- parameter servers: keys of at most ``partition_bytes``; per server the bytes placed on
  it (explicit servers as given, the rest balanced by water filling, the way the
  least-loaded placement levels servers); per host uplink the pushes of its w workers to
  remote servers plus the pulls of remote workers from its servers,
  w(L - L_n) + (W - w) L_n (incast on the servers' hosts when placement is uneven); and
  each server's CPU handles W pushes and pulls of its load.
- fp16 halves dense bytes; sparse gradients send touched rows (``encoding.Units``).
- a per-operation cost (alpha) per message (per key on the PS); hierarchical adds one per
  step of its cross-node ring.

Overlap: a unit can start when its last gradient is ready (profiled ``ready_s``, scaled
like compute); the units of one channel (Horovod's ring thread, the hierarchical path,
the PS client) run one after the other, so a channel ends at
max_j(ready_j + cost of the channel's units from j on), the textbook single-server queue;
on Horovod's channel the messages that become ready while an op runs are fused into the
next op, which pays one alpha (tensor fusion). The channels run at once but share the
cores and uplinks (``concurrency_penalty``). ASP/SSP parameters travel after
``synchronize()`` and the local step, exposed, their keys all at once (``async_scale``).
The step is compute + the part of communication not hidden behind the backward pass, and
never faster than the busiest uplink allows. Compute is slowed when more ranks than cores
share a machine (``cores``: the emulated cluster runs every rank on one machine).

Every constant's default comes from a measurement in ``benchmarks/RESULTS.md`` (named in
its docstring); ``fit_constants`` refits them by least squares on measured trials.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from hybridsync.cluster.spec import ClusterSpec
from hybridsync.model.encoding import GATHER, HIER, PS, PS_ASYNC, RING, ModelArrays, Units, from_strategies, units
from hybridsync.placement import DEFAULT_PARTITION_BYTES


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostConstants:
    """The analytic model's constants (seconds, fractions of a link's set rate, bytes per second)."""

    alpha_ring_s: float = 4.4e-3
    """Per Horovod op (fused ring all-reduces): RESULTS.md collectives.py, 4-byte ring at 1 Gbit/s:
    4.06, 4.41, 4.60 ms."""
    alpha_hier_s: float = 4.8e-3
    """Per hierarchical all-reduce: collectives.py 4-byte hier: 3.69, 4.82 ms (one outlier 10.5 ms)."""
    alpha_hier_hop_s: float = 1.0e-3
    """Per step of a hierarchical all-reduce's cross-node ring (2 (nodes - 1) of them), on top of
    ``alpha_hier_s``: with one rank per node the 110-message baseline of 4 nodes measured twice
    its 2-node cost per message. Fitted."""
    alpha_ps_s: float = 7.2e-3
    """Per PS key push-pull: collectives.py 4-byte ps: 7.43, 6.30, 7.72 ms."""
    ring_efficiency: float = 0.93
    """Ring's share of its bandwidth bound at 64 MB: collectives.py 93%, 94%, 92% (1 Gbit/s)."""
    hier_efficiency: float = 0.85
    """Hierarchical's share of its bound at 64 MB: 88%, 84%, 83% (1 Gbit/s)."""
    ps_efficiency: float = 0.89
    """PS's share of its bound at 64 MB: 89%, 89%, 88% (1 Gbit/s)."""
    shm_bytes_per_s: float = 1.4e9
    """Intra-node shared-memory steps of hierarchical: collectives.py 64 MB hier 0.609 s vs its
    cross-node step alone 0.564 s, i.e. ~45 ms for 64 MB."""
    loopback_bytes_per_s: float = 2.0e8
    """Ring on one host (no uplink): ps.py, 64 MB all-reduce of 2 loopback ranks in 0.34 s."""
    ps_server_bytes_per_s: float = 3.5e8
    """Server CPU per byte pushed or pulled: ps.py, 64 MB push-pull of 2 workers to 2 loopback
    servers in 0.387 s (2 x 2 x 32 MB per server)."""
    densify_bytes_per_s: float = 1.0e9
    """Densifying a sparse gradient that travels whole (split, merged, hierarchical): per dense
    byte, on every rank. No benchmark isolates it; the initial value is a memory-copy rate, fitted."""
    fp16_bytes_per_s: float = 1.0e9
    """fp16 compression's CPU work per half-precision byte all-reduced (casts both ways, Gloo's
    float16 sums on the CPU), on every rank. No benchmark isolates it; a memory-copy rate, fitted."""
    fp16_ps_bytes_per_s: float = 1.0e9
    """The same per half-precision byte on the BSP parameter servers (casts only; the servers
    sum): fitted apart, as the dataset's fp16 PS trials ran ~1.6x faster than the all-reduce
    rate predicted and its fp16 ring trials slower."""
    async_scale: float = 1.0
    """ASP/SSP's push-pull after the step, as a share of the same bytes' BSP cost: it sends
    every key at once and no server waits for the other workers. Fitted (the dataset's pure
    ASP trials ran ~0.6x as long as pure BSP)."""
    concurrency_penalty: float = 0.5
    """Channels (Horovod, hierarchical, PS) run at once but share cores and uplinks: each
    channel's busy time beyond the busiest one's adds this fraction of itself (0: perfectly
    parallel, 1: one after the other). No benchmark isolates it; 0.5 to start, fitted."""
    compute_scale: float = 1.0
    """Multiplies profiled compute (and ready times) beyond the core-sharing slowdown: fitted."""
    step_overhead_s: float = 1.0e-3
    """Fixed cost per step of synchronizing at all (handles, barrier of the slowest rank): fitted."""
    cores: float | None = None
    """Cores that all ranks of the cluster share (an emulated cluster on one machine: 2 here);
    ``None``: every rank has its own. Compute is slowed by max(1, ranks / cores). Not fitted."""
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    """PS key size (``BYTEPS_PARTITION_BYTES``). Not fitted."""

    def __post_init__(self) -> None:
        bad = [f.name for f in dataclasses.fields(self)
               if f.name in FITTED and not (math.isfinite(getattr(self, f.name)) and getattr(self, f.name) > 0)]
        if self.cores is not None and not self.cores > 0:
            bad.append("cores")
        if bad:
            raise ValueError(f"CostConstants: {', '.join(bad)} must be finite numbers > 0")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: dict) -> "CostConstants":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ValueError(f"CostConstants: unknown fields {unknown} (known: {sorted(known)})")
        return cls(**doc)


FITTED = ("alpha_ring_s", "alpha_hier_s", "alpha_hier_hop_s", "alpha_ps_s", "ring_efficiency", "hier_efficiency",
          "ps_efficiency", "shm_bytes_per_s", "ps_server_bytes_per_s", "densify_bytes_per_s", "fp16_bytes_per_s",
          "fp16_ps_bytes_per_s", "async_scale",
          "concurrency_penalty", "compute_scale", "step_overhead_s")
"""The constants ``fit_constants`` adjusts (the others describe the machine, not the software)."""
TERMS = ("step_s", "compute_s", "backward_s", "comm_end_s", "exposed_s", "ring_s", "hier_s", "ps_s",
         "ps_async_s", "contention_s", "ps_network_s", "ps_server_s", "uplink_s", "alpha_s", "max_server_bytes",
         "slowdown")
"""The arrays ``analytic_terms`` returns, in feature order."""
TIME_TERMS = tuple(term for term in TERMS if term not in ("max_server_bytes", "slowdown"))
"""The terms in seconds."""


def slowdown(cluster: ClusterSpec, constants: CostConstants) -> float:
    """How much slower compute runs than profiled on one process: ranks sharing cores, times the fit."""
    shared = max(1.0, cluster.num_workers / constants.cores) if constants.cores else 1.0
    return shared * constants.compute_scale


def reference_terms(arrays: ModelArrays, cluster: ClusterSpec, constants: CostConstants) -> dict[str, np.ndarray]:
    """``analytic_terms`` of plain Horovod (every variable ring all-reduced, one candidate) on
    ``cluster``: the yardstick that makes a candidate's terms comparable across models."""
    batch = from_strategies(arrays, [None], cluster)
    return analytic_terms(arrays, units(arrays, batch, partition_bytes=constants.partition_bytes), cluster, constants)


def analytic_terms(arrays: ModelArrays, u: Units, cluster: ClusterSpec,
                   constants: CostConstants) -> dict[str, np.ndarray]:
    """Predicted step time (``step_s``) of every candidate and the terms it is made of (``TERMS``)."""
    c = constants
    workers, nodes, per_node = cluster.num_workers, cluster.nodes, cluster.workers_per_node
    uplink = cluster.inter_node_bytes_per_second
    ring_rate = (c.ring_efficiency * uplink) if nodes > 1 else c.loopback_bytes_per_s
    ring_net = u.wire_bytes * (2 * (workers - 1) / workers) / ring_rate
    hier_net = u.wire_bytes * (2 * (nodes - 1) / nodes) / (c.hier_efficiency * uplink)
    hier_shm = u.wire_bytes / c.shm_bytes_per_s if per_node > 1 else 0.0
    gather_net = u.wire_bytes * (workers - 1) / ring_rate
    # PS units: their share of the busiest uplink and server, placement's imbalance included
    ps_network, ps_server, max_server, net_imbalance, cpu_imbalance = _ps_load_terms(u, cluster, c)
    ps_net_share = (u.wire_bytes * net_imbalance[:, None] * (2 * per_node * (nodes - 1) / nodes)
                    / (c.ps_efficiency * uplink))
    ps_cpu = (u.wire_bytes * cpu_imbalance[:, None] * 2 * workers / max(cluster.num_servers, 1)
              / c.ps_server_bytes_per_s)

    route = u.route
    is_ring, is_hier, is_gather = route == RING, route == HIER, route == GATHER
    is_ps = (route == PS) | (route == PS_ASYNC)
    # ring all-reduce ops are paid per Horovod op, not per message (its fusion: _fused_channel_end)
    alpha_hier = c.alpha_hier_s + c.alpha_hier_hop_s * 2 * (nodes - 1)
    alpha = np.where(is_hier, alpha_hier * u.messages, 0.0) + c.alpha_ps_s * u.keys
    network = (np.where(is_ring, ring_net, 0.0) + np.where(is_hier, hier_net, 0.0)
               + np.where(is_gather, gather_net, 0.0))
    cost = alpha + network + np.where(is_hier, hier_shm, 0.0) + np.where(is_ps, ps_net_share + ps_cpu, 0.0)
    cost = np.where(u.messages > 0, cost, 0.0)
    if workers == 1:
        cost = np.zeros_like(cost)

    scale = slowdown(cluster, c)
    backward = scale * arrays.backward_s
    ready = scale * u.ready_s
    active = u.messages > 0
    is_async = (route == PS_ASYNC) & active
    ring_end, ring_ops = _fused_channel_end(ready, cost, (is_ring | is_gather) & active, c.alpha_ring_s)
    ends = [ring_end] + [_channel_end(ready, cost, mask & active) for mask in (is_hier, (route == PS) & active)]
    busy = [np.where(mask & active, cost, 0.0).sum(axis=1) for mask in (is_ring | is_gather, is_hier, route == PS)]
    busy[0] = busy[0] + ring_ops * c.alpha_ring_s
    if workers == 1:
        ps_network = ps_server = np.zeros_like(ps_network)
    synchronous = active & ~is_async
    first_ready = np.where(synchronous, ready, np.inf).min(axis=1)
    first_ready = np.where(np.isfinite(first_ready), first_ready, backward)
    uplink_s = network.sum(axis=1) + ps_network
    # channels run at once, but share the cores and the uplink: each other channel's busy
    # time counts for ``concurrency_penalty`` of itself
    busy_all = np.stack(busy, axis=1)
    contention = c.concurrency_penalty * (busy_all.sum(axis=1) - busy_all.max(axis=1))
    comm_end = np.maximum.reduce([ends[0], ends[1], ends[2], first_ready + uplink_s,
                                  first_ready + ps_server]) + contention
    # ASP/SSP: the parameters go after synchronize() and the local step, one after the other
    async_s = c.async_scale * np.where(is_async, cost, 0.0).sum(axis=1)
    exposed = np.maximum(comm_end - backward, 0.0) + async_s
    compute = (scale * (arrays.forward_s + arrays.optimizer_s + arrays.other_s) + backward
               + u.densified_bytes / c.densify_bytes_per_s + (u.fp16_bytes - u.fp16_ps_bytes) / c.fp16_bytes_per_s
               + u.fp16_ps_bytes / c.fp16_ps_bytes_per_s)
    synced = active.any(axis=1) & (workers > 1)
    # a per-variable overhead was tried: fit on models of 12-38 variables it overpredicted the
    # 110-variable one by 1.3-1.5x when held out, so one fixed cost per step remains
    step = compute + exposed + np.where(synced, c.step_overhead_s, 0.0)
    n = len(step)
    return {"step_s": step, "compute_s": compute, "backward_s": np.full(n, backward), "comm_end_s": comm_end,
            "exposed_s": exposed, "ring_s": ends[0], "hier_s": ends[1], "ps_s": ends[2], "ps_async_s": async_s,
            "contention_s": contention, "ps_network_s": ps_network, "ps_server_s": ps_server, "uplink_s": uplink_s,
            "alpha_s": alpha.sum(axis=1) + ring_ops * c.alpha_ring_s,
            "max_server_bytes": max_server, "slowdown": np.full(n, scale)}


def _fused_channel_end(ready: np.ndarray, cost: np.ndarray, mask: np.ndarray,
                       alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """End time and op count of Horovod's channel: while an op runs, the messages that become
    ready join the next op, which starts when it ends and pays one ``alpha`` for all of them
    (tensor fusion). Scans the columns (ready order), vectorized over candidates."""
    n = ready.shape[0]
    end, pending_cost, ops = np.zeros(n), np.zeros(n), np.zeros(n)
    pending = np.zeros(n, bool)
    for j in np.flatnonzero(mask.any(axis=0)):
        mine, r, c = mask[:, j], ready[:, j], cost[:, j]
        start_pending = mine & pending & (r > end)  # the channel freed up before this message: run the queue
        end = np.where(start_pending, end + alpha + pending_cost, end)
        ops += start_pending
        pending &= ~start_pending
        pending_cost = np.where(start_pending, 0.0, pending_cost)
        idle = mine & ~pending & (r >= end)
        end = np.where(idle, r + alpha + c, end)
        ops += idle
        queued = mine & ~idle
        pending |= queued
        pending_cost = np.where(queued, pending_cost + c, pending_cost)
    return np.where(pending, end + alpha + pending_cost, end), ops + pending


def _channel_end(ready: np.ndarray, cost: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """When a channel that serves its units one at a time, in ready order (the columns'
    order), finishes: max_j(ready_j + cost of its units from j on); 0 if unused."""
    cost = np.where(mask, cost, 0.0)
    prefix = np.cumsum(cost, axis=1)
    suffix = prefix[:, -1:] - prefix + cost  # cost of units j.. (a forward cumsum is faster)
    return np.where(mask, ready + suffix, 0.0).max(axis=1, initial=0.0)


def server_loads(u: Units, num_servers: int) -> np.ndarray:
    """(N, S) bytes per server: explicit placements, then the balanced bytes poured onto the
    least-loaded servers (water filling: the level h with sum(max(0, h - e_s)) = balanced)."""
    explicit = u.server_bytes[:, :num_servers]
    ordered = np.sort(explicit, axis=1)
    k = np.arange(1, num_servers + 1)
    level = ((u.balanced_bytes[:, None] + np.cumsum(ordered, axis=1)) / k).min(axis=1)
    return np.maximum(explicit, level[:, None])


def _ps_load_terms(u: Units, cluster: ClusterSpec, c: CostConstants) -> tuple[np.ndarray, ...]:
    """Per candidate: the busiest uplink's PS seconds, the busiest server's CPU seconds, its
    bytes, and how much busier than under perfect balance the busiest uplink and server are."""
    n = len(u.balanced_bytes)
    if cluster.num_servers == 0:
        return np.zeros(n), np.zeros(n), np.zeros(n), np.ones(n), np.ones(n)
    loads = server_loads(u, cluster.num_servers)
    node_loads = loads.reshape(n, cluster.nodes, cluster.servers_per_node).sum(axis=2)
    total = node_loads.sum(axis=1, keepdims=True)
    per_node, workers = cluster.workers_per_node, cluster.num_workers
    out = (per_node * (total - node_loads) + (workers - per_node) * node_loads).max(axis=1)
    busiest = np.maximum(loads.max(axis=1), np.where(u.balanced_bytes > 0, u.largest_key, 0.0))
    total = total[:, 0]
    even_out = total * 2 * per_node * (cluster.nodes - 1) / cluster.nodes
    net_imbalance = np.where(even_out > 0, out / np.maximum(even_out, 1e-9), 1.0)
    cpu_imbalance = np.where(total > 0, busiest * cluster.num_servers / np.maximum(total, 1e-9), 1.0)
    return (out / (c.ps_efficiency * cluster.inter_node_bytes_per_second),
            busiest * 2 * workers / c.ps_server_bytes_per_s, busiest, net_imbalance, cpu_imbalance)


Problem = tuple[ModelArrays, Units, ClusterSpec, np.ndarray]
"""One (model, cluster)'s encoded candidates and their measured step times in seconds."""


def fit_constants(problems: Sequence[Problem], initial: CostConstants | None = None, *,
                  prior_weight: float = 0.05, max_evaluations: int = 400) -> CostConstants:
    """Least squares of log(predicted / measured) over every trial, in the log of the ``FITTED``
    constants (each within a factor e^4 of ``initial``, efficiencies and the penalty at most 1), with a weak
    pull (``prior_weight`` per unit of log) towards ``initial`` so that constants the data
    cannot see keep their measured defaults; a robust loss keeps a few noisy trials from
    dragging them. ``ValueError`` without trials."""
    from scipy.optimize import least_squares

    initial = initial or CostConstants()
    if not problems or sum(len(measured) for *_, measured in problems) == 0:
        raise ValueError("fit_constants: no measured trials to fit the analytic model to")
    for arrays, _, cluster, measured in problems:
        if not np.all(np.isfinite(measured)) or np.any(measured <= 0):
            raise ValueError(f"fit_constants: {arrays.name} on {cluster}: step times must be finite and > 0")
    x0 = np.log([getattr(initial, name) for name in FITTED])
    log_measured = np.concatenate([np.log(measured) for *_, measured in problems])

    def residuals(x: np.ndarray) -> np.ndarray:
        constants = dataclasses.replace(initial, **dict(zip(FITTED, np.exp(x))))
        predicted = np.concatenate([analytic_terms(arrays, u, cluster, constants)["step_s"]
                                    for arrays, u, cluster, _ in problems])
        return np.concatenate([np.log(predicted) - log_measured, prior_weight * (x - x0)])

    upper = np.array([0.0 if name.endswith(("_efficiency", "_penalty")) else x + 4.0 for name, x in zip(FITTED, x0)])
    start = np.minimum(x0, upper - 1e-9)
    result = least_squares(residuals, start, method="trf", loss="soft_l1", f_scale=0.3, max_nfev=max_evaluations,
                           bounds=(x0 - 4.0, upper))
    return dataclasses.replace(initial, **{name: float(v) for name, v in zip(FITTED, np.exp(result.x))})
