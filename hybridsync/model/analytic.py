"""The runtime simulator's analytic model: the cost of every message on its path, composed into a step time.

Each message is priced from two kinds of constants: the cluster's ``LinkConstants``
(``links.py``: latency and seconds per byte of each path, measured by a calibration job or
derived from the spec) and the software's ``CostConstants`` below (scales on those, CPU
costs per piece and per byte, contention), fitted on trials of many models and clusters.
Both are per message and per cluster, never per model, so what is fitted carries over to
a model the trials never saw. For each candidate (vectorized over a ``StrategyBatch``'s
``Units``):

- ring all-reduce of S bytes: the cluster's ring slope x S; Horovod's all-gather of a
  whole sparse gradient: W/2 times that per touched-row byte (each rank receives every
  other's rows), fused with the ring all-reduces as Horovod fuses its ops.
- hierarchical: its latency per message and its slope x S (shared memory within nodes, the
  slices' all-reduce across them).
- parameter servers: keys of at most ``partition_bytes``, a latency per key in flight, the
  slope x S scaled by how much busier than under balance placement makes the busiest uplink
  (per server the bytes placed on it: explicit servers as given, the rest balanced by water
  filling, as the least-loaded placement levels servers), and each server's CPU for the W
  pushes and pulls of its load.
- fp16 halves dense bytes and costs CPU per byte and per piece cast; sparse gradients send
  touched rows (``encoding.Units``); a sparse gradient sent whole is densified (CPU per byte);
  pieces merged into a hierarchical or PS message are copied into its buffer and back.

Composition, on the overlap the router really has: a unit can start when its last
gradient is ready (profiled ``ready_s``, scaled like compute). Horovod's ring runs in its
background thread: its units run one after the other, and the messages that become ready
while an op runs are fused into the next op, which pays one latency (tensor fusion). PS
push-pulls start at submit and queue per channel (max_j(ready_j + cost of the units from j
on), the textbook single-server queue). Hierarchical messages queue the same way: the router
starts them from the gradient hooks, one after the other. The channels share cores and uplinks
(``concurrency_penalty``). ASP/SSP parameters travel after ``synchronize()`` and the local
step, exposed (``async_scale``). The step is compute + the part of communication not hidden
behind the backward pass (the critical path), and never faster than the busiest uplink
allows. Compute is slowed when more ranks than cores share a machine (``cores``: the
emulated cluster runs every rank on one machine).

``fit_constants`` fits the software constants by least squares on measured trials, each
trial job's level (and drift over its wall time) taken out, since a job has a level of its own;
``fit_constants_and_compute`` also fits each training description's compute factor (its profile
against its trials), so that the constants do not absorb the training set's profiling errors.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import numpy as np

from hybridsync.cluster.spec import ClusterSpec
from hybridsync.model.encoding import GATHER, HIER, PS, PS_ASYNC, RING, ModelArrays, Units, from_strategies, units
from hybridsync.model.links import LinkConstants, nominal_links, ps_factor
from hybridsync.placement import DEFAULT_PARTITION_BYTES


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostConstants:
    """The software's constants: scales on a cluster's ``LinkConstants`` (a path inside a training
    step against the same path alone), CPU costs per piece, overlap and contention. Fitted on
    trials of many models and clusters (``fit_constants``); the defaults are the starting point."""

    ring_alpha_scale: float = 1.0
    """Per Horovod op (fused ring all-reduces), times the cluster's ``ring_alpha_s``."""
    ring_byte_scale: float = 1.0
    """Per ring byte, times ``ring_s_per_byte`` (also Horovod's sparse all-gather)."""
    hier_alpha_scale: float = 1.0
    """Per hierarchical message, times ``hier_alpha_s``."""
    hier_byte_scale: float = 1.0
    ps_alpha_scale: float = 1.0
    """Per PS key, times ``ps_alpha_s``."""
    ps_byte_scale: float = 1.0
    ps_server_scale: float = 2.9
    """A server's CPU per byte pushed or pulled, in units of the cluster's ``cpu_s_per_byte``:
    ps.py, 64 MB push-pull of 2 workers to 2 loopback servers in 0.387 s (~350 MB/s)."""
    densify_scale: float = 1.0
    """Densifying a sparse gradient that travels whole (split, merged, hierarchical), per dense
    byte on every rank, in units of ``cpu_s_per_byte``. No benchmark isolates it: fitted."""
    fp16_scale: float = 1.0
    """fp16 compression's CPU work per half-precision byte all-reduced (casts both ways, Gloo's
    float16 sums), in units of ``cpu_s_per_byte``: fitted."""
    fp16_ps_scale: float = 1.0
    """The same per half-precision byte on the BSP parameter servers (casts only; the servers sum)."""
    piece_s: float = 1.0e-4
    """CPU seconds per piece that travels in a merge group (copied into the message's buffer and
    back, on every rank): fitted."""
    fp16_piece_s: float = 1.0e-4
    """CPU seconds per piece sent as float16 (a cast each way, on every rank): fitted."""
    async_scale: float = 1.0
    """ASP/SSP's push-pull after the step, as a share of the same bytes' BSP cost: it sends
    every key at once and no server waits for the other workers. Fitted (the dataset's pure
    ASP trials ran ~0.6x as long as pure BSP)."""
    concurrency_penalty: float = 0.5
    """Channels (Horovod, hierarchical, PS) run at once but share cores and uplinks: each
    channel's busy time beyond the busiest one's adds this fraction of itself (0: perfectly
    parallel, 1: one after the other). No benchmark isolates it; 0.5 to start, fitted."""
    compute_scale: float = 1.0
    """Multiplies profiled compute (and ready times) beyond the core-sharing slowdown: fitted, the
    slowdown every model's compute shares in a step. ``fit_constants_and_compute`` (``Simulator.fit``)
    keeps it >= 1 and gives each training description a factor of its own: one scale over all of
    them absorbed their profiles' errors (the runtime dataset's generated models were profiled
    2-20x slow; the scale fit to 0.23) and carried them to every correctly profiled model."""
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


