"""``hybridsync-run``: its own flags anywhere before the command, and ``--config-file``'s
``hybridsync:`` section taking effect in a real 2-rank job with parameter servers."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from unittest import mock

import pytest

from conftest import BIN, WORKERS, run_job
from hybridsync.cli import run_main
from hybridsync.run.horovodrun import exec_mpirun_in_place
from hybridsync.run.launcher import _HOROVODRUN_ARITY, LaunchOptions, asks_for_help, split_argv, with_run_config
from hybridsync.strategy import Strategy

TRAIN = ["python", "train.py"]


def horovodrun_parse(argv: list[str]) -> argparse.Namespace:
    """horovodrun's own reading of ``argv`` (an error in it fails the test)."""
    launch = pytest.importorskip("horovod.runner.launch")
    with mock.patch.object(sys, "argv", ["horovodrun", *argv]):
        try:
            return launch.parse_args()
        except SystemExit as e:
            pytest.fail(f"horovodrun rejects {argv}: exit {e.code}")


@pytest.fixture
def strategy_file(tmp_path) -> str:
    path = tmp_path / "s.json"
    Strategy().save(path)
    return str(path)


@pytest.mark.parametrize("argv, horovodrun_argv", [
    # the command: ours after horovodrun's
    (["-np", "2", "-H", "localhost:2", "--num-servers", "2", *TRAIN], ["-np", "2", "-H", "localhost:2", *TRAIN]),
    # before, and between
    (["--num-servers", "2", "-np", "2", "-H", "localhost:2", *TRAIN], ["-np", "2", "-H", "localhost:2", *TRAIN]),
    (["-np", "2", "--num-servers", "2", "-H", "localhost:2", *TRAIN], ["-np", "2", "-H", "localhost:2", *TRAIN]),
    # --flag=value, on both sides, and argparse's attached short value
    (["-np=2", "--num-servers=2", "-H=localhost:2", *TRAIN], ["-np=2", "-H=localhost:2", *TRAIN]),
    (["-np", "2", "-Hlocalhost:2", "--num-servers", "2", *TRAIN], ["-np", "2", "-Hlocalhost:2", *TRAIN]),
    # a horovodrun switch takes no value: "python" after --gloo is the command
    (["-np", "2", "--gloo", "--num-servers", "2", *TRAIN], ["-np", "2", "--gloo", *TRAIN]),
    # a horovodrun value that looks like a command, and one that takes two values
    (["-np", "2", "--output-filename", "python", "--num-servers", "2", *TRAIN],
     ["-np", "2", "--output-filename", "python", *TRAIN]),
    (["-np", "2", "--blacklist-cooldown-range", "60", "300", "--num-servers", "2", *TRAIN],
     ["-np", "2", "--blacklist-cooldown-range", "60", "300", *TRAIN]),
    # abbreviations, as argparse allows them: ours, and horovodrun's (its value is kept with it)
    (["-np", "2", "--num-serv", "2", "--fusion", "32", *TRAIN], ["-np", "2", "--fusion", "32", *TRAIN]),
    # the last of a repeated flag wins
    (["--num-servers", "5", "-np", "2", "--num-servers", "2", *TRAIN], ["-np", "2", *TRAIN]),
])
@pytest.mark.unit
def test_own_flags_anywhere_before_the_command(argv, horovodrun_argv):
    options, rest = split_argv(argv)
    assert options.num_servers == 2
    assert rest == horovodrun_argv
    parsed = horovodrun_parse(rest)
    assert parsed.command == TRAIN and parsed.num_proc == 2


@pytest.mark.unit
def test_all_own_flags_between_horovodrun_flags(strategy_file):
    options, rest = split_argv(["-np", "4", "--strategy", strategy_file, "-H", "localhost:2,127.0.0.1:2",
                                "--server-hosts=localhost,127.0.0.1", "--gloo", "--partition-bytes", "400",
                                "--ps-root-port=4567", *TRAIN])
    assert options == LaunchOptions(strategy=strategy_file, num_servers=2, partition_bytes=400, ps_root_port=4567,
                                    server_hosts=("localhost", "127.0.0.1"))
    assert rest == ["-np", "4", "-H", "localhost:2,127.0.0.1:2", "--gloo", *TRAIN]


