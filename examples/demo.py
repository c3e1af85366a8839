"""``make demo``: autotune a zoo model on the emulated 2 x 2 cluster, train with the winner, report.

    hybridsync-run -np 4 --config-file horovodrun_configs/autotune_2x2_250mbit.yaml --trial-budget N \\
        --store sqlite:///demo-output/trials.db --autotune-report demo-output \\
        python -m hybridsync.zoo.train --model vgg --steps 300

One command does it all: profile the training script (one process), search with the shipped
simulator, measure the most promising strategies as real trials on the emulated cluster
(4 ranks on 2 hosts joined by 250 Mbit/s links, one parameter server per host), refit,
confirm the winner against the fastest hand-made strategies in one job, then train with
it. Needs root (network namespaces). Prints the measured speedup over the best hand-made
strategy and the time the whole thing took; the report is in ``demo-output/``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "horovodrun_configs", "autotune_2x2_250mbit.yaml")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="vgg", help="zoo model (default vgg)")
    parser.add_argument("--trial-budget", type=int, default=40, help="real trials, baselines included (default 40)")
    parser.add_argument("--out", default=os.path.join(REPO, "demo-output"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("make demo: the emulated cluster needs root (network namespaces and tc); run it as root",
              file=sys.stderr)
        return 2
    shutil.rmtree(args.out, ignore_errors=True)  # a fresh store: the demo measures, never reuses
    os.makedirs(args.out)
    launcher = os.path.join(os.path.dirname(sys.executable), "hybridsync-run")
    argv = [launcher, "-np", "4", "--config-file", CONFIG, "--trial-budget", str(args.trial_budget),
            "--store", f"sqlite:///{os.path.join(args.out, 'trials.db')}", "--autotune-report", args.out,
            sys.executable, "-m", "hybridsync.zoo.train", "--model", args.model, "--steps", "300"]
    print("== " + " ".join(os.path.relpath(a, REPO) if a.startswith(REPO) else a for a in argv), flush=True)
    started = time.monotonic()
    code = subprocess.call(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=REPO)
    elapsed = time.monotonic() - started
    report = os.path.join(args.out, "report.json")
    if code != 0 or not os.path.exists(report):
        print(f"make demo: the autotuned run failed (exit code {code})", file=sys.stderr)
        return code or 1
    with open(report, encoding="utf-8") as handle:
        doc = json.load(handle)
    winner, best, tau = doc["winner"], doc["best_rival"], doc["kendall_tau"]["tau"]
    print(f"\n== {args.model} (profiled as {doc['model']}) on {doc['cluster_label']}: {len(doc['trials'])} trials")
    print(f"winner: {winner['kind']}, {winner['step_s'] * 1e3:.1f} ms per step (confirmation job; levers: "
          f"{', '.join(winner['levers']) or 'none'})")
    print(f"best fair hand-made rival: {best['kind']}, {best['step_s'] * 1e3:.1f} ms per step")
    print(f"measured speedup of the autotuned strategy over it: {doc['speedup_over_best_rival']:.2f}x")
    print(f"trials vs confirmation job, Kendall tau: {'-' if tau is None else f'{tau:.2f}'}")
    print(f"whole run (profile, search, trials, confirmation, training): {elapsed / 60:.1f} min; "
          f"report: {os.path.relpath(args.out, REPO)}/report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
