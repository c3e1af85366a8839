"""The command line (explain, baseline) and the run configs in horovodrun_configs/."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from conftest import every_help
from hybridsync.cli import main
from hybridsync.run.config import load_run_config
from hybridsync.strategy import Strategy

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "horovodrun_configs").glob("*.yaml"))
MODEL = '{"variables": [{"name": "emb.weight", "shape": [1000, 16], "sparse": true}, ' \
        '{"name": "fc.weight", "shape": [64, 16]}, {"name": "fc.bias", "shape": [64]}]}'


@pytest.mark.unit
def test_explain_with_model(tmp_path, capsys):
    (tmp_path / "m.json").write_text(MODEL)
    Strategy.from_dict({"variables": {"emb.weight": {"route": "ps", "partitions": 4},
                                      "fc.weight": {"route": "allreduce", "group": 1},
                                      "fc.bias": {"route": "allreduce", "group": 1}}}).save(tmp_path / "s.yaml")
    assert main(["explain", str(tmp_path / "s.yaml"), "--model", str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    assert "emb.weight" in out and "62.5 KB" in out
    assert "ps           1 variables     4 messages" in out
    assert "allreduce    2 variables     1 messages" in out
    assert "sent at their full dense size" not in out, "the servers take a sparse gradient's rows in any shape"


@pytest.mark.unit
@pytest.mark.parametrize("config, dense", [
    ({"route": "allreduce"}, False),  # Horovod's all-gather of the touched rows
    ({"route": "allreduce", "compression": "fp16"}, False),
    ({"route": "allreduce", "partitions": 2}, True),
    ({"route": "allreduce", "group": 1}, True),
    ({"route": "allreduce", "algorithm": "hierarchical"}, True),
    ({"route": "ps", "partitions": 2}, False)])
def test_explain_names_the_sparse_gradients_a_strategy_sends_dense(tmp_path, capsys, config, dense):
    """What the router does (``hybridsync.router.runtime``): a sparse gradient partitioned, merged or
    hierarchical on the all-reduce route is made dense for the message."""
    (tmp_path / "m.json").write_text(MODEL)
    variables = {"emb.weight": config, **({"fc.weight": {"group": 1}} if "group" in config else {})}
    Strategy.from_dict({"variables": variables}).save(tmp_path / "s.json")
    assert main(["explain", str(tmp_path / "s.json"), "--model", str(tmp_path / "m.json")]) == 0
    assert ("sparse gradients sent at their full dense size: emb.weight\n" in capsys.readouterr().out) == dense


@pytest.mark.unit
def test_explain_reports_bad_files(tmp_path, capsys):
    (tmp_path / "m.json").write_text(MODEL)
    (tmp_path / "s.json").write_text('{"variables": {"ghost": {"route": "allreduce"}}}')
    assert main(["explain", str(tmp_path / "s.json"), "--model", str(tmp_path / "m.json")]) == 2
    assert "'ghost' is not in the model" in capsys.readouterr().err


@pytest.mark.unit
def test_an_error_names_its_subcommand(tmp_path, capsys):
    """``search`` has a positional ``command`` (the training script): the error still says ``search``."""
    ncf = REPO / "data" / "descriptions" / "ncf.json"
    cluster = tmp_path / "c.yaml"
    cluster.write_text("nodes: 1\nworkers_per_node: 1\ninter_node_bandwidth: 1gbit\n")
    assert main(["search", "--model", str(ncf), "--cluster", str(cluster), "-o", str(tmp_path / "s.json")]) == 2
    assert capsys.readouterr().err.startswith("hybridsync search: error: the cluster has 1 worker(s)")


@pytest.mark.unit
def test_search_refuses_runoff_knobs_that_cannot_work_before_any_trial(tmp_path, capsys):
    ncf = REPO / "data" / "descriptions" / "ncf.json"
    cluster = tmp_path / "c.yaml"
    cluster.write_text("nodes: 2\nworkers_per_node: 1\ninter_node_bandwidth: 1gbit\n")
    search = ["search", "--model", str(ncf), "--cluster", str(cluster), "-o", str(tmp_path / "s.json"),
              "--trials", "10"]
    assert main(search + ["--runoff-passes", "5"]) == 2
    assert "runoff_passes must be 0 (no runoff) or >= 6, the fewest passes that can resolve a lead" in \
        capsys.readouterr().err
    for limit in ("soon", "0", "inf"):
        with pytest.raises(SystemExit):
            main(search + ["--time-limit", limit])
        assert f"--time-limit: must be a number of seconds >= 1 or 'none', got '{limit}'" in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()


@pytest.mark.unit
def test_user_mistakes_are_one_line_each(tmp_path, capsys):
    """A mistake on the command line is one line on stderr, exit status 2: hybridsync-run hands an
    unknown flag to horovodrun's parser, which printed its 40-line usage first and named
    horovodrun; a missing file read as Python's ``[Errno 2] No such file or directory: 'x'``; and
    ``hybridsync cluster``'s errors had no ``error:`` as every other command's have."""
    pytest.importorskip("horovod.runner")
    from hybridsync.cli import run_main
    from hybridsync.run.cluster_cli import main as cluster_main
    absent = tmp_path / "absent.yaml"
    cases = [
        (run_main, ["-np", "2", "--bogus-flag", "python", "-c", "pass"],
         "hybridsync-run: error: unrecognized arguments: --bogus-flag (hybridsync-run --help lists its own "
         "flags and horovodrun's)"),
        (run_main, ["-np", "2", "--config-file", str(absent), "python", "-c", "pass"],
         f"hybridsync-run: error: cannot read --config-file '{absent}': No such file or directory"),
        (main, ["search", "--model", str(REPO / "data" / "descriptions" / "ncf.json"), "--cluster", str(absent),
                "-o", str(tmp_path / "s.json")],
         f"hybridsync search: error: cannot read the cluster spec {absent}: No such file or directory"),
        (cluster_main, ["run", str(absent), "--", "true"],  # the spec is read before anything starts
         f"hybridsync cluster run: error: '{absent}': No such file or directory"),
    ]
    for command, argv, line in cases:
        assert command(argv) == 2, argv
        captured = capsys.readouterr()
        assert (captured.out, captured.err) == ("", line + "\n"), argv


@pytest.mark.unit
@pytest.mark.parametrize("argv, last_line", [
    ([], "hybridsync: error: choose a command: explain, baseline, profile, trials, search, dataset, syncswitch, "
         "cluster"),
    (["--verbose"], "hybridsync: error: unrecognized arguments: --verbose"),
    (["trials"], "hybridsync trials: error: choose a command: run, list, sweep"),
    (["dataset", "--x"], "hybridsync dataset: error: unrecognized arguments: --x"),
    (["search", "--modle", "ncf", "--cluster", "c.yaml", "-o", "s.json"],
     "hybridsync search: error: unrecognized arguments: --modle"),
    (["search", "--mod", "ncf", "-oout.json"], "hybridsync search: error: the following arguments are required: "
                                               "--cluster"),  # an abbreviation and a glued value are known flags
    (["cluster", "--bogus"], "hybridsync cluster: error: unrecognized arguments: --bogus"),
])
def test_a_mistyped_flag_or_missing_command_is_named(argv, last_line, capsys):
    """argparse reports missing required arguments before unknown ones, so ``hybridsync --verbose``
    said "the following arguments are required: subcommand" (an internal name), and a typo in a
    search flag listed the required flags instead of the typo."""
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == last_line


@pytest.mark.unit
def test_hybridsync_run_passes_horovodruns_version_answer_through(capsys):
    """``--version`` is horovodrun's to answer (status 0), not a mistake to report."""
    horovod = pytest.importorskip("horovod")
    from hybridsync.cli import run_main
    with pytest.raises(SystemExit) as exit:
        run_main(["-np", "1", "--version", "python", "-c", "pass"])
    assert not exit.value.code and capsys.readouterr().out.strip() == horovod.__version__


