"""``hybridsync dataset ...``: inspect, plot, export and merge trial stores; re-link re-profiled models.

    hybridsync dataset stats  --store sqlite:///trials.db
    hybridsync dataset plot   --store sqlite:///trials.db -o plots/
    hybridsync dataset export --store sqlite:///trials.db -o trials.jsonl     # .jsonl.gz: compressed
    hybridsync dataset import host1.jsonl host2.jsonl --store sqlite:///merged.db
    hybridsync dataset redescribe --descriptions data/descriptions --models ncf --store sqlite:///trials.db
"""
from __future__ import annotations

import argparse
from typing import Any

from hybridsync.trials.store import DEFAULT_STORE, URL_FORMS, TrialStore


def add_parser(commands: Any) -> None:
    """Adds ``dataset`` (stats | plot | export | import | redescribe) to the ``hybridsync`` command's subparsers."""
    dataset = commands.add_parser("dataset", help="the trial store: stats, plot, export, import, redescribe")
    sub = dataset.add_subparsers(dest="dataset_command", required=True)
    p = sub.add_parser("stats", help="a table per model x cluster: trials, failures, best baseline, best trial")
    _store_argument(p)
    p.add_argument("--model", help="only this model")
    p.set_defaults(func=_stats)
    p = sub.add_parser("plot", help="one PNG per model x cluster: step-time distribution, baselines marked")
    _store_argument(p)
    p.add_argument("--model", help="only this model")
    p.add_argument("-o", "--output", required=True, help="directory for the PNG files (made if missing)")
    p.set_defaults(func=_plot)
    p = sub.add_parser("export", help="write the store as JSON lines (deterministic, diff-friendly)")
    _store_argument(p)
    p.add_argument("-o", "--output", required=True, help="the .jsonl file to write")
    p.set_defaults(func=_export)
    p = sub.add_parser("import", help="add exported JSON lines to a store (trials already there are skipped)")
    p.add_argument("files", nargs="+", help="files written by `hybridsync dataset export`")
    _store_argument(p)
    p.set_defaults(func=_import)
    p = sub.add_parser("redescribe", help="point the trials of models profiled again at their new descriptions "
                                          "(same variables, new timing: a new description id)")
    p.add_argument("--descriptions", required=True, help="directory of descriptions <model>.json (data/descriptions)")
    p.add_argument("--models", nargs="+", help="only these models (default: every model of the directory that the "
                                               "store holds trials of)")
    _store_argument(p)
    p.set_defaults(func=_redescribe)


def _store_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=DEFAULT_STORE, help=f"trial store URL: {URL_FORMS} (default {DEFAULT_STORE})")


def _records(args: argparse.Namespace) -> list:
    """The stored trials the command reads; ``ValueError`` for a missing or empty store."""
    with TrialStore(args.store, create=False) as store:
        records = store.trials(model=args.model)
    if not records:
        what = f"trials of model {args.model!r}" if args.model else "trials"
        raise ValueError(f"trial store {args.store!r} holds no {what}")
    return records


def _stats(args: argparse.Namespace) -> int:
    from hybridsync.trials.dataset import format_table, summarize

    print(format_table(summarize(_records(args))))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from hybridsync.trials.dataset import plot_summaries, summarize

    for path in plot_summaries(summarize(_records(args)), args.output):
        print(f"wrote {path}")
    return 0


def _export(args: argparse.Namespace) -> int:
    with TrialStore(args.store, create=False) as store:
        lines = store.export_jsonl(args.output)
    print(f"wrote {args.output} ({lines} lines)")
    return 0


def _import(args: argparse.Namespace) -> int:
    with TrialStore(args.store) as store:
        for path in args.files:
            added, skipped = store.import_jsonl(path, progress=True)
            print(f"{path}: {added} trials added, {skipped} already in the store")
    return 0


def _redescribe(args: argparse.Namespace) -> int:
    from hybridsync.trials.redescribe import load_descriptions, redescribe

    descriptions = load_descriptions(args.descriptions, args.models)
    with TrialStore(args.store, create=False) as store:
        if args.models is None:  # the directory may describe models this store never measured
            descriptions = {model: d for model, d in descriptions.items() if store.description_ids(model)}
        if not descriptions:
            raise ValueError(f"no description in {args.descriptions} is of a model with trials in {args.store!r}")
        for relinked in redescribe(store, descriptions):
            old = ", ".join(relinked.old_ids)
            print(f"{relinked.model}: {relinked.trials} trials {old} -> {relinked.new_id}" if relinked.trials
                  else f"{relinked.model}: unchanged ({relinked.new_id})")
    return 0
