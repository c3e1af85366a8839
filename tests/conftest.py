"""Shared helpers: launching real multi-process jobs with a hard time bound; a description profiled again."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import pytest

from hybridsync.description import ModelDescription
from hybridsync.run.horovodrun import horovodrun_command
from hybridsync.run.procs import run_bounded

TIERS = ("unit", "multiprocess", "emulated")
"""Every test has exactly one of these markers (registered in pytest.ini)."""

REPO = Path(__file__).resolve().parent.parent
WORKERS = REPO / "tests" / "workers"
BIN = Path(sys.executable).parent


IS_ROOT = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
"""Whether this process can build the emulated cluster (network namespaces and tc: root and iproute2)."""


def emulated_marks(timeout_s: float) -> list:
    """The marks of an emulated-cluster test module: the ``emulated`` tier, skipped without root,
    ``ip`` and ``tc`` (network namespaces) or without Horovod, and a ``timeout_s`` backstop (every
    process the tests start has its own, shorter, bound)."""
    import importlib.util
    return [pytest.mark.emulated,
            pytest.mark.skipif(not IS_ROOT, reason="network namespaces and tc need root and iproute2"),
            pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="horovod not installed"),
            pytest.mark.timeout(timeout_s)]


def reprofiled(desc: ModelDescription, factor: float) -> ModelDescription:
    """``desc`` profiled again (or on a loaded machine): every phase and ready time ``factor`` x, the
    variables the same."""
    timing = dataclasses.replace(desc.timing, forward_s=desc.timing.forward_s * factor,
                                 backward_s=desc.timing.backward_s * factor,
                                 optimizer_s=desc.timing.optimizer_s * factor, step_s=desc.timing.step_s * factor)
    return dataclasses.replace(desc, timing=timing, variable_timing={
        name: dataclasses.replace(t, ready_s=t.ready_s * factor) for name, t in desc.variable_timing.items()})


def every_help() -> dict[str, str]:
    """The ``--help`` text of every command and subcommand, nested ones included, by ``prog``
    (``hybridsync cluster`` from its own parser: ``hybridsync``'s entry for it only hands over)."""
    from hybridsync.cli import build_parser
    from hybridsync.run import cluster_cli

    def walk(parser: argparse.ArgumentParser):
        yield parser.prog, parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from walk(sub)

    return dict(walk(build_parser())) | dict(walk(cluster_cli.build_parser()))


def horovodrun_args(np: int = 2, hosts: str | None = None) -> list[str]:
    """horovodrun's (and ``hybridsync-run``'s) arguments that start ``np`` Gloo ranks on ``hosts``."""
    return ["-np", str(np), "-H", hosts or f"localhost:{np}", "--gloo"]


def launcher_argv(launcher: str, np: int = 2, hosts: str | None = None) -> list[str]:
    """The command prefix that starts ``np`` ranks with horovodrun (Gloo) or Debian's mpirun.

    horovodrun runs as ``hybridsync-run`` runs it (``hybridsync.run.horovodrun``: Horovod's own
    ``run_commandline``, which starts the ranks alike), whose build check imports no TensorFlow: plain
    ``horovodrun``'s did, 9-13 s of every job on a loaded machine. Plain ``horovodrun`` still runs
    the jobs of ``test_elastic.py`` and ``test_sparse_warning.py``."""
    if launcher == "horovodrun":
        return [*horovodrun_command(), *horovodrun_args(np, hosts)]
    if launcher == "mpirun":
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(np),
                "-x", "PATH", "-x", "PYTHONPATH"]
    raise ValueError(launcher)


