"""A name Horovod holds in flight does not stop an elastic job's plan (tests/test_elastic.py).

Run under ``horovodrun -np 2 --gloo``. Rank 1 leaves an all-reduce named ``bias`` pending through
a training step, as a plan abandoned mid-step by an elastic reset leaves its messages (an unsplit
variable's message has the variable's name); rank 0 sends its side only after the step. The
optimizer runs as in an elastic job (``HOROVOD_ELASTIC=1``, set after ``init``: the job itself is
not elastic), whose routers name their messages apart. Prints ``ok`` with the parameters, which
must be the same on both ranks.
"""
from __future__ import annotations

import json
import os

import horovod.torch as hvd
import torch

import hybridsync as hs


def main() -> None:
    hs.init()
    os.environ["HOROVOD_ELASTIC"] = "1"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    pending = torch.zeros(2)
    handle = hvd.allreduce_async_(pending, name="bias") if hvd.rank() == 1 else None
    batch = torch.randn(3, 4, generator=torch.Generator().manual_seed(hvd.rank()))
    model(batch).sum().backward()
    optimizer.step()
    if hvd.rank() == 0:
        handle = hvd.allreduce_async_(pending, name="bias")
    hvd.synchronize(handle)
    params = {name: p.detach().flatten().tolist() for name, p in model.named_parameters()}
    print(f"ok {json.dumps({'rank': hvd.rank(), 'params': params})}", flush=True)


if __name__ == "__main__":
    main()
