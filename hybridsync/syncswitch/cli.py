"""``hybridsync syncswitch tune``: pick the BSP -> ASP switch point from a few short runs."""
from __future__ import annotations

import argparse
import math
import tempfile
from typing import Any

DEFAULT_FRACTIONS = (0.0625, 0.125, 0.25, 0.5)


def _tune(args: argparse.Namespace) -> int:
    from hybridsync.progress import progress_bar
    from hybridsync.strategy import Strategy
    from hybridsync.syncswitch.tune import switch_strategy, tune_on_digits

    base = Strategy.load(args.strategy) if args.strategy else Strategy.from_dict({"default": {"route": "ps"}})
    switch_strategy(base, 0.5, args.steps)  # a base the policy cannot drive fails before any run
    probes = 1 + math.ceil(math.log2(len(args.fractions) + 1))
    with progress_bar(probes * len(args.seeds), desc="tuning runs", unit="run") as progress:
        result = tune_on_digits(args.fractions, steps=args.steps, seeds=args.seeds, tolerance=args.tolerance,
                                workdir=tempfile.mkdtemp(prefix="hs-syncswitch-tune-"), progress=progress)
    for fraction, (accuracy, seconds) in sorted(result.measured.items()):
        when = f"{seconds:6.1f} s" if seconds is not None else "   never"
        print(f"BSP fraction {fraction:6.4f}: final accuracy {accuracy:.4f}, time to target {when}")
    strategy = switch_strategy(base, result.fraction, args.total_steps or args.steps)
    strategy.save(args.output)
    print(f"chose switch_at {result.fraction} (BSP accuracy {result.reference_accuracy:.4f}, tolerance "
          f"{args.tolerance}); wrote {args.output}")
    return 0


def add_parser(commands: Any) -> None:
    """``hybridsync syncswitch ...``."""
    parser = commands.add_parser("syncswitch", help="Sync-Switch: choose the BSP -> ASP switch point offline")
    sub = parser.add_subparsers(dest="syncswitch_command", required=True)
    p = sub.add_parser("tune", help="binary-search the BSP fraction on short runs of the digits task on an "
                                    "emulated cluster (needs root); write a strategy with policy 'switch'")
    p.add_argument("-o", "--output", required=True, help="strategy file to write (.json/.yaml)")
    p.add_argument("--strategy", help="base strategy (its PS variables must be BSP; default: all on the PS)")
    p.add_argument("--fractions", type=float, nargs="+", default=list(DEFAULT_FRACTIONS),
                   help=f"candidate BSP fractions in (0, 1) (default {' '.join(map(str, DEFAULT_FRACTIONS))})")
    p.add_argument("--steps", type=int, default=200, help="steps of each tuning run (default 200)")
    p.add_argument("--total-steps", type=int, help="total_steps written into the strategy (default --steps)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds per candidate (accuracy is averaged)")
    p.add_argument("--tolerance", type=float, default=0.005,
                   help="accuracy a candidate may lose against all-BSP and still qualify (default 0.005)")
    p.set_defaults(func=_tune)