def run_job(argv: list[str], timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a multi-process job; fail the test (never hang) if it outlives ``timeout``."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        return run_bounded(argv, timeout=timeout, env=full_env, cwd=str(REPO))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"job did not finish within {timeout}s: {' '.join(argv)}\n{e.output}")


def check_dropin_outcome(outcome: dict, tolerance: float, ranks_apart: bool = False) -> None:
    """One pattern's outcome from a drop-in patterns worker (``workers/dropin_patterns.py``,
    ``workers/tf_dropin_patterns.py``): hybridsync without a strategy (``none``) and with a mixed one
    either fail as Horovod does, or keep their ranks equal (unless ``ranks_apart``), end where Horovod
    does when Horovod's ranks agree, and the strategy changes nothing."""
    horovod = outcome["horovod"]
    for variant in ("none", "mixed"):
        got = outcome[variant]
        if "error" in got:
            assert "error" in horovod and got["error"] == horovod["error"], (variant, got.get("trace"), horovod)
            continue
        if not ranks_apart:
            assert got["diff_across_ranks"] <= tolerance, (variant, got)
        if "diff_across_ranks" in horovod and horovod["diff_across_ranks"] <= tolerance:
            assert got["diff_vs_horovod"] <= tolerance, (variant, got)
        if variant == "mixed" and "error" not in outcome["none"]:
            assert got["diff_vs_none"] <= tolerance, got


_rank_results: dict[tuple[str, str], list[dict]] = {}


def rank_results(launcher: str, worker: str, tmp_path_factory, timeout: float = 240, np: int = 2) -> list[dict]:
    """Each rank's JSON results of one job of ``tests/workers/<worker>`` (run once per launcher and
    cached): the worker writes ``<prefix>.rank<r>.json``, ``prefix`` being its first argument."""
    if (launcher, worker) not in _rank_results:
        prefix = tmp_path_factory.mktemp(f"{Path(worker).stem}-{launcher}") / "results"
        proc = run_job(launcher_argv(launcher, np) + [sys.executable, str(WORKERS / worker), str(prefix)],
                       timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-6000:]
        _rank_results[launcher, worker] = [json.loads(Path(f"{prefix}.rank{r}.json").read_text())
                                           for r in range(np)]
    return _rank_results[launcher, worker]


def small_autotune(tmp_path: Path, trial_budget: int, exact: bool = False, workers_per_node: int = 2,
                   runoff: bool = True) -> tuple[list[str], Path, str]:
    """``hybridsync-run --autotune`` from the example config (emulated 2 x 2 at 250 Mbit/s; with
    ``workers_per_node=1``, 2 x 1: half the processes on this machine's two cores) with a small
    budget: 3 trials per round, 400 simulator evaluations (``exact``: no fp16, and so no fp16
    rivals to measure; ``runoff=False``: no runoff job for a lead the confirmation leaves
    unresolved). Returns the command up to the training script, the report directory and the
    trial store's URL."""
    import yaml
    config = yaml.safe_load((REPO / "horovodrun_configs" / "autotune_2x2_250mbit.yaml").read_text())
    config["hybridsync"]["autotune"].update(trial_budget=trial_budget, per_round=3, search_budget=400, exact=exact)
    if not runoff:
        config["hybridsync"]["autotune"]["runoff_passes"] = 0
    config["hybridsync"]["cluster"]["workers_per_node"] = workers_per_node
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    report, store = tmp_path / "report", f"sqlite:///{tmp_path / 'trials.db'}"
    ranks = config["hybridsync"]["cluster"]["nodes"] * workers_per_node
    argv = [str(BIN / "hybridsync-run"), "-np", str(ranks), "--config-file", str(tmp_path / "run.yaml"),
            "--store", store, "--autotune-report", str(report)]
    return argv, report, store


SERVER_LINES = (
    r"\S+ \S+ hybridsync\.ps\.server server\d+ serving \(rank \d+ of \d+\) at tcp://\S+",
    r"\S+ \S+ hybridsync\.ps\.server server\d+: all \d+ workers said goodbye; counters \{.*\}",
)
"""What a parameter server prints in a job that goes well: where it serves, and its byte counters."""
_RANK_PREFIX = re.compile(r"^\[\d+(?:,\d+)?\]<(?:stdout|stderr)>:")


def unexpected_lines(output: str, expected: Sequence[str]) -> list[str]:
    """The non-blank lines of a job's ``output`` that match none of the ``expected`` regular
    expressions (each matched against a whole line, without horovodrun's or mpirun's
    ``[rank]<stdout>:`` prefix)."""
    patterns = [re.compile(pattern) for pattern in expected]
    lines = (_RANK_PREFIX.sub("", line, count=1) for line in output.splitlines())
    return [line for line in lines if line.strip() and not any(p.fullmatch(line) for p in patterns)]


def cluster_tags(leftover_items: list[str]) -> set[str]:
    """The emulated clusters (``hs-<job>``) that ``hybridsync.cluster.netns.leftovers`` items belong
    to: a test compares these, since other clusters on the machine start and end processes meanwhile."""
    return {match.group(0) for item in leftover_items if (match := re.search(r"hs-[0-9a-f]+", item))}


def wait_for(condition: Callable[[], bool], timeout: float, what: str, poll_s: float = 0.05) -> None:
    """Return as soon as ``condition()`` holds; fail the test naming ``what`` if it does not
    within ``timeout`` seconds. For waits on a state of the world, never a fixed sleep."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(poll_s)


@pytest.fixture(params=["horovodrun", "mpirun"])
def launcher(request) -> str:
    return request.param


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a collection in which a test has no tier marker, or more than one, so that
    ``pytest -m unit`` (or ``multiprocess``, ``emulated``) always selects a whole tier."""
    wrong = [f"{item.nodeid}: {tiers or 'none'}" for item in items
             if len(tiers := sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})) != 1]
    if wrong:
        raise pytest.UsageError(f"every test needs exactly one of the markers {', '.join(TIERS)}:\n  "
                                + "\n  ".join(wrong))


def _refuse_process(*args, **kwargs):
    raise AssertionError("a test marked 'unit' started a process: mark it 'multiprocess'")


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Holds the ``unit`` tier to its promise: starting a process there fails the test."""
    if request.node.get_closest_marker("unit") is not None:
        monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse_process)
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve"):
            if hasattr(os, name):
                monkeypatch.setattr(os, name, _refuse_process)
