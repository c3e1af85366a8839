"""``hybridsync-run --autotune``: profile -> search -> trials -> train with the winner, one command.

    hybridsync-run --autotune --cluster spec.yaml -np 4 python train.py          # emulated here (root)
    hybridsync-run --autotune --cluster spec.yaml -np 4 -H a:2,b:2 python train.py
    hybridsync-run --config-file run.yaml python train.py    # its hybridsync: autotune: and cluster:

1. profile: the command runs as one process with ``HYBRIDSYNC_PROFILE`` (a few steps);
2. search and trials (``hybridsync.autotune.loop``): the same command runs as the trial job,
   its optimizer switching strategies in flight (``hybridsync.hooks.trials``);
3. train: the command runs once more, every rank with ``HYBRIDSYNC_STRATEGY`` = the winner.

The cluster spec (``--cluster`` or the config's ``hybridsync: cluster:``) tells the simulator
the shape, the inter-node bandwidth and the servers per host. Without ``-H``/``--hostfile``
that spec is emulated on this machine (network namespaces; root); with them, it must
describe those hosts (as many workers as ``-np``). The report and ``strategy.json`` go to
``--autotune-report`` (default ``autotune-report/``); the trials to ``--store``.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Sequence

from hybridsync import envvars
from hybridsync.run.launcher import LaunchOptions, horovodrun_job, run

DEFAULT_TRIAL_BUDGET = 50
DEFAULT_REPORT_DIR = "autotune-report"
TRAIN_POLL_S = 0.5


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Plan:
    """Everything the run needs, resolved from the flags and the config before any process starts."""

    cluster: Any
    command: tuple[str, ...]
    hosts: str | None
    hostfile: str | None
    settings: Any
    store: str
    report_dir: str
    simulator: str | None


def run_autotuned(options: LaunchOptions, horovodrun_argv: Sequence[str]) -> int:
    """``hybridsync-run --autotune``: returns the training job's exit code (2 if autotuning failed)."""
    try:
        return _run(options, horovodrun_argv)
    except RuntimeError as error:  # ProfileFailed, a trial job that never started, an empty confirmation
        print(f"hybridsync-run --autotune: error: {error}", file=sys.stderr)
        return 2


def _run(options: LaunchOptions, horovodrun_argv: Sequence[str]) -> int:
    started = time.monotonic()
    plan = _plan(options, horovodrun_argv)
    from hybridsync.autotune.session import autotune, trial_target
    from hybridsync.run.profile import profile_command, script_name
    from hybridsync.trials.runner import ScriptWorkload
    _check_outputs(plan)
    print(f"hybridsync-run --autotune: profiling {script_name(plan.command)} (one process)", file=sys.stderr)
    description = profile_command(list(plan.command), output=os.path.join(plan.report_dir, "model.json"))
    strategy_path = os.path.join(plan.report_dir, "strategy.json")
    with trial_target(plan.cluster, hosts=plan.hosts, hostfile=plan.hostfile) as target:
        result = autotune(description, plan.cluster, target=target, workload=ScriptWorkload(plan.command),
                          settings=plan.settings, store_url=plan.store, report_dir=plan.report_dir,
                          simulator=plan.simulator)
        result.winner.save(strategy_path)
        tuned = time.monotonic() - started
        print(f"hybridsync-run --autotune: {result.winner_kind} won ({strategy_path}); autotuning took "
              f"{tuned:.0f} s; training with it", file=sys.stderr)
        if plan.hosts is None and plan.hostfile is None:
            code = run_on(target, plan.command, {envvars.STRATEGY: strategy_path}, servers=result.winner.uses_ps)
    if plan.hosts is not None or plan.hostfile is not None:
        code = run(dataclasses.replace(options, strategy=strategy_path, autotune=False), horovodrun_argv)
    took = f"{time.monotonic() - started:.0f} s (autotune {tuned:.0f} s)"
    ended = f"done in {took}" if code == 0 else f"training with the winner failed (exit code {code}) after {took}"
    print(f"hybridsync-run --autotune: {ended}; report in {plan.report_dir}", file=sys.stderr)
    return code


