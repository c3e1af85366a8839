"""Shared memory among the ranks of one node, for the intra-node steps of hierarchical all-reduce.

Ranks on one host need not send their gradients to each other through loopback TCP (which
is what Horovod's Gloo collectives on the node's process set do): they can all map the
same ``/dev/shm`` file, write their message into it, and read each other's: a few memory
copies instead of two collectives over sockets (``benchmarks/RESULTS.md``, ``hier`` vs
``hier-gloo``, has the times).

One message's segment holds a header of int64 counters, then (in the message's dtype)
``local_size`` input regions (rank ``i`` of the node writes its padded message into region
``i``) and one output region (rank ``i`` writes the final sum of slice ``i`` there). The
header has, per local rank, its pid and two sequence numbers, "my input is written for
use n" and "my output slice is final for use n": ranks wait on each other's counters, not
on a collective, so each reads a slice the moment it is ready. x86's ordered stores make a
counter visible only after the data written before it; ``supported()`` says where that
holds. A waiting rank checks the pids of the ranks it waits for: one that died is an
error within seconds, not a hang; so is one that lives on but left the segment (its plan
dropped after a failed step, e.g. while an elastic job is re-formed), which writes ``LEFT``
in place of its pid, and one whose process is exiting (its script raised or ended), which
writes ``EXITING`` as its exit handlers begin: the others fail within a second, naming it,
instead of waiting until its process is gone (its interpreter's shutdown alone took 2-5 s on
a loaded machine, and a script's own exit handlers may take any time).

The file is unlinked as soon as every rank of the node has mapped it, so nothing stays in
``/dev/shm`` however the job ends; the memory goes back when the last rank unmaps it.
"""
from __future__ import annotations

import atexit
import hashlib
import mmap
import os
import platform
import time
import warnings
import weakref
from typing import Callable, Sequence

import torch

from hybridsync.backends import stalls, waiting
from hybridsync.backends.peer_lost import PeerLostError

SHM_DIR = "/dev/shm"
HEADER_BYTES = 4096
"""Counters first, data page-aligned after them: room for 170 ranks per node."""
LIVENESS_CHECK_S = 1.0
STALL_WARNING_S = 60.0
SPIN_S = 1e-3
MAX_SLEEP_S = 200e-6
LEFT = -1
"""Written by a rank in place of its pid when it lets go of a segment (``NodeSegment.leave``)."""
EXITING = -2
"""Written in place of its pid by a rank whose process is exiting (``leave_all_at_exit``)."""


