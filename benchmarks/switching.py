"""What a strategy switch costs, and whether a strategy timed after a switch times as in a fresh job.

    .venv/bin/python benchmarks/switching.py     # 2 ranks, hybridsync-run --num-servers 2, horovodrun --gloo

One job switches one ``DistributedOptimizer`` through STRATEGIES with ``set_strategy``, round
by round (the order rotates each round); after each switch it takes WARMUP steps, then times
STEPS steps (their median is the round's step time). Then one fresh job per strategy builds
its optimizer with that strategy and times ROUNDS rounds the same way. Printed per strategy:
the median over rounds of the step time after a switch and in a fresh job, their ratio, the
spread of each ((max - min) / median over rounds), the same ratio of the best rounds (less
sensitive to other processes on a shared machine), the median time of a switch to it, and
the wall time of launching the fresh job (what a trial would pay without ``set_strategy``).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

from steps import timed_steps

ROUNDS = int(os.environ.get("SWITCH_ROUNDS", "6"))
STEPS = int(os.environ.get("SWITCH_STEPS", "15"))
WARMUP = int(os.environ.get("SWITCH_WARMUP", "3"))
STRATEGIES = {
    "ring": None,
    "ring_partitions_groups": {"version": 1, "default": {"route": "allreduce"},
                               "variables": {"emb.weight": {"route": "allreduce", "partitions": 4},
                                             **{f"body.{i}.weight": {"route": "allreduce", "group": 1}
                                                for i in range(0, 8, 2)}}},
    "hierarchical": {"version": 1, "default": {"route": "allreduce", "algorithm": "hierarchical"}},
    "ps_bsp": {"version": 1, "default": {"route": "ps"}},
    "ps_asp": {"version": 1, "default": {"route": "ps", "protocol": "asp"}},
}


def build_model():
    import torch.nn as nn

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(2000, 64)
            self.body = nn.Sequential(nn.Linear(64, 256), *[nn.Linear(256, 256) for _ in range(6)],
                                      nn.Linear(256, 8))  # ~1 MB of parameters in 18 tensors besides emb

        def forward(self, ids):
            return self.body(self.emb(ids).mean(dim=1))

    return Model()


def worker(out: str, mode: str) -> None:
    import horovod.torch as hvd
    import torch
    import hybridsync as hs
    hs.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = build_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(hvd.rank())
    data = [(torch.randint(0, 2000, (32, 8), generator=gen), torch.randn(32, 8, generator=gen)) for _ in range(8)]
    names = list(STRATEGIES) if mode == "switch" else [mode]
    opt = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                  named_parameters=model.named_parameters(), strategy=STRATEGIES[names[0]])
    steps: dict[str, list[float]] = {name: [] for name in names}
    switches: dict[str, list[float]] = {name: [] for name in names}
    for r in range(ROUNDS):
        for name in (names[r % len(names):] + names[:r % len(names)]):
            if mode == "switch":
                hvd.barrier()
                start = time.perf_counter()
                opt.set_strategy(STRATEGIES[name])
                switches[name].append(time.perf_counter() - start)
            timed_steps(opt, model, data, WARMUP)
            hvd.barrier()
            steps[name].append(statistics.median(timed_steps(opt, model, data, STEPS)))
    if hvd.rank() == 0:
        with open(out, "w") as f:
            json.dump({"steps": steps, "switches": switches}, f)
    hvd.barrier()


def launch(out: str, mode: str) -> float:
    """Run one 2-rank job with 2 servers; its wall time in seconds."""
    from hybridsync.run.procs import run_bounded
    run = os.path.join(os.path.dirname(sys.executable), "hybridsync-run")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    start = time.perf_counter()
    proc = run_bounded([run, "--num-servers", "2", "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                        os.path.abspath(__file__), out, mode], timeout=900, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        with open(f"{out}.log", "w") as log:
            log.write(proc.stdout)
        print("\n".join(line for line in proc.stdout.splitlines() if "tensorpipe_agent" not in line)[-6000:])
        raise SystemExit(f"job {mode} failed")
    return wall


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def main() -> None:
    if len(sys.argv) == 3:
        worker(sys.argv[1], sys.argv[2])
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory() as tmp:
        launch(os.path.join(tmp, "switch.json"), "switch")
        switched = json.load(open(os.path.join(tmp, "switch.json")))
        fresh, walls = {}, {}
        for name in STRATEGIES:
            walls[name] = launch(os.path.join(tmp, f"{name}.json"), name)
            fresh[name] = json.load(open(os.path.join(tmp, f"{name}.json")))["steps"][name]
    print(f"2 ranks (horovodrun --gloo, loopback) + 2 PS servers; {ROUNDS} rounds x {STEPS} timed steps "
          f"(after {WARMUP} warm-up steps) per strategy; medians over rounds of each round's median step")
    print(f"{'strategy':<24}{'after switch ms':>16}{'spread':>8}{'fresh job ms':>14}{'spread':>8}"
          f"{'ratio':>7}{'best ratio':>11}{'switch ms':>11}{'fresh launch s':>16}")
    for name in STRATEGIES:
        after, alone = switched["steps"][name], fresh[name]
        ratio = statistics.median(after) / statistics.median(alone)
        print(f"{name:<24}{statistics.median(after) * 1e3:>16.2f}{spread(after):>8.2f}"
              f"{statistics.median(alone) * 1e3:>14.2f}{spread(alone):>8.2f}{ratio:>7.3f}"
              f"{min(after) / min(alone):>11.3f}"
              f"{statistics.median(switched['switches'][name]) * 1e3:>11.1f}{walls[name]:>16.1f}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (2 cores)")


if __name__ == "__main__":
    main()
