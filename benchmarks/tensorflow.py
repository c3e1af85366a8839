"""TensorFlow on the emulated cluster: Horovod's Keras optimizer vs hybridsync's, without and with
an autotuned strategy, on the zoo's NCF in Keras (issue 15).

    sudo .venv/bin/python benchmarks/tensorflow.py                          # autotune (30 trials), then 2 ABBA rounds
    sudo .venv/bin/python benchmarks/tensorflow.py --strategy s.json --rounds 1

1. Autotune ``python -m hybridsync.zoo.keras_ncf`` with ``hybridsync-run --autotune`` on the
   emulated 2 x 2 cluster at 250 Mbit/s (one server per host; the autotune example config), unless
   ``--strategy`` gives the strategy. The trials run inside the Keras script itself.
2. Train it for 10 warm-up + 40 timed steps per job on that emulated cluster (up once for all
   jobs; each job's ranks started as horovodrun's Gloo mode starts them, with one server per
   host beside them, as the trials run), as: ``horovod`` (``horovod.tensorflow.keras.DistributedOptimizer``),
   ``hybridsync`` (no strategy: the drop-in), ``autotuned`` (hybridsync with the winner). Jobs
   run in ABBA order per round so drift hits every variant alike; each job's time is rank 0's
   median step.

Prints each variant's job medians and its ratio to Horovod (median over rounds, with the spread
of the per-round ratios), the autotune's time and its winner. ``TF_USE_LEGACY_KERAS=1``: Horovod's
Keras optimizer needs Keras 2.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = os.path.join(REPO, "horovodrun_configs", "cluster_2x2_250mbit.yaml")
AUTOTUNE = os.path.join(REPO, "horovodrun_configs", "autotune_2x2_250mbit.yaml")
HYBRIDSYNC_RUN = os.path.join(os.path.dirname(sys.executable), "hybridsync-run")
SCRIPT = [sys.executable, "-m", "hybridsync.zoo.keras_ncf"]
ENV = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO}
VARIANTS = ("horovod", "hybridsync", "autotuned")


def autotune(workdir: str, budget: int) -> tuple[str, float, str]:
    """The winning strategy's path, the autotune's wall time and the winner's kind."""
    report = os.path.join(workdir, "report")
    argv = [HYBRIDSYNC_RUN, "-np", "4", "--config-file", AUTOTUNE, "--trial-budget", str(budget),
            "--store", f"sqlite:///{workdir}/trials.db", "--autotune-report", report, *SCRIPT, "--steps", "300"]
    started = time.monotonic()
    with open(os.path.join(workdir, "autotune.log"), "w") as log:
        subprocess.run(argv, env=ENV, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=3600)
    doc = json.load(open(os.path.join(report, "report.json")))
    return os.path.join(report, "strategy.json"), time.monotonic() - started, doc["winner"]["kind"]


def job(target, variant: str, strategy: str, workdir: str, index: int, timeout_s: float = 900.0) -> float:
    """Rank 0's median step time (seconds) of one training job of ``variant`` on the emulated cluster."""
    from hybridsync.autotune.launch import run_on
    out = os.path.join(workdir, f"{variant}-{index}.json")
    flags = {"horovod": ["--optimizer", "horovod"], "hybridsync": [], "autotuned": ["--strategy", strategy]}[variant]
    log_path = os.path.join(workdir, f"{variant}-{index}.log")
    with open(log_path, "w") as log:
        code = run_on(target, [*SCRIPT, "--warmup", "10", "--steps", "40", "--json", out, *flags], ENV, log,
                      timeout_s=timeout_s)
    if code != 0:
        raise RuntimeError(f"{variant} job {index} failed (exit code {code}; 124: timed out): see {log_path}")
    report = json.load(open(out))
    assert len(set(report["checksums"])) == 1, f"{variant}: the ranks' variables differ"
    return report["median_step_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", help="use this strategy instead of autotuning one")
    parser.add_argument("--trial-budget", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each runs every variant twice)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, report)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="which jobs to run (horovod, the reference, always runs; without autotuned, no autotune)")
    args = parser.parse_args()
    variants = ["horovod", *(v for v in VARIANTS[1:] if v in args.variants)]
    sys.path.insert(0, REPO)
    from hybridsync.cluster.spec import ClusterSpec
    from hybridsync.trials.jobs import EmulatedTarget
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    workdir = tempfile.mkdtemp(prefix="hybridsync-bench-tf-")
    try:
        if args.strategy or "autotuned" not in variants:
            strategy, autotune_s, winner = args.strategy or "", 0.0, "given" if args.strategy else "none"
        else:
            strategy, autotune_s, winner = autotune(workdir, args.trial_budget)
            print(f"autotune: {args.trial_budget} trials in {autotune_s:.0f} s, winner {winner}", flush=True)
        medians: dict[str, list[float]] = {v: [] for v in variants}
        with EmulatedTarget(ClusterSpec.from_yaml(CLUSTER)) as target:
            for round_index in range(args.rounds):
                for variant in variants + variants[::-1]:  # A B C C B A
                    medians[variant].append(job(target, variant, strategy, workdir, len(medians[variant])))
                    print(f"round {round_index}: {variant} {1e3 * medians[variant][-1]:.1f} ms", flush=True)
        print("\nvariant      job medians (ms)                      x horovod (median of rounds, spread)")
        for variant in variants:
            ratios = [h / v for h, v in zip(medians["horovod"], medians[variant])]
            print(f"{variant:<12} {' '.join(f'{1e3 * m:6.1f}' for m in medians[variant]):<36} "
                  f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
        print(f"(x > 1: faster than horovod.tensorflow; autotune {autotune_s:.0f} s, winner {winner})")
    finally:
        if args.keep:
            print(f"work directory: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
