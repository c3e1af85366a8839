"""Hierarchical all-reduce, selectable per message.

Three steps: reduce within the node, all-reduce across nodes, share within the node.
Each rank of a node carries its own ``1/local_size`` slice of the node's sum across nodes
(all-reducing it with the ranks that share its local rank on the other nodes, the
``cross_node`` group of ``groups``, built when a plan first uses this route and never a
Horovod process set, so a job pays nothing for the route unless it uses it), so every
rank's uplink is busy at once and each carries ``1/local_size`` of the message: the
cross-node traffic of the bandwidth-optimal form Horovod uses with NCCL.

The intra-node steps go through one of two transports (``HYBRIDSYNC_INTRA_NODE``):

- ``shm`` (default): the node's ranks map one ``/dev/shm`` segment per message
  (``node_memory``, ``shm``); each writes the parts of its message the others
  sum, sums its own slice of everyone's, and copies each rank's final slice out the moment
  that rank publishes it. No intra-node bytes on any socket and no intra-node collective.
  Chosen on x86-64 when every node's ranks are seen to share the segment (and each other's
  pids); otherwise (ranks of a node in separate containers, say) the job warns once and
  uses ``horovod``.
- ``horovod`` (the default in elastic Horovod jobs): a Gloo all-reduce of the whole message
  within the node's group, then the cross-node step on the slice, then an all-gather of the
  slices within the node. Moves about twice a reduce-scatter's bytes within the node:
  Horovod 0.28.1's Gloo ``reducescatter`` on a process set intermittently returned wrong
  sums (one contribution counted twice) and sometimes hung for 64 MiB buffers on the
  emulated cluster (``tests/workers/reducescatter_stress.py`` reproduces it). The fallback:
  the shared segment is several times faster (benchmarks/RESULTS.md, collectives.py).

A message's tensors travel as one flat buffer padded to a multiple of the node size, so
every rank's slice has the same length. Where one level has a single member (one node,
or one rank per node) the cross-node step is left out, or is the whole of it; where that
leaves one Horovod all-reduce over the job (``one_collective``), ``make_backend`` uses the
ring instead.
"""
from __future__ import annotations

import os
import uuid
import warnings
from typing import Any, Sequence

import torch

from hybridsync.backends.hierarchical import node_memory
from hybridsync import envvars
from hybridsync.backends.base import Reduction, RouteUnavailableError, StagedBackend
from hybridsync.backends.hierarchical.flat_buffers import (buffer_dtype, copy_out, flatten_padded, node_slice,
                                                        padded_length)
from hybridsync.backends.hierarchical.shm import SharedMemoryHandle
from hybridsync.backends.hierarchical.node_memory import SHM_DIR, NodeSegment, PeerExitedError, segment_path
from hybridsync.backends.waiting import barrier
from hybridsync.backends.hierarchical.groups import (HierarchicalGroups, Work, hierarchical_groups,
                                                     release_hierarchical_groups)
from hybridsync.backends.hierarchical.layout import node_layout

INTRA_NODE_VAR = envvars.INTRA_NODE
INTRA_NODE_CHOICES = ("shm", "horovod")


def start_first_step(flat: torch.Tensor, groups: HierarchicalGroups, name: str) -> Work:
    """Starts the in-place sum of ``flat`` within the node (or, with one rank per node, across nodes)."""
    group = groups.intra_node if groups.intra_node is not None else groups.cross_node
    assert group is not None, "a job of one rank has no hierarchical groups"
    return group.allreduce_async(flat, f"{name}.iar" if groups.intra_node is not None else f"{name}.ar")


def finish_across_nodes(node_sum: torch.Tensor, groups: HierarchicalGroups, name: str) -> torch.Tensor:
    """Steps 2 and 3 on a buffer already summed within the node: the global sum, padded length."""
    # hierarchical_groups() checked that local rank == position in the node's group (ranks laid
    # out node by node), which is the order in which all-gather concatenates the slices.
    shard = node_slice(node_sum, groups.local_size, groups.local_rank)
    groups.cross_node.allreduce_async(shard, f"{name}.ar").wait()
    return groups.intra_node.allgather(shard, f"{name}.ag")


