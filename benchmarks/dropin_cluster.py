"""The drop-in on the emulated multi-node cluster: hybridsync with no strategy vs plain Horovod.

    sudo .venv/bin/python benchmarks/dropin_cluster.py                      # 2 ABBA rounds per cell
    sudo .venv/bin/python benchmarks/dropin_cluster.py --rounds 1 --models sparse --waits spin
    sudo .venv/bin/python benchmarks/dropin_cluster.py --variants horovod horovod-sets horovod-dynamic

What a user gets when swapping ``import horovod.torch as hvd`` for ``import hybridsync as hs``
on a 2 x 2 cluster (``horovodrun_configs/cluster_2x2_1gbit.yaml``: 1 Gbit/s uplinks, Gloo):
a wide & deep model (100k x 64 embedding, sparse or dense, + 2048/1024/512 MLP, batch 64),
10 warm-up + 30 timed steps, each step's time the slowest rank's, median per job. Each
variant is its own job (``hvd.init()`` or ``hs.init()`` is part of what a user swaps), and
jobs run in ABBA order (A B B A, then again) so drift hits both sides alike. Cells:

- model ``sparse`` (``nn.Embedding(sparse=True)``) or ``dense``;
- wait ``spin`` or ``sleep`` (``HYBRIDSYNC_WAIT``), the same for both sides: with ``sleep``
  Horovod's own optimizer waits through ``hybridsync.backends.waiting.wait`` too (patched
  into ``horovod.torch.optimizer``), so the ratio shows hybridsync, not the wait.

Variants (``--variants``): ``horovod``, ``hybridsync``, and, to measure what process sets
cost plain Horovod, ``horovod-sets`` (``hvd.init(process_sets=...)`` with the four sets a
2 x 2 hierarchical all-reduce needs) and ``horovod-dynamic`` (``HOROVOD_DYNAMIC_PROCESS_SETS=1``,
no set added). Prints per cell each variant's job medians, and each variant / horovod with
its spread (the ratios of the jobs paired within a round). Target: hybridsync <= 1.03.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from gloo_job import print_load, run_worker, script_main
from steps import timed_steps

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from provenance import print_header  # noqa: E402
CONFIG = os.path.join(REPO, "horovodrun_configs", "cluster_2x2_1gbit.yaml")
WARMUP_STEPS, TIMED_STEPS = 10, 30
VARIANTS = ("horovod", "hybridsync", "horovod-sets", "horovod-dynamic")


# -- worker side (every rank, inside the emulated hosts) ------------------------------------------
def build_model(sparse: bool):
    """Wide & deep: 26 id fields -> 100k x 64 embedding -> 2048/1024/512 MLP, plus a wide linear part."""
    import torch.nn as nn

    class WideDeep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(100_000, 64, sparse=sparse)
            self.deep = nn.Sequential(nn.Linear(26 * 64, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(),
                                      nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 1))
            self.wide = nn.Linear(26 * 64, 1)

        def forward(self, ids):
            features = self.emb(ids).flatten(1)
            return (self.deep(features) + self.wide(features)).squeeze(1)

    return WideDeep()


def _init(variant: str):
    import horovod.torch as hvd
    if variant == "hybridsync":
        import hybridsync as hs
        hs.init()
        return hvd, hs.DistributedOptimizer
    if variant == "horovod-sets":
        size, local = int(os.environ["HOROVOD_SIZE"]), int(os.environ["HOROVOD_LOCAL_SIZE"])
        sets = [list(range(k, k + local)) for k in range(0, size, local)]
        sets += [list(range(i, size, local)) for i in range(local)]
        hvd.init(process_sets=[hvd.ProcessSet(ranks) for ranks in sets])
    else:  # horovod, horovod-dynamic (its environment variable is set by the controller)
        hvd.init()
    from hybridsync.backends import waiting
    waiting.use_for_horovod(hvd)  # with HYBRIDSYNC_WAIT=sleep, Horovod waits as hybridsync does
    return hvd, hvd.DistributedOptimizer


def worker(variant: str, model_kind: str, out_path: str) -> None:
    import torch
    hvd, make_optimizer = _init(variant)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = build_model(sparse=model_kind == "sparse")
    optimizer = make_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3), named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(hvd.rank())
    data = [(torch.randint(0, 100_000, (64, 26), generator=gen), torch.randn(64, generator=gen))
            for _ in range(8)]
    times = timed_steps(optimizer, model, data, WARMUP_STEPS + TIMED_STEPS)
    from hybridsync.trials.worker import slowest_rank_times
    slowest = slowest_rank_times(hvd, times[WARMUP_STEPS:], name="dropin.times")
    if hvd.rank() == 0:
        with open(out_path, "w") as handle:
            json.dump({"median": statistics.median(slowest), "steps": slowest}, handle)
    hvd.shutdown()


# -- controller (root, outside the namespaces) ----------------------------------------------------
def run_job(cluster, variant: str, model_kind: str, wait: str, logs: str, timeout: float) -> float:
    """One job of ``variant``; its median step time in seconds."""
    env = {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "HYBRIDSYNC_WAIT": wait}
    if variant == "horovod-dynamic":
        env["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    return run_worker(cluster, __file__, [variant, model_kind], env, logs, timeout,
                      f"{variant} job ({model_kind}, {wait})")["median"]


def abba_order(variants: list[str], rounds: int) -> list[list[str]]:
    """Per round, the variants forward then backward (A B B A), so each sees the same drift."""
    return [variants + variants[::-1] for _ in range(rounds)]


def cell_report(label: str, medians: dict[str, list[list[float]]], variants: list[str]) -> list[str]:
    """Lines for one cell: per variant its job medians, and its ratio to horovod with spread."""
    base = [statistics.mean(pair) for pair in medians["horovod"]]
    lines = [f"{label}:"]
    for variant in variants:
        jobs = [t for pair in medians[variant] for t in pair]
        line = f"  {variant:<16} median {statistics.median(jobs) * 1e3:7.1f} ms  jobs " + \
               " ".join(f"{t * 1e3:.0f}" for t in jobs)
        if variant != "horovod":
            ratios = [statistics.mean(pair) / b for pair, b in zip(medians[variant], base)]
            line += (f"  | / horovod {statistics.median(jobs) / statistics.median([t for p in medians['horovod'] for t in p]):.3f}"
                     f" (rounds {min(ratios):.3f}-{max(ratios):.3f})")
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds per cell (default 2)")
    parser.add_argument("--models", nargs="+", default=["sparse", "dense"], choices=["sparse", "dense"])
    parser.add_argument("--waits", nargs="+", default=["spin", "sleep"], choices=["spin", "sleep"])
    parser.add_argument("--variants", nargs="+", default=["horovod", "hybridsync"], choices=VARIANTS)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before one job is killed")
    args = parser.parse_args(argv)
    if args.variants[0] != "horovod":
        parser.error("the first variant must be horovod (the reference)")
    sys.path.insert(0, REPO)
    from tqdm import tqdm

    from hybridsync.cluster import ClusterSpec, EmulatedCluster
    print_header()
    spec = ClusterSpec.from_yaml(CONFIG)
    print(f"cluster: {spec.nodes} hosts x {spec.workers_per_node} ranks, {spec.inter_node_bandwidth} uplinks, "
          f"Gloo launcher; {WARMUP_STEPS} warm-up + {TIMED_STEPS} timed steps per job, slowest rank per step")
    logs = tempfile.mkdtemp(prefix="hs-dropin-")
    cells = [(m, w) for m in args.models for w in args.waits]
    jobs = len(cells) * args.rounds * 2 * len(args.variants)
    report: list[str] = []
    with EmulatedCluster(spec) as cluster, tqdm(total=jobs, desc="jobs", unit="job") as progress:
        for model_kind, wait in cells:
            medians: dict[str, list[list[float]]] = {v: [] for v in args.variants}
            for order in abba_order(list(args.variants), args.rounds):
                measured: dict[str, list[float]] = {v: [] for v in args.variants}
                for variant in order:
                    measured[variant].append(run_job(cluster, variant, model_kind, wait, logs, args.timeout))
                    progress.update()
                for variant in args.variants:
                    medians[variant].append(measured[variant])
            report += cell_report(f"{model_kind} embedding, HYBRIDSYNC_WAIT={wait}", medians, list(args.variants))
    print("\n".join(report))
    print_load()
    return 0


if __name__ == "__main__":
    script_main(main, worker, 3)