FITTED = ("ring_alpha_scale", "ring_byte_scale", "hier_alpha_scale", "hier_byte_scale", "ps_alpha_scale",
          "ps_byte_scale", "ps_server_scale", "densify_scale", "fp16_scale", "fp16_ps_scale", "piece_s",
          "fp16_piece_s", "async_scale", "concurrency_penalty", "compute_scale", "step_overhead_s")
"""The constants ``fit_constants`` adjusts (the others describe the machine, not the software)."""
BOUNDED = ("concurrency_penalty",)
"""Fitted constants that cannot exceed 1."""
TERMS = ("step_s", "compute_s", "backward_s", "comm_end_s", "exposed_s", "ring_s", "hier_s", "ps_s",
         "ps_async_s", "contention_s", "ps_network_s", "ps_server_s", "uplink_s", "alpha_s", "cpu_s",
         "max_server_bytes", "slowdown")
"""The arrays ``analytic_terms`` returns, in feature order."""
TIME_TERMS = tuple(term for term in TERMS if term not in ("max_server_bytes", "slowdown"))
"""The terms in seconds."""


def slowdown(cluster: ClusterSpec, constants: CostConstants) -> float:
    """How much slower compute runs than profiled on one process: ranks sharing cores, times the fit."""
    shared = max(1.0, cluster.num_workers / constants.cores) if constants.cores else 1.0
    return shared * constants.compute_scale


def reference_terms(arrays: ModelArrays, cluster: ClusterSpec, constants: CostConstants,
                    links: LinkConstants | None = None) -> dict[str, np.ndarray]:
    """``analytic_terms`` of plain Horovod (every variable ring all-reduced, one candidate) on
    ``cluster``: the yardstick that makes a candidate's terms comparable across models."""
    batch = from_strategies(arrays, [None], cluster)
    return analytic_terms(arrays, units(arrays, batch, partition_bytes=constants.partition_bytes), cluster,
                          constants, links)


def message_costs(u: Units, cluster: ClusterSpec, c: CostConstants, links: LinkConstants) -> dict[str, np.ndarray]:
    """Each unit's seconds on its path, alone (``cost``), split into its per-message part
    (``alpha``) and its uplink part (``network``); and per candidate the busiest uplink's and
    server's PS seconds (``ps_network``, ``ps_server``) and the busiest server's bytes."""
    workers = cluster.num_workers
    route = u.route
    is_hier, is_gather = route == HIER, route == GATHER
    is_ps = (route == PS) | (route == PS_ASYNC)
    ring_byte = c.ring_byte_scale * links.ring_s_per_byte
    ps_byte = c.ps_byte_scale * links.ps_s_per_byte
    server_byte = c.ps_server_scale * links.cpu_s_per_byte
    ps_network, ps_server, max_server, net_imbalance, cpu_imbalance = _ps_load_terms(u, cluster, ps_byte, server_byte)
    network = u.wire_bytes * np.select([route == RING, is_hier, is_gather, is_ps],
                                       [ring_byte, c.hier_byte_scale * links.hier_s_per_byte,
                                        ring_byte * workers / 2, ps_byte * net_imbalance[:, None]], 0.0)
    ps_cpu = u.wire_bytes * cpu_imbalance[:, None] * 2 * workers / max(cluster.num_servers, 1) * server_byte
    # ring all-reduce ops are paid per Horovod op, not per message (its fusion: _fused_channel_end)
    alpha = (np.where(is_hier, c.hier_alpha_scale * links.hier_alpha_s * u.messages, 0.0)
             + c.ps_alpha_scale * links.ps_alpha_s * u.keys)
    cost = np.where(u.messages > 0, alpha + network + np.where(is_ps, ps_cpu, 0.0), 0.0)
    if workers == 1:
        cost, ps_network, ps_server = np.zeros_like(cost), np.zeros_like(ps_network), np.zeros_like(ps_server)
    return {"cost": cost, "alpha": alpha, "network": np.where(is_ps, 0.0, network), "ps_network": ps_network,
            "ps_server": ps_server, "max_server_bytes": max_server}


