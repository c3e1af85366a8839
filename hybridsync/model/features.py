"""Fixed-length, model-agnostic features of (model description, cluster, strategy) for the runtime simulator's
learned part (XGBoost).

One row per candidate, the same columns for every model and cluster (``FEATURE_NAMES``),
computed from a batch's ``Units`` and the analytic model's terms with whole-array numpy
operations, so thousands of candidates of one (description, cluster) featurize at once:

- cluster: nodes, ranks per node, ranks, servers, uplink rate, latency;
- strategy: per route the share of the model's bytes, messages and units; fp16, sparse,
  densified and parameter-server shares; the busiest server's share; PS keys; merged and
  fp16 pieces; how many routes are mixed; a histogram of message sizes; overlap estimates
  (where in the backward pass the bytes become ready);
- the analytic model's terms relative to its prediction of plain Horovod on the same model
  and cluster, and how much of plain Horovod's step is exposed communication
  (``ANALYTIC_FEATURES``: left out when the learned model runs alone, to measure what the
  analytic part adds).

Nothing names a model: no sizes in bytes or seconds, no variable count, no profiled phase.
Trees trained on a few models split on such columns to tell the models apart, which
teaches them nothing about the next one; shares and ratios mean the same for a model of
any size, so a model the training set never saw still lands inside the trees' ranges.
"""
from __future__ import annotations

import numpy as np

from hybridsync.cluster.spec import ClusterSpec
from hybridsync.model.analytic import TIME_TERMS
from hybridsync.model.encoding import GATHER, HIER, PS, PS_ASYNC, RING, ROUTE_NAMES, ModelArrays, Units

SIZE_BINS = (16 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)
"""Message-size histogram edges in bytes: <16 KiB, <256 KiB, <1 MiB, <4 MiB, larger."""
_ROUTES = (RING, HIER, PS, PS_ASYNC, GATHER)
_BASE = (["nodes", "workers_per_node", "workers", "servers", "log_uplink_bytes_per_s", "latency_ms"]
         + [f"{route}_{what}" for route in ROUTE_NAMES for what in ("bytes_share", "messages", "units")]
         + ["wire_share", "messages", "units", "routes_used", "fp16_share", "sparse_wire_share",
            "densified_share", "ps_keys", "max_server_share", "balanced_ps_share", "largest_key_share",
            "merged_pieces", "fp16_pieces"]
         + [f"messages_under_{edge // 1024}k" for edge in SIZE_BINS] + ["messages_over_4096k"]
         + ["ready_mean_share", "late_bytes_share", "first_ready_share"])
ANALYTIC_FEATURES = (tuple(f"relative_{term}" for term in TIME_TERMS)
                     + ("relative_log_step_s", "analytic_exposed_share", "reference_exposed_share"))
"""The analytic model's outputs as features."""
FEATURE_NAMES = tuple(_BASE) + ANALYTIC_FEATURES
"""Column names of ``feature_matrix``, in order."""


def feature_matrix(arrays: ModelArrays, u: Units, cluster: ClusterSpec, terms: dict[str, np.ndarray], *,
                   reference: dict[str, np.ndarray]) -> np.ndarray:
    """(N, len(FEATURE_NAMES)) float32 features of a batch's units (``encoding.units``), its
    analytic terms (``analytic.analytic_terms``) and those of plain Horovod on the same model
    and cluster (``analytic.reference_terms``), whose step time the relative terms divide by."""
    n = u.wire_bytes.shape[0]
    model_bytes = max(float(arrays.nbytes.sum()), 1.0)
    uplink = cluster.inter_node_bytes_per_second
    active = u.messages > 0
    columns: list[np.ndarray | float] = [
        cluster.nodes, cluster.workers_per_node, cluster.num_workers, cluster.num_servers, np.log10(uplink),
        cluster.inter_node_latency_ms]
    for route in _ROUTES:
        mine = u.route == route
        columns += [np.where(mine, u.wire_bytes, 0.0).sum(axis=1) / model_bytes,
                    np.where(mine, u.messages, 0).sum(axis=1), (mine & active).sum(axis=1)]
    wire = u.wire_bytes.sum(axis=1)
    used = np.stack([(active & (u.route == route)).any(axis=1) for route in _ROUTES], axis=1)
    columns += [wire / model_bytes, u.messages.sum(axis=1), active.sum(axis=1),
                used.sum(axis=1), u.fp16_bytes / model_bytes, u.sparse_bytes.sum(axis=1) / model_bytes,
                u.densified_bytes / model_bytes, u.keys.sum(axis=1), terms["max_server_bytes"] / model_bytes,
                u.balanced_bytes / model_bytes, u.largest_key / model_bytes, u.merged_pieces, u.fp16_pieces]
    per_message = np.where(active, u.wire_bytes / np.maximum(u.messages, 1), -1.0)
    lower = 0.0
    for edge in SIZE_BINS + (np.inf,):
        columns.append(np.where(active & (per_message >= lower) & (per_message < edge), u.messages, 0).sum(axis=1))
        lower = edge
    backward = max(arrays.backward_s, 1e-9)
    ready_share = u.ready_s / backward
    weights = np.where(active, u.wire_bytes, 0.0)
    safe_wire = np.maximum(weights.sum(axis=1), 1.0)
    columns += [(weights * ready_share).sum(axis=1) / safe_wire,
                np.where(ready_share >= 0.8, weights, 0.0).sum(axis=1) / safe_wire,
                np.where(active, ready_share, np.inf).min(axis=1, initial=np.inf)]
    columns[-1] = np.where(np.isfinite(columns[-1]), columns[-1], 1.0)
    reference_s = float(reference["step_s"][0])
    columns += [terms[term] / reference_s for term in TIME_TERMS] + [np.log(terms["step_s"] / reference_s)]
    columns += [terms["exposed_s"] / terms["step_s"], float(reference["exposed_s"][0]) / reference_s]
    out = np.empty((n, len(FEATURE_NAMES)), dtype=np.float32)
    for j, column in enumerate(columns):
        out[:, j] = column
    return out
