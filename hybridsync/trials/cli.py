"""``hybridsync trials ...``: measure strategies of zoo models on emulated or real clusters.

    hybridsync trials run --model ncf --cluster spec.yaml --sample 50 --store sqlite:///trials.db
    hybridsync trials run --model ncf --cluster spec.yaml -H a:2,b:2 --strategies s.json
    hybridsync trials list --model ncf --cluster spec.yaml --sample 5
    hybridsync trials sweep --models ncf bert --clusters a.yaml b.yaml --sample 80 --store URL --export F.jsonl

Without ``-H``/``--hostfile`` the cluster spec is emulated on this machine (root needed);
with them, the spec describes those hosts and jobs start through ``hybridsync-run``.
"""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any, Sequence

from hybridsync.cluster.spec import ClusterSpec
from hybridsync.trials.store import DEFAULT_STORE, cluster_label

if TYPE_CHECKING:  # candidates need numpy, which `hybridsync --help` must not
    from hybridsync.trials.candidates import Candidate
    from hybridsync.trials.runner import TrialProtocol


def add_parser(commands: Any) -> None:
    """Adds ``trials`` (run | list | sweep) to the ``hybridsync`` command's subparsers."""
    trials = commands.add_parser("trials", help="measure strategies of zoo models (trial runner)")
    sub = trials.add_subparsers(dest="trials_command", required=True)
    p = sub.add_parser("run", help="measure strategies of one model on one cluster")
    _model_arguments(p)
    _run_arguments(p)
    p.add_argument("-H", "--hosts", help="real hosts, as horovodrun's -H (default: emulate the spec here)")
    p.add_argument("--hostfile", help="real hosts, as horovodrun's --hostfile")
    p.set_defaults(func=_run)
    p = sub.add_parser("list", help="print the candidates a run would measure (no job)")
    _model_arguments(p)
    p.set_defaults(func=_list)
    p = sub.add_parser("sweep", help="every model x every emulated cluster into one store (resumable)")
    p.add_argument("--models", nargs="+", required=True, help="zoo or generated model names")
    p.add_argument("--clusters", nargs="+", required=True, help="cluster spec YAML files (emulated)")
    p.add_argument("--descriptions", help="directory of profiled descriptions <model>.json (optional)")
    p.add_argument("--sample", type=int, default=80, help="random strategies per model and cluster")
    p.add_argument("--seed", type=int, default=0, help="seed of the random strategies (default 0)")
    p.add_argument("--export", help="write the whole store as JSON lines here when done")
    _run_arguments(p)
    p.set_defaults(func=_sweep)


def _model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="zoo model name (ncf, bert, vgg, resnet) or generated (gen-recsys-7)")
    p.add_argument("--cluster", required=True, help="cluster spec YAML (hybridsync.cluster.ClusterSpec)")
    p.add_argument("--description", help="profiled model description (default: the zoo model's variables)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--sample", type=int, default=0,
                        help="random strategies besides the rivals (reference rows, baselines, fp16 twins)")
    source.add_argument("--strategies", help="JSON/YAML file: a strategy, or a list of strategies or "
                                              "{kind, strategy} entries (measured instead of rivals + sample)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random strategies")


def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=DEFAULT_STORE, help=f"trial store URL (default {DEFAULT_STORE})")
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps per trial (default 10)")
    p.add_argument("--steps", type=int, default=40, help="timed steps per trial (default 40)")
    p.add_argument("--trial-timeout", type=float, default=180.0,
                   help="seconds before a trial counts as hung (default 180)")
    p.add_argument("--settle-s", type=float,
                   help="seconds every job waits, once its ranks are ready, before its first trial: a job's first "
                        "seconds run slow while its parameter servers finish starting (default 6; 0 for a "
                        "quick check whose first trials need not be comparable)")
    p.add_argument("--controls", type=int, default=0,
                   help="re-measure the first N candidates (the reference rows, then the baselines) as controls "
                        "between blocks of --block-size candidates in every job, so that jobs can be put on one "
                        "level (hybridsync.trials.levels); default 0: none")
    p.add_argument("--block-size", type=int, help="candidates between two passes over the controls (default: "
                                                  "the runner's, 5)")
    p.add_argument("--workdir", help="where schedules, results and job logs go (default: a new temp dir)")


def model_description(model: str, path: str | None) -> tuple[dict[str, Any], dict, str]:
    """(variables, description document, description id) of a zoo model, profiled or not."""
    from hybridsync.description import ModelDescription, description_id, load_description
    if path is not None:
        description = load_description(path)
    else:
        from hybridsync.zoo import describe
        description = ModelDescription(name=model, variables=describe(model))
    return description.variables, description.to_dict(), description_id(description)


