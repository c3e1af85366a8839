"""Issue 23: never a hang, no orphans, no spinning (2-rank jobs on this host).

Each job is bounded far below CI's timeout; each out-of-step case asserts the error every
rank raised and how soon after the ranks went out of step it came.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import BIN, REPO, WORKERS, launcher_argv, run_job, wait_for
from hybridsync.run import procs

pytestmark = pytest.mark.multiprocess

WORKER = WORKERS / "out_of_step.py"
JOB_TIMEOUT_S = 150
DETECTED_WITHIN_S = 20
"""The watch needs ~5 s (2 s before a wait is published, 3 s unchanged); the rest is load."""
GONE_WITHIN_S = 20
"""After the launcher's SIGKILL: horovodrun's middlemen give a rank 5 s after SIGTERM."""


def rank_records(case: str, tmp_path: Path, launcher: str = "horovodrun", env: dict | None = None,
                 prefix_argv: list[str] | None = None, timeout: float = JOB_TIMEOUT_S) -> list[dict]:
    prefix = tmp_path / case
    argv = (prefix_argv or launcher_argv(launcher)) + [sys.executable, str(WORKER), case, str(prefix)]
    proc = run_job(argv, timeout=timeout, env=env)
    files = [Path(f"{prefix}.rank{r}.json") for r in range(2)]
    assert all(f.exists() for f in files), proc.stdout[-6000:]
    records = [json.loads(f.read_text()) for f in files]
    print(f"{case} ({argv[0].rsplit('/', 1)[-1]}): " + ", ".join(
        f"rank {r}: {record.get('type')} after {record.get('seconds', record.get('seconds_False', 0)):.2f} s"
        for r, record in enumerate(records)))
    return records


@pytest.mark.parametrize("case, where", [
    ("skip_set_strategy", ["rank 0 is in set_strategy() (replacing plan opt0)",
                           "rank 1 is in step 2 of plan opt0", "between the same two steps"]),
    ("freeze_after_build", ["rank 0 is in step 2 of plan opt0, waiting for message 'fc1.bias'",
                            "rank 1 went on past step 2 without sending message 'fc1.bias'"]),
    ("extra_optimizer", ["rank 1 is building a DistributedOptimizer (plan opt1",
                         "rank 0 is in step 2 of plan opt0", "same DistributedOptimizers in the same order"]),
])
def test_ranks_out_of_step_fail_within_seconds_naming_where_each_waits(case, where, tmp_path, launcher):
    records = rank_records(case, tmp_path, launcher)
    for rank, record in enumerate(records):
        assert record["type"] == "RanksOutOfStepError", f"rank {rank}: {record}"
        for text in where:
            assert text in record["message"], f"rank {rank}: {record['message']}"
        assert record["seconds"] < DETECTED_WITHIN_S, f"rank {rank} failed {record['seconds']:.1f} s after"
    assert records[0]["message"] == records[1]["message"]  # one verdict


def test_ranks_out_of_step_on_the_parameter_server_route_fail_within_seconds(tmp_path):
    """Rank 1 waits for the servers' answer to its first push (rank 0 never pushes: it is in
    set_strategy()); the PS client's wait is watched like Horovod's."""
    strategy = tmp_path / "ps.json"
    strategy.write_text(json.dumps({"version": 1, "variables": {"emb.weight": {"route": "ps"}}}))
    records = rank_records("skip_set_strategy", tmp_path, prefix_argv=[
        str(BIN / "hybridsync-run"), "-np", "2", "-H", "localhost:2", "--gloo", "--strategy", str(strategy)])
    for rank, record in enumerate(records):
        assert record["type"] == "RanksOutOfStepError", f"rank {rank}: {record}"
        assert "rank 1 is in step 2 of plan opt0, waiting for message 'emb.weight'" in record["message"]
        assert record["seconds"] < DETECTED_WITHIN_S, f"rank {rank} failed {record['seconds']:.1f} s after"


def test_a_rank_whose_loop_ends_early_on_the_parameter_server_route_fails_the_others_within_seconds(tmp_path):
    """Rank 1 trains two steps fewer (or raises) and exits: on the ring Horovod fails rank 0 at once
    ("Horovod has been shut down"); on the PS route rank 0 waited for rank 1's push forever while
    rank 1's farewell at exit waited for rank 0 to leave (240 s and counting, before). The server
    fails the round at rank 1's goodbye, naming it."""
    strategy = tmp_path / "ps.json"
    strategy.write_text(json.dumps({"version": 1, "default": {"route": "ps", "protocol": "bsp"}}))
    records = rank_records("stop_early", tmp_path, prefix_argv=[
        str(BIN / "hybridsync-run"), "-np", "2", "-H", "localhost:2", "--gloo", "--strategy", str(strategy)])
    assert records[1]["type"] is None, records[1]
    assert records[0]["type"] == "PSServerError", records[0]
    for text in ("worker1 left the job", "while worker0 waited for its push in step 2", "different numbers of steps"):
        assert text in records[0]["message"], records[0]["message"]
    assert records[0]["seconds"] < DETECTED_WITHIN_S, f"rank 0 failed {records[0]['seconds']:.1f} s after"


