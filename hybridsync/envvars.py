"""Every environment variable hybridsync reads or sets, named once.

Code that reads or sets one imports its name from here, so a rename or a search for
who uses a variable needs one place. Three vocabularies: hybridsync's own settings,
BytePS's launch variables (the parameter-server route speaks them, so a BytePS job
script works unchanged) and the variables Horovod's launchers set per rank. Every name has
a docstring: the docs' environment variable reference (docs/reference/environment.md) is
generated from this module, section by section.
"""
from __future__ import annotations

import math
import os
from typing import overload

# --- hybridsync's own -----------------------------------------------------------------
STRATEGY = "HYBRIDSYNC_STRATEGY"
"""Path of the strategy file every rank loads when the optimizer gets no ``strategy=``."""
WAIT = "HYBRIDSYNC_WAIT"
"""``spin`` (Horovod's wait) or ``sleep`` (yield the core while waiting for a handle)."""
STALL_CHECK_S = "HYBRIDSYNC_STALL_CHECK_S"
"""Seconds every rank must have waited, each at an unchanged point, before ranks waiting at
different points are an error (``hybridsync.backends.stalls``; default 3, 0 turns it off)."""
PEER_TIMEOUT = "HYBRIDSYNC_PEER_TIMEOUT"
"""Seconds a hierarchical all-reduce waits for a rank of its group that its host no longer answers
for (the network between the nodes cut, or the host down) before it fails naming that rank (10)."""
PEER_HUNG_TIMEOUT = "HYBRIDSYNC_PEER_HUNG_TIMEOUT"
"""Seconds a hierarchical all-reduce waits for a rank of its group whose host answers but whose
process does not (stopped or deadlocked) before it fails naming that rank (default:
``HOROVOD_GLOO_TIMEOUT_SECONDS``, else 30, when plain Horovod gives up on such a rank too)."""
INTRA_NODE = "HYBRIDSYNC_INTRA_NODE"
"""Hierarchical route within a node: ``shm`` (shared memory) or ``horovod`` (Gloo collectives)."""
PS_TRANSPORT = "HYBRIDSYNC_PS_TRANSPORT"
"""TensorPipe transports of the parameter-server route: ``tcp`` (default) or ``auto``."""
PS_RECOVERY_TIMEOUT = "HYBRIDSYNC_PS_RECOVERY_TIMEOUT"
"""Seconds a PS worker waits for a dead server's replacement before failing (default: 60 for a
supervised server, 0 for one nobody replaces; set it when another launcher restarts servers)."""
PS_PING_TIMEOUT = "HYBRIDSYNC_PS_PING_TIMEOUT"
"""Seconds a parameter server may leave a worker's ping unanswered before the worker calls it hung (10)."""
PS_JOIN_TIMEOUT = "HYBRIDSYNC_PS_JOIN_TIMEOUT"
"""Seconds a PS worker waits, in all, for the rendezvous store, the RPC group and every server before
it fails naming what it waited for (default 120; a notice on stderr every 10 s says what it awaits)."""
PS_SUPERVISED = "HYBRIDSYNC_PS_SUPERVISED"
"""Set by ``hybridsync-server --supervise`` for the server it runs: the supervisor hosts the
rendezvous store (server 0's) and replaces the server if it dies."""
EMULATED_PROCESSES_PER_CORE = "HYBRIDSYNC_EMULATED_PROCESSES_PER_CORE"
"""Most processes (ranks and parameter servers) an emulated cluster may run per core of this
machine (default 8; 0: no bound). A bigger spec is refused before anything is built: that many
processes to a core measure the cores, not the links, and a 40 x 16 spec would start 640 ranks."""
TF_OVERLAP_BYTES = "HYBRIDSYNC_TF_OVERLAP_BYTES"
"""TensorFlow graphs on the bridge: bytes of gradients per group handed to the runtime while the
backward pass runs (default ``TF_OVERLAP_BYTES_DEFAULT``); 0 hands them all over after it, at once."""
TF_OVERLAP_BYTES_DEFAULT = 1 << 20
FAILURE_NOTES = "HYBRIDSYNC_FAILURE_NOTES"
"""Folder where each rank notes its uncaught exception, so that ``hybridsync-run`` names the rank whose
error ended a failed job (``hybridsync.failure_notes``); ``hybridsync-run`` sets it, for this host's ranks."""
PROFILE = "HYBRIDSYNC_PROFILE"
"""Path: profile this single-process job's first ``DistributedOptimizer``, write the model description, exit 0."""
PROFILE_STEPS = "HYBRIDSYNC_PROFILE_STEPS"
"""Steps the profile takes its medians over (default ``PROFILE_STEPS_DEFAULT``)."""
PROFILE_WARMUP = "HYBRIDSYNC_PROFILE_WARMUP"
"""Steps run unprofiled before them (default ``PROFILE_WARMUP_DEFAULT``)."""
PROFILE_STEPS_DEFAULT = 10
PROFILE_WARMUP_DEFAULT = 3