def analytic_terms(arrays: ModelArrays, u: Units, cluster: ClusterSpec, constants: CostConstants,
                   links: LinkConstants | None = None) -> dict[str, np.ndarray]:
    """Predicted step time (``step_s``) of every candidate and the terms it is made of (``TERMS``);
    ``links``: the cluster's paths (default: ``nominal_links(cluster)``)."""
    c = constants
    links = links or nominal_links(cluster)
    costs = message_costs(u, cluster, c, links)
    cost = costs["cost"]
    route = u.route
    is_ring, is_hier, is_gather = route == RING, route == HIER, route == GATHER
    scale = slowdown(cluster, c)
    backward = scale * arrays.backward_s
    ready = scale * u.ready_s
    active = u.messages > 0
    is_async = (route == PS_ASYNC) & active
    ring_alpha = c.ring_alpha_scale * links.ring_alpha_s if cluster.num_workers > 1 else 0.0
    ring_end, ring_ops = _fused_channel_end(ready, cost, (is_ring | is_gather) & active, ring_alpha)
    # hierarchical messages start as their node's ranks submit them, one after the other (the router's
    # staged order, the first step's ready order, agreed by the ranks)
    hier_busy = np.where(is_hier & active, cost, 0.0).sum(axis=1)
    hier_end = _channel_end(ready, cost, is_hier & active)
    ps_end = _channel_end(ready, cost, (route == PS) & active)
    busy = np.stack([np.where((is_ring | is_gather) & active, cost, 0.0).sum(axis=1) + ring_ops * ring_alpha,
                     hier_busy, np.where((route == PS) & active, cost, 0.0).sum(axis=1)], axis=1)
    synchronous = active & ~is_async
    first_ready = np.where(synchronous, ready, np.inf).min(axis=1)
    first_ready = np.where(np.isfinite(first_ready), first_ready, backward)
    uplink_s = costs["network"].sum(axis=1) + costs["ps_network"]
    # channels run at once, but share the cores and the uplink: each other channel's busy
    # time counts for ``concurrency_penalty`` of itself
    contention = c.concurrency_penalty * (busy.sum(axis=1) - busy.max(axis=1))
    comm_end = np.maximum.reduce([ring_end, hier_end, ps_end, first_ready + uplink_s,
                                  first_ready + costs["ps_server"]]) + contention
    # ASP/SSP: the parameters go after synchronize() and the local step, one after the other
    async_s = c.async_scale * np.where(is_async, cost, 0.0).sum(axis=1)
    exposed = np.maximum(comm_end - backward, 0.0) + async_s
    cpu = (links.cpu_s_per_byte * (c.densify_scale * u.densified_bytes + c.fp16_scale * (u.fp16_bytes - u.fp16_ps_bytes)
                                   + c.fp16_ps_scale * u.fp16_ps_bytes)
           + c.piece_s * u.merged_pieces + c.fp16_piece_s * u.fp16_pieces)
    compute = scale * (arrays.forward_s + arrays.optimizer_s + arrays.other_s) + backward + cpu
    synced = active.any(axis=1) & (cluster.num_workers > 1)
    # a per-variable overhead was tried: fit on models of 12-38 variables it overpredicted the
    # 110-variable one by 1.3-1.5x when held out, so one fixed cost per step remains
    step = compute + exposed + np.where(synced, c.step_overhead_s, 0.0)
    n = len(step)
    return {"step_s": step, "compute_s": compute, "backward_s": np.full(n, backward), "comm_end_s": comm_end,
            "exposed_s": exposed, "ring_s": ring_end, "hier_s": hier_end, "ps_s": ps_end, "ps_async_s": async_s,
            "contention_s": contention, "ps_network_s": costs["ps_network"], "ps_server_s": costs["ps_server"],
            "uplink_s": uplink_s, "alpha_s": costs["alpha"].sum(axis=1) + ring_ops * ring_alpha, "cpu_s": cpu,
            "max_server_bytes": costs["max_server_bytes"], "slowdown": np.full(n, scale)}


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