@pytest.mark.parametrize("argv", [
    ["-np", "2", "python", "train.py", "--num-servers", "5", "--strategy", "x.json"],
    ["-np", "2", "--", "python", "--num-servers", "5"],  # after "--" everything is the command
    ["-np", "2", "train.sh", "-np", "3", "--num-servers=5"],
])
@pytest.mark.unit
def test_flags_after_the_command_are_the_commands(argv):
    options, rest = split_argv(argv)
    assert options == LaunchOptions()
    assert rest == argv


@pytest.mark.parametrize("argv", [["-np", "2", "--help"], ["-np", "2", "-H", "localhost:2", "-h"], ["--help"], [],
                                  ["--strategy=x.json", "--he", "-np", "2", *TRAIN]])
@pytest.mark.unit
def test_help_among_the_flags_shows_ours_then_horovodruns(argv, capsys):
    pytest.importorskip("horovod.runner.launch")
    assert run_main(argv) == 0
    out = capsys.readouterr().out
    ours, theirs = out.index("hybridsync-run options"), out.index("horovodrun options")
    assert ours < out.index("--strategy PATH") < theirs < out.index("usage: horovodrun") < out.index("--gloo")


@pytest.mark.multiprocess
def test_help_read_in_part_through_a_pipe_is_no_error():
    """``hybridsync-run --help | head -1`` exits 0 and prints no traceback (BrokenPipeError)."""
    import subprocess
    proc = subprocess.Popen([str(BIN / "hybridsync-run"), "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline().startswith(b"hybridsync-run")
        proc.stdout.close()  # the reader is gone before the rest of the help is written
        assert proc.wait(timeout=60) == 0
        assert b"Error" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.unit
def test_help_after_the_command_is_the_commands():
    assert asks_for_help(["-np", "2", "--strategy", "s.json", "-h"])
    assert not asks_for_help(["-np", "2", *TRAIN, "--help"])
    assert not asks_for_help(["-np", "2", "--", "-h"])  # after "--", the command


@pytest.mark.parametrize("argv, message", [
    (["-np", "2", "--num-servers", "-1", *TRAIN], "--num-servers must be >= 0"),  # a negative number is a value
    (["-np", "2", "--strategy", "--gloo", *TRAIN], "--strategy needs a value"),
    (["-np", "2", "--num-servers"], "--num-servers needs a value"),
    (["-np", "2", "--partition-bytes", "many", *TRAIN], "--partition-bytes must be an integer"),
    (["-np", "2", "--s", "x", *TRAIN], "ambiguous option: --s could match --strategy, --server-hosts"),
])
@pytest.mark.unit
def test_bad_own_flags_are_clear_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        split_argv(argv)


@pytest.mark.unit
def test_arity_table_matches_horovodrun():
    """Which horovodrun flags take values (and how many) is read from its own parser."""
    launch = pytest.importorskip("horovod.runner.launch")

    class Captured(Exception):
        pass

    def capture(parser, *args, **kwargs):
        raise Captured(parser)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), \
            pytest.raises(Captured) as captured:
        launch.parse_args()
    parser = captured.value.args[0]
    actual = {option: (1 if action.nargs is None else action.nargs)
              for action in parser._actions for option in action.option_strings}
    assert actual == _HOROVODRUN_ARITY


def write_config(tmp_path: Path, section: str) -> Path:
    path = tmp_path / "cfg" / "run.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"controller: gloo\nparams:\n  fusion_threshold_mb: 32\nhybridsync:\n{section}")
    return path


@pytest.mark.unit
def test_run_config_fills_what_the_command_line_left_unset(tmp_path, capsys):
    (tmp_path / "strategies").mkdir()
    Strategy().save(tmp_path / "strategies" / "s.json")
    config = write_config(tmp_path, "  strategy: ../strategies/s.json\n  num_servers: 2\n  partition_bytes: 1000\n")
    options = with_run_config(LaunchOptions(), str(config))
    assert options == LaunchOptions(strategy=str(tmp_path / "strategies" / "s.json"), num_servers=2,
                                    partition_bytes=1000)
    assert with_run_config(LaunchOptions(), None) == LaunchOptions()
    # the command line wins, and says so when it replaces the config's strategy
    Strategy().save(tmp_path / "mine.json")
    mine = LaunchOptions(strategy=str(tmp_path / "mine.json"), num_servers=0, partition_bytes=5)
    assert with_run_config(mine, str(config)) == mine
    assert "replaces" in capsys.readouterr().err


@pytest.mark.parametrize("section, message", [
    ("  num_servers: -1\n", "hybridsync.num_servers must be an integer >= 0"),
    ("  partition_bytes: true\n", "hybridsync.partition_bytes must be an integer >= 1"),
    ("  strategy: {default: {route: ps}}\n", "hybridsync.strategy must be the path of a strategy file"),
    ("  strategy: absent.json\n", "cannot read strategy file"),
])
@pytest.mark.unit
def test_bad_run_config_sections_are_clear_errors(tmp_path, section, message):
    with pytest.raises(ValueError, match=message):
        with_run_config(LaunchOptions(), str(write_config(tmp_path, section)))


@pytest.mark.unit
def test_config_without_servers_for_a_ps_strategy_is_refused(tmp_path):
    pytest.importorskip("horovod.runner")
    from hybridsync.run.launcher import run
    Strategy.from_dict({"variables": {"emb.weight": {"route": "ps"}}}).save(tmp_path / "cfg.json")
    config = write_config(tmp_path, "  strategy: ../cfg.json\n  num_servers: 0\n")
    with pytest.raises(ValueError, match="routes variables through the parameter server"):
        run(LaunchOptions(), ["-np", "2", "--config-file", str(config), *TRAIN])


@pytest.mark.unit
def test_a_hierarchical_strategy_on_hosts_of_different_sizes_is_refused_before_the_job_starts(tmp_path):
    """Hierarchical all-reduce needs every node to hold as many ranks; on ``-H a:2,b:1`` each rank
    would fail building its optimizer, after start-up, in a traceback per rank: refused up front
    (an all-reduce strategy on the same hosts is not)."""
    pytest.importorskip("horovod.runner")
    from hybridsync.run.launcher import run
    hier = tmp_path / "hier.json"
    Strategy.from_dict({"variables": {"fc.weight": {"route": "allreduce", "algorithm": "hierarchical"}}}).save(hier)
    for hosts in ("localhost:2,127.0.0.1:1", "localhost:2,127.0.0.1:2"):  # mpirun: 3 ranks, 2 + 1 either way
        with pytest.raises(ValueError, match="places the 3 ranks 2 on localhost, 1 on 127.0.0.1.*fc.weight"):
            run(LaunchOptions(strategy=str(hier)), ["-np", "3", "-H", hosts, "--mpi", *TRAIN])
    ring = tmp_path / "ring.json"
    Strategy.from_dict({"variables": {"fc.weight": {"route": "allreduce"}}}).save(ring)
    with mock.patch("hybridsync.run.launcher.procs.start", side_effect=RuntimeError("started")):
        with pytest.raises(RuntimeError, match="started"):
            run(LaunchOptions(strategy=str(ring)), ["-np", "3", "-H", "localhost:2,127.0.0.1:1", *TRAIN])


@pytest.mark.unit
def test_a_strategy_naming_a_server_the_job_does_not_start_is_refused_before_the_job_starts(tmp_path):
    """``servers: [3]`` with one server: each rank failed building its optimizer after start-up,
    in a traceback per rank about DMLC_NUM_SERVER; refused up front, naming the variable and the
    count that would do (servers within the count start the job)."""
    pytest.importorskip("horovod.runner")
    from hybridsync.run.launcher import run
    pinned = tmp_path / "pinned.json"
    Strategy.from_dict({"variables": {"emb.weight": {"route": "ps", "partitions": 2, "servers": [0, 3]},
                                      "fc.weight": {"route": "ps", "servers": [1]}}}).save(pinned)
    for servers in (1, 3):
        with pytest.raises(ValueError, match=f"puts 'emb.weight'.* on server 3, but the job starts {servers} "
                                             f"parameter servers?.*--num-servers.* 4"):
            run(LaunchOptions(strategy=str(pinned), num_servers=servers), ["-np", "2", *TRAIN])
    with mock.patch("hybridsync.run.launcher.start_servers", side_effect=RuntimeError("started")):
        with pytest.raises(RuntimeError, match="started"):
            run(LaunchOptions(strategy=str(pinned), num_servers=4), ["-np", "2", *TRAIN])


@pytest.mark.unit
def test_gloo_hosts_with_more_slots_than_np_are_refused(tmp_path):
    """Horovod 0.28.1's Gloo launcher starts a rank on every ``-H`` slot, ignoring ``-np`` (measured:
    ``-np 2 -H localhost:3`` ran 3 ranks), so the servers, sized for ``-np`` workers, refused the
    job's ranks after start-up. mpirun keeps to ``-np``."""
    pytest.importorskip("horovod.runner")
    from hybridsync.run.launcher import horovodrun_job
    with pytest.raises(ValueError, match="-np 2, but Horovod's Gloo launcher starts a rank on each of the 3 slots"):
        horovodrun_job(["-np", "2", "-H", "localhost:3", "--gloo", *TRAIN])
    (tmp_path / "run.yaml").write_text("controller: gloo\n")
    with pytest.raises(ValueError, match="5 slots \\(3 on localhost, 2 on 127.0.0.1\\)"):
        horovodrun_job(["-np", "3", "-H", "localhost:3,127.0.0.1:2", "--config-file", str(tmp_path / "run.yaml"),
                        *TRAIN])
    job = horovodrun_job(["-np", "2", "-H", "localhost:3", "--mpi", *TRAIN])
    assert job.ranks_per_host == (("localhost", 2),)
    assert horovodrun_job(["-np", "3", "-H", "localhost:2,127.0.0.1:1", "--gloo", *TRAIN]).num_proc == 3


@pytest.mark.unit
def test_no_ranks_is_a_clear_error_at_once():
    pytest.importorskip("horovod.runner")
    from hybridsync.run.launcher import horovodrun_job
    with pytest.raises(ValueError, match="-np 0: a job needs at least one rank"):
        horovodrun_job(["-np", "0", *TRAIN])


@pytest.mark.unit
def test_missing_config_file_is_a_clear_error(tmp_path):
    pytest.importorskip("horovod.runner")
    from hybridsync.run.launcher import horovodrun_job
    with pytest.raises(ValueError, match="cannot read --config-file"):
        horovodrun_job(["-np", "2", "--config-file", str(tmp_path / "absent.yaml"), *TRAIN])


@pytest.mark.multiprocess
def test_config_file_strategy_takes_effect_in_a_real_job(tmp_path):
    """The config's strategy sends emb.weight through 2 parameter servers (which must start);
    ``--partition-bytes`` between horovodrun's flags overrides the config's; horovodrun still
    reads its own sections of the same file (fusion threshold)."""
    pytest.importorskip("horovod.torch")
    strategy = Strategy.from_dict({"default": {"route": "allreduce"},
                                   "variables": {"emb.weight": {"route": "ps", "partitions": 2}}})
    (tmp_path / "strategies").mkdir()
    strategy.save(tmp_path / "strategies" / "ps.json")
    config = write_config(tmp_path, "  strategy: ../strategies/ps.json\n  num_servers: 2\n"
                                    "  partition_bytes: 100000\n")
    out = tmp_path / "report"
    argv = [str(BIN / "hybridsync-run"), "-np", "2", "-H", "localhost:2", "--partition-bytes", "400",
            "--config-file", str(config), sys.executable, str(WORKERS / "report_strategy.py"), str(out)]
    proc = run_job(argv, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    for rank in range(2):
        report = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert report["strategy_fingerprint"] == strategy.fingerprint()
        assert report["routes"] == {"emb.weight": "ps", "fc.weight": "allreduce", "fc.bias": "allreduce"}
        assert report["ps_pushed_bytes"] > 0, "nothing went through the servers"
        assert report["env"] == {"HYBRIDSYNC_STRATEGY": str(tmp_path / "strategies" / "ps.json"),
                                 "DMLC_NUM_SERVER": "2", "BYTEPS_PARTITION_BYTES": "400",
                                 "HOROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024)}


@pytest.mark.multiprocess
def test_servers_no_worker_joined_are_stopped_when_the_job_ends(tmp_path):
    """``--num-servers 1`` beside a job that never routes to the PS: its worker never joins the
    server, which would wait out its join timeout (120 s) and the launcher its grace (60 s) after
    the job. The launcher asks the rendezvous, stops it at once, and leaves no server behind."""
    import psutil
    tag = f"servers-nobody-joined-{tmp_path.name}"
    argv = [str(BIN / "hybridsync-run"), "-np", "1", "-H", "localhost:1", "--num-servers", "1",
            sys.executable, "-c", "import time; time.sleep(1)"]
    started = time.monotonic()
    proc = run_job(argv, timeout=120, env={"HYBRIDSYNC_TEST_TAG": tag})
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert took < 45, f"the launcher waited its servers' grace: {took:.0f} s; its output:\n{proc.stdout[-4000:]}"
    assert "Traceback" not in proc.stdout, proc.stdout[-4000:]

    def tagged(p: psutil.Process) -> list[str] | None:
        """The command line of a process of this job (not one that exits meanwhile)."""
        try:
            return p.cmdline() if p.environ().get("HYBRIDSYNC_TEST_TAG") == tag else None
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None
    left = [command for command in map(tagged, psutil.process_iter()) if command is not None]
    assert left == [], f"processes outlived the job: {left}; its output:\n{proc.stdout[-4000:]}"


@pytest.mark.multiprocess
def test_servers_still_starting_when_the_job_ends_are_stopped_at_once():
    """A short job on a loaded host can end before server 0 hosts the rendezvous store (it imports
    torch first: tens of seconds there). Asked then, the store refused the connection, which counted
    as "cannot tell": the launcher waited out its servers' grace (60 s). Nothing listening means no
    worker joined: it stops them at once. The server here is stopped (SIGSTOP) before it could listen,
    as a starved one would be."""
    from hybridsync.run import launcher, procs
    from hybridsync.run.launcher import _free_port, _stop_servers, start_servers
    from hybridsync.run.ps_servers import ps_environment
    env = {**os.environ, **ps_environment(num_workers=1, num_servers=1, root_uri="127.0.0.1", root_port=_free_port())}
    servers = start_servers(1, env)
    os.kill(servers[0].pid, signal.SIGSTOP)  # it has not imported torch yet, let alone listened
    grace_s = 60.0  # the launcher's
    started = time.monotonic()
    try:
        _stop_servers(servers, grace_s, env)
    finally:
        procs.stop_all(servers)
    took = time.monotonic() - started
    assert servers[0].poll() is not None
    # The settle, asking (the launcher imports the PS client: 3 s, more under load) and the stop's own
    # grace (5 s: SIGTERM waits for SIGCONT, SIGKILL does not).
    assert took < launcher.SERVERS_SETTLE_S + 25 < grace_s, f"the launcher waited its servers' grace: {took:.0f} s"


@pytest.mark.unit
def test_a_taken_ps_root_port_is_refused_before_anything_starts(tmp_path, capsys):
    """``--ps-root-port`` taken by another process (another job's store): server 0's supervisor died
    at once with torch's socket traceback, and the workers waited for its store until their join
    timeout (120 s, a line every 10 s asking whether it hung)."""
    import socket
    strategy = tmp_path / "ps.json"
    strategy.write_text(json.dumps({"version": 1, "default": {"route": "ps"}}))
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert run_main(["-np", "2", "-H", "localhost:2", "--strategy", str(strategy), "--ps-root-port", str(port),
                         "python", "train.py"]) == 2
    assert capsys.readouterr().err == (f"hybridsync-run: error: --ps-root-port {port}: this host cannot listen on it "
                                       "(Address already in use; another job's rendezvous?): choose another port, or "
                                       "leave it unset for a free one\n")


@pytest.mark.multiprocess
def test_a_server_that_fails_while_the_job_runs_stops_the_job(capsys, monkeypatch):
    """A server that exits with an error (its supervisor killed, out of restarts, its port taken
    under a race) left the job's workers waiting for it until their timeouts (120 s for a store no
    one hosts). Now the job goes on for a grace (its ranks' own errors come first), then stops."""
    from hybridsync.run import launcher, procs
    monkeypatch.setattr(launcher, "FAILED_SERVER_GRACE_S", 1.0)
    job = procs.start([sys.executable, "-c", "import time; time.sleep(60)"], capture=False)
    server = procs.start([sys.executable, "-c", "raise SystemExit(3)"], capture=False)
    started = time.monotonic()
    try:
        assert launcher.wait_watching_servers(job, {"parameter server 0": server}) == 1
    finally:
        procs.stop(job), procs.stop(server)
    assert time.monotonic() - started < 15 and job.poll() is not None
    assert capsys.readouterr().err == ("hybridsync-run: error: parameter server 0 exited with status 3 while the job "
                                       "ran (its output above says why); stopping the job\n")
    healthy = procs.start([sys.executable, "-c", "import time; time.sleep(2)"], capture=False)
    done = procs.start([sys.executable, "-c", "pass"], capture=False)  # a server that left: status 0
    assert launcher.wait_watching_servers(healthy, {"parameter server 0": done}) == 0


@pytest.mark.unit
def test_every_launcher_writes_the_ps_vocabulary_the_route_reads():
    """hybridsync-run and the emulated cluster share one writer of the servers' settings; a
    server and a worker read back what it wrote (a misspelt variable would fail here)."""
    import types

    from hybridsync.backends.ps.config import PSConfig
    from hybridsync.run.emulated import ps_env
    from hybridsync.run.launcher import JobShape, job_environment
    from hybridsync.run.ps_servers import server_environment

    options = LaunchOptions(num_servers=2, partition_bytes=4000, ps_root_port=9123)
    launched = job_environment(options, JobShape(num_proc=4, hosts=("localhost",)), 2)
    server = PSConfig.from_env({**launched, **server_environment(1)})
    worker = PSConfig.from_env({**launched, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": "3"})
    for config in (server, worker):
        assert (config.num_workers, config.num_servers, config.root_port, config.partition_bytes) == (4, 2, 9123, 4000)
        assert config.root_uri == "127.0.0.1"
    assert (server.role, server.index, worker.role, worker.index) == ("server", 1, "worker", 3)

    spec = types.SimpleNamespace(num_workers=4, num_servers=2)
    cluster = types.SimpleNamespace(spec=spec, ips=("10.77.0.1", "10.77.0.2"))
    emulated = ps_env(cluster, root_port=9123)  # type: ignore[arg-type]
    assert {k: v for k, v in emulated.items() if k.startswith("DMLC_")} == {
        k: v.replace("127.0.0.1", "10.77.0.1") for k, v in launched.items() if k.startswith("DMLC_")}
    assert PSConfig.from_env({**emulated, **server_environment(0, host="10.77.0.1")}).root_uri == "10.77.0.1"


@pytest.mark.unit
def test_horovodrun_runs_mpirun_in_place_of_its_shell():
    """So that mpirun keeps the parent-death signal (test_hangs: a SIGKILLed hybridsync-run)."""
    calls = []
    execve = exec_mpirun_in_place(lambda path, argv, env: calls.append((path, argv)))
    execve("/bin/sh", ["/bin/sh", "-c", "mpirun --allow-run-as-root -np 2 python x.py"], {})
    execve("/bin/sh", ["/bin/sh", "-c", "A=1 mpirun -np 2 python x.py"], {})  # exec would run "A=1"
    execve("/usr/bin/jsrun", ["jsrun", "-n", "2"], {})
    assert calls == [("/bin/sh", ["/bin/sh", "-c", "exec mpirun --allow-run-as-root -np 2 python x.py"]),
                     ("/bin/sh", ["/bin/sh", "-c", "A=1 mpirun -np 2 python x.py"]),
                     ("/usr/bin/jsrun", ["jsrun", "-n", "2"])]


@pytest.mark.multiprocess
def test_a_store_nobody_listens_at_is_answered_without_importing_torch():
    """The launcher asks whether a worker joined servers whose store is not up (a short job, server 0
    still starting): refused means no, answered before torch's import (3 s on a loaded host), not after."""
    import socket
    import subprocess
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = ("import sys\n"
            "from hybridsync.run.ps_servers import any_worker_joined, ps_environment\n"
            f"env = ps_environment(num_workers=2, num_servers=1, root_uri='127.0.0.1', root_port={port})\n"
            "print(any_worker_joined(env), 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["False", "False"], proc.stdout + proc.stderr