def supported() -> bool:
    """Whether this machine orders stores as the counters need (x86-64's total store order)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def segment_path(job_token: str, node: int, name: str) -> str:
    """The file of message ``name``'s segment on ``node``; identical on the node's ranks, unique per job."""
    digest = hashlib.sha1(name.encode()).hexdigest()[:16]
    return os.path.join(SHM_DIR, f"hybridsync-{job_token}-n{node}-{digest}")


class PeerExitedError(PeerLostError):
    """A rank of this node exited while the others waited for it in shared memory."""


class NodeSegment:
    """Counters, ``local_size`` input regions and one output region of ``padded`` elements, mapped from one file.

    Every rank of the node constructs it with the same arguments but its own ``local_rank``,
    in any order: the first creates the file and sizes it, the others map the same file.
    """

    def __init__(self, path: str, local_size: int, padded: int, dtype: torch.dtype, local_rank: int,
                 pids: Sequence[int] = (), ranks: Sequence[int] = ()) -> None:
        """``pids``: the node's ranks' process ids where known, so that a rank that dies before
        it maps the segment is noticed too; ``ranks``: their ranks in the job, for messages."""
        assert 3 * local_size * 8 <= HEADER_BYTES, local_size
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = HEADER_BYTES + (local_size + 1) * padded * itemsize
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            # Allocated now, not at first touch: a full /dev/shm (containers often give 64 MB) is
            # an error here, not a SIGBUS in the middle of a step. Two ranks may both do it.
            os.posix_fallocate(fd, 0, nbytes)
            self._map = mmap.mmap(fd, nbytes)
        except OSError as e:
            os.close(fd)
            _remove(path)
            raise OSError(e.errno, f"cannot allocate {nbytes / 2**20:.1f} MiB for a hierarchical all-reduce "
                          f"segment in {os.path.dirname(path)} ({e.strerror}); enlarge it (docker: --shm-size) "
                          f"or set HYBRIDSYNC_INTRA_NODE=horovod") from None
        os.close(fd)
        self.path, self.local_rank, self.ranks = path, local_rank, list(ranks)
        with warnings.catch_warnings():  # the mapping is writable; torch warns about buffers in general
            warnings.simplefilter("ignore")
            header = torch.frombuffer(self._map, dtype=torch.int64, count=3 * local_size)
            flat = torch.frombuffer(self._map, dtype=dtype, offset=HEADER_BYTES)
        self.pids, self.inputs_done, self.outputs_done = header.view(3, local_size)
        self.inputs = [flat[i * padded:(i + 1) * padded] for i in range(local_size)]
        self.output = flat[local_size * padded:]
        for i, pid in enumerate(pids):
            if int(self.pids[i]) == 0:  # a rank that mapped it already (or left it) says so itself
                self.pids[i] = pid
        self.pids[local_rank] = os.getpid()
        _leave_at_exit(self)
        # Also at exit, for a message submitted but never waited for (an exception in between).
        self.unlink = weakref.finalize(self, _remove, path)
        """Removes the file once every rank has mapped it (the mapping stays valid); runs once."""

    def wait_until(self, ready: Callable[[], bool], waiting_for: Callable[[], list[int]], what: str) -> None:
        """Polls ``ready()`` (which may do work as parts arrive) until it is true, spinning
        briefly, then sleeping. Raises ``PeerExitedError`` if a local rank in
        ``waiting_for()`` has exited; warns once if the wait stalls for a minute."""
        start = time.monotonic()
        next_check, delay, warned = start + LIVENESS_CHECK_S, 0.0, False
        with stalls.Watched() as watch:  # ranks out of step (another node's rank elsewhere) are named
            while not ready():
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + LIVENESS_CHECK_S
                    late = waiting_for()
                    try:
                        self.check_alive(late, what)
                    except PeerExitedError:
                        if ready():  # what it owed was published before it exited or left
                            return
                        raise
                    if late and not warned and now - start > STALL_WARNING_S:
                        warned = True
                        warnings.warn(f"local ranks {late} have not answered for {now - start:.0f} s while {what}",
                                      RuntimeWarning, stacklevel=2)
                    watch.tick()
                if now - start < SPIN_S:
                    os.sched_yield()
                else:
                    cap = MAX_SLEEP_S if now - start < waiting.LONG_WAIT_S else waiting.LONG_SLEEP_S
                    delay = min(max(2 * delay, 20e-6), cap)
                    time.sleep(delay)

    def leave(self) -> None:
        """This rank will not use the segment again (its router closed, or was abandoned after a
        failed step): a rank of the node still waiting for it fails at once (``PeerExitedError``)
        instead of waiting for a process that has gone elsewhere, e.g. into ``hvd.init()`` to
        re-form an elastic job, where it waits for the very rank that waits here."""
        self.pids[self.local_rank] = LEFT

    def who(self, local_rank: int) -> str:
        """``local_rank`` of this node named for a message: with its rank in the job where known."""
        known = f" (rank {self.ranks[local_rank]})" if local_rank < len(self.ranks) else ""
        return f"local rank {local_rank} of this node{known}"

    def check_alive(self, local_ranks: list[int], what: str) -> None:
        """Raises ``PeerExitedError`` if one of ``local_ranks`` mapped the segment and has exited or left it since."""
        for i in local_ranks:
            pid = int(self.pids[i])
            if pid == 0:
                continue  # not mapped yet: still on its way here
            if pid == LEFT:
                raise PeerExitedError(f"{self.who(i)} left while {what} (it dropped this plan: "
                                      f"its step failed, or the job is being re-formed)")
            if pid == EXITING:
                raise PeerExitedError(f"{self.who(i)} is exiting (its script raised or ended: its first error "
                                      f"in the log is the cause) while {what}")
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise PeerExitedError(f"local rank {i} of this node (pid {pid}) exited while {what}") from None
            except PermissionError:
                pass  # alive, under another user


_MAPPED: "weakref.WeakSet[NodeSegment]" = weakref.WeakSet()
"""This process's segments still mapped, for ``leave_all_at_exit``."""
_exit_handler_registered = False


def _leave_at_exit(segment: NodeSegment) -> None:
    """Remember ``segment`` for ``leave_all_at_exit``, registered once per process at its first segment:
    after ``hvd.init()``, so it runs before Horovod's shutdown (exit handlers run last-registered first)."""
    global _exit_handler_registered
    if not _exit_handler_registered:
        atexit.register(leave_all_at_exit)
        _exit_handler_registered = True
    _MAPPED.add(segment)


def leave_all_at_exit() -> None:
    """Write ``EXITING`` for this rank in every segment it still maps: the node's ranks waiting in one
    for this process fail within ``LIVENESS_CHECK_S`` rather than after its slower exit handlers."""
    for segment in list(_MAPPED):
        if int(segment.pids[segment.local_rank]) == os.getpid():  # not one it left already
            segment.pids[segment.local_rank] = EXITING


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # another rank of the node removed it first
