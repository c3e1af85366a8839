"""``hybridsync dataset ...``: inspect, plot, export and merge trial stores; re-link re-profiled models.

    hybridsync dataset stats  --store sqlite:///trials.db
    hybridsync dataset plot   --store sqlite:///trials.db -o plots/
    hybridsync dataset export --store sqlite:///trials.db -o trials.jsonl     # .jsonl.gz: compressed
    hybridsync dataset import host1.jsonl host2.jsonl --store sqlite:///merged.db
    hybridsync dataset redescribe --descriptions data/descriptions --models ncf --store sqlite:///trials.db
    hybridsync dataset remeasure --from 2026-11-25T16:00 --to 2026-11-25T21:30 --store sqlite:///trials.db
"""
from __future__ import annotations

import argparse
from typing import Any

from hybridsync.trials.store import DEFAULT_STORE, URL_FORMS, TrialStore


def add_parser(commands: Any) -> None:
    """Adds ``dataset`` (stats | plot | export | import | redescribe | remeasure) to the ``hybridsync`` command's
    subparsers."""
    dataset = commands.add_parser("dataset", help="the trial store: stats, plot, export, import, redescribe, remeasure")
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
    p = sub.add_parser("remeasure", help="measure the jobs that started in a time window again, each lineup in one "
                                         "new job, and replace their trials (resumable)")
    p.add_argument("--from", dest="started_from", required=True, help="window start, ISO-8601 UTC (2026-11-25T16:00)")
    p.add_argument("--to", dest="started_to", required=True, help="window end, ISO-8601 UTC prefix (2026-11-25T21:30)")
    p.add_argument("--models", nargs="+", help="only these models' jobs")
    p.add_argument("--descriptions", help="directory of re-profiled descriptions <model>.json: the new trials name "
                                          "these (default: the description the old trials name)")
    p.add_argument("--workdir", required=True, help="scratch stores and job logs, one per job")
    p.add_argument("--trial-timeout", type=float, default=300.0, help="seconds before a trial counts as hung")
    p.add_argument("--dry-run", action="store_true", help="list the jobs, measure nothing")
    p.add_argument("-H", "--hosts", help="real hosts, as horovodrun's -H (default: emulate each job's cluster here)")
    _store_argument(p)
    p.set_defaults(func=_remeasure)


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


def _remeasure(args: argparse.Namespace) -> int:
    from itertools import groupby

    from hybridsync.progress import progress_bar
    from hybridsync.trials.jobs import EmulatedTarget, HostsTarget
    from hybridsync.trials.redescribe import load_descriptions
    from hybridsync.trials.remeasure import description_for, jobs_started_between, remeasure_job
    from hybridsync.trials.store import cluster_label

    with TrialStore(args.store, create=False) as store:
        jobs = jobs_started_between(store, args.started_from, args.started_to, models=args.models)
        if not jobs:
            print(f"no job of {args.store} started between {args.started_from} and {args.started_to}")
            return 0
        new = load_descriptions(args.descriptions, sorted({j.model for j in jobs})) if args.descriptions else {}
        described = {j.job: description_for(store, j, new.get(j.model)) for j in jobs}  # refuse before measuring
        if args.dry_run:
            for j in jobs:
                print(f"{j.started}  {j.job}  {j.model:<20} {cluster_label(j.cluster.to_dict()):<18} "
                      f"{len(j.trials)} trials -> description {described[j.job][0]}")
            return 0
        with progress_bar(sum(len(j.candidates()) for j in jobs), desc="remeasure", unit="trial") as bar:
            for _, same_cluster in groupby(jobs, key=lambda j: j.cluster):
                batch = list(same_cluster)
                spec = batch[0].cluster
                with (HostsTarget(spec, hosts=args.hosts) if args.hosts else EmulatedTarget(spec)) as target:
                    for j in batch:
                        done = remeasure_job(store, j, target, workdir=args.workdir, description=described[j.job],
                                             trial_timeout_s=args.trial_timeout, on_trial=lambda r: bar.update())
                        ratio = "-" if done.old_over_new is None else f"{done.old_over_new:.2f}x"
                        bar.write(f"{done.model} on {done.cluster}: job {done.old_job} -> {done.new_job or 'kept'}, "
                                  f"{done.trials} trials ({done.failed} failed), old / new step time {ratio}")
    return 0
