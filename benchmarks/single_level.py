"""Hierarchical all-reduce where one level of the world has a single member (one host of N ranks,
or N hosts of one rank): the backend it ran on before vs the way it goes now.

    sudo .venv/bin/python benchmarks/single_level.py [--worlds 1x4 1x4:horovod 3x1 4x1] \\
        [--bandwidth 500mbit] [--blocks 4] [--steps-per-block 4]

On such a world hierarchical all-reduce is the flat all-reduce over the job. It ran on
``HierarchicalAllreduce`` everywhere; where that is one Horovod all-reduce over the job per
message, run in ``synchronize()`` (no overlap with the backward pass, no fusion), it now goes
Horovod's ring way (``backends.make_backend``, ``HierarchicalAllreduce.one_collective``): one rank
per host, or one host whose ranks sum through Gloo (``1x4:horovod`` sets ``HYBRIDSYNC_INTRA_NODE``
for the job). One host through shared memory (``1x4``) keeps the hierarchical backend: another
transport than the ring, so there ``hier before`` and ``hier now`` are the same code.

One job per world on the emulated cluster (Gloo launcher). Every rank builds each model three
times from the same weights, each with its own ``hybridsync.DistributedOptimizer``:

- ``ring``: the ``allreduce`` baseline (every variable its own ring all-reduce);
- ``hier before``: the ``hierarchical`` baseline (every variable its own hierarchical message)
  on the backend it ran on before, ``HierarchicalAllreduce``, given to the router as its
  backend factory (the one thing that changed);
- ``hier now``: the same strategy as a job runs it now.

Two models: ``layers`` (``--layers`` linear layers of ``--width`` squared, a message per weight
and bias) and ``tiny`` (``--tiny`` variables of 64 floats each, the many-small-variables case).
The arms train in alternating blocks of ``--steps-per-block`` steps (rotated each block), after a
warm-up block, so that all see the same machine; a step's time is the slowest rank's. Prints per
world and model each arm's median step time and its ratio to ``ring``.
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
ARMS = ("ring", "hier before", "hier now")
MODELS = ("layers", "tiny")
TINY_NUMEL = 64


# -- worker side (every rank, inside the emulated hosts) ------------------------------------------
def build_model(kind: str, config: dict):
    """``layers``: a stack of square linear layers; ``tiny``: many 64-float variables summed into the output."""
    import torch
    import torch.nn as nn

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = nn.ParameterList(nn.Parameter(torch.randn(TINY_NUMEL) * 0.01) for _ in range(config["tiny"]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.stack(list(self.weights)).sum(dim=0)

    if kind == "tiny":
        return Tiny()
    layers = [nn.Linear(config["width"], config["width"]) for _ in range(config["layers"])]
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())][:-1])


def before_backends(route: str, variant: str, variables=(), namespace: str = "", process_set=None):
    """The backend factory as it was: ``HierarchicalAllreduce`` for the hierarchical route on any world."""
    from hybridsync.backends import make_backend
    from hybridsync.backends.hierarchical import HierarchicalAllreduce
    if (route, variant) == ("allreduce", "hierarchical"):
        return HierarchicalAllreduce()
    return make_backend(route, variant, variables, namespace, process_set)


def build_arm(arm: str, kind: str, config: dict, hvd):
    """(optimizer, model, batches) of one arm, the model's weights the same in every arm."""
    import torch

    import hybridsync as hs
    from hybridsync import baselines
    from hybridsync.router.runtime import Router
    from hybridsync.variables import variables_from_model
    torch.manual_seed(0)
    model = build_model(kind, config)
    strategy = baselines.build_baseline("allreduce" if arm == "ring" else "hierarchical",
                                        variables_from_model(model), num_servers=1)
    defaults = Router.__init__.__kwdefaults__
    saved = defaults["backends"]
    if arm == "hier before":  # the router is built with the optimizer: give it the old factory there
        defaults["backends"] = before_backends
    try:
        optimizer = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                            named_parameters=model.named_parameters(), strategy=strategy)
    finally:
        defaults["backends"] = saved
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    width = config["width"] if kind == "layers" else TINY_NUMEL
    gen = torch.Generator().manual_seed(hvd.rank())
    batches = [(torch.randn(config["batch"], width, generator=gen), torch.randn(config["batch"], width, generator=gen))
               for _ in range(4)]
    return optimizer, model, batches