@pytest.mark.unit
def test_hybridsync_run_help_states_the_defaults_the_code_uses():
    """hybridsync-run's own options are a hand-written table (its flags sit among horovodrun's): the
    defaults it states must be the constants the launcher and the autotuner use."""
    from hybridsync.autotune.launch import DEFAULT_REPORT_DIR, DEFAULT_TRIAL_BUDGET
    from hybridsync.placement import DEFAULT_PARTITION_BYTES
    from hybridsync.run.launcher import usage
    from hybridsync.trials.store import DEFAULT_STORE

    own = usage().split("horovodrun options")[0]  # its own section, before horovodrun's help
    stated = dict(re.findall(r"^  (--[\w-]+) .*\(default ([^):][^)]*)\)$", own, flags=re.MULTILINE))
    assert stated == {"--partition-bytes": str(DEFAULT_PARTITION_BYTES), "--trial-budget": str(DEFAULT_TRIAL_BUDGET),
                      "--store": DEFAULT_STORE, "--autotune-report": DEFAULT_REPORT_DIR}


@pytest.mark.unit
def test_baseline_writes_a_loadable_strategy(tmp_path, capsys):
    (tmp_path / "m.json").write_text(MODEL)
    out = tmp_path / "strategies" / "p.json"  # a folder not made yet: made
    assert main(["baseline", "parallax", "--model", str(tmp_path / "m.json"), "--num-servers", "2",
                 "-o", str(out)]) == 0
    assert Strategy.load(out).config_for("emb.weight").route == "ps"
    assert main(["baseline", "horovod-hierarchical-rows-fp16", "--model", str(tmp_path / "m.json"),
                 "--rows", "fc.weight", "-o", str(out)]) == 0  # fc.weight stands for a dense embedding
    twin = Strategy.load(out)
    assert twin.config_for("fc.weight").rows and twin.config_for("fc.bias").compression == "fp16"
    assert main(["baseline", "parallax-rows", "--model", str(tmp_path / "m.json"), "-o", str(out)]) == 2
    assert "a rows twin sends the dense embeddings named by --rows" in capsys.readouterr().err