class _GlooIntraNodeHandle:
    """``horovod`` intra-node transport: all three steps run in ``wait()``.

    The router waits messages in one order on every rank, and a group's collectives must be
    issued in the same order by all its members, so nothing starts at submit (the order in
    which gradients become ready is not guaranteed to be the same on every rank), and nothing
    in ``advance`` (its first step is a collective within the node, which would block).
    """

    def __init__(self, backend: "HierarchicalAllreduce", name: str, tensors: Sequence[torch.Tensor],
                 reduction: Reduction) -> None:
        self._backend, self._name, self._tensors, self._reduction = backend, name, tensors, reduction

    def advance(self) -> bool:
        """Never starts early (see the class): everything runs in ``wait()``."""
        return False

    def wait(self) -> None:
        groups = self._backend.groups
        flat, _ = flatten_padded(self._tensors, groups.local_size)
        if self._reduction.prescale_factor != 1.0:
            flat.mul_(self._reduction.prescale_factor)
        start_first_step(flat, groups, self._name).wait()  # in place: flat now holds the node's sum (or the total)
        both_levels = groups.intra_node is not None and groups.cross_node is not None
        total = finish_across_nodes(flat, groups, self._name) if both_levels else flat
        copy_out(total, self._tensors, self._reduction.result_factor(self._backend.hvd.size()))


