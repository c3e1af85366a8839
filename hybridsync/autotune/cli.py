"""``hybridsync search``: a strategy for a model and a cluster, from the simulator alone or with trials.

    hybridsync search --model desc.json --cluster spec.yaml -o s.json              # simulator only
    hybridsync search --model vgg --cluster spec.yaml --trials 50 -o s.json        # zoo model, emulated trials
    hybridsync search --model desc.json --cluster spec.yaml --trials 30 -H a:2,b:2 -o s.json -- python train.py

``--model`` is a profiled description (``hybridsync profile``) or a zoo model name (profiled
here, one process). With ``--trials 0`` the search ranks strategies with the simulator only.
With ``--trials N`` the autotune loop (``hybridsync.autotune.loop``) measures up to N
strategies as real trials: on the emulated cluster the spec describes (root needed), or on
real hosts with ``-H``/``--hostfile``; the jobs run the zoo model's trial worker or, given
after ``--``, your own training script (its optimizer measures the trials in flight).
"""
from __future__ import annotations

import argparse
import os
from typing import Any

from hybridsync.autotune.session import (autotune, check_emulated_target, load_cluster, load_or_profile,
                                         load_simulator, trial_target, workload_for)
from hybridsync.trials.store import DEFAULT_STORE

DEFAULT_SEARCH_BUDGET = 20_000
RUNOFF_KNOBS = ("runoff_passes", "time_limit_s")
"""``AutotuneSettings`` fields with a flag of the same name; not given, they keep the settings' defaults."""


def add_parser(commands: Any) -> None:
    """Adds ``search`` to the ``hybridsync`` command's subparsers."""
    p = commands.add_parser("search", help="pick a strategy with the simulator (and, with --trials, real trials)")
    p.add_argument("--model", required=True,
                   help="profiled model description JSON (write one with: hybridsync profile -o model.json -- "
                        "python train.py), or a zoo model name (ncf, bert, vgg, resnet; profiled now)")
    p.add_argument("--cluster", required=True, help="cluster spec YAML, or a run config with a hybridsync: cluster:")
    p.add_argument("-o", "--output", required=True, help="where to write the winning strategy")
    add_autotune_arguments(p)
    p.add_argument("-H", "--hosts", help="measure trials on these real hosts (as horovodrun's -H)")
    p.add_argument("--hostfile", help="measure trials on these real hosts (as horovodrun's --hostfile)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="after --: the training script to measure trials with (default: the zoo model's worker)")
    p.set_defaults(func=_search)


def add_autotune_arguments(p: argparse.ArgumentParser) -> None:
    """``hybridsync search``'s knobs of the autotune loop (``hybridsync-run --autotune`` reads its config's)."""
    p.add_argument("--trials", "--trial-budget", dest="trials", type=int, default=0,
                   help="real trials to spend, baselines included (default 0: simulator only)")
    p.add_argument("--store", default=DEFAULT_STORE, help=f"trial store URL (default {DEFAULT_STORE})")
    p.add_argument("--report",
                   help="with --trials: directory for report.json/.md/.png (default: autotune-report/ beside --output)")
    p.add_argument("--seed", type=int, default=0, help="seed of the search's random choices (default 0)")
    p.add_argument("--search-budget", type=int, default=DEFAULT_SEARCH_BUDGET,
                   help=f"simulator evaluations per search round (default {DEFAULT_SEARCH_BUDGET})")
    p.add_argument("--per-round", type=int, default=10, help="trials per round (default 10)")
    p.add_argument("--simulator", help="a saved simulator (default: the one shipped with hybridsync)")
    p.add_argument("--exact", action="store_true",
                   help="only strategies with plain Horovod's numerics: no fp16 compression, BSP only")
    p.add_argument("--runoff-passes", type=int, default=argparse.SUPPRESS,
                   help="a search lead the confirmation job does not resolve gets a runoff job of up to this many "
                        "passes (default 8; 0: no runoff; else at least 6)")
    p.add_argument("--time-limit", dest="time_limit_s", type=_seconds_or_none, default=argparse.SUPPRESS,
                   metavar="SECONDS",
                   help="wall time of the whole autotune: rounds stop short of the trial budget and the runoff "
                        "shrinks to fit it (default 600; none: no limit)")


def _seconds_or_none(text: str) -> float | None:
    """``--time-limit``'s value: a positive number of seconds, or ``none``."""
    from hybridsync.autotune.loop import check_time_limit
    if text.lower() == "none":
        return None
    try:
        value = float(text)
        check_time_limit(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 1 or 'none', got {text!r}") from None
    return value


def _search(args: argparse.Namespace) -> int:
    cluster = load_cluster(args.cluster)
    command = [word for word in args.command if word != "--"] if args.command else []
    if args.trials > 0 and not (args.hosts or args.hostfile):
        check_emulated_target(cluster)
    description = load_or_profile(args.model)
    if args.trials <= 0:
        if command or args.hosts or args.hostfile:
            raise ValueError("a training command, -H and --hostfile are for trials: give --trials N as well")
        return _simulator_only(args, description, cluster)
    from hybridsync.autotune.loop import AutotuneSettings
    settings = AutotuneSettings(trial_budget=args.trials, per_round=args.per_round, search_budget=args.search_budget,
                                seed=args.seed, exact=args.exact, **{knob: getattr(args, knob) for knob in RUNOFF_KNOBS
                                                                     if hasattr(args, knob)})
    workload = workload_for(description.name, command)
    report = args.report or os.path.join(os.path.dirname(os.path.abspath(args.output)), "autotune-report")
    with trial_target(cluster, hosts=args.hosts, hostfile=args.hostfile) as target:
        result = autotune(description, cluster, target=target, workload=workload, settings=settings,
                          store_url=args.store, report_dir=report, simulator=args.simulator)
    result.winner.save(args.output)
    print(f"wrote {args.output}: {result.winner_kind}")
    return 0


def _simulator_only(args: argparse.Namespace, description: Any, cluster: Any) -> int:
    import numpy as np

    from hybridsync.autotune.loop import check_fits, propose
    from hybridsync.trials.candidates import baseline_candidates
    check_fits(description, cluster)
    simulator = load_simulator(args.simulator)
    references = baseline_candidates(description.variables, cluster)
    predicted = simulator.predict(description, cluster, [c.strategy for c in references])
    baseline_s, baseline = min(zip(predicted, references), key=lambda item: item[0])
    [(step_s, strategy)] = propose(simulator, description, cluster, seeds=[c.strategy for c in references],
                                   exclude=set(), count=1, budget=args.search_budget,
                                   rng=np.random.default_rng(args.seed), exact=args.exact)
    kind = "the search's best"
    if baseline_s < step_s:  # a baseline outside the search's bounds (e.g. hierarchical, one rank per node)
        step_s, strategy, kind = baseline_s, baseline.strategy, baseline.kind
    strategy.save(args.output)
    print(f"wrote {args.output} ({kind}): predicted {step_s * 1e3:.1f} ms per step; best baseline "
          f"{baseline.kind} predicted {baseline_s * 1e3:.1f} ms ({baseline_s / step_s:.2f}x). "
          f"Simulator only: measure it with --trials N.")
    return 0