@pytest.mark.unit
def test_baseline_help_says_what_each_baseline_is(capsys):
    """The choices alone are 19 names: the help gives each builder a line, in plain text, and names the
    twins; a wrong name still lists every choice."""
    from hybridsync import baselines
    with pytest.raises(SystemExit):
        main(["baseline", "--help"])
    help_text = capsys.readouterr().out
    for name in baselines.BUILDERS:
        assert f"\n  {name} " in help_text, name
    assert "``" not in help_text and "<name>-rows-fp16" in help_text
    with pytest.raises(SystemExit):
        main(["baseline", "parallax-typo", "--model", "ncf", "-o", "x.json"])
    assert "invalid choice: 'parallax-typo'" in capsys.readouterr().err


@pytest.mark.unit
def test_every_help_is_plain_text(capsys):
    """What ``--help`` prints is for users: no reStructuredText markup from a module docstring."""
    from hybridsync.backends.ps import server
    texts = every_help()
    if importlib.util.find_spec("torch") is not None:  # the zoo's trainer, a command the zoo guide shows
        from hybridsync.zoo import train
        texts["python -m hybridsync.zoo.train"] = train.build_parser().format_help()
    with pytest.raises(SystemExit):
        server.main(["--help"])
    texts["hybridsync-server"] = capsys.readouterr().out
    assert len(texts) > 20
    for prog, text in texts.items():
        assert "``" not in text, prog