class HierarchicalAllreduce(StagedBackend):
    """Per-message hierarchical all-reduce over the node / local-rank groups (``groups``)."""

    def __init__(self, intra_node: str | None = None) -> None:
        """``intra_node``: ``shm`` or ``horovod``; by default ``HYBRIDSYNC_INTRA_NODE`` (or ``shm``).
        Collective: every rank constructs it at the same point."""
        import horovod.torch as hvd
        self.hvd = hvd
        layout, problem = node_layout()
        # Every rank must agree before any of them builds groups, or one would hang.
        problems = [p for p in hvd.allgather_object(problem, name="hybridsync.hierarchical_check") if p]
        if problems:
            raise RouteUnavailableError(f"hierarchical all-reduce is not available: {problems[0]} "
                                        f"(reported by {len(problems)} of {hvd.size()} ranks)")
        self.groups = groups = hierarchical_groups(hvd, layout)
        self._node_pids: list[int] = []
        self.intra_node = self._choose_intra_node(intra_node) if groups.intra_node is not None else "horovod"
        self._segments: dict[str, NodeSegment] = {}
        self._uses: dict[str, int] = {}

    def _choose_intra_node(self, asked: str | None) -> str:
        """``shm`` where asked for and every node's ranks share a probe segment; agreed by all ranks.

        An elastic job defaults to ``horovod``: a rank whose step failed leaves its node peers'
        Gloo collectives failing at once (``forget_world``), where in shared memory a peer
        could wait on its counters while it re-forms the job."""
        hvd, groups = self.hvd, self.groups
        default = "horovod" if os.environ.get(envvars.HOROVOD_ELASTIC) == "1" else "shm"
        choice = asked or os.environ.get(INTRA_NODE_VAR, default).strip().lower() or default
        if choice not in INTRA_NODE_CHOICES:
            raise ValueError(f"{INTRA_NODE_VAR} must be one of {', '.join(INTRA_NODE_CHOICES)}, got {choice!r}")
        self.job_token = hvd.broadcast_object(uuid.uuid4().hex if hvd.rank() == 0 else None, root_rank=0,
                                              name="hybridsync.node_memory_token")
        probe, problem = None, None
        if choice == "shm" and not node_memory.supported():
            problem = f"this machine ({os.uname().machine}) does not order stores as the shared counters need"
        elif choice == "shm":
            try:
                probe = NodeSegment(segment_path(self.job_token, hvd.cross_rank(), "probe"), groups.local_size,
                                    1, torch.float64, hvd.local_rank())
                probe.inputs[hvd.local_rank()][0] = hvd.rank() + 1
            except OSError as e:
                problem = f"rank {hvd.rank()} cannot map a segment in {SHM_DIR}: {e}"
        barrier(hvd, "hybridsync.node_memory_probe")  # every rank has written its probe
        if probe is not None:
            problem = _probe_problem(probe, self.node_ranks(), hvd.rank())
        answers = hvd.allgather_object((choice, problem), name="hybridsync.node_memory_check")
        if probe is not None:
            self._node_pids = [int(pid) for pid in probe.pids]
            probe.unlink()
        choices = {c for c, _ in answers}
        if len(choices) > 1:
            raise RouteUnavailableError(f"ranks disagree on {INTRA_NODE_VAR}: "
                                        f"{', '.join(repr(c) for c, _ in answers)} (by rank)")
        problems = [p for _, p in answers if p]
        if choice == "shm" and problems:
            if hvd.rank() == 0:
                warnings.warn(f"hierarchical all-reduce uses Horovod within nodes instead of shared "
                              f"memory: {problems[0]}", RuntimeWarning, stacklevel=2)
            return "horovod"
        return choice

    @property
    def one_collective(self) -> bool:
        """Whether each message would be one all-reduce over the whole job through Horovod, run in
        ``wait()``: one rank per node, or one node whose ranks do not share memory (``horovod``
        within it). That is the ring's all-reduce without its overlap and fusion (3x1: 495 vs
        181 ms a step), so ``make_backend`` gives the route the ring's backend then. One node
        through shared memory is another transport, faster for large messages (benchmarks/RESULTS.md)."""
        return self.intra_node == "horovod" and (self.groups.intra_node is None or self.groups.cross_node is None)

    def node_ranks(self) -> list[int]:
        """The ranks of this rank's node, by local rank (``hierarchical_groups`` checked that ranks are laid out
        node by node)."""
        first = self.hvd.cross_rank() * self.groups.local_size
        return list(range(first, first + self.groups.local_size))

    def segment(self, name: str, tensors: Sequence[torch.Tensor]) -> tuple[NodeSegment, int]:
        """The node's shared segment for message ``name`` (mapped at its first use) and this use's number."""
        padded, dtype = padded_length(tensors, self.groups.local_size), buffer_dtype(tensors)
        segment = self._segments.get(name)
        if segment is None:
            segment = NodeSegment(segment_path(self.job_token, self.hvd.cross_rank(), name),
                                  self.groups.local_size, padded, dtype, self.hvd.local_rank(), self._node_pids,
                                  self.node_ranks())
            self._segments[name] = segment
        if segment.output.numel() != padded or segment.output.dtype != dtype:
            raise RuntimeError(f"message {name!r} changed size or dtype between steps")
        self._uses[name] = self._uses.get(name, 0) + 1
        return segment, self._uses[name]

    def close(self) -> None:
        """Drop this backend's shared segments and give its groups back (the last user drops them).

        At a step boundary, on every rank (a router's ``close``): segment files are already
        unlinked once mapped, so dropping the mappings frees the memory once the node's ranks did.
        Or on one rank mid-step (``Router.abandon``): the node's ranks waiting for this one in a
        segment fail instead of waiting (``NodeSegment.leave``).
        """
        for segment in self._segments.values():
            segment.leave()
            segment.unlink()
        self._segments.clear()
        self._uses.clear()
        if self.groups is not None:
            groups, self.groups = self.groups, None
            release_hierarchical_groups(groups)

    def submit(self, name: str, tensors: Sequence[torch.Tensor], reduction: Reduction) -> Any:
        if self.intra_node == "shm":
            segment, use = self.segment(name, tensors)
            return SharedMemoryHandle(self.groups.cross_node, segment, use, name, tensors,
                                      reduction.prescale_factor, reduction.result_factor(self.hvd.size()))
        return _GlooIntraNodeHandle(self, name, tensors, reduction)

    def advance(self, handle: SharedMemoryHandle | _GlooIntraNodeHandle) -> bool:
        """A ``shm`` message starts across nodes once its node's inputs are written; ``horovod`` ones
        start in ``wait()``."""
        return handle.advance()


def _probe_problem(probe: NodeSegment, node_ranks: list[int], rank: int) -> str | None:
    """Why this node's ranks cannot use shared memory, judged from the probe they all wrote; or None."""
    seen = [int(region[0]) - 1 for region in probe.inputs]
    if seen != node_ranks:
        return f"ranks {node_ranks} do not share {SHM_DIR} (rank {rank} saw ranks {[r for r in seen if r >= 0]} there)"
    try:
        probe.check_alive(list(range(len(node_ranks))), "probing")
    except PeerExitedError:
        return f"ranks {node_ranks} share {SHM_DIR} but not their process ids (rank {rank} cannot see theirs)"
    return None
