"""The two communicators of hierarchical all-reduce, created when a plan first uses the route.

Hierarchical all-reduce needs the ranks of a node (the intra-node step, when it is not done
through shared memory) and the ranks that share a local rank on the other nodes (the
cross-node step). Horovod's process sets would serve, but a process set is not free: static
sets must be declared at ``hvd.init`` and, declared, slowed every Horovod collective of a
2 x 2 job by 1.26-1.31x, hierarchical or not; dynamic sets need
``HOROVOD_DYNAMIC_PROCESS_SETS=1`` at ``hvd.init`` in every job, which adds a global
all-gather to every cycle of Horovod's background loop (``process_set.cc``). Either way a
job would pay for a route its strategy never uses (benchmarks/dropin_cluster.py and
benchmarks/RESULTS.md have the numbers).

So the groups are ``torch.distributed`` Gloo process groups, built directly on a
``TCPStore`` that rank 0 hosts, outside Horovod: nothing exists until a plan routes a
variable hierarchically (``hierarchical_groups`` is collective and runs at optimizer
construction), and Horovod's background loop never sees them. Where one level is the whole
job (one node, or one rank per node) that level is Horovod's own global all-reduce.

Every backend that took the groups gives them back (``release_hierarchical_groups``) when
its plan is replaced; when none holds them any more they are dropped (their sockets and
rank 0's store closed), so switching away from the route stops its cost, and the next plan
that uses the route builds them afresh. Taking and giving back happen at the same points of
the program on every rank (optimizer construction, ``set_strategy``), so all ranks drop them
together.
"""
from __future__ import annotations

import dataclasses
import datetime
import time
from collections import Counter
from typing import Any, Protocol

import torch

from hybridsync.backends import rendezvous
from hybridsync.backends.base import RouteUnavailableError
from hybridsync.backends.hierarchical.liveness import Peer, PeerWatch, beacon
from hybridsync.backends.waiting import wait, wait_until

GROUP_TIMEOUT = datetime.timedelta(seconds=600)
"""Gloo's bound on one collective: a 64 MiB slice at 100 Mbit/s takes ~6 s, and a peer may be busy
elsewhere (a checkpoint) for minutes. A dead peer fails at once (its sockets close); one the
network cut off, or one that hangs while its host answers, is found by probing it
(``liveness.PeerWatch``), so this bounds only the groups' set-up."""


class Work(Protocol):
    """A collective in flight."""

    def wait(self) -> Any:
        """Block until it is done (raising if it failed)."""
        ...

    def done(self) -> bool:
        """True once it is done (``wait`` then returns at once)."""
        ...


class Group(Protocol):
    """Some ranks of the job that reduce and gather together, in the order they are asked."""

    size: int

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> Work:
        """Start summing ``tensor`` (contiguous) in place across the group."""
        ...

    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Every member's ``tensor`` (equal lengths), concatenated in member order."""
        ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class HierarchicalGroups:
    """This rank's two groups; ``None`` where a level has a single member."""

    intra_node: Group | None
    cross_node: Group | None
    local_size: int
    num_nodes: int
    local_rank: int


class _HorovodWork:
    def __init__(self, hvd: Any, handle: Any) -> None:
        self._hvd, self._handle = hvd, handle

    def wait(self) -> Any:
        return wait(self._hvd, self._handle)

    def done(self) -> bool:
        return bool(self._hvd.poll(self._handle))


class HorovodGlobal:
    """The whole job, through Horovod's global set (no process set needed)."""

    def __init__(self, hvd: Any) -> None:
        self._hvd, self.size = hvd, hvd.size()

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> Work:
        return _HorovodWork(self._hvd, self._hvd.allreduce_async_(tensor, name=name, op=self._hvd.Sum))

    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return wait(self._hvd, self._hvd.allgather_async(tensor, name=name))


class _GlooWork:
    def __init__(self, work: Any, peers: PeerWatch) -> None:
        self._work, self._peers, self._started = work, peers, time.monotonic()

    def wait(self) -> Any:
        # Polled, so that a long wait is watched (waiting.py); never spinning: Gloo's own threads
        # do the work, and its blocking wait held no core either.
        wait_until(self.done, spin=False)
        try:
            return self._work.wait()
        except RuntimeError as e:  # Gloo's error names an address and port only
            raise self._peers.explain(e) from e

    def done(self) -> bool:
        """Whether it is done; while it is not, its peers are probed once it has waited a while
        (``PeerUnreachableError`` for one that is gone or cut off)."""
        if self._work.is_completed():
            return True
        self._peers.check(self._started, time.monotonic())
        return False


class GlooGroup:
    """A torch Gloo process group over ``ranks`` (this rank among them)."""

    def __init__(self, store: Any, label: str, ranks: list[int], rank: int, device_address: str,
                 route: str, nodes: list[int]) -> None:
        """``route``: what errors call the group's collectives (``hierarchical all-reduce across nodes``);
        ``nodes``: the node of each of ``ranks``."""
        import torch.distributed as dist
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=device_address)]
        options._timeout = GROUP_TIMEOUT
        self.size, self.ranks = len(ranks), ranks
        group_store = dist.PrefixStore(label, store)
        self._peers = PeerWatch(_beacons(group_store, dict(zip(ranks, nodes)), rank, device_address), route)
        self._group = dist.ProcessGroupGloo(group_store, ranks.index(rank), len(ranks), options)

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> Work:
        return _GlooWork(self._group.allreduce([tensor]), self._peers)

    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        out = torch.empty(self.size * tensor.numel(), dtype=tensor.dtype)
        _GlooWork(self._group.allgather([list(out.chunk(self.size))], [tensor]), self._peers).wait()
        return out

    def close(self) -> None:
        """Close the group's connections now: a peer waiting in one of its collectives fails at
        once. (Gloo's ``abort()`` and ``shutdown()`` leave them open; only dropping the group
        closes them, so no reference elsewhere, say in a traceback, may keep it.)"""
        self._group = None


