"""Is the dataset's best sampled strategy faster than the best *fair* rival? (issue 21 section 2)

    sudo .venv/bin/python benchmarks/dataset_fair.py --dataset sqlite:///data/trials.db \
        [--models ncf bert vgg resnet] [--clusters horovodrun_configs/cluster_2x2_1gbit.yaml ...] [--out DIR]

The shipped dataset's jobs measured the baselines without fp16 rivals, while most of the fastest
sampled strategies use fp16, so its "x baseline" (``hybridsync dataset stats``) compares unlike
things. Per (zoo model, cluster) this runs one new job that measures, in passes, every fair rival
(``hybridsync.trials.candidates.rivals``: plain Horovod, Horovod with fp16 where it runs, every
baseline and its fp16 twin) as controls, and between them the dataset's ``--best`` fastest sampled
strategies of that pair (fastest by their ratio to the best baseline of their own job), each twice,
with the sweep's protocol (3 warm-up + 10 timed steps). Within that one job it prints the sampled
best over the best baseline without fp16 (the dataset's column, measured again) and over the best
fair rival, naming the rival. Step times: the mean of a strategy's trial medians in the job.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hybridsync.cluster.spec import ClusterSpec  # noqa: E402
from hybridsync.strategy import Strategy  # noqa: E402
from hybridsync.trials.candidates import Candidate, rival_levers, rivals  # noqa: E402
from hybridsync.trials.cli import model_description  # noqa: E402
from hybridsync.trials.dataset import cluster_label  # noqa: E402
from hybridsync.trials.jobs import EmulatedTarget  # noqa: E402
from hybridsync.trials.runner import TrialProtocol, TrialRunner  # noqa: E402
from hybridsync.trials.store import BASELINE_PREFIX, TrialRecord, TrialStore, base_kind  # noqa: E402

PROTOCOL = TrialProtocol(warmup_steps=3, timed_steps=10)
CLUSTERS = ("horovodrun_configs/cluster_2x2_1gbit.yaml", "horovodrun_configs/cluster_2x2_500mbit_2ps.yaml")


def fastest_sampled(records: list[TrialRecord], count: int) -> list[Strategy]:
    """The ``count`` sampled (``random``) strategies fastest by their median over the best plain
    baseline's median in their own job (jobs are not comparable with each other)."""
    ok = [r for r in records if r.status == "ok" and r.median_s]
    best_baseline: dict[str, float] = {}
    for r in ok:
        if base_kind(r.kind).startswith(BASELINE_PREFIX):
            best_baseline[r.job] = min(best_baseline.get(r.job, r.median_s), r.median_s)
    sampled = sorted((r.median_s / best_baseline[r.job], r.fingerprint, r.strategy) for r in ok
                     if base_kind(r.kind) == "random" and r.job in best_baseline)
    out: dict[str, Strategy] = {}
    for _, fingerprint, doc in sampled:
        if len(out) == count:
            break
        out.setdefault(fingerprint, Strategy.from_dict(doc))
    return list(out.values())


def measure_pair(dataset: TrialStore, model: str, spec: ClusterSpec, best: int, out: str) -> dict:
    """One job on ``spec``: the fair rivals as controls around the dataset's fastest sampled strategies."""
    variables, doc, desc_id = model_description(model, None)
    sampled = fastest_sampled(dataset.trials(model=model, cluster=spec.to_dict()), best)
    if not sampled:
        raise SystemExit(f"{model} on {cluster_label(spec.to_dict())}: the dataset holds no sampled strategy")
    lineup, not_runnable = rivals(variables, spec, horovod=True, fp16=True)
    candidates = [Candidate(kind=f"sampled{i + 1}", strategy=s) for i, s in enumerate(sampled)]
    with TrialStore(f"sqlite:///{out}/{model}-{spec.nodes}x{spec.workers_per_node}.db") as store, \
            EmulatedTarget(spec) as target:
        store.add_description(desc_id, model, doc)
        runner = TrialRunner(model=model, description_id=desc_id, target=target, store=store, protocol=PROTOCOL,
                             workdir=tempfile.mkdtemp(prefix=f"fair-{model}-", dir=out))
        runner.run(candidates, controls=lineup, block_size=len(candidates), rechecks=candidates)
        records = [r for r in store.trials(model=model) if r.status == "ok" and r.median_s]
    medians: dict[str, list[float]] = defaultdict(list)
    for r in records:
        medians[base_kind(r.kind)].append(r.median_s)
    ms = {kind: 1e3 * statistics.fmean(values) for kind, values in medians.items()}
    fair = {k: v for k, v in ms.items() if not k.startswith("sampled")}
    plain = {k: v for k, v in fair.items() if k.startswith(BASELINE_PREFIX) and not rival_levers(k)}
    sampled_best = min((k for k in ms if k.startswith("sampled")), key=ms.get)
    rival = min(fair, key=fair.get)
    baseline = min(plain, key=plain.get)
    return {"model": model, "cluster": cluster_label(spec.to_dict()), "ms": ms, "sampled": sampled_best,
            "rival": rival, "baseline": baseline, "x_baseline": ms[baseline] / ms[sampled_best],
            "x_rival": ms[rival] / ms[sampled_best], "not_runnable": sorted(not_runnable)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="sqlite:///data/trials.db", help="trial store holding the dataset")
    parser.add_argument("--models", nargs="+", default=["ncf", "bert", "vgg", "resnet"])
    parser.add_argument("--clusters", nargs="+", default=list(CLUSTERS))
    parser.add_argument("--best", type=int, default=2, help="fastest sampled strategies per pair")
    parser.add_argument("--out", help="where the stores and job logs go (default: a new temp dir)")
    args = parser.parse_args()
    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="dataset-fair-"))
    os.makedirs(out, exist_ok=True)
    rows = []
    with TrialStore(args.dataset) as dataset:
        for path in args.clusters:
            spec = ClusterSpec.from_yaml(path)
            for model in args.models:
                try:
                    row = measure_pair(dataset, model, spec, args.best, out)
                except RuntimeError as error:  # the runner gave up on this pair's jobs: say so, go on
                    print(f"{model} on {cluster_label(spec.to_dict())}: {error}", flush=True)
                    continue
                rows.append(row)
                print(f"{row['model']:7s} {row['cluster']:18s} "
                      + "  ".join(f"{k} {v:.1f}" for k, v in sorted(row["ms"].items(), key=lambda kv: kv[1])),
                      flush=True)
    print(f"\n{'model':7s} {'cluster':18s} {'sampled best':>12s} {'x best baseline (no fp16)':>26s} "
          f"{'x best fair rival':>18s}  rival")
    for row in rows:
        print(f"{row['model']:7s} {row['cluster']:18s} {row['ms'][row['sampled']]:10.1f}ms "
              f"{row['x_baseline']:25.2f}x {row['x_rival']:17.2f}x  {row['rival']}")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
