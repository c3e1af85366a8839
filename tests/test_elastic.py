"""Elastic Horovod (issue 23, item 3): hybridsync's optimizer in jobs that lose or gain workers.

Unit: ``hybridsync.world`` fits a strategy to a world (which routes fall back, and why);
``hybridsync-run`` checks an elastic job's discovery script and says what it will not do.
Multiprocess: real ``horovodrun --min-np/--max-np --host-discovery-script`` jobs of
``examples/elastic_train.py`` on this machine (``localhost`` and ``127.0.0.1`` are two
hosts to Horovod): one grows from 1 to 2 workers when the discovery script's answer
changes, one (under ``hybridsync-run``) loses a worker to SIGKILL, one grows into a world
of 2 nodes x 2 ranks where the hierarchical route runs. Emulated: on two network-namespace
hosts (ssh replaced by the emulated cluster's stand-in), a job grows from 2 x 1 to 2 x 2,
where the hierarchical route runs across the shaped link, then loses host 1 mid-run (both
its workers killed at once) and ends on host 0's two. Each must end with every rank holding
the same model, and that model must be the one a single process computes from the world size
of each committed step (``replay``): the gradients were averaged over exactly the ranks there
were.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from conftest import BIN, IS_ROOT, REPO, WORKERS, launcher_argv, run_job, wait_for
from hybridsync.cluster.spec import ClusterSpec
from hybridsync.router.plan import build_plan
from hybridsync.run import procs
from hybridsync.run.launcher import JobShape, elastic_notes
from hybridsync.strategy import Strategy
from hybridsync.variables import variables_from_model
from hybridsync.world import World, fit_to_world

EXAMPLE = REPO / "examples" / "elastic_train.py"
JOB_TIMEOUT_S = 240.0
GLOO_TIMEOUT = ("--gloo-timeout-seconds", "120")
"""For jobs that grow: after a reset the running workers wait in hvd.init() for a joining one, which
on these shared cores took over Horovod's default 30 s to start (the waiters then abort: README,
"Elastic training"). The same timeout bounds a survivor's wait after a death, so a job that only
loses workers keeps the default; where the emulated job loses a host, that is why it takes ~25 s or
~150 s: rank 0, Horovod's coordinator, may be left waiting on the other survivor for all of it
(docs/guides/elastic.md)."""


def _example():
    spec = importlib.util.spec_from_file_location("elastic_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- unit: fitting a strategy to a world ----------------------------------------------------------

NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]


def _example_strategy() -> Strategy:
    return Strategy.from_dict(_example().STRATEGY)


@pytest.mark.unit
@pytest.mark.parametrize("world", [World(size=2, local_size=2), World(size=4, local_size=1),
                                   World(size=3, local_size=None), World(size=1, local_size=1)],
                         ids=["one-node", "one-rank-per-node", "uneven-nodes", "one-rank"])
def test_hierarchical_falls_back_to_ring_where_it_has_one_level(world):
    fitted, notes = fit_to_world(_example_strategy(), NAMES, world)
    assert fitted.config_for("2.weight").algorithm == "ring"
    assert fitted.config_for("2.weight").partitions == 2  # only the route changes
    assert notes == [f"2.weight: allreduce/hierarchical -> allreduce/ring ({world.hierarchical_problem()})"]
    assert fitted.config_for("2.bias").route == "ps"  # not an elastic job: the servers still fit


@pytest.mark.unit
def test_two_nodes_of_two_keep_the_hierarchical_route():
    strategy = _example_strategy()
    assert fit_to_world(strategy, NAMES, World(size=4, local_size=2)) == (strategy, [])


@pytest.mark.unit
def test_an_elastic_job_sends_ps_variables_by_ring_keeping_partitions_and_groups():
    strategy = Strategy.from_dict({"default": {"route": "ps", "protocol": "asp"}, "variables": {
        "0.weight": {"route": "ps", "partitions": 2, "group": 3, "servers": [1, 0], "compression": "fp16"},
        "0.bias": {"route": "ps", "group": 3, "compression": "fp16"}}})
    fitted, notes = fit_to_world(strategy, NAMES, World(size=4, local_size=2, elastic=True))
    assert fitted.config_for("0.weight").to_dict() == {"route": "allreduce", "algorithm": "ring", "partitions": 2,
                                                       "group": 3, "compression": "fp16"}
    assert fitted.config_for("2.weight").to_dict() == {"route": "allreduce", "algorithm": "ring"}
    assert [note.split(" (")[0] for note in notes] == ["0.weight, 0.bias: ps/bsp -> allreduce/ring",
                                                       "2.weight, 2.bias: ps/asp -> allreduce/ring"]
    model = _example().build_model()
    build_plan(variables_from_model(model), fitted)  # the fitted strategy is valid for the model


@pytest.mark.unit
def test_a_sync_switch_policy_goes_with_the_last_ps_variable():
    strategy = Strategy.from_dict({"default": {"route": "ps"},
                                   "sync": {"policy": "switch", "switch_at": 10, "total_steps": 100}})
    fitted, notes = fit_to_world(strategy, NAMES, World(size=2, local_size=2, elastic=True))
    assert fitted.sync is None and fitted.default.route == "allreduce"
    assert notes[-1] == "sync policy 'switch' dropped: no variable is left on the PS route"
    assert fit_to_world(None, NAMES, World(size=2, local_size=2, elastic=True)) == (None, [])


@pytest.mark.unit
def test_hybridsync_run_refuses_a_discovery_script_horovodrun_could_not_run(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    job = JobShape(num_proc=2, hosts=(), elastic=True, discovery_script=str(script), nics=("lo",), gloo_timeout_s=120)
    with pytest.raises(ValueError, match=f"{script} is not executable \\(chmod \\+x"):
        elastic_notes(job, num_servers=0)
    with pytest.raises(ValueError, match="'absent.sh' is not a file"):
        elastic_notes(JobShape(num_proc=2, hosts=(), elastic=True, discovery_script="absent.sh"), num_servers=0)
    script.chmod(0o755)
    assert elastic_notes(job, num_servers=0) == []
    notes = elastic_notes(JobShape(num_proc=2, hosts=(), elastic=True, discovery_script=f"{script} --arg"),
                          num_servers=1)
    assert [note.split(" ")[:3] for note in notes] == [["an", "elastic", "job"], ["when", "workers", "join,"],
                                                       ["no", "parameter", "servers"]]
    assert len(elastic_notes(JobShape(num_proc=2, max_proc=2, hosts=(), elastic=True, nics=("lo",)), 0)) == 0


# --- multiprocess: real elastic jobs -------------------------------------------------------------

class ExampleOutput:
    """What ``examples/elastic_train.py --out DIR`` writes, read while the job runs and after."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir()

    def events(self) -> list[dict]:
        path = self.out / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def worker_pids(self, host: str | None = None) -> list[int]:
        return [int(p.name.split(".")[-1]) for p in self.out.glob("pid.*")
                if host is None or p.name.startswith(f"pid.{host}.")]

    def results(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.out.glob("result.*.json"))]

    def wait_until(self, condition: Callable[[list[dict]], bool], proc: subprocess.Popen, what: str) -> None:
        """Until ``condition(events)`` holds; fails if the job ends first (it should still be running)."""
        wait_for(lambda: condition(self.events()) or proc.poll() is not None, JOB_TIMEOUT_S / 2, what)
        assert proc.poll() is None, f"the elastic job ended before {what}"

    def wait_for_step(self, step: int, proc: subprocess.Popen) -> None:
        self.wait_until(lambda events: any(e.get("step", 0) >= step for e in events), proc, f"step {step}")


