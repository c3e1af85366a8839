"""One rank (rank 1) leaves the program the others run; record what each rank saw.

Usage: python out_of_step.py CASE OUT_PREFIX   -> OUT_PREFIX.rank<R>.json (2 ranks or more)
Each rank records the exception it raised (type, message), the seconds from the moment
the ranks went out of step (each rank's own clock) to the error and the error's epoch time
(``at``); then it exits 0.

Cases:
- ``skip_set_strategy``: rank 1 does not call ``set_strategy()`` (the others do) and trains on;
- ``freeze_after_build``: rank 1 freezes a parameter after the optimizer was built;
- ``extra_optimizer``: rank 1 builds one more ``DistributedOptimizer`` than rank 0;
- ``skip_step``: rank 1 skips ``optimizer.step()`` once;
- ``user_error``: rank 1's own code raises where the others call ``set_strategy()``; its script
  ends with that error (exit code 1, its exit handlers run), and so do the others' scripts;
- ``raise_in_step``: rank 1's own code raises between ``backward()`` and ``step()`` (its gradients
  submitted, the others waiting in their step for them); its script ends with that error, as
  ``user_error``. With ``SLOW_EXIT_S`` set, its exit handlers take that long (a slow log upload,
  a big checkpoint): the others must not wait for them;
- ``sparse_no_gradient``: rank 1's sparse embedding gets no gradient in the first step (not
  an error: the ranks must agree to send sparse zeros), on the route of ``HYBRIDSYNC_STRATEGY``;
  records the embedding's gradient after the step, and the same with ``sparse_as_dense=True``;
- ``rank0_elsewhere``: rank 0 sleeps outside hybridsync (an evaluation that takes long) while
  the others wait in their step; both write ``OUT_PREFIX.rank<R>.ready`` (pid, waiting thread id)
  and stay until killed. Not out of step: rank 0 may come back, so nobody may fail.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from typing import Any, Callable

import torch
import torch.nn as nn

import hybridsync as hs


class Net(nn.Module):
    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 4, sparse=sparse)
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor, use_embedding: bool = True) -> torch.Tensor:
        x = self.emb(ids).mean(dim=1) if use_embedding else torch.ones(ids.shape[0], 4)
        return self.fc2(torch.relu(self.fc1(x)))


def optimizer(model: nn.Module, **kwargs: Any) -> torch.optim.Optimizer:
    return hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), **kwargs)


def step(model: Net, opt: torch.optim.Optimizer, use_embedding: bool = True, call_step: bool = True) -> None:
    ids = torch.randint(0, 20, (3, 5), generator=torch.Generator().manual_seed(hs.rank()))
    opt.zero_grad()
    model(ids, use_embedding).sum().backward()
    if call_step:
        opt.step()


def out_of_step(prepare: Callable[[Net, torch.optim.Optimizer], None],
                diverge: Callable[[Net, torch.optim.Optimizer], None]) -> dict[str, Any]:
    """Two healthy steps; then ``diverge`` (the ranks differ from here on) until it raises."""
    model = Net()
    opt = optimizer(model)
    prepare(model, opt)
    for _ in range(2):
        step(model, opt)
    began = time.perf_counter()
    try:
        diverge(model, opt)
        return {"type": None, "message": "no error", "seconds": time.perf_counter() - began}
    except Exception as e:  # noqa: BLE001 - what the user would see
        return {"type": type(e).__name__, "message": str(e), "seconds": time.perf_counter() - began,
                "at": time.time()}


def skip_set_strategy(model: Net, opt: torch.optim.Optimizer) -> None:
    if hs.rank() != 1:
        opt.set_strategy({"version": 1, "variables": {"fc1.weight": {"route": "allreduce", "partitions": 2}}})
    for _ in range(3):
        step(model, opt)


def freeze_after_build(model: Net, opt: torch.optim.Optimizer) -> None:
    if hs.rank() == 1:
        model.fc1.bias.requires_grad_(False)
    for _ in range(3):
        step(model, opt)


def extra_optimizer(model: Net, opt: torch.optim.Optimizer) -> None:
    if hs.rank() == 1:
        optimizer(Net())
    for _ in range(3):
        step(model, opt)


def skip_step(model: Net, opt: torch.optim.Optimizer) -> None:
    step(model, opt, call_step=hs.rank() != 1)
    for _ in range(3):
        step(model, opt)


class UserCodeError(Exception):
    """An error in the training script itself."""


def user_error(model: Net, opt: torch.optim.Optimizer) -> None:
    if hs.rank() == 1:
        raise UserCodeError("rank 1's training code failed")
    opt.set_strategy({"version": 1, "variables": {"fc1.weight": {"route": "allreduce", "partitions": 2}}})
    for _ in range(3):
        step(model, opt)


def raise_in_step(model: Net, opt: torch.optim.Optimizer) -> None:
    if hs.rank() == 1:
        step(model, opt, call_step=False)
        raise UserCodeError("rank 1's training code failed between backward() and step()")
    for _ in range(3):
        step(model, opt)


def stop_early(model: Net, opt: torch.optim.Optimizer) -> None:
    """Rank 1's loop ends here, rank 0's runs on: rank 1 leaves at exit while rank 0 waits for it."""
    for _ in range(3 if hs.rank() == 0 else 0):
        step(model, opt)


def sparse_no_gradient() -> dict[str, Any]:
    """The embedding's synchronized gradient after a first step in which rank 1 does not use it."""
    out: dict[str, Any] = {}
    for sparse_as_dense in (False, True):
        model = Net(sparse=True)
        opt = optimizer(model, sparse_as_dense=sparse_as_dense)
        began = time.perf_counter()
        step(model, opt, use_embedding=hs.rank() == 0)
        out[f"seconds_{sparse_as_dense}"] = time.perf_counter() - began
        out[f"grad_{sparse_as_dense}"] = model.emb.weight.grad.to_dense().tolist()
        out[f"sparse_{sparse_as_dense}"] = model.emb.weight.grad.is_sparse
        step(model, opt)  # and the next step, every rank with its gradient
    return out