def _candidates(args: argparse.Namespace, variables: dict[str, Any], spec: ClusterSpec) -> list[Candidate]:
    from hybridsync.trials.candidates import load_candidates, trial_candidates
    if args.strategies:
        return load_candidates(args.strategies)
    return trial_candidates(variables, spec, sample=args.sample, seed=args.seed)


def _list(args: argparse.Namespace) -> int:
    spec = ClusterSpec.from_yaml(args.cluster)
    variables, _, _ = model_description(args.model, args.description)
    for candidate in _candidates(args, variables, spec):
        print(f"{candidate.fingerprint}  {candidate.kind}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from hybridsync.trials.jobs import EmulatedTarget, HostsTarget
    spec = ClusterSpec.from_yaml(args.cluster)
    variables, doc, desc_id = model_description(args.model, args.description)
    candidates = _candidates(args, variables, spec)
    target = (HostsTarget(spec, hosts=args.hosts, hostfile=args.hostfile) if args.hosts or args.hostfile
              else EmulatedTarget(spec))
    with _open_store(args.store) as store, target:
        store.add_description(desc_id, args.model, doc)
        run_with_progress([(args.model, desc_id, target, candidates)], store, args)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from hybridsync.trials.candidates import trial_candidates
    from hybridsync.trials.jobs import EmulatedTarget
    specs = [ClusterSpec.from_yaml(path) for path in args.clusters]
    with _open_store(args.store) as store:
        described = {}  # model -> (variables, description id), read (or built) once for every cluster
        for model in args.models:
            path = os.path.join(args.descriptions, f"{model}.json") if args.descriptions else None
            variables, doc, desc_id = model_description(model, path if path and os.path.exists(path) else None)
            store.add_description(desc_id, model, doc)
            described[model] = variables, desc_id
        for spec in specs:
            plans = [(model, desc_id, trial_candidates(variables, spec, sample=args.sample, seed=args.seed))
                     for model, (variables, desc_id) in described.items()]
            with EmulatedTarget(spec) as target:
                run_with_progress([(m, d, target, c) for m, d, c in plans], store, args)
        if args.export:
            store.export_jsonl(args.export)
            print(f"exported the store to {args.export}")
    return 0


def trial_protocol(args: argparse.Namespace) -> "TrialProtocol":
    """How ``trials run`` and ``trials sweep`` measure each trial: their flags, and ``TrialProtocol``'s own
    default where a flag is not given (``--settle-s``)."""
    from hybridsync.trials.runner import TrialProtocol
    settle = {} if args.settle_s is None else {"settle_s": args.settle_s}
    return TrialProtocol(warmup_steps=args.warmup, timed_steps=args.steps, trial_timeout_s=args.trial_timeout,
                         **settle)


def run_with_progress(runs: Sequence[tuple[str, str, Any, list[Candidate]]], store: Any,
                      args: argparse.Namespace) -> None:
    """Runs each (model, description id, target, candidates) in turn under one progress bar
    (trials done / left, ETA, best so far), printing a summary line per run."""
    from hybridsync.progress import progress_bar
    from hybridsync.trials.runner import DEFAULT_BLOCK_SIZE, TrialRunner
    if args.controls < 0:
        raise ValueError(f"--controls must be >= 0, got {args.controls}")
    protocol = trial_protocol(args)
    runners = [TrialRunner(model=model, description_id=desc_id, target=target, store=store, protocol=protocol,
                           workdir=args.workdir) for model, desc_id, target, _ in runs]
    pending = [len(runner.pending(candidates)) for runner, (_, _, _, candidates) in zip(runners, runs)]
    with progress_bar(sum(pending), desc="trials", unit="trial") as bar:
        for runner, (model, _, target, candidates) in zip(runners, runs):
            best: dict[str, Any] = {"ms": None, "failed": 0}

            def on_trial(record: Any, best: dict[str, Any] = best, model: str = model) -> None:
                bar.update()
                if record.status != "ok":
                    best["failed"] += 1
                elif best["ms"] is None or record.median_s * 1e3 < best["ms"]:
                    best.update(ms=record.median_s * 1e3, kind=record.kind)
                shown = "-" if best["ms"] is None else f"{best['ms']:.1f} ms ({best['kind']})"
                bar.set_postfix_str(f"{model} on {cluster_label(target.spec.to_dict())}: best {shown}, failed {best['failed']}")

            summary = runner.run(candidates, on_trial, controls=candidates[:args.controls],
                                 block_size=DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size)
            bar.write(f"{model} on {cluster_label(target.spec.to_dict())}: {summary.measured} measured, "
                      f"{summary.failed} failed, {summary.skipped} already in the store, {summary.controls} control "
                      f"trials, {summary.jobs} job(s), {summary.seconds:.0f} s")


def _open_store(url: str) -> Any:
    from hybridsync.trials.store import TrialStore
    return TrialStore(url)