def _ps_load_terms(u: Units, cluster: ClusterSpec, ps_byte: float, server_byte: float) -> tuple[np.ndarray, ...]:
    """Per candidate: the busiest uplink's PS seconds, the busiest server's CPU seconds, its
    bytes, and how much busier than under perfect balance the busiest uplink and server are
    (``ps_byte``: seconds per byte of a balanced push-pull; ``server_byte``: a server's CPU per byte)."""
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
    even_out = total * ps_factor(cluster)
    net_imbalance = np.where(even_out > 0, out / np.maximum(even_out, 1e-9), 1.0)
    cpu_imbalance = np.where(total > 0, busiest * cluster.num_servers / np.maximum(total, 1e-9), 1.0)
    return (total * net_imbalance * ps_byte, busiest * 2 * workers * server_byte, busiest, net_imbalance,
            cpu_imbalance)


class Problem(NamedTuple):
    """One (model, cluster)'s encoded candidates and their measured step times in seconds."""

    arrays: ModelArrays
    units: Units
    cluster: ClusterSpec
    measured: np.ndarray
    links: LinkConstants | None = None
    """The cluster's paths (``None``: ``nominal_links``)."""
    jobs: np.ndarray | None = None
    """Each trial's job (any labels; ``None``: one job): levels are taken out per job."""
    positions: np.ndarray | None = None
    """Each trial's place in its job, 0 to 1 (``Sample.job_position``; ``None``: no drift fitted)."""


def job_residuals(log_ratio: np.ndarray, jobs: np.ndarray, positions: np.ndarray | None, *,
                  level_weight: float, drift_shrink: float = 0.5) -> np.ndarray:
    """``log_ratio`` (log predicted / measured per trial) with each job's level and drift
    weighed down: a job's mean is kept at ``level_weight`` (0: only differences within a job
    count; 1: all of it), and its linear trend over the job's wall time (``positions``) is
    taken out, shrunk towards none by ``drift_shrink`` (a job of a few trials has no trend to
    speak of). Step times of one job share a level and drift that no strategy causes."""
    out = np.array(log_ratio, dtype=float)
    for job in np.unique(jobs):
        mine = jobs == job
        level = out[mine].mean()
        if positions is not None and mine.sum() > 2:
            x = positions[mine] - positions[mine].mean()
            out[mine] -= x * float((x * (out[mine] - level)).sum() / ((x * x).sum() + drift_shrink))
        out[mine] -= (1.0 - level_weight) * level
    return out


def with_compute_factor(arrays: ModelArrays, u: Units, factor: float) -> tuple[ModelArrays, Units]:
    """``arrays`` and ``u`` with every profiled phase and ready time multiplied by ``factor``: the
    description as its trials ran, when its profile ran ``1 / factor`` times as long."""
    if factor == 1.0:
        return arrays, u
    return (dataclasses.replace(arrays, forward_s=arrays.forward_s * factor, backward_s=arrays.backward_s * factor,
                                optimizer_s=arrays.optimizer_s * factor, other_s=arrays.other_s * factor,
                                ready_s=arrays.ready_s * factor),
            dataclasses.replace(u, ready_s=u.ready_s * factor))


def fit_constants(problems: Sequence[Problem | tuple], initial: CostConstants | None = None, *,
                  prior_weight: float = 0.05, max_evaluations: int = 400, level_weight: float = 0.3,
                  detrend: bool = True) -> CostConstants:
    """Least squares of log(predicted / measured) over every trial (``job_residuals``: each job's
    level at ``level_weight``, its drift taken out where ``detrend``), in the log of the
    ``FITTED`` constants (each within a factor e^4 of ``initial``, the penalty at most 1),
    with a weak pull (``prior_weight`` per unit of log) towards ``initial`` so that constants
    the data cannot see keep their defaults; a robust loss keeps a few noisy trials from
    dragging them. ``ValueError`` without trials. Takes every description's profile as its
    trials ran (``fit_constants_and_compute`` does not)."""
    return _fit(problems, initial, prior_weight=prior_weight, max_evaluations=max_evaluations,
                level_weight=level_weight, detrend=detrend, compute_factors=False)[0]