def rank0_elsewhere(prefix: str) -> None:
    model = Net()
    opt = optimizer(model)
    step(model, opt)
    ready = {"pid": os.getpid(), "thread": threading.get_native_id()}
    with open(f"{prefix}.rank{hs.rank()}.ready", "w") as f:
        json.dump(ready, f)
    if hs.rank() == 0:
        time.sleep(3600)  # an evaluation that takes long: not in a hybridsync wait
    step(model, opt)  # waits for rank 0


CASES = {"skip_set_strategy": skip_set_strategy, "freeze_after_build": freeze_after_build,
         "extra_optimizer": extra_optimizer, "skip_step": skip_step, "stop_early": stop_early,
         "user_error": user_error, "raise_in_step": raise_in_step}


def main() -> None:
    case, prefix = sys.argv[1], sys.argv[2]
    if os.environ.get("SLOW_EXIT_S"):  # registered first, so it runs after hybridsync's and Horovod's handlers
        atexit.register(time.sleep, float(os.environ["SLOW_EXIT_S"]))
    hs.init()
    if case == "rank0_elsewhere":
        rank0_elsewhere(prefix)
        return
    result = sparse_no_gradient() if case == "sparse_no_gradient" else out_of_step(lambda m, o: None, CASES[case])
    with open(f"{prefix}.rank{hs.rank()}.json", "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    if case in ("user_error", "raise_in_step"):
        sys.exit(1)  # as a script that raised: its exit handlers run (Horovod's shutdown, the PS farewell)
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        # mpirun ends every rank once one exits without MPI_Finalize: leave only when each rank's record
        # is written (one host), so that a slower rank is not killed before it writes its own (bounded).
        # Not under horovodrun: there a rank may be waiting for this one to leave (skip_step).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                os.path.exists(f"{prefix}.rank{r}.json") for r in range(hs.size())):
            time.sleep(0.1)
    if case == "stop_early" and hs.rank() == 1:
        return  # a script that ends: at exit it says goodbye to the servers and shuts Horovod down
    os._exit(0)  # out of step, Horovod's shutdown would wait for collectives that never complete


if __name__ == "__main__":
    main()
