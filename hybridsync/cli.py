"""The commands: ``hybridsync`` (inspect and build strategies, run emulated clusters) and
``hybridsync-run`` (``run_main``: ``hybridsync.run.launcher``, or the autotuner with ``--autotune``),
and what their ``--model`` names (``load_model_variables``)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import textwrap
from typing import Sequence

from hybridsync import baselines
from hybridsync.autotune import cli as autotune_cli
from hybridsync.cli_parser import CommandParser
from hybridsync.description import VariableInfo, load_model_description
from hybridsync.explain import explain
from hybridsync.run import launcher, profile
from hybridsync.strategy import Strategy
from hybridsync.syncswitch import cli as syncswitch_cli
from hybridsync.trials import cli as trials_cli
from hybridsync.trials import dataset_cli


def load_model_variables(model: str) -> dict[str, VariableInfo]:
    """The variables of ``--model``: an existing description file wins, else a zoo model name
    (``ncf``, ``bert``, ``vgg``, ``resnet``, or generated: ``gen-recsys-7``); ``ValueError`` naming
    both possibilities otherwise. The zoo (and so torch) is imported only when ``model`` is not a
    file, so that commands reading description files run without torch."""
    if os.path.exists(model):
        return load_model_description(model)
    try:
        from hybridsync import zoo
    except ImportError as e:  # no torch here: only description files can be read
        raise ValueError(f"--model {model!r}: no such model description file, and the model zoo "
                         f"cannot be imported ({e})") from None
    if not zoo.is_model(model):
        raise ValueError(f"--model {model!r}: neither a model description file nor a zoo model "
                         f"(zoo models: {', '.join(zoo.ZOO_MODELS)}; generated: gen-<family>-<k>)")
    return zoo.describe(model)


def _explain(args: argparse.Namespace) -> int:
    variables = load_model_variables(args.model) if args.model else None
    print(explain(Strategy.load(args.strategy), variables))
    return 0


def _baseline(args: argparse.Namespace) -> int:
    variables = load_model_variables(args.model)
    rows = frozenset(args.rows or ())
    if "rows" in baselines.split_twin(args.name)[1] and not rows:
        raise ValueError(f"{args.name}: a rows twin sends the dense embeddings named by --rows as their rows; "
                         "name them (an autotune takes those a profile shows touching few rows)")
    strategy = baselines.build_baseline(args.name, variables, args.num_servers, rows=rows)
    strategy.save(args.output)
    print(f"wrote {args.output} ({args.name}, fingerprint {strategy.fingerprint()})")
    return 0


MODEL_HELP = ("model description JSON (write one with: hybridsync profile -o model.json -- python train.py), "
              "or a zoo model name (ncf, bert, vgg, resnet, or generated: gen-recsys-7)")


def _baselines_epilog() -> str:
    """The baselines, one line each (the builder's docstring), and which of them have twins."""
    width = max(map(len, baselines.BUILDERS))
    lines = [textwrap.fill(builder.__doc__.splitlines()[0].replace("``", ""), 100,
                           initial_indent=f"  {name:<{width}}  ", subsequent_indent=" " * (width + 4))
             for name, builder in baselines.BUILDERS.items()]
    twins = (f"twins of {', '.join(baselines.TWINS)}: <name>-fp16 (fp16 on every dense gradient, as Horovod's "
             "Compression.fp16), <name>-rows (the --rows embeddings sent as their nonzero rows), <name>-rows-fp16")
    return "baselines:\n" + "\n".join(lines) + "\n\n" + textwrap.fill(twins, 100)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="hybridsync", description="Inspect, build, measure and search synchronization strategies; run emulated "
        "clusters. Training jobs start with hybridsync-run (hybridsync-run --help).")
    commands = parser.add_subparsers(dest="subcommand", required=True)  # "command" is a script's argv
    p = commands.add_parser("explain", help="print what a strategy does to each variable")
    p.add_argument("strategy", help="strategy file (.json/.yaml)")
    p.add_argument("--model", help=MODEL_HELP)
    p.set_defaults(func=_explain)
    twins = baselines.twin_names(fp16=True, rows=True)
    p = commands.add_parser("baseline", help="write a hand-made baseline strategy for a model",
                            epilog=_baselines_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=sorted([*baselines.BUILDERS, *twins]), metavar="name",
                   help="a baseline below, or one of its twins")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--num-servers", type=int, default=1, help="parameter servers (PS baselines)")
    p.add_argument("--rows", nargs="+", metavar="VARIABLE",
                   help="the dense embeddings a rows twin (<name>-rows[-fp16]) sends as their nonzero rows")
    p.add_argument("-o", "--output", required=True, help="where to write the strategy")
    p.set_defaults(func=_baseline)
    profile.add_parser(commands)
    trials_cli.add_parser(commands)
    autotune_cli.add_parser(commands)
    dataset_cli.add_parser(commands)
    syncswitch_cli.add_parser(commands)
    commands.add_parser("cluster", help="emulated multi-node cluster: up | run | down | ls (see: cluster --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["cluster"]:  # its own parser: everything after "--" is the job's command
        from hybridsync.run.cluster_cli import main as cluster_main
        return cluster_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        message = launcher.describe_os_error(e) if isinstance(e, OSError) else e
        print(f"hybridsync {args.subcommand}: error: {message}", file=sys.stderr)
        return 2


def run_main(argv: Sequence[str] | None = None) -> int:
    """``hybridsync-run``: horovodrun plus servers and a strategy (``hybridsync.run.launcher``), or,
    with ``--autotune`` or the run config's ``autotune:`` section, the autotuner."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or launcher.asks_for_help(argv):
            _print_help(launcher.usage())
            return 0
        options, rest = launcher.split_argv(argv)
        if _autotune_requested(options, rest):
            from hybridsync.autotune.launch import run_autotuned  # the autotuner needs numpy, xgboost, the search
            return run_autotuned(dataclasses.replace(options, autotune=True), rest)
        return launcher.run(options, rest)
    except ValueError as e:
        print(f"hybridsync-run: error: {e}", file=sys.stderr)
        return 2


def _print_help(text: str) -> None:
    """Print ``text``; a reader that closed the pipe early (``hybridsync-run --help | head``) is no error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python flushes stdout once more at exit: point it at /dev/null so that flush cannot fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _autotune_requested(options: launcher.LaunchOptions, horovodrun_argv: Sequence[str]) -> bool:
    """``--autotune``, else the ``--config-file``'s ``hybridsync: autotune:`` section (the autotuner
    reads the rest of the config itself)."""
    if options.autotune is not None:
        return options.autotune
    config_file = launcher.horovodrun_job(horovodrun_argv).config_file
    if config_file is None:
        return False
    from hybridsync.run.config import load_run_config
    return bool(load_run_config(config_file).autotune.get("enabled"))


if __name__ == "__main__":
    sys.exit(main())
