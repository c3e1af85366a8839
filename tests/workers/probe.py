"""One rank of a Horovod job across emulated hosts (``tests/test_cluster.py``): where it runs and a sum.

Usage: ``python tests/workers/probe.py OUT_DIR`` -> ``OUT_DIR/rank<R>.json`` with the rank's
place in the job as Horovod sees it, its host name and the result of an all-reduce. One
file per rank, so no launcher's merging of the ranks' output streams can mix two records.
"""
import json
import socket
import sys
from pathlib import Path

import horovod.torch as hvd
import torch

if __name__ == "__main__":
    hvd.init()
    total = hvd.allreduce(torch.full((1000,), float(hvd.rank() + 1)), op=hvd.Sum, name="probe")
    record = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
              "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
              "host": socket.gethostname(), "sum_min": total.min().item(), "sum_max": total.max().item()}
    Path(sys.argv[1], f"rank{hvd.rank()}.json").write_text(json.dumps(record))