@pytest.mark.multiprocess
def test_console_script_runs():
    proc = subprocess.run([str(Path(sys.executable).parent / "hybridsync"), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "explain" in proc.stdout


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
@pytest.mark.unit
def test_run_config_loads_in_horovodrun_and_hybridsync(path):
    from horovod.runner import launch
    argv = ["horovodrun", "-np", "2", "--config-file", str(path), "python", "train.py"]
    with mock.patch.object(sys, "argv", argv):
        args = launch.parse_args()  # horovodrun's own parser: the hybridsync section must not upset it
    assert args.fusion_threshold_mb is not None
    config = load_run_config(path)
    assert config.strategy_path is not None or config.cluster is not None
    assert config.strategy_path is None or config.load_strategy() is not None


@pytest.mark.unit
def test_run_config_rejects_unknown_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("hybridsync:\n  strategy: s.json\n  stratgey: typo\n")
    with pytest.raises(ValueError, match="unknown key\\(s\\) in 'hybridsync': stratgey"):
        load_run_config(path)


@pytest.mark.multiprocess
def test_import_works_without_horovod():
    code = ("import sys; sys.modules['horovod'] = None; sys.modules['horovod.torch'] = None\n"
            "import hybridsync as hs, hybridsync.baselines, hybridsync.explain\n"
            "assert hs.Strategy().fingerprint()\n"
            "try:\n    hs.init()\nexcept ImportError as e:\n    print('clear:', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "hybridsync.init needs horovod.torch" in proc.stdout


@pytest.mark.multiprocess
def test_cluster_subcommand_is_wired():
    proc = subprocess.run([str(Path(sys.executable).parent / "hybridsync"), "cluster", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "up" in proc.stdout and "down" in proc.stdout


@pytest.mark.unit
def test_hybridsync_run_splits_its_own_flags(tmp_path):
    from hybridsync.run.launcher import split_argv
    Strategy().save(tmp_path / "s.json")
    options, rest = split_argv(["--strategy", str(tmp_path / "s.json"), "--num-servers=2", "-np", "2",
                                "python", "train.py", "--strategy", "not-ours"])
    assert options.strategy == str(tmp_path / "s.json") and options.num_servers == 2
    assert rest == ["-np", "2", "python", "train.py", "--strategy", "not-ours"]
    with pytest.raises(ValueError, match="--num-servers must be >= 0"):
        split_argv(["--num-servers", "-1", "-np", "2", "python"])
    with pytest.raises(ValueError, match="cannot read strategy file"):
        split_argv(["--strategy", str(tmp_path / "absent.json"), "-np", "2", "python"])


@pytest.mark.unit
def test_hybridsync_run_reads_the_job_shape_and_picks_a_reachable_rendezvous():
    pytest.importorskip("horovod.runner")
    from hybridsync.run.launcher import horovodrun_job, rendezvous_address
    job = horovodrun_job(["-np", "4", "-H", "localhost:2,127.0.0.1:2", "python", "train.py"])
    assert (job.num_proc, job.hosts) == (4, ("localhost", "127.0.0.1"))
    assert horovodrun_job(["-np", "2", "python", "train.py"]).hosts == ()
    assert rendezvous_address(job.hosts) == "127.0.0.1"  # every rank on this host
    # a worker on another host cannot dial this host's loopback: use the address facing it
    assert not rendezvous_address(["localhost", "192.0.2.7"]).startswith("127.")
    with pytest.raises(ValueError, match="no training command"):
        horovodrun_job(["-np", "2"])


@pytest.mark.unit
def test_hybridsync_run_places_servers_with_the_workers_or_where_told():
    pytest.importorskip("horovod.runner")
    from hybridsync.run.launcher import JobShape, LaunchOptions, job_environment, server_placement, split_argv
    local = JobShape(num_proc=2, hosts=("localhost",))
    assert server_placement(LaunchOptions(), local, 2) is None  # all here: plain child processes
    spread = JobShape(num_proc=4, hosts=("localhost", "192.0.2.7"))
    # colocated, round-robin, grouped host by host as horovodrun numbers its ranks
    assert server_placement(LaunchOptions(), spread, 3) == ("localhost", "localhost", "192.0.2.7")
    told = LaunchOptions(server_hosts=("192.0.2.8", "localhost", "192.0.2.8"))
    placement = server_placement(told, spread, 3)
    assert placement == ("192.0.2.8", "192.0.2.8", "localhost")
    assert job_environment(told, spread, 3, placement)["DMLC_PS_ROOT_URI"] == "192.0.2.8"  # server 0's host
    options, _ = split_argv(["--server-hosts", "a,b", "-np", "2", "python"])
    assert (options.server_hosts, options.num_servers) == (("a", "b"), 2)
    with pytest.raises(ValueError, match="--num-servers 3 but --server-hosts names 2"):
        split_argv(["--num-servers", "3", "--server-hosts", "a,b", "-np", "2", "python"])


@pytest.mark.unit
@pytest.mark.parametrize("command", ["run", "sweep"])
def test_trials_settle_is_a_flag_and_defaults_to_the_protocols(command):
    """``trials run`` and ``trials sweep`` waited ``TrialProtocol.settle_s`` (6 s) in every job, with no
    way to ask for less (a quick check, a test); ``--settle-s`` sets it, and unset leaves the
    protocol's default. A negative wait is refused, as the protocol refuses it."""
    from hybridsync.cli import build_parser
    from hybridsync.trials.cli import trial_protocol
    from hybridsync.trials.runner import TrialProtocol
    inputs = (["--model", "ncf", "--cluster", "c.yaml"] if command == "run"
              else ["--models", "ncf", "--clusters", "c.yaml"])
    parse = build_parser().parse_args
    assert trial_protocol(parse(["trials", command, *inputs])).settle_s == TrialProtocol().settle_s == 6.0
    assert trial_protocol(parse(["trials", command, *inputs, "--settle-s", "0.5", "--steps", "3"])) == \
        TrialProtocol(warmup_steps=10, timed_steps=3, trial_timeout_s=180.0, settle_s=0.5)
    with pytest.raises(ValueError, match="settle_s >= 0"):
        trial_protocol(parse(["trials", command, *inputs, "--settle-s", "-1"]))