# --- BytePS's launch vocabulary (parameter-server route) -------------------------------
DMLC_ROLE = "DMLC_ROLE"
"""``server`` or ``worker``: what this process is in a parameter-server job."""
DMLC_NUM_WORKER = "DMLC_NUM_WORKER"
"""Worker processes in the job (a BSP step waits for this many pushes)."""
DMLC_NUM_SERVER = "DMLC_NUM_SERVER"
"""Parameter servers in the job; set (and not 0) in a worker, ``hs.init()`` connects to them."""
DMLC_PS_ROOT_URI = "DMLC_PS_ROOT_URI"
"""Host of server 0, which hosts the rendezvous."""
DMLC_PS_ROOT_PORT = "DMLC_PS_ROOT_PORT"
"""Rendezvous port on ``DMLC_PS_ROOT_URI``."""
DMLC_SERVER_ID = "DMLC_SERVER_ID"
"""A server's index, 0 .. ``DMLC_NUM_SERVER`` - 1."""
DMLC_WORKER_ID = "DMLC_WORKER_ID"
"""A worker's index, 0 .. ``DMLC_NUM_WORKER`` - 1 (unset: the launcher's rank, ``LAUNCHER_RANKS``)."""
DMLC_NODE_HOST = "DMLC_NODE_HOST"
"""A server's own address, as BytePS names it: set by the launchers for each server they place on a
known host, for server programs that read it (``hybridsync-server`` does not need it)."""
PARTITION_BYTES = "BYTEPS_PARTITION_BYTES"
"""The largest parameter-server key, in bytes (``hybridsync.placement.DEFAULT_PARTITION_BYTES``)."""

# --- set per rank by launchers ---------------------------------------------------------
HOROVOD_RANK = "HOROVOD_RANK"
"""This process's rank, as horovodrun sets it."""
LAUNCHER_RANKS = (HOROVOD_RANK, "OMPI_COMM_WORLD_RANK", "PMI_RANK")
"""A process's rank as horovodrun, Open MPI's and PMI launchers set it (a PS worker id fallback)."""
HOROVOD_ELASTIC = "HOROVOD_ELASTIC"
"""``1`` in every rank of an elastic Horovod job (``horovodrun --min-np/--max-np/--host-discovery-script``)."""
HOROVOD_GLOO_TIMEOUT = "HOROVOD_GLOO_TIMEOUT_SECONDS"
"""Horovod's bound on one Gloo operation (horovodrun's ``--gloo-timeout-seconds``; Horovod's default 30)."""
INTERFACE = ("HOROVOD_GLOO_IFACE", "GLOO_SOCKET_IFNAME")
"""The network interface Gloo uses, as horovodrun and torch spell it (first one set wins)."""

# --- set by the trial runner (hybridsync-run --autotune) in the jobs it starts ---------
TRIALS = "HYBRIDSYNC_TRIALS"
"""Schedule (JSON lines) of strategies a training script's optimizer measures in flight
(``hybridsync.hooks.trials``); set by the trial runner for ``hybridsync-run --autotune``."""
TRIALS_RESULTS = "HYBRIDSYNC_TRIALS_RESULTS"
"""Where rank 0 appends the trials' events (JSON lines)."""
TRIALS_WARMUP = "HYBRIDSYNC_TRIALS_WARMUP"
"""Steps after each switch that are recorded but not timed."""
TRIALS_STEPS = "HYBRIDSYNC_TRIALS_STEPS"
"""Timed steps per trial."""
TRIALS_SETTLE_S = "HYBRIDSYNC_TRIALS_SETTLE_S"
"""Seconds a trial job runs before its first trial counts (``TrialProtocol.settle_s``)."""

# --- test hooks ------------------------------------------------------------------------
STORE_HOLD_S = "HYBRIDSYNC_STORE_HOLD_S"
"""Seconds ``TrialStore.add`` sleeps inside its transaction, before the commit (a test hook:
lets a test kill a writer mid-transaction, or make writers contend for the lock)."""
TRIAL_FAULT = "HYBRIDSYNC_TRIAL_FAULT"
"""Fault injection for the trial runner's tests (``hybridsync.trials.worker``): comma-separated
``KIND:crash`` / ``KIND:hang`` make the last rank exit (or stop responding) at a candidate of that kind."""
TRIAL_REPLICA_SUMS = "HYBRIDSYNC_TRIAL_REPLICA_SUMS"
"""``1``: the trial worker also reports every rank's sum of the trained parameters after each trial
(its tests check that synchronized copies stay equal across ranks and the local step's do not)."""


@overload
def seconds_from_env(name: str, default: float) -> float: ...
@overload
def seconds_from_env(name: str, default: None) -> float | None: ...
def seconds_from_env(name: str, default: float | None) -> float | None:
    """The seconds in environment variable ``name`` (``default`` if unset or blank); ``ValueError``
    naming the variable for anything else than a finite number >= 0 (``sleep(nan)`` and a negative
    timeout would fail later, far from the variable that caused them)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a number of seconds >= 0, got {raw!r}")
    return value


def int_from_env(name: str, default: int, minimum: int) -> int:
    """The integer in environment variable ``name`` (``default`` if unset or empty); ``ValueError``
    naming the variable for anything else than an integer >= ``minimum``."""
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{name}={raw!r}: expected an integer >= {minimum}")
    return value