@pytest.mark.parametrize("gloo", [True, False], ids=["gloo", "mpirun"])
def test_a_rank_whose_code_raises_on_the_parameter_server_route_fails_the_others_within_seconds(gloo, tmp_path):
    """Rank 1's own code raises where rank 0 calls set_strategy() (a Horovod all-gather). Before,
    rank 1's exit handlers said goodbye to the servers first, and that farewell waits for every
    worker to leave, while rank 0 waited for rank 1 in the all-gather: both hung (rank 1 up to the
    farewell's 300 s). Now Horovod shuts down first, as in a job without servers: rank 0 fails at once."""
    strategy = tmp_path / "ps.json"
    strategy.write_text(json.dumps({"version": 1, "default": {"route": "ps", "protocol": "bsp"}}))
    records = rank_records("user_error", tmp_path, prefix_argv=[
        str(BIN / "hybridsync-run"), "-np", "2", "-H", "localhost:2", *(["--gloo"] if gloo else []),
        "--strategy", str(strategy)], timeout=90)
    assert records[1]["type"] == "UserCodeError", records[1]
    assert records[0]["type"] == "HorovodInternalError", records[0]
    assert "Horovod has been shut down" in records[0]["message"], records[0]
    assert records[0]["seconds"] < DETECTED_WITHIN_S, f"rank 0 failed {records[0]['seconds']:.1f} s after"


def test_a_skipped_step_fails_every_rank_within_seconds(tmp_path):
    """The rank that skipped fails at its next zero_grad() (Horovod's check: its gradients are
    still in flight); the other one waits in its step until that rank leaves, then Horovod fails."""
    records = rank_records("skip_step", tmp_path)
    assert records[1]["type"] == "AssertionError", records[1]
    assert "zero_grad() was called after loss.backward() but before optimizer.step()" in records[1]["message"]
    assert records[0]["type"] in ("HorovodInternalError", "RanksOutOfStepError"), records[0]
    assert all(r["seconds"] < DETECTED_WITHIN_S for r in records), records


@pytest.mark.parametrize("route", ["ring", "ps"])
def test_a_sparse_gradient_missing_on_one_rank_is_sent_as_sparse_zeros(route, tmp_path):
    """Rank 1's embedding gets no gradient in the first step: before issue 23 it sent dense zeros
    while rank 0 sent a sparse gradient (ring: both waited forever; PS: the server refused after 46 s)."""
    if route == "ring":
        records = rank_records("sparse_no_gradient", tmp_path)
    else:
        strategy = tmp_path / "ps.json"
        strategy.write_text(json.dumps({"version": 1, "variables": {"emb.weight": {"route": "ps"}}}))
        records = rank_records("sparse_no_gradient", tmp_path, prefix_argv=[
            str(BIN / "hybridsync-run"), "-np", "2", "-H", "localhost:2", "--gloo", "--strategy", str(strategy)])
    for rank, record in enumerate(records):
        assert record["sparse_False"], f"rank {rank}: the gradient went back dense"
        assert record["grad_False"] == record["grad_True"], f"rank {rank}: sparse and sparse_as_dense differ"
        assert any(any(row) for row in record["grad_False"]), "no row was touched: the comparison is vacuous"
        assert record["seconds_False"] < DETECTED_WITHIN_S, record
    assert records[0]["grad_False"] == records[1]["grad_False"]


