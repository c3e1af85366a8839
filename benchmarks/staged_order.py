"""Does the hierarchical route overlap a model that declares its layers in another order than it uses them?

    sudo .venv/bin/python benchmarks/staged_order.py [--cluster horovodrun_configs/cluster_2x2_1gbit.yaml] \\
        [--layers 8] [--width 1024] [--blocks 6] [--strategy hierarchical|hierarchical-fp16] [--jobs 2]

Hierarchical messages start across nodes from the gradient hooks in one order on every rank.
Before the router learned that order it was reverse plan order, i.e. the reverse of the order
the model *declares* its parameters in: right for most models, but a model that declares its
last layer first (a head built before its trunk, layers kept in a dict filled backwards) had
its first-declared message, ready last, hold back every other one until the backward pass ended.

One job per ``--jobs`` on the emulated cluster (Gloo launcher). Every rank builds two models
that compute the same function from the same weights: ``use order`` declares the layers in the
order ``forward`` runs them, ``reversed`` declares them backwards. Each gets its own
``hybridsync.DistributedOptimizer`` with the ``--strategy`` baseline (per-variable
hierarchical all-reduce); the two train in alternating blocks of ``--steps-per-block`` steps
(each first in every other block), after a warm-up block each, so that both see the same machine. A step's time is the slowest
rank's. Prints, per job, each model's median step time and ``reversed / use order``: 1.00
when the order is learned, above 1 when one declaration order overlaps less.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from gloo_job import finish_worker, print_load, run_worker, script_main, start_worker
from steps import interleaved_times

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from provenance import print_header  # noqa: E402
ORDERS = ("use order", "reversed")


# -- worker side (every rank, inside the emulated hosts) ------------------------------------------
def build_model(layers: int, width: int, declared_backwards: bool):
    """``layers`` square linear layers with ReLU between, run first to last; declared in that order
    or backwards (the forward pass is the same: it indexes the layers by position)."""
    import torch
    import torch.nn as nn

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            positions = range(layers - 1, -1, -1) if declared_backwards else range(layers)
            for position in positions:
                self.add_module(f"layer{position}", nn.Linear(width, width))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for position in range(layers):
                x = getattr(self, f"layer{position}")(x)
                if position < layers - 1:
                    x = torch.relu(x)
            return x

    return Stack()


def worker(config_path: str, out_path: str) -> None:
    import torch

    import horovod.torch as hvd
    import hybridsync as hs
    from hybridsync import baselines
    from hybridsync.hooks.trials import slowest_rank_times
    from hybridsync.variables import variables_from_model
    config = start_worker(config_path)
    runs = {}
    for order in ORDERS:
        torch.manual_seed(0)
        model = build_model(config["layers"], config["width"], declared_backwards=order == "reversed")
        strategy = baselines.build_baseline(config["strategy"], variables_from_model(model), num_servers=1)
        optimizer = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                            named_parameters=model.named_parameters(), strategy=strategy)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        gen = torch.Generator().manual_seed(hvd.rank())
        batches = [(torch.randn(config["batch"], config["width"], generator=gen),
                    torch.randn(config["batch"], config["width"], generator=gen)) for _ in range(4)]
        runs[order] = (optimizer, model, batches)
    # the warm-up block's first step learns the order
    times = interleaved_times(runs, config["blocks"], config["steps_per_block"])
    finish_worker(hvd, out_path, {order: slowest_rank_times(hvd, times[order], name=f"staged_order.{i}")
                                  for i, order in enumerate(ORDERS)})


# -- controller (root, outside the namespaces) ----------------------------------------------------
def run_job(cluster, config_path: str, logs: str, timeout: float) -> dict[str, list[float]]:
    """One job; per model, the slowest rank's time of each timed step."""
    return run_worker(cluster, __file__, [config_path], {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}, logs, timeout,
                      "job")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cluster", default=os.path.join(REPO, "horovodrun_configs", "cluster_2x2_1gbit.yaml"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024, help="each layer is width x width (+ bias)")
    parser.add_argument("--batch", type=int, default=64, help="rows per rank and step")
    parser.add_argument("--strategy", default="hierarchical", help="a baseline name, as `hybridsync baseline --help` lists them")
    parser.add_argument("--blocks", type=int, default=6, help="timed blocks per model and job")
    parser.add_argument("--steps-per-block", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before one job is killed")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    from tqdm import tqdm

    from hybridsync.cluster import ClusterSpec, EmulatedCluster
    print_header()
    spec = ClusterSpec.from_yaml(args.cluster)
    megabytes = args.layers * (args.width + 1) * args.width * 4 / 2**20
    print(f"cluster: {spec.nodes} hosts x {spec.workers_per_node} ranks, {spec.inter_node_bandwidth} uplinks; "
          f"{args.layers} layers of {args.width} x {args.width} ({megabytes:.0f} MB), batch {args.batch}, "
          f"strategy {args.strategy}; {args.blocks} blocks of {args.steps_per_block} steps per model, alternating")
    logs = tempfile.mkdtemp(prefix="hs-staged-order-")
    config_path = os.path.join(logs, "config.json")
    with open(config_path, "w") as handle:
        json.dump({"layers": args.layers, "width": args.width, "batch": args.batch, "strategy": args.strategy,
                   "blocks": args.blocks, "steps_per_block": args.steps_per_block}, handle)
    ratios = []
    with EmulatedCluster(spec) as cluster:
        for job in tqdm(range(args.jobs), desc="jobs", unit="job"):
            slowest = run_job(cluster, config_path, logs, args.timeout)
            medians = {order: statistics.median(slowest[order]) for order in ORDERS}
            ratios.append(medians["reversed"] / medians["use order"])
            tqdm.write(f"job {job + 1}: " + ", ".join(f"{order} {medians[order] * 1e3:.1f} ms" for order in ORDERS)
                       + f"; reversed / use order {ratios[-1]:.3f}")
    print(f"reversed / use order: median {statistics.median(ratios):.3f} over {len(ratios)} jobs "
          f"({min(ratios):.3f}-{max(ratios):.3f})")
    print_load()
    return 0


if __name__ == "__main__":
    script_main(main, worker, 2)
