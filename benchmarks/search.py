"""The strategy search (issue 13 §2): its throughput, and a head-to-head against other searchers.

    .venv/bin/python benchmarks/search.py throughput [--budget 30000] [--batch 2048]
    .venv/bin/python benchmarks/search.py head-to-head [--budget 2000] [--seeds 10] \\
        [--cluster horovodrun_configs/cluster_2x2_250mbit.yaml] [--searchers evolution,random,tpe,ngopt] \\
        [--limit tpe=3 --limit tpe:resnet=0]

Both score candidates with the shipped simulator (``shipped_simulator()``) for the zoo
models' profiled descriptions (``data/descriptions/``).

``throughput``: candidate strategies scored per second end to end (ask + the simulator's
``predict_batch`` + tell, through ``run_search``), a fresh ``EvolutionarySearch`` seeded with
every baseline per repeat, best of 3, with the share of the time spent in the simulator
and the load average; also per CPU second of this process (``time.process_time``: one
thread, numpy and xgboost single-threaded), which other processes on the cores do not change.

``head-to-head``: for each model, the best predicted step time each searcher finds at an
equal budget of simulator evaluations, over seeds 0..N-1 (mean, spread, min, max), its
wall time, and its mean over ours (``ratio``, > 1: worse than ours). Nobody is seeded with
the baselines; the best baseline is printed for scale. The libraries propose one candidate
at a time (sequential ask/tell, what they are built for); ``--limit`` caps the seeds of a
slow searcher on a model, or on every model (Optuna's TPE slows with trials x parameters,
nevergrad spends ~0.1 s of its own per candidate here).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("ncf", "bert", "vgg", "resnet")
LIBRARY_BATCH = 1
"""Candidates per ask for optuna and nevergrad: sequential, as they are used."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("throughput", "head-to-head"))
    parser.add_argument("--cluster", default=str(ROOT / "horovodrun_configs/cluster_2x2_250mbit.yaml"))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--budget", type=int, help="simulator evaluations (default: 30000 throughput, 2000 head-to-head)")
    parser.add_argument("--batch", type=int, default=2048, help="throughput: candidates per ask")
    parser.add_argument("--seeds", type=int, default=10, help="head-to-head: seeds 0..N-1")
    parser.add_argument("--searchers", default="evolution,random,tpe,ngopt")
    parser.add_argument("--limit", action="append", default=[], metavar="SEARCHER:MODEL=SEEDS",
                        help="head-to-head: fewer seeds for one searcher on one model")
    args = parser.parse_args(argv)

    from hybridsync.cluster.spec import ClusterSpec
    from hybridsync.model.simulator import shipped_simulator

    cluster = ClusterSpec.from_yaml(args.cluster)
    simulator = shipped_simulator()
    models = args.models.split(",")
    print(f"cluster {Path(args.cluster).name}: {cluster.nodes}x{cluster.workers_per_node}, "
          f"{cluster.inter_node_bandwidth}, {cluster.num_servers} servers; shipped simulator "
          f"({simulator.kind}, {simulator.meta.get('samples')} trials); load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")
    started = time.perf_counter()
    if args.mode == "throughput":
        for model in models:
            print(_throughput(model, cluster, simulator, args.budget or 30_000, args.batch), flush=True)
    else:
        limits = {}
        for text in args.limit:  # "tpe:resnet=2", or "tpe=3" for every model
            key, _, seeds = text.partition("=")
            name, _, only = key.partition(":")
            limits.update({(name, model): int(seeds) for model in ([only] if only else models)})
        for model in models:
            _head_to_head(model, cluster, simulator, args.budget or 2000, args.seeds, args.searchers.split(","),
                          limits)
    print(f"load average {os.getloadavg()[0]:.1f}; took {time.perf_counter() - started:.0f} s")
    return 0