def fit_constants_and_compute(problems: Sequence[Problem | tuple], initial: CostConstants | None = None, *,
                              prior_weight: float = 0.05, factor_weight: float = 0.05, max_evaluations: int = 400,
                              level_weight: float = 0.3, detrend: bool = True) -> tuple[CostConstants, dict[str, float]]:
    """``fit_constants``, and one compute factor per training description (``ModelArrays.name``):
    how much faster or slower than profiled its compute ran in its trials (``with_compute_factor``;
    within e^-3..e^3, pulled towards 1 by ``factor_weight`` per unit of log). A profile taken on a
    loaded machine is then that description's own error, not the software's: ``compute_scale``, the
    slowdown all share, is fitted >= 1 (a step's compute never runs faster than its profile), so a
    model the fit never saw is priced by its own profile times that. The factors describe the
    training set only (and where its profiles disagree with its trials)."""
    return _fit(problems, initial, prior_weight=prior_weight, max_evaluations=max_evaluations, level_weight=level_weight,
                detrend=detrend, compute_factors=True, factor_weight=factor_weight)


def _fit(problems: Sequence[Problem | tuple], initial: CostConstants | None, *, prior_weight: float,
         max_evaluations: int, level_weight: float, detrend: bool, compute_factors: bool,
         factor_weight: float = 0.05) -> tuple[CostConstants, dict[str, float]]:
    from scipy.optimize import least_squares
    from scipy.sparse import lil_matrix

    initial = initial or CostConstants()
    problems = [Problem(*p) for p in problems]
    if not problems or sum(len(p.measured) for p in problems) == 0:
        raise ValueError("fit_constants: no measured trials to fit the analytic model to")
    for p in problems:
        if not np.all(np.isfinite(p.measured)) or np.any(p.measured <= 0):
            raise ValueError(f"fit_constants: {p.arrays.name} on {p.cluster}: step times must be finite and > 0")
    names = sorted({p.arrays.name for p in problems}) if compute_factors else []
    column = {name: len(FITTED) + k for k, name in enumerate(names)}
    x0 = np.concatenate([np.log([getattr(initial, name) for name in FITTED]), np.zeros(len(names))])
    log_measured = [np.log(p.measured) for p in problems]
    jobs = [np.zeros(len(p.measured), int) if p.jobs is None else np.asarray(p.jobs) for p in problems]
    positions = [p.positions if detrend else None for p in problems]
    weights = np.array([prior_weight] * len(FITTED) + [factor_weight] * len(names))

    def residuals(x: np.ndarray) -> np.ndarray:
        constants = dataclasses.replace(initial, **dict(zip(FITTED, np.exp(x[:len(FITTED)]))))
        parts = []
        for p, measured, job, position in zip(problems, log_measured, jobs, positions):
            arrays, u = p.arrays, p.units
            if compute_factors:
                arrays, u = with_compute_factor(arrays, u, float(np.exp(x[column[arrays.name]])))
            step = analytic_terms(arrays, u, p.cluster, constants, p.links)["step_s"]
            parts.append(job_residuals(np.log(step) - measured, job, position, level_weight=level_weight))
        return np.concatenate(parts + [weights * (x - x0)])

    upper = np.array([0.0 if name in BOUNDED else x + 4.0 for name, x in zip(FITTED, x0)] + [3.0] * len(names))
    lower = np.concatenate([x0[:len(FITTED)] - 4.0, [-3.0] * len(names)])
    sparsity = None
    if compute_factors:
        # a step's compute never runs faster than its profile: a profile that ran slow is its own factor
        lower[FITTED.index("compute_scale")] = 0.0
        # a description's factor moves only its own trials' residuals
        sparsity = lil_matrix((sum(len(m) for m in log_measured) + len(x0), len(x0)), dtype=np.int8)
        row = 0
        for p, measured in zip(problems, log_measured):
            sparsity[row:row + len(measured), :len(FITTED)] = 1
            sparsity[row:row + len(measured), column[p.arrays.name]] = 1
            row += len(measured)
        for j in range(len(x0)):
            sparsity[row + j, j] = 1
    start = np.clip(x0, lower + 1e-9, upper - 1e-9)
    result = least_squares(residuals, start, method="trf", loss="soft_l1", f_scale=0.3, max_nfev=max_evaluations,
                           bounds=(lower, upper), jac_sparsity=sparsity)
    constants = dataclasses.replace(initial, **{name: float(v) for name, v in
                                                zip(FITTED, np.exp(result.x[:len(FITTED)]))})
    return constants, {name: float(np.exp(result.x[column[name]])) for name in names}
