"""The autotune loop's pieces: settings, report, run config, launcher flags, `hybridsync search`
with the simulator alone, and autotuned strategies run by plain MPI jobs."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import BIN, IS_ROOT, REPO, launcher_argv, run_job
from hybridsync.autotune.loop import AutotuneResult, AutotuneSettings, TrialOutcome
from hybridsync.autotune.report import markdown, to_dict, write_report
from hybridsync.autotune.result import RESOLVED_P
from hybridsync.cli import main
from hybridsync.cluster.netns import NETEM_MISSING, leftovers, netem_available
from hybridsync.cluster.spec import ClusterSpec
from hybridsync.run.config import load_run_config
from hybridsync.run.launcher import split_argv
from hybridsync.strategy import Strategy

DESCRIPTIONS = REPO / "data" / "descriptions"
CLUSTER = ClusterSpec(nodes=2, workers_per_node=2, inter_node_bandwidth="250mbit", servers_per_node=1)
TINY = str(REPO / "tests" / "workers" / "tiny_train.py")


def a_result(levers: frozenset[str] = frozenset({"fp16"})) -> AutotuneResult:
    trials = [TrialOutcome(round=0, kind="baseline:allreduce", fingerprint="a", predicted_s=0.20, measured_s=0.21,
                           job="j0", normalized_s=0.22),
              TrialOutcome(round=0, kind="search:r0", fingerprint="b", predicted_s=0.15, measured_s=0.18, job="j0",
                           normalized_s=0.19),
              TrialOutcome(round=1, kind="search:r1", fingerprint="c", predicted_s=0.14, measured_s=None,
                           reason="refused", job="j1"),
              TrialOutcome(round=1, kind="search:r1", fingerprint="d", predicted_s=0.13, measured_s=0.16, job="j1",
                           normalized_s=0.15)]
    winner = Strategy.from_dict({"version": 1, "default": {"route": "allreduce", "compression": "fp16"}})
    return AutotuneResult(model="m", cluster=CLUSTER, winner_kind="search:top1", winner=winner, winner_levers=levers,
                          trials=trials,
                          confirmed_s={"search:top1": 0.15, "baseline:allreduce": 0.20,
                                       "baseline:horovod-hierarchical-fp16": 0.17, "horovod": 0.24},
                          trial_s={"search:top1": 0.15, "baseline:allreduce": 0.22,
                                   "baseline:horovod-hierarchical-fp16": 0.18, "horovod": 0.25},
                          not_runnable={"horovod-fp16": "not runnable: sparse"},
                          job_levels={"j0": {"level": 1.1, "drift_per_min": 0.01, "trials": 2},
                                      "j1": {"level": 0.9, "drift_per_min": 0.0, "trials": 2}},
                          seconds={"search": 1.0, "trials": 10.0, "refit": 0.5, "confirm": 5.0, "total": 17.0})


@pytest.mark.unit
def test_settings_reject_empty_budgets():
    with pytest.raises(ValueError, match="trial_budget"):
        AutotuneSettings(trial_budget=0)
    with pytest.raises(ValueError, match="confirm_top"):
        AutotuneSettings(confirm_top=0)


@pytest.mark.unit
def test_the_best_rival_is_the_best_fair_one():
    fp16 = a_result()
    assert fp16.best_rival == ("baseline:horovod-hierarchical-fp16", 0.17)  # the winner uses fp16: so may its rivals
    assert fp16.speedup == pytest.approx(0.17 / 0.15)
    exact = a_result(levers=frozenset())
    assert exact.best_rival == ("baseline:allreduce", 0.20)  # an fp16 twin is no fair rival of an exact winner
    assert exact.speedup_over("horovod") == pytest.approx(1.6)
    assert fp16.kendall_tau == pytest.approx(1.0)
    assert fp16.best_so_far() == [0.22, 0.19, 0.19, 0.15]  # by the job-normalized times


@pytest.mark.unit
def test_the_runner_up_rival_is_the_best_fair_rival_unless_a_rival_won():
    fp16 = a_result()
    assert fp16.runner_up_rival == fp16.best_rival == ("baseline:horovod-hierarchical-fp16", 0.17)
    rival_won = dataclasses.replace(fp16, winner_kind="baseline:horovod-hierarchical-fp16")
    assert rival_won.best_rival == ("baseline:horovod-hierarchical-fp16", 0.17)  # the winner itself
    assert rival_won.runner_up_rival == ("baseline:allreduce", 0.20)  # the next fair one, not the search's 0.15
    exact = dataclasses.replace(a_result(levers=frozenset()), winner_kind="baseline:allreduce")
    assert exact.runner_up_rival == ("horovod", 0.24)  # the fp16 twin is still no fair rival
    alone = dataclasses.replace(exact, confirmed_s={"baseline:allreduce": 0.2, "search:top1": 0.3})
    assert alone.runner_up_rival is None


@pytest.mark.unit
def test_the_resolved_tau_counts_only_pairs_the_confirmation_repeats_separate():
    # Four repeats each: top1 and the fp16 twin overlap (inside the noise); horovod lies above everyone,
    # allreduce above top1 and the twin. The trials order top1/twin the wrong way, which the plain tau
    # counts and the resolved tau does not; allreduce vs horovod is ordered the wrong way and counts.
    result = dataclasses.replace(
        a_result(),
        confirmed_repeats_s={"search:top1": [0.150, 0.160, 0.145, 0.155], "baseline:horovod-hierarchical-fp16":
                             [0.152, 0.158, 0.149, 0.151], "baseline:allreduce": [0.200, 0.205, 0.198, 0.202],
                             "horovod": [0.240, 0.250, 0.235, 0.245]},
        trial_s={"search:top1": 0.19, "baseline:horovod-hierarchical-fp16": 0.18, "baseline:allreduce": 0.26,
                 "horovod": 0.25})
    assert sorted(result.resolved_pairs()) == sorted([
        ("search:top1", "baseline:allreduce"), ("search:top1", "horovod"),
        ("baseline:horovod-hierarchical-fp16", "baseline:allreduce"), ("baseline:horovod-hierarchical-fp16", "horovod"),
        ("baseline:allreduce", "horovod")])
    assert result.resolved_tau == pytest.approx((4 - 1) / 5)
    assert result.kendall_tau == pytest.approx((4 - 2) / 6)
    too_few = dataclasses.replace(result, confirmed_repeats_s={k: v[:2] for k, v in result.confirmed_repeats_s.items()})
    assert too_few.resolved_pairs() == [] and too_few.resolved_tau is None  # two repeats cannot resolve anything


@pytest.mark.unit
def test_a_search_strategy_wins_only_on_a_lead_the_confirmation_resolves(tmp_path):
    from hybridsync.autotune.loop import Autotuner
    from hybridsync.description import load_description
    from hybridsync.trials.candidates import Candidate
    from hybridsync.trials.store import TrialStore
    description = load_description(DESCRIPTIONS / "ncf.json")
    tuner = Autotuner(description=description, cluster=CLUSTER, store=TrialStore(str(tmp_path / "t.db")),
                      runner_for=lambda *_: None, settings=AutotuneSettings(), progress=False)
    fp16 = Strategy.from_dict({"version": 1, "default": {"route": "allreduce", "compression": "fp16"}})
    lineup = [Candidate(kind="search:top1", strategy=fp16), Candidate(kind="horovod", strategy=None),
              Candidate(kind="baseline:allreduce", strategy=Strategy.from_dict({"version": 1})),
              Candidate(kind="baseline:allreduce-fp16", strategy=fp16)]
    def medians(repeats):
        return {kind: float(np.median(times)) for kind, times in repeats.items()}
    apart = {"search:top1": [0.150, 0.152, 0.149, 0.151], "baseline:allreduce-fp16": [0.160, 0.161, 0.159, 0.162],
             "baseline:allreduce": [0.180, 0.182, 0.179, 0.181], "horovod": [0.2] * 4}
    confirmed = medians(apart)
    winner, lead = tuner._winner(lineup, confirmed, apart)
    assert (winner.kind, lead) == ("search:top1", None)  # every repeat faster than the best fair rival's
    overlapping = {**apart, "search:top1": [0.150, 0.163, 0.149, 0.158]}
    winner, lead = tuner._winner(lineup, medians(overlapping), overlapping)
    assert winner.kind == "baseline:allreduce-fp16", "a lead inside the job's noise goes to the rival"
    assert lead["kind"] == "search:top1" and lead["over"] == "baseline:allreduce-fp16" and lead["p"] >= 0.05
    exact = Candidate(kind="search:top1", strategy=Strategy.from_dict({"version": 1, "default": {"route": "ps"}}))
    near = {**apart, "search:top1": [0.165, 0.181, 0.168, 0.183],
            "baseline:allreduce-fp16": [0.174, 0.176, 0.175, 0.177]}
    winner, lead = tuner._winner([exact, *lineup[1:]], medians(near), near)
    assert winner.kind == "baseline:allreduce", "an fp16 twin is no fair rival of an exact strategy"
    assert lead["over"] == "baseline:allreduce"
    rival_won = {**confirmed, "baseline:allreduce": 0.13}
    assert tuner._winner(lineup, rival_won, apart) == (lineup[2], None)
    result = dataclasses.replace(a_result(), winner_kind="baseline:horovod-hierarchical-fp16",
                                 unresolved_lead={"kind": "search:top1", "step_s": 0.15, "p": 0.34,
                                                  "over": "baseline:horovod-hierarchical-fp16"})
    assert "search:top1 measured 150.0 ms, faster than baseline:horovod-hierarchical-fp16 but within the " \
           "confirmation job's noise (p = 0.34): not taken" in result.verdict()
    assert "Not taken: search:top1" in markdown(to_dict(result))


@pytest.mark.unit
def test_report_files_say_what_won_over_which_rival_and_how_well_trials_ranked(tmp_path):
    paths = write_report(a_result(), tmp_path / "report")
    assert [p.name for p in paths] == ["report.json", "report.md", "report.png"]
    doc = json.loads(paths[0].read_text())
    assert doc["speedup_over_best_rival"] == pytest.approx(0.17 / 0.15)
    assert doc["best_rival"]["kind"] == "baseline:horovod-hierarchical-fp16" and doc["winner"]["levers"] == ["fp16"]
    assert doc["kendall_tau"] == {"tau": pytest.approx(1.0), "strategies": 4, "target": 0.8, "resolved_tau": None,
                                  "resolved_pairs": 0}  # no repeats recorded: nothing resolved
    assert Strategy.from_dict(doc["winner"]["strategy"]).default.compression == "fp16"
    assert paths[2].stat().st_size > 10_000
    text = markdown(to_dict(a_result()))
    assert "**1.13x**" in text and "| 3 | 1 | j1 | search:r1 | 140.0 | failed | - |" in text
    assert "Kendall tau **1.00** over 4 strategies" in text and "horovod-fp16: not runnable" in text
    assert "Next fair rival" not in text and doc["runner_up_rival"] == doc["best_rival"]


@pytest.mark.unit
def test_a_report_whose_rival_won_names_the_next_fair_rival():
    """A hand-made rival that wins is its own best fair rival (1.00x); the report also names the next
    one, or it would say nothing about what the winner beat (seen: 3 x 1 nodes at 50 Mbit/s, where
    Horovod's hierarchical baseline with fp16 won)."""
    rival_won = dataclasses.replace(a_result(), winner_kind="baseline:horovod-hierarchical-fp16")
    doc = to_dict(rival_won)
    assert doc["runner_up_rival"] == {"kind": "baseline:allreduce", "step_s": 0.20}
    assert ("Next fair rival: baseline:allreduce, 200.0 ms: the winner is **1.18x** as fast."
            in markdown(doc))
    assert rival_won.verdict().startswith("winner baseline:horovod-hierarchical-fp16, 170.0 ms per step (a rival: "
                                          "nothing measured beat it); next fair rival baseline:allreduce 200.0 ms: "
                                          "1.18x ("), rival_won.verdict()
    assert a_result().verdict().startswith("winner search:top1, 150.0 ms per step; best fair rival "
                                           "baseline:horovod-hierarchical-fp16 170.0 ms: 1.13x ("), a_result().verdict()


@pytest.mark.unit
def test_the_autotune_example_config_is_complete():
    config = load_run_config(REPO / "horovodrun_configs" / "autotune_2x2_250mbit.yaml")
    assert config.autotune["enabled"] and config.autotune["trial_budget"] == 50
    assert config.cluster.num_workers == 4 and config.cluster.num_servers == 2


@pytest.mark.unit
@pytest.mark.parametrize("section, message", [
    ("autotune: 5", "must be a mapping"),
    ("autotune:\n    trial_budgt: 3", "unknown key\\(s\\) in 'hybridsync.autotune': trial_budgt"),
    ("autotune:\n    trial_budget: many", "trial_budget must be int"),
    ("autotune:\n    per_round: 0", "per_round must be >= 1"),
    ("autotune:\n    runoff_passes: -1", "runoff_passes must be >= 0"),
    ("autotune:\n    time_limit_s: soon", "time_limit_s must be float"),
    ("autotune:\n    time_limit_s: .nan", "time_limit_s must be a finite number"),
])
def test_bad_autotune_sections_are_named(tmp_path, section, message):
    path = tmp_path / "run.yaml"
    path.write_text(f"hybridsync:\n  {section}\n")
    with pytest.raises(ValueError, match=message):
        load_run_config(path)


@pytest.mark.unit
def test_the_runoff_settings_come_from_the_run_config(tmp_path):
    from hybridsync.autotune.launch import _plan
    from hybridsync.run.launcher import LaunchOptions
    cluster = "    cluster: {nodes: 2, workers_per_node: 2, inter_node_bandwidth: 250mbit}\n"
    for entries, passes, limit in [("", 8, 600.0), ("      runoff_passes: 0\n      time_limit_s: 900\n", 0, 900),
                                   ("      time_limit_s: null\n", 8, None)]:
        path = tmp_path / "run.yaml"
        path.write_text("hybridsync:\n" + cluster + "    autotune:\n      seed: 1\n" + entries)
        plan = _plan(LaunchOptions(autotune=True), ["-np", "4", "--config-file", str(path), "python", "train.py"])
        assert (plan.settings.runoff_passes, plan.settings.time_limit_s) == (passes, limit)


@pytest.mark.unit
@pytest.mark.parametrize("hosts, message, target_message", [
    ("a:3,b:1", "places 4 ranks, 3 on a, 1 on b", None),  # unequal nodes: no hierarchical all-reduce
    ("a:4,b:4", "starts a rank on each of the 8 slots", "places 8 ranks, 4 on a, 4 on b"),  # Gloo ignores -np
    ("a:2,b:2", None, None),
    ("a:1,b:1", "cannot place the cluster spec's 4 workers", None),
])
def test_autotune_on_hosts_refuses_hosts_placed_unlike_the_spec(tmp_path, hosts, message, target_message):
    """The search prices the spec's shape (2 x 2 here): hosts that horovodrun fills otherwise are
    refused before anything starts, by ``hybridsync-run --autotune`` and by every trial target."""
    from hybridsync.autotune.launch import _plan
    from hybridsync.run.launcher import LaunchOptions
    from hybridsync.trials.jobs import HostsTarget
    path = tmp_path / "run.yaml"
    path.write_text("hybridsync:\n  cluster: {nodes: 2, workers_per_node: 2, inter_node_bandwidth: 250mbit}\n")
    argv = ["-np", "4", "-H", hosts, "--gloo", "--config-file", str(path), "python", "train.py"]
    if message is None:
        assert _plan(LaunchOptions(autotune=True), argv).hosts == hosts
        HostsTarget(CLUSTER, hosts=hosts)
        return
    with pytest.raises(ValueError, match=re.escape(message)):
        _plan(LaunchOptions(autotune=True), argv)
    (tmp_path / "hostfile").write_text(hosts.replace(",", "\n").replace(":", " slots="))
    with pytest.raises(ValueError, match=re.escape(target_message or message)):
        HostsTarget(CLUSTER, hostfile=str(tmp_path / "hostfile"))


@pytest.mark.unit
def test_launcher_reads_the_autotune_flags_anywhere_before_the_command():
    options, rest = split_argv(["-np", "4", "--autotune", "--trial-budget", "20", "--cluster=c.yaml",
                                "--store", "sqlite:///t.db", "python", "train.py", "--autotune"])
    assert options.autotune and options.trial_budget == 20 and options.cluster.endswith("c.yaml")
    assert options.store == "sqlite:///t.db"
    assert rest == ["-np", "4", "python", "train.py", "--autotune"]
    with pytest.raises(ValueError, match="--trial-budget must be >= 1"):
        split_argv(["--trial-budget", "0", "python", "train.py"])


@pytest.mark.unit
def test_search_with_the_simulator_alone_beats_the_baselines_it_predicts(tmp_path, capsys):
    spec = tmp_path / "cluster.yaml"
    spec.write_text("nodes: 2\nworkers_per_node: 2\ninter_node_bandwidth: 250mbit\nservers_per_node: 1\n")
    out = tmp_path / "strategies" / "s.json"  # a folder not made yet: made, as the report's is
    assert main(["search", "--model", str(DESCRIPTIONS / "vgg.json"), "--cluster", str(spec), "-o", str(out),
                 "--search-budget", "600", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    speedup = float(printed.rpartition("(")[2].partition("x)")[0])
    assert speedup >= 1.0, printed  # seeded with every baseline: never predicted slower than the best
    from hybridsync.description import load_description
    Strategy.load(out).validate_for(load_description(DESCRIPTIONS / "vgg.json").variables)


@pytest.mark.unit
@pytest.mark.parametrize("model, cluster, extra, message", [
    ("no_such_model", "two", [], "neither a file nor a zoo model"),
    ("plain", "two", [], "has no compute timing"),
    ("vgg", "one", [], "needs at least 2"),
    ("vgg", "two", ["-H", "a:2"], "give --trials N as well"),
])
def test_search_gives_clear_errors(tmp_path, capsys, model, cluster, extra, message):
    (tmp_path / "plain.json").write_text('{"variables": [{"name": "w", "shape": [4, 4]}]}')
    (tmp_path / "one.yaml").write_text("nodes: 1\nworkers_per_node: 1\ninter_node_bandwidth: 1gbit\n")
    (tmp_path / "two.yaml").write_text("nodes: 2\nworkers_per_node: 1\ninter_node_bandwidth: 1gbit\n")
    models = {"plain": str(tmp_path / "plain.json"), "vgg": str(DESCRIPTIONS / "vgg.json")}
    argv = ["search", "--model", models.get(model, model), "--cluster", str(tmp_path / f"{cluster}.yaml"),
            "-o", str(tmp_path / "s.json"), "--search-budget", "50", *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.unit
def test_an_empty_store_is_a_clear_error_for_fitting(tmp_path):
    from hybridsync.model.simulator import Simulator, load_samples
    from hybridsync.trials.store import TrialStore
    with TrialStore(tmp_path / "t.db") as store:
        assert load_samples(store) == []
        with pytest.raises(ValueError, match="no samples \\(is the trial store empty"):
            Simulator().fit(load_samples(store))


def autotuned_strategy(tmp_path, servers: int) -> str:
    """A profiled tiny model and a strategy the search picks for one host with 2 ranks."""
    desc, spec, out = tmp_path / "tiny.json", tmp_path / "cluster.yaml", tmp_path / "s.json"
    proc = run_job([str(BIN / "hybridsync"), "profile", "-o", str(desc), "--", sys.executable, TINY,
                    "--steps", "30"], timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    spec.write_text(f"nodes: 1\nworkers_per_node: 2\ninter_node_bandwidth: 1gbit\nservers_per_node: {servers}\n")
    proc = run_job([str(BIN / "hybridsync"), "search", "--model", str(desc), "--cluster", str(spec), "-o", str(out),
                    "--search-budget", "400"], timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return str(out)


def final_loss(output: str) -> float:
    """Rank 0's last reported loss (under mpirun another rank's line may follow it without a newline)."""
    return float(re.findall(r"final loss (\d+\.\d+)", output)[-1])


@pytest.mark.multiprocess
def test_plain_mpirun_trains_with_an_autotuned_strategy(tmp_path):
    strategy = autotuned_strategy(tmp_path, servers=0)
    proc = run_job(launcher_argv("mpirun") + ["-x", f"HYBRIDSYNC_STRATEGY={strategy}", sys.executable, TINY,
                                              "--steps", "60"], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert final_loss(proc.stdout) < 0.5


@pytest.mark.multiprocess
def test_hybridsync_run_mpi_trains_with_an_autotuned_strategy(tmp_path):
    strategy = autotuned_strategy(tmp_path, servers=1)
    proc = run_job([str(BIN / "hybridsync-run"), "--mpi", "-np", "2", "-H", "localhost:2", "--strategy", strategy,
                    sys.executable, TINY, "--steps", "60"], timeout=180, env={"OMPI_ALLOW_RUN_AS_ROOT": "1",
                                                                             "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert final_loss(proc.stdout) < 0.5


@pytest.mark.unit
def test_a_round_picks_strategies_that_differ_in_more_than_one_variable():
    from hybridsync.autotune.loop import diverse
    names = ["a", "b", "c"]

    def strategy(**routes) -> Strategy:
        return Strategy.from_dict({"version": 1, "variables": {n: {"route": routes.get(n, "allreduce")} for n in names}})
    ranked = [(1.0, strategy()), (1.1, strategy(a="ps")), (1.2, strategy(a="ps", b="ps")), (1.3, strategy(c="ps"))]
    sizes = dict.fromkeys(names, 4000)
    picks = diverse(ranked, 2, sizes)
    assert [cost for cost, _ in picks] == [1.0, 1.2]  # 1.1 differs from the best in one variable only
    assert [cost for cost, _ in diverse(ranked, 4, sizes)] == [1.0, 1.1, 1.2, 1.3]  # topped up in rank order
    read = []

    def lazily():
        for item in ranked:
            read.append(item[0])
            yield item
    assert [cost for cost, _ in diverse(lazily(), 2, sizes)] == [1.0, 1.2] and read == [1.0, 1.1, 1.2]  # no further
    assert diverse(iter(ranked), 0, sizes) == []


@pytest.mark.unit
def test_a_round_picks_strategies_that_differ_in_more_than_a_few_small_variables():
    """Picks that differ only in small variables (biases: which server, which group) are one strategy
    to the simulator and to the network; they count as the same, also against strategies measured
    in earlier rounds, unless nothing else is left."""
    from hybridsync.autotune.loop import diverse
    sizes = {"weight": 4_000_000, "other.weight": 1_000_000, "bias": 4000, "other.bias": 4000}

    def strategy(**routes) -> Strategy:
        return Strategy.from_dict({"version": 1, "variables": {n: {"route": routes.get(n.replace(".", "_"), "allreduce")}
                                                               for n in sizes}})
    best, biases = strategy(), strategy(bias="ps", other_bias="ps")
    weights = strategy(weight="ps", bias="ps")
    ranked = [(1.0, best), (1.01, biases), (1.2, weights)]
    assert [s for _, s in diverse(ranked, 2, sizes)] == [best, weights]  # the biases alone: the same strategy
    assert [s for _, s in diverse(ranked[1:], 1, sizes, measured=[best])] == [weights]  # measured before
    assert [s for _, s in diverse(ranked, 3, sizes)] == [best, biases, weights]  # topped up in rank order


@pytest.mark.unit
def test_exact_search_keeps_plain_horovod_numerics(tmp_path):
    from hybridsync.autotune.loop import propose
    from hybridsync.description import load_description
    from hybridsync.model.simulator import shipped_simulator
    description = load_description(DESCRIPTIONS / "bert.json")
    picks = propose(shipped_simulator(), description, CLUSTER, seeds=[], exclude=set(), count=20, budget=600,
                    rng=np.random.default_rng(0), progress=False, exact=True)
    configs = [s.config_for(name) for _, s in picks for name in description.variables]
    assert len(picks) == 20
    assert all(c.compression is None and (c.route != "ps" or c.protocol == "bsp") for c in configs)


@pytest.mark.multiprocess
def test_autotune_on_hosts_from_the_config_alone(tmp_path):
    """`hybridsync-run -H ... --config-file run.yaml`: the config's autotune: section turns it on; trials
    and the final job go through hybridsync-run on those hosts (here: this one, two ranks, one server).
    In exact mode: no fp16 anywhere, and the rivals are the baselines without their fp16 twins."""
    (tmp_path / "run.yaml").write_text(
        "hybridsync:\n  cluster: {nodes: 1, workers_per_node: 2, inter_node_bandwidth: 1gbit, servers_per_node: 1}\n"
        "  autotune: {trial_budget: 8, per_round: 3, search_budget: 300, exact: true}\n")
    report = tmp_path / "report"
    # 500 steps per run: each trial job and the confirmation end in one run of the script
    proc = run_job([str(BIN / "hybridsync-run"), "-np", "2", "-H", "localhost:2", "--gloo", "--config-file",
                    str(tmp_path / "run.yaml"), "--store", f"sqlite:///{tmp_path / 't.db'}", "--autotune-report",
                    str(report), sys.executable, TINY, "--steps", "500"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:]
    doc = json.loads((report / "report.json").read_text())
    assert len({t["fingerprint"] for t in doc["trials"]}) == 8
    assert doc["winner"]["kind"] in doc["confirmed_s"] and doc["exact"] and doc["winner"]["levers"] == []
    assert not any(kind.endswith("-fp16") for kind in doc["confirmed_s"]), "exact: no fp16 twin among the rivals"
    assert doc["best_rival"]["kind"].startswith("baseline:")
    assert final_loss(proc.stdout) < 0.5


@pytest.mark.unit
def test_rechecks_are_the_best_search_strategies_measured_once_less_the_controls(tmp_path):
    from hybridsync.autotune.loop import Autotuner
    from hybridsync.description import description_id, load_description
    from hybridsync.trials.store import TrialStore
    description = load_description(DESCRIPTIONS / "ncf.json")
    store = TrialStore(str(tmp_path / "trials.db"))
    store.add_description(description_id(description), description.name, description.to_dict())
    tuner = Autotuner(description=description, cluster=CLUSTER, store=store, runner_for=lambda *_: None,
                      settings=AutotuneSettings(recheck=2), progress=False)
    rival = next(c for c in tuner.references if c.strategy is not None)
    searched = [dataclasses.replace(c, kind="search:r0") for c in tuner.seeds[:5]]
    assert len(searched) == 5

    def add(candidate, seconds: float, job: str, minute: int) -> None:
        _store_trial(store, tuner, candidate, uid=f"{job}-{minute}", step_s=seconds, job=job, at_s=60 * minute)
    add(rival.as_control(), 0.30, "j0", 0)
    for minute, (candidate, seconds) in enumerate(zip(searched, [0.20, 0.21, 0.22, 0.23, 0.24]), start=1):
        add(candidate, seconds, "j0", minute)
    add(rival.as_control(), 0.30, "j0", 9)
    add(searched[1].as_control(), 0.21, "j1", 10)  # rechecked once already in another job
    add(rival.as_control(), 0.30, "j1", 11)
    tuner._refit()
    picked = tuner._rechecks([rival, searched[0]])  # the incumbent is a control: measured in every pass anyway
    assert [c.fingerprint for c in picked] == [searched[2].fingerprint, searched[3].fingerprint]
    assert all(c.kind == "search:r0" and c.strategy is not None for c in picked)
    once = next(c for c in tuner.references if c.strategy is not None and c.fingerprint != rival.fingerprint)
    add(once, 0.26, "j1", 12)
    tuner._refit()
    last = tuner._last_rechecks([rival, searched[0]])
    assert once.fingerprint in {c.fingerprint for c in last}, "a rival measured once is rechecked before the confirmation"
    assert rival.fingerprint not in {c.fingerprint for c in last} and len(last) == len({c.fingerprint for c in last})
    assert Autotuner(description=description, cluster=CLUSTER, store=store, runner_for=lambda *_: None,
                     settings=AutotuneSettings(recheck=0), progress=False)._rechecks([]) == []
    with pytest.raises(ValueError, match="recheck"):
        AutotuneSettings(recheck=-1)



def _store_trial(store, tuner, candidate, *, uid: str, step_s: float, job: str, at_s: float):
    """Stores (and returns) a successful trial of ``candidate`` for ``tuner``'s model and ``CLUSTER``:
    three steps of ``step_s``, started and finished ``at_s`` seconds into 2026."""
    import datetime
    from hybridsync.description import description_id
    from hybridsync.trials.store import TrialRecord
    at = (datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc) + datetime.timedelta(seconds=at_s)).isoformat()
    record = TrialRecord(
        uid=uid, model=tuner.model, description_id=description_id(tuner.description), cluster=CLUSTER.to_dict(),
        kind=candidate.kind, strategy=None if candidate.strategy is None else candidate.strategy.to_dict(),
        fingerprint=candidate.fingerprint, status="ok", reason=None, warmup_steps=0, step_times=[step_s] * 3,
        versions={}, started=at, finished=at, host="h", job=job)
    store.add(record)
    return record


class _DriftingJob:
    """Stands in for the trial runner of one runoff job (unit test): stores each scheduled trial with
    step times ``times[kind][pass]``, as a job on shared cores whose level drifts from pass to pass would."""

    def __init__(self, store, tuner, times: dict[str, list[float]]) -> None:
        self.store, self.tuner, self.times = store, tuner, times

    def run(self, schedule, on_trial=lambda record: None) -> None:
        for index, candidate in enumerate(schedule):
            on_trial(_store_trial(self.store, self.tuner, candidate, uid=f"t{index}",
                                  step_s=self.times[candidate.kind][index // 2], job="runoff", at_s=index))


class _ClockedJobs:
    """Stands in for the trial runner of every job (unit test): stores each scheduled trial (controls as
    ``blocked_schedule`` places them) with a step time fixed per strategy, and moves ``clock`` on by
    ``per_trial_s`` a trial, as trial jobs on a slow machine would."""

    def __init__(self, store, tuner, clock: list[float], per_trial_s: float) -> None:
        self.store, self.tuner, self.clock, self.per_trial_s = store, tuner, clock, per_trial_s

    def run(self, candidates, on_trial=lambda record: None, *, controls=(), block_size=5, rechecks=()):
        import zlib
        from hybridsync.trials.runner import RunSummary, blocked_schedule
        from hybridsync.trials.store import is_control
        job = f"j{self.clock[0]:.0f}"
        schedule = blocked_schedule(list(candidates), list(controls), block_size, list(rechecks))
        for index, candidate in enumerate(schedule):
            self.clock[0] += self.per_trial_s
            record = _store_trial(self.store, self.tuner, candidate, uid=f"{job}-{index}", job=job, at_s=self.clock[0],
                                  step_s=0.1 + zlib.crc32(candidate.fingerprint.encode()) % 997 / 1e4)
            if not is_control(candidate.kind):
                on_trial(record)
        controls_run = sum(is_control(c.kind) for c in schedule)
        return RunSummary(measured=len(schedule) - controls_run, failed=0, skipped=0, jobs=1,
                          seconds=len(schedule) * self.per_trial_s, controls=controls_run)


@pytest.mark.unit
def test_the_time_limit_stops_the_rounds_short_of_the_budget_so_that_the_autotune_fits_it(tmp_path, monkeypatch):
    import types
    from hybridsync.autotune import loop
    from hybridsync.description import load_description
    from hybridsync.trials.store import TrialStore
    description = load_description(DESCRIPTIONS / "ncf.json")
    clock = [0.0]
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))

    def autotune(limit: float | None, name: str):
        clock[0] = 0.0
        settings = AutotuneSettings(trial_budget=50, per_round=10, search_budget=300, calibrate=False,
                                    time_limit_s=limit)
        tuner = loop.Autotuner(description=description, cluster=CLUSTER, store=TrialStore(str(tmp_path / name)),
                               runner_for=lambda protocol, store: _ClockedJobs(store, tuner, clock, per_trial_s=5.0),
                               settings=settings, progress=False)
        return tuner.run(), len(tuner._measured())

    unlimited, measured = autotune(None, "unlimited.db")
    assert unlimited.rounds_cut is None and measured == 50
    assert unlimited.seconds["total"] > 600, "at 5 s a trial the whole budget takes longer than 10 minutes"
    limited, measured = autotune(600.0, "limited.db")
    assert limited.rounds_cut is not None and limited.rounds_cut["measured"] == measured < 50
    assert limited.rounds_cut["budget"] == 50 and "would pass the 600 s limit" in limited.rounds_cut["why"]
    assert limited.seconds["total"] <= 600, "the rounds left room for the recheck job and the confirmation"
    assert "Time limit: the rounds stopped at" in markdown(to_dict(limited))


@pytest.mark.unit
def test_progress_counts_new_strategies_against_the_budget_and_names_the_phase():
    import io
    import types
    from hybridsync.autotune.progress import AutotuneProgress
    ok, failed = types.SimpleNamespace(status="ok"), types.SimpleNamespace(status="failed")
    stream = io.StringIO()
    with AutotuneProgress(30, stream=stream, bar=True) as progress:
        progress.phase("round 1", expected=3)
        progress.trial(ok)
        progress.trial(failed)
        assert progress.bar.n == 2 and "round 1 2/3 trials, 1 failed" in stream.getvalue()
        progress.phase("confirmation of 6", expected=24)
        progress.trial(ok, new_strategy=False)
        assert progress.bar.n == 2 and progress.failed == 0, "a confirmation trial is no new strategy"
        progress.line("round 1: 3 strategies measured")
    assert "autotune: 2/30 strategies" in stream.getvalue() and "confirmation of 6 1/24 trials" in stream.getvalue()
    assert re.search(r"autotune \[ *\d+ s\] round 1: 3 strategies measured\n", stream.getvalue())
    quiet = io.StringIO()
    with AutotuneProgress(30, enabled=False, stream=quiet) as progress:
        progress.phase("round 1", expected=3)
        progress.trial(ok)
        progress.line("round 1: 3 strategies measured")
    assert quiet.getvalue() == ""


@pytest.mark.unit
def test_progress_in_a_log_is_lines_without_bar_redraws():
    """Into a file or a pipe (a cluster job's log) the bar's redraws folded into one line of
    carriage returns, one redraw per trial; there each phase's start and end are a line each."""
    import io
    import types
    from hybridsync.autotune.progress import AutotuneProgress
    log = io.StringIO()  # not a terminal
    with AutotuneProgress(30, stream=log) as progress:
        progress.phase("round 1", expected=3)
        for _ in range(3):
            progress.trial(types.SimpleNamespace(status="ok"))
        progress.line("round 1: 3 strategies measured")
        progress.phase("confirmation of 6", expected=24)
    text = log.getvalue()
    assert "\r" not in text and progress.bar is None, text
    assert re.fullmatch(r"autotune \[ *\d+ s\] round 1: 3 trials \.\.\.\n"
                        r"autotune \[ *\d+ s\] round 1: 3 strategies measured\n"
                        r"autotune \[ *\d+ s\] confirmation of 6: 24 trials \.\.\.\n", text), text


@pytest.mark.unit
def test_a_runoff_job_takes_a_lead_only_if_it_holds_pass_by_pass(tmp_path, capsys):
    from hybridsync.autotune.loop import Autotuner
    from hybridsync.autotune.result import repeats_p
    from hybridsync.description import load_description
    from hybridsync.trials.candidates import Candidate
    from hybridsync.trials.store import TrialStore
    description = load_description(DESCRIPTIONS / "ncf.json")
    fp16 = Strategy.from_dict({"version": 1, "default": {"route": "allreduce", "compression": "fp16"}})
    ps = Strategy.from_dict({"version": 1, "default": {"route": "ps", "compression": "fp16"}})
    lineup = [Candidate(kind="search:top1", strategy=ps), Candidate(kind="baseline:allreduce-fp16", strategy=fp16)]
    lead = {"kind": "search:top1", "step_s": 0.15, "over": "baseline:allreduce-fp16", "p": 0.34}
    drift = np.array([1.0, 1.15, 0.9, 1.1, 0.95, 1.05, 0.85, 1.12])  # +-15% from pass to pass, as within a job

    def runoff(times: dict[str, np.ndarray], elapsed_s: float = 100.0, progress: bool = False):
        tuner = Autotuner(description=description, cluster=CLUSTER, store=TrialStore(str(tmp_path / "t.db")),
                          runner_for=lambda protocol, store: _DriftingJob(store, tuner, times), progress=progress)
        tuner.seconds["confirm"] = 60.0  # 8 kinds x 4 repeats in the confirmation: ~1.9 s a trial
        with tuner.progress:
            return tuner._runoff(lineup * 4, lead, elapsed_s)

    held = {"search:top1": 0.150 * drift, "baseline:allreduce-fp16": 0.156 * drift}  # 4% faster in every pass
    winner, left, found = runoff(held, progress=True)
    assert "runoff: search:top1 1.040x baseline:allreduce-fp16 over 8 passes (p = 0.008): taken\n" in \
        capsys.readouterr().err, "the user sees the runoff's verdict as it ends"
    assert winner.kind == "search:top1" and left is None and found["taken"]
    assert found["ratio"] == pytest.approx(1.04) and found["p"] < 0.01 and len(found["step_s"]["search:top1"]) == 8
    assert repeats_p(*found["step_s"].values()) > RESOLVED_P, "unpaired, the same repeats would not resolve it"
    assert "runoff job, 8 passes: search:top1 1.04x as fast as baseline:allreduce-fp16 (p = 0.008): the lead " \
           "held: taken" in dataclasses.replace(a_result(), runoff=found).verdict()
    alternating = {"search:top1": 0.150 * drift * np.array([0.96, 1.04] * 4), "baseline:allreduce-fp16": 0.152 * drift}
    winner, left, found = runoff(alternating)  # ahead in half the passes, behind in the others
    assert winner.kind == "baseline:allreduce-fp16" and left == lead and not found["taken"] and found["p"] > RESOLVED_P
    even = {"search:top1": 0.15 * drift, "baseline:allreduce-fp16": 0.15 * drift}
    assert runoff(even)[2]["p"] == 1.0, "identical passes: nothing to resolve, not an error"
    winner, left, found = runoff(held, elapsed_s=575.0)  # a pass ~3.75 s: 6 of the 8 passes fit in 600 s
    assert winner.kind == "search:top1" and found["passes"] == 6 and len(found["step_s"]["search:top1"]) == 6
    assert found["p"] == pytest.approx(0.031, abs=1e-3), "six passes one way: the least p that resolves"
    winner, left, found = runoff(held, elapsed_s=580.0)  # 5 passes fit: too few to resolve anything
    assert winner.kind == "baseline:allreduce-fp16" and left == lead
    assert found["skipped"] == "its 6 passes, about 22 s, would pass the 600 s limit" and "no runoff of" in \
        markdown(to_dict(dataclasses.replace(a_result(), runoff=found)))
    for passes in (-1, 5):
        with pytest.raises(ValueError, match="runoff_passes must be 0 .no runoff. or >= 6"):
            AutotuneSettings(runoff_passes=passes)
    for limit in (float("nan"), float("inf"), 0.5):
        with pytest.raises(ValueError, match="time_limit_s must be None .no limit. or a finite number of seconds"):
            AutotuneSettings(time_limit_s=limit)


@pytest.mark.unit
def test_a_model_with_a_dense_embedding_meets_rows_twins_and_the_confirmation_keeps_its_size(tmp_path):
    from hybridsync.autotune.loop import Autotuner, embeddings
    from hybridsync.description import load_description
    from hybridsync.trials.candidates import rival_levers
    from hybridsync.trials.levels import JobLevels
    from hybridsync.trials.store import TrialStore
    sizes = {}
    for model in ("bert", "ncf"):
        description = load_description(DESCRIPTIONS / f"{model}.json")
        tuner = Autotuner(description=description, cluster=CLUSTER, store=TrialStore(str(tmp_path / f"{model}.db")),
                          runner_for=lambda *_: None, progress=False)
        levers = {rival_levers(c.kind) for c in tuner.references}
        assert ({frozenset({"rows"}), frozenset({"rows", "fp16"})} <= levers) == bool(embeddings(description))
        tuner.levels = JobLevels(strategy_s={c.fingerprint: 0.1 + i / 100 for i, c in enumerate(tuner.references)},
                                 jobs={})
        lineup = [c for c in tuner._fastest_references() if c.strategy is not None]
        by_levers = {}
        for candidate in lineup:
            by_levers.setdefault(rival_levers(candidate.kind), []).append(candidate)
        assert set(by_levers) == levers
        assert all(len(group) == (1 if len(by_levers) > 2 else 2) for group in by_levers.values())
        assert len(tuner._fastest_references(extra=1)) > len(tuner._fastest_references())
        sizes[model] = len(lineup)
    assert embeddings(load_description(DESCRIPTIONS / "bert.json")), "bert's profile marks its token embedding"
    assert sizes["bert"] == sizes["ncf"] == 4, "rows twins share the confirmation's places"


@pytest.mark.unit
@pytest.mark.parametrize("where", ["report", "store"])
def test_autotune_fails_at_once_naming_an_unusable_output(tmp_path, capsys, where):
    """A report folder that cannot be made (a traceback before) or a trial store that cannot be
    opened (an error only after profiling before) is a one-line error, exit code 2, before profiling."""
    from hybridsync.cli import run_main
    spec = tmp_path / "cluster.yaml"
    spec.write_text("nodes: 1\nworkers_per_node: 2\ninter_node_bandwidth: 250mbit\nservers_per_node: 1\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    report = a_file / "report" if where == "report" else tmp_path / "report"
    store = tmp_path / "trials.db" if where == "report" else a_file  # a file that is no trial store
    code = run_main(["--autotune", "--cluster", str(spec), "--autotune-report", str(report), "--store", str(store),
                     "-np", "2", "-H", "localhost:2", "--gloo", "python", str(tmp_path / "never_run.py")])
    err = capsys.readouterr().err
    assert code == 2 and "profiling" not in err, err
    assert (f"cannot make the report folder {report}" in err if where == "report"
            else "(--store, or the config's autotune: store:)" in err), err


@pytest.mark.unit
@pytest.mark.parametrize("spec, message", [
    (None, "cannot read the cluster spec {spec}: No such file or directory"),  # a traceback before
    ("nodes: 1\nworkers_per_node: 1\ninter_node_bandwidth: 1gbit\n",
     "the cluster has 1 worker(s); autotuning synchronization needs at least 2"),  # only after profiling before
    ("nodes: 2\nworkers_per_node: [2, 1]\ninter_node_bandwidth: 1gbit\n",
     "got [2, 1] (a spec's nodes hold equal numbers of workers"),
])
def test_autotune_refuses_a_cluster_spec_it_cannot_use_before_profiling(tmp_path, capsys, spec, message):
    """A mistyped spec path, a spec of one worker or of uneven hosts: one line, exit code 2, nothing started."""
    from hybridsync.cli import run_main
    path = tmp_path / "cluster.yaml"
    if spec is not None:
        path.write_text(spec)
    code = run_main(["--autotune", "--cluster", str(path), "--autotune-report", str(tmp_path / "report"),
                     "--store", f"sqlite:///{tmp_path / 'trials.db'}", "-np", "1", "python",
                     str(tmp_path / "never_run.py")])
    err = capsys.readouterr().err
    assert code == 2 and "profiling" not in err and "Traceback" not in err, err
    assert err.startswith("hybridsync-run: error: ") and message.format(spec=path) in err, err


@pytest.mark.emulated
@pytest.mark.skipif(not IS_ROOT, reason="network namespaces and tc need root and iproute2")
@pytest.mark.parametrize("spec, message", [
    ("nodes: 2\nworkers_per_node: 2\ninter_node_bandwidth: 1gbit\ninter_node_latency_ms: 5\n", NETEM_MISSING),
    ("nodes: 40\nworkers_per_node: 2\ninter_node_bandwidth: 1gbit\n", "an emulated cluster of 80 processes"),
])
@pytest.mark.parametrize("command", ["hybridsync-run", "hybridsync search"])
def test_a_spec_this_machine_cannot_emulate_is_refused_before_profiling(tmp_path, capsys, spec, message, command):
    """Latency on a kernel without netem, or more ranks than this machine's cores can run as a cluster,
    were refused only when the emulated cluster was built, after the profile (19 s); now in a second."""
    from hybridsync.cli import run_main
    if message == NETEM_MISSING and netem_available():
        pytest.skip("this kernel has netem: such a spec is emulated")
    path = tmp_path / "cluster.yaml"
    path.write_text(spec)
    workers = str(ClusterSpec.from_yaml(path).num_workers)
    started = time.monotonic()
    if command == "hybridsync-run":
        code = run_main(["--autotune", "--cluster", str(path), "--autotune-report", str(tmp_path / "report"),
                         "--store", f"sqlite:///{tmp_path / 'trials.db'}", "-np", workers, "python",
                         str(tmp_path / "never_run.py")])
    else:
        code = main(["search", "--model", str(tmp_path / "never_profiled.json"), "--cluster", str(path),
                     "--trials", "10", "--output", str(tmp_path / "strategy.json"), "--", "python",
                     str(tmp_path / "never_run.py")])
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 2 and "profiling" not in err and "Traceback" not in err, err
    assert message in err and took < 10, (took, err)
    assert leftovers("hs-netem-") == []


@pytest.mark.unit
def test_the_confirmation_and_the_runoff_leave_no_temporary_folder(tmp_path, monkeypatch):
    """Each autotune left a hybridsync-confirm-* (without a confirm store) and a hybridsync-runoff-*
    folder in /tmp, with its store, for ever; they are read once, then removed."""
    import tempfile
    from hybridsync.autotune import loop
    from hybridsync.description import load_description
    from hybridsync.trials.candidates import Candidate
    from hybridsync.trials.store import TrialStore
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    clock = [0.0]
    settings = AutotuneSettings(trial_budget=14, per_round=4, search_budget=100, calibrate=False)
    tuner = loop.Autotuner(description=load_description(DESCRIPTIONS / "vgg.json"), cluster=CLUSTER,
                           store=TrialStore(str(tmp_path / "t.db")), settings=settings, progress=False,
                           runner_for=lambda protocol, store: _ClockedJobs(store, tuner, clock, per_trial_s=1.0))
    result = tuner.run()
    assert result.confirmed_s and list(scratch.iterdir()) == []
    lineup = [Candidate(kind=kind, strategy=Strategy.from_dict({"version": 1, "default": {"route": route}}))
              for kind, route in (("search:top1", "ps"), ("baseline:allreduce", "allreduce"))]
    times = {"search:top1": [0.15] * 8, "baseline:allreduce": [0.16] * 8}
    tuner.runner_for = lambda protocol, store: _DriftingJob(store, tuner, times)
    tuner.seconds["confirm"] = 8.0
    found = tuner._runoff(lineup, {"kind": "search:top1", "step_s": 0.15, "over": "baseline:allreduce", "p": 0.3},
                          10.0)[2]
    assert found["passes"] == 8 and list(scratch.iterdir()) == []


@pytest.mark.unit
def test_a_budget_the_rivals_fill_says_that_nothing_else_was_measured(tmp_path):
    """A budget of 10 on a model with 10 rivals measured the rivals alone and named a baseline the
    winner without a word on the hand mixes and search strategies it never tried."""
    from hybridsync.autotune import loop
    from hybridsync.description import load_description
    from hybridsync.trials.store import TrialStore

    def autotune(extra: int, name: str):
        clock = [0.0]
        tuner = loop.Autotuner(description=load_description(DESCRIPTIONS / "vgg.json"), cluster=CLUSTER,
                               store=TrialStore(str(tmp_path / name)), progress=False,
                               settings=AutotuneSettings(trial_budget=1, per_round=4, search_budget=100, calibrate=False),
                               runner_for=lambda protocol, store: _ClockedJobs(store, tuner, clock, per_trial_s=1.0))
        tuner.settings = dataclasses.replace(tuner.settings, trial_budget=len(tuner.references) + extra)
        return tuner.run(), len(tuner.references)

    result, rivals = autotune(0, "rivals.db")
    assert not any(t.kind.startswith("search:") for t in result.trials)
    assert result.rivals_only == (f"the trial budget ({rivals}) measures only the {rivals} rivals: no hand-made mix "
                                  f"or search strategy will be; a budget of at least {rivals + 4} measures a round "
                                  "of them")
    assert f"Budget: {result.rivals_only}." in markdown(to_dict(result))
    result, _ = autotune(4, "round.db")
    assert any(t.kind.startswith("search:") for t in result.trials) and result.rivals_only is None
    assert "Budget:" not in markdown(to_dict(result))