class ElasticJob:
    """``horovodrun`` (or ``launcher``) in elastic mode on this machine, with a discovery script
    that prints ``hosts`` (a file the test rewrites); every process it starts is stopped by pid."""

    def __init__(self, tmp_path: Path, hosts: list[str], *, np: int, max_np: int, steps: int,
                 launcher: tuple[str, ...] = (str(BIN / "horovodrun"),), grows: bool = True) -> None:
        self.output, self.hosts_file = ExampleOutput(tmp_path / "out"), tmp_path / "hosts"
        self.set_hosts(hosts)
        script = tmp_path / "discover.sh"
        script.write_text(f"#!/bin/sh\ncat {self.hosts_file}\n")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        argv = [*launcher, "-np", str(np), "--min-np", "1", "--max-np", str(max_np), *(GLOO_TIMEOUT if grows else ()),
                "--network-interface", "lo", "--host-discovery-script", str(script),
                sys.executable, str(EXAMPLE), "--steps", str(steps), "--pause", "0.1", "--out", str(self.output.out)]
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        self.proc = procs.start(argv, env=env, cwd=str(REPO))
        self.started = time.monotonic()

    def set_hosts(self, hosts: list[str]) -> None:
        self.hosts_file.write_text("".join(f"{h}\n" for h in hosts))

    def finish(self) -> tuple[int, str]:
        """Exit code and output, within what is left of the job's time bound."""
        try:
            output, _ = self.proc.communicate(timeout=max(1.0, JOB_TIMEOUT_S - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"elastic job did not finish within {JOB_TIMEOUT_S} s:\n{self.proc.communicate()[0][-5000:]}")
        return self.proc.returncode, output

    def stop(self) -> None:
        """The launcher and its process group, then every worker (each in a session of its own)."""
        procs.stop(self.proc, grace=3.0)
        for pid in self.output.worker_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _run(tmp_path: Path, hosts: list[str], *, np: int, max_np: int, steps: int,
         change: Callable[[ElasticJob], None], **options) -> tuple[list[dict], str]:
    job = ElasticJob(tmp_path, hosts, np=np, max_np=max_np, steps=steps, **options)
    try:
        change(job)
        code, output = job.finish()
    finally:
        job.stop()
    assert code == 0, output[-6000:]
    return job.output.results(), output


def _assert_one_correct_model(results: list[dict], size: int) -> None:
    """Every rank holds the same parameters, and they are the replayed run's."""
    assert sorted(r["rank"] for r in results) == list(range(size))
    assert all(r["sizes"] == results[0]["sizes"] and r["params"] == results[0]["params"] for r in results)
    expected = _example().replay(results[0]["sizes"])
    for name, p in expected.named_parameters():
        torch.testing.assert_close(torch.tensor(results[0]["params"][name]), p.detach().flatten(),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(360)
def test_grows_from_one_to_two_workers(tmp_path):
    def grow(job: ElasticJob) -> None:
        job.output.wait_for_step(3, job.proc)
        job.set_hosts(["localhost:2"])

    results, output = _run(tmp_path, ["localhost:1"], np=1, max_np=2, steps=100, change=grow)
    _assert_one_correct_model(results, size=2)
    sizes = results[0]["sizes"]
    assert sizes[0] == 1 and sizes[-1] == 2 and sizes == sorted(sizes), sizes
    assert results[0]["routes"] == ["allreduce/ring"]
    for world in ("1 node x 1 rank, elastic", "1 node x 2 ranks, elastic"):
        assert f"the strategy does not fit this world ({world}); falling back: 2.weight: allreduce/hierarchical " \
               f"-> allreduce/ring" in output, output[-6000:]
    assert "2.bias: ps/bsp -> allreduce/ring" in output


@pytest.mark.multiprocess
@pytest.mark.timeout(360)
def test_survives_losing_a_worker(tmp_path):
    def kill_one(job: ElasticJob) -> None:
        job.output.wait_for_step(5, job.proc)
        [victim] = job.output.worker_pids("127.0.0.1")
        os.kill(victim, signal.SIGKILL)

    # Two host names: Horovod blacklists the host of a failed worker, and with one host it would
    # have no host left to go on with. Through hybridsync-run, which starts no server for the PS
    # variable of the strategy it is given (they fall back to ring all-reduce).
    strategy = tmp_path / "strategy.json"
    strategy.write_text(json.dumps(_example().STRATEGY))
    results, output = _run(tmp_path, ["localhost:2", "127.0.0.1:1"], np=3, max_np=3, steps=40, change=kill_one,
                           launcher=(str(BIN / "hybridsync-run"), "--strategy", str(strategy)), grows=False)
    assert "hybridsync-run: no parameter servers are started for an elastic job" in output
    _assert_one_correct_model(results, size=2)
    sizes = results[0]["sizes"]
    assert sizes[0] == 3 and sizes[-1] == 2 and sizes == sorted(sizes, reverse=True), sizes
    assert "3 ranks on nodes of different sizes, elastic" in output and "1 node x 2 ranks, elastic" in output


@pytest.mark.multiprocess
@pytest.mark.timeout(360)
def test_grows_into_a_world_where_the_hierarchical_route_runs(tmp_path):
    def grow(job: ElasticJob) -> None:
        job.output.wait_for_step(3, job.proc)
        job.set_hosts(["localhost:2", "127.0.0.1:2"])

    results, output = _run(tmp_path, ["localhost:2"], np=2, max_np=4, steps=100, change=grow)
    _assert_one_correct_model(results, size=4)
    assert results[0]["sizes"][0] == 2 and results[0]["sizes"][-1] == 4
    assert results[0]["routes"] == ["allreduce/hierarchical", "allreduce/ring"]  # rebuilt for 2 nodes x 2
    assert "(2 nodes x 2 ranks, elastic); falling back: 2.bias: ps/bsp -> allreduce/ring" in output


# --- emulated: two hosts behind a shaped link -----------------------------------------------------



@pytest.mark.emulated
@pytest.mark.skipif(not IS_ROOT, reason="network namespaces and tc need root and iproute2")
@pytest.mark.timeout(600)
def test_on_the_emulated_cluster_grows_into_two_nodes_of_two_then_loses_a_host(tmp_path):
    from hybridsync.cluster.netns import EmulatedCluster, leftovers
    from hybridsync.run.emulated import launch_horovodrun_elastic

    hosts, script, log = tmp_path / "hosts", tmp_path / "discover.sh", tmp_path / "job.log"
    output = ExampleOutput(tmp_path / "out")
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    with EmulatedCluster(ClusterSpec(nodes=2, workers_per_node=2, inter_node_bandwidth="1gbit")) as cluster, \
            open(log, "w") as stream:
        ip0, ip1 = cluster.ips
        hosts.write_text(f"{ip0}:1\n{ip1}:1\n")  # not host 0 alone: see launch_horovodrun_elastic
        command = [sys.executable, str(EXAMPLE), "--steps", "100", "--pause", "0.1", "--out", str(output.out)]
        job = launch_horovodrun_elastic(cluster, command, discovery_script=str(script), num_proc=2, max_proc=4,
                                        horovodrun_args=GLOO_TIMEOUT, env={"PYTHONPATH": str(REPO)},
                                        stdout=stream, stderr=subprocess.STDOUT)
        [horovodrun] = job.processes
        output.wait_for_step(3, horovodrun)
        hosts.write_text(f"{ip0}:2\n{ip1}:2\n")
        output.wait_until(lambda events: any(e.get("size") == 4 for e in events), horovodrun,
                          "a step on 2 nodes x 2 ranks")
        for pid in output.worker_pids(ip1):  # the host is lost: every worker on it dies at once
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        codes = job.wait(timeout=JOB_TIMEOUT_S)
    assert leftovers(cluster.prefix) == []
    text = log.read_text()
    assert codes == [0], text[-6000:]
    results = output.results()
    _assert_one_correct_model(results, size=2)
    sizes = results[0]["sizes"]
    assert sizes[0] == 2 and 4 in sizes and sizes[-1] == 2, sizes
    for world in ("2 nodes x 1 rank", "1 node x 2 ranks"):
        assert f"({world}, elastic); falling back: 2.weight: allreduce/hierarchical -> allreduce/ring" in text
    assert "(2 nodes x 2 ranks, elastic); falling back: 2.bias: ps/bsp -> allreduce/ring" in text


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_an_elastic_plan_names_its_messages_apart_from_names_in_flight():
    """A message of a plan abandoned mid-step may still be in Horovod's queue under its name: the next
    plan's message of that name failed with Horovod's "same name as another tensor that is currently
    being processed" (seen once in CI: a surviving rank's first step after the emulated cluster lost a
    host). In an elastic job each router names its messages ``opt<N>.<name>``; this step goes through."""
    proc = run_job(launcher_argv("horovodrun") + [sys.executable, str(WORKERS / "elastic_names.py")], timeout=150)
    assert proc.returncode == 0, proc.stdout[-4000:]
    results = [json.loads(line.split("ok ", 1)[1]) for line in proc.stdout.splitlines() if "ok {" in line]
    assert sorted(r["rank"] for r in results) == [0, 1], proc.stdout[-4000:]
    assert results[0]["params"] == results[1]["params"]  # one averaged gradient on both ranks
