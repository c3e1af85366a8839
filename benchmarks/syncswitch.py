"""Sync-Switch on the emulated cluster: BSP, ASP, SSP, switch and elastic, with and without a straggler.

    sudo flock /tmp/hybridsync-bench.lock .venv/bin/python benchmarks/syncswitch.py
    sudo .venv/bin/python benchmarks/syncswitch.py --seeds 0 --stragglers none --kind cpu

The digits task (``hybridsync/syncswitch/digits.py``: scikit-learn's bundled digits, a
64-64-64-10 MLP, every variable on one parameter server) on 4 ranks over 2 hosts, the
server on a third, 20 Mbit/s uplinks (``hybridsync/syncswitch/evaluate.py``). The
straggler is host 1 (ranks 2, 3): its uplink drops to 4 Mbit/s (``--kind net``) or its
ranks get a tenth of a core (``--kind cpu``), never (``none``), from the first step
(``persistent``) or for 4 s of every 8 s from 2 s on (``intermittent``).

Each (straggler, seed) is one job training the policies one after another (the order
reversed on odd seeds, so warm-up favours none). Per cell: wall-clock seconds to 95% test
accuracy, throughput (images/s of all ranks while all train), final test accuracy; mean
and (min-max) over seeds, and time and throughput as ratios to BSP under the same straggler
(from the per-seed pairs, which ran side by side in one job).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from provenance import print_header  # noqa: E402


def _spread(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    return f"{format(statistics.mean(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def table(results: list[Any], policies: list[str], stragglers: list[str]) -> list[str]:
    """Markdown rows: one per (straggler, policy)."""
    lines = ["| straggler | policy | time to 95% (s) | vs BSP | throughput (img/s) | vs BSP | final accuracy | "
             "reached | switches |", "|---|---|---|---|---|---|---|---|---|"]
    for straggler in stragglers:
        cell = {(r.spec.policy, r.spec.seed): r for r in results if r.spec.straggler == straggler}
        seeds = sorted({seed for _, seed in cell})
        for policy in policies:
            runs = [cell[policy, s] for s in seeds if (policy, s) in cell]
            pairs = [(cell[policy, s], cell["bsp", s]) for s in seeds if (policy, s) in cell and ("bsp", s) in cell]
            times = [r.time_to_target_s for r in runs if r.time_to_target_s is not None]
            time_ratios = [r.time_to_target_s / b.time_to_target_s for r, b in pairs
                           if r.time_to_target_s is not None and b.time_to_target_s is not None]
            speed_ratios = [r.throughput / b.throughput for r, b in pairs]
            switches = statistics.mean(len(r.switches) for r in runs) if runs else 0
            lines.append(f"| {straggler} | {policy} | {_spread(times, '.1f')} | {_spread(time_ratios, '.2f')} | "
                         f"{_spread([r.throughput for r in runs], '.0f')} | {_spread(speed_ratios, '.2f')} | "
                         f"{_spread([r.final_accuracy for r in runs], '.3f')} | {len(times)}/{len(runs)} | "
                         f"{switches:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, REPO)
    from hybridsync.syncswitch import evaluate

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policies", nargs="+", default=list(evaluate.POLICY_NAMES), choices=evaluate.POLICY_NAMES)
    parser.add_argument("--stragglers", nargs="+", default=list(evaluate.STRAGGLER_NAMES),
                        choices=evaluate.STRAGGLER_NAMES)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--kind", choices=["net", "cpu"], default="net", help="what the straggler lacks")
    parser.add_argument("--steps", type=int, default=200, help="steps per rank and run (default 200)")
    parser.add_argument("--switch-at", type=float, default=0.25, help="'switch': BSP fraction (default 0.25)")
    args = parser.parse_args(argv)
    from tqdm import tqdm

    from hybridsync.cluster.netns import EmulatedCluster
    print_header()
    print(f"cluster: 2 hosts x 2 ranks + 1 PS host, {evaluate.LINK_RATE} uplinks; straggler: host 1, "
          f"{'uplink ' + evaluate.STRAGGLER_RATE if args.kind == 'net' else f'{evaluate.STRAGGLER_CPU} CPU'}; "
          f"{args.steps} steps per rank, switch_at {args.switch_at}, SSP staleness {evaluate.SSP_STALENESS}")
    workdir = tempfile.mkdtemp(prefix="hs-syncswitch-")
    results = []
    jobs = [(straggler, seed) for seed in args.seeds for straggler in args.stragglers]
    with EmulatedCluster(evaluate.cluster_spec()) as cluster, \
            tqdm(total=len(jobs) * len(args.policies), desc="runs", unit="run") as progress:
        for straggler, seed in jobs:
            order = args.policies if seed % 2 == 0 else args.policies[::-1]
            runs = [evaluate.RunSpec(policy=policy, straggler=straggler, kind=args.kind, seed=seed,
                                     steps=args.steps, switch_at=args.switch_at) for policy in order]
            for result in evaluate.run_job(cluster, runs, workdir):
                results.append(result)
                progress.update()
                switches = "; ".join(f"{s['protocol']}@{s['step']}" for s in result.switches)
                tqdm.write(f"{straggler:12} seed {seed} {result.spec.policy:8} to-target "
                           f"{result.time_to_target_s or float('nan'):6.1f} s  {result.throughput:5.0f} img/s  "
                           f"acc {result.final_accuracy:.3f}  wall {result.wall_s:5.1f} s  {switches}")
    print("\n".join(table(results, list(args.policies), list(args.stragglers))))
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