# --- no orphans, no spinning ---------------------------------------------------------------------------------

def ready_ranks(prefix: Path, timeout: float) -> list[dict]:
    files = [Path(f"{prefix}.rank{r}.ready") for r in range(2)]
    wait_for(lambda: all(f.exists() and f.read_text().endswith("}") for f in files), timeout, "both ranks ready")
    return [json.loads(f.read_text()) for f in files]


def cpu_share(process: psutil.Process, thread: int | None, seconds: float) -> float:
    """Share of one core ``process`` (or one of its threads) used over ``seconds``."""
    def used() -> float:
        if thread is None:
            times = process.cpu_times()
            return times.user + times.system
        return next(t.user_time + t.system_time for t in process.threads() if t.id == thread)
    before, began = used(), time.monotonic()
    time.sleep(seconds)
    return (used() - before) / (time.monotonic() - began)


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def waiting_job(tmp_path: Path, launcher_prefix: list[str], env: dict | None = None):
    """Start the ``rank0_elsewhere`` job; returns (process, prefix, every rank's ready record)."""
    prefix = tmp_path / "elsewhere"
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = procs.start(launcher_prefix + [sys.executable, str(WORKER), "rank0_elsewhere", str(prefix)],
                       env=full_env, cwd=str(REPO), capture=False)
    try:
        ready = ready_ranks(prefix, JOB_TIMEOUT_S)
    except BaseException:
        procs.stop(proc)
        raise
    return proc, prefix, ready


def test_a_waiting_rank_holds_no_core_and_nothing_outlives_a_killed_launcher(tmp_path):
    """hybridsync-run (horovodrun and a PS server under it) SIGKILLed while rank 1 waits for rank 0,
    which is busy elsewhere (not out of step: nobody fails). Before issue 23 horovodrun, both ranks
    and the server lived on, each waiting rank spinning at ~66% of a core."""
    strategy = tmp_path / "s.json"  # one server, used by the last message: rank 1 first waits on the ring
    strategy.write_text(json.dumps({"version": 1, "variables": {"fc2.bias": {"route": "ps"}}}))
    launcher, _, ready = waiting_job(tmp_path, [str(BIN / "hybridsync-run"), "-np", "2", "-H", "localhost:2",
                                                "--gloo", "--strategy", str(strategy)])
    try:
        tree = [launcher.pid] + [p.pid for p in psutil.Process(launcher.pid).children(recursive=True)]
        rank1 = psutil.Process(ready[1]["pid"])
        time.sleep(3)  # rank 1 is in a long wait by now
        thread_share = cpu_share(rank1, ready[1]["thread"], 4)
        process_share = cpu_share(rank1, None, 4)
        (tmp_path / "cpu.json").write_text(json.dumps({"thread": thread_share, "process": process_share}))
        assert thread_share < 0.10, f"the waiting thread used {thread_share:.0%} of a core"
        # the server, its supervisor and the supervisor's standby spare (issue 23 §2)
        servers = [p.pid for p in map(psutil.Process, alive(tree)) if "backends.ps.server" in " ".join(p.cmdline())]
        assert servers and {r["pid"] for r in ready} <= set(tree), (servers, tree)
        os.kill(launcher.pid, signal.SIGKILL)
        killed = time.monotonic()
        launcher.wait(timeout=10)
        wait_for(lambda: not alive(tree), GONE_WITHIN_S, f"every process of the job gone (alive: {alive(tree)})")
        print(f"gone {time.monotonic() - killed:.1f} s after the SIGKILL; waiting rank's thread "
              f"{thread_share:.1%}, process {process_share:.1%} of a core")
    finally:
        procs.stop(launcher, grace=1)
        for pid in alive(tree if "tree" in locals() else []):
            os.kill(pid, signal.SIGKILL)


