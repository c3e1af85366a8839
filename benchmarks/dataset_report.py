"""What the runtime dataset says: does any strategy beat every baseline, by how much, and how?

    .venv/bin/python benchmarks/dataset_report.py --store sqlite:///data/trials.db
    .venv/bin/python benchmarks/dataset_report.py --jsonl data/trials.jsonl.gz
    .venv/bin/python benchmarks/dataset_report.py --jsonl data/trials.jsonl.gz --by-family

Per model x cluster: the best baseline, plain Horovod, the best trial, and the best trial
among those that keep the baselines' semantics (no fp16 compression: it changes the
numerics; no ASP/SSP: they change the algorithm), each with its speedup over the best
baseline; how many trials beat the best baseline; and the winner's shape (bytes per route,
merge groups, compression, shards). Every speedup is a ratio of medians measured in one job.
``--by-family``: one line per model family (the zoo, or a generator family) x cluster instead.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import tempfile


def exact(strategy: dict | None) -> bool:
    """True if the strategy computes what the baselines compute: no fp16, no ASP/SSP."""
    if strategy is None:
        return True
    configs = [strategy.get("default", {}), *strategy.get("variables", {}).values()]
    return all(c.get("compression") != "fp16" and c.get("protocol", "bsp") == "bsp" for c in configs)


def shape(strategy: dict | None, variables: dict) -> str:
    """Bytes per route (MB), merge groups, fp16 share and partitioned variables of a strategy."""
    from hybridsync.strategy import Strategy
    if strategy is None:
        return "plain Horovod"
    parsed = Strategy.from_dict(strategy)
    by_route: dict[str, float] = collections.Counter()
    groups, fp16, shards = set(), 0, 0
    for name, info in variables.items():
        config = parsed.config_for(name)
        by_route[config.route_name] += info.nbytes / 1e6
        groups |= {config.group} - {None}
        fp16 += config.compression == "fp16"
        shards += config.partitions > 1
    routes = ", ".join(f"{route} {mb:.2f} MB" for route, mb in sorted(by_route.items(), key=lambda kv: -kv[1]))
    return f"{routes}; {len(groups)} groups; fp16 on {fp16}/{len(variables)}; {shards} partitioned"


def family(model: str) -> str:
    """``recsys`` for ``gen-recsys-3``; ``zoo`` for the zoo's models."""
    match = re.fullmatch(r"gen-([a-z]+)-\d+", model)
    return match.group(1) if match else "zoo"


def by_family(records: list) -> str:
    """Per family x cluster: models, trials, the most frequent best baseline, and the medians over
    the models of the best trial's speedup over the best baseline and over Horovod, and of p90/p10."""
    from hybridsync.trials.dataset import summarize
    groups = collections.defaultdict(list)
    for summary in summarize(records):
        groups[family(summary.model), summary.cluster].append(summary)
    lines = [f"{'family':<12} {'cluster':<16} {'models':>6} {'ok':>5} {'failed':>6}  {'best baseline (most often)':<28}"
             f" {'x baseline':>10} {'(max)':>6} {'x horovod':>9} {'p90/p10':>7}"]
    for (name, cluster), summaries in sorted(groups.items()):
        best = collections.Counter(s.best_baseline[0] for s in summaries if s.best_baseline).most_common(1)
        over_baseline = [s.speedup_over_baseline for s in summaries if s.speedup_over_baseline]
        over_horovod = [s.speedup_over_horovod for s in summaries if s.speedup_over_horovod]
        spread = [s.medians_p90_p10 for s in summaries if s.medians_p90_p10]
        lines.append(f"{name:<12} {cluster:<16} {len(summaries):>6} {sum(s.ok for s in summaries):>5} "
                     f"{sum(s.failed for s in summaries):>6}  {best[0][0] if best else '-':<28} "
                     f"{statistics.median(over_baseline):>9.2f}x {max(over_baseline):>5.2f}x "
                     f"{statistics.median(over_horovod):>8.2f}x {statistics.median(spread):>6.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--store", help="trial store URL")
    source.add_argument("--jsonl", help="an export (data/trials.jsonl.gz), loaded into a temporary store")
    parser.add_argument("--by-family", action="store_true", help="one line per model family x cluster")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from hybridsync.description import parse_description
    from hybridsync.trials.store import BASELINE_PREFIX, HOROVOD_KIND, TrialStore, cluster_label
    with tempfile.TemporaryDirectory() as tmp:
        url = args.store or os.path.join(tmp, "trials.db")
        with TrialStore(url) as store:
            if args.jsonl:
                store.import_jsonl(args.jsonl)
            records = store.trials(status="ok")
            descriptions = {did: parse_description(entry["doc"]).variables
                            for did, entry in store.descriptions().items()}
    if args.by_family:
        print(by_family(records))
        return 0
    groups = collections.defaultdict(list)
    for record in records:
        groups[record.model, cluster_label(record.cluster)].append(record)
    for (model, cluster), trials in sorted(groups.items()):
        variables = descriptions[trials[0].description_id]
        trials.sort(key=lambda r: r.median_s)
        baselines = [r for r in trials if r.kind.startswith(BASELINE_PREFIX)]
        best_baseline = baselines[0]
        horovod = next(r for r in trials if r.kind == HOROVOD_KIND)
        best_exact = next(r for r in trials if exact(r.strategy))
        beating = sum(r.median_s < best_baseline.median_s for r in trials if not r.kind.startswith(BASELINE_PREFIX))
        beating_exact = sum(r.median_s < best_baseline.median_s for r in trials
                            if not r.kind.startswith(BASELINE_PREFIX) and exact(r.strategy))
        print(f"== {model} on {cluster}: {len(trials)} trials ok")
        print(f"  best baseline  {best_baseline.kind.removeprefix(BASELINE_PREFIX):<28} "
              f"{best_baseline.median_s * 1e3:7.1f} ms")
        print(f"  plain Horovod  {'':<28} {horovod.median_s * 1e3:7.1f} ms  "
              f"(best baseline x{horovod.median_s / best_baseline.median_s:.2f} faster)")
        for label, record in (("best trial", trials[0]), ("best exact", best_exact)):
            print(f"  {label:<14} {record.kind:<28} {record.median_s * 1e3:7.1f} ms  "
                  f"x{best_baseline.median_s / record.median_s:.2f} over the best baseline, "
                  f"x{horovod.median_s / record.median_s:.2f} over Horovod")
            print(f"      {shape(record.strategy, variables)}")
        print(f"  trials faster than the best baseline: {beating} ({beating_exact} exact)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
