"""Unit tests of hierarchical all-reduce's buffers (no Horovod): padding, slices, copies and the
node's shared-memory segment.

The multi-rank runs (tests/test_four_ranks.py, tests/test_emulated.py) check the sums; these
check that the slices the ranks of a node carry across nodes tile the buffer exactly.
"""
from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hybridsync.backends.hierarchical.flat_buffers import (buffer_dtype, copy_into, copy_out, flatten_padded,
                                                          node_slice, padded_length, slice_range)
from hybridsync.backends.hierarchical.node_memory import LEFT, NodeSegment, PeerExitedError

REPO = Path(__file__).resolve().parent.parent
WORKERS = REPO / "tests" / "workers"


@pytest.mark.parametrize("local_size", [1, 2, 3, 4])
@pytest.mark.unit
def test_slices_of_a_node_tile_the_padded_buffer(local_size: int) -> None:
    tensors = [torch.arange(6.0).reshape(2, 3), torch.arange(5.0) + 100]
    flat, numel = flatten_padded(tensors, local_size)
    assert flat.numel() == padded_length(tensors, local_size)
    assert [slice_range(flat.numel(), local_size, r) for r in range(local_size)] == [
        (r * flat.numel() // local_size, (r + 1) * flat.numel() // local_size) for r in range(local_size)]
    assert numel == 11 and flat.numel() % local_size == 0 and flat.numel() - numel < local_size
    assert torch.equal(flat[:numel], torch.cat([t.reshape(-1) for t in tensors]))
    assert not flat[numel:].any()  # zero padding adds nothing to a sum
    slices = [node_slice(flat, local_size, r) for r in range(local_size)]
    assert torch.equal(torch.cat(slices), flat)
    assert len({s.numel() for s in slices}) == 1  # all-gather needs equal lengths


@pytest.mark.unit
def test_flat_buffer_is_a_copy_and_slices_are_views() -> None:
    tensor = torch.ones(4, dtype=torch.float16)
    flat, _ = flatten_padded([tensor], 2)
    flat.mul_(3)  # the collectives work on it in place
    assert torch.equal(tensor, torch.ones(4, dtype=torch.float16)) and flat.dtype == torch.float16
    node_slice(flat, 2, 1).zero_()  # the cross-node all-reduce writes through the view
    assert flat.tolist() == [3.0, 3.0, 0.0, 0.0]


@pytest.mark.unit
def test_copy_into_and_out_round_trip_with_scaling() -> None:
    tensors = [torch.arange(6.0).reshape(2, 3), torch.arange(3.0) + 10]
    flat = torch.zeros(10)
    copy_into(tensors, flat, 2.0)
    assert flat.tolist() == [0, 2, 4, 6, 8, 10, 20, 22, 24, 0]  # the padding is left alone
    out = [torch.empty(2, 3), torch.empty(3)]
    copy_out(flat, out, 0.5)
    assert all(torch.equal(a, b) for a, b in zip(out, tensors))


@pytest.mark.unit
def test_a_message_mixing_dtypes_is_summed_in_their_common_dtype() -> None:
    """A merge group of float64, float32 and float16 gradients: one float64 buffer, each tensor back in its dtype."""
    tensors = [torch.full((3,), 0.1, dtype=torch.float64), torch.full((2,), 1 / 3), torch.full((1,), 2.0).half()]
    assert buffer_dtype(tensors) == torch.float64
    flat, numel = flatten_padded(tensors, 4)
    assert flat.dtype == torch.float64 and numel == 6 and flat[:3].tolist() == [0.1] * 3
    flat.mul_(2.0)  # the all-reduce, as two ranks' equal sums
    copy_out(flat, tensors, 0.5)
    assert [t.dtype for t in tensors] == [torch.float64, torch.float32, torch.float16]
    assert tensors[0].tolist() == [0.1] * 3 and torch.equal(tensors[1], torch.full((2,), 1 / 3))
    assert tensors[2].item() == 2.0


@pytest.mark.multiprocess
def test_node_segment_is_shared_between_processes_and_leaves_no_file(tmp_path) -> None:
    """Two processes map one segment: each sees the other's writes; after unlink the file is
    gone and the mapping still works; a segment never unlinked is removed when collected."""
    path = str(tmp_path / "segment")
    mine = NodeSegment(path, local_size=2, padded=4, dtype=torch.float32, local_rank=0)
    assert mine.inputs[0].numel() == mine.inputs[1].numel() == mine.output.numel() == 4
    mine.inputs[0].fill_(1.0)
    child = subprocess.run([sys.executable, str(WORKERS / "segment_peer.py"), path, "hard"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert child.returncode == 0, child.stderr
    assert not os.path.exists(path)
    # The child has exited: waiting for it is an error naming it, not a hang.
    assert int(mine.pids[1]) == child_pid(child) and int(mine.pids[0]) == os.getpid()
    with pytest.raises(PeerExitedError, match=r"local rank 1 of this node \(pid \d+\) exited while testing"):
        mine.wait_until(lambda: False, lambda: [1], "testing")
    mine.wait_until(lambda: True, lambda: [1], "testing")  # ready at once: no check needed
    torch.add(mine.inputs[0], mine.inputs[1], out=mine.output)
    assert mine.output.tolist() == [3.0] * 4
    mine.unlink()  # already removed by the other process: fine

    forgotten = NodeSegment(path, local_size=1, padded=2, dtype=torch.float16, local_rank=0)
    assert os.path.exists(path) and forgotten.inputs[0].dtype == torch.float16
    del forgotten
    gc.collect()
    assert not os.path.exists(path)


@pytest.mark.multiprocess
def test_a_rank_whose_process_is_exiting_is_not_waited_for(tmp_path) -> None:
    """A node peer whose script raised or ended while the others wait for it in a segment: they fail
    within a second or two, naming it, while its own exit handlers (Horovod's shutdown, the script's)
    still run. Before, they waited until its process was gone: here 60 s, 2-8 s in a loaded 2-rank job."""
    path = str(tmp_path / "segment")
    mine = NodeSegment(path, local_size=2, padded=4, dtype=torch.float32, local_rank=0, ranks=[4, 5])
    mine.inputs[0].fill_(1.0)
    child = subprocess.Popen([sys.executable, str(WORKERS / "segment_peer.py"), path, "slow"], text=True,
                             stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    outcome: dict = {}

    def wait() -> None:
        began = time.monotonic()
        try:
            mine.wait_until(lambda: False, lambda: [1], "testing")
        except PeerExitedError as e:
            outcome.update(error=str(e), seconds=time.monotonic() - began)

    waiter = threading.Thread(target=wait, daemon=True)
    try:
        assert int(child.stdout.readline()) == child.pid  # mapped, and on its way out
        waiter.start()
        waiter.join(timeout=10)  # bounded: the old code waited for the child to be reaped
        assert outcome, "still waiting 10 s after the peer began to exit"
        assert child.poll() is None, "the peer was gone already: the check would not tell the two apart"
    finally:
        child.kill()
        child.wait(timeout=10)
        waiter.join(timeout=10)
    assert re.fullmatch(r"local rank 1 of this node \(rank 5\) is exiting \(its script raised or ended: .*\) "
                        r"while testing", outcome["error"]), outcome
    assert mine.inputs[1].tolist() == [2.0] * 4


@pytest.mark.unit
def test_a_rank_that_leaves_a_segment_is_not_waited_for(tmp_path) -> None:
    """A node peer that lets go of the segment (its plan dropped after a failed step) while its
    process lives on, e.g. re-forming an elastic job: waiting for it is an error, not a wait
    for a rank that waits in turn; what it published before leaving is still taken."""
    path = str(tmp_path / "segment")
    mine = NodeSegment(path, local_size=2, padded=4, dtype=torch.float32, local_rank=0)
    peer = NodeSegment(path, local_size=2, padded=4, dtype=torch.float32, local_rank=1)
    peer.leave()
    again = NodeSegment(path, local_size=2, padded=4, dtype=torch.float32, local_rank=0, pids=[0, os.getpid()])
    assert int(again.pids[1]) == LEFT  # a rank mapping it later does not bring the peer back
    with pytest.raises(PeerExitedError, match=r"local rank 1 of this node left while testing"):
        mine.wait_until(lambda: False, lambda: [1], "testing")
    asked: list[int] = []

    def waiting_for() -> list[int]:  # what was awaited arrives as the check runs: no error
        asked.append(1)
        return [1]

    mine.wait_until(lambda: bool(asked), waiting_for, "testing")
    assert asked
    mine.unlink()


def child_pid(child: subprocess.CompletedProcess) -> int:
    return int(child.stdout.split()[-1])


@pytest.mark.unit
def test_copy_out_by_ranges_covers_each_element_once() -> None:
    """The shared-memory handle copies its own slice early and the rest later: together, all."""
    tensors = [torch.zeros(2, 3), torch.zeros(4)]
    flat = torch.arange(10.0)
    copy_out(flat, tensors, 1.0, [(4, 7)])  # straddles both tensors
    assert tensors[0].reshape(-1).tolist() == [0, 0, 0, 0, 4, 5] and tensors[1].tolist() == [6, 0, 0, 0]
    copy_out(flat, tensors, 1.0, [(0, 4), (7, 10)])
    assert torch.cat([t.reshape(-1) for t in tensors]).tolist() == list(range(10))
    strided = torch.zeros(3, 2).t()  # not contiguous: only whole copies
    copy_out(flat, [strided], 3.0)
    assert strided.tolist() == [[0, 3, 6], [9, 12, 15]]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (root)")
@pytest.mark.multiprocess
def test_segment_larger_than_its_tmpfs_is_a_clear_error_at_once(tmp_path) -> None:
    """Allocated at creation: a small /dev/shm fails here with advice, not with SIGBUS later."""
    mount = tmp_path / "small_shm"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True, timeout=30)
    try:
        with pytest.raises(OSError, match=r"cannot allocate 8\.0 MiB .*HYBRIDSYNC_INTRA_NODE=horovod"):
            NodeSegment(str(mount / "segment"), local_size=1, padded=2**20, dtype=torch.float32, local_rank=0)
        assert list(mount.iterdir()) == []  # nothing half-made left behind
        small = NodeSegment(str(mount / "segment"), local_size=1, padded=1000, dtype=torch.float32, local_rank=0)
        small.output.fill_(1.0)
        del small
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True, timeout=30)