def shared_memory_files(pids: list[int]) -> set[str]:
    """The files in ``/dev/shm`` that processes ``pids`` map (Open MPI's ``vader_segment.<host>.<jobid>.<rank>``
    transport files, one per rank): this job's only, so that another job running meanwhile does not count."""
    files = set()
    for pid in alive(pids):
        try:
            maps = psutil.Process(pid).memory_maps(grouped=True)
        except psutil.NoSuchProcess:
            continue
        files |= {m.path for m in maps if m.path.startswith("/dev/shm/") and os.path.exists(m.path)}
    return files


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_an_interrupted_hybridsync_run_on_mpirun_leaves_no_process_and_no_shared_memory(sig, tmp_path):
    """Ctrl-C, SIGTERM or SIGKILL to hybridsync-run while its mpirun job runs. Before, on SIGINT/SIGTERM
    the job's process group was SIGKILLed as soon as its leader (the shell horovodrun ran mpirun in)
    was gone, so mpirun could not remove its ranks' shared-memory segments: two 4 MB files left in
    /dev/shm per interrupted job. On SIGKILL the shell died of its parent-death signal and mpirun,
    its child, trained on with its ranks, orphaned."""
    # A child inherits an ignored SIGINT (pytest started in the background, as a CI script may run it),
    # and Python then keeps ignoring it: start hybridsync-run with Ctrl-C's usual disposition.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        launcher, _, ready = waiting_job(tmp_path, [str(BIN / "hybridsync-run"), "-np", "2", "-H", "localhost:2"])
    finally:
        signal.signal(signal.SIGINT, previous)
    tree = [launcher.pid] + [p.pid for p in psutil.Process(launcher.pid).children(recursive=True)]
    segments = shared_memory_files([r["pid"] for r in ready])
    try:
        assert any("vader_segment" in f for f in segments), f"the ranks map no Open MPI segment: {segments}"
        launcher.send_signal(sig)
        stopped = time.monotonic()
        assert launcher.wait(timeout=GONE_WITHIN_S) == (-signal.SIGKILL if sig == signal.SIGKILL else 130)
        wait_for(lambda: not alive(tree), GONE_WITHIN_S, f"every process of the job gone (alive: {alive(tree)})")
        print(f"{signal.Signals(sig).name}: hybridsync-run and its job gone {time.monotonic() - stopped:.1f} s after")
        assert not [f for f in segments if os.path.exists(f)], f"left in /dev/shm: {segments}"
    finally:
        procs.stop(launcher, grace=1)
        for pid in alive(tree):
            os.kill(pid, signal.SIGKILL)
        for path in segments:  # a failed run leaves the suite's machine clean
            if os.path.exists(path):
                os.unlink(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_killed_mpirun_takes_its_ranks_and_the_servers_notice(tmp_path):
    """Plain mpirun with a server started by hand (README: "Parameter servers without hybridsync-run"):
    Open MPI stops its ranks when mpirun dies, and the server exits once its workers are gone."""
    strategy = tmp_path / "s.json"
    strategy.write_text(json.dumps({"version": 1, "variables": {"fc2.bias": {"route": "ps"}}}))
    ps = {"DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
          "DMLC_PS_ROOT_PORT": str(free_port())}
    server = procs.start([sys.executable, "-m", "hybridsync.backends.ps.server"],
                         env={**os.environ, **ps, "PYTHONPATH": str(REPO), "DMLC_ROLE": "server",
                              "DMLC_SERVER_ID": "0"}, capture=True)
    launcher = None
    try:
        argv = launcher_argv("mpirun") + [word for name in (*ps, "HYBRIDSYNC_STRATEGY") for word in ("-x", name)]
        # SIGKILLed ranks cannot unlink their shared-memory segments: keep them out of /dev/shm
        argv += ["--mca", "btl_vader_backing_directory", str(tmp_path)]
        launcher, _, ready = waiting_job(tmp_path, argv, env={**ps, "HYBRIDSYNC_STRATEGY": str(strategy)})
        ranks = [r["pid"] for r in ready]
        os.kill(launcher.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: not alive(ranks), GONE_WITHIN_S, f"the ranks gone after mpirun's SIGKILL ({alive(ranks)})")
        ranks_gone = time.monotonic() - killed
        wait_for(lambda: server.poll() is not None, 30, "the server exits once its workers are gone")
        print(f"ranks gone {ranks_gone:.1f} s, server exited {time.monotonic() - killed:.1f} s after mpirun's SIGKILL")
        assert "stopped answering" in server.stdout.read(), "the server did not say why it left"
    finally:
        if launcher is not None:
            procs.stop(launcher, grace=1)
        procs.stop(server, grace=1)
