"""Pure unit tests of hierarchical all-reduce's buffer layout (no Horovod): padding and slices.

The multi-rank runs (tests/test_four_ranks.py, tests/test_emulated.py) check the sums; these
check that the slices the ranks of a node carry across nodes tile the buffer exactly.
"""
from __future__ import annotations

import pytest
import torch

from hybridsync.backends.hierarchical import flatten_padded, node_slice


@pytest.mark.parametrize("local_size", [1, 2, 3, 4])
def test_slices_of_a_node_tile_the_padded_buffer(local_size: int) -> None:
    tensors = [torch.arange(6.0).reshape(2, 3), torch.arange(5.0) + 100]
    flat, numel = flatten_padded(tensors, local_size)
    assert numel == 11 and flat.numel() % local_size == 0 and flat.numel() - numel < local_size
    assert torch.equal(flat[:numel], torch.cat([t.reshape(-1) for t in tensors]))
    assert not flat[numel:].any()  # zero padding adds nothing to a sum
    slices = [node_slice(flat, local_size, r) for r in range(local_size)]
    assert torch.equal(torch.cat(slices), flat)
    assert len({s.numel() for s in slices}) == 1  # all-gather needs equal lengths


def test_flat_buffer_is_a_copy_and_slices_are_views() -> None:
    tensor = torch.ones(4, dtype=torch.float16)
    flat, _ = flatten_padded([tensor], 2)
    flat.mul_(3)  # the collectives work on it in place
    assert torch.equal(tensor, torch.ones(4, dtype=torch.float16)) and flat.dtype == torch.float16
    node_slice(flat, 2, 1).zero_()  # the cross-node all-reduce writes through the view
    assert flat.tolist() == [3.0, 3.0, 0.0, 0.0]