def worker(config_path: str, out_path: str) -> None:
    import horovod.torch as hvd

    from hybridsync.hooks.trials import slowest_rank_times
    config = start_worker(config_path)
    out = {}
    for kind in MODELS:
        runs = {arm: build_arm(arm, kind, config, hvd) for arm in ARMS}
        times = interleaved_times(runs, config["blocks"], config["steps_per_block"])
        out[kind] = {arm: slowest_rank_times(hvd, times[arm], name=f"single_level.{kind}.{i}")
                     for i, arm in enumerate(ARMS)}
        for optimizer, _, _ in runs.values():
            optimizer.close()
    finish_worker(hvd, out_path, out)


# -- controller (root, outside the namespaces) ----------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", nargs="+", default=["1x4", "1x4:horovod", "3x1", "4x1"],
                        help="HOSTSxRANKS[:INTRA_NODE], one job each (INTRA_NODE: shm or horovod)")
    parser.add_argument("--bandwidth", default="500mbit", help="tc-style uplink rate (default 500mbit)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512, help="each layer is width x width (+ bias)")
    parser.add_argument("--tiny", type=int, default=1200, help="variables of the tiny model")
    parser.add_argument("--batch", type=int, default=32, help="rows per rank and step")
    parser.add_argument("--blocks", type=int, default=4, help="timed blocks per arm and model")
    parser.add_argument("--steps-per-block", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before one job is killed")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    from hybridsync.cluster import ClusterSpec, EmulatedCluster
    print_header()
    config = {k: getattr(args, k) for k in ("layers", "width", "tiny", "batch", "blocks", "steps_per_block")}
    print(f"models: layers = {args.layers} x linear {args.width}x{args.width} "
          f"({args.layers * (args.width + 1) * args.width * 4 / 2**20:.1f} MB, {2 * args.layers} variables); "
          f"tiny = {args.tiny} variables of {TINY_NUMEL} floats; batch {args.batch}; uplinks {args.bandwidth}; "
          f"{args.blocks} blocks of {args.steps_per_block} steps per arm, rotated; slowest rank per step, median")
    logs = tempfile.mkdtemp(prefix="hs-single-level-")
    config_path = os.path.join(logs, "config.json")
    with open(config_path, "w") as handle:
        json.dump(config, handle)
    print(f"{'world':<12} {'model':<7} " + " ".join(f"{arm + ' ms':>15}" for arm in ARMS)
          + f" {'before/ring':>12} {'now/ring':>9}")
    for world in args.worlds:
        shape, _, intra_node = world.partition(":")
        nodes, per_node = (int(n) for n in shape.split("x"))
        spec = ClusterSpec(nodes=nodes, workers_per_node=per_node, inter_node_bandwidth=args.bandwidth)
        env = {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "HYBRIDSYNC_INTRA_NODE": intra_node or "shm"}
        with EmulatedCluster(spec) as cluster:
            slowest = run_worker(cluster, __file__, [config_path], env, logs, args.timeout, f"job on {world}")
        for kind in MODELS:
            medians = {arm: statistics.median(slowest[kind][arm]) * 1e3 for arm in ARMS}
            print(f"{world:<12} {kind:<7} " + " ".join(f"{medians[arm]:>15.1f}" for arm in ARMS)
                  + f" {medians['hier before'] / medians['ring']:>11.2f}x {medians['hier now'] / medians['ring']:>8.2f}x",
                  flush=True)
    print_load()
    return 0


if __name__ == "__main__":
    script_main(main, worker, 2)
