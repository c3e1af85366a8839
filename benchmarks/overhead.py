"""hybridsync with no strategy vs Horovod, same 2-rank model, interleaved rounds in one job.

    .venv/bin/python benchmarks/overhead.py            # launches itself under horovodrun -np 2 --gloo

Each round trains ROUND_STEPS steps with Horovod's DistributedOptimizer, then the same
with hybridsync's (order alternating per round), on one model of ~50 parameter tensors.
Prints the median per-step time of each and their ratio (hybridsync / Horovod).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

ROUNDS = int(os.environ.get("OVERHEAD_ROUNDS", "15"))
ROUND_STEPS = int(os.environ.get("OVERHEAD_STEPS", "20"))


def build_model():
    import torch.nn as nn
    layers = []
    for i in range(25):  # 25 Linear layers = 50 parameter tensors, 256x256 each (~6.6 MB in all)
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers)


def timed_round(opt, model, data) -> list[float]:
    import torch
    times = []
    for x, y in data:
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def worker() -> None:
    import horovod.torch as hvd
    import torch
    import hybridsync as hs
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = [(torch.randn(32, 256), torch.randn(32, 256)) for _ in range(ROUND_STEPS)]
    runs = {}
    for name, make_optimizer in (("horovod", hvd.DistributedOptimizer), ("hybridsync", hs.DistributedOptimizer)):
        torch.manual_seed(0)
        model = build_model()  # one model per library: each optimizer's hooks stay on its own model
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = make_optimizer(torch.optim.SGD(model.parameters(), lr=1e-4), named_parameters=model.named_parameters())
        runs[name] = (opt, model)
        timed_round(opt, model, data)  # warm-up: threads, caches, fusion buffers
    per_step = {"horovod": [], "hybridsync": []}
    for r in range(ROUNDS):
        order = ["horovod", "hybridsync"] if r % 2 == 0 else ["hybridsync", "horovod"]
        for name in order:
            per_step[name].append(statistics.median(timed_round(*runs[name], data)))
    if hvd.rank() == 0:
        hv, hs_ = statistics.median(per_step["horovod"]), statistics.median(per_step["hybridsync"])
        print(f"model: 50 parameter tensors, {ROUNDS} interleaved rounds x {ROUND_STEPS} steps, 2 ranks (Gloo)")
        print(f"horovod    median step {hv * 1e3:8.2f} ms")
        print(f"hybridsync median step {hs_ * 1e3:8.2f} ms")
        print(f"ratio hybridsync/horovod = {hs_ / hv:.3f}  (target <= 1.03)")


def main() -> None:
    if os.environ.get("HOROVOD_RANK") is not None or os.environ.get("OMPI_COMM_WORLD_RANK") is not None:
        worker()
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from hybridsync.procs import run_bounded
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    proc = run_bounded([horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                        os.path.abspath(__file__)], timeout=900)
    print(proc.stdout)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