def _problem(model: str, cluster):
    from hybridsync import baselines
    from hybridsync.description import parse_description
    from hybridsync.model.encoding import model_arrays

    with open(ROOT / "data/descriptions" / f"{model}.json", encoding="utf-8") as handle:
        description = parse_description(json.load(handle), where=model)
    seeds = [None] + [baselines.build_baseline(name, description.variables, cluster.num_servers)
                      for name in baselines.BUILDERS
                      if cluster.num_servers > 0 or name not in baselines.NEEDS_SERVERS]
    return description, model_arrays(description), seeds


def _throughput(model: str, cluster, simulator, budget: int, batch: int) -> str:
    from hybridsync.search.evolution import EvolutionarySearch, bounds_for, run_search, simulator_cost

    description, arrays, seeds = _problem(model, cluster)
    score = simulator_cost(simulator, arrays, cluster)
    runs = []
    for repeat in range(4):  # the first warms up (imports, caches)
        spent = [0.0]

        def cost(candidates):
            start = time.perf_counter()
            out = score(candidates)
            spent[0] += time.perf_counter() - start
            return out
        search = EvolutionarySearch(arrays, cluster, bounds_for(cluster), np.random.default_rng(repeat), seeds=seeds)
        start, cpu = time.perf_counter(), time.process_time()
        best, _ = run_search(search, cost, budget if repeat else batch, batch=batch, progress=False)
        runs.append((time.perf_counter() - start, time.process_time() - cpu, spent[0], best))
    seconds, cpu, simulated, best = min(runs[1:])
    return (f"{model:7s} {arrays.num_variables:4d} variables: {budget / seconds:8,.0f} candidates/s end to end, "
            f"{budget / cpu:8,.0f} per CPU second (best of 3 runs of {budget:,} in batches of {batch}; "
            f"{simulated / seconds:.0%} of the time in the simulator; best {best * 1e3:.1f} ms; load average "
            f"{os.getloadavg()[0]:.1f})")


def _head_to_head(model: str, cluster, simulator, budget: int, num_seeds: int, searchers: list[str],
                  limits: dict) -> None:
    from hybridsync.model.encoding import from_strategies
    from hybridsync.search.evolution import bounds_for, run_search, simulator_cost
    from hybridsync.search.external import make_search

    description, arrays, seeds = _problem(model, cluster)
    cost = simulator_cost(simulator, arrays, cluster)
    baseline = cost(from_strategies(arrays, seeds, cluster)).min()
    print(f"\n{model} ({arrays.num_variables} variables), budget {budget} evaluations; best baseline "
          f"(incl. plain Horovod) {baseline * 1e3:.1f} ms")
    print(f"  {'searcher':10s} {'seeds':>5s} {'mean ms':>8s} {'std':>6s} {'min':>7s} {'max':>7s} {'ratio':>6s} "
          f"{'vs base':>7s} {'wall s':>7s} {'repeats':>7s}")
    ours = None
    for name in searchers:
        bests, walls, repeats = [], [], []
        if limits.get((name, model), num_seeds) == 0:
            print(f"  {name:10s} skipped (--limit)")
            continue
        for seed in range(limits.get((name, model), num_seeds)):
            search = make_search(name, arrays, cluster, bounds_for(cluster), np.random.default_rng(seed), budget=budget)
            batch = None if name == "evolution" else 256 if name == "random" else LIBRARY_BATCH
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                best, strategy = run_search(search, cost, budget, batch=batch, progress=False)
            walls.append(time.perf_counter() - start)
            strategy.validate_for(description.variables)
            bests.append(best)
            repeats.append(getattr(search, "repeats", 0))
        mean = float(np.mean(bests))
        ours = mean if name == "evolution" else ours
        ratio = f"{mean / ours:6.3f}" if ours else "     -"
        print(f"  {name:10s} {len(bests):5d} {mean * 1e3:8.2f} {np.std(bests) * 1e3:6.2f} {min(bests) * 1e3:7.2f} "
              f"{max(bests) * 1e3:7.2f} {ratio} {mean / baseline:7.3f} {np.mean(walls):7.1f} {np.mean(repeats):7.0f}",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
