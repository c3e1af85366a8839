"""Run under horovodrun with parameter servers started beside it (``tests/test_ps_horovod.py``).

Usage: ``python tests/workers/ps_with_ring.py OUT_PREFIX`` -> ``OUT_PREFIX.rank<R>.json``.
Each rank submits some messages to the parameter servers and the others to Horovod's ring,
in opposite orders on the two ranks, and waits in yet another order; it records how far
every result is from Horovod's all-reduce of the same tensors.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def worker_main(out: Path) -> int:
    import horovod.torch as hvd
    import torch
    from hybridsync.backends import ps
    from hybridsync.backends.base import Reduction
    from hybridsync.backends.ring import RingAllreduce
    hvd.init()
    client = ps.init()  # DMLC_WORKER_ID falls back to HOROVOD_RANK
    backends = {"ps": ps.PSBackend(client), "ring": RingAllreduce()}
    errors, rank = [], hvd.rank()
    for step in range(3):
        tensors = {f"m{i}": torch.randn(1000 * (i + 1), generator=torch.Generator().manual_seed(10 * rank + step + i))
                   for i in range(6)}
        expected = {name: hvd.allreduce(t.clone(), name=f"check.{name}", op=hvd.Average) for name, t in tensors.items()}
        names = sorted(tensors) if rank == 0 else sorted(tensors, reverse=True)
        handles = {name: backends["ps" if int(name[1]) % 2 == 0 else "ring"].submit(name, [tensors[name]], Reduction())
                   for name in names}
        for name in sorted(handles, key=lambda n: (int(n[1]) * 7 + rank) % 6):
            handles[name].wait()
        errors += [float((tensors[n] - expected[n]).abs().max()) for n in tensors]
    Path(f"{out}.rank{rank}.json").write_text(json.dumps({"max_error": max(errors), "worker": client.config.index}))
    ps.shutdown()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(worker_main(Path(sys.argv[1])))
