"""Local rank 1 of a two-rank node segment, for ``tests/test_hierarchical_layout.py``.

Usage: ``python tests/workers/segment_peer.py PATH [HOW]``. Maps the segment at PATH (which local
rank 0 created and filled its input with ones), checks it sees those ones, writes twos into
its own input, unlinks the file, prints its pid and exits, ``HOW``:

- ``exit`` (default): as a script that ends (its exit handlers run);
- ``hard``: without exit handlers (``os._exit``, as a SIGKILLed process would);
- ``slow``: as a script whose own exit handlers then take 60 s (registered before the segment).
"""
from __future__ import annotations

import atexit
import os
import sys
import time

import torch

from hybridsync.backends.hierarchical.node_memory import NodeSegment

if __name__ == "__main__":
    how = sys.argv[2] if len(sys.argv) > 2 else "exit"
    if how == "slow":
        atexit.register(time.sleep, 60)
    theirs = NodeSegment(sys.argv[1], local_size=2, padded=4, dtype=torch.float32, local_rank=1)
    assert theirs.inputs[0].tolist() == [1.0] * 4, theirs.inputs[0].tolist()
    theirs.inputs[1].fill_(2.0)
    theirs.unlink()
    print(os.getpid(), flush=True)
    if how == "hard":
        os._exit(0)
