"""Does a shorter trial protocol rank strategies as AutoSync's 10 warm-up + 40 timed steps do?

    .venv/bin/python benchmarks/trial_protocol.py --store sqlite:///data/protocol.db

Reads trials measured with the full protocol (every step time is stored, warm-up included)
and, per model x cluster, compares each trial's full step time (median of steps 10-49)
with what a shorter protocol would have measured in the same run: the median of steps
``w .. w+t-1`` (the first ``w + t`` steps of a trial are exactly a short trial). Printed per
short protocol: Kendall tau between the short and full rankings, the share of trial pairs
ordered alike, whether the top-1 strategy is the same, the median relative deviation
|short/full - 1|, and the median spread ((p90 - p10) / median) of the steps each one times.

Noise floor, for judging those taus: ``split`` is the full protocol against itself (the
median of timed steps 10-29 vs that of steps 30-49, Kendall tau), and ``disjoint`` the short
protocol against the steps after it (w+t .. 49), which shares no step with it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict

import numpy as np

FULL = (10, 40)
SHORT = ((3, 10), (5, 10), (3, 15), (5, 20), (10, 20))


def agreement(ranked: list[float], reference: list[float]):
    """How ``ranked`` orders the trials against ``reference`` (one query group): the simulator's
    metrics (``pairwise``, ``kendall_tau``)."""
    from hybridsync.model.evaluate import score
    return score(np.array(ranked), np.array(reference), [0] * len(ranked))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", required=True, help="trial store URL with full-protocol trials")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from hybridsync.trials.store import TrialStore, cluster_label, relative_spread as spread
    groups: dict[tuple[str, str], list[list[float]]] = defaultdict(list)
    with TrialStore(args.store) as store:
        for record in store.trials(status="ok"):
            if record.warmup_steps == FULL[0] and len(record.step_times) >= sum(FULL):
                groups[record.model, cluster_label(record.cluster)].append(record.step_times)
    print(f"full protocol: {FULL[0]} warm-up + {FULL[1]} timed steps; short w+t = median of steps w..w+t-1")
    print(f"{'model':<8}{'cluster':<16}{'trials':>7}{'protocol':>10}{'tau':>7}{'pairs':>7}{'top1':>6}"
          f"{'|dev|':>7}{'spread':>8}{'full spread':>12}{'disjoint':>9}{'split':>7}")
    for (model, cluster), traces in sorted(groups.items()):
        if len(traces) < 5:
            continue
        full = [statistics.median(t[FULL[0]:sum(FULL)]) for t in traces]
        full_spread = statistics.median(spread(t[FULL[0]:sum(FULL)]) for t in traces)
        half = FULL[0] + FULL[1] // 2
        split = agreement([statistics.median(t[FULL[0]:half]) for t in traces],
                          [statistics.median(t[half:sum(FULL)]) for t in traces]).kendall_tau
        for warmup, timed in SHORT:
            short = [statistics.median(t[warmup:warmup + timed]) for t in traces]
            against_full = agreement(short, full)
            deviation = statistics.median(abs(s / f - 1) for s, f in zip(short, full))
            short_spread = statistics.median(spread(t[warmup:warmup + timed]) for t in traces)
            top1 = int(np.argmin(full)) == int(np.argmin(short))
            disjoint = agreement(short, [statistics.median(t[warmup + timed:sum(FULL)]) for t in traces]).kendall_tau
            print(f"{model:<8}{cluster:<16}{len(traces):>7}{f'{warmup}+{timed}':>10}{against_full.kendall_tau:>7.3f}"
                  f"{against_full.pairwise:>7.3f}{'yes' if top1 else 'no':>6}{deviation:>7.3f}"
                  f"{short_spread:>8.3f}{full_spread:>12.3f}{disjoint:>9.3f}{split:>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