def _plan(options: LaunchOptions, horovodrun_argv: Sequence[str]) -> _Plan:
    """Flags over the config's ``hybridsync:`` section; ``ValueError`` for what cannot work."""
    from hybridsync.autotune.loop import AutotuneSettings, check_cluster
    from hybridsync.autotune.session import check_emulated_target, load_cluster
    from hybridsync.run.config import RunConfig, load_run_config
    from hybridsync.trials.store import DEFAULT_STORE
    job = horovodrun_job(horovodrun_argv)
    config = load_run_config(job.config_file) if job.config_file else RunConfig()
    tune = config.autotune
    cluster = load_cluster(options.cluster) if options.cluster else config.cluster
    if cluster is None:
        raise ValueError("--autotune needs the cluster's spec (shape, inter-node bandwidth, servers per host): "
                         "give --cluster SPEC.yaml or a hybridsync: cluster: section in --config-file")
    check_cluster(cluster)  # before the profile: a 1-worker spec was refused only once profiling was done
    if cluster.num_workers != job.num_proc:
        raise ValueError(f"the cluster spec has {cluster.num_workers} workers ({cluster.nodes} nodes x "
                         f"{cluster.workers_per_node}) but -np is {job.num_proc}")
    if options.strategy:
        raise ValueError("--autotune picks the strategy: drop --strategy (or drop --autotune to use that file)")
    if job.hosts_arg is not None or job.hostfile is not None:
        from hybridsync.trials.jobs import check_hosts_fit
        check_hosts_fit(cluster, hosts=job.hosts_arg, hostfile=job.hostfile)
    else:
        check_emulated_target(cluster)
    settings = AutotuneSettings(trial_budget=options.trial_budget or tune.get("trial_budget", DEFAULT_TRIAL_BUDGET),
                                per_round=tune.get("per_round", AutotuneSettings.per_round),
                                search_budget=tune.get("search_budget", AutotuneSettings.search_budget),
                                seed=tune.get("seed", 0), exact=tune.get("exact", False),
                                runoff_passes=tune.get("runoff_passes", AutotuneSettings.runoff_passes),
                                time_limit_s=tune.get("time_limit_s", AutotuneSettings.time_limit_s))
    return _Plan(cluster=cluster, command=job.command, hosts=job.hosts_arg, hostfile=job.hostfile, settings=settings,
                 store=options.store or tune.get("store", DEFAULT_STORE),
                 report_dir=os.path.abspath(options.autotune_report or tune.get("report", DEFAULT_REPORT_DIR)),
                 simulator=tune.get("simulator"))


def _check_outputs(plan: _Plan) -> None:
    """Make the report folder and open the trial store before minutes of profiling and trials:
    a folder that cannot be made failed with a traceback (exit code 1), a store that cannot be
    opened only once profiling was done; now each is a one-line error (exit code 2) at once."""
    try:
        os.makedirs(plan.report_dir, exist_ok=True)
    except OSError as error:
        raise RuntimeError(f"cannot make the report folder {plan.report_dir} (--autotune-report, or the config's "
                           f"autotune: report:): {error.strerror or error}") from error
    if not os.access(plan.report_dir, os.W_OK):
        raise RuntimeError(f"cannot write in the report folder {plan.report_dir} (--autotune-report, or the "
                           f"config's autotune: report:)")
    from hybridsync.trials.store import TrialStore
    try:
        with TrialStore(plan.store):
            pass
    except ValueError as error:  # a missing folder, a file that is no trial store, a locked or corrupt one
        raise RuntimeError(f"{error} (--store, or the config's autotune: store:)") from error


def run_on(target: Any, command: Sequence[str], env: dict[str, str], out: Any = sys.stdout,
           timeout_s: float | None = None, *, servers: bool = True) -> int:
    """Runs ``command`` on every worker of an entered emulated ``target`` with ``env`` (and its
    parameter servers, with ``servers``), output to ``out``, until it ends (or ``timeout_s``: 124).
    Returns the first non-zero exit code, or 0."""
    job = target.start(list(command), env, out, servers=servers)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            codes = job.exit_codes()
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                return 124
            time.sleep(TRAIN_POLL_S)
    finally:
        job.stop()