def _beacons(store: Any, nodes: dict[int, int], rank: int, device_address: str) -> list[Peer]:
    """The beacons (``liveness``) of the members of ``nodes`` (rank -> node) other than ``rank``,
    this rank's own published in ``store`` first."""
    own = beacon(device_address)
    store.set(f"beacon/{rank}", f"{own.host}:{own.port}")
    peers = []
    for other, node in nodes.items():
        if other != rank:
            host, port = store.get(f"beacon/{other}").decode().rsplit(":", 1)
            peers.append(Peer(other, node, host, int(port)))
    return peers


_groups: dict[str, Any] = {}


def hierarchical_groups(hvd: Any, layout: Any) -> HierarchicalGroups:
    """This rank's groups for ``layout`` (``layout.NodeLayout``), built at the first call.

    Collective: every rank calls it at the same point (optimizer construction). Ranks must
    be laid out node by node (node k holds ranks ``k*local_size ...``), as horovodrun and
    Open MPI's default mapping place them; otherwise ``RouteUnavailableError`` on every rank.
    """
    if "groups" in _groups:
        _groups["users"] += 1
        return _groups["groups"]
    rank, local_size = hvd.rank(), layout.local_size
    node, local_rank = rank // local_size, rank % local_size
    placed = (hvd.local_rank(), hvd.cross_rank()) == (local_rank, node)
    misplaced = [r for r, ok in enumerate(hvd.allgather_object(placed, name="hybridsync.groups.layout")) if not ok]
    if misplaced:
        raise RouteUnavailableError(f"hierarchical all-reduce needs ranks laid out node by node; ranks {misplaced} "
                                    f"are not (rank r should be local rank r % {local_size} of node r // {local_size})")
    one_node, one_per_node = layout.num_nodes == 1, local_size == 1
    store, address = (None, "") if one_node or one_per_node else _rendezvous(hvd)
    intra = (HorovodGlobal(hvd) if one_node else None if one_per_node else
             GlooGroup(store, f"hybridsync/node{node}", layout.node_ranks()[node], rank, address,
                       f"hierarchical all-reduce within node {node}", [node] * local_size))
    cross = (HorovodGlobal(hvd) if one_per_node else None if one_node else
             GlooGroup(store, f"hybridsync/local{local_rank}", layout.local_rank_peers()[local_rank], rank, address,
                       f"hierarchical all-reduce across nodes (rank {rank}, node {node})",
                       list(range(layout.num_nodes))))
    _groups.update(groups=HierarchicalGroups(intra_node=intra, cross_node=cross, local_size=local_size,
                                             num_nodes=layout.num_nodes, local_rank=local_rank), store=store,
                   users=1)
    return _groups["groups"]


def hierarchical_groups_in_use() -> int:
    """How many backends hold this process's hierarchical groups (0: none exist)."""
    return _groups.get("users", 0)


def release_hierarchical_groups(groups: HierarchicalGroups | None = None) -> None:
    """Give back groups taken with ``hierarchical_groups``; the last one back drops them.

    Collective in effect: every rank gives them back at the same point of the program.
    ``groups``: the ones taken; nothing happens when they are no longer this process's
    (``forget_hierarchical_groups`` dropped them for a new world).
    """
    if not _groups or (groups is not None and groups is not _groups["groups"]):
        return
    _groups["users"] -= 1
    if _groups["users"] <= 0:
        forget_hierarchical_groups()


def forget_hierarchical_groups() -> None:
    """Close and drop this process's groups whoever holds them (rank 0's store closes with its
    last reference). Also for a world that is gone (a rank failed, an elastic reset re-formed
    the job): peers waiting in a group's collective fail at once, and the next plan that uses
    the route builds groups for the new world."""
    groups = _groups.get("groups")
    for group in (getattr(groups, "intra_node", None), getattr(groups, "cross_node", None)):
        if isinstance(group, GlooGroup):
            group.close()
    _groups.clear()


def _rendezvous(hvd: Any) -> tuple[Any, str]:
    """Rank 0 hosts a ``TCPStore``; every rank finds an address of rank 0 it reaches and the
    address of its own it reaches it from (its Gloo device's address). Rank 0's own device
    address is the one of its addresses the other ranks reached most."""
    store, offer = None, None
    if hvd.rank() == 0:
        try:
            store, offer = rendezvous.host_store(GROUP_TIMEOUT)
        except ValueError as e:
            offer = f"hierarchical all-reduce: {e}"  # every rank raises it: the others are waiting for this broadcast
    offer = hvd.broadcast_object(offer, root_rank=0, name="hybridsync.groups.offer")
    if isinstance(offer, str):
        raise RouteUnavailableError(offer)
    candidates, port = offer
    reached = rendezvous.reach(candidates, port) if hvd.rank() != 0 else None
    everyone = hvd.allgather_object(reached, name="hybridsync.groups.reached")
    failed = [r for r, answer in enumerate(everyone) if r != 0 and answer is None]
    if failed:
        raise RouteUnavailableError(f"hierarchical all-reduce: ranks {failed} cannot reach rank 0 at any of "
                                    f"{', '.join(candidates)} (port {port}); set HOROVOD_GLOO_IFACE to the "
                                    f"interface the hosts share")
    if hvd.rank() == 0:
        votes = Counter(answer[0] for answer in everyone[1:])
        return store, votes.most_common(1)[0][0] if votes else candidates[0]
    rank0_address, own_address = reached
    return rendezvous.connect_store(rank0_address, port, GROUP_TIMEOUT), own_address
